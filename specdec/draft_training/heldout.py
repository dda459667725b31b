"""The held-out curve of streaming distillation: how often the draft would be accepted.

Two held-out sets of everyday chat that no training context holds, each prompt answered
greedily by the target: first the hand-written set (`handwritten_heldout.jsonl`: single-
and multi-turn conversations of the kinds people write, made by no generator), then the
held-out prompts of the project's prompt sets. Teacher-forced along those
answers, two figures per draft and set:
- top-1 agreement: the share of positions where the draft's most probable token is the
  target's next token (under greedy verification, exactly when a drafted token is
  accepted; a target token outside the draft's vocabulary counts as a miss);
- expected acceptance: the mean of sum_x min(p(x), q(x)), the probability that a token
  sampled from the draft is accepted at T=1 (docs/design.md, "The exactness contract").
Each checkpoint appends them, with the tokens trained on so far, to a JSON log: the
hand-written set's figures at the top level of a point, the prompt sets' under
"generated". A point without "generated" holds the prompt sets' figures at the top
level, as logs did before the hand-written set; read_curve moves them under
"generated", so the top level means the hand-written set in every point it holds
figures. The plot of the log sits next to the model card.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedModel

from specdec.draft_training.datagen import interleave_by_category
from specdec.draft_training.handwritten import (
    HANDWRITTEN,
    Messages,
    handwritten_held_out,
)
from specdec.draft_training.producers import generate
from specdec.draft_training.stream_prompts import ChatFormat, split_prompt_sets

CURVE_FILE = "stream_curve.json"
PLOT_FILE = "heldout_curve.png"
GENERATED = "generated"  # the prompt sets' held-out prompts: their key in a curve point


def held_out_chat(count: int) -> list[str]:
    """The first `count` held-out prompts, the prompt sets and their categories in turn."""
    per_set = [interleave_by_category(held_out) for _, held_out in split_prompt_sets()]
    mixed = [p.text for group in zip(*per_set, strict=False) for p in group]
    return mixed[:count]


def held_out_sets(count: int) -> dict[str, list[Messages]]:
    """The first `count` conversations of each held-out set: the hand-written set first,
    then the prompt sets' held-out prompts (held_out_chat)."""
    return {HANDWRITTEN: [p.messages for p in handwritten_held_out()[:count]],
            GENERATED: [[{"role": "user", "content": text}] for text in held_out_chat(count)]}


@dataclass
class HeldOutSet:
    sequences: list[list[int]]  # chat prompt + the target's greedy answer
    answer_starts: list[int]
    target_probs: list[torch.Tensor]  # [answer length, draft rows]: p on the mapped ids
    token_map: list[int]


def build_held_out(target: PreTrainedModel, tokenizer, token_map: list[int],
                   conversations: list[Messages], max_new_tokens: int) -> HeldOutSet:
    chat = ChatFormat(tokenizer)
    prompts = [chat.conversation(messages) for messages in conversations]
    answers, _ = generate(target, prompts, 0.0, max_new_tokens, chat.end_of_turn,
                          pad=chat.end_of_turn)
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    mapped = torch.tensor(token_map, device=target.device)
    probs = []
    with torch.inference_mode():
        for prompt, sequence in zip(prompts, sequences, strict=True):
            ids = torch.tensor([sequence], device=target.device)
            logits = target(input_ids=ids).logits[0, len(prompt) - 1:-1]
            probs.append(torch.softmax(logits.float(), dim=-1)[:, mapped]
                         .to(torch.float16).cpu())
    return HeldOutSet(sequences, [len(p) for p in prompts], probs, token_map)


def load_or_build_held_out(path: Path, target: PreTrainedModel, tokenizer,
                           token_map: list[int], conversations: list[Messages],
                           max_new_tokens: int) -> HeldOutSet:
    """The cached held-out set when it was built for this token map and these
    conversations, else a new one (cached for the next run)."""
    key = hashlib.sha256(json.dumps([token_map, conversations, max_new_tokens])
                         .encode()).hexdigest()
    if path.exists():
        cached = torch.load(path)
        if cached.get("key") == key:
            return HeldOutSet(**cached["held_out"])
    held_out = build_held_out(target, tokenizer, token_map, conversations, max_new_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "held_out": held_out.__dict__}, path)
    return held_out


