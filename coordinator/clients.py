"""gRPC Drafter and Verifier: the specdec.core.interfaces protocols over the network.

Like specdec.engine.local, each keeps a CacheMirror per session (what the service's KV cache
should hold) and sends only the committed tokens the service lacks. A service that lost
the cache (restart, eviction, another replica) answers FAILED_PRECONDITION; the client
re-sends the whole history from position 0 and counts a resync, so specdec.core.loop runs
unchanged. Failure policy differs by role: the draft is optional (any failure or a slow
answer raises DraftUnavailable and the loop goes target-only, still exact), the target
is not (calls wait for it, retrying, until the request's deadline).

Calls go through a coordinator.routing.Route. When the session's replica is gone and
another one exists, the route moves and the next call re-sends the committed prefix
from position 0 to the new replica (counted as a resync): the target retries the Verify
there at once; the draft's round goes target-only and its next Propose goes there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import grpc
import torch

from coordinator.routing import ChannelClosed, FixedRoute, Route
from specdec.core.history import FINAL_STATE, HiddenSpec, SyncPoint, TokenHistory
from specdec.core.interfaces import (
    CacheMirror,
    DraftUnavailable,
    ForwardBatch,
    Proposal,
    Verification,
    draft_hidden_rows,
)
from specdec.core.sampling import SamplingParams
from specdec.core.tree_acceptance import NO_ALTERNATIVES, Alternatives
from specdec.errors import DeadlineExceeded, InvalidRequest, ServiceUnavailable
from specdec.proto.specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specdec.serving import wire
from specdec.serving.grpc_server import MESSAGE_OPTIONS, check_health
from specdec.serving.grpc_status import from_rpc_error

log = logging.getLogger(__name__)

# Reconnect quickly to a restarted peer: gRPC's default backoff grows to 120 s, which
# would keep a recovered draft unused for minutes.
CHANNEL_OPTIONS = [*MESSAGE_OPTIONS,
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
# Release is sent without waiting for it, so its deadline costs no request any time; it
# only bounds how long the call may queue. Under load every server thread can be busy with
# forwards, and a release that gives up leaves the session's KV cache held until the
# service's session TTL reaps it.
RELEASE_TIMEOUT_S = 30.0
# Draft endpoints whose last Propose failed: each change of state is logged once, so an
# operator sees when (and why) requests run target-only, e.g. while the draft loads.
_drafts_down: set[str] = set()
MAX_RESYNCS_PER_CALL = 2

StubT = TypeVar("StubT")


class ChannelPool:
    """One channel per endpoint, shared by every session (HTTP/2 multiplexes calls).

    `wrap` is the seam for client interceptors (e.g. trace propagation).
    """

    def __init__(self, wrap: Callable[[grpc.Channel], grpc.Channel] | None = None, *,
                 credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        """credentials: TLS towards the services (specdec.serving.security.channel_credentials);
        options: channel options that replace CHANNEL_OPTIONS' of the same name."""
        self._wrap = wrap
        self._credentials = credentials
        named = {name for name, _ in options}
        self._options = [*(o for o in CHANNEL_OPTIONS if o[0] not in named), *options]
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[tuple[str, Callable[[grpc.Channel], Any]], Any] = {}
        self._lock = threading.Lock()

    def get(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            return self._get(endpoint)

    def stub(self, endpoint: str, make: Callable[[grpc.Channel], StubT]) -> StubT:
        """The shared stub `make` builds for `endpoint`.

        Built under the lock, from a channel still in the pool: building a stub on a
        channel `retain` has closed crashes the process (grpcio 1.85), whereas calling a
        stub built before the close only raises ValueError.
        """
        with self._lock:
            stub = self._stubs.get((endpoint, make))
            if stub is None:
                stub = self._stubs[endpoint, make] = make(self._get(endpoint))
            return stub  # type: ignore[no-any-return]  # built by `make`

    def _get(self, endpoint: str) -> grpc.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = (grpc.secure_channel(endpoint, self._credentials, options=self._options)
                       if self._credentials is not None
                       else grpc.insecure_channel(endpoint, options=self._options))
            if self._wrap is not None:
                channel = self._wrap(channel)
            self._channels[endpoint] = channel
        return channel

    def check_health(self, endpoint: str) -> bool:
        """One health check of a replica, with this pool's credentials."""
        return check_health(endpoint, credentials=self._credentials, options=self._options)

    def retain(self, endpoints: Iterable[str]) -> None:
        """Close the channels of endpoints not listed: replicas that left discovery."""
        keep = set(endpoints)
        with self._lock:
            closing = {e: self._channels.pop(e) for e in list(self._channels) if e not in keep}
            self._stubs = {key: stub for key, stub in self._stubs.items() if key[0] in keep}
        for endpoint, channel in closing.items():
            log.info("closing the channel to %s: no longer discovered", endpoint)
            channel.close()  # calls still on it end CANCELLED: their route moves

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()


class ProbsRelay:
    """Passes q from a Propose response to the following Verify as the received message.

    The loop hands the verifier a dense tensor; re-encoding it would cost a scan of
    rows x vocabulary per round, so the verifier forwards the original bytes whenever it
    is given the very tensor the drafter decoded.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[torch.Tensor, common_pb2.DraftProbs]] = {}

    def put(self, session_id: str, probs: torch.Tensor, message: common_pb2.DraftProbs) -> None:
        self._last[session_id] = (probs, message)

    def take(self, session_id: str, probs: torch.Tensor) -> common_pb2.DraftProbs | None:
        entry = self._last.pop(session_id, None)
        return entry[1] if entry is not None and entry[0] is probs else None

    def drop(self, session_id: str) -> None:
        self._last.pop(session_id, None)


def described_spec(response: draft_pb2.DescribeResponse) -> HiddenSpec | None:
    """The target states a draft's Describe says it reads (None: tokens only)."""
    if response.target_hidden_size == 0:
        return None
    return HiddenSpec(tuple(response.target_hidden_layers),
                      wire.hidden_dtype(response.hidden_dtype))


# A Verify never ends CANCELLED by the coordinator's own doing (it cancels no call, and a
# channel the pool closes is the route's `gone`), so CANCELLED is the target's: a server
# stopping under the call. It is retried like a lost connection.
_RETRIED_VERIFY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.CANCELLED)


