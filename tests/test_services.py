"""The three gRPC services on loopback with tiny random models: exactness over the wire,
reproducibility, restarts, a failing draft or target, cancellation, concurrency."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch
from service_harness import DelayInterceptor, Services
from tiny_models import tiny_llama

from coordinator.servicer import CoordinatorSettings
from specdec.core.loop import GenerateConfig, RoundEvent, generate
from specdec.core.prompt_lookup import PromptLookup
from specdec.core.sampling import SamplingParams
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.proto.specdec.v1 import common_pb2, coordinator_pb2

VOCAB = 32
LOOKUP = PromptLookup(VOCAB)  # the coordinator's default
PROMPT = [1, 5, 7, 3]
FAST = CoordinatorSettings(draft_backoff_initial_s=0.01, draft_backoff_max_s=0.05)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(1)
    return tiny_llama(VOCAB, seed=1), tiny_llama(VOCAB, seed=2, layers=1)


@pytest.fixture(scope="module")
def services(models) -> Iterator[Services]:
    target, draft = models
    stack = Services(draft, target, settings=FAST)
    yield stack
    stack.close()


@pytest.fixture
def own_services(models) -> Iterator[Callable[..., Services]]:
    """Services a test may stop and restart; closed afterwards."""
    made: list[Services] = []

    def make(**kwargs: object) -> Services:
        target, draft = models
        kwargs.setdefault("settings", FAST)
        made.append(Services(draft, target, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for stack in made:
        stack.close()


def request(prompt: list[int] = PROMPT, max_new_tokens: int = 24, *, k: int | None = 3,
            temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0, min_p: float = 0.0,
            seed: int | None = None) -> coordinator_pb2.GenerateRequest:
    message = coordinator_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=max_new_tokens,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                           min_p=min_p))
    if seed is not None:
        message.sampling.seed = seed
    if k is not None:
        message.speculation.num_draft_tokens = k
    return message


def target_only(target: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    config = GenerateConfig(max_new_tokens=max_new_tokens, num_draft_tokens=0)
    return generate(None, LocalVerifier(ModelRunner(target)), prompt, config).token_ids


def stream(stack: Services, message: coordinator_pb2.GenerateRequest,
           after_first: Callable[[], None] | None = None, timeout: float = 60
           ) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    """Token ids from GenerateStream and its last message; after_first runs mid-stream."""
    tokens: list[int] = []
    last = None
    for index, piece in enumerate(stack.stub.GenerateStream(message, timeout=timeout)):
        tokens += piece.token_ids
        last = piece
        if index == 0 and after_first is not None:
            after_first()
    assert last is not None and last.finish_reason
    return tokens, last


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# -- exactness ---------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_greedy_equals_target_only(services, models, k: int) -> None:
    target, _ = models
    for prompt in (PROMPT, [9], [4, 4, 4, 4, 4, 4, 2]):
        response = services.stub.Generate(request(prompt, 30, k=k), timeout=30)
        assert list(response.token_ids) == target_only(target, prompt, 30)
        assert response.finish_reason == "length"
        assert response.stats.rounds > 0 and not response.stats.degraded
        if k:
            assert response.stats.draft_tokens > 0


def test_adaptive_draft_length_stays_exact(services, models) -> None:
    message = request(max_new_tokens=40, k=3)
    message.speculation.adaptive = True
    response = services.stub.Generate(message, timeout=30)
    assert list(response.token_ids) == target_only(models[0], PROMPT, 40)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, seed=3)],
                         ids=["greedy", "sampled"])
def test_draft_confidence_over_the_wire_equals_the_in_process_loop(services, models,
                                                                    sampling) -> None:
    """Proposals cut short by the gate travel as shorter ProposeResponses; the result is
    the in-process loop's with the same gate (and, greedy, the target's own text)."""
    target, draft = models
    message = request(max_new_tokens=30, k=6, **sampling)  # type: ignore[arg-type]
    message.speculation.draft_confidence = 0.2
    response = services.stub.Generate(message, timeout=30)
    params = SamplingParams(**sampling)  # type: ignore[arg-type]
    config = GenerateConfig(max_new_tokens=30, sampling=params, num_draft_tokens=6,
                            draft_confidence=0.2, prompt_lookup=LOOKUP)
    local = generate(LocalDrafter(ModelRunner(draft, target_vocab_size=VOCAB)),
                     LocalVerifier(ModelRunner(target)), PROMPT, config)
    assert list(response.token_ids) == local.token_ids
    assert response.stats.draft_tokens == local.stats.draft_tokens
    assert response.stats.draft_tokens < 6 * response.stats.num_drafts  # the gate acted
    if not sampling:
        assert list(response.token_ids) == target_only(target, PROMPT, 30)


@pytest.mark.parametrize(("adaptive", "temperature"), [(False, 0.0), (True, 0.0), (False, 1.0)],
                         ids=["greedy", "greedy-adaptive", "sampled"])
def test_token_trees_over_the_wire_equal_the_in_process_loop(services, models, adaptive: bool,
                                                             temperature: float) -> None:
    """Token trees travel Propose -> coordinator -> Verify (with q for every node with
    children when sampled); the kept paths are the same as in process, and greedy text is
    the target's own."""
    target, draft = models
    prompt = [4, 4, 4, 4, 4, 4, 2]  # with these tiny models, one where alternatives are kept
    message = request(prompt, max_new_tokens=40, k=3, temperature=temperature,
                      seed=5 if temperature else None)
    message.speculation.num_alternatives = 6
    message.speculation.adaptive = adaptive
    response = services.stub.Generate(message, timeout=30)
    if temperature == 0.0:
        assert list(response.token_ids) == target_only(target, prompt, 40)
    if adaptive:
        return
    events: list[RoundEvent] = []
    local = generate(LocalDrafter(ModelRunner(draft, target_vocab_size=VOCAB)),
                     LocalVerifier(ModelRunner(target)), prompt,
                     GenerateConfig(max_new_tokens=40, num_draft_tokens=3, num_alternatives=6,
                                    prompt_lookup=LOOKUP,
                                    sampling=SamplingParams(temperature=temperature, seed=5)),
                     on_round=events.append)
    assert list(response.token_ids) == local.token_ids
    assert response.stats.accepted_tokens == local.stats.accepted_tokens
    assert response.stats.kept_alternatives == local.stats.kept_alternatives > 0
    assert any(event.kept_branches for event in events)


