"""What the draft and target services share: model loading, session bookkeeping and the
batching scheduler.

`SessionTable` serialises calls of one session (a client that timed out may retry while
its first call still runs; interleaved extends would scramble the cache) and expires
sessions nobody released: a coordinator that crashed mid-generation must not pin KV
memory forever. ModelRunner itself only knows LRU eviction under its byte budget.

`BatchScheduler` runs the calls of different sessions together (continuous batching):
every call is a job of forward steps (specdec.engine.steps); the calls waiting when a forward
ends join the next one, which takes one step of every running job, so a Verify is one
forward shared with the other sessions' Verify calls and a Propose's draft steps go in
lockstep with the other proposals still drafting. A job leaves when it ends (its length
or confidence gate), a newcomer joins at the next step. Limits: sessions and token rows
per forward; a call over the row limit or longer than a decode-sized forward (a new
session's prompt) is a prefill and runs on its own between decode batches, at most
max_prefills after each, so a long prompt delays the others' next step by one prefill
instead of growing every forward it shares. A call whose gRPC context is no longer
active (cancelled, deadline passed) leaves before the next forward and its session's
cache is released.

A session's next call reaches the service one coordinator round trip after its last one
ended, so sessions that keep arriving a little after a forward started fall into step
with it and take turns, one forward each, instead of sharing. The scheduler learns each
session's gap (from the end of one call to the arrival of its next, a moving average)
and, before a forward with no job in progress, waits for the sessions expected back
within GATHER_FRACTION of a typical forward (a moving average), no longer: one that
comes shares the forward instead of waiting a whole one, one that does not costs the
others at most that wait.

Model work runs on one thread per process, whichever gRPC worker received the call:
under `specdec serve` the main thread (specdec.serving.compute), elsewhere a compute thread of
the table's own. OpenMP keeps a thread team per calling thread, so one thread reuses one
team; forwards never run side by side, which on a CPU they could only do by splitting the
same cores.
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import grpc
import torch

from specdec.engine.models import LoadedModel
from specdec.engine.runner import ModelRunner
from specdec.engine.shapes import DECODE_ROWS
from specdec.engine.steps import Job, step_jobs
from specdec.errors import ServiceUnavailable, SpecdecError
from specdec.proto.specdec.v1 import common_pb2
from specdec.serving.grpc_server import ServerHandle, Service, build_server
from specdec.serving.security import check_session_cap
from specdec.settings import default

DEFAULT_MAX_BATCH_SESSIONS: int = default("max-batch-sessions")
DEFAULT_MAX_BATCH_ROWS: int = default("max-batch-rows")
DEFAULT_MAX_BATCH_PREFILLS: int = default("max-batch-prefills")
GATHER_FRACTION = 0.5  # of a typical forward: the longest wait for expected sessions
EMA = 0.2  # weight of the newest sample in the forward-time and gap averages

if TYPE_CHECKING:
    from specdec.telemetry.service import Telemetry

log = logging.getLogger(__name__)
T = TypeVar("T")
J = TypeVar("J", bound=Job)


class CallCancelled(SpecdecError):
    """The caller went away (cancelled, deadline passed) before its call finished."""

    code = "CANCELLED"


@dataclass(frozen=True)
class BatchLimits:
    max_sessions: int = DEFAULT_MAX_BATCH_SESSIONS
    max_rows: int = DEFAULT_MAX_BATCH_ROWS
    max_prefills: int = DEFAULT_MAX_BATCH_PREFILLS

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_rows < 1 or self.max_prefills < 1:
            raise ValueError(f"batch limits must be at least 1, got {self}")

    @classmethod
    def from_args(cls, args: argparse.Namespace | Any) -> BatchLimits:
        return cls(getattr(args, "max_batch_sessions", DEFAULT_MAX_BATCH_SESSIONS),
                   getattr(args, "max_batch_rows", DEFAULT_MAX_BATCH_ROWS),
                   getattr(args, "max_batch_prefills", DEFAULT_MAX_BATCH_PREFILLS))


@dataclass
class BatchInfo:
    """The forward a call ran in: for a multi-step call, the step with most sessions."""

    sessions: int = 0
    rows: int = 0
    queue_wait_s: float = 0.0
    queued: int = 0

    def to_proto(self) -> common_pb2.BatchInfo:
        return common_pb2.BatchInfo(sessions=self.sessions, rows=self.rows,
                                    queue_wait_seconds=self.queue_wait_s, queued=self.queued)


class BatchObserver(Protocol):
    """What the scheduler reports (specdec.telemetry.metrics.ModelServiceMetrics)."""

    def observe_forward(self, sessions: int, rows: int) -> None: ...

    def observe_queue_wait(self, seconds: float) -> None: ...


@dataclass
class _Call(Generic[T]):
    session_id: str
    make_job: Callable[[], Job]
    finish: Callable[[Any], T]
    context: grpc.ServicerContext | None
    future: Future[tuple[T, BatchInfo]]
    enqueued: float
    job: Job | None = None
    rows: int = 0
    batch: BatchInfo = field(default_factory=BatchInfo)

    def gone(self) -> bool:
        return self.context is not None and not self.context.is_active()


class BatchScheduler:
    """Runs jobs of many sessions in shared forwards on the model's thread (see module
    docstring). submit() blocks its gRPC worker until the call's job has finished."""

    def __init__(self, runner: ModelRunner, executor: Executor, limits: BatchLimits,
                 release: Callable[[str], object]) -> None:
        self.runner = runner
        self.limits = limits
        self.observer: BatchObserver | None = None
        self._executor = executor
        self._release = release
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._waiting: deque[_Call[Any]] = deque()  # no forward yet
        self._running: list[_Call[Any]] = []  # jobs with more steps to go
        self._driving = False
        self._closed = False
        self._ended: dict[str, float] = {}  # session -> when its last call ended
        self._gap_s: dict[str, float] = {}  # session -> average end-to-next-arrival
        self._forward_s = 0.0  # moving average of a decode batch's seconds

    @property
    def queued(self) -> int:
        """Calls waiting for their first forward."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Calls with a job in progress (proposals between draft steps)."""
        return len(self._running)

    def submit(self, session_id: str, make_job: Callable[[], J], finish: Callable[[J], T],
               context: grpc.ServicerContext | None = None) -> tuple[T, BatchInfo]:
        """make_job and finish run on the model's thread: every tensor op of a request
        belongs there, not on the gRPC worker (a torch op on another thread starts
        another OpenMP team, and more OpenMP threads than cores make every team sleep
        between its GEMMs). The caller's context (its tracing span) goes along."""
        ctx = contextvars.copy_context()
        call: _Call[T] = _Call(session_id, lambda: ctx.run(make_job),
                               lambda job: ctx.run(finish, job), context, Future(),
                               time.perf_counter())
        with self._lock:
            if self._closed:
                raise ServiceUnavailable("the model service is stopping")
            self._waiting.append(call)
            ended = self._ended.pop(session_id, None)
            if ended is not None:
                gap = call.enqueued - ended
                old = self._gap_s.get(session_id)
                self._gap_s[session_id] = gap if old is None else old + EMA * (gap - old)
            if len(self._gap_s) > 2 * (len(self._ended) + len(self._waiting)) + 256:
                # Sessions whose last call failed never come back to be pruned in _gather.
                live = {*self._ended, *(c.session_id for c in (*self._waiting, *self._running))}
                self._gap_s = {s: g for s, g in self._gap_s.items() if s in live}
            self._arrived.notify()
            start = not self._driving
            self._driving = True
        if start:
            try:
                self._executor.submit(self._drive)
            except RuntimeError as error:  # the executor is shutting down
                with self._lock:
                    self._driving = False
                raise ServiceUnavailable(str(error)) from None
        return call.future.result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            calls = [*self._waiting, *self._running]
            self._waiting.clear()
            self._running.clear()
        for call in calls:
            _fail(call, ServiceUnavailable("the model service is stopping"))

    # -- on the model's thread --------------------------------------------------------------
    def _drive(self) -> None:
        """Forwards back to back while any call waits or runs."""
        while True:
            with self._lock:
                if not self._waiting and not self._running:
                    self._driving = False
                    return
            try:
                self._iterate()
            except BaseException as error:  # a bug here must not leave callers hanging
                log.exception("batch scheduler failed")
                with self._lock:
                    calls = [*self._waiting, *self._running]
                    self._waiting.clear()
                    self._running.clear()
                    self._driving = False
                for call in calls:
                    _fail(call, error if isinstance(error, Exception)
                          else ServiceUnavailable(repr(error)))
                if not isinstance(error, Exception):
                    raise
                return

    def _iterate(self) -> None:
        """One decode batch (the running jobs' next steps, then newcomers in arrival order
        within the limits), then up to max_prefills prefills, each alone."""
        limits = self.limits
        with self._lock:
            self._gather()
            running, self._running = self._running, []
            newcomers = list(self._waiting)
            self._waiting.clear()
        running = self._drop_gone(running)
        newcomers = self._drop_gone(newcomers)
        batch: list[_Call[Any]] = []
        rows = 0
        for call in running:  # lockstep: every running job steps in every forward
            rows += call.rows
            batch.append(call)
        prefills: list[_Call[Any]] = []
        deferred: list[_Call[Any]] = []
        for call in newcomers:
            if not self._start(call):
                continue
            if call.rows > DECODE_ROWS or call.rows > limits.max_rows:
                if len(prefills) < limits.max_prefills:
                    prefills.append(call)
                else:
                    deferred.append(call)
            elif len(batch) < limits.max_sessions and rows + call.rows <= limits.max_rows:
                batch.append(call)
                rows += call.rows
            else:
                deferred.append(call)
        if deferred:
            with self._lock:
                self._waiting.extendleft(reversed(deferred))  # first in line next time
        if batch:
            self._forward(batch)
        for call in prefills:
            self._forward([call])

    def _gather(self) -> None:
        """With the lock held and no job in progress: wait (at most GATHER_FRACTION of a
        typical forward) for the sessions expected back by then."""
        if self._running or self._forward_s <= 0.0:
            return
        now = time.perf_counter()
        window = GATHER_FRACTION * self._forward_s
        deadline = now + window
        expected = set()
        for session, ended in list(self._ended.items()):
            gap = self._gap_s.get(session)
            due = ended + gap if gap is not None else float("inf")
            if now - window <= due <= deadline:  # due now or soon, a little late at most
                expected.add(session)
            elif due < now - window or now - ended > 4.0 * self._forward_s:
                del self._ended[session]  # overdue: its generation has probably ended
                self._gap_s.pop(session, None)
        while expected and not self._closed and len(self._waiting) < self.limits.max_sessions:
            expected.difference_update(call.session_id for call in self._waiting)
            remaining = deadline - time.perf_counter()
            if not expected or remaining <= 0:
                return
            self._arrived.wait(remaining)

    def _drop_gone(self, calls: list[_Call[Any]]) -> list[_Call[Any]]:
        kept = []
        for call in calls:
            if call.gone():
                self._release(call.session_id)  # its cache would only wait for the TTL
                _fail(call, CallCancelled(f"session {call.session_id!r}: the caller "
                                          "cancelled or its deadline passed"))
            else:
                kept.append(call)
        return kept

    def _start(self, call: _Call[Any]) -> bool:
        """Build a newcomer's job (its tensors decoded here); False if that failed."""
        if call.job is not None:
            return True
        try:
            call.job = call.make_job()
            call.rows = len(call.job.request().tokens)
        except Exception as error:  # noqa: BLE001 - the caller's own bad input
            _fail(call, error)
            return False
        return True

    def _forward(self, batch: list[_Call[Any]]) -> None:
        started = time.perf_counter()
        rows = sum(call.rows for call in batch)
        queued = self.queued
        for call in batch:
            if call.batch.sessions == 0:
                call.batch.queue_wait_s = started - call.enqueued
                call.batch.queued = queued
                if self.observer is not None:
                    self.observer.observe_queue_wait(call.batch.queue_wait_s)
            if len(batch) > call.batch.sessions:
                call.batch.sessions, call.batch.rows = len(batch), rows
        if self.observer is not None:
            self.observer.observe_forward(len(batch), rows)
        try:
            jobs: list[Job] = [call.job for call in batch if call.job is not None]
            outcomes = step_jobs(self.runner, jobs)
        except Exception as error:  # noqa: BLE001 - the forward itself failed: all its calls
            outcomes = [error] * len(batch)
        ended = time.perf_counter()
        if rows <= DECODE_ROWS * len(batch):  # a decode batch, not a prefill
            seconds = ended - started
            self._forward_s = (seconds if self._forward_s <= 0.0
                               else self._forward_s + EMA * (seconds - self._forward_s))
        still = []
        for call, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, Exception):
                _fail(call, outcome)
            elif outcome:
                with self._lock:  # before the caller can call again
                    self._ended[call.session_id] = ended
                try:
                    call.future.set_result((call.finish(call.job), call.batch))
                except Exception as error:  # noqa: BLE001
                    _fail(call, error)
            else:
                call.rows = len(call.job.request().tokens)  # type: ignore[union-attr]
                still.append(call)
        if still:
            with self._lock:
                self._running.extend(still)


