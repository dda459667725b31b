"""The coordinator under many concurrent streams: real gRPC on loopback, tiny models.

Every stream completes with the serial greedy output; beyond the running and queued
limits requests get RESOURCE_EXHAUSTED at once (counted); a cancelled or expired stream
frees its slot and both services' sessions while the others go on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry
from service_harness import DelayInterceptor, Services
from tiny_models import tiny_llama

from coordinator.admission import Admission, AdmissionAbandoned, AdmissionRefused
from coordinator.endpoints import StaticEndpoints
from coordinator.server import build_coordinator_server
from coordinator.servicer import CoordinatorServicer, CoordinatorSettings
from specdec.core.loop import GenerateConfig, generate
from specdec.engine.local import LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.proto.specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specdec.serving.grpc_server import ServerHandle
from specdec.telemetry.service import Telemetry

VOCAB = 32
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(1)
    return tiny_llama(VOCAB, seed=1), tiny_llama(VOCAB, seed=2, layers=1)


class Coordinator:
    """A coordinator of its own settings over a Services stack's draft and target."""

    def __init__(self, stack: Services, settings: CoordinatorSettings) -> None:
        self.telemetry = Telemetry("coordinator", registry=CollectorRegistry())
        self.servicer = CoordinatorServicer(
            stack.coordinator.target,
            StaticEndpoints(stack.target_endpoint, stack.draft_endpoint),
            settings=settings, channels=stack.channels, telemetry=self.telemetry)
        self.server: ServerHandle = build_coordinator_server(self.servicer)
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def metric(self, name: str) -> float:
        value = self.telemetry.registry.get_sample_value(name)
        return 0.0 if value is None else value

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


@pytest.fixture
def stack(models) -> Iterator[Callable[..., tuple[Services, Coordinator]]]:
    made: list[tuple[Services, Coordinator]] = []

    def make(settings: CoordinatorSettings | None = None,
             **kwargs: object) -> tuple[Services, Coordinator]:
        target, draft = models
        settings = settings or CoordinatorSettings()
        services = Services(draft, target, **kwargs)  # type: ignore[arg-type]
        made.append((services, Coordinator(services, settings)))
        return made[-1]

    yield make
    for services, coordinator in made:
        coordinator.close()
        services.close()


def request(prompt: list[int], max_new_tokens: int = NEW_TOKENS, k: int = 2,
            adaptive: bool = False) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=max_new_tokens,
        speculation=coordinator_pb2.SpeculationParams(num_draft_tokens=k, adaptive=adaptive))


def prompt_of(i: int) -> list[int]:
    return [1 + i % 7, 2 + (i * 3) % 11, 3 + (i * 5) % 13, 4]


