"""What the draft and target services share: model loading and session bookkeeping.

`SessionTable` serialises calls of one session (a client that timed out may retry while
its first call still runs; interleaved extends would scramble the cache) and expires
sessions nobody released: a coordinator that crashed mid-generation must not pin KV
memory forever. ModelRunner itself only knows LRU eviction under its byte budget.

Model work runs on one thread per process, whichever gRPC worker received the call:
under `specdec serve` the main thread (specdec.compute), elsewhere a compute thread of
the table's own. OpenMP keeps a thread team per calling thread: calls landing on
whichever of 32 workers is free started or woke a different team each time, which made 2
intra-op threads slower than 1 in a service (docs/benchmarks.md section 4g). One thread
reuses one team. Forwards of different sessions queue instead of running side by side,
which on a CPU they could only do by splitting the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
import torch

from specdec.grpc_server import ServerHandle, Service, build_server
from specdec.models import LoadedModel, load_causal_lm, resolve
from specdec.runner import ModelRunner
from specdec.security import check_session_cap

if TYPE_CHECKING:
    from specdec.telemetry.service import Telemetry

log = logging.getLogger(__name__)
T = TypeVar("T")


class SessionTable:
    def __init__(self, runner: ModelRunner, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic,
                 executor: Executor | None = None) -> None:
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
        self.max_sessions = 0  # SPECDEC_MAX_SESSIONS; 0 = no cap
        self.runner_role = "model"  # names the service in the cap's message

    def call(self, session_id: str, work: Callable[[], T]) -> T:
        """Run work on the model's thread, after the session's earlier calls.

        Every tensor op of a request belongs in work, not only the forward: a torch op on
        a gRPC worker thread starts another OpenMP team there, and once a process holds
        more OpenMP threads than cores libgomp shortens every team's spin, so the
        forward's team sleeps between its GEMMs (T=1 Verify forwards went 35 -> 55 ms
        after probabilities were decoded on worker threads; docs/benchmarks.md 4g).
        """
        with self._guard:
            if session_id not in self._locks:
                check_session_cap(len(self._locks), self.max_sessions, self.runner_role)
            lock = self._locks.setdefault(session_id, threading.Lock())
            self._last_used[session_id] = self._clock()
        with lock:
            try:
                # The caller's context (its tracing span) goes along to the model's thread.
                return self._compute.submit(contextvars.copy_context().run, work).result()
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
        self._compute.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class ModelInfo:
    """What a coordinator (and a draft) must know about the target without its weights."""

    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]


def model_info(name_or_path: str) -> ModelInfo:
    from transformers import AutoConfig, GenerationConfig

    source = resolve(name_or_path, progress=False)
    config = AutoConfig.from_pretrained(source)
    eos = getattr(config, "eos_token_id", None)
    # generation_config.json is where chat models record their end-of-turn token.
    with contextlib.suppress(OSError):
        generation_eos = GenerationConfig.from_pretrained(source).eos_token_id
        eos = eos if generation_eos is None else generation_eos
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    return ModelInfo(int(config.vocab_size),
                     int(getattr(config, "max_position_embeddings", 2048)),
                     tuple(int(i) for i in eos_ids))


def load_runner(model: str, *, device: torch.device, dtype: torch.dtype,
                kv_budget_mb: int | None = None, linear_kernel: str = "auto",
                attention_kernel: str = "auto") -> ModelRunner:
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
                       token_map=loaded.token_map, kv_budget_bytes=budget)


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
    from specdec.security import SecuritySettings, server_options

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
