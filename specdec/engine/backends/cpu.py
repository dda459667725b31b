"""The cpu-tuned backend: row-invariant kernels, the draft's precision and compile
measured at load, and the OpenMP thread count.

On a CPU the target in bfloat16 runs its linear layers with oneDNN and its attention
row by row (specdec.engine.kernels, specdec.engine.attention): a verified row then computes exactly
what a one-row decode would, which greedy equality with the target's own decoding rests
on. The draft's precision and compilation change only its speed and acceptance, never
the output, so they follow the hardware (specdec.engine.draft_precision,
specdec.engine.draft_compile).
Off the CPU every "auto" resolves to transformers' stock kernels.
"""

from __future__ import annotations

import torch

from specdec.engine.backends.base import Backend, DraftChoice
from specdec.engine.backends.row_invariance import row_invariance
from specdec.engine.draft_precision import Precision, load_draft
from specdec.engine.fused_step import FUSED
from specdec.engine.fused_step import install as install_fused_step
from specdec.engine.models import LoadedModel, load_pretrained, row_invariance_caveat


class CpuTunedBackend(Backend):
    name = "cpu-tuned"

    def __init__(self, device: torch.device, dtype: torch.dtype, *,
                 linear_kernel: str = "auto", attention_kernel: str = "auto",
                 draft_dtype: str = "auto", draft_linear_kernel: str = "",
                 draft_compile: str = "auto", torch_threads: int = 0,
                 fused_step: str = "off") -> None:
        super().__init__(device, dtype)
        self.linear_kernel = linear_kernel
        self.attention_kernel = attention_kernel
        self.draft_dtype = draft_dtype
        self.draft_linear_kernel = draft_linear_kernel or linear_kernel
        self.draft_compile = draft_compile
        self.torch_threads = torch_threads
        self.fused_step = fused_step

    def configure_process(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)

    def load(self, name_or_path: str, *, progress: bool = False,
             target_model: str = "") -> LoadedModel:
        from specdec.engine.attention import apply_attention_kernel
        from specdec.engine.kernels import apply_linear_kernel

        loaded = load_pretrained(name_or_path, self.device, self.dtype, progress,
                                 target_model)
        linear = apply_linear_kernel(loaded.model, self.linear_kernel)
        attention = apply_attention_kernel(loaded.model, self.attention_kernel)
        loaded.precision = (f"{str(self.dtype).removeprefix('torch.')}, {linear} linear, "
                            f"{attention} attention")
        loaded.row_invariance_caveat = row_invariance_caveat(self.device, self.dtype, linear,
                                                             attention)
        loaded.row_invariant, loaded.max_invariant_rows = row_invariance(loaded.model)
        if install_fused_step(loaded.model, self.fused_step) == FUSED:
            loaded.precision += f", {FUSED}"
        return loaded

    def load_draft(self, name_or_path: str, *, target_vocab_size: int | None,
                   progress: bool = False, target_model: str = "") -> DraftChoice:
        def load(option: Precision) -> LoadedModel:
            return load_causal_lm(name_or_path, self.device, option.dtype, progress=progress,
                                  linear_kernel=option.linear_kernel,
                                  attention_kernel=self.attention_kernel,
                                  target_model=target_model,
                                  fused_step="off" if self.draft_compile == "on"
                                  else self.fused_step)

        return load_draft(load, self.device, self.draft_dtype, self.draft_linear_kernel,
                          shared_dtype=self.dtype, target_vocab_size=target_vocab_size,
                          compile_setting=self.draft_compile)

    def describe(self) -> str:
        return (f"{super().describe()}, linear {self.linear_kernel}, attention "
                f"{self.attention_kernel}, draft {self.draft_dtype}/{self.draft_linear_kernel}"
                f", draft compile {self.draft_compile}, fused step {self.fused_step}")


def load_causal_lm(name_or_path: str, device: torch.device, dtype: torch.dtype,
                   progress: bool = True, linear_kernel: str = "auto",
                   attention_kernel: str = "auto", target_model: str = "",
                   fused_step: str = "off") -> LoadedModel:
    """Load a causal LM through the cpu-tuned backend with these kernels ("auto" resolves
    to the stock kernels off the CPU). target_model: the target a draft drafts for;
    fused_step: --fused-step."""
    backend = CpuTunedBackend(device, dtype, linear_kernel=linear_kernel,
                              attention_kernel=attention_kernel, fused_step=fused_step)
    return backend.load(name_or_path, progress=progress, target_model=target_model)
