"""Distil a small Llama draft from the target's top-k distributions.

The draft starts as the target's first layers with the target's own embeddings, restricted
to the tokens the target actually emits (a reduced vocabulary plus one UNK input row), and
learns to match the target's distribution with a KL loss. Checkpoints every few minutes;
`train(...)` resumes from the last one.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.draft_training.optimise import optimise
from specdec.engine.token_map import has_token_map, input_rows, read_token_map, write_token_map

Record = dict[str, torch.Tensor]


def shard_paths(data_dir: Path) -> list[Path]:
    """Every prompt set's shards: "<prefix>-NNNNN.pt" (datagen.PROMPT_SETS)."""
    return sorted(data_dir.glob("*-[0-9][0-9][0-9][0-9][0-9].pt"))


def load_shards(data_dir: Path) -> list[dict[str, Any]]:
    shards = [torch.load(path) for path in shard_paths(data_dir)]
    if not any(shard["records"] for shard in shards):
        raise FileNotFoundError(f"no distillation shards in {data_dir}; run datagen first")
    return shards


def records_of(shards: list[dict[str, Any]]) -> list[Record]:
    return [record for shard in shards for record in shard["records"]]


def describe_shards(shards: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """How the shards were decoded: shard counts per temperature and per target dtype.
    Shards written before these were recorded are the pipeline's first recipe: float32,
    alternating greedy and T=1 by shard index."""
    temperatures: Counter[str] = Counter()
    dtypes: Counter[str] = Counter()
    for shard in shards:
        temperature = shard.get("temperature", 0.0 if shard["greedy"] else 1.0)
        temperatures[f"{temperature:g}"] += 1
        dtypes[shard.get("dtype", "float32")] += 1
    return {"temperatures": dict(sorted(temperatures.items())), "dtypes": dict(dtypes)}


def build_token_map(records: list[Record], size: int, always: list[int]) -> list[int]:
    """Target ids the draft can propose: the most probable mass in the target's outputs."""
    mass: dict[int, float] = {}
    for record in records:
        for ids, probs in zip(record["topk_ids"].tolist(), record["topk_probs"].float().tolist(),
                              strict=True):
            for token, prob in zip(ids, probs, strict=True):
                mass[token] = mass.get(token, 0.0) + prob
        for token in record["prompt_ids"].tolist():  # so prompts lose little as inputs
            mass[token] = mass.get(token, 0.0) + 0.1
    chosen = [token for token in always if token not in mass] + sorted(mass, key=mass.__getitem__,
                                                                   reverse=True)
    return sorted(set(chosen[:size]) | set(always))


def make_draft(target_dir: str, token_map: list[int], num_layers: int) -> LlamaForCausalLM:
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    base = target.config
    config = LlamaConfig(
        vocab_size=len(token_map) + 1, hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads, head_dim=base.head_dim,
        max_position_embeddings=base.max_position_embeddings, rms_norm_eps=base.rms_norm_eps,
        rope_parameters=base.rope_parameters, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    draft = LlamaForCausalLM(config)
    with torch.no_grad():
        rows = torch.tensor(token_map)
        embed = target.model.embed_tokens.weight
        draft.model.embed_tokens.weight[: len(token_map)] = embed[rows]
        draft.model.embed_tokens.weight[len(token_map)] = embed.mean(0)  # UNK input row
        for index in range(num_layers):
            draft.model.layers[index].load_state_dict(target.model.layers[index].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.tie_weights()
    return draft


def _batches(records: list[Record], batch_size: int, rng: random.Random) -> list[list[Record]]:
    order = sorted(records, key=lambda r: len(r["prompt_ids"]) + len(r["new_ids"]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def right_pad(sequences: Sequence[torch.Tensor], pad: float = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences stacked along a new first dimension, right-padded with `pad` to the
    longest, and the attention mask [B, width] (1 on real positions, int64)."""
    padded = torch.nn.utils.rnn.pad_sequence(list(sequences), batch_first=True,
                                             padding_value=pad)
    lengths = torch.tensor([len(s) for s in sequences])
    mask = (torch.arange(padded.shape[1])[None] < lengths[:, None]).long()
    return padded, mask


def _loss(draft: LlamaForCausalLM, batch: list[Record], input_map: torch.Tensor,
          unk_row: int) -> torch.Tensor:
    ids, mask = right_pad([input_map[torch.cat([r["prompt_ids"], r["new_ids"]]).long()]
                           for r in batch], pad=unk_row)
    device = draft.device  # records stay on the CPU; the step runs where the draft is
    hidden = draft.model(input_ids=ids.to(device),
                         attention_mask=mask.to(device)).last_hidden_state
    rows, cols, target_rows, target_probs = [], [], [], []
    for row, record in enumerate(batch):
        start = len(record["prompt_ids"]) - 1
        length = len(record["new_ids"])
        rows.append(torch.full((length,), row))
        cols.append(torch.arange(start, start + length))
        target_rows.append(input_map[record["topk_ids"].long()])
        target_probs.append(record["topk_probs"].float())
    picked = hidden[torch.cat(rows).to(device), torch.cat(cols).to(device)]
    logits = draft.lm_head(picked)[:, :unk_row]  # the UNK row is never proposed
    log_q = torch.log_softmax(logits.float(), dim=-1)
    topk_rows = torch.cat(target_rows).to(device)
    # mass outside the map is lost
    probs = torch.cat(target_probs).to(device) * (topk_rows != unk_row)
    log_q_at = log_q.gather(1, topk_rows.clamp_max(unk_row - 1))
    return -(probs * log_q_at).sum(1).mean()


def load_draft(draft_dir: Path) -> tuple[LlamaForCausalLM, list[int]]:
    """A trained draft and its token map, to continue distilling it on new data."""
    draft = LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    token_map = read_token_map(draft_dir)
    return draft, token_map


def _card_training_section(draft_dir: Path | None) -> list[str]:
    """The "Training data" lines of the continued draft's model card, so the new card can
    say how the starting point was made."""
    card = draft_dir / "README.md" if draft_dir is not None else None
    if card is None or not card.exists():
        return []
    lines = card.read_text().splitlines()
    try:
        start = lines.index("## Training data") + 1
    except ValueError:
        return []
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [line for line in lines[start:end] if line.strip()]


def train(target_dir: str, data_dir: Path, work_dir: Path, out_dir: Path, *,
          vocab_size: int = 8192, num_layers: int = 2, epochs: float = 2.0,
          batch_size: int = 16, lr: float = 5e-4, checkpoint_every_s: float = 300.0,
          eos_ids: tuple[int, ...] = (1, 2), init_draft: Path | None = None) -> dict[str, Any]:
    """Distil a draft from the shards in data_dir: a new one initialised from the target,
    or, with init_draft, that trained draft (same token map and layers) continued."""
    started = time.monotonic()
    shards = load_shards(data_dir)  # one read: records and how they were decoded
    records = records_of(shards)
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = work_dir / "checkpoint.pt"
    if init_draft is not None:
        draft, token_map = load_draft(init_draft)
    else:
        token_map = (read_token_map(work_dir) if has_token_map(work_dir)
                     else build_token_map(records, vocab_size, list(eos_ids)))
        draft = make_draft(target_dir, token_map, num_layers)
    write_token_map(work_dir, token_map)
    unk_row = len(token_map)
    input_map = input_rows(token_map, int(LlamaConfig.from_pretrained(target_dir).vocab_size))
    rng = random.Random(0)
    steps_per_epoch = math.ceil(len(records) / batch_size)
    total_steps = int(steps_per_epoch * epochs)
    schedule = [b for _ in range(math.ceil(epochs) + 1) for b in _batches(records, batch_size, rng)]

    def step_loss(batch: list[Record]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = _loss(draft, batch, input_map, unk_row)
        return loss, {"loss": float(loss.detach())}

    resumed_from_step, final = optimise(
        draft, list(draft.parameters()), schedule, total_steps, lr, step_loss, checkpoint,
        label="training draft", metrics=("loss",), checkpoint_every_s=checkpoint_every_s)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out_dir, safe_serialization=True)
    write_token_map(out_dir, token_map)
    tokens = sum(len(r["new_ids"]) for r in records)
    per_set = Counter(path.name.rsplit("-", 1)[0] for path in shard_paths(data_dir))
    summary = {"sequences": len(records), "tokens": tokens, "steps": total_steps,
               "shards": dict(sorted(per_set.items())), **describe_shards(shards),
               "final_loss": final["loss"], "lr": lr, "epochs": epochs,
               "init_draft": str(init_draft) if init_draft is not None else None,
               "init_card": _card_training_section(init_draft),
               "train_s": time.monotonic() - started, "resumed_from_step": resumed_from_step,
               "parameters": sum(p.numel() for p in draft.parameters())}
    (work_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
