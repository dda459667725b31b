"""Grouped-query attention for verification-sized queries, without copying K and V.

SmolLM2 has 9 query heads sharing 3 key/value heads. For one query row transformers
folds the query heads onto their K/V head ("pack_gqa"), but for the k + 1 rows of a
verification with an attention mask it expands K and V to 9 heads (`repeat_kv`): a copy
of the whole cache, every layer, every round (a visible share of a round in a py-spy
profile). Here the rows of the query heads that share a K/V head are stacked
into one taller query instead, (B, H, q, D) -> (B, H_kv, groups * q, D), with the mask
repeated per group. Each output row is the same softmax(q K^T + mask) V over the same
keys; only SDPA's blocking of query rows changes, as it already does with q.

Registered with transformers' AttentionInterface as "specdec_grouped_sdpa"; queries of one
row or more than DECODE_ROWS (a prefill) go to transformers' own SDPA function.

"rowwise" ("specdec_rowwise_sdpa") is the kernel that makes a verification exact in
reduced precision. SDPA's result for a query row depends on how many keys the call holds
(its blocking of the key axis), not only on the keys the row may see: in bfloat16 the row
of a verification and the same token decoded alone differ in the logits, and greedy
speculative output leaves the target's own wherever two logits are that close. So every
decode-sized call (1 to DECODE_ROWS rows) computes each row alone, over exactly its
visible keys: the call a one-row decode of that token makes. A row's output is then the
same whichever forward it was part of.

In bfloat16 on a CPU the calls go to a C++ operator of ours instead
(csrc/rowwise_attention.cpp, `torch.ops.specdec.rowwise_attention`, built on first use
like the int8 product): one call per layer for all of a sequence's rows, each row over
exactly its visible keys in a fixed order, so each row gets the same bits in any forward
by construction. Where the operator cannot build (no C++ compiler) the rows take SDPA
calls as below, with the same guarantee and other bits.

With SDPA, one call per row costs an SDPA call per extra row per layer of a
verification (the grouped kernel stays flat). Rows whose visible-key counts share a
block of KEY_BLOCK keys may share one masked call over the block's longest prefix, but
whether a masked call over L >= n keys gives a row with n visible keys the same bits as
a call over exactly n keys depends on the CPU's SDPA kernel: on some hosts it holds within a vector
width of keys, on others (AMD EPYC with AVX-512 here) only for L == n. KEY_BLOCK = 1
therefore gives every chain row its own call, which is invariant on any CPU;
tests/test_attention.py checks the result bit for bit on the machine it runs on. A
token-tree row sees its ancestors' keys out of order, so it keeps a call of its own over
its prefix, its ancestors and itself.

Several sessions' rows run in one forward as a PackedBatch: each session's rows get the
calls above over that session's keys alone, so batching changes no row's attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.engine.cpu_operators import OptionalOperators
from specdec.engine.shapes import DECODE_ROWS

log = logging.getLogger(__name__)

NAME = "specdec_grouped_sdpa"
ROWWISE_NAME = "specdec_rowwise_sdpa"
# transformers' own SDPA function, registered under a name of ours so that it also runs
# packed batches (PackedBatch); the "sdpa" kernel choice installs it.
SDPA_NAME = "specdec_sdpa"
PACKABLE = (NAME, ROWWISE_NAME, SDPA_NAME)  # implementations that run a PackedBatch
ATTENTION_KERNELS = ("auto", "sdpa", "grouped", "rowwise")
KEY_BLOCK = 1
# The forward kwarg that carries a PackedBatch down to the attention functions
# (transformers passes a forward's extra kwargs through to them).
PACKING_KWARG = "specdec_packing"


def grouped_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    packing = kwargs.pop(PACKING_KWARG, None)
    if packing is not None:
        return packing.attend(module, query, grouped_sdpa_forward, dropout, scaling, kwargs)
    groups = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, q_length, head_dim = query.shape
    if groups == 1 or not 1 < q_length <= DECODE_ROWS or kwargs.get("position_bias") \
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
    packing = kwargs.pop(PACKING_KWARG, None)
    if packing is not None:
        return packing.attend(module, query, rowwise_sdpa_forward, dropout, scaling, kwargs)
    batch, heads, q_length, head_dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    plan = None
    if batch == 1 and kwargs.get("position_bias") is None:
        plan = row_plan_for(attention_mask, q_length, kv_length, groups, query.device)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    return _rowwise_calls(query, key, value, plan, dropout, scaling), None


_native = OptionalOperators("specdec_rowwise_attention", "rowwise_attention.cpp",
                           ("rowwise_attention",),
                           "each row takes an SDPA call of its own instead",
                           # The vector paths repeat the scalar code's rounding: no fused
                           # multiply-adds anywhere.
                           flags=("-ffp-contract=off",))


def native_rowwise_attention() -> Callable[..., torch.Tensor] | None:
    """The C++ rowwise attention operator, built or loaded on first call; None where it
    cannot build here (logged once), and the rows then take SDPA calls."""
    operators = _native.get()
    return None if operators is None else operators[0]


def _native_runs(query: torch.Tensor, key: torch.Tensor, dropout: float) -> bool:
    return (query.device.type == "cpu" and query.dtype == key.dtype == torch.bfloat16
            and dropout == 0.0 and query.shape[0] == 1)


def _rowwise_calls(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   plan: RowPlan, dropout: float, scaling: float | None) -> torch.Tensor:
    """The rowwise kernel for one sequence's rows (a RowPlan): the C++ operator where it
    runs, else the plan's SDPA calls."""
    batch, heads, q_length, head_dim = query.shape
    if _native_runs(query, key, dropout):
        native = native_rowwise_attention()
        if native is not None:
            scale = head_dim ** -0.5 if scaling is None else scaling
            out = native(query[0], key[0], value[0], plan.prefixes, plan.extras,
                         plan.extra_counts, float(scale))
            return out.unsqueeze(0)  # (B, q, H, D), as transformers expects
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    out = query.new_empty(batch, q_length, heads, value.shape[-1])
    for call in plan.calls:
        if call.slots is not None and call.rows is not None:
            # Rows that see as many keys, each its own (a token-tree row: the prefix, then
            # its path in order): one call, a batch entry per row, which gives every entry
            # the bits of a call of its own, the call a one-row decode of it makes.
            picked = call.rows
            count = picked.shape[0]
            call_key = key[0][:, call.slots].transpose(0, 1)  # (rows, H_kv, keys, D)
            call_value = value[0][:, call.slots].transpose(0, 1)
            row_query = query[0][:, picked].reshape(kv_heads, groups, count, head_dim
                                                    ).permute(2, 0, 1, 3)
            # One call per row: a batched call's entries match calls of their own on one
            # thread, not always on more (SDPA splits a batch's work by thread count).
            result = torch.cat([F.scaled_dot_product_attention(
                row_query[entry:entry + 1], call_key[entry:entry + 1],
                call_value[entry:entry + 1], dropout_p=dropout, scale=scaling)
                for entry in range(count)])
            out[0, picked] = result.reshape(count, heads, value.shape[-1])
            continue
        rows = len(call.prefixes)
        call_key, call_value = key[:, :, :call.keys], value[:, :, :call.keys]
        # The query heads of one K/V head stacked as rows of one query, as in the grouped
        # kernel: (1, H_kv, rows * groups, D), row-major over (row, head of the group).
        stacked_query = query[:, :, call.start:call.start + rows].reshape(
            batch, kv_heads, groups, rows, head_dim).transpose(2, 3).reshape(
            batch, kv_heads, rows * groups, head_dim)
        result = F.scaled_dot_product_attention(stacked_query, call_key, call_value,
                                                attn_mask=call.mask, dropout_p=dropout,
                                                scale=scaling)
        out[:, call.start:call.start + rows] = result.reshape(
            batch, kv_heads, rows, groups, value.shape[-1]).transpose(1, 2).reshape(
            batch, rows, heads, value.shape[-1])
    return out  # (B, q, H, D), as transformers expects


