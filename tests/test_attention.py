"""Grouped-query attention without the K/V copy: same attention, same greedy text."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from tiny_models import assert_speculative_greedy_equals_hf, tiny_gpt2, tiny_llama
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.engine import attention
from specdec.engine.attention import (
    DECODE_ROWS,
    NAME,
    SDPA_NAME,
    apply_attention_kernel,
    grouped_sdpa_forward,
    resolve_attention,
    rowwise_sdpa_forward,
)


def _causal_tail_mask(q_length: int, kv_length: int) -> torch.Tensor:
    rows = torch.arange(kv_length - q_length, kv_length)
    return (torch.arange(kv_length) <= rows[:, None])[None, None]


HEADS, KV_HEADS, KV_LENGTH, DIM = 9, 3, 40, 16


def _attention_inputs(q_length: int) -> tuple[types.SimpleNamespace, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
    """SmolLM2's head layout (9 query heads on 3 K/V heads), random query, keys, values."""
    torch.manual_seed(q_length)
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)
    query = torch.randn(1, HEADS, q_length, DIM)
    key, value = torch.randn(2, 1, KV_HEADS, KV_LENGTH, DIM).unbind(0)
    return module, query, key, value


@pytest.mark.parametrize("q_length", [2, 3, 5, DECODE_ROWS, DECODE_ROWS + 1])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "per_head", "none"])
def test_grouped_attention_equals_transformers_sdpa(q_length: int, mask_kind: str) -> None:
    module, query, key, value = _attention_inputs(q_length)
    heads, kv_length, dim = HEADS, KV_LENGTH, DIM
    mask: torch.Tensor | None = _causal_tail_mask(q_length, kv_length)
    mask[..., 3] = False  # a padded position, so a wrong mask shows
    if mask_kind == "float":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    elif mask_kind == "per_head":
        mask = mask.expand(1, heads, -1, -1).clone()
        mask[:, 4, :, 5] = False  # one head masks one more key
    elif mask_kind == "none":
        mask = None
    # Unmasked, the grouped path puts the queries at the end of the keys (decoding); longer
    # queries (a prefill) go to transformers' function unchanged, whatever it does.
    grouped = q_length <= DECODE_ROWS
    expected_mask = _causal_tail_mask(q_length, kv_length) if mask is None and grouped else mask
    expected, _ = sdpa_attention_forward(module, query, key, value, expected_mask, scaling=0.25)
    out, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    assert out.shape == (1, q_length, heads, dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_length", [1, 2, 5, DECODE_ROWS, DECODE_ROWS + 1])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padded"])
def test_rowwise_attention_equals_transformers_sdpa(q_length: int, mask_kind: str) -> None:
    module, query, key, value = _attention_inputs(q_length)
    causal = _causal_tail_mask(q_length, KV_LENGTH)
    mask = None if mask_kind == "none" else causal.clone()
    if mask_kind == "padded" and mask is not None:
        mask[..., 3] = False  # not a plain causal tail: must fall back, not be ignored
    # Unmasked, decode-sized queries sit at the end of the keys; a prefill goes to
    # transformers' function unchanged, whatever it does.
    expected_mask = causal if mask is None and q_length <= DECODE_ROWS else mask
    expected, _ = sdpa_attention_forward(module, query, key, value, expected_mask,
                                         scaling=0.25)
    out, _ = rowwise_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    assert out.shape == (1, q_length, HEADS, DIM)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _rowwise_mismatches(contexts: range, rows: int) -> int:
    """Rows of one bfloat16 rowwise call (chain rows, then three token-tree rows, batched
    with the chain rows that see as many keys) whose output differs from the one-row call
    of the same row over exactly its keys."""
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)
    mismatches = 0
    for context in contexts:
        torch.manual_seed(context)
        kv_length = context + rows
        query = torch.randn(1, HEADS, rows, 64).bfloat16()
        key, value = torch.randn(2, 1, KV_HEADS, kv_length, 64).bfloat16().unbind(0)
        mask = _causal_tail_mask(rows, kv_length).clone()
        sibling, child, first = rows - 3, rows - 2, rows - 1
        mask[0, 0, sibling:] = False
        # A sibling of the chain's second token, then its child, then a sibling of the
        # chain's first token: each sees the prefix, its path and itself.
        mask[0, 0, sibling, :context + 1] = True
        mask[0, 0, sibling, context + sibling] = True
        mask[0, 0, child] = mask[0, 0, sibling]
        mask[0, 0, child, context + child] = True
        mask[0, 0, first, :context] = True
        mask[0, 0, first, context + first] = True
        out, _ = rowwise_sdpa_forward(module, query, key, value, mask, scaling=0.125)
        for row in range(rows):
            keys = mask[0, 0, row].nonzero().flatten()
            alone, _ = rowwise_sdpa_forward(module, query[:, :, row:row + 1], key[:, :, keys],
                                            value[:, :, keys], None, scaling=0.125)
            mismatches += int(not torch.equal(alone[:, 0], out[:, row]))
    return mismatches


