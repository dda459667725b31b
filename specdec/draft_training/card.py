"""Write the draft's model card from the figures the pipeline measured (nothing typed in)."""

from __future__ import annotations

import json
from pathlib import Path


def _row(result: dict) -> str:
    greedy = result.get("greedy_matches_target")
    check = "" if greedy is None else ("yes" if greedy else "NO")
    return (f"| {result.get('prompt_set', 'templated')} | {result['temperature']:g} | "
            f"{result['gamma']} | {result['alpha']:.3f} | "
            f"{result['acceptance_rate']:.3f} | {result['mean_accepted_length']:.2f} | "
            f"{result['draft_tokens']} | {check} |")


def write_model_card(out_dir: Path, work_dir: Path) -> None:
    config = json.loads((out_dir / "config.json").read_text())
    token_map = json.loads((out_dir / "token_map.json").read_text())["target_ids"]
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
        "- Initialisation: the target's embeddings (restricted to the map), first layers and "
        "final norm; then distilled with a KL loss to the target's top-16 distribution.",
        "",
        "## Training data",
        f"- {summary['sequences']:,} continuations, {summary['tokens']:,} target tokens, "
        "sampled from SmolLM2-135M-Instruct (fp32) on the project's prompt sets: "
        + _shards_text(summary.get("shards", {"shard": None}))
        + "; half greedy, half sampled at T=1.",
        f"- {summary['steps']:,} optimiser steps of 16 sequences; the last training run took "
        f"{summary['train_s'] / 60:.1f} min on 2 CPU cores"
        + (f" (resumed at step {summary['resumed_from_step']:,})"
           if summary.get("resumed_from_step") else
           " (runs resume from checkpoints: this may be the last part only)")
        + "; final loss (cross-entropy to the target's top-k) "
        f"{summary['final_loss']:.3f}.",
        "",
        *_evaluation_lines(report),
        "## Reproduce",
        "```",
        "specdec train-draft            # data, train, eval, card; resumable",
        "specdec train-draft eval card  # re-measure the committed draft",
        "```",
    ]
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


def _evaluation_lines(report: dict) -> list[str]:
    t_target = {int(k): v for k, v in report["t_target_ms"].items()}
    bounds = {int(k): v for k, v in report["bound_by_gamma_greedy"].items()}
    return [
        f"## Evaluation ({report['num_prompts']} held-out prompts of each set, up to "
        f"{report['max_new_tokens']} new tokens, target in fp32, "
        f"{report['threads']} threads)",
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
        "- Speedup bound S(gamma) at T=0 (shared/REFERENCE.md section 2, measured costs): "
        + ", ".join(f"{g}: {b:.2f}x" for g, b in sorted(bounds.items())),
        f"- Best gamma {report['best_gamma']}: bound {report['best_bound']:.2f}x over "
        "target-only.",
        "",
    ]


def write_feature_model_card(out_dir: Path, work_dir: Path) -> None:
    config = json.loads((out_dir / "config.json").read_text())
    token_map = json.loads((out_dir / "token_map.json").read_text())["target_ids"]
    summary = json.loads((work_dir / "feature_train_summary.json").read_text())
    report = json.loads((work_dir / "feature_eval_report.json").read_text())
    lines = [
        "# specdec-feature-draft: a draft that reads SmolLM2-135M-Instruct's hidden states",
        "",
        "An EAGLE-style draft (`specdec/feature_draft.py`), trained by `specdec "
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