def measure_agreement(draft: LlamaForCausalLM, held_out: HeldOutSet) -> dict[str, float]:
    """Top-1 agreement and expected acceptance of the draft (float32 forward, one
    sequence at a time so no padding enters)."""
    token_map = torch.tensor(held_out.token_map)
    unk_row = len(held_out.token_map)
    input_map = torch.full((int(max(held_out.token_map)) + 1,), unk_row)
    input_map[token_map] = torch.arange(unk_row)
    matches = positions = 0
    accepted = 0.0
    was_training = draft.training
    draft.eval()
    with torch.inference_mode():
        for sequence, start, p in zip(held_out.sequences, held_out.answer_starts,
                                      held_out.target_probs, strict=True):
            ids = torch.tensor(sequence)
            rows = input_map[ids.clamp_max(len(input_map) - 1)]
            rows[ids >= len(input_map)] = unk_row
            logits = draft(input_ids=rows[None].to(draft.device)).logits
            q = torch.softmax(logits[0, start - 1:-1, :unk_row].float(), dim=-1).cpu()
            following = ids[start:]
            matches += int((token_map[q.argmax(-1)] == following).sum())
            accepted += float(torch.minimum(p.float(), q).sum())
            positions += len(following)
    draft.train(was_training)
    return {"top1_agreement": matches / max(1, positions),
            "expected_acceptance": accepted / max(1, positions), "positions": positions}


# The counters of a curve point (stream.Progress's, which a run continuing the curve
# starts from); besides them and the loss, a point holds figures.
POINT_COUNTERS = ("tokens", "trained_tokens", "step", "records", "batches", "elapsed_s",
                  "cpu_s")


def read_curve(path: Path) -> list[dict[str, Any]]:
    """The curve at path (empty where there is none), each point's prompt-set figures
    under GENERATED."""
    return [_generated_under_its_key(point) for point in json.loads(path.read_text())
            ] if path.exists() else []


def _generated_under_its_key(point: dict[str, Any]) -> dict[str, Any]:
    if GENERATED in point:
        return point
    kept = (*POINT_COUNTERS, "loss")
    counters = {key: value for key, value in point.items() if key in kept}
    figures = {key: value for key, value in point.items() if key not in kept}
    return {**counters, GENERATED: figures}


def curve_series(curve: list[dict[str, Any]]) -> list[tuple[str, list[int], list[float]]]:
    """(label, labelled tokens, values) of each line the plot draws, over the points that
    measured it: the hand-written set's figures, then the prompt sets'."""
    series = []
    for name, nested in ((HANDWRITTEN, False), ("prompt sets", True)):
        for key, what in (("top1_agreement", "top-1 agreement (greedy acceptance)"),
                          ("expected_acceptance", "sum min(p, q) (T=1 acceptance)")):
            points = [(point["tokens"], figures[key]) for point in curve
                      for figures in [point.get(GENERATED, {}) if nested else point]
                      if key in figures]
            series.append((f"{name}: {what}", [t for t, _ in points], [v for _, v in points]))
    return series


def write_curve(path: Path, curve: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(curve, indent=1))
    tmp.rename(path)


def plot_curve(curve: list[dict[str, Any]], path: Path, title: str) -> None:
    """Held-out top-1 agreement and expected acceptance against labelled tokens: the
    hand-written set in solid lines, the prompt sets' dashed, each over the points that
    measured it (curve_series)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    styles = [("o", "C0", "-", 1.0), ("s", "C1", "-", 1.0), ("o", "C0", "--", 0.6),
              ("s", "C1", "--", 0.6)]  # in curve_series's order
    for (label, tokens, values), (marker, color, line, alpha) in zip(
            curve_series(curve), styles, strict=True):
        if tokens:
            axes.plot(tokens, values, marker=marker, color=color, linestyle=line,
                      alpha=alpha, label=label)
    axes.set_xlabel("target-labelled tokens trained on (this stage)")
    axes.set_ylabel("held-out, per token")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
