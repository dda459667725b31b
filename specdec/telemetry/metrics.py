"""Prometheus metrics, one registry per service, with vLLM's speculative-decoding meanings.

Counters (coordinator), as vLLM defines them:
- specdec_num_drafts_total: rounds that asked the draft for at least one token;
- specdec_num_draft_tokens_total: tokens the draft proposed;
- specdec_num_accepted_tokens_total: proposed tokens the target accepted;
- specdec_num_accepted_tokens_per_pos_total{position}: acceptances at draft index
  `position` (0-based), so acceptance by position is per_pos[i] / num_drafts.
- specdec_num_lookup_draft_tokens_total / specdec_num_lookup_accepted_tokens_total: prompt
  lookup's part of the two token counters (specdec.core.prompt_lookup).
- specdec_num_drafts_per_source_total{source}, specdec_num_draft_tokens_per_source_total
  {source}, specdec_num_accepted_tokens_per_source_total{source}: the three counters split
  by who proposed (source: draft, prompt_lookup or suffix, Proposal.source); over the
  sources they sum to the unlabelled ones.
- specdec_speculation_epochs_total{arm}: the speculation gate's epochs (one second each
  by default) by what it let adaptive sessions propose: target-only, model-free or draft
  (specdec.core.speculation_gate), so the share of time speculation was on.
Gauges: specdec_suffix_cache_bytes and specdec_suffix_cache_requests, the global suffix
tree's memory (estimated from its node count) and the responses it holds;
specdec_suffix_request_trees_bytes, the running requests' own trees' memory.
Mean acceptance length = 1 + accepted / drafts (the +1 is the correction or bonus token).
They are counted per round as rounds end, so they move during long requests and sum to
exactly the GenerationStats a response reports.

Each service gets its own CollectorRegistry (not the process-global one), so tests can
run the three services in one process and a registry holds only its service's series.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from specdec.core.stats import PROMPT_LOOKUP, SUFFIX

if TYPE_CHECKING:  # the loop pulls in torch; `specdec traces` should not need it
    from specdec.core.loop import GenerationResult, RoundEvent


_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.5, 1, 2.5)


def new_registry() -> CollectorRegistry:
    # No `*_created` series: an extra sample per counter and histogram that dashboards do
    # not use. The switch is process-wide in prometheus_client.
    disable_created_metrics()
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # CPU seconds, RSS, open fds of this process
    return registry


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0",
                         avoid: Sequence[int] = ()) -> int:
    """Serve /metrics in a daemon thread; returns the bound port (port 0 picks one).

    avoid: ports the process binds later (its gRPC port, bound once its model has
    loaded). While port 0 is picked they are held, so that the kernel cannot hand one of
    them to /metrics, as it can a port another process chose and released."""
    held: list[socket.socket] = []
    if port == 0:
        for other in avoid:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((addr, other))
            except OSError:  # in use already, so the kernel will not choose it either
                sock.close()
                continue
            held.append(sock)
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    finally:
        for sock in held:
            sock.close()
    return int(server.server_port)


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"specdec_{name}", doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"specdec_{name}", doc, buckets=buckets, registry=registry)

        self.num_drafts = counter("num_drafts", "Rounds that asked the draft for tokens")
        self.num_draft_tokens = counter("num_draft_tokens", "Tokens proposed by the draft")
        self.num_accepted_tokens = counter("num_accepted_tokens",
                                           "Draft tokens accepted by the target")
        self.num_alternatives = counter(
            "num_alternatives", "Alternatives verified beside the draft's chain (greedy)")
        self.num_kept_alternatives = counter(
            "num_kept_alternatives", "Alternatives the target kept (also counted as accepted)")
        self.num_lookup_draft_tokens = counter(
            "num_lookup_draft_tokens", "Tokens proposed by prompt lookup (also counted as "
            "draft tokens)")
        self.num_lookup_accepted_tokens = counter(
            "num_lookup_accepted_tokens", "Prompt-lookup tokens accepted by the target (also "
            "counted as accepted)")
        self.num_drafts_per_source = counter(
            "num_drafts_per_source", "Rounds that proposed tokens, by who proposed them",
            ("source",))
        self.num_draft_tokens_per_source = counter(
            "num_draft_tokens_per_source", "Proposed chain tokens, by who proposed them",
            ("source",))
        self.num_accepted_tokens_per_source = counter(
            "num_accepted_tokens_per_source", "Proposed tokens the target accepted, by who "
            "proposed them", ("source",))
        self.suffix_cache_bytes = Gauge(
            "specdec_suffix_cache_bytes", "Memory of the global suffix tree (estimated from "
            "its nodes)", registry=registry)
        self.suffix_cache_requests = Gauge(
            "specdec_suffix_cache_requests", "Earlier responses the global suffix tree holds",
            registry=registry)
        self.suffix_request_trees_bytes = Gauge(
            "specdec_suffix_request_trees_bytes", "Memory of the running requests' own suffix "
            "trees (estimated from their nodes)", registry=registry)
        self.num_accepted_tokens_per_pos = counter(
            "num_accepted_tokens_per_pos", "Accepted draft tokens by 0-based draft position",
            ("position",))
        self.rounds = counter("rounds", "Speculative rounds (target verifications)")
        self.degraded_rounds = counter("degraded_rounds",
                                       "Rounds run target-only because the draft was unavailable")
        self.resyncs = counter("resyncs", "KV cache re-syncs from position 0")
        self.requests = counter("requests", "Finished requests by finish reason",
                                ("finish_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.request_latency = histogram("request_latency_seconds",
                                         "End-to-end generation time", _REQUEST_BUCKETS)
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time to the first round's tokens", _REQUEST_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Generation time after the first round per further output token", _TOKEN_BUCKETS)
        self.round_latency = histogram("round_latency_seconds",
                                       "Wall time of one speculative round", _CALL_BUCKETS)
        self.propose_latency = histogram("propose_latency_seconds",
                                         "Propose call as the coordinator saw it", _CALL_BUCKETS)
        self.verify_latency = histogram("verify_latency_seconds",
                                        "Verify call as the coordinator saw it", _CALL_BUCKETS)
        # Spread of sessions over replicas: a pin at session start or a move after a
        # replica was lost. Labelled by endpoint, so one series per replica ever used.
        self.replica_sessions = counter("replica_sessions",
                                        "Sessions pinned to a draft or target replica",
                                        ("role", "endpoint"))
        self.active_requests = Gauge("specdec_active_requests", "Requests being generated",
                                     registry=registry)
        # Admission control (coordinator.admission) and load-aware speculation.
        self.refused_requests = counter(
            "refused_requests", "Requests answered RESOURCE_EXHAUSTED: the running and "
            "queued limits were full")
        self.queued_requests = Gauge("specdec_queued_requests",
                                     "Requests waiting for a running slot", registry=registry)
        self.speculation_epochs = counter(
            "speculation_epochs", "Epochs of the speculation gate, by the arm it played: "
            "target-only, model-free (prompt lookup and suffix only) or draft", ("arm",))
        self.load_limited_rounds = counter(
            "load_limited_rounds", "Rounds that drafted fewer tokens than the session alone "
            "would have, because other sessions shared the forward")

    def request(self) -> RequestRecorder:
        return RequestRecorder(self)


class RequestRecorder:
    """Feeds one request's rounds and result into CoordinatorMetrics."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.metrics = metrics
        # A round starts when the previous one's callback returns (or the request starts):
        # the loop does nothing else between rounds, so no hook at round start is needed.
        self._round_started = time.perf_counter()
        self._open = True
        metrics.active_requests.inc()

    def on_round(self, event: RoundEvent) -> None:
        m = self.metrics
        now = time.perf_counter()
        m.round_latency.observe(now - self._round_started)
        m.rounds.inc()
        m.verify_latency.observe(event.verify_s)
        m.resyncs.inc(event.resyncs)
        if event.degraded:
            m.degraded_rounds.inc()
        proposed = len(event.proposal.tokens) if event.proposal else 0
        # A model-free round makes no Propose call: its microseconds of search would drag
        # the histogram towards zero.
        if event.proposal is not None and event.proposal.source not in (PROMPT_LOOKUP,
                                                                         SUFFIX):
            m.propose_latency.observe(event.proposal.elapsed_s)
        if proposed:  # the same rule as GenerationStats.record_round
            m.num_drafts.inc()
            m.num_draft_tokens.inc(proposed)
            m.num_accepted_tokens.inc(event.accepted_len)
            m.num_alternatives.inc(len(event.proposal.alternatives) if event.proposal else 0)
            m.num_kept_alternatives.inc(len(event.kept_branches))
            if event.proposal is not None and event.proposal.source == PROMPT_LOOKUP:
                m.num_lookup_draft_tokens.inc(proposed)
                m.num_lookup_accepted_tokens.inc(event.accepted_len)
            if event.proposal is not None:
                source = event.proposal.source
                m.num_drafts_per_source.labels(source=source).inc()
                m.num_draft_tokens_per_source.labels(source=source).inc(proposed)
                m.num_accepted_tokens_per_source.labels(source=source).inc(event.accepted_len)
            for position in range(event.accepted_len):
                m.num_accepted_tokens_per_pos.labels(position=str(position)).inc()
        self._round_started = time.perf_counter()

    def finish(self, result: GenerationResult, prompt_tokens: int) -> None:
        m, stats = self.metrics, result.stats
        m.requests.labels(finish_reason=result.finish_reason).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(len(result.token_ids))
        m.request_latency.observe(stats.total_s)
        m.time_to_first_token.observe(stats.first_token_s)
        if len(result.token_ids) > 1:
            m.time_per_output_token.observe(
                (stats.total_s - stats.first_token_s) / (len(result.token_ids) - 1))
        self.close()

    def fail(self, reason: str = "error") -> None:
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            self.metrics.active_requests.dec()


