"""transformers baselines: `generate` with the target alone, and assisted generation.

The default draft has a reduced vocabulary (token_map.json), which transformers'
assisted generation cannot use directly: FullVocabDraft shows it through the target's
vocabulary (inputs mapped to draft rows, logits scattered into a -inf row of the target's
width), the same view specdec's VocabAdapter gives, at the cost of one scatter per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from specdec.bench.configs import HF_ASSISTED, BenchConfig, RunRecord, SamplingMode
from specdec.engine.attention import apply_attention_kernel
from specdec.engine.kernels import apply_linear_kernel


class FullVocabDraft(LlamaForCausalLM):
    """A reduced-vocabulary Llama draft answering in the target's vocabulary."""

    def attach_map(self, token_map: torch.Tensor, target_vocab: int) -> FullVocabDraft:
        rows = token_map.shape[0]
        input_map = torch.full((target_vocab,), rows, dtype=torch.long)  # UNK row
        input_map[token_map] = torch.arange(rows)
        self._input_map = input_map
        self._token_map = token_map.clone()
        self._rows = rows
        self._target_vocab = target_vocab
        self.config.vocab_size = target_vocab  # what generate() compares with the target's
        return self

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if input_ids is not None:
            input_ids = self._input_map[input_ids]
        out = super().forward(input_ids=input_ids, **kwargs)
        logits = out.logits[..., : self._rows]
        full = logits.new_full((*logits.shape[:-1], self._target_vocab), float("-inf"))
        full[..., self._token_map] = logits
        out.logits = full
        return out


def hf_draft(model: Any, token_map: torch.Tensor | None, target_vocab: int,
             source: str, dtype: torch.dtype, linear_kernel: str = "auto",
             attention_kernel: str = "auto") -> Any:
    """The draft as transformers' assistant_model (same kernels as specdec's)."""
    if token_map is None:
        return model
    draft = FullVocabDraft.from_pretrained(source, dtype=dtype).eval()
    apply_linear_kernel(draft, linear_kernel)
    apply_attention_kernel(draft, attention_kernel)
    return draft.attach_map(token_map, target_vocab)


@contextmanager
def count_calls(model: torch.nn.Module) -> Iterator[list[int]]:
    calls = [0]
    handle = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


def generation_config(base: GenerationConfig, mode: SamplingMode, max_new_tokens: int,
                      eos: tuple[int, ...]) -> GenerationConfig:
    config = GenerationConfig.from_dict(base.to_dict())
    config.max_new_tokens = max_new_tokens
    config.do_sample = mode.temperature > 0
    config.temperature = mode.temperature if mode.temperature > 0 else None
    config.top_p = mode.top_p if mode.temperature > 0 and mode.top_p < 1 else None
    config.top_k = None  # specdec's top-k is off in these modes; transformers defaults to 50
    config.eos_token_id = list(eos) or None
    config.pad_token_id = eos[0] if eos else 0
    return config


@torch.inference_mode()
def run_hf(config: BenchConfig, mode: SamplingMode, target: Any, draft: Any | None,
           prompt_ids: list[int], max_new_tokens: int, eos: tuple[int, ...],
           seed: int) -> RunRecord:
    """One transformers generation; rounds = target forwards (the first one prefills)."""
    gen_config = generation_config(target.generation_config, mode, max_new_tokens, eos)
    kwargs: dict[str, Any] = {"generation_config": gen_config}
    if config.system == HF_ASSISTED:
        kwargs["assistant_model"] = draft
    ids = torch.tensor([prompt_ids], device=next(target.parameters()).device)
    torch.manual_seed(seed)
    with count_calls(target) as target_calls, \
            count_calls(draft if draft is not None else target) as draft_calls:
        started = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - started
    new = out[0, len(prompt_ids):].tolist()
    rounds = target_calls[0]
    record = RunRecord(config.name, config.system, config.length, mode.name, "", "", 0,
                       len(prompt_ids), len(new), seconds, rounds=rounds,
                       token_ids=new if mode.temperature == 0 else [])
    if config.system == HF_ASSISTED and draft is not None:
        # Each draft forward proposes one token; each target call emits the accepted
        # ones plus its own.
        record.draft_tokens = draft_calls[0]
        record.num_drafts = rounds
        record.accepted_tokens = max(0, len(new) - rounds)
    return record