def serial_greedy(target: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    result = generate(None, LocalVerifier(ModelRunner(target)), prompt,
                      GenerateConfig(max_new_tokens=new_tokens, num_draft_tokens=0))
    return result.token_ids


def stream_tokens(stub: coordinator_pb2_grpc.CoordinatorStub,
                  message: coordinator_pb2.GenerateRequest) -> list[int]:
    tokens: list[int] = []
    for chunk in stub.GenerateStream(message, timeout=120):
        tokens.extend(chunk.token_ids)
    return tokens


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_the_server_holds_a_thread_for_every_admitted_request() -> None:
    admission = Admission(max_running=256, max_queued=64)
    assert admission.threads_needed() > 256 + 64


def test_sixty_four_concurrent_streams_all_complete_with_the_serial_output(models, stack
                                                                           ) -> None:
    target, _ = models
    services, coordinator = stack()
    streams = 64
    expected = {i: serial_greedy(target, prompt_of(i), NEW_TOKENS) for i in range(8)}
    started = threading.Barrier(streams)

    def one(i: int) -> list[int]:
        started.wait()  # all 64 in flight together
        adaptive = i % 2 == 1
        return stream_tokens(coordinator.stub, request(prompt_of(i % 8), adaptive=adaptive,
                                                       k=0 if i % 4 == 0 else 3))

    with ThreadPoolExecutor(streams) as pool:
        outputs = list(pool.map(one, range(streams)))
    assert [out == expected[i % 8] for i, out in enumerate(outputs)] == [True] * streams
    counts = coordinator.servicer.admission.counts()
    assert counts.admitted == streams and counts.refused == 0 and counts.running == 0
    assert wait_until(lambda: services.target.runner.active_sessions == 0)
    assert services.draft is not None
    assert wait_until(lambda: services.draft.runner.active_sessions == 0)


def test_beyond_capacity_only_resource_exhausted_at_once_and_counted(stack) -> None:
    settings = CoordinatorSettings(max_concurrent_requests=2, max_queued_requests=1)
    _, coordinator = stack(settings, target_interceptors=[DelayInterceptor("Verify", 0.1)])
    calls = 8
    started = threading.Barrier(calls)

    def one(i: int) -> tuple[str, float, str]:
        started.wait()
        begin = time.monotonic()
        try:
            coordinator.stub.Generate(request(prompt_of(i), max_new_tokens=8, k=0),
                                      timeout=60)
            return "OK", time.monotonic() - begin, ""
        except grpc.RpcError as error:
            return error.code().name, time.monotonic() - begin, error.details() or ""

    with ThreadPoolExecutor(calls) as pool:
        outcomes = list(pool.map(one, range(calls)))
    codes = sorted(code for code, _, _ in outcomes)
    assert codes == ["OK"] * 3 + ["RESOURCE_EXHAUSTED"] * 5
    refused = [(elapsed, details) for code, elapsed, details in outcomes if code != "OK"]
    served = [elapsed for code, elapsed, _ in outcomes if code == "OK"]
    # Refused at once: long before a served request (8 rounds of 0.1 s) could finish.
    assert max(elapsed for elapsed, _ in refused) < min(served)
    assert all("SPECDEC_MAX_CONCURRENT_REQUESTS" in details
               and "SPECDEC_MAX_QUEUED_REQUESTS" in details for _, details in refused)
    counts = coordinator.servicer.admission.counts()
    assert (counts.admitted, counts.refused, counts.running, counts.queued) == (3, 5, 0, 0)
    assert coordinator.metric("specdec_refused_requests_total") == 5


def test_a_cancelled_stream_frees_its_slot_and_sessions_while_others_finish(models,
                                                                            stack) -> None:
    target, _ = models
    services, coordinator = stack(target_interceptors=[DelayInterceptor("Verify", 0.05)])
    assert services.draft is not None
    others = 6
    expected = serial_greedy(target, prompt_of(1), 20)
    cancelled = coordinator.stub.GenerateStream(request(prompt_of(0), max_new_tokens=240),
                                                timeout=120)
    next(cancelled)  # running: it holds a session on each service
    (target_session,) = list(services.target.runner._sessions)
    (draft_session,) = list(services.draft.runner._sessions)
    with ThreadPoolExecutor(others) as pool:
        futures = [pool.submit(stream_tokens, coordinator.stub,
                               request(prompt_of(1), max_new_tokens=20)) for _ in range(others)]
        time.sleep(0.2)
        cancelled.cancel()
        # Freed at its next round, long before its 240 tokens (80+ rounds of 0.05 s) end.
        assert wait_until(lambda: services.target.runner.kv_length(target_session) == 0,
                          timeout_s=1.5)
        assert wait_until(lambda: services.draft.runner.kv_length(draft_session) == 0,
                          timeout_s=1.5)
        outputs = [future.result() for future in futures]
    assert outputs == [expected] * others
    with pytest.raises(grpc.RpcError) as caught:
        next(cancelled)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert wait_until(lambda: coordinator.servicer.admission.counts().running == 0)
    assert wait_until(lambda: services.target.runner.active_sessions == 0)
    assert wait_until(lambda: services.draft.runner.active_sessions == 0)


def test_an_expired_stream_frees_its_slot_and_sessions(stack) -> None:
    services, coordinator = stack(target_interceptors=[DelayInterceptor("Verify", 0.02)])
    with pytest.raises(grpc.RpcError) as caught:
        for _ in coordinator.stub.GenerateStream(request(prompt_of(0), max_new_tokens=240),
                                                 timeout=0.6):
            pass
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: coordinator.servicer.admission.counts().running == 0)
    assert wait_until(lambda: services.target.runner.active_sessions == 0)
    assert services.draft is not None
    assert wait_until(lambda: services.draft.runner.active_sessions == 0)


