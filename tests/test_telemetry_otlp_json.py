"""The direct OTLP/JSON encoder agrees with the exporter library's protobuf encoding."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags, TraceState

from specdec.telemetry.file_exporter import (
    JsonLinesSpanExporter,
    protobuf_json_line,
    spans_to_json_line,
)
from specdec.telemetry.tracing import build_tracer_provider


def _varied_spans() -> list:
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider("target", exporters=[exporter], synchronous=True)
    tracer = provider.get_tracer("specdec", "1.0")
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("vendor", "x")]))
    parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    with tracer.start_as_current_span("server", context=parent, kind=trace.SpanKind.SERVER,
                                      links=[Link(remote, {"why": "retry"})]) as span:
        span.set_attributes({"s": "x", "b": True, "i": 7, "f": 0.25, "nan": float("nan"),
                             "ints": [1, 2], "strs": ["a"], "empty": []})
        span.add_event("rejection", {"position": 3})
        with tracer.start_as_current_span("child") as child:
            child.set_status(Status(StatusCode.ERROR, "boom"))
    other = provider.get_tracer("other")
    other.start_span("root", kind=trace.SpanKind.CLIENT).end()
    return list(exporter.get_finished_spans())


def test_direct_encoding_equals_protobuf_encoding() -> None:
    spans = _varied_spans()
    assert json.loads(spans_to_json_line(spans)) == json.loads(protobuf_json_line(spans))


def test_rotation_keeps_one_backup(tmp_path: Path) -> None:
    spans = _varied_spans()
    path = tmp_path / "target.jsonl"
    exporter = JsonLinesSpanExporter(path, max_bytes=len(spans_to_json_line(spans)) + 10)
    exporter.export(spans)
    exporter.export(spans)
    assert path.with_name("target.jsonl.1").exists()
    assert len(path.read_text().splitlines()) == 1