@dataclass(frozen=True)
class _RowCall:
    """One SDPA call of the rowwise kernel: query rows start..start + len(prefixes) - 1."""

    start: int
    prefixes: tuple[int, ...]  # keys [0, prefix) each row sees
    keys: int  # the call's key count: the longest prefix
    mask: torch.Tensor | None  # (1, 1, rows * groups, keys) when the rows' prefixes differ
    # A batched call of rows that each see `keys` keys: the query rows, and each one's key
    # slots in order, (rows, keys).
    rows: torch.Tensor | None = None
    slots: torch.Tensor | None = None


@dataclass(frozen=True)
class RowPlan:
    """Which keys each of one sequence's rows sees (its leading keys [0, prefix), then
    extra_counts[row] keys of extras[row], in order), as the C++ operator takes them;
    the SDPA calls for the same rows are worked out only where they run."""

    visible: list[tuple[int, tuple[int, ...]]]
    groups: int
    device: torch.device
    prefixes: torch.Tensor  # (rows,) int64
    extras: torch.Tensor  # (rows, most extras) int64, zero-padded
    extra_counts: torch.Tensor  # (rows,) int64

    @cached_property
    def calls(self) -> list[_RowCall]:
        return _row_calls(self.visible, self.groups, self.device)


def _plan(visible: list[tuple[int, tuple[int, ...]]], groups: int,
          device: torch.device) -> RowPlan:
    width = max(len(extras) for _, extras in visible)
    extras = torch.zeros(len(visible), width, dtype=torch.long)
    for row, (_, row_extras) in enumerate(visible):
        extras[row, :len(row_extras)] = torch.tensor(row_extras, dtype=torch.long)
    return RowPlan(visible, groups, device,
                   torch.tensor([prefix for prefix, _ in visible], dtype=torch.long),
                   extras, torch.tensor([len(e) for _, e in visible], dtype=torch.long))


