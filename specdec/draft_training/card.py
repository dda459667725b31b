"""Write the draft's model card from the figures the pipeline measured (nothing typed in)."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.engine.token_map import read_token_map

# What the evaluation's held-out sets are, under its heading.
HELD_OUT_SETS = ("Held-out prompts: hand-written, everyday single- and multi-turn "
                 "conversations that no generator made (advice, explanation, how-to, story, "
                 "code, comparison, rewriting, lists; "
                 "`specdec/draft_training/handwritten_heldout.jsonl`); templated and wide, the "
                 "held-out split of the project's prompt generators. No training context "
                 "holds either.")


def _row(result: dict) -> str:
    greedy = result.get("greedy_matches_target")
    check = "" if greedy is None else ("yes" if greedy else "NO")
    return (f"| {result.get('prompt_set', 'templated')} | {result['temperature']:g} | "
            f"{result['gamma']} | {result['alpha']:.3f} | "
            f"{result['acceptance_rate']:.3f} | {result['mean_accepted_length']:.2f} | "
            f"{result['draft_tokens']} | {check} |")


def write_model_card(out_dir: Path, work_dir: Path) -> None:
    config = json.loads((out_dir / "config.json").read_text())
    token_map = read_token_map(out_dir)
    summary = json.loads((work_dir / "train_summary.json").read_text())
    report = json.loads((work_dir / "eval_report.json").read_text())
    lines = [
        "# specdec-draft: a distilled draft for SmolLM2-135M-Instruct",
        "",
        "The default draft model of specdec, trained by `specdec train-draft` on the target's "
        "own outputs. Every figure below was written by that pipeline "
        "(`specdec train-draft card`) from its training summary and evaluation report.",
        "",
        "## Architecture",
        f"- Llama, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} KV heads), "
        f"intermediate {config['intermediate_size']}, tied embeddings.",
        f"- Reduced vocabulary: {len(token_map)} target tokens (the ones carrying the most of "
        "the target's probability mass in the training data) plus one UNK input row. "
        "`token_map.json` maps draft rows to target ids; the draft proposes only mapped "
        "tokens, so q is 0 elsewhere and speculative sampling stays exact.",
        f"- Parameters: {summary['parameters']:,}.",
        *_initialisation_lines(summary),
        "",
        "## Training data",
        *_training_lines(summary),
        "",
        *_evaluation_lines(report),
        "## Reproduce",
        "```",
        *_reproduce_lines(summary),
        "specdec train-draft eval card  # re-measure the committed draft",
        "```",
    ]
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def _reproduce_lines(summary: dict) -> list[str]:
    if not summary.get("init_draft"):
        return ["specdec train-draft            # data, train, eval, card; resumable"]
    temperatures = ",".join(summary.get("temperatures", {"0": 1}))
    dtypes = summary.get("dtypes", {"float32": 1})
    dtype = next(iter(dtypes))
    shards = summary.get("shards", {})
    batch_size = summary["sequences"] // max(1, sum(shards.values()))  # every shard is full
    mixed = []
    if len(dtypes) > 1:  # --data-dtype takes one dtype for every shard
        counts = ", ".join(f"{count} in {name}" for name, count in dtypes.items())
        mixed = [f"# its shards were generated in more than one dtype ({counts}); "
                 f"this command generates all of them in {dtype}"]
    return [
        "# stage 1: the starting draft's own recipe (its card), into another work dir",
        "# stage 2 (the sampled text differs with --data-seed, not in kind):",
        *mixed,
        "specdec train-draft --work-dir WORK2 --init-draft STAGE1_DRAFT "
        f"--data-dtype {dtype} --data-temperatures {temperatures} "
        f"--batch-size {batch_size} --max-shards {shards.get('shard', 0)} "
        f"--wide-shards {shards.get('wide', 0)} "
        f"--epochs {summary.get('epochs', 3):g} --lr {summary.get('lr', 5e-4):g}",
    ]


def _initialisation_lines(summary: dict) -> list[str]:
    if summary.get("init_draft"):
        return ["- Initialisation: the previous specdec-draft (its weights and token map; how it "
                "was trained is under Training data, stage 1); then distilled further with "
                "the same KL loss on new data (stage 2)."]
    return ["- Initialisation: the target's embeddings (restricted to the map), first layers "
            "and final norm; then distilled with a KL loss to the target's top-16 "
            "distribution."]


def _training_lines(summary: dict) -> list[str]:
    temperatures = summary.get("temperatures", {"0": 1, "1": 1})
    dtypes = summary.get("dtypes", {"float32": 1})
    total = sum(temperatures.values())
    decoding = ", ".join(
        f"{count}/{total} shards {'greedy' if float(t) == 0 else f'sampled at T={t}'}"
        for t, count in temperatures.items())
    this_run = [
        f"- {summary['sequences']:,} continuations, {summary['tokens']:,} target tokens, "
        f"generated by SmolLM2-135M-Instruct ({', '.join(dtypes)}) on the project's prompt "
        "sets: " + _shards_text(summary.get("shards", {"shard": None})) + f"; {decoding}.",
        f"- {summary['steps']:,} optimiser steps of 16 sequences (peak learning rate "
        f"{summary.get('lr', 5e-4):g}); the last training run took "
        f"{summary['train_s'] / 60:.1f} min on 2 CPU cores"
        + (f" (resumed at step {summary['resumed_from_step']:,})"
           if summary.get("resumed_from_step") else
           " (runs resume from checkpoints: this may be the last part only)")
        + "; final loss (cross-entropy to the target's top-k) "
        f"{summary['final_loss']:.3f}.",
    ]
    if not summary.get("init_draft"):
        return this_run
    previous = summary.get("init_card") or ["- (the starting draft had no model card)"]
    return ["Stage 1, the draft this one continues (from its model card):", "",
            *previous, "", "Stage 2, this run:", "", *this_run]


def _evaluation_lines(report: dict) -> list[str]:
    t_target = {int(k): v for k, v in report["t_target_ms"].items()}
    bounds = {int(k): v for k, v in report["bound_by_gamma_greedy"].items()}
    return [
        f"## Evaluation ({report['num_prompts']} held-out prompts of each set, up to "
        f"{report['max_new_tokens']} new tokens, target in fp32, "
        f"{report['threads']} threads)",
        HELD_OUT_SETS,
        "alpha = accepted / (accepted + rejections), the per-token acceptance probability; "
        "acceptance rate = accepted / drafted (vLLM's); mean accepted length includes the "
        "bonus/correction token.",
        "",
        "| held-out prompts | T | gamma | alpha | acceptance rate | mean accepted length | "
        "draft tokens | greedy == target |",
        "|---|---|---|---|---|---|---|---|",
        *(_row(result) for result in report["acceptance"]),
        "",
        "## Costs (median warm-cache forward, ms)",
        f"- T_draft(1) = {report['t_draft_1_ms']:.1f} ms; c = T_draft(1)/T_target(1) = "
        f"{report['c']:.3f}",
        "- T_target(k): "
        + ", ".join(f"k={k}: {v:.1f}" for k, v in sorted(t_target.items())),
        "- Speedup bound S(gamma) at T=0 (docs/design.md, measured costs): "
        + ", ".join(f"{g}: {b:.2f}x" for g, b in sorted(bounds.items())),
        f"- Best gamma {report['best_gamma']}: bound {report['best_bound']:.2f}x over "
        "target-only.",
        "",
    ]


def write_feature_model_card(out_dir: Path, work_dir: Path) -> None:
    config = json.loads((out_dir / "config.json").read_text())
    token_map = read_token_map(out_dir)
    summary = json.loads((work_dir / "feature_train_summary.json").read_text())
    report = json.loads((work_dir / "feature_eval_report.json").read_text())
    lines = [
        "# specdec-feature-draft: a draft that reads SmolLM2-135M-Instruct's hidden states",
        "",
        "An EAGLE-style draft (`specdec/engine/feature_draft.py`), trained by `specdec "
        "train-feature-draft` on the target's own outputs and hidden states. Every figure "
        "below was written by that pipeline from its training summary and evaluation report.",
        "",
        "## Architecture",
        f"- Input at position p: a linear map of [embedding(x_p); h_(p-1)] "
        f"({config['hidden_size']} + {config['specdec_target_hidden_size']} -> "
        f"{config['hidden_size']}), where h is the target's final-norm hidden state (the "
        "draft's own output state at positions it drafted itself); then "
        f"{config['num_hidden_layers']} Llama layer(s) ({config['num_attention_heads']} heads, "
        f"{config['num_key_value_heads']} KV heads, intermediate "
        f"{config['intermediate_size']}) and the final norm.",
        f"- Reduced vocabulary: {len(token_map)} target tokens plus one UNK input row "
        "(`token_map.json`, the same map as specdec-draft); q is 0 elsewhere, so speculative "
        "sampling stays exact.",
        f"- Parameters: {summary['parameters']:,}, of which {summary['trained_parameters']:,} "
        "trained (the embeddings and the tied LM head stay frozen).",
        *_feature_init_lines(summary),
        "",
        "## Training data and objective",
        f"- {summary['sequences']:,} continuations, {summary['tokens']:,} target tokens from "
        "the distillation shards of `specdec train-draft` ("
        + _shards_text(summary.get("shards", {"shard": None}))
        + "), each with the target's hidden states at every position (fp32 target, stored "
        "in float16).",
        "- Loss: cross-entropy to the target's top-16 distribution of the next token, plus "
        "smooth L1 between the draft's output state and the target's state at the same "
        "position (so that drafting a second token from its own state works).",
        f"- {summary['steps']:,} optimiser steps of 16 sequences (peak learning rate "
        f"{summary.get('lr', 0):g}, regression weight {summary.get('regression_weight', 1):g}); "
        f"the last training run took {summary['train_s'] / 60:.1f} min on 2 CPU cores"
        + (f" (resumed at step {summary['resumed_from_step']:,})"
           if summary.get("resumed_from_step") else "")
        + f"; final cross-entropy {summary['final_cross_entropy']:.3f}, regression "
        f"{summary['final_regression']:.3f}.",
        "",
        *_evaluation_lines(report),
        "The first round of each request is target-only (the draft needs the target's states "
        "of the prompt); the evaluation's figures include it.",
        "",
        "## Reproduce",
        "```",
        "specdec train-feature-draft            # data, hidden, train, eval, card; resumable",
        "specdec train-feature-draft eval card  # re-measure the committed draft",
        "```",
    ]
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def _feature_init_lines(summary: dict) -> list[str]:
    return ["- Initialisation: specdec-draft (the token-only draft: its embeddings, layers "
            "and final norm), with the input map set to [identity | 0], so training starts "
            "from exactly that draft and learns what the target's states add. The states "
            "enter scaled to the embeddings' RMS (`specdec_target_hidden_scale` in "
            "config.json): at their own scale (row norm ~46 against ~2.8) the first updates "
            "of the zero path swamped the embeddings."]


def _shards_text(shards: dict[str, int | None]) -> str:
    from specdec.draft_training.datagen import PROMPT_SETS

    # Shard prefix -> its prompt set and the module that generates it.
    names = {prefix: f"the {name} set (`{generate.__module__.replace('.', '/')}.py`)"
             for name, (prefix, generate) in PROMPT_SETS.items()}
    return ", ".join(f"{names.get(prefix, prefix)}" + (f", {count} shards" if count else "")
                     for prefix, count in shards.items())


# Lines of a streamed draft's card that a run continuing its curve replaces.
STREAM_STAGE = "Streaming stage (`specdec train-draft --stream`), continuing the draft above:"
CURVE_HEADING = "## Held-out curve (streaming stage)"
STREAM_COMMAND = "# streaming stage, from the draft above:"
REMEASURE = "specdec train-draft eval --out-dir DRAFT"


def stream_command(settings: dict) -> str:
    """The `specdec train-draft --stream` line that reproduces a run's settings."""
    flags = [("--device", settings.get("device", "cpu")), ("--producer", settings["producer"]),
             ("--stream-produce-batch", settings["produce_batch"]),
             ("--stream-train-batch", settings["train_batch"]),
             ("--stream-passes", settings["passes"]), ("--stream-lr", f"{settings['lr']:g}"),
             *([("--stream-mix", ",".join(f"{w:g}" for w in settings["mix"]))]
               if "mix" in settings else []),
             ("--stream-checkpoint-every-s", f"{settings['checkpoint_every_s']:g}"),
             ("--time-budget-min", f"{settings['time_budget_s'] / 60:g}")]
    return "specdec train-draft --stream " + " ".join(f"{flag} {value}" for flag, value in flags)


