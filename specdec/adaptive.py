"""Adaptive draft length: pick k each round to maximise expected tokens per second.

A round that drafts k tokens emits E(k) tokens on average and costs D(k) + V(k) + O
seconds (draft wait, verify wait, the loop's own time), so the long-run rate of a policy
that keeps k is E(k) / (D(k) + V(k) + O); AdaptiveLength picks the k in [0, max_length]
with the best ratio, every round, from running estimates of both:

- acceptance, per session: discounted counts per draft position (position i is a trial
  when the first i - 1 proposals were accepted), shrunk towards a discounted Beta
  posterior of the per-token rate, so E(k) = 1 + sum_j prod_{i <= j} a_i. The discount
  (per drafting round) lets the estimate follow the text (code, lists and prose accept
  differently). k = 0 collects no evidence, so drafting stops only when even an
  optimistic acceptance (posterior mean + 1 sd) says so, and the draft is then probed
  with the best k > 0 every `probe_every` rounds, an interval that doubles (to 64) while
  probes keep failing.
- costs, shared by all sessions of a process (a property of the deployment, not of the
  text): wall time of Propose per k, of Verify per k and the remaining per-round time,
  each an EMA, optionally seeded from a calibration (MeasuredCosts). Until every k has
  `min_samples` measurements the policy sweeps the unmeasured ones (a few rounds once per
  process); a k without data is costed by interpolation between measured neighbours.

HeuristicLength is transformers' "+2 after a fully accepted round, -1 otherwise".
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

from specdec.acceptance import ChainAcceptance
from specdec.interfaces import Proposal, Verification
from specdec.policy import FixedLength, LengthPolicy
from specdec.settings import default

DEFAULT_MAX_DRAFT_TOKENS: int = default("max-draft-tokens")


class MeasuredCosts(Protocol):
    """A calibration of forward times (specdec.bench.costs.CostCurve is one)."""

    draft_s: float  # one draft forward

    def t_target(self, k: float) -> float:
        """One target forward over k new tokens."""
        ...


def expected_tokens(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens per round at i.i.d. acceptance alpha."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class CostTable:
    """EMA seconds per draft length k, with interpolation for lengths not measured yet."""

    def __init__(self, ema: float = 0.2) -> None:
        self.ema = ema
        self.mean: dict[int, float] = {}
        self.count: dict[int, float] = {}

    def observe(self, k: int, seconds: float, weight: float = 1.0) -> None:
        n = self.count.get(k, 0.0)
        old = self.mean.get(k, seconds)
        step = max(self.ema, weight / (n + weight))  # the first samples count fully
        self.mean[k] = old + step * (seconds - old)
        self.count[k] = n + weight

    def estimate(self, k: int, proportional: bool = False) -> float | None:
        if k in self.mean:
            return self.mean[k]
        known = sorted(self.mean)
        if not known:
            return None
        below = [j for j in known if j < k]
        above = [j for j in known if j > k]
        if below and above:
            low, high = below[-1], above[0]
            frac = (k - low) / (high - low)
            return self.mean[low] + frac * (self.mean[high] - self.mean[low])
        nearest = below[-1] if below else above[0]
        if proportional and nearest > 0:  # k forwards of one token each
            return self.mean[nearest] * k / nearest
        return self.mean[nearest]


class CostModel:
    """Per-deployment round costs, shared across sessions (thread-safe), and the typical
    acceptance of recent sessions per kind of request, a prior for new sessions."""

    def __init__(self, ema: float = 0.2, acceptance_decay: float = 0.995) -> None:
        self.draft = CostTable(ema)  # Propose wait for k tokens
        self.verify = CostTable(ema)  # Verify wait with k draft tokens (k + 1 new)
        self.overhead = CostTable(ema)  # the rest of a round, under key 0
        self.acceptance_decay = acceptance_decay
        self._acceptance: dict[str, list[float]] = {}  # key -> [successes, failures]
        self._lock = threading.Lock()

    def record_acceptance(self, key: str, accepted: int, failed: bool) -> None:
        with self._lock:
            counts = self._acceptance.setdefault(key, [0.0, 0.0])
            counts[0] = counts[0] * self.acceptance_decay + accepted
            counts[1] = counts[1] * self.acceptance_decay + float(failed)

    def acceptance(self, key: str, min_evidence: float = 10.0) -> float | None:
        with self._lock:
            successes, failures = self._acceptance.get(key, (0.0, 0.0))
        total = successes + failures
        return successes / total if total >= min_evidence else None

    @classmethod
    def from_curve(cls, curve: MeasuredCosts, max_length: int = DEFAULT_MAX_DRAFT_TOKENS,
                   weight: float = 0.5) -> CostModel:
        """Seed from a calibration; weight < 1 lets the first real sample replace it."""
        model = cls()
        for k in range(max_length + 1):
            model.verify.observe(k, curve.t_target(k + 1), weight)
            if k:
                model.draft.observe(k, k * curve.draft_s, weight)
        return model

    def samples(self, k: int) -> float:
        with self._lock:
            return self.verify.count.get(k, 0.0)

    def observe(self, k: int, draft_s: float | None, verify_s: float,
                round_s: float | None) -> None:
        with self._lock:
            if draft_s is not None and k > 0:
                self.draft.observe(k, draft_s)
            self.verify.observe(k, verify_s)
            if round_s is not None:
                self.overhead.observe(0, max(0.0, round_s - verify_s - (draft_s or 0.0)))

    def round_seconds(self, k: int, drafted: bool = True) -> float | None:
        """A round verifying k proposed tokens; drafted=False: proposed without the draft
        model (prompt lookup), so no Propose wait."""
        with self._lock:
            verify = self.verify.estimate(k)
            draft = self.draft.estimate(k, proportional=True) if k and drafted else 0.0
            overhead = self.overhead.estimate(0) or 0.0
        if verify is None or draft is None:
            return None
        return draft + verify + overhead


SHARED_COSTS = CostModel()  # the coordinator's: one per process
DEFAULT_MAX_LENGTH: int = default("max-adaptive-length")
# Adaptive requests end a round's draft after a token the draft gives less than this
# probability (transformers uses the same for assisted generation): the target rarely
# agrees with a token its draft was unsure of, so drafting past one rarely pays.
DEFAULT_DRAFT_CONFIDENCE: float = default("draft-confidence")
DEFAULT_INITIAL_LENGTH: int = default("num-draft-tokens")


class AdaptiveLength:
    """LengthPolicy maximising E(k) / round_seconds(k) over k in [0, max_length]."""

    def __init__(self, initial: int = DEFAULT_INITIAL_LENGTH,
                 max_length: int = DEFAULT_MAX_LENGTH, *, costs: CostModel | None = None,
                 prior_alpha: float = 0.6, prior_strength: float = 4.0, decay: float = 0.95,
                 shrink: float = 3.0, allow_zero: bool = True, min_samples: float = 2.0,
                 probe_every: int = 8, prior_key: str = "default",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.initial = max(0, min(initial, max_length))
        self.max_length = max_length
        self.costs = costs if costs is not None else CostModel()
        self.prior_key = prior_key
        shared = self.costs.acceptance(prior_key)
        prior_alpha = min(0.95, max(0.05, shared if shared is not None else prior_alpha))
        self.prior = (prior_alpha * prior_strength, (1 - prior_alpha) * prior_strength)
        self.decay = decay
        self.shrink = shrink
        self.allow_zero = allow_zero
        self.min_samples = min_samples
        self.probe_every = probe_every
        self._probe_interval = probe_every
        self._idle_rounds = 0  # consecutive rounds at k = 0
        self._clock = clock
        self.successes = 0.0  # discounted accepted proposals
        self.failures = 0.0  # discounted rejections (rounds that stopped early)
        self.chain = ChainAcceptance(max_length, decay)
        self.rounds = 0
        # The length chosen for each round the policy ran (observe), in order; a round
        # that verified a prompt-lookup hit instead never reaches the policy.
        self.chosen: list[int] = []
        self._choice: int | None = None
        self._round_started: float | None = None
        self._last: tuple[int, float | None, float] | None = None

    # -- estimates ---------------------------------------------------------------------
    def alpha(self) -> float:
        a, b = self.prior
        return (self.successes + a) / (self.successes + self.failures + a + b)

    def upper_alpha(self) -> float:
        a, b = self.prior
        n = self.successes + self.failures + a + b
        mean = self.alpha()
        return min(1.0, mean + math.sqrt(mean * (1 - mean) / (n + 1)))

    def expected_tokens(self, k: int) -> float:
        return self.chain.expected_tokens(k, self.alpha(), self.shrink)

    def rates(self) -> dict[int, float]:
        """Expected tokens per second for each k that can be costed now."""
        out: dict[int, float] = {}
        for k in range(0 if self.allow_zero else 1, self.max_length + 1):
            rate = self.rate(k)
            if rate is not None:
                out[k] = rate
        return out

    def rate(self, k: int) -> float | None:
        """Expected tokens per second of a round drafting k (None: not costed yet)."""
        seconds = self.costs.round_seconds(k)
        return self.expected_tokens(k) / seconds if seconds is not None and seconds > 0 else None

    def undrafted_round_seconds(self, k: int) -> float | None:
        """A round verifying k tokens that did not come from the draft model."""
        return self.costs.round_seconds(k, drafted=False)

    # -- LengthPolicy ----------------------------------------------------------------------
    def next_length(self) -> int:
        now = self._clock()
        if self._last is not None and self._round_started is not None and self.rounds > 1:
            k, draft_s, verify_s = self._last  # the previous round, now that its wall is known
            self.costs.observe(k, draft_s, verify_s, now - self._round_started)
        self._last = None
        self._round_started = now
        self._choice = self._choose()
        return self._choice

    def _choose(self) -> int:
        first = 0 if self.allow_zero else 1
        lengths = range(first, self.max_length + 1)
        known = {k: self.costs.samples(k) for k in lengths}
        unmeasured = [k for k in lengths if known[k] < self.min_samples]
        if unmeasured and self.rounds == 0:  # round 1 carries the prefill: not a sample
            return self.initial
        if unmeasured:  # sweep, nearest to the starting length first
            return min(unmeasured, key=lambda k: (known[k], abs(k - self.initial), k))
        rates = self.rates()
        if not rates:
            return self.initial
        best = max(rates, key=lambda k: (rates[k], -k))
        if best > 0:
            self._idle_rounds = 0
            self._probe_interval = self.probe_every
            return best
        drafting = {k: r for k, r in rates.items() if k > 0}
        if not drafting:
            return 0
        best_drafting = max(drafting, key=lambda k: (drafting[k], -k))
        # Stopping the draft stops the evidence: stop only if even an optimistic alpha
        # (posterior mean + 1 sd) says so, and then probe now and again.
        optimistic = self.upper_alpha()
        for k in drafting:
            seconds = self.costs.round_seconds(k) or 0.0
            if seconds > 0 and expected_tokens(optimistic, k) / seconds > rates[0]:
                return best_drafting
        self._idle_rounds += 1
        if self._idle_rounds < self._probe_interval:
            return 0
        self._idle_rounds = 0  # probe; back off further if it fails again
        self._probe_interval = min(64, 2 * self._probe_interval)
        return best_drafting

    def observe(self, asked: int, accepted_len: int, proposal: Proposal | None,
                verification: Verification) -> None:
        # Evidence and costs are per requested length: a proposal the confidence gate ended
        # early counts as the chain stopping there, so E(k) and the cost of asking k both
        # include what the gate does.
        self.rounds += 1
        if self._choice is not None:
            self.chosen.append(self._choice)
            self._choice = None
        if asked > 0:  # evidence ages per drafting round: k = 0 rounds teach nothing
            self.successes = self.successes * self.decay + accepted_len
            self.failures = self.failures * self.decay + (1.0 if accepted_len < asked else 0.0)
            self.chain.record(asked, accepted_len)
            self.costs.record_acceptance(self.prior_key, accepted_len, accepted_len < asked)
        resynced = verification.resyncs or (proposal is not None and proposal.resyncs)
        # Round 1 carries the prompt's prefill; a resync re-sends the history: not typical.
        if self.rounds > 1 and not resynced:
            self._last = (asked, proposal.elapsed_s if proposal else None,
                          verification.elapsed_s)


class HeuristicLength:
    """transformers' num_assistant_tokens_schedule="heuristic": +2 if all accepted, else -1."""

    def __init__(self, initial: int = DEFAULT_INITIAL_LENGTH,
                 max_length: int = DEFAULT_MAX_DRAFT_TOKENS) -> None:
        self.length = initial
        self.max_length = max_length

    def next_length(self) -> int:
        return self.length

    def observe(self, asked: int, accepted_len: int, proposal: Proposal | None,
                verification: Verification) -> None:
        if asked == 0:
            return
        step = 2 if accepted_len == asked else -1
        self.length = max(1, min(self.max_length, self.length + step))


def length_policy(num_draft_tokens: int, adaptive: bool, max_length: int = DEFAULT_MAX_LENGTH,
                  costs: CostModel | None = None, greedy: bool = True) -> LengthPolicy:
    """The policy a request asks for: adaptive (starting at num_draft_tokens) or fixed.

    Adaptive sessions share `costs` (default: this process's SHARED_COSTS) and learn a
    prior acceptance per kind of request (greedy or sampled accept differently).
    """
    if adaptive and num_draft_tokens > 0:
        # Past DEFAULT_MAX_LENGTH tokens a CPU verify costs more than the extra acceptance
        # brings, and every length allowed is swept once; a request asking more raises it.
        longest = min(max_length, max(DEFAULT_MAX_LENGTH, num_draft_tokens))
        return AdaptiveLength(num_draft_tokens, max(1, longest),
                              costs=SHARED_COSTS if costs is None else costs,
                              prior_key="greedy" if greedy else "sampled")
    return FixedLength(num_draft_tokens)
