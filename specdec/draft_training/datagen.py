"""Distillation data: the target's own continuations and its top-k distribution per position.

Each shard is one batch of prompts, written atomically as shard-NNNNN.pt, so an
interrupted run resumes at the first missing shard. Shard i decodes at
temperatures[i % len(temperatures)]: by default even shards greedily (the contexts a T=0
request produces) and odd shards at T=1 (the contexts of sampled requests). Every shard
stores the target's unprocessed T=1 distribution, which is what the draft learns.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdec.draft_training.handwritten import handwritten_texts, normal
from specdec.draft_training.prompts import Prompt, generate_prompts, split
from specdec.draft_training.wide_prompts import generate_wide_prompts

# Shard file prefix per prompt set; "shard" is the templated set's historical name.
PROMPT_SETS = {"templated": ("shard", generate_prompts), "wide": ("wide", generate_wide_prompts)}


def interleave_by_category(prompts: list[Prompt]) -> list[Prompt]:
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    mixed = itertools.chain.from_iterable(itertools.zip_longest(*by_category.values()))
    return [p for p in mixed if p is not None]


def training_split(prompt_set: str) -> list[Prompt]:
    """A prompt set's training prompts, categories interleaved, without any that equals a
    user turn of the hand-written held-out set up to case and spacing."""
    train, _ = split(PROMPT_SETS[prompt_set][1]())
    return interleave_by_category([p for p in train if normal(p.text) not in handwritten_texts()])


def generate_shards(target_dir: str, out_dir: Path, batch_size: int = 48,
                    max_new_tokens: int = 128, top_k: int = 16, max_shards: int = 100,
                    time_budget_s: float = float("inf"), prompt_set: str = "templated",
                    dtype: torch.dtype = torch.float32,
                    temperatures: tuple[float, ...] = (0.0, 1.0), seed: int = 0) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    prefix = PROMPT_SETS[prompt_set][0]
    prompts = training_split(prompt_set)
    num_shards = min(max_shards, len(prompts) // batch_size)
    started = time.monotonic()
    columns = (TextColumn(f"distillation data ({prompt_set} prompts)"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[tokens]} tokens"))
    with Progress(*columns) as bar:
        task = bar.add_task("shards", total=num_shards, tokens=0)
        total_tokens = 0
        for shard in range(num_shards):
            path = out_dir / f"{prefix}-{shard:05d}.pt"
            if path.exists():
                bar.advance(task)
                continue
            if time.monotonic() - started > time_budget_s:
                break
            batch = prompts[shard * batch_size:(shard + 1) * batch_size]
            chats = [tokenizer.apply_chat_template([{"role": "user", "content": p.text}],
                                                   add_generation_prompt=True, tokenize=False)
                     for p in batch]
            encoded = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
            temperature = temperatures[shard % len(temperatures)]
            greedy = temperature == 0.0
            torch.manual_seed(seed * 1_000_003 + shard)  # a resumed shard samples the same text
            with torch.no_grad():
                out = model.generate(
                    **encoded, max_new_tokens=max_new_tokens, do_sample=not greedy,
                    temperature=temperature if not greedy else 1.0, top_k=0, top_p=1.0,
                    return_dict_in_generate=True,
                    output_logits=True, pad_token_id=tokenizer.eos_token_id)
            logits = torch.stack(out.logits, dim=1)  # [B, new, V]
            top = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
            prompt_len = encoded["input_ids"].shape[1]
            records = []
            for row in range(len(batch)):
                prompt_ids = encoded["input_ids"][row][encoded["attention_mask"][row].bool()]
                new_ids = out.sequences[row, prompt_len:]
                eos_at = (new_ids == tokenizer.eos_token_id).nonzero()
                length = int(eos_at[0]) + 1 if len(eos_at) else new_ids.shape[0]
                records.append({
                    "category": batch[row].category,
                    "prompt_ids": prompt_ids.to(torch.int32),
                    "new_ids": new_ids[:length].to(torch.int32),
                    "topk_ids": top.indices[row, :length].to(torch.int32),
                    "topk_probs": top.values[row, :length].to(torch.float16),
                })
                total_tokens += length
            tmp = path.with_suffix(".tmp")
            torch.save({"greedy": greedy, "temperature": temperature,
                        "dtype": str(dtype).removeprefix("torch."), "records": records}, tmp)
            tmp.rename(path)
            bar.update(task, advance=1, tokens=total_tokens)
