"""The KV cache that grows in place (specdec.engine.kv_cache): the keys and values of a
DynamicLayer, without the per-step copy of the whole cache."""

from __future__ import annotations

import random

import torch
from tiny_models import tiny_llama
from transformers.cache_utils import DynamicLayer

from specdec.engine.extend import Session
from specdec.engine.kv_cache import GROW_BLOCK, GrowingCache, GrowingLayer, grown_capacity


def _rows(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, count, 8, generator=generator).to(torch.bfloat16),
            torch.randn(1, 2, count, 8, generator=generator).to(torch.bfloat16))


def test_updates_and_crops_hold_what_a_dynamic_layer_holds() -> None:
    ours, theirs = GrowingLayer(), DynamicLayer()
    rng = random.Random(0)
    for step in range(120):
        if step and rng.random() < 0.3 and theirs.get_seq_length() > 1:
            drop = rng.randint(1, theirs.get_seq_length() - 1)
            ours.crop(-drop)
            theirs.crop(-drop)
        else:
            keys, values = _rows(rng.choice([1, 1, 1, 4, 5, 40]), step)
            got = ours.update(keys, values)
            want = theirs.update(keys, values)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    buffer = ours.key_buffer
    ours.crop(-(ours.get_seq_length() + 3))  # more than it holds: nothing left
    theirs.crop(-(theirs.get_seq_length() + 3))
    assert ours.get_seq_length() == theirs.get_seq_length() == 0
    assert ours.key_buffer is buffer  # a crop keeps the buffers and their room


def test_a_step_writes_its_rows_into_the_buffer_it_has() -> None:
    layer = GrowingLayer()
    layer.update(*_rows(10, 0))
    buffer = layer.key_buffer
    assert buffer is not None and buffer.shape[2] == grown_capacity(0, 10) == GROW_BLOCK
    for step in range(GROW_BLOCK - 10):
        layer.update(*_rows(1, step + 1))
        assert layer.key_buffer is buffer  # no copy of what it holds
        assert layer.keys.data_ptr() == buffer.data_ptr()
    layer.update(*_rows(1, 99))  # full: a bigger buffer, the rows carried over
    assert layer.key_buffer is not buffer and layer.length == GROW_BLOCK + 1
    assert torch.equal(layer.keys[:, :, :GROW_BLOCK], buffer)


def test_capacity_grows_by_a_quarter_and_whole_blocks() -> None:
    assert grown_capacity(0, 1) == GROW_BLOCK
    assert grown_capacity(1000, 1001) == 1280  # 1000 + 250, rounded up to a block
    assert grown_capacity(100, 900) == 960  # what is needed, rounded up
    for length in range(0, 5000, 37):
        capacity = grown_capacity(length, length + 1)
        assert capacity % GROW_BLOCK == 0 and capacity >= length + max(GROW_BLOCK, length // 4)


def test_keys_set_from_outside_are_adopted() -> None:
    """A caller that sets keys and values to tensors of its own (a batch reindexing, a
    copy to another layout) gets them kept, not the stale buffer."""
    layer = GrowingLayer()
    layer.update(*_rows(6, 0))
    replaced_keys, replaced_values = _rows(6, 1)
    layer.keys, layer.values = replaced_keys.clone(), replaced_values.clone()
    new_keys, new_values = _rows(2, 2)
    keys, values = layer.update(new_keys, new_values)
    assert torch.equal(keys, torch.cat([replaced_keys, new_keys], dim=2))
    assert torch.equal(values, torch.cat([replaced_values, new_values], dim=2))


def test_a_session_counts_the_memory_its_buffers_hold() -> None:
    model = tiny_llama(vocab_size=96, hidden=64, layers=2)
    cache = GrowingCache(model.config)
    assert len(cache.layers) == 2 and all(type(layer) is GrowingLayer for layer in cache.layers)
    for index in range(2):
        cache.update(*_rows(3, index), index)
    assert cache.get_seq_length() == 3
    per_position = 2 * 8 * 2  # kv heads x head dim x bfloat16 bytes
    assert Session(cache=cache).kv_bytes() == 2 * 2 * GROW_BLOCK * per_position
    cache.reset()
    assert Session(cache=cache).kv_bytes() == 0
