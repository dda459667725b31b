"""What this CPU's kernels can do, for tests whose expectations depend on it (tests only).

bfloat16's row-invariant linear kernel is oneDNN's, which needs the CPU's bfloat16
support (AVX-512 or AVX-NE-CONVERT). Without it (an AVX2-only CPU) --dtype bfloat16's
auto kernel is F.linear, for which no row-invariance is claimed, and the int8 kernel is
the row-invariant one in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from specdec.engine.kernels import onednn_available, resolve_kernel

ONEDNN_BF16 = onednn_available(torch.bfloat16)
# What --linear-kernel auto resolves to for bfloat16 weights on this CPU.
BF16_AUTO_LINEAR = resolve_kernel("auto", torch.device("cpu"), torch.bfloat16)
# A row-invariant linear kernel for a model in bfloat16 on this CPU.
ROW_INVARIANT_BF16_LINEAR = "onednn" if ONEDNN_BF16 else "int8"
needs_onednn_bf16 = pytest.mark.skipif(
    not ONEDNN_BF16, reason="this CPU has no oneDNN bfloat16 (no AVX-512 or AVX-NE-CONVERT)")
