"""`Telemetry`: everything one service needs, built once at start-up from its flags.

    telemetry = Telemetry.from_args(args, "draft")          # provider, registry, /metrics
    server = build_server(..., interceptors=telemetry.server_interceptors())
    channel = telemetry.intercept_channel(grpc.insecure_channel(address))   # clients
    ...
    telemetry.shutdown()                                       # flush the trace batch
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry

from specdec.core.loop import GenerateConfig
from specdec.telemetry import names, propagation, tracing
from specdec.telemetry.metrics import (
    CoordinatorMetrics,
    ModelServiceMetrics,
    new_registry,
    start_metrics_server,
)
from specdec.telemetry.observe import RequestObserver, record_step
from specdec.telemetry.round_tracer import RequestTracer
from specdec.telemetry.settings import metrics_port_for, trace_file_for

logger = logging.getLogger(__name__)

ROLES = ("coordinator", "draft", "target")


class Telemetry:
    def __init__(self, role: str, tracer_provider: trace.TracerProvider | None = None,
                 registry: CollectorRegistry | None = None, *, record_tokens: bool = False,
                 step_spans: bool = False) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown service role {role!r}; expected one of {ROLES}")
        self.role = role
        self.tracer_provider = tracer_provider or trace.NoOpTracerProvider()
        self.tracer = self.tracer_provider.get_tracer("specdec")
        self.registry = registry or new_registry()
        self.record_tokens = record_tokens
        self.step_spans = step_spans
        coordinator = role == "coordinator"
        self.coordinator_metrics = CoordinatorMetrics(self.registry) if coordinator else None
        self.model_metrics = None if coordinator else ModelServiceMetrics(self.registry, role)
        self.metrics_port: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str, *,
                  serve_metrics: bool = True) -> Telemetry:
        """From the flags of specdec.telemetry.settings.add_telemetry_settings."""
        enabled = tracing.switch_on(getattr(args, "tracing", "on"))
        trace_file = trace_file_for(args, role)
        provider = tracing.build_tracer_provider(role, enabled=enabled, trace_file=trace_file)
        telemetry = cls(role, provider,
                        record_tokens=tracing.switch_on(getattr(args, "trace_tokens", "off")))
        if enabled and not tracing.sdk_disabled():
            logger.info("%s: tracing on, file %s", role, trace_file or "(none)")
        port = metrics_port_for(args, role)
        if serve_metrics and port >= 0:
            # Where the service listens: a service on 127.0.0.1 keeps its metrics local too.
            service_ports = [p for p in (getattr(args, "port", 0), getattr(args, "health_port", 0))
                             if isinstance(p, int) and p > 0]
            telemetry.serve_metrics(port, getattr(args, "host", "") or "0.0.0.0",
                                    avoid=service_ports)
        return telemetry

    @property
    def tracing_enabled(self) -> bool:
        return not isinstance(self.tracer_provider, trace.NoOpTracerProvider)

    def serve_metrics(self, port: int, addr: str = "0.0.0.0", avoid: Sequence[int] = ()) -> int:
        """avoid: the ports the service binds later (start_metrics_server)."""
        try:
            self.metrics_port = start_metrics_server(port, self.registry, addr, avoid)
        except OSError as error:  # reported by the CLI as a one-line error, not a traceback
            raise RuntimeError(f"{self.role}: cannot serve metrics on {addr}:{port}: {error} "
                               "(set --metrics-port / SPECDEC_METRICS_PORT; -1 turns it off)"
                               ) from None
        logger.info("%s: Prometheus metrics on %s:%d/metrics", self.role, addr,
                    self.metrics_port)
        return self.metrics_port

    # -- gRPC ----------------------------------------------------------------------------
    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        return propagation.server_interceptors(self.tracer_provider)

    def intercept_channel(self, channel: grpc.Channel) -> grpc.Channel:
        return propagation.intercept_channel(channel, self.tracer_provider)

    # -- coordinator -----------------------------------------------------------------------
    def request(self, request_id: str, prompt_tokens: int,
                config: GenerateConfig | None = None) -> RequestObserver:
        tracer = None
        if self.tracing_enabled:
            tracer = RequestTracer(self.tracer, request_id=request_id,
                                   prompt_tokens=prompt_tokens, config=config,
                                   step_spans=self.step_spans, record_tokens=self.record_tokens)
        recorder = self.coordinator_metrics.request() if self.coordinator_metrics else None
        return RequestObserver(tracer, recorder, prompt_tokens)

    def record_replica_session(self, role: str, endpoint: str) -> None:
        """A session was pinned to (or moved to) this draft or target replica."""
        if self.coordinator_metrics is not None:
            self.coordinator_metrics.replica_sessions.labels(role=role, endpoint=endpoint).inc()

    def watch_queue(self, queued: Callable[[], int]) -> None:
        """The specdec_queued_requests gauge reads `queued` at each scrape."""
        if self.coordinator_metrics is not None:
            self.coordinator_metrics.queued_requests.set_function(queued)

    def watch_suffix_cache(self, usage: Callable[[], Any]) -> None:
        """The suffix cache gauges read `usage()` (a CacheUsage) at each scrape."""
        if self.coordinator_metrics is not None:
            metrics = self.coordinator_metrics
            metrics.suffix_cache_bytes.set_function(lambda: usage().bytes)
            metrics.suffix_cache_requests.set_function(lambda: usage().requests)

    def watch_suffix_request_trees(self, total_bytes: Callable[[], int]) -> None:
        """The running requests' suffix trees gauge reads `total_bytes()` at each scrape."""
        if self.coordinator_metrics is not None:
            self.coordinator_metrics.suffix_request_trees_bytes.set_function(total_bytes)

    def record_refused_request(self) -> None:
        if self.coordinator_metrics is not None:
            self.coordinator_metrics.refused_requests.inc()

    def record_speculation_epoch(self, arm: Any) -> None:
        """The speculation gate began an epoch playing `arm` (an Arm)."""
        if self.coordinator_metrics is not None:
            self.coordinator_metrics.speculation_epochs.labels(arm=arm.label).inc()

    def record_load_limited_round(self) -> None:
        if self.coordinator_metrics is not None:
            self.coordinator_metrics.load_limited_rounds.inc()

    # -- draft / target --------------------------------------------------------------------
    def watch_runner(self, runner: Any) -> None:
        if self.model_metrics is not None:
            self.model_metrics.watch_runner(runner)

    def watch_scheduler(self, scheduler: Any) -> None:
        """Batch sizes and queue waits from a BatchScheduler; queued calls at scrape time."""
        if self.model_metrics is not None:
            self.model_metrics.watch_scheduler(scheduler)

    def record_step(self, *, forward_s: float, tokens_processed: int, kv_length: int,
                    committed_position: int, catch_up_tokens: int, batch: Any = None,
                    attributes: Mapping[str, AttributeValue] | None = None) -> None:
        """Inside a Propose/Verify handler: annotate its server span, feed the metrics.
        batch: the call's specdec.serving.model_service.BatchInfo (the forward it ran in)."""
        if batch is not None:
            attributes = {names.BATCH_SESSIONS: batch.sessions, names.BATCH_ROWS: batch.rows,
                          names.QUEUE_WAIT_MS: round(batch.queue_wait_s * 1000.0, 3),
                          names.BATCH_QUEUED: batch.queued, **(attributes or {})}
        record_step(self.model_metrics, forward_s=forward_s, tokens_processed=tokens_processed,
                    kv_length=kv_length, committed_position=committed_position,
                    catch_up_tokens=catch_up_tokens, attributes=attributes)

    def record_cache_sync_error(self) -> None:
        if self.model_metrics is not None:
            self.model_metrics.cache_resyncs.inc()

    def flush(self, timeout_millis: int = 5000) -> bool:
        return tracing.force_flush(self.tracer_provider, timeout_millis)

    def shutdown(self) -> None:
        tracing.shutdown_provider(self.tracer_provider)