def write_stream_card(out_dir: Path, init_card: Path, summary: dict,
                      reports: tuple[dict, dict] | None = None) -> None:
    """The card of a draft continued by streaming self-distillation: the starting draft's
    card with this stage added to its training data, its held-out curve (the plot next
    to the card) and its evaluation table marked as the starting draft's. With `reports`
    (evaluate.evaluate of this draft and of the starting draft, measured in one run) the
    evaluation is the two side by side instead; the costs stay the starting draft's (the
    stage keeps the architecture). Where the run continued the starting draft's own
    streaming curve (summary["continued_from"]), this stage's block, curve section and
    command replace the starting card's."""
    from specdec.draft_training.heldout import GENERATED, PLOT_FILE, handwritten_held_out

    lines = init_card.read_text().splitlines()
    progress, settings, curve = summary["progress"], summary["settings"], summary["curve"]
    last = curve[-1]
    # The first point of each held-out set: points from before the hand-written set
    # hold the prompt sets' figures only (heldout.read_curve).
    first = next(point for point in curve if "top1_agreement" in point)
    first_generated = next((point for point in curve if GENERATED in point), last)
    since = summary.get("continued_from") or {}
    # Counters the continued point lacks start at the resumption.
    contexts = (f"in {progress['records']:,} contexts" if not since or "records" in since
                else f"({progress['tokens'] - since['tokens']:,} of them since the "
                f"resumption, in {progress['records']:,} contexts)")
    minutes = f"{progress['elapsed_s'] / 60:.1f} min" + (
        "" if not since or "elapsed_s" in since else " since the resumption")
    kinds = summary.get("produced_by_kind", {})
    total = max(1, sum(kinds.values()))
    mix = ", ".join(f"{kind} {count / total:.0%}" for kind, count in sorted(kinds.items()))
    user_like = (kinds.get("magpie", 0) + kinds.get("multi-turn", 0)) / total
    temperatures = ", ".join(f"{t:g}" for t in settings["temperatures"])
    stage = [
        "",
        STREAM_STAGE,
        "",
        *([f"- Resumed from the committed draft at {since['tokens']:,} tokens, step "
           f"{since['step']:,} (its bfloat16 weights and this curve; the optimiser state "
           "started fresh)."] if since else []),
        f"- {progress['tokens']:,} target-labelled tokens {contexts}, written by the "
        f"{settings['producer']} producer and labelled by "
        f"{summary.get('target', 'the target')} (bfloat16) with its top-"
        f"{settings['top_k']} distribution; contexts: {mix}, user-like (magpie + multi-turn) "
        f"{user_like:.0%} (labelled tokens); temperatures {temperatures} in turn.",
        f"- {progress['step']:,} optimiser steps of {settings['train_batch']} contexts (peak "
        f"learning rate {settings['lr']:g}, each context used at most {settings['passes']} "
        f"times), {minutes} on "
        f"{summary.get('device_name', '2 shared CPU cores')} "
        f"({summary['tokens_per_s_this_run']:.0f} labelled tokens/s in the last run).",
        *([f"- User turns the target wrote in the last run: {summary['written_turns']:,} "
            f"kept, {summary['dropped_written_turns']:,} refused (cut short, empty or "
            f"held-out text), {summary['near_duplicate_turns']:,} dropped as "
            "near-duplicates of a recent one (word 3-gram Jaccard similarity)."]
          if "near_duplicate_turns" in summary else []),
        f"- Command: `{stream_command(settings)}`.",
    ]
    count = settings["held_out_prompts"]
    generated = ([f"On {count} held-out prompts of the project's prompt sets "
                  f"({last[GENERATED]['positions']} positions): top-1 agreement "
                  f"{first_generated[GENERATED]['top1_agreement']:.3f} -> "
                  f"{last[GENERATED]['top1_agreement']:.3f}, sum min(p, q) "
                  f"{first_generated[GENERATED]['expected_acceptance']:.3f} -> "
                  f"{last[GENERATED]['expected_acceptance']:.3f} over "
                  f"{last['tokens'] - first_generated['tokens']:,} labelled tokens.", ""]
                 if GENERATED in last else [])
    span = (f"over {last['tokens']:,} labelled tokens (`stream_curve.json` beside this card)"
            if first["tokens"] == 0 else
            f"from {first['tokens']:,} to {last['tokens']:,} labelled tokens "
            "(`stream_curve.json` beside this card; its earlier points measured the prompt "
            "sets only)")
    curve_lines = [
        CURVE_HEADING,
        f"Teacher-forced on the target's greedy answers to "
        f"{min(count, len(handwritten_held_out()))} hand-written everyday conversations "
        f"(`specdec/draft_training/handwritten_heldout.jsonl`; {last['positions']} "
        f"positions): top-1 agreement {first['top1_agreement']:.3f} -> "
        f"{last['top1_agreement']:.3f}, expected T=1 acceptance sum min(p, q) "
        f"{first['expected_acceptance']:.3f} -> {last['expected_acceptance']:.3f} {span}.",
        "",
        *generated,
        f"![held-out acceptance against training tokens]({PLOT_FILE})",
        "",
    ]
    out: list[str] = []
    section = ""  # the "## " heading the line is under
    dropping = False  # in a part of the starting card that this stage's lines replace
    skip = 0  # lines of the starting card's stream command still to drop
    for line in lines:
        if line.startswith("## "):
            if section == "## Training data":
                while out and not out[-1].strip():
                    out.pop()
                out += stage + [""]
            section = line
            dropping = False
        if since and (line == STREAM_STAGE or section == CURVE_HEADING):
            dropping = True  # to the section's end: the stage so far, which this run covers
        if since and line == STREAM_COMMAND:
            skip = 2  # the comment and the command
        if dropping or skip:
            skip = max(0, skip - 1)
            continue
        if reports is not None and section.startswith("## Evaluation"):
            if line == section:
                out += curve_lines + _comparison_lines(*reports)
            continue  # the starting draft's table, measured in another run
        if since and section.startswith("## Evaluation"):
            line = line.replace("Starting draft -> this draft.",
                                f"Starting draft -> the draft at {since['tokens']:,} tokens.")
        if line.startswith("## Evaluation"):
            out += curve_lines
            if "before the streaming stage" not in line:
                line = line.replace("## Evaluation", (
                    f"## Evaluation at {since['tokens']:,} streamed tokens," if since else
                    "## Evaluation of the draft before the streaming stage"))
        if line.startswith(("specdec train-draft eval card", REMEASURE)):
            # `card` writes a card of the staged pipeline, which this draft has outgrown
            out += [STREAM_COMMAND, stream_command(settings) + " --stream-from STARTING_DRAFT"]
            line = f"{REMEASURE}  # re-measure a draft (eval_report.json in --work-dir)"
        out.append(line)
    (out_dir / "README.md").write_text("\n".join(out) + "\n")


