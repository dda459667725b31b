"""The request span (`specdec.generate`) and one child span per round (`specdec.round`).

The loop reports a round only when it is over (`on_round(RoundEvent)`), but the round
span has to be current *while* the round runs, so the Propose/Verify client spans the
gRPC interceptor opens become its children. So the Drafter/Verifier handed to the loop
are wrapped: the first call of a round opens its span and makes it current; on_round
fills in the attributes, adds the rejection event and closes it. Without the wrappers a
round span still appears (from the end of the previous round to on_round), just with
no children.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry import context, trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from specdec.core.history import TokenHistory
from specdec.core.interfaces import Drafter, ForwardBatch, Proposal, Verification, Verifier
from specdec.core.loop import GenerateConfig, GenerationResult, RoundEvent
from specdec.core.sampling import SamplingParams
from specdec.core.tree_acceptance import NO_ALTERNATIVES, Alternatives
from specdec.telemetry import names as n

if TYPE_CHECKING:
    from specdec.core.adaptive import AdaptiveLength


def trace_id_hex(span: Span) -> str:
    """32 hex digits, or "" when no trace will exist: tracing off, or this request not
    sampled (OTEL_TRACES_SAMPLER): an id that leads nowhere would only mislead."""
    span_context = span.get_span_context()
    if not (span_context.is_valid and span_context.trace_flags.sampled):
        return ""
    return format(span_context.trace_id, "032x")


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def next_token_kind(event: RoundEvent) -> str:
    if event.bonus:
        return "bonus"
    return "correction" if event.proposal and event.proposal.tokens else "target"


def round_attributes(event: RoundEvent, record_tokens: bool) -> dict[str, AttributeValue]:
    proposal = event.proposal
    attributes: dict[str, AttributeValue] = {
        n.ROUND_INDEX: event.index,
        n.POSITION_BEFORE: event.position_before,
        n.POSITION_AFTER: event.position_after,
        n.ASKED: event.asked,
        n.PROPOSED: len(proposal.tokens) if proposal else 0,
        n.ACCEPTED: event.accepted_len,
        n.ALTERNATIVES: len(proposal.alternatives) if proposal else 0,
        n.ALTERNATIVE_KEPT: bool(event.kept_branches),
        n.SOURCE: proposal.source if proposal else "",
        n.EMITTED: len(event.emitted),
        n.NEXT_TOKEN_KIND: next_token_kind(event),
        n.RESYNCS: event.resyncs,
        n.DEGRADED: event.degraded,
        n.VERIFY_MS: _ms(event.verify_s),
        n.VERIFY_FORWARD_MS: _ms(event.verify_forward_s),
    }
    if proposal is not None:
        k = len(proposal.tokens)
        alternatives = proposal.alternatives
        attributes[n.TREE_DEPTH] = max([k, *alternatives.depths(k)])
        chain_accepted = event.accepted_len - len(event.kept_branches)
        attributes[n.KEPT_RANKS] = alternatives.kept_ranks(k, chain_accepted,
                                                           event.kept_branches)
        attributes[n.DRAFT_MS] = _ms(proposal.elapsed_s)
        attributes[n.DRAFT_FORWARD_MS] = _ms(proposal.forward_s)
        attributes.update(propose_batch_attributes(proposal.batch))
    if record_tokens:
        attributes[n.EMITTED_TOKEN_IDS] = list(event.emitted)
    return attributes


def propose_batch_attributes(batch: ForwardBatch) -> dict[str, AttributeValue]:
    """The forward a Propose ran in; nothing when the draft did not report it."""
    if not batch.known:
        return {}
    return {n.PROPOSE_BATCH_SESSIONS: batch.sessions, n.PROPOSE_BATCH_ROWS: batch.rows,
            n.PROPOSE_QUEUE_WAIT_MS: _ms(batch.queue_wait_s)}


def verify_batch_attributes(batch: ForwardBatch) -> dict[str, AttributeValue]:
    """The forward a Verify ran in; nothing when the target did not report it."""
    if not batch.known:
        return {}
    return {n.VERIFY_BATCH_SESSIONS: batch.sessions, n.VERIFY_BATCH_ROWS: batch.rows,
            n.VERIFY_QUEUE_WAIT_MS: _ms(batch.queue_wait_s),
            n.VERIFY_BATCH_QUEUED: batch.queued}


def load_attributes(policy: AdaptiveLength) -> dict[str, AttributeValue]:
    """The load the adaptive policy chose this round's length under."""
    attributes: dict[str, AttributeValue] = {
        n.LOAD_SESSIONS: round(policy.load.sessions, 2),
        n.LOAD_OTHER_ROWS: round(policy.load.other_rows, 1),
        n.LOAD_LIMITED: policy.load_limited,
        n.GATED_OFF: policy.gated_off,
    }
    if policy.gate_arm is not None:
        attributes[n.GATE_ARM] = policy.gate_arm.label
    if policy.running is not None:
        attributes[n.LOAD_RUNNING] = policy.running()
    if policy.alone_choice is not None:
        attributes[n.ALONE_LENGTH] = policy.alone_choice
    return attributes