@pytest.mark.parametrize("native", [True, False], ids=["operator", "sdpa-calls"])
def test_rowwise_rows_equal_their_one_row_calls_bit_for_bit(monkeypatch, native: bool) -> None:  # type: ignore[no-untyped-def]
    """Every row gets the bits a one-row decode of it gets, from the C++ operator and from
    its SDPA fallback; the control (every chain row in one masked SDPA call) shows that
    SDPA's bits depend on the call's key count, so the comparison can fail."""
    if native:
        assert attention.native_rowwise_attention() is not None
    else:
        monkeypatch.setattr(attention, "native_rowwise_attention", lambda: None)
    contexts = range(1, 70)
    assert _rowwise_mismatches(contexts, rows=9) == 0
    if not native:
        monkeypatch.setattr(attention, "KEY_BLOCK", 4096)
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            assert _rowwise_mismatches(contexts, rows=9) > 0


def _tree_inputs(context: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor, torch.Tensor]:
    """bfloat16 query, keys, values and a mask of chain rows, then two token-tree rows
    whose ancestors sit out of order among the new keys."""
    torch.manual_seed(context)
    kv_length = context + rows
    query = torch.randn(1, HEADS, rows, 64).bfloat16()
    key, value = (3 * torch.randn(2, 1, KV_HEADS, kv_length, 64)).bfloat16().unbind(0)
    mask = _causal_tail_mask(rows, kv_length).clone()
    mask[0, 0, rows - 2:] = False
    mask[0, 0, rows - 2, :context + 1] = True  # a sibling of the chain's second token
    mask[0, 0, rows - 2, context + rows - 2] = True
    mask[0, 0, rows - 1] = mask[0, 0, rows - 2]  # and its child
    mask[0, 0, rows - 1, context + rows - 1] = True
    return query, key, value, mask


