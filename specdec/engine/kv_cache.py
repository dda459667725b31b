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
    """A DynamicLayer whose keys and values are views of buffers it writes in place.

    `keys` and `values` are the buffers' first positions, made on access; the layer keeps
    only how many positions each holds, so a step's bookkeeping is two integer additions.
    A tensor assigned to them that is a prefix of the buffer (a crop) sets the count;
    any other (a batch reindexing, say) is kept as given and copied into new buffers at
    the next update."""

    def __init__(self) -> None:
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self._held = [0, 0]  # positions of the key and the value buffer in use
        self._outside: list[torch.Tensor | None] = [None, None]  # set from outside
        super().__init__()

    def _buffer(self, which: int) -> torch.Tensor | None:
        return self.key_buffer if which == 0 else self.value_buffer

    def _view(self, which: int) -> torch.Tensor | None:
        outside = self._outside[which]
        if outside is not None:
            return outside
        buffer = self._buffer(which)
        return None if buffer is None else buffer[:, :, :self._held[which]]

    def _assign(self, which: int, tensor: torch.Tensor | None) -> None:
        buffer = self._buffer(which)
        if tensor is not None and buffer is not None and tensor.dim() == 4 \
                and tensor.data_ptr() == buffer.data_ptr() \
                and tensor.stride() == buffer.stride() and tensor.shape[:2] == buffer.shape[:2] \
                and tensor.shape[3] == buffer.shape[3]:
            self._held[which] = tensor.shape[2]
            self._outside[which] = None
        else:
            self._outside[which] = tensor

    keys = property(lambda self: self._view(0), lambda self, tensor: self._assign(0, tensor))
    values = property(lambda self: self._view(1), lambda self, tensor: self._assign(1, tensor))

    @property
    def length(self) -> int:
        """Positions the layer holds."""
        outside = self._outside[0]
        if outside is None:
            return self._held[0]
        return outside.shape[-2] if outside.numel() else 0

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def nbytes(self) -> int:
        """The memory the layer's keys and values hold, spare room included."""
        total = 0
        for which in (0, 1):
            tensor = self._outside[which]
            if tensor is None:
                tensor = self._buffer(which)
            if tensor is not None:
                total += tensor.untyped_storage().nbytes()
        return total

    def reserve(self, rows: int, key_states: torch.Tensor | None = None,
                value_states: torch.Tensor | None = None) -> None:
        """Room for `rows` more positions shaped like key_states and value_states
        ([batch, kv heads, rows, head dim]; default: like the buffers), copying what the
        layer holds into new buffers when the old ones are full or not what it holds."""
        length = self.length
        needed = length + rows
        key_buffer = self.key_buffer
        if key_buffer is not None and key_buffer.shape[2] >= needed \
                and self._outside[0] is None and self._outside[1] is None \
                and self._held[1] == length:
            return
        capacity = grown_capacity(length, needed)
        buffers = []
        for which, states in enumerate((key_states, value_states)):
            held = self._view(which)
            template = self._buffer(which) if states is None else states
            assert template is not None and template.dim() == 4
            shape = (template.shape[0], template.shape[1], capacity, template.shape[3])
            buffer = torch.empty(shape, dtype=template.dtype, device=template.device)
            if length:
                assert held is not None
                buffer[:, :, :length].copy_(held)
            buffers.append(buffer)
        self.key_buffer, self.value_buffer = buffers
        self._held = [length, length]
        self._outside = [None, None]

    def crop(self, tokens_to_remove: int) -> None:
        """DynamicLayer.crop (a negative count of positions to drop), as a change of the
        counts where the layer's keys and values are its own buffers' prefixes."""
        if tokens_to_remove >= 0 or not self.is_initialized or \
                self._outside[0] is not None or self._outside[1] is not None:
            super().crop(tokens_to_remove)
            return
        self._held = [max(held + tokens_to_remove, 0) for held in self._held]

    def advance(self, rows: int) -> None:
        """Take `rows` positions written past the end into the layer's keys and values."""
        self._held[0] += rows
        self._held[1] += rows

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
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        return keys, values

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        self._held = [0, 0]
        self._outside = [None, None]
        super().reset()


class GrowingCache(DynamicCache):
    """A DynamicCache of GrowingLayers, one per decoder layer of `config`."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        count = int(config.get_text_config(decoder=True).num_hidden_layers)
        self.layers = [GrowingLayer() for _ in range(count)]
