"""Streaming self-distillation on a tiny random target with SmolLM2's tokenizer: the
queue's bound, labels equal to the target's own distribution, held-out and bench prompts
never produced, resume from the checkpoint, and the held-out curve."""

from __future__ import annotations

import functools
import json
import queue
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.bench.workloads import bench_texts
from specdec.draft_training import heldout, stream_prompts
from specdec.draft_training.heldout import CURVE_FILE, GENERATED, PLOT_FILE, held_out_chat
from specdec.draft_training.producers import (
    DraftWrittenProducer,
    TargetDecodingProducer,
)
from specdec.draft_training.prompts import Prompt, generate_prompts, split
from specdec.draft_training.stream import (
    CHECKPOINT_FILE,
    DraftWeights,
    ProducerThread,
    StreamSettings,
    stream_distill,
)
from specdec.draft_training.stream_prompts import (
    NEAR_DUPLICATE,
    ChatFormat,
    Context,
    ConversationSource,
    RecentTurns,
    normal,
    similarity,
)
from specdec.draft_training.train import make_draft
from specdec.draft_training.wide_prompts import generate_wide_prompts
from specdec.engine.runner import ModelRunner
from tests.tiny_models import assert_speculative_greedy_equals_hf, save_tiny_pair

# A run of a few seconds on the tiny models, checkpointing every second. Prompt-set
# contexts only: the tiny random target's written turns never end, so the source refuses
# them all.
QUICK_RUN = StreamSettings(time_budget_s=3.0, train_batch=2, produce_batch=3, max_new_tokens=6,
                           top_k=4, lr=1e-3, queue_size=4, checkpoint_every_s=1.0,
                           progress_every_s=1.0, held_out_prompts=2, held_out_tokens=4,
                           mix=(1.0, 0.0, 0.0))


# Written user turns no two of which are near-duplicates (stream_prompts.RecentTurns).
DISTINCT_TURNS = [f"How do I {verb} a {thing}?" for verb in ("fold", "paint", "fix", "clean")
                  for thing in ("kite", "bicycle", "lamp", "chair", "boat", "fence")]


@functools.cache
def _small_prompt_sets() -> tuple[tuple[list[Prompt], list[Prompt]], ...]:
    return (split(generate_prompts(count=600)), split(generate_wide_prompts(count=600)))


@pytest.fixture(autouse=True)
def small_prompt_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt sets' first 600 prompts each, split the same way: the full sets take
    half a minute to generate (the wide set tries many fills before it stops)."""
    monkeypatch.setattr(stream_prompts, "split_prompt_sets", _small_prompt_sets)
    monkeypatch.setattr(heldout, "split_prompt_sets", _small_prompt_sets)
    monkeypatch.setattr(stream_prompts, "held_out_texts", lambda: frozenset(
        normal(p.text) for _, held_out in _small_prompt_sets() for p in held_out))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny target and a reduced-vocabulary draft made from it."""
    root = tmp_path_factory.mktemp("stream")
    target, _ = save_tiny_pair(root)
    token_map = list(range(0, 49152, 6))  # every sixth id; 0 and the chat tokens 1, 2
    draft = make_draft(str(target), token_map, num_layers=1)
    draft.save_pretrained(root / "draft")
    (root / "draft" / "token_map.json").write_text(json.dumps({"target_ids": token_map}))
    (root / "draft" / "README.md").write_text(
        "# a draft\n\n## Training data\n- stage one\n\n## Evaluation (old)\n| table |\n\n"
        "## Reproduce\n```\nspecdec train-draft eval card  # re-measure\n```\n")
    return target, root / "draft"