def _comparison_lines(this: dict, start: dict) -> list[str]:
    """This draft's acceptance beside the starting draft's, from one evaluation run."""
    rows = [f"| {new.get('prompt_set', 'templated')} | {new['temperature']:g} | "
            f"{new['gamma']} | {old['alpha']:.3f} -> {new['alpha']:.3f} | "
            f"{old['acceptance_rate']:.3f} -> {new['acceptance_rate']:.3f} | "
            f"{old['mean_accepted_length']:.2f} -> {new['mean_accepted_length']:.2f} | "
            f"{'' if new.get('greedy_matches_target') is None else _yes(new, old)} |"
            for new, old in zip(this["acceptance"], start["acceptance"], strict=True)]
    return [
        f"## Evaluation beside the starting draft ({this['num_prompts']} held-out prompts of "
        f"each set, up to {this['max_new_tokens']} new tokens, target in fp32, "
        f"{this['threads']} threads; `specdec/draft_training/evaluate.py`, both drafts in "
        "one run)",
        HELD_OUT_SETS,
        "alpha = accepted / (accepted + rejections), the per-token acceptance probability; "
        "acceptance rate = accepted / drafted (vLLM's); mean accepted length includes the "
        "bonus/correction token. Starting draft -> this draft.",
        "",
        "| held-out prompts | T | gamma | alpha | acceptance rate | mean accepted length | "
        "greedy == target |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _yes(*results: dict) -> str:
    return "yes" if all(r.get("greedy_matches_target") for r in results) else "NO"
