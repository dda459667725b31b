"""Timing one model step the way decoding runs it: extend a session, then roll back."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

import torch

from specdec.engine.runner import ModelRunner

Key = TypeVar("Key", bound=Hashable)
STEP_CONTEXT_TOKENS = 64
STEP_ROUNDS = 9


def random_tokens(vocab_size: int, count: int, seed: int = 0) -> list[int]:
    """count seeded token ids below min(vocab_size, 4096): low ids, which a draft's
    reduced vocabulary holds too."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab_size, 4096), (count,), generator=generator).tolist()


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


def round_robin(calls: Mapping[Key, Callable[[], float]], rounds: int,
                on_last_round: Callable[[], None] | None = None) -> dict[Key, list[float]]:
    """Each call's times over `rounds` rounds, the calls interleaved, after one untimed
    pass (first calls pay allocation and kernel choice). Interleaved, a machine that
    speeds up or slows down during the measurement shifts every call alike instead of
    inflating whichever is timed first. on_last_round runs after each call of the last."""
    for call in calls.values():
        call()
    samples: dict[Key, list[float]] = {key: [] for key in calls}
    for round_index in range(rounds):
        for key, call in calls.items():
            samples[key].append(call())
            if on_last_round is not None and round_index == rounds - 1:
                on_last_round()
    return samples


def fastest_step_s(steps: Mapping[Key, tuple[ModelRunner, Callable[[], None]]],
                   rounds: int = STEP_ROUNDS) -> dict[Key, float]:
    """Each runner's fastest one-token step after STEP_CONTEXT_TOKENS tokens, the steps
    interleaved; a step's prepare() runs before each of its calls (to swap a forward,
    say). The fastest, not the median: other work on the machine (a service loading
    beside this one) only ever adds time, so the minimum is the least disturbed."""
    vocab = min(runner.vocab.target_vocab_size for runner, _ in steps.values())
    context = random_tokens(vocab, STEP_CONTEXT_TOKENS + 1)
    timers = {key: extend_timer(runner, context[:-1], context[-1:])
              for key, (runner, _) in steps.items()}

    def prepared(key: Key) -> Callable[[], float]:
        prepare, (call, _) = steps[key][1], timers[key]

        def timed() -> float:
            prepare()
            return call()
        return timed

    try:
        samples = round_robin({key: prepared(key) for key in steps}, rounds)
    finally:
        for _, release in timers.values():
            release()
    return {key: min(values) for key, values in samples.items()}
