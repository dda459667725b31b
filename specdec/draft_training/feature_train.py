"""Train a feature draft (specdec.engine.feature_draft) on the distillation shards.

Two stages on top of `datagen`'s shards: `hidden` runs the target once over every
record (prompt + continuation) and stores its final-norm hidden states (float16, one file
per shard, resumable); `train` fits the draft. Entry p of a sequence reads (x_p, h_{p-1})
and is trained to (a) give the target's top-k distribution of x_{p+1} (cross-entropy,
continuation positions) and (b) reproduce h_p (smooth L1, all positions), so that at
decode time its own output can stand in for the target's state at the positions it drafts.
The draft starts as a token-only draft (its embeddings and tied LM head stay frozen) with a
zero-initialised path for the target's states.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.draft_training.optimise import optimise
from specdec.draft_training.train import Record, shard_paths
from specdec.engine.feature_draft import (
    TARGET_HIDDEN_SCALE_KEY,
    TARGET_HIDDEN_SIZE_KEY,
    FeatureDraftForCausalLM,
)
from specdec.engine.token_map import input_rows, read_token_map, write_token_map


def extract_hidden_states(target_dir: str, data_dir: Path, hidden_dir: Path,
                          batch_size: int = 8, time_budget_s: float = float("inf")) -> int:
    """The target's hidden states for every record of every shard; returns shards done."""
    hidden_dir.mkdir(parents=True, exist_ok=True)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    paths = shard_paths(data_dir)
    started = time.monotonic()
    columns = (TextColumn("target hidden states"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    done = 0
    with Progress(*columns) as bar:
        task = bar.add_task("shards", total=len(paths))
        for path in paths:
            out = hidden_dir / path.name
            if out.exists():
                done += 1
                bar.advance(task)
                continue
            if time.monotonic() - started > time_budget_s:
                break
            records = torch.load(path)["records"]
            sequences = [torch.cat([r["prompt_ids"], r["new_ids"]]).long() for r in records]
            states: list[torch.Tensor | None] = [None] * len(sequences)
            order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
            for start in range(0, len(order), batch_size):
                group = order[start:start + batch_size]
                width = max(len(sequences[i]) for i in group)
                ids = torch.zeros((len(group), width), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, index in enumerate(group):
                    ids[row, : len(sequences[index])] = sequences[index]
                    mask[row, : len(sequences[index])] = 1
                with torch.no_grad():
                    hidden = target.model(input_ids=ids, attention_mask=mask).last_hidden_state
                for row, index in enumerate(group):
                    states[index] = hidden[row, : len(sequences[index])].to(torch.float16).clone()
            tmp = out.with_suffix(".tmp")
            torch.save(states, tmp)
            tmp.rename(out)
            done += 1
            bar.advance(task)
    return done


def load_with_hidden(data_dir: Path, hidden_dir: Path) -> list[Record]:
    """Records of the shards whose hidden states exist, each with its "hidden" [L, H]."""
    records: list[Record] = []
    for path in shard_paths(data_dir):
        hidden_path = hidden_dir / path.name
        if not hidden_path.exists():
            continue
        for record, hidden in zip(torch.load(path)["records"], torch.load(hidden_path),
                                  strict=True):
            records.append({**record, "hidden": hidden})
    if not records:
        raise FileNotFoundError(f"no hidden states in {hidden_dir}; run the hidden stage first")
    return records


def feature_draft_from_token_draft(token_draft_dir: str, target_hidden_size: int,
                                   target_hidden_rms: float = 1.0) -> FeatureDraftForCausalLM:
    """The token-only draft with a zero-initialised path for the target's states: it
    starts as exactly that draft (fc = [identity | 0]) and learns to use them. The states
    are scaled to the embeddings' RMS (TARGET_HIDDEN_SCALE_KEY)."""
    token_draft = LlamaForCausalLM.from_pretrained(token_draft_dir, dtype=torch.float32)
    config = token_draft.config
    setattr(config, TARGET_HIDDEN_SIZE_KEY, int(target_hidden_size))
    embed_rms = float(token_draft.model.embed_tokens.weight.detach().pow(2).mean().sqrt())
    setattr(config, TARGET_HIDDEN_SCALE_KEY, embed_rms / target_hidden_rms)
    draft = FeatureDraftForCausalLM(config)
    missing, unexpected = draft.load_state_dict(token_draft.state_dict(), strict=False)
    if unexpected or any(not name.startswith("feature_fc.") for name in missing):
        raise ValueError(f"{token_draft_dir} is not a Llama draft of this shape "
                         f"(missing {missing}, unexpected {unexpected})")
    hidden = config.hidden_size
    with torch.no_grad():
        draft.feature_fc.weight.zero_()
        draft.feature_fc.weight[:, :hidden] = torch.eye(hidden)
        draft.feature_fc.bias.zero_()
    draft.tie_weights()
    draft.model.embed_tokens.weight.requires_grad_(False)  # also the tied LM head
    return draft


def _inputs(batch: list[Record], input_map: torch.Tensor, unk_row: int, hidden_size: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, W], the target state before each id, the target state at each id, mask."""
    sequences = [torch.cat([r["prompt_ids"], r["new_ids"]]).long() for r in batch]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(batch), width), unk_row, dtype=torch.long)
    before = torch.zeros(len(batch), width, hidden_size)
    at = torch.zeros(len(batch), width, hidden_size)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (record, sequence) in enumerate(zip(batch, sequences, strict=True)):
        length = len(sequence)
        hidden = record["hidden"].float()
        ids[row, :length] = input_map[sequence]
        before[row, 1:length] = hidden[: length - 1]  # zeros before position 0
        at[row, :length] = hidden
        mask[row, :length] = 1
    return ids, before, at, mask


def _distribution_targets(batch: list[Record], input_map: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch rows, positions, top-k draft rows, top-k probs): entry p predicts x_{p+1},
    so continuation token j (at prompt_len + j) is predicted at prompt_len + j - 1."""
    rows, cols, topk_rows, topk_probs = [], [], [], []
    for row, record in enumerate(batch):
        start, length = len(record["prompt_ids"]) - 1, len(record["new_ids"])
        rows.append(torch.full((length,), row))
        cols.append(torch.arange(start, start + length))
        topk_rows.append(input_map[record["topk_ids"].long()])
        topk_probs.append(record["topk_probs"].float())
    return torch.cat(rows), torch.cat(cols), torch.cat(topk_rows), torch.cat(topk_probs)


def feature_draft_loss(draft: FeatureDraftForCausalLM, batch: list[Record],
                       input_map: torch.Tensor, unk_row: int, regression_weight: float = 1.0
                       ) -> tuple[torch.Tensor, float, float]:
    """(loss, its cross-entropy part, its regression part)."""
    ids, before, at, mask = _inputs(batch, input_map, unk_row, draft.target_hidden_size)
    scale = float(getattr(draft.config, TARGET_HIDDEN_SCALE_KEY, 1.0))
    out = draft.model(inputs_embeds=draft.feature_fc(
        torch.cat([draft.model.embed_tokens(ids), before * scale], dim=-1)), attention_mask=mask)
    hidden = out.last_hidden_state
    weights = mask.unsqueeze(-1).float()
    regression = (torch.nn.functional.smooth_l1_loss(hidden, at, reduction="none")
                  * weights).sum() / weights.sum() / hidden.shape[-1]
    rows, cols, topk_rows, topk_probs = _distribution_targets(batch, input_map)
    logits = draft.lm_head(hidden[rows, cols])[:, :unk_row]  # the UNK row is never proposed
    log_q = torch.log_softmax(logits, dim=-1)
    probs = topk_probs * (topk_rows != unk_row)  # mass outside the map is lost
    cross_entropy = -(probs * log_q.gather(1, topk_rows.clamp_max(unk_row - 1))).sum(1).mean()
    loss = cross_entropy + regression_weight * regression
    return loss, float(cross_entropy.detach()), float(regression.detach())


def train_feature_draft(target_dir: str, data_dir: Path, hidden_dir: Path, work_dir: Path,
                        out_dir: Path, init_from: str, *, epochs: float = 3.0,
                        batch_size: int = 16, lr: float = 2e-4, regression_weight: float = 0.1,
                        checkpoint_every_s: float = 300.0) -> dict[str, Any]:
    """Extend the token-only draft in init_from (feature_draft_from_token_draft)."""
    started = time.monotonic()
    records = load_with_hidden(data_dir, hidden_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = work_dir / "feature-checkpoint.pt"
    token_map = read_token_map(Path(init_from))
    unk_row = len(token_map)
    input_map = input_rows(token_map, int(LlamaConfig.from_pretrained(target_dir).vocab_size))
    sample = torch.cat([r["hidden"].float() for r in records[:64]])
    draft = feature_draft_from_token_draft(init_from, int(sample.shape[-1]),
                                           float(sample.pow(2).mean().sqrt()))
    trainable = [p for p in draft.parameters() if p.requires_grad]
    steps_per_epoch = math.ceil(len(records) / batch_size)
    total_steps = int(steps_per_epoch * epochs)
    rng = random.Random(0)
    order = sorted(records, key=lambda r: len(r["prompt_ids"]) + len(r["new_ids"]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    schedule: list[list[Record]] = []
    for _ in range(math.ceil(epochs) + 1):
        rng.shuffle(batches)
        schedule.extend(batches)

    def step_loss(batch: list[Record]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, cross_entropy, regression = feature_draft_loss(draft, batch, input_map, unk_row,
                                                             regression_weight)
        return loss, {"ce": cross_entropy, "reg": regression}

    resumed_from_step, final = optimise(
        draft, trainable, schedule, total_steps, lr, step_loss, checkpoint,
        label="training feature draft", metrics=("ce", "reg"),
        checkpoint_every_s=checkpoint_every_s)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out_dir, safe_serialization=True)
    write_token_map(out_dir, token_map)
    shards = Counter(path.name.rsplit("-", 1)[0] for path in shard_paths(data_dir)
                     if (hidden_dir / path.name).exists())
    summary = {"sequences": len(records), "tokens": sum(len(r["new_ids"]) for r in records),
               "steps": total_steps, "shards": dict(sorted(shards.items())),
               "final_cross_entropy": final["ce"], "final_regression": final["reg"],
               "train_s": time.monotonic() - started, "resumed_from_step": resumed_from_step,
               "parameters": sum(p.numel() for p in draft.parameters()),
               "init_from": init_from, "lr": lr, "regression_weight": regression_weight,
               "trained_parameters": sum(p.numel() for p in trainable)}
    (work_dir / "feature_train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