def test_greedy_with_a_perfect_draft_accepts_everything(models) -> None:
    target, _ = models
    stack = Services(target, target)  # the target as its own draft: every token accepted
    try:
        message = request(max_new_tokens=25, k=4)
        message.speculation.prompt_lookup_tokens = 0  # the draft's own rounds only
        response = stack.stub.Generate(message, timeout=30)
    finally:
        stack.close()
    assert list(response.token_ids) == target_only(target, PROMPT, 25)
    assert response.stats.acceptance_rate == 1.0
    assert response.stats.mean_accepted_length == 5.0


SEEDED = [dict(temperature=1.0), dict(temperature=0.5, top_k=3),
          dict(temperature=0.75, top_p=0.75), dict(temperature=1.0, min_p=0.125)]


@pytest.mark.parametrize("sampling", SEEDED,
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_seeded_sampling_equals_the_in_process_loop(services, models, sampling) -> None:
    target, draft = models
    for seed in (0, 7):
        response = services.stub.Generate(request(max_new_tokens=20, k=3, seed=seed, **sampling),
                                          timeout=30)
        params = SamplingParams(seed=seed, **sampling)  # values exact in float32
        config = GenerateConfig(max_new_tokens=20, sampling=params, num_draft_tokens=3,
                                prompt_lookup=LOOKUP)
        local = generate(LocalDrafter(ModelRunner(draft, target_vocab_size=VOCAB)),
                         LocalVerifier(ModelRunner(target)), PROMPT, config)
        assert list(response.token_ids) == local.token_ids
        assert response.stats.accepted_tokens == local.stats.accepted_tokens
        assert response.stats.lookup_draft_tokens == local.stats.lookup_draft_tokens
        again = services.stub.Generate(request(max_new_tokens=20, k=3, seed=seed, **sampling))
        assert list(again.token_ids) == local.token_ids


def test_reduced_vocabulary_draft_over_the_wire(models) -> None:
    """A draft over 12 of the target's 32 ids (plus an UNK row): q travels with its column
    ids and the result equals the in-process loop with the same draft."""
    target, _ = models
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:12]
    draft = tiny_llama(13, seed=3, layers=1)
    stack = Services(draft, target, draft_token_map=token_map)
    try:
        for sampling in ({"temperature": 1.0}, {"temperature": 0.5, "top_k": 2}):
            response = stack.stub.Generate(request(max_new_tokens=20, k=3, seed=4, **sampling),
                                           timeout=30)
            config = GenerateConfig(max_new_tokens=20, num_draft_tokens=3,
                                    sampling=SamplingParams(seed=4, **sampling))
            drafter = LocalDrafter(ModelRunner(draft, target_vocab_size=VOCAB,
                                               token_map=token_map))
            local = generate(drafter, LocalVerifier(ModelRunner(target)), PROMPT, config)
            assert list(response.token_ids) == local.token_ids
        greedy = stack.stub.Generate(request(max_new_tokens=20, k=3), timeout=30)
        assert list(greedy.token_ids) == target_only(target, PROMPT, 20)
    finally:
        stack.close()