def _fail(call: _Call[Any], error: BaseException) -> None:
    if not call.future.done():
        call.future.set_exception(error)


class SessionTable:
    def __init__(self, runner: ModelRunner, ttl_s: float = default("session-ttl-s"),
                 clock: Callable[[], float] = time.monotonic,
                 executor: Executor | None = None, limits: BatchLimits | None = None) -> None:
        """executor: where model work runs (`specdec serve` passes its main thread's);
        default a compute thread of this table's own."""
        self.runner = runner
        self.ttl_s = ttl_s
        self._clock = clock
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._last_used: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._compute = executor or ThreadPoolExecutor(max_workers=1,
                                                       thread_name_prefix="compute")
        self.scheduler = BatchScheduler(runner, self._compute, limits or BatchLimits(),
                                        self.release)
        self.max_sessions = 0  # SPECDEC_MAX_SESSIONS; 0 = no cap
        self.runner_role = "model"  # names the service in the cap's message

    def call(self, session_id: str, make_job: Callable[[], J], finish: Callable[[J], T],
             context: grpc.ServicerContext | None = None) -> tuple[T, BatchInfo]:
        """Run a call's job in the scheduler's shared forwards, after the session's
        earlier calls (see BatchScheduler.submit)."""
        with self._guard:
            if session_id not in self._locks:
                check_session_cap(len(self._locks), self.max_sessions, self.runner_role)
            lock = self._locks.setdefault(session_id, threading.Lock())
            self._last_used[session_id] = self._clock()
        with lock:
            try:
                return self.scheduler.submit(session_id, make_job, finish, context)
            finally:
                with self._guard:
                    released = session_id not in self._locks
                    if not released:
                        self._last_used[session_id] = self._clock()
                if released:
                    # Released while this call ran (the caller gave up on it): the work
                    # may have built the cache again, which no TTL would ever reclaim.
                    self.runner.release(session_id)

    def release(self, session_id: str) -> bool:
        with self._guard:
            self._locks.pop(session_id, None)
            self._last_used.pop(session_id, None)
        return self.runner.release(session_id)

    def expire_idle(self) -> list[str]:
        """Release sessions idle longer than the TTL; a session mid-call is never idle."""
        now = self._clock()
        expired = []
        with self._guard:
            for session_id, last in list(self._last_used.items()):
                lock = self._locks[session_id]
                if now - last > self.ttl_s and lock.acquire(blocking=False):
                    try:
                        del self._locks[session_id], self._last_used[session_id]
                        self.runner.release(session_id)
                        expired.append(session_id)
                    finally:
                        lock.release()
        if expired:
            log.info("released %d idle sessions (TTL %.0f s)", len(expired), self.ttl_s)
        return expired

    def start_reaper(self) -> None:
        interval = max(0.05, min(self.ttl_s / 4, 30.0))

        def run() -> None:
            while not self._stop.wait(interval):
                self.expire_idle()

        self._thread = threading.Thread(target=run, name="session-ttl", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.scheduler.close()
        self._compute.shutdown(wait=False, cancel_futures=True)


def load_runner(model: str, *, device: torch.device, dtype: torch.dtype,
                kv_budget_mb: int | None = None, linear_kernel: str = "auto",
                attention_kernel: str = "auto") -> ModelRunner:
    # The backends are the seam to the hardware: loaded here only, not at import.
    from specdec.engine.backends.cpu import load_causal_lm

    loaded = load_causal_lm(model, device, dtype, progress=False, linear_kernel=linear_kernel,
                            attention_kernel=attention_kernel)
    log.info("loaded %s: %s", model, loaded.precision)
    if loaded.row_invariance_caveat:  # the target's rounding is what greedy equality rests on
        log.warning("%s", loaded.row_invariance_caveat)
    return serving_runner(loaded, kv_budget_mb=kv_budget_mb)


def serving_runner(loaded: LoadedModel, *, target_vocab_size: int | None = None,
                   kv_budget_mb: int | None = None) -> ModelRunner:
    budget = kv_budget_mb * 1024 * 1024 if kv_budget_mb and kv_budget_mb > 0 else None
    return ModelRunner(loaded.model, target_vocab_size=target_vocab_size,
                       token_map=loaded.token_map, kv_budget_bytes=budget,
                       row_invariance=loaded.row_invariance)


class ModelServicer(Protocol):
    """What draft and target servicers expose to the server builder."""

    sessions: SessionTable

    def service(self) -> Service: ...


def start_model_server(servicer: ModelServicer, args: argparse.Namespace,
                       interceptors: Sequence[grpc.ServerInterceptor] = (),
                       telemetry: Telemetry | None = None) -> ServerHandle:
    """Serve a draft or target servicer: interceptors, session reaper, flush on stop."""
    if telemetry is not None:  # tracing outermost: its span covers the other interceptors
        interceptors = [*telemetry.server_interceptors(), *interceptors]
    from specdec.serving.security import SecuritySettings, server_options

    secure = server_options(args, role="model")
    handle = build_server([servicer.service()], host=args.host, port=args.port,
                          max_workers=args.max_workers,
                          **{**secure, "interceptors": [*interceptors, *secure["interceptors"]]})
    servicer.sessions.max_sessions = SecuritySettings.from_args(args).max_sessions
    servicer.sessions.start_reaper()
    handle.on_stop.append(servicer.sessions.close)
    if telemetry is not None:
        handle.on_stop.append(telemetry.shutdown)  # flush the last spans
    return handle
