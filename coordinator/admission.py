"""Admission control: a bounded number of running generations and a bounded wait queue.

A request beyond both is refused at once with RESOURCE_EXHAUSTED, whose message names
the limit and the setting that raises it; a queued request waits for a running one to
finish, and leaves the queue when its client cancels or its deadline passes. Nothing
waits without a bound, so an overloaded coordinator answers instead of hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from specdec.settings import default

DEFAULT_MAX_CONCURRENT_REQUESTS: int = default("max-concurrent-requests")
DEFAULT_MAX_QUEUED_REQUESTS: int = default("max-queued-requests")
# How often a queued request re-checks its client's cancellation while it waits.
_WAIT_POLL_S = 0.05


class AdmissionRefused(Exception):
    """Over capacity (RESOURCE_EXHAUSTED): `message` says which limit and its setting."""


class AdmissionAbandoned(Exception):
    """The client cancelled, or its deadline passed, while the request was queued."""


@dataclass(frozen=True)
class AdmissionCounts:
    running: int
    queued: int
    admitted: int  # requests that started generating, since the coordinator started
    refused: int  # answered RESOURCE_EXHAUSTED
    abandoned: int  # left the queue (cancelled or expired) before they started


class Admission:
    """Slots for generations; `slot()` is held for the whole of one generation."""

    def __init__(self, max_running: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
                 max_queued: int = DEFAULT_MAX_QUEUED_REQUESTS) -> None:
        if max_running < 1:
            raise ValueError(f"max concurrent requests must be at least 1, got {max_running} "
                             "(SPECDEC_MAX_CONCURRENT_REQUESTS)")
        if max_queued < 0:
            raise ValueError(f"max queued requests must be at least 0, got {max_queued} "
                             "(SPECDEC_MAX_QUEUED_REQUESTS)")
        self.max_running = max_running
        self.max_queued = max_queued
        self._changed = threading.Condition()
        self._running = 0
        self._queued = 0
        self._admitted = 0
        self._refused = 0
        self._abandoned = 0

    @property
    def running(self) -> int:
        """Generations running now: the coordinator's own measure of its load."""
        return self._running

    def counts(self) -> AdmissionCounts:
        with self._changed:
            return AdmissionCounts(self._running, self._queued, self._admitted,
                                   self._refused, self._abandoned)

    @contextmanager
    def slot(self, is_cancelled: Callable[[], bool] = lambda: False,
             deadline: float | None = None) -> Iterator[None]:
        """Hold a running slot for the body (see `acquire`)."""
        self.acquire(is_cancelled, deadline)
        try:
            yield
        finally:
            self.release()

    def acquire(self, is_cancelled: Callable[[], bool] = lambda: False,
                deadline: float | None = None) -> None:
        """Take a running slot, waiting in the queue for one if all are taken.

        Raises AdmissionRefused when the queue is full too, AdmissionAbandoned when the
        client goes away (or `deadline`, a time.monotonic() value, passes) while queued.
        Every successful acquire is paired with one `release`.
        """
        with self._changed:
            if self._running < self.max_running and self._queued == 0:
                self._start()
                return
            if self._queued >= self.max_queued:
                self._refused += 1
                raise AdmissionRefused(
                    f"coordinator at capacity: {self._running} generations running (limit "
                    f"{self.max_running}, SPECDEC_MAX_CONCURRENT_REQUESTS / "
                    f"--max-concurrent-requests) and {self._queued} waiting (limit "
                    f"{self.max_queued}, SPECDEC_MAX_QUEUED_REQUESTS / "
                    "--max-queued-requests); retry later or add coordinator replicas")
            self._queued += 1
            try:
                while self._running >= self.max_running:
                    if is_cancelled() or (deadline is not None
                                          and time.monotonic() >= deadline):
                        self._abandoned += 1
                        raise AdmissionAbandoned("the request left the queue before it started")
                    self._changed.wait(_WAIT_POLL_S)
            finally:
                self._queued -= 1
            self._start()

    def release(self) -> None:
        with self._changed:
            self._running -= 1
            self._changed.notify()

    def _start(self) -> None:
        self._running += 1
        self._admitted += 1

    def threads_needed(self) -> int:
        """Server threads that let every running and queued request hold one while the
        rejection path and health checks still find a free one."""
        return self.max_running + self.max_queued + 16
