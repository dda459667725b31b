"""A SpanExporter writing OTLP/JSON, one ExportTraceServiceRequest per line.

This is the format of the OpenTelemetry Collector's file exporter (and what its
`otlpjsonfile` receiver reads back), so traces are readable with no back end running
and can be replayed into one later. Ids are hex strings as the OTLP/JSON spec requires,
not the base64 that protobuf's generic JSON mapping would give for bytes fields.
Encoding is specdec.telemetry.otlp_json (direct, fast); `protobuf_json_line` is the slow
reference path through the exporter library's protobuf encoder, kept for the tests.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from specdec.telemetry.otlp_json import export_request
from specdec.telemetry.settings import TRACE_FILE_MAX_MB

logger = logging.getLogger(__name__)

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(node: Any) -> None:
    """Rewrite base64 id fields to lower-case hex, in place, at any depth (spans, links)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_KEYS and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                _hex_ids(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids(item)


def protobuf_json_line(spans: Sequence[ReadableSpan]) -> str:
    message = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    _hex_ids(message)
    return json.dumps(message, separators=(",", ":")) + "\n"


def spans_to_json_line(spans: Sequence[ReadableSpan],
                       resource_cache: dict[int, dict[str, Any]] | None = None) -> str:
    return json.dumps(export_request(spans, resource_cache), separators=(",", ":")) + "\n"


class JsonLinesSpanExporter(SpanExporter):
    """Appends each exported batch as one line; rotates to `<file>.1` past max_bytes."""

    def __init__(self, path: str | Path,
                 max_bytes: int = TRACE_FILE_MAX_MB * 1024 * 1024) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False
        self._resources: dict[int, dict[str, Any]] = {}

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed:
            return SpanExportResult.FAILURE
        try:
            line = spans_to_json_line(spans, self._resources)
            with self._lock:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._rotate_if_full(len(line))
                # One write per batch, O_APPEND: lines from concurrent writers stay whole.
                with open(self.path, "a", encoding="utf-8") as handle:
                    handle.write(line)
            return SpanExportResult.SUCCESS
        except OSError as error:
            # A full disk or a read-only file system must not take the service down, nor
            # fill its log: warn once, keep trying (the condition may clear).
            if not self._warned:
                self._warned = True
                logger.warning("cannot write spans to %s: %s (set SPECDEC_TRACE_DIR to a "
                               "writable directory, or SPECDEC_TRACE_FILE=none)", self.path, error)
            return SpanExportResult.FAILURE

    def _rotate_if_full(self, incoming: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size + incoming > self.max_bytes:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))

    def shutdown(self) -> None:
        self._closed = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is written and closed before it returns