def _assume_done(mirror: CacheMirror, committed: TokenHistory) -> None:
    """After a call with an unknown outcome, assume it went through on the service.

    If it did (a deadline that passed while the service kept working, typically a long
    prompt's prefill), the next call continues from the whole committed history instead
    of re-sending it from position 0, which could time out the same way forever. If it
    did not, the service answers FAILED_PRECONDITION and we re-sync: one extra call.
    """
    mirror.tokens = list(committed.tokens)


def forward_batch(message: common_pb2.BatchInfo) -> ForwardBatch:
    """A response's BatchInfo; all zero (a service that does not batch) reads as unknown."""
    return ForwardBatch(message.sessions, message.rows, message.queue_wait_seconds,
                        message.queued)


def _code(error: grpc.RpcError) -> grpc.StatusCode:
    if isinstance(error, ChannelClosed):
        return grpc.StatusCode.UNAVAILABLE
    return error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN


def _describe(error: grpc.RpcError) -> str:
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    return f"{_code(error).name}: {details}"


def _release(call: grpc.Future, session_id: str, endpoint: str) -> None:
    """Release without waiting: the response is not needed to answer the client, and a
    lost release is covered by the service's session TTL."""

    def done(future: grpc.Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.debug("release of %s on %s failed: %s", session_id, endpoint,
                      future.exception())

    call.add_done_callback(done)


def _invoke(method: Callable[..., Any], request: Any, **kwargs: Any) -> Any:
    try:
        return method(request, **kwargs)
    except ValueError as error:
        # The pool closed this channel between the route's discovery check and the call.
        if "closed channel" in str(error):
            raise ChannelClosed(str(error)) from None
        raise


class _RoutedClient(Generic[StubT]):
    """A client's route, its sessions' CacheMirrors, and what a move resets."""

    def __init__(self, route: Route | grpc.Channel, endpoint: str,
                 make_stub: Callable[[grpc.Channel], StubT]) -> None:
        # A bare channel (scripts, older callers) is one fixed replica.
        self.route = route if isinstance(route, Route) else FixedRoute(route, endpoint)
        self._make_stub = make_stub
        self._mirrors: dict[str, CacheMirror] = {}
        self._moved: set[str] = set()  # sessions whose next call must re-send everything

    @property
    def endpoint(self) -> str:
        return self.route.endpoint

    @property
    def stub(self) -> StubT:
        return self.route.stub(self._make_stub)

    def _begin(self, session_id: str, committed: TokenHistory
               ) -> tuple[CacheMirror, SyncPoint, int]:
        """The session's mirror, the first sync point, and the resyncs that one costs."""
        mirror = self._mirrors.setdefault(session_id, CacheMirror())
        if self.route.left_discovery() and self.route.move():
            self._moved.add(session_id)  # its replica was scaled away between rounds
        if session_id in self._moved:
            # The new replica holds nothing of this session: the whole committed prefix.
            self._moved.discard(session_id)
            return mirror, mirror.full_resync(session_id, committed), 1
        return mirror, mirror.plan(session_id, committed), 0

    def _moved_away(self, code: grpc.StatusCode) -> bool:
        """After a failed call: True if its replica is gone and the route moved."""
        return self.route.gone(code) and self.route.move()

    def _forget(self, session_id: str) -> None:
        self._mirrors.pop(session_id, None)
        self._moved.discard(session_id)


class GrpcDrafter(_RoutedClient[draft_pb2_grpc.DraftStub]):
    """`timeout_s` bounds each Propose; `deadline` is the request's monotonic deadline.

    `route`: a Route, or a channel with its `endpoint` (one fixed replica).
    """

    def __init__(self, route: Route | grpc.Channel, endpoint: str = "", *, vocab_size: int,
                 timeout_s: float, deadline: float | None = None,
                 relay: ProbsRelay | None = None,
                 descriptions: dict[str, HiddenSpec | None] | None = None) -> None:
        super().__init__(route, endpoint, draft_pb2_grpc.DraftStub)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.relay = relay
        # endpoint -> the states Describe says the draft reads (None: tokens only), shared
        # across requests by the caller.
        self.descriptions = descriptions if descriptions is not None else {}

    @property
    def needs_target_hidden(self) -> bool:
        """Asked once per replica; a draft that cannot answer is treated as token-only
        (if it is not, its Propose refuses and the round goes target-only: still exact)."""
        endpoint = self.endpoint
        if endpoint not in self.descriptions:
            try:
                response = _invoke(self.stub.Describe, draft_pb2.DescribeRequest(),
                                   timeout=self.timeout_s)
            except grpc.RpcError as error:
                log.info("draft %s: Describe failed (%s); sending no hidden states", endpoint,
                         _describe(error))
                return False
            self.descriptions[endpoint] = described_spec(response)
        return self.descriptions[endpoint] is not None

    @property
    def target_hidden_spec(self) -> HiddenSpec:
        """The target states the draft reads (asked with needs_target_hidden)."""
        return self.descriptions.get(self.endpoint) or FINAL_STATE

    def propose(self, session_id: str, committed: TokenHistory, num_tokens: int,
                params: SamplingParams, min_confidence: float = 0.0,
                num_alternatives: int = 0, max_alternative_depth: int = 0) -> Proposal:
        started = time.perf_counter()
        mirror, sync, resyncs = self._begin(session_id, committed)
        refused = 0
        while True:
            request = draft_pb2.ProposeRequest(sync=wire.sync_to_proto(sync), num_tokens=num_tokens,
                                               sampling=wire.sampling_to_proto(params),
                                               min_confidence=min_confidence,
                                               num_alternatives=num_alternatives,
                                               max_alternative_depth=max_alternative_depth)
            if committed.target_hidden is not None:
                request.target_hidden_states.CopyFrom(wire.encode_hidden(
                    draft_hidden_rows(committed, sync), committed.target_hidden.spec.wire_dtype))
            timeout = self.timeout_s
            if self.deadline is not None:
                timeout = max(0.001, min(timeout, self.deadline - time.monotonic()))
            try:
                response = _invoke(self.stub.Propose, request, timeout=timeout)
                if self.endpoint in _drafts_down:
                    _drafts_down.discard(self.endpoint)
                    log.info("draft %s answers: rounds are speculative again", self.endpoint)
                break
            except grpc.RpcError as error:
                code = _code(error)
                if code == grpc.StatusCode.FAILED_PRECONDITION and refused < MAX_RESYNCS_PER_CALL:
                    refused += 1
                    resyncs += 1
                    sync = mirror.full_resync(session_id, committed)
                    continue
                failed = f"draft {self.endpoint}: {_describe(error)}"
                if self.endpoint not in _drafts_down:
                    _drafts_down.add(self.endpoint)
                    log.warning("%s; rounds run target-only (same output, slower) until it "
                                "answers", failed)
                # The draft is optional: this round goes target-only either way, and after
                # a move the next Propose goes to the new replica.
                if self._moved_away(code):
                    self._moved.add(session_id)
                else:
                    _assume_done(mirror, committed)
                raise DraftUnavailable(failed) from None
        tokens = list(response.tokens)
        try:
            alternatives = self._checked_alternatives(response, len(tokens), num_alternatives)
            probs = self._checked(response, tokens, num_tokens, params, min_confidence > 0,
                                  len(alternatives.q_nodes(len(tokens))))
        except InvalidRequest as error:  # a draft that answers nonsense is not used
            _assume_done(mirror, committed)
            raise DraftUnavailable(f"draft {self.endpoint} answered badly: {error}") from None
        if probs is not None and self.relay is not None:
            self.relay.put(session_id, probs, response.probs)
        mirror.record_proposal(committed, tokens)
        return Proposal(tokens, probs, time.perf_counter() - started, response.forward_seconds,
                        resyncs, request.ByteSize() + response.ByteSize(), alternatives,
                        batch=forward_batch(response.batch))

    def _checked_alternatives(self, response: draft_pb2.ProposeResponse, num_tokens: int,
                              asked: int) -> Alternatives:
        alternatives = wire.alternatives_from_proto(response.alternatives, self.vocab_size,
                                                    num_tokens)
        if len(alternatives) > asked:
            raise InvalidRequest(f"{len(alternatives)} alternatives for {asked} asked")
        return alternatives

    def _checked(self, response: draft_pb2.ProposeResponse, tokens: list[int],
                 num_tokens: int, params: SamplingParams, may_stop_early: bool,
                 q_rows: int) -> torch.Tensor | None:
        if len(tokens) != num_tokens and not (may_stop_early and 1 <= len(tokens) < num_tokens):
            raise InvalidRequest(f"{len(tokens)} tokens for {num_tokens} asked")
        wire.check_token_ids(tokens, self.vocab_size, "tokens")
        if params.greedy:
            return None
        return wire.decode_probs(response.probs, q_rows, self.vocab_size, "probs")

    def release(self, session_id: str) -> None:
        self._forget(session_id)
        if self.relay is not None:
            self.relay.drop(session_id)
        _release(self.stub.Release.future(
            draft_pb2.DraftReleaseRequest(session_id=session_id), timeout=RELEASE_TIMEOUT_S),
            session_id, self.endpoint)


class GrpcVerifier(_RoutedClient[target_pb2_grpc.TargetStub]):
    """`deadline` is the request's absolute time.monotonic() deadline (None: none).

    `route`: a Route, or a channel with its `endpoint` (one fixed replica).
    """

    def __init__(self, route: Route | grpc.Channel, endpoint: str = "", *,
                 call_timeout_s: float, deadline: float | None = None,
                 relay: ProbsRelay | None = None, retry_interval_s: float = 0.1) -> None:
        super().__init__(route, endpoint, target_pb2_grpc.TargetStub)
        self.call_timeout_s = call_timeout_s
        self.deadline = deadline
        self.relay = relay
        self.retry_interval_s = retry_interval_s

    def verify(self, session_id: str, committed: TokenHistory, draft_tokens: list[int],
               draft_probs: torch.Tensor | None, params: SamplingParams,
               alternatives: Alternatives = NO_ALTERNATIVES, decode_steps: int = 1,
               stop_token_ids: Sequence[int] = ()) -> Verification:
        started = time.perf_counter()
        give_up = time.monotonic() + self.call_timeout_s
        # Whether the request's deadline, not the per-call limit, is what ends the wait.
        deadline_bound = self.deadline is not None and self.deadline <= give_up
        if self.deadline is not None:
            give_up = min(give_up, self.deadline)
        mirror, sync, resyncs = self._begin(session_id, committed)
        probs_message = self._probs_message(session_id, draft_tokens, draft_probs, params)
        refused = 0
        last_error = "no answer"
        while True:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                if deadline_bound:
                    raise DeadlineExceeded(f"the request's deadline passed while waiting for "
                                           f"target {self.endpoint} ({last_error})")
                raise ServiceUnavailable(f"target {self.endpoint} unavailable: no answer within "
                                         f"{self.call_timeout_s:g} s ({last_error})")
            request = target_pb2.VerifyRequest(
                sync=wire.sync_to_proto(sync), draft_tokens=draft_tokens,
                sampling=wire.sampling_to_proto(params),
                return_hidden_states=committed.target_hidden is not None)
            if decode_steps > 1 and not draft_tokens and committed.target_hidden is None:
                request.decode_steps = decode_steps
                request.stop_token_ids.extend(stop_token_ids)
            if committed.target_hidden is not None:
                spec = committed.target_hidden.spec
                request.hidden_layers.extend(spec.layers)
                request.hidden_dtype = spec.wire_dtype
            if alternatives:
                request.alternatives.CopyFrom(wire.alternatives_to_proto(alternatives))
            if probs_message is not None:
                request.draft_probs.CopyFrom(probs_message)
            try:
                # wait_for_ready: a restarting target is waited for, not failed fast, when
                # it is the only one; with other replicas, failing fast lets the session move.
                response = _invoke(self.stub.Verify, request, timeout=remaining,
                                   wait_for_ready=not self.route.can_move)
                break
            except grpc.RpcError as error:
                code = _code(error)
                last_error = _describe(error)
                if code == grpc.StatusCode.FAILED_PRECONDITION and refused < MAX_RESYNCS_PER_CALL:
                    refused += 1
                    resyncs += 1
                    sync = mirror.full_resync(session_id, committed)
                    continue
                if self._moved_away(code):
                    # Retry on the new replica at once, from the committed prefix.
                    resyncs += 1
                    sync = mirror.full_resync(session_id, committed)
                    continue
                _assume_done(mirror, committed)
                if code in _RETRIED_VERIFY_CODES or self.route.gone(code):
                    # Connection lost mid-call (a restart), no answer yet, or no replica to
                    # move to yet: try again, with the cache state re-checked, until the
                    # deadline.
                    time.sleep(min(self.retry_interval_s, max(0.0, give_up - time.monotonic())))
                    sync = mirror.plan(session_id, committed)
                    continue
                raise from_rpc_error(error, f"target {self.endpoint}") from None
        decoded = tuple(response.decoded_tokens)
        if len(decoded) >= max(1, request.decode_steps):
            raise ServiceUnavailable(f"target {self.endpoint} decoded {len(decoded) + 1} tokens "
                                     f"where {max(1, request.decode_steps)} were asked")
        # The target fed every token it drew but the last (draft tokens: all of them).
        mirror.record(committed, [response.next_token, *decoded][:-1] if decoded
                      else draft_tokens)
        kept_branches = tuple(response.kept_alternatives)
        if any(index >= len(alternatives) for index in kept_branches):
            raise ServiceUnavailable(
                f"target {self.endpoint} kept alternatives {list(kept_branches)} of "
                f"{len(alternatives)} sent")
        branch_tokens = tuple(alternatives.tokens[index] for index in kept_branches)
        hidden = None
        if request.return_hidden_states and response.HasField("hidden_states"):
            try:
                hidden = wire.decode_hidden(
                    response.hidden_states,
                    len(sync.append) + response.accepted_len + len(kept_branches),
                    response.hidden_states.hidden_size, "hidden_states")
            except InvalidRequest as error:  # the draft goes without; output is unaffected
                log.warning("target %s: unusable hidden states: %s", self.endpoint, error)
        return Verification(response.accepted_len, response.next_token,
                            time.perf_counter() - started, response.forward_seconds, resyncs,
                            request.ByteSize() + response.ByteSize(), hidden,
                            sync.committed_position, kept_branches, branch_tokens,
                            forward_batch(response.batch), decoded)

    def _probs_message(self, session_id: str, draft_tokens: list[int],
                       draft_probs: torch.Tensor | None,
                       params: SamplingParams) -> common_pb2.DraftProbs | None:
        """q for the wire: the relayed Propose message when possible, else encoded."""
        if not draft_tokens or params.greedy:
            return None
        if draft_probs is None:
            raise InvalidRequest("sampled verification needs the draft probabilities q")
        message = self.relay.take(session_id, draft_probs) if self.relay is not None else None
        return message if message is not None else wire.encode_probs(draft_probs)

    def release(self, session_id: str) -> None:
        self._forget(session_id)
        _release(self.stub.Release.future(
            target_pb2.TargetReleaseRequest(session_id=session_id), timeout=RELEASE_TIMEOUT_S),
            session_id, self.endpoint)