@pytest.mark.parametrize("context", [1, 17, 130])
def test_the_rowwise_operator_computes_attention(context: int) -> None:
    """Each row, chain or tree, against float32 attention over its visible keys: within
    what rounding the inputs and the result to bfloat16 allows (SDPA's own bfloat16
    result is held to the same bound)."""
    assert attention.native_rowwise_attention() is not None
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)
    query, key, value, mask = _tree_inputs(context)
    out, _ = rowwise_sdpa_forward(module, query, key, value, mask, scaling=0.125)
    expected, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                         mask, scaling=0.125)
    sdpa, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.125)
    bound = 2 * float((sdpa.float() - expected).abs().max()) + 1e-2
    assert float((out.float() - expected).abs().max()) <= bound
    # A row that misses half its prefix is off by more than that.
    wrong = mask.clone()
    wrong[0, 0, -1, :max(1, context // 2)] = False
    off, _ = rowwise_sdpa_forward(module, query, key, value, wrong, scaling=0.125)
    assert float((off[:, -1].float() - expected[:, -1]).abs().max()) > bound


def test_the_rowwise_operator_gives_the_same_bits_on_any_thread_count() -> None:
    assert attention.native_rowwise_attention() is not None
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)
    query, key, value, mask = _tree_inputs(90)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append(rowwise_sdpa_forward(module, query, key, value, mask,
                                                scaling=0.125)[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def test_the_packed_operator_gives_each_sequence_the_bits_of_its_own_call() -> None:
    """Trees and one-row sequences in one packed call, on 1 and 2 threads, against each
    sequence's own rowwise_attention call."""
    native = attention.native_rowwise_attention()
    assert native is not None
    packed = torch.ops.specdec.rowwise_attention_packed
    sequences = []
    for context, rows in ((130, 6), (17, 1), (1, 1), (90, 6)):
        query, key, value, mask = _tree_inputs(context, rows)
        plan = attention.row_plan(mask if rows > 1 else None, rows, context + rows,
                                  HEADS // KV_HEADS, torch.device("cpu"))
        assert plan is not None
        sequences.append((query[0], key[0], value[0], plan))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            alone = [native(q, k, v, plan.prefixes, plan.extras, plan.extra_counts, 0.125)
                     for q, k, v, plan in sequences]
            for first, last in ((0, 4), (1, 2), (2, 4)):
                picked = sequences[first:last]
                together = packed(torch.cat([q for q, _, _, _ in picked], dim=1),
                                  [k for _, k, _, _ in picked], [v for _, _, v, _ in picked],
                                  [plan.prefixes for *_, plan in picked],
                                  [plan.extras for *_, plan in picked],
                                  [plan.extra_counts for *_, plan in picked],
                                  [q.shape[1] for q, _, _, _ in picked], 0.125)
                assert torch.equal(together, torch.cat(alone[first:last]))
    finally:
        torch.set_num_threads(threads)


def test_the_vector_path_gives_the_scalar_paths_bits() -> None:
    """A head dimension of 64 takes the vector code where the CPU has it, one of 65 the
    scalar code: with the 65th input zero in the query, keys and values, both compute the
    same sums, so the first 64 outputs must agree bit for bit."""
    native = attention.native_rowwise_attention()
    assert native is not None
    query, key, value, mask = _tree_inputs(130)
    plan = attention.row_plan(mask, query.shape[2], key.shape[2], HEADS // KV_HEADS,
                              torch.device("cpu"))
    assert plan is not None

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, torch.zeros(*tensor.shape[:-1], 1, dtype=tensor.dtype)], -1)

    arguments = (plan.prefixes, plan.extras, plan.extra_counts, 0.125)
    vector = native(query[0], key[0], value[0], *arguments)
    scalar = native(padded(query[0]), padded(key[0]), padded(value[0]), *arguments)
    assert torch.equal(vector, scalar[..., :64])
    assert not scalar[..., 64].any()


def test_the_rowwise_operator_refuses_keys_past_the_cache() -> None:
    native = attention.native_rowwise_attention()
    assert native is not None
    query = torch.randn(HEADS, 1, 64).bfloat16()
    key = value = torch.randn(KV_HEADS, 10, 64).bfloat16()
    none = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="keys past the cache"):
        native(query, key, value, torch.tensor([11]), none, torch.tensor([0]), 0.125)
    with pytest.raises(RuntimeError, match="names a key past the cache"):
        native(query, key, value, torch.tensor([3]), torch.tensor([[10]]), torch.tensor([1]),
               0.125)


def test_auto_resolves_by_device() -> None:
    assert resolve_attention("auto", torch.device("cpu")) == "grouped"
    assert resolve_attention("auto", torch.device("cuda")) == "sdpa"
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        resolve_attention("flash", torch.device("cpu"))


def test_apply_switches_sdpa_models_and_leaves_eager_ones() -> None:
    model = tiny_llama(vocab_size=32)
    assert model.config._attn_implementation == "sdpa"
    assert apply_attention_kernel(model, "auto") == "grouped"
    assert model.config._attn_implementation == NAME
    assert apply_attention_kernel(model, "sdpa") == "sdpa"
    assert model.config._attn_implementation == SDPA_NAME  # transformers' SDPA, packable
    eager = tiny_llama(vocab_size=32)
    eager.set_attn_implementation("eager")
    assert apply_attention_kernel(eager, "grouped") == "eager"
    assert eager.config._attn_implementation == "eager"


@pytest.mark.parametrize("make", [lambda: tiny_llama(vocab_size=64, seed=3, logit_scale=3.0),
                                  lambda: tiny_gpt2(vocab_size=64, seed=3)])
def test_greedy_with_grouped_attention_equals_hf_generate_with_sdpa(make) -> None:  # type: ignore[no-untyped-def]
    """Only the grouping of query rows changes: greedy text is the target's own."""
    target = make()
    reference = copy.deepcopy(target)
    draft = tiny_llama(vocab_size=64, seed=4, layers=1)
    apply_attention_kernel(target, "grouped")
    apply_attention_kernel(draft, "grouped")
    assert_speculative_greedy_equals_hf(target, reference, draft)


def test_verification_logits_match_sdpa_on_a_gqa_model() -> None:
    """A k+1-row forward over a cache gives the same logits with either attention."""
    model = tiny_llama(vocab_size=64, seed=5, layers=2)
    reference = copy.deepcopy(model)
    apply_attention_kernel(model, "grouped")
    prompt, block = [5, 9, 2, 33, 7, 1, 12, 40], [8, 3, 22, 17]
    logits = []
    for m in (reference, model):
        cache = DynamicCache(config=m.config)
        with torch.no_grad():
            m(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
            positions = torch.arange(len(prompt), len(prompt) + len(block))[None]
            logits.append(m(input_ids=torch.tensor([block]), cache=cache, use_cache=True,
                            position_ids=positions).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_bench_format_label_names_the_attention_kernel() -> None:
    from specdec.bench.dtypes import load_runners
    from specdec.bench.harness import BenchSettings

    with pytest.raises(ValueError, match="unknown attention kernel 'flash' in 'float32@"):
        load_runners(BenchSettings(), "float32@skinny@flash")
