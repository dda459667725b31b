"""The thread a served model's tensor work runs on: the process's main thread.

libgomp, torch's OpenMP runtime on Linux, gives every thread that starts a parallel
region a worker pool of its own. A `specdec serve` process starts one on its main thread
while it loads the model; forwards on another thread would start a second. Once a
process holds more OpenMP threads than CPUs, libgomp stops spinning at barriers (under
the services' OMP_WAIT_POLICY=PASSIVE, not at all), so every parallel region of a
forward wakes its worker through the kernel, dozens of context switches per call. So
`specdec serve` runs every forward on the main thread, the one that loaded the model.
`specdec ray`'s replica actors, whose main thread runs Ray's task loop, load their model
on a compute thread and run its forwards there (`on_own_compute_thread`). Servers
started inside another program (tests, in-process stacks) keep SessionTable's own
compute thread: their main thread is the caller's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as error:
        future.set_exception(error)
        if not isinstance(error, Exception):
            raise
    else:
        future.set_result(result)


class MainThreadExecutor(Executor):
    """submit() queues work for the main thread, which runs it inside run_until()."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Work] = queue.SimpleQueue()
        self._owner = threading.main_thread()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        if threading.current_thread() is self._owner:
            _run(future, fn, args, kwargs)  # queued, it would wait for itself
            return future
        with self._lock:
            if self._closed:
                raise RuntimeError("the model service is stopping: no new work is accepted")
            self._queue.put((future, fn, args, kwargs))
        return future

    def run_until(self, done: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Run queued work, in order, until done() holds (checked at least every poll_s
        and after each piece of work). Only the main thread may serve the queue."""
        if threading.current_thread() is not self._owner:
            raise RuntimeError("MainThreadExecutor.run_until must run on the main thread")
        while not done():
            try:
                work = self._queue.get(timeout=poll_s)
            except queue.Empty:
                continue
            _run(*work)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; with cancel_futures, cancel what is still queued. (Work
        already queued otherwise runs while the main thread still serves the queue.)"""
        with self._lock:
            self._closed = True
        while cancel_futures:
            try:
                future = self._queue.get_nowait()[0]
            except queue.Empty:
                break
            future.cancel()


def on_own_compute_thread(create: Callable[[Executor], T]) -> T:
    """create(compute) on a new compute thread that then runs every piece of work given
    to `compute`: the model loads on the thread that will run its forwards, so the
    process keeps one OpenMP pool where its main thread cannot serve (a Ray actor)."""
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    try:
        return compute.submit(create, compute).result()
    except BaseException:
        compute.shutdown(wait=False, cancel_futures=True)
        raise
