"""W3C trace context over gRPC metadata: client and server interceptors.

opentelemetry-instrumentation-grpc does the work: the client interceptor opens a CLIENT
span per call and injects `traceparent` (the globally configured propagator, W3C trace
context + baggage unless OTEL_PROPAGATORS says otherwise); the server interceptor
extracts it and opens the matching SERVER span, current while the servicer runs, so a
servicer annotates it with `trace.get_current_span()`. Health checks and reflection are
left untraced: Kubernetes probes would otherwise fill the trace files.
"""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import client_interceptor, server_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel as otel_intercept_channel

_UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


def _traced(details: Any) -> bool:
    """Filter: trace every call but health checks and reflection.

    Hand-written because the instrumentation's filters identify the call through
    isinstance checks against grpc's abstract classes, which cost more per call than
    the span itself. Client calls carry `full_method`, server calls `method`.
    """
    method = getattr(details, "full_method", None) or getattr(details, "method", "") or ""
    if isinstance(method, bytes):
        method = method.decode()
    return not method.startswith(_UNTRACED_PREFIXES)


def server_interceptors(provider: trace.TracerProvider | None) -> list[grpc.ServerInterceptor]:
    """Interceptors for grpc.server(...); empty when tracing is off (no per-call cost)."""
    if provider is None or isinstance(provider, trace.NoOpTracerProvider):
        return []
    return [server_interceptor(tracer_provider=provider, filter_=_traced)]


def intercept_channel(channel: grpc.Channel, provider: trace.TracerProvider | None) -> grpc.Channel:
    """The channel, wrapped so each call carries the caller's trace context."""
    if provider is None or isinstance(provider, trace.NoOpTracerProvider):
        return channel
    interceptor = client_interceptor(tracer_provider=provider, filter_=_traced)
    # The instrumentation's interceptor is its own (grpcext) kind, not grpc's interceptor
    # classes, so grpc.intercept_channel rejects it; grpcext wraps the channel instead.
    return otel_intercept_channel(channel, interceptor)  # type: ignore[no-any-return]
