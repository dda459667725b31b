"""Whether a loaded model computes each row as it would alone, and up to how many rows.

The cpu-tuned backend's rowwise attention gives every decode-sized row the call a
one-row decode makes, and its oneDNN linear layers give a row the same bits in any
product up to a row count measured on the CPU at hand (specdec.engine.kernels). The runner
reads these two facts from here (or from LoadedModel, where the backend put them at
load), never from the kernel modules.
"""

from __future__ import annotations

from torch import nn


def row_invariance(model: nn.Module) -> tuple[bool, int | None]:
    """(rows independent of their forward, the most rows one forward may hold so; None:
    no limit known)."""
    from specdec.engine.attention import ROWWISE_NAME
    from specdec.engine.kernels import row_invariant_rows

    config = getattr(model, "config", None)
    invariant = getattr(config, "_attn_implementation", None) == ROWWISE_NAME
    return invariant, (row_invariant_rows(model) if invariant else None)
