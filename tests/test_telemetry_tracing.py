"""Request and round spans from an in-process run, through the JSON-lines file exporter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specdec.telemetry import names as n
from specdec.telemetry import reader
from specdec.telemetry.service import Telemetry
from specdec.telemetry.tracing import build_tracer_provider, service_resource
from tests.telemetry_helpers import PROMPT, file_telemetry, run_request


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    path = tmp_path_factory.mktemp("traces") / "coordinator.jsonl"
    telemetry = file_telemetry(path)
    result, trace_id = run_request(telemetry)
    telemetry.shutdown()
    return path, result, trace_id


def test_file_is_otlp_json_lines_with_hex_ids(traced: tuple) -> None:
    path, _, trace_id = traced
    lines = Path(path).read_text().splitlines()
    assert lines
    message = json.loads(lines[0])
    span = message["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(span["traceId"]) == 32 and int(span["traceId"], 16) >= 0
    assert len(span["spanId"]) == 16
    assert len(trace_id) == 32


def test_one_trace_with_round_spans_under_the_request(traced: tuple) -> None:
    path, result, trace_id = traced
    spans = reader.load_spans([path])
    assert {s.trace_id for s in spans} == {trace_id}
    generate = [s for s in spans if s.name == n.GENERATE_SPAN]
    assert len(generate) == 1 and generate[0].parent_id == ""
    rounds = [s for s in spans if s.name == n.ROUND_SPAN]
    assert len(rounds) == result.stats.rounds
    assert all(r.parent_id == generate[0].span_id for r in rounds)
    by_id = {s.span_id: s for s in spans}
    steps = [s for s in spans if s.name in (n.PROPOSE_STEP_SPAN, n.VERIFY_STEP_SPAN)]
    assert steps and all(by_id[s.parent_id].name == n.ROUND_SPAN for s in steps)
    # Every round verifies once; rounds end after their steps.
    assert sum(s.name == n.VERIFY_STEP_SPAN for s in steps) == result.stats.rounds
    for step in steps:
        parent = by_id[step.parent_id]
        assert parent.start_ns <= step.start_ns <= step.end_ns <= parent.end_ns


def test_request_attributes_match_stats(traced: tuple) -> None:
    path, result, _ = traced
    spans = reader.load_spans([path])
    a = next(s for s in spans if s.name == n.GENERATE_SPAN).attributes
    stats = result.stats
    assert a[n.REQUEST_ID] == "req-1"
    assert a[n.PROMPT_TOKENS] == len(PROMPT)
    assert a[n.NEW_TOKENS] == len(result.token_ids)
    assert a[n.ROUNDS] == stats.rounds
    assert a[n.ACCEPTED_TOKENS] == stats.accepted_tokens
    assert a[n.DRAFT_TOKENS] == stats.draft_tokens
    assert a[n.ACCEPTANCE_RATE] == pytest.approx(stats.acceptance_rate)
    assert a[n.FINISH_REASON] == result.finish_reason
    assert a[n.DEGRADED] is False


def test_round_attributes_and_rejection_events(traced: tuple) -> None:
    path, result, _ = traced
    rounds = sorted((s for s in reader.load_spans([path]) if s.name == n.ROUND_SPAN),
                    key=lambda s: s.attributes[n.ROUND_INDEX])
    assert [r.attributes[n.ROUND_INDEX] for r in rounds] == list(range(result.stats.rounds))
    emitted: list[int] = []
    position = len(PROMPT)
    for span in rounds:
        a = span.attributes
        assert a[n.POSITION_BEFORE] == position
        position = a[n.POSITION_AFTER]
        assert a[n.EMITTED] == position - a[n.POSITION_BEFORE]
        emitted += a[n.EMITTED_TOKEN_IDS]
        rejections = [e for e in span.events if e.name == n.REJECTION_EVENT]
        if a[n.ACCEPTED] < a[n.PROPOSED]:
            assert a[n.NEXT_TOKEN_KIND] == "correction"
            (event,) = rejections
            assert event.attributes[n.REJECT_POSITION] == a[n.POSITION_BEFORE] + a[n.ACCEPTED]
            assert event.attributes[n.REJECT_DRAFT_INDEX] == a[n.ACCEPTED]
        else:
            assert not rejections
            assert a[n.NEXT_TOKEN_KIND] == ("bonus" if a[n.PROPOSED] else "target")
    assert emitted == result.token_ids
    # Random tiny models disagree often: the run must have shown at least one rejection.
    assert any(r.events for r in rounds)


def test_tracing_off_gives_empty_trace_id_and_no_spans(tmp_path: Path) -> None:
    telemetry = Telemetry("coordinator", build_tracer_provider("coordinator", enabled=False))
    result, trace_id = run_request(telemetry, max_new_tokens=4)
    assert trace_id == "" and len(result.token_ids) == 4
    assert telemetry.server_interceptors() == []


def test_otel_sdk_disabled_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert isinstance(build_tracer_provider("draft"), trace.NoOpTracerProvider)


def test_service_name_default_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert service_resource("draft").attributes["service.name"] == "specdec-draft"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-draft")
    resource = service_resource("draft")
    assert resource.attributes["service.name"] == "my-draft"
    assert resource.attributes[n.ROLE] == "draft"


def test_exception_closes_open_round_and_marks_error() -> None:
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider("coordinator", exporters=[exporter], synchronous=True)
    telemetry = Telemetry("coordinator", provider)

    class Broken:
        def verify(self, *args: object) -> None:
            raise RuntimeError("target down")

        def release(self, session_id: str) -> None:
            pass

    from specdec.core.loop import GenerateConfig, generate

    with pytest.raises(RuntimeError), telemetry.request("r", 3, GenerateConfig()) as observed:
        generate(None, observed.verifier(Broken()), [1, 2, 3], GenerateConfig(max_new_tokens=2),
                 on_round=observed.on_round)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans[n.ROUND_SPAN].status.status_code == trace.StatusCode.ERROR
    assert spans[n.GENERATE_SPAN].status.status_code == trace.StatusCode.ERROR
    assert trace.get_current_span() is trace.INVALID_SPAN  # contexts were detached


def test_unsampled_request_reports_no_trace_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("coordinator", build_tracer_provider(
        "coordinator", exporters=[exporter], synchronous=True))
    _, trace_id = run_request(telemetry, max_new_tokens=3)
    assert trace_id == "" and not exporter.get_finished_spans()


def test_trace_context_crosses_a_grpc_call() -> None:
    """Client span -> traceparent in metadata -> server span in another provider."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health_pb2

    exporter = InMemorySpanExporter()
    client = Telemetry("coordinator", build_tracer_provider(
        "coordinator", exporters=[exporter], synchronous=True))
    server_side = Telemetry("target", build_tracer_provider(
        "target", exporters=[exporter], synchronous=True))
    seen: list[str] = []

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(format(trace.get_current_span().get_span_context().trace_id, "032x"))
        return request

    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(echo)})
    server = grpc.server(futures.ThreadPoolExecutor(2),
                         interceptors=server_side.server_interceptors())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel = client.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{port}"))
        with client.tracer.start_as_current_span("parent") as parent:
            assert channel.unary_unary("/test.Echo/Call")(b"x", timeout=10) == b"x"
        assert health_pb2  # health checks are filtered (see propagation.py)
    finally:
        server.stop(0)
    spans = {(s.name, s.kind): s for s in exporter.get_finished_spans()}
    call_client = spans[("/test.Echo/Call", trace.SpanKind.CLIENT)]
    call_server = spans[("/test.Echo/Call", trace.SpanKind.SERVER)]
    trace_id = parent.get_span_context().trace_id
    assert seen == [format(trace_id, "032x")]
    assert call_client.context.trace_id == call_server.context.trace_id == trace_id
    assert call_server.parent.span_id == call_client.context.span_id
    assert call_server.resource.attributes[n.ROLE] == "target"


def test_health_checks_and_reflection_are_not_traced() -> None:
    from types import SimpleNamespace

    from specdec.telemetry.propagation import _traced

    assert _traced(SimpleNamespace(method="/specdec.v1.Draft/Propose"))  # server side
    assert _traced(SimpleNamespace(full_method="/specdec.v1.Target/Verify"))  # client side
    assert not _traced(SimpleNamespace(method="/grpc.health.v1.Health/Check"))
    assert not _traced(SimpleNamespace(method=b"/grpc.health.v1.Health/Watch"))
    assert not _traced(SimpleNamespace(
        full_method="/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"))
