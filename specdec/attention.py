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
ATTENTION_KERNELS = ("auto", "sdpa", "grouped")
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


AttentionInterface.register(NAME, grouped_sdpa_forward)
# Without a registered mask function transformers builds no mask at all for an unknown
# attention name; SDPA's own masks are what both paths expect.
AttentionMaskInterface.register(NAME, sdpa_mask)


def resolve_attention(kernel: str, device: torch.device) -> str:
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose from "
                         f"{', '.join(ATTENTION_KERNELS)}")
    if kernel == "auto":
        return "grouped" if device.type == "cpu" else "sdpa"
    return kernel


def apply_attention_kernel(model: nn.Module, kernel: str) -> str:
    """Switch a loaded model's attention to `kernel`; returns the kernel used."""
    parameter = next(model.parameters())
    chosen = resolve_attention(kernel, parameter.device)
    current = str(getattr(getattr(model, "config", None), "_attn_implementation", None))
    if current not in ("sdpa", NAME):
        return current  # eager, flash, ... models keep their own
    model.set_attn_implementation(NAME if chosen == "grouped" else "sdpa")  # type: ignore[operator]
    return chosen
