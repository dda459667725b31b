"""A KV cache that grows in place: each step writes only its new keys and values.

transformers' DynamicLayer appends by concatenation, so every forward copies each
layer's whole cache to add a few rows: per token that is as many bytes as the cache
holds, read and written again, which at a few hundred tokens and several sessions per
forward rivals the int8 weights' own traffic. A GrowingLayer keeps its keys and values
in buffers with room to spare and writes the new rows into that room; `keys` and
`values` are views of the buffers' first `length` positions, so everything that reads a
DynamicLayer (attention kernels, `crop`, `get_seq_length`, the runner's rollback) reads
it unchanged. A buffer grows by at least a quarter (and a block) when full, so the
copies it makes cost a bounded share of the rows written.

The values are the bits DynamicLayer would hold: only where they sit changes (the rows
of a head lie `capacity` apart rather than `length` apart). The attention that reads
them must therefore not depend on strides for its sums; the rowwise kernel reads rows
through strides in a fixed order, and the runner uses this cache where the fused step
runs (fused_step.py), which attends with that kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Buffers hold whole blocks of positions, and grow by at least a quarter of what they
# hold, so a long generation copies its cache O(log length) times.
GROW_BLOCK = 64


def grown_capacity(length: int, needed: int) -> int:
    """A buffer's new capacity for `needed` positions when it holds `length`."""
    wanted = max(needed, length + max(GROW_BLOCK, length // 4))
    return -(-wanted // GROW_BLOCK) * GROW_BLOCK


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers it writes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def _views_own_buffers(self) -> bool:
        """Whether keys and values are still prefixes of the buffers (anything that set
        them to other tensors, a batch reindexing say, leaves them adopted next)."""
        keys, values = self.keys, self.values
        key_buffer, value_buffer = self.key_buffer, self.value_buffer
        if key_buffer is None or value_buffer is None or keys is None or values is None:
            return False
        return all(view.dim() == 4 and view.data_ptr() == buffer.data_ptr()
                   and view.shape[:2] == buffer.shape[:2] and view.shape[3] == buffer.shape[3]
                   and view.stride() == buffer.stride()
                   for view, buffer in ((keys, key_buffer), (values, value_buffer)))

    def reserve(self, rows: int, key_states: torch.Tensor | None = None,
                value_states: torch.Tensor | None = None) -> None:
        """Room for `rows` more positions shaped like key_states and value_states
        ([batch, kv heads, rows, head dim]; default: like the keys and values held),
        copying what the layer holds into new buffers when the old ones are full or not
        its own."""
        length = self.length
        needed = length + rows
        if self._views_own_buffers() and self.key_buffer is not None \
                and self.key_buffer.shape[2] >= needed:
            return
        capacity = grown_capacity(length, needed)
        buffers = []
        for states, held in ((key_states, self.keys), (value_states, self.values)):
            states = held if states is None else states
            assert states is not None and states.dim() == 4
            shape = (states.shape[0], states.shape[1], capacity, states.shape[3])
            buffer = torch.empty(shape, dtype=states.dtype, device=states.device)
            if length:
                assert held is not None
                buffer[:, :, :length].copy_(held)
            buffers.append(buffer)
        self.key_buffer, self.value_buffer = buffers
        self.advance(0)

    def advance(self, rows: int) -> None:
        """Take `rows` positions written past the end into the layer's keys and values."""
        assert self.key_buffer is not None and self.value_buffer is not None
        end = self.length + rows
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = key_states.shape[-2]
        self.reserve(rows, key_states, value_states)
        assert self.key_buffer is not None and self.value_buffer is not None
        length = self.length
        self.key_buffer[:, :, length:length + rows].copy_(key_states)
        self.value_buffer[:, :, length:length + rows].copy_(value_states)
        self.advance(rows)
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        super().reset()


class GrowingCache(DynamicCache):
    """A DynamicCache of GrowingLayers, one per decoder layer of `config`."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        count = int(config.get_text_config(decoder=True).num_hidden_layers)
        self.layers = [GrowingLayer() for _ in range(count)]
