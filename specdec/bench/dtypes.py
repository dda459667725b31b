"""Load the pair in a given numeric format for the cost comparison.

"float32", "bfloat16", "float16": weights and activations in that dtype.
"int8": what `--dtype int8` serves: int8 linear weights, bfloat16 activations
(specdec.engine.int8); "auto": what `--dtype auto` serves (int8 where its operator runs,
else bfloat16). Every format loads with the bench's --fused-step, as the services do.
"FORMAT@KERNEL" (e.g. "float32@torch") also picks the linear kernel (specdec.engine.kernels),
and "FORMAT@KERNEL@ATTENTION" (e.g. "float32@skinny@sdpa") the attention kernel
(specdec.engine.attention); without them the bench's --linear-kernel / --attention-kernel apply.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from specdec.engine.runner import ModelRunner

FORMATS = ("float32", "bfloat16", "float16", "int8", "auto")


class PairSettings(Protocol):
    """The bench settings a format's pair is loaded with (BenchSettings has them)."""

    target_model: str
    draft_model: str
    linear_kernel: str
    attention_kernel: str
    fused_step: str


def load_runners(settings: PairSettings, label: str) -> tuple[ModelRunner, ModelRunner]:
    from specdec.engine.attention import ATTENTION_KERNELS
    from specdec.engine.backends.cpu import load_causal_lm
    from specdec.engine.kernels import KERNELS
    from specdec.engine.models import parse_dtype
    from specdec.settings import linear_kernel_for

    name, _, kernels = label.partition("@")
    kernel, _, attention = kernels.partition("@")
    kernel = kernel or settings.linear_kernel
    attention = attention or settings.attention_kernel
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {attention!r} in {label!r}; "
                         f"choose from {', '.join(ATTENTION_KERNELS)}")
    if name not in FORMATS and name not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"unknown format {name!r}; choose from {', '.join(FORMATS)}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r} in {label!r}; "
                         f"choose from {', '.join(KERNELS)}")
    kernel = linear_kernel_for(name, kernel)
    dtype = parse_dtype(name)
    cpu = torch.device("cpu")
    target = load_causal_lm(settings.target_model, cpu, dtype, progress=False,
                            linear_kernel=kernel, attention_kernel=attention,
                            fused_step=settings.fused_step)
    draft = load_causal_lm(settings.draft_model, cpu, dtype, progress=False,
                           linear_kernel=kernel, attention_kernel=attention,
                           target_model=settings.target_model, fused_step=settings.fused_step)
    target_model: Any = target.model
    draft_model: Any = draft.model
    vocab = int(target_model.config.vocab_size)
    return (ModelRunner(target_model),
            ModelRunner(draft_model, target_vocab_size=vocab, token_map=draft.token_map))
