"""Grouped-query attention for verification-sized queries, without copying K and V.

SmolLM2 has 9 query heads sharing 3 key/value heads. For one query row transformers
folds the query heads onto their K/V head ("pack_gqa"), but for the k + 1 rows of a
verification with an attention mask it expands K and V to 9 heads (`repeat_kv`): a copy
of the whole cache, every layer, every round (8.8 % of a k=1 round in the py-spy profile,
docs/benchmarks.md). Here the rows of the query heads that share a K/V head are stacked
into one taller query instead, (B, H, q, D) -> (B, H_kv, groups * q, D), with the mask
repeated per group. Each output row is the same softmax(q K^T + mask) V over the same
keys; only SDPA's blocking of query rows changes, as it already does with q.

Registered with transformers' AttentionInterface as "specdec_grouped_sdpa"; queries of one
row or more than MAX_QUERY_ROWS (a prefill) go to transformers' own SDPA function.

"rowwise" ("specdec_rowwise_sdpa") is the kernel that makes a verification exact in
reduced precision. SDPA's result for a query row depends on how many keys the call holds
(its blocking of the key axis), not only on the keys the row may see: in bfloat16 the row
of a 4-row verification and the same token decoded alone differed by up to 0.4 in the
logits, and greedy speculative output left the target's own on half the prompts. So every
decode-sized call (1 to MAX_QUERY_ROWS rows) computes each row alone, over exactly its
visible keys: the call a one-row decode of that token makes. A row's output is then the
same whichever forward it was part of. The price is a loop of SDPA calls per layer
(one per row), paid where the rows share a forward anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "specdec_grouped_sdpa"
ROWWISE_NAME = "specdec_rowwise_sdpa"
ATTENTION_KERNELS = ("auto", "sdpa", "grouped", "rowwise")
MAX_QUERY_ROWS = 16


def grouped_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    groups = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, q_length, head_dim = query.shape
    if groups == 1 or not 1 < q_length <= MAX_QUERY_ROWS or kwargs.get("position_bias") \
            is not None or (attention_mask is not None and attention_mask.dim() != 4):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    kv_heads, kv_length = key.shape[1], key.shape[2]
    if attention_mask is None:  # causal, with the queries at the end of the keys
        rows = torch.arange(kv_length - q_length, kv_length, device=query.device)
        attention_mask = (torch.arange(kv_length, device=query.device) <= rows[:, None])
        attention_mask = attention_mask[None, None]
    mask = attention_mask[..., :kv_length]  # transformers' convention: key positions from 0
    # Head h uses K/V head h // groups, so heads of one group are adjacent in dim 1.
    stacked_query = query.reshape(batch, kv_heads, groups * q_length, head_dim)
    mask_heads = mask.shape[1]
    if mask_heads == 1:
        stacked_mask = mask.expand(-1, groups, -1, -1).reshape(mask.shape[0], 1,
                                                               groups * q_length, kv_length)
    else:  # a per-head mask: regroup it like the query
        stacked_mask = mask.expand(-1, heads, -1, -1).reshape(mask.shape[0], kv_heads,
                                                              groups * q_length, kv_length)
    out = F.scaled_dot_product_attention(stacked_query, key, value, attn_mask=stacked_mask,
                                         dropout_p=dropout, scale=scaling)
    out = out.reshape(batch, heads, q_length, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def rowwise_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    batch, heads, q_length, head_dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    visible = None
    if batch == 1 and q_length <= MAX_QUERY_ROWS and kwargs.get("position_bias") is None:
        visible = _visible_keys(attention_mask, q_length, kv_length)
    if visible is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    groups = heads // kv_heads
    rows = []
    for row, (prefix, extra) in enumerate(visible):
        row_key, row_value = key[:, :, :prefix], value[:, :, :prefix]
        if extra is not None:
            # A token-tree row (an alternative beside the chain): its prefix, then itself;
            # the same keys in the same order as the one-row decode of that token.
            row_key = torch.cat([row_key, key[:, :, extra:extra + 1]], dim=2)
            row_value = torch.cat([row_value, value[:, :, extra:extra + 1]], dim=2)
        # The query heads of one K/V head stacked as rows of one query, as in the grouped
        # kernel: (1, H_kv, groups, D) against that head's keys, no mask needed.
        stacked_query = query[:, :, row].reshape(batch, kv_heads, groups, head_dim)
        out = F.scaled_dot_product_attention(stacked_query, row_key, row_value,
                                             dropout_p=dropout, scale=scaling)
        rows.append(out.reshape(batch, heads, value.shape[-1]))
    return torch.stack(rows, dim=1), None  # (B, q, H, D), as transformers expects


# Every layer of a forward gets the same mask object; it is read once per forward.
_last_mask: tuple[torch.Tensor | None, list[tuple[int, int | None]] | None] = (None, None)


def _visible_keys(mask: torch.Tensor | None, q_length: int, kv_length: int
                  ) -> list[tuple[int, int | None]] | None:
    """Per query row: (prefix, extra) when the row sees keys [0, prefix) plus the key at
    `extra` (None: the prefix alone); None when some row sees another pattern."""
    global _last_mask
    if mask is None:  # causal, with the queries at the end of the keys
        return [(kv_length - q_length + row + 1, None) for row in range(q_length)]
    cached_mask, cached = _last_mask  # one read: runners in other threads replace it
    if cached_mask is mask:
        return cached
    visible = _mask_patterns(mask, q_length, kv_length)
    _last_mask = (mask, visible)
    return visible


def _mask_patterns(mask: torch.Tensor, q_length: int, kv_length: int
                   ) -> list[tuple[int, int | None]] | None:
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1:
        return None
    allowed = mask[0, 0, -q_length:, :kv_length]
    allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    allowed = allowed.cpu()
    visible: list[tuple[int, int | None]] = []
    for row in allowed:
        count = int(row.sum())
        prefix = int(row.int().cumprod(0).sum())  # leading visible keys
        if count == prefix and prefix > 0:
            visible.append((prefix, None))
        elif count == prefix + 1:
            visible.append((prefix, int(row[prefix:].int().argmax()) + prefix))
        else:
            return None
    return visible


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionInterface.register(ROWWISE_NAME, rowwise_sdpa_forward)
# Without a registered mask function transformers builds no mask at all for an unknown
# attention name; SDPA's own masks are what both paths expect.
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionMaskInterface.register(ROWWISE_NAME, sdpa_mask)


def resolve_attention(kernel: str, device: torch.device,
                      dtype: torch.dtype = torch.float32) -> str:
    """auto: rowwise for reduced precision on CPU (exact verification needs it there and
    costs little), grouped for float32 on CPU, transformers' SDPA elsewhere."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose from "
                         f"{', '.join(ATTENTION_KERNELS)}")
    if kernel == "auto":
        if device.type != "cpu":
            return "sdpa"
        return "grouped" if dtype == torch.float32 else "rowwise"
    return kernel


def apply_attention_kernel(model: nn.Module, kernel: str) -> str:
    """Switch a loaded model's attention to `kernel`; returns the kernel used."""
    parameter = next(model.parameters())
    chosen = resolve_attention(kernel, parameter.device, parameter.dtype)
    current = str(getattr(getattr(model, "config", None), "_attn_implementation", None))
    if current not in ("sdpa", NAME, ROWWISE_NAME):
        return current  # eager, flash, ... models keep their own
    implementation = {"grouped": NAME, "rowwise": ROWWISE_NAME}.get(chosen, "sdpa")
    model.set_attn_implementation(implementation)  # type: ignore[operator]
    return chosen
