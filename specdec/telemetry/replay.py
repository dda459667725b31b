"""Send trace files to an OTLP/gRPC endpoint (Phoenix, Jaeger, a Collector) after the fact.

The files hold OTLP/JSON with hex ids; protobuf's JSON parser wants base64 for bytes
fields, so ids are converted back before parsing into ExportTraceServiceRequest.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _base64_ids(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_KEYS and isinstance(value, str):
                node[key] = base64.b64encode(bytes.fromhex(value)).decode()
            else:
                _base64_ids(value)
    elif isinstance(node, list):
        for item in node:
            _base64_ids(item)


def parse_line(line: str) -> trace_service_pb2.ExportTraceServiceRequest:
    message = json.loads(line)
    _base64_ids(message)
    return json_format.ParseDict(message, trace_service_pb2.ExportTraceServiceRequest(),
                                 ignore_unknown_fields=True)


def grpc_target(endpoint: str) -> tuple[str, bool]:
    """(host:port, use TLS) from `http://host:4317`, `https://...` or `host:4317`."""
    parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    return f"{parsed.hostname}:{parsed.port or 4317}", parsed.scheme == "https"


def send_files(paths: Iterable[Path], endpoint: str, timeout_s: float = 10.0) -> int:
    """Export every line of every file; returns the number of spans sent."""
    target, tls = grpc_target(endpoint)
    channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials()) if tls
               else grpc.insecure_channel(target))
    sent = 0
    with channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        for path in paths:
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    request = parse_line(line)
                except (ValueError, json_format.ParseError):
                    continue  # a torn last line
                stub.Export(request, timeout=timeout_s)
                sent += sum(len(scope.spans) for resource in request.resource_spans
                            for scope in resource.scope_spans)
    return sent
