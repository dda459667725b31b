"""One TracerProvider per service: resource, exporters, batching, on/off.

Exporters, in order of precedence:
- the OTLP/JSON-lines file (default `traces/<role>.jsonl`), so traces exist with no
  back end; `--trace-file none` turns it off;
- OTLP over gRPC when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  is set (or OTEL_TRACES_EXPORTER names `otlp`); the exporter reads the other standard
  OTEL_EXPORTER_OTLP_* variables (headers, insecure, timeout) itself;
- the console when OTEL_TRACES_EXPORTER names `console`.
OTEL_SDK_DISABLED=true or `--tracing off` gives a no-op provider: spans cost nothing and
responses carry an empty trace id. The SDK itself reads OTEL_TRACES_SAMPLER(_ARG) and
OTEL_BSP_* (batch size, queue, delay).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)

from specdec.telemetry.file_exporter import JsonLinesSpanExporter
from specdec.telemetry.names import ROLE

logger = logging.getLogger(__name__)

# Shorter than the SDK's 5 s default so `specdec traces` sees a request soon after it
# ends; writing a small batch to a local file is cheap. OTEL_BSP_SCHEDULE_DELAY wins.
FILE_FLUSH_DELAY_MS = 1000
_OFF = {"0", "off", "false", "no", "none", "disabled"}


def sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def switch_on(value: str | bool | None) -> bool:
    if isinstance(value, bool):
        return value
    return value is None or value.strip().lower() not in _OFF


def service_resource(role: str) -> Resource:
    """OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win; otherwise `specdec-<role>`."""
    resource = Resource.create({
        ROLE: role,
        # Pod name under Kubernetes; tells replicas of one role apart.
        "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
    })
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"specdec-{role}"}))
    return resource


def otlp_requested() -> bool:
    names = {n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")}
    if "none" in names:
        return False
    return "otlp" in names or any(os.environ.get(name) for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def default_exporters(trace_file: Path | None) -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    if trace_file is not None:
        exporters.append(JsonLinesSpanExporter(trace_file))
    if otlp_requested():
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                  os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
        if protocol != "grpc":
            logger.warning("OTLP protocol %r is not installed; exporting over gRPC", protocol)
        # Imported here: it pulls in the gRPC exporter stack only when asked for.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    names = os.environ.get("OTEL_TRACES_EXPORTER", "")
    if "console" in {n.strip() for n in names.split(",")}:
        exporters.append(ConsoleSpanExporter())
    return exporters


def build_tracer_provider(role: str, *, enabled: bool = True, trace_file: Path | None = None,
                          exporters: Sequence[SpanExporter] | None = None,
                          synchronous: bool = False) -> trace.TracerProvider:
    """A provider for one service. `exporters` replaces the defaults (tests pass an
    in-memory one); `synchronous` exports each span as it ends instead of batching."""
    if not enabled or sdk_disabled():
        return trace.NoOpTracerProvider()
    # shutdown_on_exit: flush the batch queue at interpreter exit as well.
    provider = TracerProvider(resource=service_resource(role), shutdown_on_exit=True)
    chosen = list(exporters) if exporters is not None else default_exporters(trace_file)
    for exporter in chosen:
        provider.add_span_processor(_processor(exporter, synchronous))
    if not chosen:
        logger.info("tracing is on for %s but no exporter is configured", role)
    return provider


def _processor(exporter: SpanExporter, synchronous: bool) -> SpanProcessor:
    if synchronous:
        return SimpleSpanProcessor(exporter)
    delay = None
    if isinstance(exporter, JsonLinesSpanExporter) and "OTEL_BSP_SCHEDULE_DELAY" not in os.environ:
        delay = FILE_FLUSH_DELAY_MS
    return BatchSpanProcessor(exporter, schedule_delay_millis=delay)


def shutdown_provider(provider: trace.TracerProvider) -> None:
    """Flush and close; a no-op provider has nothing to flush."""
    shutdown = getattr(provider, "shutdown", None)
    if callable(shutdown):
        shutdown()


def force_flush(provider: trace.TracerProvider, timeout_millis: int = 5000) -> bool:
    flush = getattr(provider, "force_flush", None)
    return bool(flush(timeout_millis)) if callable(flush) else True