def _row_calls(visible: list[tuple[int, tuple[int, ...]]], groups: int,
               device: torch.device) -> list[_RowCall]:
    """Token-tree rows, with the chain rows that see as many keys, in one batched call per
    key count; the other chain rows in consecutive runs whose prefixes share a KEY_BLOCK
    block, one call each run."""
    calls: list[_RowCall] = []
    by_keys: dict[int, list[int]] = {}
    for row, (prefix, extras) in enumerate(visible):
        by_keys.setdefault(prefix + len(extras), []).append(row)
    batched: set[int] = set()
    for keys, rows in by_keys.items():
        if not any(visible[row][1] for row in rows):
            continue
        slots = torch.tensor([[*range(visible[row][0]), *visible[row][1]] for row in rows],
                             device=device)
        calls.append(_RowCall(rows[0], (), keys, None,
                              torch.tensor(rows, device=device), slots))
        batched.update(rows)
    row = 0
    while row < len(visible):
        prefix, _ = visible[row]
        if row in batched:
            row += 1
            continue
        stop = row + 1
        while stop < len(visible) and stop not in batched \
                and visible[stop][0] // KEY_BLOCK == prefix // KEY_BLOCK:
            stop += 1
        prefixes = tuple(p for p, _ in visible[row:stop])
        keys = max(prefixes)
        mask = None
        if min(prefixes) != keys:
            allowed = (torch.arange(keys, device=device)
                       < torch.tensor(prefixes, device=device)[:, None])  # (rows, keys)
            mask = allowed.repeat_interleave(groups, dim=0)[None, None]
        calls.append(_RowCall(row, prefixes, keys, mask))
        row = stop
    return calls


# Every layer of a forward gets the same mask object; its plan is worked out once per forward.
_last_plan: tuple[torch.Tensor | None, tuple[Any, ...], RowPlan | None] = (None, (), None)


def row_plan_for(mask: torch.Tensor | None, q_length: int, kv_length: int, groups: int,
                 device: torch.device) -> RowPlan | None:
    """The rowwise kernel's plan for one sequence's decode-sized rows (the same plan its
    attention call builds); None where it falls back to SDPA."""
    if q_length > DECODE_ROWS:
        return None
    return _row_plan(mask, q_length, kv_length, groups, device)


def _row_plan(mask: torch.Tensor | None, q_length: int, kv_length: int, groups: int,
              device: torch.device) -> RowPlan | None:
    """The rowwise kernel's calls for this forward; None when some row sees keys in a
    pattern it does not handle (the caller falls back to transformers' SDPA)."""
    global _last_plan
    shape = (q_length, kv_length, groups, device, KEY_BLOCK)
    cached_mask, cached_shape, cached = _last_plan  # one read: other threads replace it
    if cached_mask is mask and cached_shape == shape:
        return cached
    plan = row_plan(mask, q_length, kv_length, groups, device)
    _last_plan = (mask, shape, plan)
    return plan


def row_plan(mask: torch.Tensor | None, q_length: int, kv_length: int, groups: int,
             device: torch.device) -> RowPlan | None:
    """The rowwise kernel's calls for q_length query rows at the end of kv_length keys
    under mask (None: causal); None for a pattern it does not handle."""
    if mask is None:  # causal, with the queries at the end of the keys
        visible: list[tuple[int, tuple[int, ...]]] | None = [
            (kv_length - q_length + row + 1, ()) for row in range(q_length)]
    else:
        visible = _mask_patterns(mask, q_length, kv_length)
    return None if visible is None else _plan(visible, groups, device)


def _mask_patterns(mask: torch.Tensor, q_length: int, kv_length: int
                   ) -> list[tuple[int, tuple[int, ...]]] | None:
    """Per row: its leading visible keys, and the visible keys past them (a token-tree
    row's ancestors and itself); None for a row that sees no key."""
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1:
        return None
    allowed = mask[0, 0, -q_length:, :kv_length]
    allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    allowed = allowed.cpu()
    visible: list[tuple[int, tuple[int, ...]]] = []
    for row in allowed:
        prefix = int(row.int().cumprod(0).sum())  # leading visible keys
        extras = tuple(int(i) + prefix for i in row[prefix:].nonzero().flatten().tolist())
        if prefix == 0 and not extras:
            return None
        visible.append((prefix, extras))
    return visible


