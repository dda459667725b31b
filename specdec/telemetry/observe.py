"""Per-call observation: a request in the coordinator, a Propose/Verify in a model service."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from specdec.core.interfaces import Drafter, Verifier
from specdec.core.loop import GenerateConfig, GenerationResult, RoundEvent
from specdec.telemetry import names as n
from specdec.telemetry.metrics import ModelServiceMetrics, RequestRecorder
from specdec.telemetry.round_tracer import RequestTracer


class RequestObserver:
    """Tracing and metrics for one generate() call; use as a context manager:

        with telemetry.request(request_id, len(prompt_ids), config) as observed:
            result = generate(observed.drafter(d), observed.verifier(v), prompt_ids, config,
                              on_round=observed.on_round)
            observed.finish(result)
        response.trace_id = observed.trace_id
    """

    def __init__(self, tracer: RequestTracer | None, recorder: RequestRecorder | None,
                 prompt_tokens: int) -> None:
        self.tracer = tracer
        self.recorder = recorder
        self.prompt_tokens = prompt_tokens
        self._callbacks: list[Callable[[RoundEvent], None]] = []
        self._finished = False

    def __enter__(self) -> RequestObserver:
        if self.tracer is not None:
            self.tracer.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.recorder is not None and not self._finished:
            # An exception may name its own outcome (e.g. finish_reason = "cancelled").
            reason = getattr(exc, "finish_reason", "error") if exc is not None else "abandoned"
            self.recorder.fail(str(reason))
        if self.tracer is not None:
            self.tracer.__exit__(exc_type, exc, tb)

    @property
    def trace_id(self) -> str:
        return self.tracer.trace_id if self.tracer is not None else ""

    def also(self, callback: Callable[[RoundEvent], None]) -> RequestObserver:
        """Chain another round observer (streaming, logging) behind this one."""
        self._callbacks.append(callback)
        return self

    def describe(self, config: GenerateConfig) -> None:
        if self.tracer is not None:
            self.tracer.describe(config)

    def drafter(self, inner: Drafter) -> Drafter:
        return self.tracer.drafter(inner) if self.tracer is not None else inner

    def verifier(self, inner: Verifier) -> Verifier:
        return self.tracer.verifier(inner) if self.tracer is not None else inner

    def on_round(self, event: RoundEvent) -> None:
        if self.tracer is not None:
            self.tracer.on_round(event)
        if self.recorder is not None:
            self.recorder.on_round(event)
        for callback in self._callbacks:
            callback(event)

    def finish(self, result: GenerationResult) -> None:
        self._finished = True
        if self.tracer is not None:
            self.tracer.finish(result)
        if self.recorder is not None:
            self.recorder.finish(result, self.prompt_tokens)


def record_step(metrics: ModelServiceMetrics | None, *, forward_s: float, tokens_processed: int,
                kv_length: int, committed_position: int, catch_up_tokens: int,
                attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """Called by a Propose/Verify servicer inside its RPC: annotates the SERVER span the
    interceptor made current, and feeds the service's metrics."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({
            n.FORWARD_MS: round(forward_s * 1000.0, 3),
            n.TOKENS_PROCESSED: tokens_processed,
            n.KV_LENGTH: kv_length,
            n.COMMITTED_POSITION: committed_position,
            n.CATCH_UP_TOKENS: catch_up_tokens,
            **(attributes or {}),
        })
    if metrics is not None:
        metrics.observe_step(forward_s, tokens_processed)
