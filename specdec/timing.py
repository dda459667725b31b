"""Timing one model step the way decoding runs it: extend a session, then roll back."""

from __future__ import annotations

import time
from collections.abc import Callable

from specdec.runner import ModelRunner


def extend_timer(runner: ModelRunner, context: list[int], new_tokens: list[int],
                 ) -> tuple[Callable[[], float], Callable[[], None]]:
    """A call that times one extend of new_tokens after context, rolling back each time,
    and the call that releases its session."""
    session = f"cost-{len(new_tokens)}-{time.monotonic_ns()}"
    runner.extend(session, 0, 0, context, num_logits=1,
                  target_hidden=runner.placeholder_hidden(len(context)))
    fingerprint = runner._sessions[session].history.fingerprint(len(context))
    hidden = runner.placeholder_hidden(len(new_tokens))

    def call() -> float:
        started = time.perf_counter()
        runner.extend(session, len(context), fingerprint, new_tokens,
                      num_logits=len(new_tokens), target_hidden=hidden)
        return time.perf_counter() - started

    def release() -> None:
        runner.release(session)

    return call, release