class PackedBatch:
    """Several sequences' new rows as one forward: the model's cache and the attention's
    layout at once.

    The rows go in as one sequence [1, total rows] with explicit position ids, sequence
    after sequence. Passed as the model's cache, `update` splits each layer's new keys and
    values by sequence and appends each part to that sequence's own cache; passed as the
    PACKING_KWARG forward kwarg, `attend` computes each sequence's rows against exactly
    that sequence's keys, with the call the kernel makes when the sequence runs alone (the
    rowwise kernel: the same per-row SDPA calls). A row's attention output is then the
    same bits whether its sequence ran alone or packed with others.

    transformers' continuous-batching module (PagedAttentionCache) is not used: it has no
    rollback, and it changes how many keys each row's attention call holds, which changes
    reduced-precision results.
    """

    def __init__(self, caches: Sequence[Any], rows: Sequence[int],
                 masks: Sequence[torch.Tensor | None]) -> None:
        """caches: each sequence's cache (a transformers Cache); rows: its new rows;
        masks: its rows' mask over its keys, [1, 1, rows, keys] bool, None for causal."""
        self.caches = list(caches)
        self.masks = list(masks)
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for count in rows:
            self.bounds.append((start, start + count))
            start += count
        self._layer: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._plans: dict[int, RowPlan | None] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self._layer = [cache.update(key_states[:, :, begin:end], value_states[:, :, begin:end],
                                    layer_idx)
                       for cache, (begin, end) in zip(self.caches, self.bounds, strict=True)]
        return key_states, value_states

    def attend(self, module: nn.Module, query: torch.Tensor, kernel: Any, dropout: float,
               scaling: float | None, kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
        outputs = []
        for index, ((begin, end), (key, value)) in enumerate(
                zip(self.bounds, self._layer, strict=True)):
            rows = query[:, :, begin:end]
            call = kernel
            if kernel is rowwise_sdpa_forward:
                plan = self._plan(index, rows.shape[2], key.shape[2], module)
                if plan is not None:
                    outputs.append(_rowwise_calls(rows, key, value, plan, dropout, scaling))
                    continue
                call = sdpa_attention_forward
            out, _ = call(module, rows, key, value, self._mask(index, rows.shape[2],
                                                                key.shape[2]),
                            dropout=dropout, scaling=scaling, **kwargs)
            outputs.append(out)
        return torch.cat(outputs, dim=1), None

    def _plan(self, index: int, q_length: int, kv_length: int, module: nn.Module
              ) -> RowPlan | None:
        # Every layer sees the same rows and key counts: one plan per sequence and forward.
        if index not in self._plans:
            groups = int(getattr(module, "num_key_value_groups", 1))
            self._plans[index] = row_plan(self.masks[index], q_length, kv_length, groups,
                                          self.caches_device())
        return self._plans[index]

    def caches_device(self) -> torch.device:
        return self._layer[0][0].device

    def _mask(self, index: int, q_length: int, kv_length: int) -> torch.Tensor | None:
        """The sequence's mask, explicit: a None mask with several query rows would make
        SDPA align the causal triangle to the first key, not the last."""
        mask = self.masks[index]
        if mask is not None or q_length == 1:
            return mask
        device = self.caches_device()
        last = torch.arange(kv_length - q_length, kv_length, device=device)
        return (torch.arange(kv_length, device=device) <= last[:, None])[None, None]


def packable_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs: Any
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    packing = kwargs.pop(PACKING_KWARG, None)
    if packing is not None:
        return packing.attend(module, query, sdpa_attention_forward, dropout, scaling, kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionInterface.register(SDPA_NAME, packable_sdpa_forward)
AttentionInterface.register(ROWWISE_NAME, rowwise_sdpa_forward)
# Without a registered mask function transformers builds no mask at all for an unknown
# attention name; SDPA's own masks are what both paths expect.
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionMaskInterface.register(ROWWISE_NAME, sdpa_mask)
AttentionMaskInterface.register(SDPA_NAME, sdpa_mask)


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
    if current not in ("sdpa", *PACKABLE):
        return current  # eager, flash, ... models keep their own
    implementation = {"grouped": NAME, "rowwise": ROWWISE_NAME}.get(chosen, SDPA_NAME)
    model.set_attn_implementation(implementation)  # type: ignore[operator]
    return chosen