def _target(path: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _contexts(target_dir: Path) -> list[Context]:
    chat = ChatFormat(AutoTokenizer.from_pretrained(target_dir))
    texts = ["Tell me about owls.", "Write a haiku about rain, please.", "Hi!"]
    return [Context("prompt-set", chat.user_turn(text)) for text in texts]


def _assert_labels_are_the_targets(target: torch.nn.Module, records: list[dict]) -> None:
    assert records
    for record in records:
        prompt, new = record["prompt_ids"].long(), record["new_ids"].long()
        with torch.no_grad():
            logits = target(input_ids=torch.cat([prompt, new])[None]).logits[0]
        probs = torch.softmax(logits[len(prompt) - 1:-1].float(), dim=-1)
        k = record["topk_ids"].shape[1]
        expected = probs.topk(k, dim=-1)
        assert record["topk_ids"].shape == (len(new), k)
        assert torch.allclose(record["topk_probs"].float(), expected.values, atol=2e-3)
        # ids agree wherever the probabilities are not tied
        chosen = probs.gather(1, record["topk_ids"].long())
        assert torch.allclose(chosen, expected.values, atol=2e-3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_written_text_is_labelled_with_the_targets_distribution(
        tiny: tuple[Path, Path], temperature: float) -> None:
    target_dir, draft_dir = tiny
    from specdec.draft_training.train import load_draft

    target = _target(target_dir)
    draft, token_map = load_draft(draft_dir)
    producer = DraftWrittenProducer(target, draft, token_map, 2, top_k=4, max_new_tokens=7)
    torch.manual_seed(3)
    records = producer.produce(_contexts(target_dir), temperature)
    assert all(set(r["new_ids"].tolist()) <= set(token_map) for r in records)
    _assert_labels_are_the_targets(target, records)


@pytest.mark.parametrize("backend", ["generate", "runner"])
def test_target_decoding_labels_are_the_targets_distribution(
        tiny: tuple[Path, Path], backend: str) -> None:
    target_dir, _ = tiny
    target = _target(target_dir)
    runner = ModelRunner(target, row_invariance=(False, None)) if backend == "runner" else None
    producer = TargetDecodingProducer(target, 2, top_k=4, max_new_tokens=6, backend=backend,
                                      runner=runner)
    records = producer.produce(_contexts(target_dir), 0.0)
    _assert_labels_are_the_targets(target, records)
    for record in records:  # greedy: every token is the target's most probable one
        assert record["new_ids"].tolist() == record["topk_ids"][:, 0].tolist()


class _EndlessProducer:
    name = "endless"

    def produce(self, contexts: list[Context], temperature: float) -> list[dict]:
        return [{"prompt_ids": torch.tensor(c.prompt_ids), "new_ids": torch.tensor([5, 2]),
                 "kind": c.kind} for c in contexts]


def test_the_queue_holds_at_most_its_bound_and_the_producer_waits(
        tiny: tuple[Path, Path]) -> None:
    target_dir, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    source = ConversationSource(tokenizer, lambda prefixes, t, n: [[5, 2]] * len(prefixes),
                                mix=(1.0, 0.0, 0.0))
    records: queue.Queue = queue.Queue(maxsize=5)
    settings = StreamSettings(produce_batch=4)
    thread = ProducerThread(_EndlessProducer(), source, records, settings,  # type: ignore[arg-type]
                            DraftWeights(), 0)
    thread.start()
    time.sleep(1.0)
    try:
        assert records.qsize() == 5 and thread.is_alive() and thread.error is None
        made = thread.batch_index
        time.sleep(0.5)
        assert thread.batch_index == made  # blocked on the full queue, not producing
        records.get()
        time.sleep(0.5)
        assert records.qsize() == 5
    finally:
        thread.stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_held_out_and_bench_prompts_never_become_a_user_turn(tiny: tuple[Path, Path]) -> None:
    target_dir, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    chat = ChatFormat(tokenizer)
    held_out = sorted(stream_prompts.held_out_texts())
    bench = bench_texts()
    forbidden = held_out[:3] + bench[:2] + bench[-2:]
    allowed = DISTINCT_TURNS
    written = [f"  {t.upper()} " for t in forbidden]

    rng = random.Random(0)

    def write_turns(prefixes: list[list[int]], temperature: float, n: int) -> list[list[int]]:
        # half the written turns are excluded text, half allowed ones
        return [chat.encode(rng.choice(written) if rng.random() < 0.5 else rng.choice(allowed))
                + [chat.end_of_turn] for _ in prefixes]

    source = ConversationSource(tokenizer, write_turns, excluded=bench, mix=(0.3, 0.5, 0.2))
    excluded = {normal(t) for t in held_out + bench}
    assert all(normal(t) in excluded for t in held_out_chat(8))  # what the curve measures on
    turns: list[str] = []
    kinds: set[str] = set()
    for _ in range(8):
        for context in source.next_batch(8):
            kinds.add(context.kind)
            text = tokenizer.decode(context.prompt_ids)
            turns += [turn.split("<|im_end|>")[0].strip()
                      for turn in text.split("<|im_start|>user\n")[1:]]
            source.remember(context.prompt_ids, chat.encode("Sure.") + [chat.end_of_turn])
    assert source.dropped_turns > 0
    assert {normal(t) for t in allowed} & {normal(t) for t in turns}
    assert not [t for t in turns if normal(t) in excluded]
    assert kinds == {"prompt-set", "magpie", "multi-turn"}


def test_a_reworded_near_copy_is_a_near_duplicate_and_another_prompt_is_not() -> None:
    turn = "Can you give me some tips for staying focused while working from home?"
    reworded = "could you give me some tips for staying focused while working from home"
    other = "Can you give me some tips for a weekend trip to Rome with two kids?"
    assert similarity(turn, reworded) >= NEAR_DUPLICATE > similarity(turn, other)
    assert all(similarity(a, b) < NEAR_DUPLICATE
               for i, a in enumerate(DISTINCT_TURNS) for b in DISTINCT_TURNS[i + 1:])
    recent = RecentTurns()
    assert recent.keep(turn) and not recent.keep(reworded) and recent.keep(other)
    assert not recent.keep(f"  {turn.upper()}")
    # near-duplicates of the last `size` kept turns, equal text of the last `exact`
    window = RecentTurns(size=1, exact=3)
    assert window.keep(turn) and window.keep(other)
    assert not window.keep(turn) and window.keep(reworded)
    assert window.keep(DISTINCT_TURNS[0]) and window.keep(DISTINCT_TURNS[1])
    assert window.keep(turn)  # past both windows


def test_the_source_drops_a_repeated_written_turn(tiny: tuple[Path, Path]) -> None:
    target_dir, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    chat = ChatFormat(tokenizer)
    repeated = ["How do I keep basil alive on a windowsill?",
                "how do I keep basil alive on a windowsill",
                "So how do I keep basil alive on a windowsill?"]
    distinct = DISTINCT_TURNS[:3]
    rng = random.Random(0)

    def write_turns(prefixes: list[list[int]], temperature: float, n: int) -> list[list[int]]:
        return [chat.encode(rng.choice(repeated + distinct)) + [chat.end_of_turn]
                for _ in prefixes]

    source = ConversationSource(tokenizer, write_turns, mix=(0.0, 0.6, 0.4))
    written: list[str] = []
    for _ in range(6):
        for context in source.next_batch(8):
            user_turns = tokenizer.decode(context.prompt_ids).split("<|im_start|>user\n")[1:]
            written.append(user_turns[-1].split("<|im_end|>")[0].strip())
            source.remember(context.prompt_ids, chat.encode("Sure.") + [chat.end_of_turn])
    # the basil question once, in whichever wording came first, and each other turn once
    assert len(written) == len(set(written)) == 4 == source.written_turns
    assert sum(t in repeated for t in written) == 1 and set(distinct) <= set(written)
    assert source.near_duplicates == 6 * 8 - 4 and source.dropped_turns == 0


def test_a_refused_written_turn_leaves_its_context_out(tiny: tuple[Path, Path]) -> None:
    target_dir, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    chat = ChatFormat(tokenizer)

    def unended(prefixes: list[list[int]], temperature: float, n: int) -> list[list[int]]:
        return [chat.encode("Tell me how tides work and") for _ in prefixes]  # cut short

    written_only = ConversationSource(tokenizer, unended, mix=(0.0, 1.0, 0.0))
    assert written_only.next_batch(8) == [] and written_only.dropped_turns == 8
    mixed = ConversationSource(tokenizer, unended, mix=(0.5, 0.5, 0.0))
    contexts = [c for _ in range(4) for c in mixed.next_batch(8)]
    # the prompt sets keep their share of the draws, not the refused turns' as well
    assert {c.kind for c in contexts} == {"prompt-set"}
    assert len(contexts) + mixed.dropped_turns == 32 and mixed.dropped_turns > 0


def test_the_default_mix_expects_user_like_contexts_to_label_most_tokens() -> None:
    # Labelled tokens per unit of weight, from the committed draft's card: 63/26/11 % of
    # its tokens from prompt-set/magpie/multi-turn contexts at weights 0.4/0.4/0.2.
    per_weight = (0.63 / 0.4, 0.26 / 0.4, 0.11 / 0.2)
    tokens = [w * y for w, y in zip(StreamSettings().mix, per_weight, strict=True)]
    assert (tokens[1] + tokens[2]) / sum(tokens) > 0.6


def test_the_stream_mix_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from specdec.cli import build_parser
    from specdec.commands.train_draft import stream_settings

    parser = build_parser("train-draft")
    assert stream_settings(parser.parse_args(["train-draft"])).mix == StreamSettings().mix
    chosen = parser.parse_args(["train-draft", "--stream-mix", "0,1,0.5"])
    assert stream_settings(chosen).mix == (0.0, 1.0, 0.5)
    for wrong in ("1,2", "1,-1,1", "0,0,0", "a,b,c", "1,inf,1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["train-draft", "--stream-mix", wrong])
        assert f"argument --stream-mix: '{wrong}' is not three non-negative weights" in (
            capsys.readouterr().err)


def test_a_stream_run_writes_the_curve_and_the_next_run_resumes(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    target_dir, draft_dir = tiny
    settings = QUICK_RUN
    work, out = tmp_path / "work", tmp_path / "out"
    first = stream_distill(str(target_dir), draft_dir, work, out, settings)
    assert first["progress"]["step"] > 0 and first["progress"]["tokens"] > 0
    curve = json.loads((work / CURVE_FILE).read_text())
    assert len(curve) >= 2 and curve[0]["tokens"] == 0 and curve[0]["step"] == 0
    # the hand-written set's figures, and the prompt sets' under GENERATED
    assert all(0.0 <= f["top1_agreement"] <= 1.0 and 0.0 <= f["expected_acceptance"] <= 1.0
               and f["positions"] > 0 for p in curve for f in (p, p[GENERATED]))
    assert (out / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / CURVE_FILE).read_text()) == curve
    assert (out / "token_map.json").exists() and (work / CHECKPOINT_FILE).exists()
    card = (out / "README.md").read_text()
    assert card.index("- stage one") < card.index("Streaming stage") < card.index(
        "## Held-out curve") < card.index("2 hand-written everyday conversations") < card.index(
        "On 2 held-out prompts of the project's prompt sets") < card.index(
        f"]({PLOT_FILE})") < card.index(
        "## Evaluation of the draft before the streaming stage (old)")
    stored = AutoModelForCausalLM.from_pretrained(out)
    assert next(stored.parameters()).dtype == torch.bfloat16

    second = stream_distill(str(target_dir), draft_dir, work, out, settings)
    assert second["progress"]["step"] > first["progress"]["step"]
    assert second["progress"]["tokens"] > first["progress"]["tokens"]
    # the process's CPU time adds up over runs, as the wall time does
    assert second["progress"]["cpu_s"] > first["progress"]["cpu_s"] > 0
    resumed = json.loads((work / CURVE_FILE).read_text())
    assert resumed[:len(curve)] == curve and len(resumed) > len(curve)


def test_a_run_from_a_streamed_draft_continues_its_curve_in_a_new_work_dir(
        tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target_dir, draft_dir = tiny
    first = stream_distill(str(target_dir), draft_dir, tmp_path / "work", tmp_path / "out",
                           QUICK_RUN)
    committed = json.loads((tmp_path / "out" / CURVE_FILE).read_text())
    capsys.readouterr()
    # another machine: the committed draft directory only, no checkpoint
    second = stream_distill(str(target_dir), tmp_path / "out", tmp_path / "new-work",
                            tmp_path / "new-out", QUICK_RUN)
    assert (f"continuing the committed curve at {committed[-1]['tokens']:,} tokens, step "
            f"{committed[-1]['step']:,}; optimiser state starts fresh") in capsys.readouterr().out
    curve = json.loads((tmp_path / "new-out" / CURVE_FILE).read_text())
    assert curve[:len(committed)] == committed and len(curve) > len(committed) + 1
    tokens = [point["tokens"] for point in curve]
    assert tokens == sorted(tokens) and curve[len(committed)]["tokens"] >= committed[-1]["tokens"]
    for key in ("step", "tokens", "records", "batches", "elapsed_s", "cpu_s"):
        assert second["progress"][key] > first["progress"][key], key
    assert second["continued_from"]["tokens"] == committed[-1]["tokens"]
    card = (tmp_path / "new-out" / "README.md").read_text()  # the stage's block replaced
    assert card.count("Streaming stage (`specdec train-draft --stream`)") == 1
    assert card.count("## Held-out curve") == 1 and card.count("--stream-from STARTING") == 1
    assert f"Resumed from the committed draft at {committed[-1]['tokens']:,} tokens" in card


def test_a_curve_from_before_the_handwritten_set_continues_with_its_figures_marked(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    from specdec.draft_training.heldout import curve_series

    target_dir, draft_dir = tiny
    old_draft = tmp_path / "old-draft"
    shutil.copytree(draft_dir, old_draft)
    # the prompt sets' figures at the top level, no hand-written ones
    old_points = [{"tokens": tokens, "trained_tokens": 2 * tokens, "step": step, "loss": None,
                   "top1_agreement": 0.3, "expected_acceptance": 0.2, "positions": 9}
                  for tokens, step in ((0, 0), (100, 5))]
    (old_draft / CURVE_FILE).write_text(json.dumps(old_points))
    out = tmp_path / "out"
    stream_distill(str(target_dir), old_draft, tmp_path / "work", out,
                   replace(QUICK_RUN, time_budget_s=0.0))
    curve = json.loads((out / CURVE_FILE).read_text())
    figures = ("top1_agreement", "expected_acceptance", "positions")
    for old, point in zip(old_points, curve, strict=False):
        assert point == {**{k: v for k, v in old.items() if k not in figures},
                         GENERATED: {k: old[k] for k in figures}}
    new = curve[len(old_points):]
    assert len(new) == 2 and all(p["tokens"] >= 100 and p["step"] >= 5 for p in new)
    assert all(set(figures) <= set(p) and set(figures) <= set(p[GENERATED]) for p in new)
    # the hand-written set's lines start at the continuation, the prompt sets' span the curve
    lines = {label.split(":")[0]: tokens for label, tokens, _ in curve_series(curve)}
    assert lines == {"hand-written": [100, 100], "prompt sets": [0, 100, 100, 100]}
    assert "from 100 to 100 labelled tokens" in (out / "README.md").read_text()


def test_a_new_draft_for_a_target_without_one(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from specdec.draft_training.stream import new_draft
    from specdec.draft_training.train import load_draft

    target_dir, _ = tiny
    settings = replace(QUICK_RUN, max_new_tokens=5)  # prompt-set contexts (QUICK_RUN)
    made = new_draft(str(target_dir), tmp_path / "new", settings, vocab_size=40, num_layers=1,
                     batches=2)
    draft, token_map = load_draft(made)
    chat = ChatFormat(AutoTokenizer.from_pretrained(target_dir))
    assert chat.end_of_turn == 2 and {2, *chat.assistant_prefix} <= set(token_map)
    assert len(token_map) == 40 and draft.config.vocab_size == 41  # the map and an UNK row
    assert draft.config.num_hidden_layers == 1


def test_the_stream_card_puts_both_drafts_evaluations_side_by_side(tmp_path: Path) -> None:
    from specdec.draft_training.card import stream_command, write_stream_card

    init = tmp_path / "init.md"
    init.write_text("# a draft\n\n## Training data\n- stage one\n\n## Evaluation (old run)\n"
                    "| old table |\n\n## Costs (median warm-cache forward, ms)\n- costs\n\n"
                    "## Reproduce\n```\nspecdec train-draft eval card  # re-measure\n```\n")
    settings = {**StreamSettings(device="cuda").__dict__, "temperatures": [0.0, 1.0]}

    def report(alpha: float) -> dict:
        row = {"prompt_set": "wide", "temperature": 0.0, "gamma": 4, "alpha": alpha,
               "acceptance_rate": alpha / 2, "mean_accepted_length": 1 + alpha,
               "greedy_matches_target": True}
        return {"acceptance": [row], "num_prompts": 3, "max_new_tokens": 8, "threads": 2}

    summary = {"progress": {"tokens": 10, "records": 2, "step": 1, "elapsed_s": 60.0},
               "settings": settings, "tokens_per_s_this_run": 5.0, "device_name": "one GPU",
               "produced_by_kind": {"prompt-set": 40, "magpie": 45, "multi-turn": 15},
               "written_turns": 1200, "dropped_written_turns": 300, "near_duplicate_turns": 90,
               "curve": [{"tokens": 0, "top1_agreement": 0.4, "expected_acceptance": 0.3,
                          "positions": 9}, {"tokens": 10, "top1_agreement": 0.5,
                                            "expected_acceptance": 0.4, "positions": 9}]}
    write_stream_card(tmp_path, init, summary, (report(0.6), report(0.5)))
    card = (tmp_path / "README.md").read_text()
    assert "| wide | 0 | 4 | 0.500 -> 0.600 | 0.250 -> 0.300 | 1.50 -> 1.60 | yes |" in card
    assert "old table" not in card and "- costs" in card and "1.0 min on one GPU" in card
    assert ("contexts: magpie 45%, multi-turn 15%, prompt-set 40%, user-like (magpie + "
            "multi-turn) 60% (labelled tokens)") in card
    assert ("1,200 kept, 300 refused (cut short, empty or held-out text), 90 dropped as "
            "near-duplicates") in card
    assert f"`{stream_command(settings)}`" in card and "--device cuda" in card
    assert "eval card" not in card  # `card` would rewrite it as a staged pipeline's card
    assert f"\n{stream_command(settings)} --stream-from STARTING_DRAFT\n" in card


def test_target_decoding_keeps_the_layer_states_an_eagle3_draft_reads(
        tiny: tuple[Path, Path]) -> None:
    target_dir, _ = tiny
    target = _target(target_dir)
    producer = TargetDecodingProducer(target, 2, top_k=4, max_new_tokens=5,
                                      state_layers=(1, 0))
    records = producer.produce(_contexts(target_dir), 1.0)
    _assert_labels_are_the_targets(target, records)
    for record in records:
        ids = torch.cat([record["prompt_ids"], record["new_ids"]]).long()[None]
        with torch.no_grad():
            states = target(input_ids=ids, output_hidden_states=True).hidden_states
        expected = torch.cat([states[1][0], states[0][0]], dim=-1)  # layer inputs, in order
        assert record["aux_states"].dtype == torch.bfloat16
        torch.testing.assert_close(record["aux_states"].float(), expected, rtol=2e-2,
                                   atol=2e-2)


def test_an_eagle3_stream_run_writes_a_speculators_draft_and_resumes(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from specdec.engine.eagle3_formats import directory_layout, load_eagle3, target_facts

    target_dir, token_draft = tiny
    settings = replace(QUICK_RUN, draft_kind="eagle3", ttt_steps=3, producer="target-generate")
    work, out = tmp_path / "work", tmp_path / "out"
    first = stream_distill(str(target_dir), token_draft, work, out, settings)
    assert first["progress"]["step"] > 0
    curve = json.loads((work / CURVE_FILE).read_text())
    assert len(curve) >= 2 and all(len(p["top1_by_step"]) == 3 for p in curve)
    assert directory_layout(out) == "speculators" and (out / PLOT_FILE).exists()
    target = _target(target_dir)
    draft = load_eagle3(out, None, target_facts(target.config), target_dir)
    token_map = json.loads((token_draft / "token_map.json").read_text())["target_ids"]
    assert draft.draft_to_target().tolist() == token_map
    assert next(draft.lm_head.parameters()).dtype == torch.bfloat16
    assert torch.equal(draft.model.embed_tokens.weight,  # shared, not stored
                       target.get_input_embeddings().weight.to(torch.bfloat16))
    # a draft served from out speculates exactly: greedy equals the target alone
    assert_speculative_greedy_equals_hf(target, target, draft.float(), lengths=(2, 4))

    second = stream_distill(str(target_dir), token_draft, work, out, settings)
    assert second["progress"]["step"] > first["progress"]["step"]


def test_an_eagle3_run_needs_the_producer_that_keeps_states(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    target_dir, token_draft = tiny
    settings = StreamSettings(time_budget_s=1.0, draft_kind="eagle3", producer="mix",
                              held_out_prompts=1, held_out_tokens=2)
    with pytest.raises(ValueError, match="target-generate"):
        stream_distill(str(target_dir), token_draft, tmp_path / "w", tmp_path / "o", settings)