def test_a_queued_request_runs_when_a_slot_frees_and_leaves_the_queue_when_cancelled(
) -> None:
    admission = Admission(max_running=1, max_queued=1)
    admission.acquire()
    gone = threading.Event()
    outcome: list[str] = []

    def queued() -> None:
        try:
            admission.acquire(gone.is_set)
            outcome.append("admitted")
            admission.release()
        except AdmissionAbandoned:
            outcome.append("abandoned")

    waiter = threading.Thread(target=queued)
    waiter.start()
    assert wait_until(lambda: admission.counts().queued == 1)
    with pytest.raises(AdmissionRefused, match="limit 1, SPECDEC_MAX_QUEUED_REQUESTS"):
        admission.acquire()
    gone.set()
    waiter.join(5)
    assert outcome == ["abandoned"] and admission.counts().queued == 0
    admitted = threading.Thread(target=queued)
    gone.clear()
    admitted.start()
    assert wait_until(lambda: admission.counts().queued == 1)
    admission.release()
    admitted.join(5)
    assert outcome == ["abandoned", "admitted"]
    counts = admission.counts()
    assert (counts.running, counts.refused, counts.abandoned) == (0, 1, 1)


class BatchReporter(grpc.ServerInterceptor):
    """Fills BatchInfo on every Verify response, as a batching target does."""

    def __init__(self, sessions: int, rows: int, queued: int) -> None:
        self.batch = common_pb2.BatchInfo(sessions=sessions, rows=rows,
                                          queue_wait_seconds=0.002, queued=queued)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.endswith("/Verify"):
            return handler
        inner = handler.unary_unary

        def reported(request: Any, context: Any) -> Any:
            response = inner(request, context)
            response.batch.CopyFrom(self.batch)
            return response

        return grpc.unary_unary_rpc_method_handler(
            reported, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def test_round_spans_record_the_verify_batch_and_the_load_it_chose_under(models,
                                                                         tmp_path) -> None:
    from specdec.telemetry import names as n
    from specdec.telemetry.reader import load_spans
    from tests.telemetry_helpers import file_telemetry

    target, draft = models
    services = Services(draft, target, target_interceptors=[BatchReporter(3, 12, 1)])
    trace_file = tmp_path / "coordinator.jsonl"
    telemetry = file_telemetry(trace_file)
    servicer = CoordinatorServicer(
        services.coordinator.target,
        StaticEndpoints(services.target_endpoint, services.draft_endpoint),
        channels=services.channels, telemetry=telemetry)
    server = build_coordinator_server(servicer)
    try:
        with grpc.insecure_channel(server.address) as channel:
            coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
                request(prompt_of(0), max_new_tokens=16, k=3, adaptive=True), timeout=60)
    finally:
        server.stop(0)
        services.close()
        telemetry.shutdown()
    rounds = [s for s in load_spans([trace_file]) if s.name == n.ROUND_SPAN]
    assert rounds
    for span in rounds:
        attributes = span.attributes
        assert attributes[n.VERIFY_BATCH_SESSIONS] == 3
        assert attributes[n.VERIFY_BATCH_ROWS] == 12
        assert attributes[n.VERIFY_BATCH_QUEUED] == 1
        assert attributes[n.VERIFY_QUEUE_WAIT_MS] == pytest.approx(2.0)
        assert attributes[n.LOAD_RUNNING] == 1 and n.LOAD_LIMITED in attributes
        # one request, the gate's first epochs: every source (drafting, nothing known yet)
        assert attributes[n.GATE_ARM] == "draft" and attributes[n.GATED_OFF] is False
    # From the second round on the policy sees the batch: 3 sessions and 1 queued.
    assert [span.attributes[n.LOAD_SESSIONS] for span in rounds[1:]] == [4] * (len(rounds) - 1)


def test_more_streams_than_the_running_limit_queue_and_all_complete(models, stack) -> None:
    """300 streams at once against the default limits: 256 run, the rest wait their turn."""
    target, _ = models
    _, coordinator = stack()
    streams = 300
    expected = {i: serial_greedy(target, prompt_of(i), 6) for i in range(8)}
    started = threading.Barrier(streams)
    peak = 0
    finished = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not finished.is_set():
            peak = max(peak, coordinator.servicer.admission.counts().running)
            time.sleep(0.01)

    def one(i: int) -> list[int]:
        started.wait()
        return stream_tokens(coordinator.stub, request(prompt_of(i % 8), max_new_tokens=6,
                                                       k=2 if i % 2 else 0))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(streams) as pool:
        outputs = list(pool.map(one, range(streams)))
    finished.set()
    watcher.join()
    assert all(out == expected[i % 8] for i, out in enumerate(outputs))
    assert peak == coordinator.servicer.settings.max_concurrent_requests == 256
    counts = coordinator.servicer.admission.counts()
    assert (counts.admitted, counts.refused, counts.running) == (streams, 0, 0)
