"""Read the services' OTLP/JSON-lines trace files and rebuild requests from them.

Each service writes its own file; spans of one request share a trace id across them
(the W3C context travels in gRPC metadata), so joining is a group-by on trace id. The
request summary comes from the `specdec.generate` span, the round table from its
`specdec.round` children, and the network/model split from the Propose/Verify client
spans under each round and the server spans under those.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.telemetry import names as n

logger = logging.getLogger(__name__)

KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_ERROR = 2


@dataclass
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[SpanEvent]
    service: str
    role: str
    error: bool = False

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def method(self) -> str:
        """`Propose` for a gRPC span named `/pkg.Service/Propose`, else the span name."""
        return self.name.rsplit("/", 1)[-1] if self.name.startswith("/") else self.name


def any_value(value: dict[str, Any]) -> Any:
    """Decode an OTLP/JSON AnyValue."""
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])  # int64 is a JSON string in proto3 JSON
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return attributes_of(value["kvlistValue"].get("values", []))
    return value.get("bytesValue")


def attributes_of(items: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {item["key"]: any_value(item.get("value", {})) for item in items}


def spans_from_request(message: dict[str, Any]) -> Iterator[SpanRecord]:
    """Spans of one ExportTraceServiceRequest in OTLP/JSON."""
    for resource_spans in message.get("resourceSpans", []):
        resource = attributes_of(resource_spans.get("resource", {}).get("attributes", []))
        service = str(resource.get("service.name", "?"))
        role = str(resource.get(n.ROLE, service.removeprefix("specdec-")))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                yield SpanRecord(
                    trace_id=span.get("traceId", ""), span_id=span.get("spanId", ""),
                    parent_id=span.get("parentSpanId", ""), name=span.get("name", ""),
                    kind=int(span.get("kind", KIND_INTERNAL)),
                    start_ns=int(span.get("startTimeUnixNano", 0)),
                    end_ns=int(span.get("endTimeUnixNano", 0)),
                    attributes=attributes_of(span.get("attributes", [])),
                    events=[SpanEvent(e.get("name", ""), int(e.get("timeUnixNano", 0)),
                                      attributes_of(e.get("attributes", [])))
                            for e in span.get("events", [])],
                    service=service, role=role,
                    error=int(span.get("status", {}).get("code", 0)) == STATUS_ERROR)


def trace_files(directory: Path) -> list[Path]:
    """`*.jsonl` plus the rotated `*.jsonl.1` backups."""
    return sorted([*directory.glob("*.jsonl"), *directory.glob("*.jsonl.1")])


def load_spans(paths: Iterable[Path]) -> list[SpanRecord]:
    spans: list[SpanRecord] = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    spans.extend(spans_from_request(json.loads(line)))
                except (ValueError, KeyError, TypeError) as error:
                    # A service killed mid-write leaves a torn last line; skip it.
                    logger.warning("%s:%d: skipping unreadable line (%s)", path, number, error)
    return spans


def group_by_trace(spans: Iterable[SpanRecord]) -> dict[str, list[SpanRecord]]:
    traces: dict[str, list[SpanRecord]] = defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    return dict(traces)


@dataclass
class RequestSummary:
    trace_id: str
    span_id: str
    start_ns: int
    latency_ms: float
    request_id: str
    prompt_tokens: int
    new_tokens: int
    rounds: int
    acceptance_rate: float
    mean_accepted_length: float
    finish_reason: str
    degraded: bool
    error: bool
    services: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / (self.latency_ms / 1000.0) if self.latency_ms > 0 else 0.0


def summarize(generate: SpanRecord, trace: list[SpanRecord]) -> RequestSummary:
    a = generate.attributes
    return RequestSummary(
        trace_id=generate.trace_id, span_id=generate.span_id, start_ns=generate.start_ns,
        latency_ms=generate.duration_ms, request_id=str(a.get(n.REQUEST_ID, "")),
        prompt_tokens=int(a.get(n.PROMPT_TOKENS, 0)), new_tokens=int(a.get(n.NEW_TOKENS, 0)),
        rounds=int(a.get(n.ROUNDS, 0)), acceptance_rate=float(a.get(n.ACCEPTANCE_RATE, 0.0)),
        mean_accepted_length=float(a.get(n.MEAN_ACCEPTED_LENGTH, 0.0)),
        finish_reason=str(a.get(n.FINISH_REASON, "error" if generate.error else "?")),
        degraded=bool(a.get(n.DEGRADED, False)), error=generate.error,
        services=sorted({span.role for span in trace}))


def list_requests(spans: Iterable[SpanRecord], limit: int | None = None) -> list[RequestSummary]:
    """Requests newest first; one per `specdec.generate` span."""
    summaries = [summarize(span, trace)
                 for trace in group_by_trace(spans).values()
                 for span in trace if span.name == n.GENERATE_SPAN]
    summaries.sort(key=lambda s: s.start_ns, reverse=True)
    return summaries[:limit] if limit else summaries


def resolve_trace_id(spans: Iterable[SpanRecord], prefix: str) -> str:
    """The trace id starting with `prefix` (case-insensitive); unique or an error."""
    prefix = prefix.lower().strip()
    matches = sorted({span.trace_id for span in spans if span.trace_id.startswith(prefix)})
    if not matches:
        raise ValueError(f"no trace with id {prefix!r} in the trace files")
    if len(matches) > 1:
        raise ValueError(f"trace id prefix {prefix!r} is ambiguous: {', '.join(matches[:5])}")
    return matches[0]


@dataclass
class RoundRow:
    index: int
    start_ms: float  # from the request span's start
    duration_ms: float
    position_before: int
    position_after: int
    asked: int
    proposed: int
    accepted: int
    emitted: int
    next_token: str  # bonus, correction or target
    rejected_at: int | None  # absolute position of the rejected draft token
    propose_ms: float | None  # as the coordinator saw it
    draft_forward_ms: float | None
    verify_ms: float
    target_forward_ms: float
    network_ms: float | None  # client time not spent inside a server (wire + queueing)
    resyncs: int
    degraded: bool
    source: str = ""  # who proposed (names.SOURCE)


def _children(trace: list[SpanRecord]) -> dict[str, list[SpanRecord]]:
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for span in trace:
        children[span.parent_id].append(span)
    for group in children.values():
        group.sort(key=lambda s: s.start_ns)
    return children


@dataclass
class RpcTimes:
    client_ms: float  # the call as the coordinator saw it (all attempts of the round)
    forward_ms: float | None  # model time the servers reported; None without server spans
    outside_ms: float | None  # client time outside any server span: wire, (de)serialising


def _rpc_times(round_span: SpanRecord, children: dict[str, list[SpanRecord]],
               method: str) -> RpcTimes | None:
    clients = [c for c in children.get(round_span.span_id, [])
               if c.kind == KIND_CLIENT and c.method == method]
    if not clients:
        return None
    client_ms = sum(c.duration_ms for c in clients)
    servers = [s for c in clients for s in children.get(c.span_id, []) if s.kind == KIND_SERVER]
    if not servers:  # the service wrote no trace file here (or has tracing off)
        return RpcTimes(client_ms, None, None)
    forward = sum(float(s.attributes.get(n.FORWARD_MS, 0.0)) for s in servers)
    return RpcTimes(client_ms, forward, client_ms - sum(s.duration_ms for s in servers))


def _network_ms(propose: RpcTimes | None, verify: RpcTimes | None) -> float | None:
    parts = [rpc for rpc in (propose, verify) if rpc is not None]
    if not parts or any(rpc.outside_ms is None for rpc in parts):
        return None
    return sum(rpc.outside_ms or 0.0 for rpc in parts)


def round_rows(generate: SpanRecord, trace: list[SpanRecord]) -> list[RoundRow]:
    children = _children(trace)
    rows: list[RoundRow] = []
    for span in children.get(generate.span_id, []):
        if span.name != n.ROUND_SPAN:
            continue
        a = span.attributes
        rejection = next((e for e in span.events if e.name == n.REJECTION_EVENT), None)
        propose = _rpc_times(span, children, "Propose")
        verify = _rpc_times(span, children, "Verify")
        # Server-side numbers when the services' files are there, else the coordinator's.
        draft_forward = propose.forward_ms if propose else None
        target_forward = verify.forward_ms if verify else None
        rows.append(RoundRow(
            index=int(a.get(n.ROUND_INDEX, len(rows))),
            start_ms=(span.start_ns - generate.start_ns) / 1e6, duration_ms=span.duration_ms,
            position_before=int(a.get(n.POSITION_BEFORE, 0)),
            position_after=int(a.get(n.POSITION_AFTER, 0)), asked=int(a.get(n.ASKED, 0)),
            proposed=int(a.get(n.PROPOSED, 0)), accepted=int(a.get(n.ACCEPTED, 0)),
            emitted=int(a.get(n.EMITTED, 0)), next_token=str(a.get(n.NEXT_TOKEN_KIND, "")),
            rejected_at=(int(rejection.attributes.get(n.REJECT_POSITION, -1))
                         if rejection else None),
            propose_ms=propose.client_ms if propose else a.get(n.DRAFT_MS),
            draft_forward_ms=draft_forward if draft_forward is not None
            else a.get(n.DRAFT_FORWARD_MS),
            verify_ms=verify.client_ms if verify else float(a.get(n.VERIFY_MS, 0.0)),
            target_forward_ms=target_forward if target_forward is not None
            else float(a.get(n.VERIFY_FORWARD_MS, 0.0)),
            network_ms=_network_ms(propose, verify), resyncs=int(a.get(n.RESYNCS, 0)),
            degraded=bool(a.get(n.DEGRADED, False)), source=str(a.get(n.SOURCE, ""))))
    rows.sort(key=lambda r: r.index)
    return rows


@dataclass
class TimelineRow:
    span: SpanRecord
    depth: int


def timeline(trace: list[SpanRecord]) -> list[TimelineRow]:
    """Spans depth-first in start order; spans whose parent is not in the files are roots."""
    known = {span.span_id for span in trace}
    children = _children(trace)
    roots = sorted((s for s in trace if s.parent_id not in known), key=lambda s: s.start_ns)
    rows: list[TimelineRow] = []

    def visit(span: SpanRecord, depth: int) -> None:
        rows.append(TimelineRow(span, depth))
        for child in children.get(span.span_id, []):
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return rows


@dataclass
class RequestDetail:
    summary: RequestSummary | None
    rounds: list[RoundRow]
    spans: list[TimelineRow]


def request_detail(spans: Iterable[SpanRecord], trace_id: str) -> RequestDetail:
    trace = group_by_trace(spans).get(trace_id, [])
    generate = next((s for s in sorted(trace, key=lambda s: s.start_ns)
                     if s.name == n.GENERATE_SPAN), None)
    if generate is None:
        return RequestDetail(None, [], timeline(trace))
    return RequestDetail(summarize(generate, trace), round_rows(generate, trace), timeline(trace))


def detail_to_json(detail: RequestDetail) -> dict[str, Any]:
    t0 = min((row.span.start_ns for row in detail.spans), default=0)
    return {
        "summary": asdict(detail.summary) if detail.summary else None,
        "rounds": [asdict(row) for row in detail.rounds],
        "spans": [{
            "depth": row.depth, "name": row.span.name, "service": row.span.service,
            "role": row.span.role, "kind": row.span.kind, "span_id": row.span.span_id,
            "parent_id": row.span.parent_id, "start_ms": (row.span.start_ns - t0) / 1e6,
            "duration_ms": row.span.duration_ms, "error": row.span.error,
            "attributes": row.span.attributes,
            "events": [asdict(event) for event in row.span.events],
        } for row in detail.spans],
    }
