"""ModelRunner.extend_batch: many sessions' rows in one forward, each as if alone.

Every request's result from a batch is compared with the same request run alone through
`extend` on a twin runner holding the same sessions: bit for bit under the row-invariant
kernels (bfloat16, oneDNN or int8 linears, rowwise attention), within float tolerance under the
float32 kernels. The caches are compared afterwards too, tensor for tensor.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from cpu_features import ROW_INVARIANT_BF16_LINEAR
from torch import nn
from transformers import PreTrainedModel

from specdec.engine import models
from specdec.engine.attention import apply_attention_kernel
from specdec.engine.backends.cpu import load_causal_lm
from specdec.engine.kernels import (
    ROW_INVARIANCE_PROBE_CAP,
    OneDnnLinear,
    apply_linear_kernel,
    row_invariant_rows,
)
from specdec.engine.runner import ExtendRequest, ExtendResult, ModelRunner
from specdec.engine.shapes import DECODE_ROWS
from specdec.errors import CacheSyncError, InvalidRequest, KVBudgetExhausted
from tests.tiny_models import tiny_feature_draft, tiny_llama

VOCAB = 64
KERNELS = {  # dtype name: (dtype, linear kernel, attention kernel, bit-exact)
    "bfloat16": (torch.bfloat16, ROW_INVARIANT_BF16_LINEAR, "rowwise", True),
    "float32": (torch.float32, "skinny", "grouped", False),
    "float32-sdpa": (torch.float32, "torch", "sdpa", False),  # what CUDA runs
}


def _tiny(dtype_name: str) -> PreTrainedModel:
    dtype, linear, attention, _ = KERNELS[dtype_name]
    model: Any = tiny_llama(vocab_size=VOCAB, layers=2, hidden=64)
    model = model.to(dtype)
    apply_linear_kernel(model, linear)
    apply_attention_kernel(model, attention)
    return model


@pytest.fixture(scope="module")
def bf16() -> PreTrainedModel:
    """One model for the module: its row-invariance cap is measured once."""
    return _tiny("bfloat16")


@contextmanager
def _counting_forwards(model: nn.Module) -> Iterator[list[int]]:
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda _module, _args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def _assert_same(got: ExtendResult, expected: ExtendResult, exact: bool) -> None:
    assert got.kv_length == expected.kv_length
    assert got.tokens_processed == expected.tokens_processed
    pairs = [(got.logits, expected.logits)]
    assert (got.hidden is None) == (expected.hidden is None)
    if got.hidden is not None and expected.hidden is not None:
        pairs.append((got.hidden, expected.hidden))
    for actual, wanted in pairs:
        assert actual.shape == wanted.shape
        if exact:
            assert torch.equal(actual, wanted)
        else:
            torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-4)


def _assert_same_caches(batched: ModelRunner, alone: ModelRunner, exact: bool) -> None:
    assert list(batched._sessions) == list(alone._sessions)
    for session_id, session in batched._sessions.items():
        other = alone._sessions[session_id]
        assert session.history.tokens == other.history.tokens
        assert session.cache is not None and other.cache is not None
        for layer, other_layer in zip(session.cache.layers, other.cache.layers, strict=True):
            for name in ("keys", "values"):
                tensor, other_tensor = getattr(layer, name), getattr(other_layer, name)
                assert tensor.shape == other_tensor.shape
                if exact:
                    assert torch.equal(tensor, other_tensor)
                else:
                    torch.testing.assert_close(tensor, other_tensor, rtol=1e-4, atol=1e-4)


def _random_request(rng: random.Random, runner: ModelRunner, session_id: str) -> ExtendRequest:
    """A random extend of the session: a restart with a prompt, a long catch-up (a
    prefill piece), or a rollback of up to 3 tokens then a short chain, with branch rows
    beside it, logits for some rows and hidden rows or not."""
    session = runner._sessions.get(session_id)
    held = len(session.history) if session else 0
    kind = rng.random()
    if session is None or kind < 0.15:
        position, tokens = 0, [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
    else:
        position = rng.randrange(max(1, held - 3), held + 1)
        count = rng.randrange(18, 30) if kind < 0.3 else rng.randrange(1, 7)
        tokens = [rng.randrange(VOCAB) for _ in range(count)]
    fingerprint = session.history.fingerprint(position) if session else 0
    branches: list[int] = []
    if position > 0 and len(tokens) <= 6 and rng.random() < 0.5:
        # A token tree: each branch follows a chain token or an earlier branch.
        for _ in range(rng.randrange(1, 4)):
            branches.append(rng.randrange(position, position + len(tokens) + len(branches)))
        tokens = tokens + [rng.randrange(VOCAB) for _ in branches]
    return ExtendRequest(session_id, position, fingerprint, tokens,
                         num_logits=rng.randrange(1, len(tokens) + 1),
                         hidden_rows=rng.choice([0, 0, len(tokens), 1]),
                         branch_parents=tuple(branches))


def _alone(runner: ModelRunner, request: ExtendRequest) -> ExtendResult:
    return runner.extend(request.session_id, request.committed_position, request.fingerprint,
                         request.tokens, request.num_logits, hidden_rows=request.hidden_rows,
                         branch_parents=request.branch_parents)


@pytest.mark.parametrize("dtype_name", list(KERNELS))
def test_batched_rows_equal_rows_run_alone(dtype_name: str, bf16: PreTrainedModel) -> None:
    torch.set_num_threads(2)
    model = bf16 if dtype_name == "bfloat16" else _tiny(dtype_name)
    exact = KERNELS[dtype_name][3]
    batched, alone = ModelRunner(model), ModelRunner(model)
    rng = random.Random(dtype_name)
    sessions = [f"s{index}" for index in range(8)]
    packed_forwards = 0
    for _ in range(12):
        members = rng.sample(sessions, rng.randrange(1, len(sessions) + 1))
        requests = [_random_request(rng, batched, session_id) for session_id in members]
        with _counting_forwards(model) as calls:
            results = batched.extend_batch(requests)
        decode_sized = sum(len(r.tokens) <= DECODE_ROWS for r in requests)
        packed_forwards += decode_sized > 1 and len(calls) < len(requests)
        for request, result in zip(requests, results, strict=True):
            assert isinstance(result, ExtendResult), result
            _assert_same(result, _alone(alone, request), exact)
        _assert_same_caches(batched, alone, exact)
    assert packed_forwards > 0  # rows of several sessions did share forwards
    # Continue every session alone on both runners: the caches the batches left behave alike.
    for session_id in sessions:
        if session_id in batched._sessions:
            history = batched._sessions[session_id].history
            request = ExtendRequest(session_id, len(history), history.fingerprint(), [5, 9],
                                    num_logits=2)
            _assert_same(_alone(batched, request), _alone(alone, request), exact)


def test_decode_rows_of_many_sessions_run_in_one_forward(bf16: PreTrainedModel) -> None:
    model = bf16
    runner = ModelRunner(model)
    for index in range(6):
        runner.extend(f"s{index}", 0, 0, list(range(index + 3)))
    requests = [ExtendRequest(f"s{index}", index + 3,
                              runner._sessions[f"s{index}"].history.fingerprint(),
                              [1, 2, 3][: 1 + index % 3], num_logits=1 + index % 3)
                for index in range(6)]
    with _counting_forwards(model) as calls:
        results = runner.extend_batch(requests)
    assert len(calls) == 1
    assert [result.kv_length for result in results  # type: ignore[union-attr]
            ] == [index + 3 + 1 + index % 3 for index in range(6)]


def test_a_long_catch_up_runs_its_prefill_alone_and_its_decode_rows_in_the_batch(
        bf16: PreTrainedModel) -> None:
    model = bf16
    runner = ModelRunner(model)
    runner.extend("short", 0, 0, [1, 2, 3])
    requests = [ExtendRequest("long", 0, 0, list(range(40)), num_logits=5),
                ExtendRequest("short", 3, runner._sessions["short"].history.fingerprint(),
                              [4])]
    with _counting_forwards(model) as calls:
        results = runner.extend_batch(requests)
    assert len(calls) == 2  # the 36-token prefill, then both sessions' decode rows
    assert all(isinstance(result, ExtendResult) for result in results)


def test_a_feature_draft_batches_with_each_sessions_target_states() -> None:
    model: Any = tiny_feature_draft(vocab_size=VOCAB).to(torch.bfloat16)
    apply_linear_kernel(model, ROW_INVARIANT_BF16_LINEAR)
    apply_attention_kernel(model, "rowwise")
    batched, alone = ModelRunner(model), ModelRunner(model)
    generator = torch.Generator().manual_seed(0)
    for index in range(4):
        prompt = list(range(3 + 5 * index))
        states = torch.randn(len(prompt), 32, generator=generator)
        for runner in (batched, alone):
            runner.extend(f"s{index}", 0, 0, prompt, target_hidden=states)
    requests = [ExtendRequest(f"s{index}", 3 + 5 * index,
                              batched._sessions[f"s{index}"].history.fingerprint(),
                              [7] * (1 + index), hidden_rows=1,
                              target_hidden=torch.randn(1 + index, 32, generator=generator))
                for index in range(4)]
    with _counting_forwards(model) as calls:
        results = batched.extend_batch(requests)
    assert len(calls) == 1
    for request, result in zip(requests, results, strict=True):
        assert isinstance(result, ExtendResult)
        expected = alone.extend(request.session_id, request.committed_position,
                                request.fingerprint, request.tokens, hidden_rows=1,
                                target_hidden=request.target_hidden)
        _assert_same(result, expected, exact=True)


def _twin_runners(model: PreTrainedModel, **kwargs: int) -> tuple[ModelRunner, ModelRunner]:
    runners = ModelRunner(model, **kwargs), ModelRunner(model, **kwargs)  # type: ignore[arg-type]
    for runner in runners:
        for index, session_id in enumerate(("a", "b", "c")):
            runner.extend(session_id, 0, 0, [index + 1] * (4 + index))
    return runners


def _step(runner: ModelRunner, session_id: str, tokens: list[int],
          fingerprint: int | None = None) -> ExtendRequest:
    history = runner._sessions[session_id].history
    return ExtendRequest(session_id, len(history),
                         history.fingerprint() if fingerprint is None else fingerprint,
                         tokens, num_logits=len(tokens))


def test_a_failing_request_leaves_the_others_as_a_batch_without_it(bf16: PreTrainedModel) -> None:
    with_bad, without = _twin_runners(bf16)
    good = [_step(with_bad, "a", [7, 8]), _step(with_bad, "c", [9])]
    bad = _step(with_bad, "b", [3, 3, 3], fingerprint=12345)
    held_b = list(with_bad._sessions["b"].history.tokens)
    results = with_bad.extend_batch([good[0], bad, good[1]])
    expected = without.extend_batch(good)
    assert isinstance(results[1], CacheSyncError)
    assert "fingerprint mismatch" in str(results[1])
    for got, wanted in zip([results[0], results[2]], expected, strict=True):
        assert isinstance(got, ExtendResult) and isinstance(wanted, ExtendResult)
        _assert_same(got, wanted, exact=True)
    assert with_bad._sessions["b"].history.tokens == held_b  # untouched
    _assert_same_caches(with_bad, without, exact=True)


def test_a_request_over_the_kv_budget_fails_alone(bf16: PreTrainedModel) -> None:
    per_token = ModelRunner(bf16)._bytes_per_token()
    with_bad, without = _twin_runners(bf16, kv_budget_bytes=40 * per_token)
    too_long = _step(with_bad, "b", list(range(40)))  # 5 held + 40 new > 40
    good = [_step(with_bad, "a", [7, 8]), _step(with_bad, "c", [9])]
    results = with_bad.extend_batch([good[0], too_long, good[1]])
    expected = without.extend_batch(good)
    assert isinstance(results[1], KVBudgetExhausted)
    assert "SPECDEC_KV_BUDGET_MB" in str(results[1])
    for got, wanted in zip([results[0], results[2]], expected, strict=True):
        assert isinstance(got, ExtendResult) and isinstance(wanted, ExtendResult)
        _assert_same(got, wanted, exact=True)
    _assert_same_caches(with_bad, without, exact=True)


def test_the_batch_evicts_least_recently_used_sessions_outside_it(bf16: PreTrainedModel) -> None:
    model = bf16
    per_token = ModelRunner(model)._bytes_per_token()
    runner = ModelRunner(model, kv_budget_bytes=30 * per_token)
    for session_id in ("old", "a", "b"):
        runner.extend(session_id, 0, 0, [1] * 8)  # 24 tokens held
    results = runner.extend_batch([_step(runner, "a", [2] * 5), _step(runner, "b", [3] * 5)])
    assert all(isinstance(result, ExtendResult) for result in results)
    assert list(runner._sessions) == ["a", "b"]  # "old" made room; the batch's own stay
    assert runner.total_kv_bytes() <= 30 * per_token


def test_the_same_session_twice_in_one_batch_is_refused(bf16: PreTrainedModel) -> None:
    runner, _ = _twin_runners(bf16)
    first = _step(runner, "a", [7])
    results = runner.extend_batch([first, _step(runner, "a", [8])])
    assert isinstance(results[0], ExtendResult)
    assert isinstance(results[1], InvalidRequest) and "twice" in str(results[1])
    assert runner._sessions["a"].history.tokens[-1] == 7


def test_row_invariance_is_measured_for_the_row_invariant_kernels_only(
        bf16: PreTrainedModel) -> None:
    cap = ModelRunner(bf16).max_invariant_rows
    assert cap is not None and DECODE_ROWS <= cap <= ROW_INVARIANCE_PROBE_CAP
    assert row_invariant_rows(bf16) == cap  # measured once, remembered on the model
    assert row_invariant_rows(_tiny("float32")) is None  # skinny: no such guarantee
    assert ModelRunner(_tiny("float32")).max_invariant_rows is None


class _OrderChangesPast12Rows(OneDnnLinear):
    """A oneDNN linear whose kernel, as on some CPUs for a wide output layer, sums in
    another order beyond 12 rows: the result moves by one step of its precision there."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = super().forward(input)
        return torch.nextafter(out, out + 1) if input.shape[0] > 12 else out