def test_stream_pieces_add_up_to_the_unary_response(services) -> None:
    message = request(max_new_tokens=30, temperature=1.0, seed=3)
    unary = services.stub.Generate(message, timeout=30)
    pieces = list(services.stub.GenerateStream(message, timeout=30))
    assert len(pieces) > 2
    assert [t for p in pieces for t in p.token_ids] == list(unary.token_ids)
    assert all(not p.finish_reason for p in pieces[:-1])
    assert pieces[-1].finish_reason == "length"
    assert pieces[-1].stats.rounds == unary.stats.rounds


# -- failures and restarts ---------------------------------------------------------------
def test_target_restart_mid_generation_keeps_the_output(own_services) -> None:
    stack = own_services()
    message = request(max_new_tokens=120, k=3, temperature=1.0, top_k=8, seed=5)
    expected = list(stack.stub.Generate(message, timeout=30).token_ids)

    def restart_target() -> None:
        stack.stop_target()
        stack.start_target()  # same port, empty caches

    tokens, last = stream(stack, message, restart_target)
    assert tokens == expected
    assert last.stats.resyncs >= 1


class EndVerifyOnce(grpc.ServerInterceptor):
    """Once armed, ends the next Verify with `code` before the servicer sees it."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code
        self.armed = threading.Event()

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.endswith("/Verify"):
            return handler
        inner = handler.unary_unary

        def ended(request: Any, context: grpc.ServicerContext) -> Any:
            if self.armed.is_set():
                self.armed.clear()
                context.abort(self.code, "server shutting down")
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            ended, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_verify_ended_by_a_stopping_target_is_retried(own_services, code) -> None:
    # A target that stops under a call ends it UNAVAILABLE or CANCELLED, depending on
    # where the call was: both are retried, and the output stays the same.
    end_once = EndVerifyOnce(code)
    stack = own_services(target_interceptors=[end_once])
    message = request(max_new_tokens=40, k=3, temperature=1.0, top_k=8, seed=7)
    expected = list(stack.stub.Generate(message, timeout=30).token_ids)
    tokens, last = stream(stack, message, end_once.armed.set)
    assert not end_once.armed.is_set()  # a Verify did end that way
    assert tokens == expected


def test_draft_restart_mid_generation_keeps_the_output(own_services, models) -> None:
    stack = own_services()
    message = request(max_new_tokens=120, k=3)

    def restart_draft() -> None:
        stack.stop_draft()
        stack.start_draft()

    tokens, last = stream(stack, message, restart_draft)
    assert tokens == target_only(models[0], PROMPT, 120)
    assert last.stats.resyncs >= 1 or last.stats.degraded


def test_draft_down_then_back(own_services, models) -> None:
    stack = own_services()
    expected = target_only(models[0], PROMPT, 30)
    stack.stop_draft()
    down = stack.stub.Generate(request(max_new_tokens=30, k=3), timeout=30)
    assert list(down.token_ids) == expected
    # Prompt lookup needs no draft: only its tokens were proposed.
    assert down.stats.degraded and down.stats.draft_tokens == down.stats.lookup_draft_tokens
    stack.start_draft()
    assert wait_until(lambda: not stack.stub.Generate(
        request(max_new_tokens=30, k=3), timeout=30).stats.degraded)
    back = stack.stub.Generate(request(max_new_tokens=30, k=3), timeout=30)
    assert list(back.token_ids) == expected
    assert not back.stats.degraded and back.stats.draft_tokens > 0


def test_slow_draft_is_skipped_and_output_stays_exact(own_services, models) -> None:
    settings = CoordinatorSettings(draft_timeout_s=0.05, draft_backoff_initial_s=0.02,
                                   draft_backoff_max_s=0.1)
    stack = own_services(settings=settings,
                         draft_interceptors=[DelayInterceptor("Propose", 0.3)])
    response = stack.stub.Generate(request(max_new_tokens=20, k=3), timeout=30)
    assert list(response.token_ids) == target_only(models[0], PROMPT, 20)
    assert response.stats.degraded


def test_draft_catches_up_after_a_slow_prefill(own_services, models) -> None:
    """The first Propose (the prompt's prefill) misses its deadline but completes on the
    draft; later rounds continue from there instead of re-sending the prompt forever."""
    settings = CoordinatorSettings(draft_timeout_s=0.1, draft_backoff_initial_s=0.2,
                                   draft_backoff_max_s=0.2)
    slow_prefill = DelayInterceptor("Propose", 0.3,
                                    when=lambda r: r.sync.committed_position == 0)
    stack = own_services(settings=settings, draft_interceptors=[slow_prefill],
                         target_interceptors=[DelayInterceptor("Verify", 0.01)])
    response = stack.stub.Generate(request(max_new_tokens=60, k=3), timeout=30)
    assert list(response.token_ids) == target_only(models[0], PROMPT, 60)
    assert response.stats.degraded and response.stats.draft_tokens > 0


def test_target_down_is_unavailable_naming_the_endpoint(own_services) -> None:
    stack = own_services(settings=CoordinatorSettings(target_timeout_s=1.0))
    stack.stop_target()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stack.stub.Generate(request(), timeout=20)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert stack.target_endpoint in caught.value.details()
    assert time.monotonic() - started < 10
    # A client deadline shorter than the target timeout: our DEADLINE_EXCEEDED, in time,
    # naming the target the request waited for.
    stack2 = own_services(settings=CoordinatorSettings(target_timeout_s=60.0))
    stack2.stop_target()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stack2.stub.Generate(request(), timeout=2.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stack2.target_endpoint in caught.value.details()
    assert time.monotonic() - started < 3


def test_kv_budget_exhausted_is_resource_exhausted(own_services) -> None:
    stack = own_services(target_kv_budget_bytes=1024)
    with pytest.raises(grpc.RpcError) as caught:
        stack.stub.Generate(request(), timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "budget" in caught.value.details()


# -- cancellation and session lifetime ---------------------------------------------------
def test_cancellation_releases_both_caches(own_services) -> None:
    stack = own_services(target_interceptors=[DelayInterceptor("Verify", 0.02)])
    call = stack.stub.GenerateStream(request(max_new_tokens=240, k=2), timeout=60)
    next(call)
    assert stack.target.runner.active_sessions == 1
    assert stack.draft is not None and stack.draft.runner.active_sessions == 1
    call.cancel()
    assert wait_until(lambda: stack.target.runner.active_sessions == 0)
    assert wait_until(lambda: stack.draft.runner.active_sessions == 0)


def test_client_deadline_releases_both_caches(own_services) -> None:
    stack = own_services(target_interceptors=[DelayInterceptor("Verify", 0.02)])
    with pytest.raises(grpc.RpcError) as caught:
        stack.stub.Generate(request(max_new_tokens=240, k=2), timeout=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: stack.target.runner.active_sessions == 0)
    assert stack.draft is not None
    assert wait_until(lambda: stack.draft.runner.active_sessions == 0)


def test_finished_requests_leave_no_sessions(services) -> None:
    for _ in range(3):
        services.stub.Generate(request(max_new_tokens=10), timeout=30)
    assert wait_until(lambda: services.target.runner.active_sessions == 0)
    assert services.draft is not None
    assert wait_until(lambda: services.draft.runner.active_sessions == 0)


def test_idle_sessions_expire_after_the_ttl(own_services) -> None:
    from specdec.proto.specdec.v1 import draft_pb2, draft_pb2_grpc

    stack = own_services(session_ttl_s=0.2)
    assert stack.draft is not None
    stack.draft.sessions.start_reaper()
    try:
        with grpc.insecure_channel(stack.draft_endpoint) as channel:
            draft_pb2_grpc.DraftStub(channel).Propose(draft_pb2.ProposeRequest(
                sync=common_pb2.SyncPoint(session_id="abandoned", append_tokens=PROMPT),
                num_tokens=2), timeout=10)
        assert stack.draft.runner.active_sessions == 1  # nobody calls Release
        assert wait_until(lambda: stack.draft.runner.active_sessions == 0, 3.0)
    finally:
        stack.draft.sessions.close()


# -- concurrency -------------------------------------------------------------------------
def test_concurrent_requests_equal_sequential_ones(services) -> None:
    messages = [request(max_new_tokens=24, k=3, temperature=1.0, top_k=10, seed=seed)
                for seed in range(8)]
    sequential = [list(services.stub.Generate(m, timeout=60).token_ids) for m in messages]
    bad = request(max_new_tokens=-1)
    bad_codes: list[grpc.StatusCode] = []

    def bad_calls() -> None:  # invalid requests alongside must not disturb anyone
        for _ in range(10):
            try:
                services.stub.Generate(bad, timeout=10)
            except grpc.RpcError as error:
                bad_codes.append(error.code())

    noise = threading.Thread(target=bad_calls)
    noise.start()
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(
            lambda m: list(services.stub.Generate(m, timeout=120).token_ids), messages))
    noise.join()
    assert concurrent == sequential
    assert len(set(map(tuple, sequential))) > 1
    assert bad_codes == [grpc.StatusCode.INVALID_ARGUMENT] * 10


def test_wire_tensor_work_runs_on_the_compute_thread(services, monkeypatch) -> None:
    """Probabilities are decoded and encoded on each service's compute thread: a torch op
    on a gRPC worker thread starts another OpenMP team, which shortens the spin of the
    forward's team (specdec.serving.model_service.BatchScheduler.submit)."""
    from specdec.serving import wire

    # (function, calling module) -> threads; the coordinator shares this test process.
    threads: dict[tuple[str, str], set[str]] = {}
    for name in ("encode_probs", "decode_probs"):
        original = getattr(wire, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals["__name__"]
            threads.setdefault((_name, caller), set()).add(threading.current_thread().name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(wire, name, spy)
    response = services.stub.Generate(request(max_new_tokens=12, temperature=1.0, seed=4))
    assert response.stats.draft_tokens > 0
    services_calls = {key: seen for key, seen in threads.items()
                      if key[1] in ("draft_service.servicer", "target_service.servicer")}
    assert {name for name, _ in services_calls} == {"encode_probs", "decode_probs"}
    for key, seen in services_calls.items():
        assert all(thread.startswith("compute") for thread in seen), (key, seen)