def rejection_attributes(event: RoundEvent,
                         record_tokens: bool) -> dict[str, AttributeValue] | None:
    """The rejection in this round, if a draft token was rejected."""
    proposal = event.proposal
    # A kept alternative stands in for the rejected chain token: it is the correction.
    chain_accepted = event.accepted_len - len(event.kept_branches)
    if proposal is None or chain_accepted >= len(proposal.tokens):
        return None
    attributes: dict[str, AttributeValue] = {
        n.REJECT_POSITION: event.position_before + chain_accepted,
        n.REJECT_DRAFT_INDEX: chain_accepted,
    }
    if record_tokens:
        attributes[n.REJECTED_TOKEN] = proposal.tokens[chain_accepted]
        if len(event.emitted) > chain_accepted:  # a stop string may have cut it off
            attributes[n.CORRECTION_TOKEN] = event.emitted[chain_accepted]
    return attributes


def config_attributes(config: GenerateConfig) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        n.MAX_NEW_TOKENS: config.max_new_tokens,
        n.NUM_DRAFT_TOKENS: config.num_draft_tokens,
        n.TEMPERATURE: float(config.sampling.temperature),
    }
    if config.session_id:
        attributes[n.SESSION_ID] = config.session_id
    return attributes


def request_attributes(result: GenerationResult) -> dict[str, AttributeValue]:
    stats = result.stats
    return {
        n.NEW_TOKENS: len(result.token_ids),
        n.ROUNDS: stats.rounds,
        n.NUM_DRAFTS: stats.num_drafts,
        n.DRAFT_TOKENS: stats.draft_tokens,
        n.ACCEPTED_TOKENS: stats.accepted_tokens,
        n.ACCEPTANCE_RATE: round(stats.acceptance_rate, 6),
        n.MEAN_ACCEPTED_LENGTH: round(stats.mean_accepted_length, 6),
        n.FINISH_REASON: result.finish_reason,
        n.DEGRADED: stats.degraded,
        n.RESYNCS: stats.resyncs,
        n.TTFT_MS: _ms(stats.first_token_s),
        n.DRAFT_MS: _ms(stats.draft_s),
        n.VERIFY_MS: _ms(stats.verify_s),
        n.DRAFT_FORWARD_MS: _ms(stats.draft_forward_s),
        n.VERIFY_FORWARD_MS: _ms(stats.verify_forward_s),
        n.WIRE_BYTES: stats.wire_bytes,
    }