def test_row_invariance_is_measured_on_every_shape_not_one_per_input_width() -> None:
    # float32: oneDNN serves it on every x86 CPU (bfloat16 needs AVX-512 there).
    narrow = nn.Linear(32, 8, bias=False)
    narrow.__class__ = OneDnnLinear
    wide = nn.Linear(32, 96, bias=False)
    wide.__class__ = _OrderChangesPast12Rows
    assert row_invariant_rows(nn.Sequential(narrow)) == ROW_INVARIANCE_PROBE_CAP
    # The same input width: the wide layer's own probe finds where its order changes.
    assert row_invariant_rows(nn.Sequential(narrow, wide)) == 12


def test_a_batch_over_the_row_cap_is_split_into_whole_sessions(bf16: PreTrainedModel) -> None:
    model = bf16
    batched, alone = ModelRunner(model), ModelRunner(model)
    for runner in (batched, alone):
        for index in range(5):
            runner.extend(f"s{index}", 0, 0, [index + 1] * 6)
    batched.max_batch_rows = 8
    requests = [_step(batched, f"s{index}", [2, 3, 4]) for index in range(5)]  # 15 rows
    with _counting_forwards(model) as calls:
        results = batched.extend_batch(requests)
    assert len(calls) == 3  # 3 + 3 rows, 3 + 3 rows, 3 rows
    for request, result in zip(requests, results, strict=True):
        assert isinstance(result, ExtendResult)
        _assert_same(result, _alone(alone, request), exact=True)


