"""The linear-layer kernel for decoding-sized batches, chosen by measurement.

Decoding multiplies a few rows (1 token, or the k + 1 of a verification) by every weight
matrix, so it is bound by reading the weights. On the CPUs measured here (AMD EPYC, MKL,
float32), `F.linear` does that badly for small row counts: one row goes through a GEMV at
~10 GB/s, and 2-9 rows through a GEMM path that is slower still (T_target(2) about twice
T_target(1) for SmolLM2-135M). Computing the transposed product W @ x^T instead reads the
weights at ~24 GB/s, provided x is row-major (with x^T contiguous the same call is ~5x
slower), and padding an odd row count to an even one avoids a slow edge case.
Measured with SmolLM2-135M on 2 threads: T_target(1) 67 -> 37-44 ms, T_draft(1) 6.8 ->
3.0 ms, T_target(4) 91 -> 54 ms (`specdec bench --costs-only --compare-dtypes
float32@torch,float32@skinny` reproduces this).

The product is the same matrix product; only the floating-point summation order differs
(logits agree to ~1e-3 of magnitude ~10), exactly as they already differ between a 1-row
and a (k+1)-row forward. It changes nothing else: bfloat16, float16, CUDA and prefills
(more than SKINNY_MAX_ROWS rows) keep `F.linear`, which is as fast or faster there.

Kernels: "torch" (F.linear everywhere), "skinny" (the above), "auto" (skinny for float32
on CPU, torch otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("auto", "torch", "skinny")
SKINNY_MAX_ROWS = 16  # beyond this (a prefill) the regular GEMM path is efficient


class SkinnyLinear(nn.Linear):
    """nn.Linear computing small-row products as (W @ x^T)^T."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        features = input.shape[-1]
        rows = input.numel() // features if features else 0
        if not 0 < rows <= SKINNY_MAX_ROWS or input.dtype != torch.float32 \
                or input.device.type != "cpu":
            return F.linear(input, self.weight, self.bias)
        flat = input.reshape(rows, features)
        if rows % 2:
            flat = torch.cat([flat, flat[:1]])  # the odd-row path is the slow one
        # Row-major x only: with x^T contiguous MKL takes a path ~5x slower. The output is
        # made row-major too, or the next layer's input would be the slow layout.
        out = torch.mm(self.weight, flat.contiguous().t()).t()[:rows].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*input.shape[:-1], self.out_features)


def resolve_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    if kernel == "auto":
        return "skinny" if device.type == "cpu" and dtype == torch.float32 else "torch"
    return kernel


def apply_linear_kernel(model: nn.Module, kernel: str) -> str:
    """Switch every nn.Linear of model (in place, weights and ties kept) to kernel.

    Returns the kernel in use ("auto" resolved from the model's device and dtype).
    """
    parameter = next(model.parameters())
    chosen = resolve_kernel(kernel, parameter.device, parameter.dtype)
    new_class = SkinnyLinear if chosen == "skinny" else nn.Linear
    for module in model.modules():
        if type(module) in (nn.Linear, SkinnyLinear):
            module.__class__ = new_class
    return chosen
