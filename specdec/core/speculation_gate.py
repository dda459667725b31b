"""Whether drafting raises the deployment's throughput at the current load, measured.

AdaptiveLength prices a round from what a session can observe: its own waits and what
its rows add to a shared forward. It cannot see what the draft model's work takes from
the target's when both run on the same compute (one CPU, or draft and target on one
GPU): under load that contention can make every drafting session slower than
target-only, while each session's own arithmetic still says drafting pays.

SpeculationGate answers the question for the whole deployment by experiment. Time is
cut into epochs of `epoch_s`; in each epoch adaptive sessions either may draft ("on") or
run target-only ("off"), and the gate records the output tokens per second of every
generation the coordinator runs. Arms are kept per load level (running generations, in
powers of two: 1, 2-3, 4-7, 8-15, ...), each an exponential moving average over epochs.
Per level it plays the arm with the higher rate and re-tests the other every
`explore_every` epochs, an interval that doubles (to `max_explore_every`) while the
re-test confirms the choice and falls back when it does not. Once chosen, an arm is left
only for one ahead by SWITCH_MARGIN: arms closer than that are within an epoch's noise,
and each switch to drafting costs the draft a catch-up of the tokens it missed. Until
each arm has MIN_EPOCHS epochs at a level the arm with fewer is played, first the
nearest lower level's choice (drafting pays less as load grows).

An epoch counts at the level of its mean load, and only if the load stayed within a
factor of two through it, only adaptive sessions produced tokens in it (a fixed-length
request is the client's choice, not the gate's), it was not an idle gap, and no burst of
new requests' prompts was prefilled in it (more first rounds than BURST_SHARE of the
running generations, at least one): a burst's prefills slow whichever arm is playing, and
one such sample can keep the wrong arm until the next re-test. Either arm is exact: the
gate only chooses k = 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# An epoch spans a few rounds of every running session, so that its rate is a fair
# sample; longer epochs adapt more slowly when the load changes.
DEFAULT_EPOCH_S = 1.0
# Epochs each arm needs at a level before the faster one is played: one epoch can hold
# a burst of new prompts' prefills.
MIN_EPOCHS = 2
# An epoch that ran longer than this many epoch lengths spanned an idle gap: not a sample.
IDLE_FACTOR = 3.0
# How far ahead (a fraction of its rate) the other arm must be for a level to switch.
SWITCH_MARGIN = 0.05
# An epoch in which more first rounds (each a prompt's prefill) ended than this share of
# the running generations, and more than one, is a burst of arrivals: not a sample.
BURST_SHARE = 0.25


def load_level(running: int) -> int:
    """Running generations in powers of two: 1 -> 1, 2-3 -> 2, 4-7 -> 3, 8-15 -> 4."""
    return max(1, running).bit_length()


@dataclass
class Arm:
    """Output tokens per second at one load level with drafting on or off."""

    rate: float = 0.0
    epochs: int = 0

    def observe(self, rate: float, ema: float) -> None:
        self.rate = rate if self.epochs == 0 else self.rate + ema * (rate - self.rate)
        self.epochs += 1


@dataclass
class Level:
    on: Arm
    off: Arm
    explore_every: int
    since_explore: int = 0
    choice: bool | None = None  # the arm played: True drafting on

    def winner(self) -> bool | None:
        """True: drafting on wins; None: an arm has fewer than MIN_EPOCHS epochs."""
        return self.choice

    def decide(self, margin: float) -> None:
        """After an epoch: the faster arm once both are measured, then the other arm
        only when it is ahead by `margin`."""
        if min(self.on.epochs, self.off.epochs) < MIN_EPOCHS:
            return
        if self.choice is None:
            self.choice = self.on.rate >= self.off.rate
            return
        played, other = (self.on, self.off) if self.choice else (self.off, self.on)
        if other.rate > played.rate * (1.0 + margin):
            self.choice = not self.choice


class SpeculationGate:
    """Thread-safe; one per coordinator. `allows` before a round, `record` after it."""

    def __init__(self, epoch_s: float = DEFAULT_EPOCH_S, explore_every: int = 4,
                 max_explore_every: int = 32, ema: float = 0.3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if epoch_s <= 0:
            raise ValueError(f"epoch_s must be positive, got {epoch_s}")
        self.epoch_s = epoch_s
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.ema = ema
        self._clock = clock
        self._lock = threading.Lock()
        self._levels: dict[int, Level] = {}
        self._start: float | None = None  # the current epoch's
        self._level = 0
        self._on = True
        self._tokens = 0
        self._first_rounds = 0  # rounds in the epoch that carried a prompt's prefill
        self._load = 0.0  # running generations, smoothed
        self._samples, self._sum = 0, 0.0  # running generations seen in the epoch
        self._low, self._high = 1 << 30, 0
        self._counts = True  # whether the current epoch can still be a sample
        self._exploring = False  # whether it re-tests the losing arm

    # -- what callers use ------------------------------------------------------------------
    def allows(self, running: int) -> bool:
        """Whether an adaptive session may draft in its next round."""
        with self._lock:
            self._advance(running)
            return self._on

    def record(self, tokens: int, running: int, gated: bool = True,
               first_round: bool = False) -> None:
        """A round of some generation emitted `tokens`; gated: it was an adaptive
        session's (one that asks `allows`); first_round: the generation's first, which
        carried its prompt's prefill."""
        with self._lock:
            self._advance(running)
            self._tokens += tokens
            self._first_rounds += first_round
            if not gated:
                self._counts = False

    def snapshot(self) -> dict[int, tuple[float, int, float, int]]:
        """Per load level with a counted epoch: (rate on, epochs on, rate off, epochs off)."""
        with self._lock:
            return {level: (s.on.rate, s.on.epochs, s.off.rate, s.off.epochs)
                    for level, s in sorted(self._levels.items()) if s.on.epochs + s.off.epochs}

    # -- epochs ----------------------------------------------------------------------------
    def _advance(self, running: int) -> None:
        now = self._clock()
        running = max(1, running)
        # A smoothed load: at a steady N clients the count dips to N - 1 between one
        # request's end and the next one's start, which must not move the level.
        self._load = running if self._load <= 0 else self._load + 0.05 * (running - self._load)
        level = load_level(round(self._load))
        if self._start is None:
            self._begin(now, level)
            return
        self._samples += 1
        self._sum += running
        self._low, self._high = min(self._low, running), max(self._high, running)
        elapsed = now - self._start
        if elapsed < self.epoch_s:
            return
        mean_running = self._sum / self._samples
        if (self._counts and self._tokens > 0 and elapsed <= IDLE_FACTOR * self.epoch_s
                and self._high <= 2 * self._low  # else the load moved within the epoch
                and self._first_rounds <= max(1.0, BURST_SHARE * mean_running)):
            self._close(load_level(round(mean_running)), self._tokens / elapsed)
        self._begin(now, level)

    def _begin(self, now: float, level: int) -> None:
        self._start = now
        self._level = level
        self._tokens = 0
        self._first_rounds = 0
        self._samples, self._sum = 0, 0.0
        self._low, self._high = 1 << 30, 0
        self._counts = True
        self._exploring = False
        self._on = self._choose(self._state(level))

    def _close(self, level: int, rate: float) -> None:
        """Count the epoch that just ended, at the load level it held on average."""
        state = self._state(level)
        before = state.winner()
        (state.on if self._on else state.off).observe(rate, self.ema)
        state.decide(SWITCH_MARGIN)
        after = state.winner()
        if after is not None and after != before:
            low = 1 << (level - 1)
            log.info("speculation %s at %d-%d running generations: %.1f tokens/s drafting, "
                     "%.1f target-only", "on" if after else "off", low, 2 * low - 1,
                     state.on.rate, state.off.rate)
        if self._exploring and level == self._level:
            confirmed = before is not None and state.winner() == before
            state.explore_every = (min(self.max_explore_every, 2 * state.explore_every)
                                   if confirmed else self.explore_every)

    def _state(self, level: int) -> Level:
        if level not in self._levels:
            self._levels[level] = Level(Arm(), Arm(), self.explore_every)
        return self._levels[level]

    def _choose(self, state: Level) -> bool:
        winner = state.winner()
        if winner is None:  # measure the arm with fewer epochs, the prior's first
            if state.on.epochs != state.off.epochs:
                return state.on.epochs < state.off.epochs
            return self._prior(self._level)
        state.since_explore += 1
        if state.since_explore > state.explore_every:
            state.since_explore = 0
            self._exploring = True
            return not winner
        return winner

    def _prior(self, level: int) -> bool:
        """The nearest lower level's choice; drafting on where nothing is known."""
        for lower in range(level - 1, 0, -1):
            state = self._levels.get(lower)
            if state is not None:
                winner = state.winner()
                if winner is not None:
                    return winner
        return True