class RequestTracer:
    """Context manager around one call of specdec.core.loop.generate."""

    def __init__(self, tracer: Tracer, *, request_id: str = "", prompt_tokens: int = 0,
                 config: GenerateConfig | None = None, step_spans: bool = False,
                 record_tokens: bool = False,
                 attributes: Mapping[str, AttributeValue] | None = None) -> None:
        self.tracer = tracer
        self.step_spans = step_spans  # in-process runs: spans for propose/verify calls
        self.record_tokens = record_tokens  # token ids are content: opt-in
        self._attributes: dict[str, AttributeValue] = {
            n.REQUEST_ID: request_id, n.PROMPT_TOKENS: prompt_tokens}
        if config is not None:
            self._attributes.update(config_attributes(config))
        self._attributes.update(attributes or {})
        self.span: Span = trace.INVALID_SPAN
        self._context: context.Context | None = None
        self._token: object | None = None
        self._round: Span | None = None
        self._round_token: object | None = None
        self._round_end_ns = 0
        self._verify_end_ns: int | None = None

    # -- request span ------------------------------------------------------------------
    def __enter__(self) -> RequestTracer:
        self.span = self.tracer.start_span(n.GENERATE_SPAN, attributes=self._attributes)
        self._context = trace.set_span_in_context(self.span)
        self._token = context.attach(self._context)
        self._round_end_ns = time.time_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._round is not None:  # the round that raised never reached on_round
            self._round.set_status(Status(StatusCode.ERROR, "round did not complete"))
            self._end_round(time.time_ns())
        if exc is not None:
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        if self._token is not None:
            context.detach(self._token)  # type: ignore[arg-type]
        self.span.end()

    @property
    def trace_id(self) -> str:
        return trace_id_hex(self.span)

    def describe(self, config: GenerateConfig) -> None:
        """Add the request's settings when they are known only after the span opened."""
        self.span.set_attributes(config_attributes(config))

    def finish(self, result: GenerationResult) -> None:
        self.span.set_attributes(request_attributes(result))

    # -- round spans -------------------------------------------------------------------
    def begin_round(self, start_ns: int | None = None, make_current: bool = True) -> None:
        if self._round is not None:
            return
        self._round = self.tracer.start_span(n.ROUND_SPAN, context=self._context,
                                             start_time=start_ns)
        self._verify_end_ns = None
        if make_current:
            self._round_token = context.attach(trace.set_span_in_context(self._round,
                                                                         self._context))

    def annotate_round(self, attributes: Mapping[str, AttributeValue]) -> None:
        """Add attributes to the round span (opening it if no call has yet)."""
        if self._round is None:
            self.begin_round(self._round_end_ns, make_current=False)
        assert self._round is not None
        self._round.set_attributes(attributes)

    def on_round(self, event: RoundEvent) -> None:
        if self._round is None:  # no wrapped drafter/verifier: the round began when the last ended
            self.begin_round(self._round_end_ns, make_current=False)
        assert self._round is not None
        self._round.set_attributes(round_attributes(event, self.record_tokens))
        rejection = rejection_attributes(event, self.record_tokens)
        if rejection is not None:
            self._round.add_event(n.REJECTION_EVENT, rejection, timestamp=self._verify_end_ns)
        self._end_round(time.time_ns())

    def _end_round(self, end_ns: int) -> None:
        assert self._round is not None
        self._round.end(end_time=end_ns)
        if self._round_token is not None:
            context.detach(self._round_token)  # type: ignore[arg-type]
        self._round, self._round_token, self._round_end_ns = None, None, end_ns

    # -- wrappers ----------------------------------------------------------------------
    def drafter(self, inner: Drafter) -> Drafter:
        return _TracedDrafter(inner, self)

    def verifier(self, inner: Verifier) -> Verifier:
        return _TracedVerifier(inner, self)

    def step_span(self, name: str) -> Any:
        if self.step_spans:
            return self.tracer.start_as_current_span(name, kind=trace.SpanKind.INTERNAL)
        return _NullSpan()


class _NullSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _TracedDrafter:
    def __init__(self, inner: Drafter, owner: RequestTracer) -> None:
        self.inner, self.owner = inner, owner

    @property
    def needs_target_hidden(self) -> bool:
        return self.inner.needs_target_hidden

    def propose(self, session_id: str, committed: TokenHistory, num_tokens: int,
                params: SamplingParams, min_confidence: float = 0.0,
                num_alternatives: int = 0, max_alternative_depth: int = 0) -> Proposal:
        self.owner.begin_round()
        with self.owner.step_span(n.PROPOSE_STEP_SPAN) as span:
            proposal = self.inner.propose(session_id, committed, num_tokens, params,
                                          min_confidence, num_alternatives,
                                          max_alternative_depth)
            if span is not None:
                span.set_attributes({n.FORWARD_MS: _ms(proposal.forward_s),
                                     n.PROPOSED: len(proposal.tokens),
                                     n.COMMITTED_POSITION: len(committed)})
        return proposal

    def release(self, session_id: str) -> None:
        self.inner.release(session_id)


class _TracedVerifier:
    def __init__(self, inner: Verifier, owner: RequestTracer) -> None:
        self.inner, self.owner = inner, owner

    def verify(self, session_id: str, committed: TokenHistory, draft_tokens: list[int],
               draft_probs: torch.Tensor | None, params: SamplingParams,
               alternatives: Alternatives = NO_ALTERNATIVES, decode_steps: int = 1,
               stop_token_ids: Sequence[int] = ()) -> Verification:
        self.owner.begin_round()
        with self.owner.step_span(n.VERIFY_STEP_SPAN) as span:
            verification = self.inner.verify(session_id, committed, draft_tokens, draft_probs,
                                             params, alternatives, decode_steps,
                                             stop_token_ids)
            if span is not None:
                span.set_attributes({n.FORWARD_MS: _ms(verification.forward_s),
                                     n.ACCEPTED: verification.accepted_len,
                                     n.COMMITTED_POSITION: len(committed)})
        self.owner._verify_end_ns = time.time_ns()
        if self.owner._round is not None:
            self.owner._round.set_attributes(verify_batch_attributes(verification.batch))
        return verification

    def release(self, session_id: str) -> None:
        self.inner.release(session_id)