class ModelServiceMetrics:
    """Draft or target: model time per call, tokens through the model, cache occupancy."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.registry = registry
        self.forward = Histogram("specdec_forward_seconds",
                                 f"Model time inside one {role} call", buckets=_CALL_BUCKETS,
                                 registry=registry)
        self.tokens_processed = Counter("specdec_tokens_processed",
                                        "Tokens run through the model", registry=registry)
        self.cache_resyncs = Counter("specdec_cache_sync_errors",
                                     "Calls refused because the KV cache lacked the prefix",
                                     registry=registry)
        self.active_sessions = Gauge("specdec_active_sessions", "Sessions holding a KV cache",
                                     registry=registry)
        self.kv_cache_bytes = Gauge("specdec_kv_cache_bytes", "Bytes held by KV caches",
                                    registry=registry)
        # Continuous batching (specdec.serving.model_service.BatchScheduler).
        self.batch_sessions = Histogram("specdec_batch_sessions",
                                        "Sessions whose rows shared one forward",
                                        buckets=_BATCH_BUCKETS, registry=registry)
        self.batch_rows = Histogram("specdec_batch_rows", "Token rows of one forward",
                                    buckets=_ROW_BUCKETS, registry=registry)
        self.queue_wait = Histogram("specdec_queue_wait_seconds",
                                    f"Time a {role} call waited for its first forward",
                                    buckets=_CALL_BUCKETS, registry=registry)
        self.calls_waiting = Gauge("specdec_num_calls_waiting",
                                   f"{role} calls waiting for their first forward",
                                   registry=registry)
        self.calls_running = Gauge("specdec_num_calls_running",
                                   f"{role} calls between forwards of a multi-step job",
                                   registry=registry)

    def watch_runner(self, runner: Any) -> None:
        """Read the gauges from a ModelRunner at scrape time (no bookkeeping per call)."""
        sessions: Callable[[], float] = lambda: float(runner.active_sessions)  # noqa: E731
        # total_kv_bytes takes the runner lock, so a scrape waits for a forward in flight:
        # at most one forward's delay for the scrape, never for the model.
        kv_bytes: Callable[[], float] = lambda: float(runner.total_kv_bytes())  # noqa: E731
        self.active_sessions.set_function(sessions)
        self.kv_cache_bytes.set_function(kv_bytes)

    def watch_scheduler(self, scheduler: Any) -> None:
        """The scheduler reports each forward and queue wait; the gauges read its queues
        at scrape time."""
        scheduler.observer = self
        waiting: Callable[[], float] = lambda: float(scheduler.queued)  # noqa: E731
        running: Callable[[], float] = lambda: float(scheduler.running)  # noqa: E731
        self.calls_waiting.set_function(waiting)
        self.calls_running.set_function(running)

    def observe_forward(self, sessions: int, rows: int) -> None:
        self.batch_sessions.observe(sessions)
        self.batch_rows.observe(rows)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def observe_step(self, forward_s: float, tokens_processed: int) -> None:
        self.forward.observe(forward_s)
        self.tokens_processed.inc(tokens_processed)
