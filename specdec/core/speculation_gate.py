"""How much speculation raises the deployment's throughput at the current load, measured.

AdaptiveLength prices a round from what a session can observe: its own waits and what
its rows add to a shared forward, from a line fitted to recent forwards. It cannot see
what the draft model's work takes from the target's when both run on the same compute
(one CPU, or draft and target on one GPU), nor where a busy forward's cost per row
departs from that line: under load either can make speculating sessions slower than
target-only, while each session's own arithmetic still says speculation pays.

SpeculationGate answers the question for the whole deployment by experiment. Its arms
say how much adaptive sessions may speculate: TARGET_ONLY (no proposal), MODEL_FREE
(prompt lookup and the suffix cache, whose proposals cost no draft forward but still add
rows to the target's forward) and DRAFT (the draft model too; each round the session's
policy then picks among them). Time is cut into epochs of `epoch_s`; each epoch plays
one arm, and the gate records the output tokens per second of every generation the
coordinator runs. Levels are kept per load (running generations, in powers of two: 1,
2-3, 4-7, 8-15, ...). What requests ask moves every arm's rate (hard prompts are slower
either way), so arms are compared only in adjacent epochs, a switchback design: each
counted epoch that follows a counted epoch of another arm at the same level gives one
paired comparison of the two, log(rate of the higher arm / rate of the lower), bounded
by PAIR_BOUND, and the level keeps their mean per pair of arms (an exponential moving
average once there are enough). A re-test is thus compared with the played epochs just
before and just after it, whose average cancels a drift that runs through all three.

Per level the gate plays one arm, first the nearest lower level's (drafting pays less as
load grows; DRAFT where nothing is known), and re-tests the other arms in turn every
`explore_every` epochs, an interval that doubles (to `max_explore_every`) while re-tests
confirm the choice (the re-test's epoch was slower than the played epoch before it); an
arm found ahead is re-tested again at the shortest interval, so a change in what pays is
followed within a few short intervals. An arm is played once a fresh comparison with
the played one leaves it SWITCH_MARGIN ahead over MIN_PAIRS comparisons: arms closer than
that are within an epoch's noise, and each switch to drafting costs the draft a catch-up
of the tokens it missed.

An epoch counts at the level of its mean load, and only if the load stayed within a
factor of two through it, only adaptive sessions produced tokens in it (a fixed-length
request is the client's choice, not the gate's), it was not an idle gap, and no burst of
new requests' prompts was prefilled in it (more first rounds than BURST_SHARE of the
running generations, at least one): a burst's prefills slow whichever arm is playing.
A single prompt's prefill runs alone on the target, stalling every session while it
runs, whatever the arm: its forward time is taken out of the epoch's duration (the part
before the epoch began out of the epoch before, which is therefore counted one epoch
late), so an arm is not charged for the arrivals that happened to fall in its epochs.
Every arm is exact: the gate only takes proposals away.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# An epoch spans a few rounds of every running session, so that its rate is a fair
# sample; longer epochs adapt more slowly when the load changes.
DEFAULT_EPOCH_S = 1.0
# Paired comparisons two arms need before one replaces the other: two (one re-test's
# epochs before and after it) cancel a linear drift.
MIN_PAIRS = 2
# A paired comparison counts at most this far from even (a log rate ratio, about 22 %):
# a pair that straddles a step in what requests ask can differ many times over, while
# arms that differ more than this are told apart by the sign of every pair anyway.
PAIR_BOUND = 0.2
# An epoch that ran longer than this many epoch lengths spanned an idle gap: not a sample.
IDLE_FACTOR = 3.0
# How far ahead (a fraction of its rate) another arm must be for a level to switch.
SWITCH_MARGIN = 0.05
# An epoch whose prefill stalls (see record) took more than this share of it is no sample.
MAX_STALL_SHARE = 0.75
# An epoch in which more first rounds (each a prompt's prefill) ended than this share of
# the running generations, and more than one, is a burst of arrivals: not a sample.
BURST_SHARE = 0.25


class Arm(enum.IntEnum):
    """How much adaptive sessions may speculate, from none to every source."""

    TARGET_ONLY = 0
    MODEL_FREE = 1  # prompt lookup and the suffix cache
    DRAFT = 2  # the draft model too

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


def load_level(running: int) -> int:
    """Running generations in powers of two: 1 -> 1, 2-3 -> 2, 4-7 -> 3, 8-15 -> 4."""
    return max(1, running).bit_length()


@dataclass
class ArmRate:
    """Output tokens per second of one arm at one load level."""

    rate: float = 0.0
    epochs: int = 0

    def observe(self, rate: float, ema: float) -> None:
        self.rate = rate if self.epochs == 0 else self.rate + ema * (rate - self.rate)
        self.epochs += 1


@dataclass
class Pairs:
    """Paired comparisons of two arms: the mean of log(rate of the higher arm / rate of
    the lower)."""

    advantage: float = 0.0
    count: int = 0

    def observe(self, log_ratio: float, ema: float) -> None:
        self.count += 1
        weight = max(ema, 1.0 / self.count)  # the plain mean until 1/ema pairs
        self.advantage += weight * (log_ratio - self.advantage)


@dataclass
class Level:
    choice: Arm  # the arm played
    explore_every: int
    since_explore: int = 0
    explore_turn: int = 0  # which of the other arms the next re-test tries
    rates: list[ArmRate] = field(default_factory=lambda: [ArmRate() for _ in Arm])
    # (lower arm, higher arm) -> their paired comparisons
    pairs: dict[tuple[Arm, Arm], Pairs] = field(default_factory=dict)
    last: tuple[int, Arm, float] | None = None  # last counted epoch: (index, arm, rate)

    def compared(self, one: Arm, other: Arm) -> Pairs:
        key = (min(one, other), max(one, other))
        return self.pairs.setdefault(key, Pairs())

    def lead(self, arm: Arm) -> tuple[float, int]:
        """(how far `arm` is ahead of the played arm, a log rate ratio; comparisons)."""
        pairs = self.compared(arm, self.choice)
        return (pairs.advantage if arm > self.choice else -pairs.advantage), pairs.count

    def count(self, index: int, arm: Arm, rate: float, ema: float) -> Arm | None:
        """Count epoch `index`; the arm of the epoch before it when the two formed a pair
        (that epoch was another arm's at this level)."""
        self.rates[arm].observe(rate, ema)
        last, self.last = self.last, (index, arm, rate)
        if last is None or last[0] != index - 1 or last[1] == arm:
            return None
        higher, lower = (rate, last[2]) if arm > last[1] else (last[2], rate)
        ratio = min(max(math.log(higher / lower), -PAIR_BOUND), PAIR_BOUND)
        self.compared(arm, last[1]).observe(ratio, ema)
        return last[1]

    def decide(self, one: Arm, other: Arm, margin: float) -> None:
        """After a comparison of `one` and `other`: if the played arm is one of them, move
        to the other when it leads by `margin` over at least MIN_PAIRS comparisons. Only
        the pair just compared is acted on; another pair's comparisons may be old."""
        if self.choice not in (one, other):
            return
        rival = other if self.choice == one else one
        lead, count = self.lead(rival)
        if count >= MIN_PAIRS and lead > math.log1p(margin):
            self.choice = rival

    def others(self) -> list[Arm]:
        return [arm for arm in Arm if arm != self.choice]

    def retest(self) -> Arm:
        """The arm the next re-test tries: the other arms in turn, the same one again
        while it is found ahead (see retested)."""
        others = self.others()
        return others[self.explore_turn % len(others)]

    def retested(self, confirmed: bool, initial: int, most: int) -> None:
        """After a re-test: a confirmed choice doubles the interval and turns to the
        next arm; an arm found ahead is re-tested again at the shortest."""
        if confirmed:
            self.explore_every = min(most, 2 * self.explore_every)
            self.explore_turn += 1
        else:
            self.explore_every = initial


@dataclass
class Epoch:
    """One epoch's arm and what happened in it."""

    index: int
    start: float
    level: int  # the load level it was begun at (the smoothed load's)
    arm: Arm
    exploring: bool  # it re-tests an arm other than the played one
    tokens: int = 0
    first_rounds: int = 0  # rounds that carried a prompt's prefill
    samples: int = 0  # calls seen, and the running generations they reported
    running_sum: float = 0.0
    low: int = 1 << 30
    high: int = 0
    gated_only: bool = True  # only adaptive sessions' rounds ended in it
    elapsed: float = 0.0  # set when it ends
    stall_s: float = 0.0  # prefill forward time inside it

    def sample(self, epoch_s: float) -> tuple[int, float] | None:
        """(load level, output tokens per second outside prefill stalls), or None when
        the epoch is not a fair sample."""
        mean_running = self.running_sum / max(1, self.samples)
        if (not self.gated_only or self.tokens <= 0 or self.elapsed > IDLE_FACTOR * epoch_s
                or self.high > 2 * self.low  # the load moved within the epoch
                or self.first_rounds > max(1.0, BURST_SHARE * mean_running)
                or self.stall_s > MAX_STALL_SHARE * self.elapsed):
            return None
        return load_level(round(mean_running)), self.tokens / (self.elapsed - self.stall_s)


class SpeculationGate:
    """Thread-safe; one per coordinator. `arm` before a round, `record` after it."""

    def __init__(self, epoch_s: float = DEFAULT_EPOCH_S, explore_every: int = 4,
                 max_explore_every: int = 32, ema: float = 0.3,
                 clock: Callable[[], float] = time.monotonic,
                 on_epoch: Callable[[Arm], None] | None = None) -> None:
        """on_epoch: told the arm of each epoch as it begins (metrics)."""
        if epoch_s <= 0:
            raise ValueError(f"epoch_s must be positive, got {epoch_s}")
        self.epoch_s = epoch_s
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.ema = ema
        self._clock = clock
        self._on_epoch = on_epoch
        self._lock = threading.Lock()
        self._levels: dict[int, Level] = {}
        self._load = 0.0  # running generations, smoothed
        self._index = 0  # epochs begun
        self._current: Epoch | None = None
        self._ended: Epoch | None = None  # counted once the next one ends

    # -- what callers use ------------------------------------------------------------------
    def arm(self, running: int) -> Arm:
        """How much an adaptive session may speculate in its next round."""
        with self._lock:
            return self._advance(running).arm

    def record(self, tokens: int, running: int, gated: bool = True,
               first_round: bool = False, prefill_s: float = 0.0) -> None:
        """A round of some generation emitted `tokens`; gated: it was an adaptive
        session's (one that asks `arm`); first_round: the generation's first, which
        carried its prompt's prefill, whose forward ended now after `prefill_s`."""
        with self._lock:
            epoch = self._advance(running)
            epoch.tokens += tokens
            epoch.first_rounds += first_round
            epoch.gated_only = epoch.gated_only and gated
            if prefill_s > 0:
                inside = min(prefill_s, self._clock() - epoch.start)
                epoch.stall_s += inside
                if self._ended is not None:
                    self._ended.stall_s += prefill_s - inside

    def snapshot(self) -> dict[int, tuple[Arm, list[tuple[float, int]]]]:
        """Per load level with a counted epoch: the arm played, and each arm's (rate,
        epochs) in Arm order."""
        with self._lock:
            return {level: (state.choice, [(arm.rate, arm.epochs) for arm in state.rates])
                    for level, state in sorted(self._levels.items())
                    if any(arm.epochs for arm in state.rates)}

    # -- epochs ----------------------------------------------------------------------------
    def _advance(self, running: int) -> Epoch:
        """The epoch in force now, after ending the current one if its time is up."""
        now = self._clock()
        running = max(1, running)
        # A smoothed load: at a steady N clients the count dips to N - 1 between one
        # request's end and the next one's start, which must not move the level.
        self._load = running if self._load <= 0 else self._load + 0.05 * (running - self._load)
        level = load_level(round(self._load))
        epoch = self._current
        if epoch is None:
            epoch = self._current = self._begin(now, level)
            return epoch
        epoch.samples += 1
        epoch.running_sum += running
        epoch.low, epoch.high = min(epoch.low, running), max(epoch.high, running)
        if now - epoch.start < self.epoch_s:
            return epoch
        epoch.elapsed = now - epoch.start
        if self._ended is not None:
            sample = self._ended.sample(self.epoch_s)
            if sample is not None:
                self._close(self._ended, *sample)
        self._ended = epoch
        self._current = self._begin(now, level)
        return self._current

    def _begin(self, now: float, level: int) -> Epoch:
        self._index += 1
        state = self._state(level)
        arm, exploring = self._choose(state)
        if self._on_epoch is not None:
            self._on_epoch(arm)
        return Epoch(self._index, now, level, arm, exploring)

    def _close(self, epoch: Epoch, level: int, rate: float) -> None:
        """Count an ended epoch, at the load level it held on average."""
        state = self._state(level)
        before, last = state.choice, state.last
        paired_with = state.count(epoch.index, epoch.arm, rate, self.ema)
        if paired_with is not None:
            state.decide(epoch.arm, paired_with, SWITCH_MARGIN)
        if state.choice != before:
            low = 1 << (level - 1)
            lead, count = state.lead(before)
            log.info("speculation %s at %d-%d running generations: %+.0f%% against %s in "
                     "adjacent epochs (%d compared)", state.choice.label, low, 2 * low - 1,
                     100.0 * math.expm1(-lead), before.label, count)
        if epoch.exploring and level == epoch.level:
            # the re-test paired with the played epoch just before it and was slower
            confirmed = (paired_with == before and last is not None and rate <= last[2])
            state.retested(confirmed, self.explore_every, self.max_explore_every)

    def _state(self, level: int) -> Level:
        if level not in self._levels:
            self._levels[level] = Level(self._prior(level), self.explore_every)
        return self._levels[level]

    def _choose(self, state: Level) -> tuple[Arm, bool]:
        """(the arm the next epoch plays, whether that is a re-test)."""
        state.since_explore += 1
        if state.since_explore > state.explore_every:
            state.since_explore = 0
            return state.retest(), True
        return state.choice, False

    def _prior(self, level: int) -> Arm:
        """The nearest lower level's choice; DRAFT where nothing is known."""
        for lower in range(level - 1, 0, -1):
            state = self._levels.get(lower)
            if state is not None:
                return state.choice
        return Arm.DRAFT