def _forwards(row_counts: list[int], cap: int) -> int:
    """Forwards of whole sessions, in order, of at most cap rows each."""
    forwards, rows = 0, cap
    for count in row_counts:
        if rows + count > cap:
            forwards, rows = forwards + 1, 0
        rows += count
    return forwards


# -- the real target in bfloat16 --------------------------------------------------------------

@pytest.fixture(scope="module")
def target_bf16() -> models.LoadedModel:
    return load_causal_lm(models.DEFAULT_TARGET, torch.device("cpu"), torch.bfloat16,
                          progress=False, linear_kernel=ROW_INVARIANT_BF16_LINEAR)


@pytest.mark.slow
def test_real_target_batched_rows_equal_alone_up_to_the_cap_and_split_beyond(
        target_bf16: models.LoadedModel) -> None:
    model = target_bf16.model
    batched, alone = ModelRunner(model), ModelRunner(model)
    cap = batched.max_invariant_rows
    assert cap is not None and cap >= DECODE_ROWS
    generator = torch.Generator().manual_seed(3)
    sessions = 12
    for index in range(sessions):  # different prompts of different lengths
        prompt = torch.randint(0, 49152, (20 + 7 * index,), generator=generator).tolist()
        for runner in (batched, alone):
            runner.extend(f"s{index}", 0, 0, prompt)
    rounds = [[1, 5, 9] * 4, [16] * sessions]  # rows per session: verifications, then full
    for row_counts in rounds:
        requests = []
        for index, count in enumerate(row_counts):
            tokens = torch.randint(0, 49152, (count,), generator=generator).tolist()
            requests.append(_step(batched, f"s{index}", tokens))
        with _counting_forwards(model) as calls:
            results = batched.extend_batch(requests)
        assert len(calls) == _forwards(row_counts, cap)
        for request, result in zip(requests, results, strict=True):
            assert isinstance(result, ExtendResult)
            _assert_same(result, _alone(alone, request), exact=True)
    # Over the cap: split into forwards of whole sessions, still bit-equal to alone.
    batched.max_batch_rows = min(40, cap)
    requests = [_step(batched, f"s{index}", [11, 12, 13, 14, 15, 16, 17, 18, 19])
                for index in range(sessions)]
    with _counting_forwards(model) as calls:
        results = batched.extend_batch(requests)
    assert len(calls) == _forwards([9] * sessions, batched.max_batch_rows) > 1
    for request, result in zip(requests, results, strict=True):
        assert isinstance(result, ExtendResult)
        _assert_same(result, _alone(alone, request), exact=True)
    _assert_same_caches(batched, alone, exact=True)
