"""Coordinator.Generate / GenerateStream: validate, run specdec.core.loop over gRPC clients.

Per request: pin the session to one target and one draft replica (routes over the
discovered replica sets), build a GrpcDrafter and GrpcVerifier sharing a ProbsRelay,
run `generate` in this thread (unary) or a worker thread feeding the stream. A client
that cancels or whose deadline passes stops the loop after the current round; the
loop's `finally` then releases both services' caches.

Every generation holds an admission slot (coordinator.admission) while it runs: beyond
the running and queued limits a request is answered RESOURCE_EXHAUSTED at once.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from coordinator.admission import (
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    Admission,
    AdmissionAbandoned,
    AdmissionRefused,
)
from coordinator.clients import ChannelPool, GrpcDrafter, GrpcVerifier, ProbsRelay
from coordinator.endpoints import EndpointSource
from coordinator.routing import ReplicaRoute
from coordinator.streaming import StreamChunker
from coordinator.validation import (
    AUTO,
    DRAFT,
    LOOKUP,
    SUFFIX,
    Limits,
    ValidRequest,
    decoder,
    validate,
)
from specdec.core import policy as policies
from specdec.core.acceptance import acceptance_key
from specdec.core.adaptive import DEFAULT_DRAFT_CONFIDENCE, AdaptiveLength, length_policy
from specdec.core.cost_model import CostModel
from specdec.core.history import HiddenSpec
from specdec.core.interfaces import Drafter, Verifier
from specdec.core.loop import GenerateConfig, GenerationResult, RoundEvent, generate
from specdec.core.prompt_lookup import (
    DEFAULT_LOOKUP_TOKENS,
    DEFAULT_MAX_NGRAM,
    DEFAULT_MIN_NGRAM,
    PromptLookup,
)
from specdec.core.speculation_gate import SpeculationGate
from specdec.core.suffix_cache import SuffixCache
from specdec.core.suffix_proposer import SuffixProposer
from specdec.engine.models import ModelInfo
from specdec.engine.shapes import DECODE_ROWS, DEFAULT_ALTERNATIVES, MAX_DECODE_STEPS
from specdec.errors import SpecdecError
from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.serving.discovery import ReplicaSet
from specdec.serving.grpc_server import Service
from specdec.serving.grpc_status import abort, rpc_errors
from specdec.settings import default
from specdec.telemetry.observe import RequestObserver
from specdec.telemetry.round_tracer import load_attributes
from specdec.telemetry.service import Telemetry

log = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


@dataclass(frozen=True)
class CoordinatorSettings:
    num_draft_tokens: int = default("num-draft-tokens")  # when a request has no `speculation`
    draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE  # adaptive requests without their own
    num_alternatives: int = DEFAULT_ALTERNATIVES  # adaptive requests without their own
    prompt_lookup_tokens: int = DEFAULT_LOOKUP_TOKENS  # requests without their own; 0 = off
    prompt_lookup_min: int = DEFAULT_MIN_NGRAM
    prompt_lookup_max: int = DEFAULT_MAX_NGRAM
    decode_steps: int = default("decode-steps")  # most tokens a Verify decodes undrafted
    max_draft_tokens: int = default("max-draft-tokens")
    max_new_tokens_limit: int = default("max-new-tokens-limit")
    draft_timeout_s: float = default("draft-timeout-ms") / 1000  # per Propose; slower: unavailable
    target_timeout_s: float = default("target-timeout-s")  # per Verify, retries included
    draft_backoff_initial_s: float = 0.25
    draft_backoff_max_s: float = 5.0
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS  # generations running
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS  # waiting for a running slot
    max_prompt_tokens: int = 0  # SPECDEC_MAX_PROMPT_TOKENS; 0 = the target's context
    # Suffix decoding (specdec.core.suffix_cache); suffix_max_tokens 0 = off.
    suffix_max_tokens: int = default("suffix-max-tokens")
    suffix_max_tree_depth: int = default("suffix-max-tree-depth")
    suffix_prompt_tokens: int = default("suffix-prompt-tokens")
    suffix_max_cached_requests: int = default("suffix-max-cached-requests")
    suffix_cache_mb: int = default("suffix-cache-mb")
    suffix_max_spec_factor: float = default("suffix-max-spec-factor")
    suffix_min_token_prob: float = default("suffix-min-token-prob")
    suffix_share_tenants: bool = default("suffix-share-tenants") == "on"

    def __post_init__(self) -> None:
        if not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"--decode-steps (SPECDEC_DECODE_STEPS) must be 1 to "
                             f"{MAX_DECODE_STEPS}, got {self.decode_steps}")


class Cancelled(Exception):
    """The client went away; raised from on_round to end the loop (which releases)."""

    finish_reason = "cancelled"  # how metrics count the request


@dataclass(frozen=True)
class AdmittedCall:
    """A valid request holding a running slot (its RPC releases it when it ends)."""

    valid: ValidRequest
    deadline: float | None
    tenant: str
    cancelled: threading.Event  # set by the RPC's end (the client went away)
    context: grpc.ServicerContext

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set() or not self.context.is_active()


def make_policy(num_draft_tokens: int, adaptive: bool, *,
                max_length: int = default("max-adaptive-length"),
                greedy: bool = True, costs: CostModel | None = None,
                running: Callable[[], int] | None = None,
                gate: SpeculationGate | None = None) -> policies.LengthPolicy:
    """FixedLength, or specdec.core.adaptive's load-aware policy for `adaptive` requests;
    `costs` is the coordinator's round-cost model, `running` counts its running
    generations, `gate` may turn drafting off at that load."""
    return length_policy(num_draft_tokens, adaptive, max_length=max_length, greedy=greedy,
                         costs=costs, running=running, gate=gate)


def _deadline(context: grpc.ServicerContext) -> float | None:
    """Monotonic time to give up by: a little before the client's own deadline, so the
    client receives our status (DEADLINE_EXCEEDED naming what the request waited for),
    not its own timeout."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e7:
        return None
    return time.monotonic() + remaining - min(0.5, 0.1 * remaining)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, target: ModelInfo, endpoints: EndpointSource, *,
                 settings: CoordinatorSettings | None = None, tokenizer: Any | None = None,
                 channels: ChannelPool | None = None, telemetry: Telemetry | None = None) -> None:
        self.target = target
        # Tracing (request and round spans) and Prometheus metrics; off unless given.
        self.telemetry = telemetry or Telemetry("coordinator")
        self.endpoints = endpoints
        self.settings = settings or CoordinatorSettings()
        self.tokenizer = tokenizer
        self.decode = decoder(tokenizer)
        self.channels = channels or ChannelPool()
        # endpoint -> the target states the draft reads (None: tokens only)
        self.draft_descriptions: dict[str, HiddenSpec | None] = {}
        self.limits = Limits(target.vocab_size, target.max_context,
                             self.settings.max_new_tokens_limit, self.settings.max_draft_tokens,
                             self.settings.num_draft_tokens, self.settings.draft_confidence,
                             self.settings.num_alternatives,
                             self.settings.prompt_lookup_tokens,
                             max_prompt_tokens=self.settings.max_prompt_tokens,
                             default_suffix_tokens=self.settings.suffix_max_tokens)
        # Earlier responses, per tenant, that suffix decoding proposes from.
        self.suffix_cache = SuffixCache(self.settings.suffix_max_tree_depth,
                                        self.settings.suffix_max_cached_requests,
                                        self.settings.suffix_cache_mb << 20)
        self.telemetry.watch_suffix_cache(self.suffix_cache.usage)
        # The running requests' own suffix trees, by id(proposer), for their memory gauge.
        self._request_trees: dict[int, SuffixProposer] = {}
        self._request_trees_lock = threading.Lock()
        self.telemetry.watch_suffix_request_trees(self.request_trees_bytes)
        # Round costs are a property of this deployment: every adaptive session shares them.
        self.costs = CostModel()
        # How much speculation raises this deployment's output rate at the current load.
        self.gate = SpeculationGate(on_epoch=self.telemetry.record_speculation_epoch)
        self.admission = Admission(self.settings.max_concurrent_requests,
                                   self.settings.max_queued_requests)
        self.telemetry.watch_queue(lambda: self.admission.counts().queued)
        # Checked here, so that a bad setting stops the coordinator at start.
        PromptLookup(target.vocab_size, 1, self.settings.prompt_lookup_min,
                     self.settings.prompt_lookup_max)
        if not 0.0 <= self.settings.suffix_min_token_prob <= 1.0:
            raise ValueError(f"suffix min token probability must be in [0, 1], got "
                             f"{self.settings.suffix_min_token_prob}")
        if self.settings.suffix_max_spec_factor <= 0:
            raise ValueError(f"suffix max spec factor must be > 0, got "
                             f"{self.settings.suffix_max_spec_factor}")
        if self.settings.suffix_prompt_tokens < 0:
            raise ValueError(f"suffix prompt tokens must be >= 0 (0 = no limit), got "
                             f"{self.settings.suffix_prompt_tokens}")

    def service(self) -> Service:
        return Service(SERVICE_NAME,
                       lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self, s))

    # -- RPCs ------------------------------------------------------------------------------
    @rpc_errors
    def Generate(self, request: coordinator_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> coordinator_pb2.GenerateResponse:
        call = self._admitted(request, context)
        valid = call.valid
        try:
            with self.telemetry.request(request.request_id, len(valid.prompt_ids)) as observed:
                result = self.run(valid, request.request_id, call.deadline, call.is_cancelled,
                                  observed=observed, tenant=call.tenant)
        except Cancelled:
            context.abort(grpc.StatusCode.CANCELLED, "client cancelled")
        finally:
            self.admission.release()
        response = coordinator_pb2.GenerateResponse(
            text=result.text or "", token_ids=result.token_ids,
            finish_reason=result.finish_reason, trace_id=observed.trace_id)
        self._fill_stats(response.stats, result, len(valid.prompt_ids))
        return response

    def GenerateStream(self, request: coordinator_pb2.GenerateRequest,
                       context: grpc.ServicerContext
                       ) -> Iterator[coordinator_pb2.GenerateResponse]:
        try:
            call = self._admitted(request, context)
        except SpecdecError as error:  # a generator: rpc_errors cannot see its errors
            abort(context, error)
        valid = call.valid
        chunks: queue.Queue[coordinator_pb2.GenerateResponse | BaseException | None] = queue.Queue()
        chunker = StreamChunker(self.decode, valid.stop)
        output: list[int] = []

        def on_round(event: RoundEvent) -> None:
            output.extend(event.emitted)
            text, tokens = chunker.update(output)
            if text or tokens:
                chunks.put(coordinator_pb2.GenerateResponse(text=text, token_ids=tokens))

        def work() -> None:
            try:
                with self.telemetry.request(request.request_id,
                                            len(valid.prompt_ids)) as observed:
                    result = self.run(valid, request.request_id, call.deadline,
                                      call.is_cancelled, on_round, observed=observed,
                                      tenant=call.tenant)
                text, tokens = chunker.finish(result.text or "", result.token_ids)
                last = coordinator_pb2.GenerateResponse(text=text, token_ids=tokens,
                                                        finish_reason=result.finish_reason,
                                                        trace_id=observed.trace_id)
                self._fill_stats(last.stats, result, len(valid.prompt_ids))
                chunks.put(last)
                chunks.put(None)
            except BaseException as error:  # noqa: BLE001 - handed to the RPC thread
                chunks.put(error)
            finally:
                self.admission.release()

        # copy_context: the worker's spans join the trace of this RPC's server span.
        worker = threading.Thread(target=contextvars.copy_context().run, args=(work,),
                                  name="generate-stream", daemon=True)
        try:
            worker.start()
        except BaseException:
            self.admission.release()  # the worker that would release it never ran
            raise
        try:
            while True:
                item = chunks.get()
                if item is None:
                    return
                if isinstance(item, Cancelled):
                    context.abort(grpc.StatusCode.CANCELLED, "client cancelled")
                if isinstance(item, SpecdecError):
                    abort(context, item)
                if isinstance(item, BaseException):
                    log.error("GenerateStream failed", exc_info=item)
                    context.abort(grpc.StatusCode.INTERNAL, f"{type(item).__name__}: {item}")
                yield item
        finally:
            call.cancelled.set()  # the client stopped reading: end the loop, free the caches

    def _admitted(self, request: coordinator_pb2.GenerateRequest,
                  context: grpc.ServicerContext) -> AdmittedCall:
        """Validate the request (SpecdecError), tie its cancellation to the RPC and take
        a running slot (_admit); the caller releases the slot when the generation ends."""
        valid = validate(request, self.limits, self.tokenizer)
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        call = AdmittedCall(valid, _deadline(context), self.tenant(context, request.cache_salt),
                            cancelled, context)
        self._admit(context, call.is_cancelled, call.deadline)
        return call

    def _admit(self, context: grpc.ServicerContext, is_cancelled: Callable[[], bool],
               deadline: float | None) -> None:
        """Take a running slot (see coordinator.admission), or end the RPC: over
        capacity RESOURCE_EXHAUSTED at once; gone while queued CANCELLED or
        DEADLINE_EXCEEDED. The caller releases the slot when the generation ends."""
        try:
            self.admission.acquire(is_cancelled, deadline)
        except AdmissionRefused as error:
            self.telemetry.record_refused_request()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except AdmissionAbandoned:
            if deadline is not None and time.monotonic() >= deadline:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              "the deadline passed while the request waited for a running "
                              f"slot (limit {self.admission.max_running}, "
                              "SPECDEC_MAX_CONCURRENT_REQUESTS)")
            context.abort(grpc.StatusCode.CANCELLED, "client cancelled while queued")

    def tenant(self, context: grpc.ServicerContext, cache_salt: str = "") -> str:
        """Whose earlier responses suffix decoding may propose from: the caller's API key
        (a digest of it, never the key), so one key's outputs never speculate for
        another's ("" for calls without a key, or for all when sharing is on), narrowed
        by the request's cache_salt, so requests with different salts share nothing."""
        key = ""
        if not self.settings.suffix_share_tenants:
            header = next((str(value) for name, value in context.invocation_metadata() or ()
                           if name == "authorization"), "")
            key = hashlib.sha256(header.strip().encode()).hexdigest() if header else ""
        if not cache_salt:
            return key
        return key + "/" + hashlib.sha256(cache_salt.encode()).hexdigest()

    # -- the loop --------------------------------------------------------------------------
    def run(self, valid: ValidRequest, request_id: str, deadline: float | None,
            is_cancelled: Callable[[], bool],
            on_event: Callable[[RoundEvent], None] | None = None,
            observed: RequestObserver | None = None, tenant: str = "") -> GenerationResult:
        session_id = uuid.uuid4().hex  # never the client's request_id: caches are per run
        relay = ProbsRelay()
        drafter = None
        if (self.endpoints.draft is not None and valid.num_draft_tokens > 0
                and valid.method in (AUTO, DRAFT)):
            drafter = GrpcDrafter(self._route("draft", self.endpoints.draft, session_id),
                                  vocab_size=self.target.vocab_size,
                                  timeout_s=self.settings.draft_timeout_s, deadline=deadline,
                                  relay=relay, descriptions=self.draft_descriptions)
        verifier = GrpcVerifier(self._route("target", self.endpoints.target, session_id),
                                call_timeout_s=self.settings.target_timeout_s,
                                deadline=deadline, relay=relay)
        log.debug("request %r: session %s on target %s, draft %s", request_id, session_id,
                  verifier.endpoint, drafter.endpoint if drafter else None)
        kind = acceptance_key(valid.sampling.greedy)  # the deployment's priors are per kind
        suffix = self._suffix(valid, tenant)
        config = GenerateConfig(max_new_tokens=valid.max_new_tokens, sampling=valid.sampling,
                                num_draft_tokens=valid.num_draft_tokens,
                                draft_confidence=valid.draft_confidence,
                                num_alternatives=valid.num_alternatives,
                                max_alternative_depth=valid.max_alternative_depth,
                                prompt_lookup=self._prompt_lookup(valid),
                                lookup_acceptance=self.costs.lookup_acceptance.get(
                                    kind, self.settings.max_draft_tokens),
                                suffix=suffix,
                                suffix_calibration=self.costs.suffix_calibration.get(kind),
                                eos_token_ids=self.target.eos_token_ids, stop=valid.stop,
                                session_id=session_id,
                                max_decode_steps=self.settings.decode_steps)
        loop_drafter: Drafter | None = drafter
        loop_verifier: Verifier = verifier
        if observed is not None:  # round spans must be current while their calls run
            observed.describe(config)
            loop_drafter = observed.drafter(drafter) if drafter is not None else None
            loop_verifier = observed.verifier(verifier)

        policy = make_policy(valid.num_draft_tokens, valid.adaptive,
                             max_length=self.settings.max_draft_tokens,
                             greedy=valid.sampling.greedy, costs=self.costs,
                             running=lambda: self.admission.running, gate=self.gate)
        adaptive = isinstance(policy, AdaptiveLength)

        def on_round(event: RoundEvent) -> None:
            first_round = event.index == 0
            self.gate.record(len(event.emitted), self.admission.running, gated=adaptive,
                             first_round=first_round,
                             prefill_s=event.verify_forward_s if first_round else 0.0)
            if observed is not None:  # record the round even if the client has gone
                if isinstance(policy, AdaptiveLength) and observed.tracer is not None:
                    observed.tracer.annotate_round(load_attributes(policy))
                observed.on_round(event)
            if isinstance(policy, AdaptiveLength) and policy.load_limited:
                self.telemetry.record_load_limited_round()
            if is_cancelled():
                raise Cancelled()
            if on_event is not None:
                on_event(event)

        backoff = policies.DraftBackoff(self.settings.draft_backoff_initial_s,
                                        self.settings.draft_backoff_max_s)
        if suffix is not None:
            with self._request_trees_lock:
                self._request_trees[id(suffix)] = suffix
        try:
            result = generate(loop_drafter, loop_verifier, valid.prompt_ids, config,
                              policy=policy, decode=self.decode, on_round=on_round,
                              backoff=backoff)
        finally:
            if suffix is not None:
                with self._request_trees_lock:
                    del self._request_trees[id(suffix)]
        if ((config.suffix is None or config.suffix.cache is None)
                and self.settings.suffix_max_tokens > 0):
            # Every response joins its tenant's tree (a suffix request's own did in the
            # loop), whichever method produced it.
            self.suffix_cache.add(tenant, result.token_ids)
        if observed is not None:
            observed.finish(result)
        return result

    def request_trees_bytes(self) -> int:
        """Estimated memory of the running requests' own suffix trees."""
        with self._request_trees_lock:
            trees = [proposer.tree for proposer in self._request_trees.values()]
        return sum(tree.bytes for tree in trees)

    def _prompt_lookup(self, valid: ValidRequest) -> PromptLookup | None:
        if (valid.num_draft_tokens == 0 or valid.prompt_lookup_tokens == 0
                or valid.method not in (AUTO, LOOKUP)):
            return None  # a target-only request stays target-only
        return PromptLookup(self.target.vocab_size, valid.prompt_lookup_tokens,
                            self.settings.prompt_lookup_min, self.settings.prompt_lookup_max)

    def _suffix(self, valid: ValidRequest, tenant: str) -> SuffixProposer | None:
        if (valid.num_draft_tokens == 0 or valid.suffix_tokens == 0
                or valid.method not in (AUTO, SUFFIX)):
            return None
        # A fixed-length auto request proposes from its own text alone, so that a seeded
        # one repeats its tokens whatever earlier requests left in the global tree.
        shared = valid.adaptive or valid.method == SUFFIX
        # The target verifies at most max_draft_tokens chain tokens and DECODE_ROWS
        # alternatives a round.
        return SuffixProposer(self.target.vocab_size,
                              min(valid.suffix_tokens,
                                  self.settings.max_draft_tokens, DECODE_ROWS + 1),
                              self.suffix_cache if shared else None, tenant,
                              self.settings.suffix_max_tree_depth,
                              self.settings.suffix_max_spec_factor,
                              self.settings.suffix_min_token_prob,
                              self.settings.suffix_prompt_tokens)

    def _route(self, role: str, replicas: ReplicaSet, session_id: str) -> ReplicaRoute:
        """Pin the session to a replica; every pin (at start or after a move) is counted."""
        return ReplicaRoute(
            replicas, self.channels.stub, session_id,
            on_pin=lambda endpoint: self.telemetry.record_replica_session(role, endpoint))

    @staticmethod
    def _fill_stats(out: coordinator_pb2.GenerationStats, result: GenerationResult,
                    prompt_tokens: int) -> None:
        stats = result.stats
        out.rounds = stats.rounds
        out.num_drafts = stats.num_drafts
        out.draft_tokens = stats.draft_tokens
        out.accepted_tokens = stats.accepted_tokens
        out.acceptance_rate = stats.acceptance_rate
        out.mean_accepted_length = stats.mean_accepted_length
        out.accepted_per_position.extend(stats.accepted_per_position)
        out.alternatives = stats.alternatives
        out.kept_alternatives = stats.kept_alternatives
        out.lookup_drafts = stats.lookup_drafts
        out.lookup_draft_tokens = stats.lookup_draft_tokens
        out.lookup_accepted_tokens = stats.lookup_accepted_tokens
        out.suffix_drafts = stats.suffix_drafts
        out.suffix_draft_tokens = stats.suffix_draft_tokens
        out.suffix_accepted_tokens = stats.suffix_accepted_tokens
        out.decoded_tokens = stats.decoded_tokens
        out.prompt_tokens = prompt_tokens
        out.completion_tokens = len(result.token_ids)
        out.total_seconds = stats.total_s
        out.first_token_seconds = stats.first_token_s
        out.draft_seconds = stats.draft_s
        out.verify_seconds = stats.verify_s
        out.draft_forward_seconds = stats.draft_forward_s
        out.verify_forward_seconds = stats.verify_forward_s
        out.degraded = stats.degraded
        out.resyncs = stats.resyncs
        out.wire_bytes = stats.wire_bytes
