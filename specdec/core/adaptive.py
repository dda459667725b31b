"""Adaptive draft length: pick k each round to maximise expected tokens per second.

A round that drafts k tokens emits E(k) tokens on average and costs D(k) + V(k) + O
seconds (draft wait, verify wait, the loop's own time), so the long-run rate of a policy
that keeps k is E(k) / (D(k) + V(k) + O); AdaptiveLength picks the k in [0, max_length]
with the best ratio, every round, from running estimates of both:

- acceptance, per session: discounted counts per draft position (position i is a trial
  when the first i - 1 proposals were accepted), shrunk towards a discounted Beta
  posterior of the per-token rate, so E(k) = 1 + sum_j prod_{i <= j} a_i. The discount
  (per drafting round) lets the estimate follow the text (code, lists and prose accept
  differently). The posterior's prior is the acceptance of the deployment's recent
  sessions of the same kind (greedy or sampled), worth up to 8 trials, once they have
  drafted; before that a generic one. k = 0 collects no evidence, so drafting stops
  only when even an optimistic acceptance (posterior mean + 1 sd) says so, and the
  draft is then probed with the best k > 0 every `probe_every` rounds, an interval
  that doubles (to 64) while probes keep failing.
- costs, shared by all sessions of a process (a property of the deployment, not of the
  text): wall time of Propose per k, of Verify per k and the remaining per-round time,
  each an EMA (specdec.core.cost_model), optionally seeded from a calibration. Until every k has
  `min_samples` measurements the policy sweeps the unmeasured ones (a few rounds once per
  process); a k without data is costed by interpolation between measured neighbours.

Under load (services that batch several sessions into one forward report it in each
response's BatchInfo) a session's rows also lengthen every other session's forward, so
the choice maximises what the deployment gains from the round rather than the session
alone: the session's own rate E(k) / W(k) minus the rate the other B - 1 sessions lose
to its k + 1 rows, (B - 1) * r * c * (k + 1) / W, where c is the seconds a row adds to
a forward (a line fitted to observed forward times against rows) and r, W an other
session's rate and round time (one drafting what its observed rows say, accepting like
this session). At the symmetric point this is the gradient of the deployment's total
rate, B * E(k) / W(k). The rule is smooth in B: long drafts, then alternatives, then
drafting itself (k = 0: no Propose) fade out as load grows and come back as it falls;
there is no batch-size threshold. An all-zero BatchInfo (a service that does not batch)
counts as running alone. What this model cannot see (the draft's work slowing the
target's where they share compute) a SpeculationGate measures: while it finds that
drafting lowers the deployment's output rate at the current load, rounds draft nothing.

HeuristicLength is transformers' "+2 after a fully accepted round, -1 otherwise".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from specdec.core.acceptance import ChainAcceptance, acceptance_key
from specdec.core.cost_model import DEFAULT_MAX_DRAFT_TOKENS, CostModel
from specdec.core.interfaces import ForwardBatch, Proposal, Verification
from specdec.core.policy import EVERY_ROUND, FixedLength, LengthPolicy
from specdec.core.speculation_gate import Arm, SpeculationGate
from specdec.settings import default


def expected_tokens(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens per round at i.i.d. acceptance alpha."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class SharedLoad:
    """What the next verify forward is expected to hold besides this session's rows."""

    sessions: float = 1.0  # sessions sharing it, this one included
    other_rows: float = 0.0  # the other sessions' rows

    @property
    def alone(self) -> bool:
        return self.sessions <= 1.0 and self.other_rows <= 0.0

    @property
    def rows_per_other(self) -> float:
        return self.other_rows / (self.sessions - 1.0) if self.sessions > 1.0 else 0.0


RUNNING_ALONE = SharedLoad()


def expected_load(batch: ForwardBatch, own_rows: int, running_then: int = 0,
                  running_now: int = 0) -> SharedLoad:
    """The load of the next forward, from the last Verify's BatchInfo.

    Calls queued behind that forward join the next one; the coordinator's count of
    running generations (then: when that forward ran; now) scales the estimate, since it
    moves as soon as requests arrive or finish, a round before BatchInfo shows it. An
    unknown batch (all zero) is running alone."""
    if not batch.known:
        return RUNNING_ALONE
    observed = max(1, batch.sessions)
    others_rows = max(0, batch.rows - own_rows)
    per_other = others_rows / (observed - 1) if observed > 1 else float(own_rows)
    sessions = float(observed + batch.queued)
    if running_then > 0 and running_now > 0:
        sessions *= running_now / running_then
    sessions = max(1.0, sessions)
    return SharedLoad(sessions, (sessions - 1.0) * per_other)


def shared_rate(expected: float, seconds: float, rows: float, load: SharedLoad,
                per_row_s: float, others_rate: float, others_round_s: float) -> float:
    """Tokens per second the deployment gains from a round: the session's own rate
    (expected tokens over its round's seconds) minus what its `rows` cost the other
    sessions sharing the forward, each losing others_rate * per_row_s * rows /
    others_round_s. Alone, just the session's own rate."""
    own = expected / seconds
    if load.sessions <= 1.0 or others_round_s <= 0.0:
        return own
    lost = (load.sessions - 1.0) * others_rate * per_row_s * rows / others_round_s
    return own - lost


DEFAULT_MAX_LENGTH: int = default("max-adaptive-length")
# Adaptive requests end a round's draft after a token the draft gives less than this
# probability (transformers uses the same for assisted generation): the target rarely
# agrees with a token its draft was unsure of, so drafting past one rarely pays.
DEFAULT_DRAFT_CONFIDENCE: float = default("draft-confidence")
DEFAULT_INITIAL_LENGTH: int = default("num-draft-tokens")


# Trials recent sessions of a kind must have drafted before their acceptance is the prior.
SHARED_PRIOR_MIN_EVIDENCE = 10.0


class _PendingRound(NamedTuple):
    k: int  # tokens asked of the draft; for a model-free round, the nodes verified
    draft_s: float | None
    verify_s: float
    other_rows: int  # the other sessions' rows in its forward
    drafted: bool  # False: a model-free proposal (CostModel.observe_undrafted)
    steps: int = 1  # target forwards one after another (a round that decoded several)


class AdaptiveLength:
    """LengthPolicy maximising E(k) / round_seconds(k) over k in [0, max_length]."""

    def __init__(self, initial: int = DEFAULT_INITIAL_LENGTH,
                 max_length: int = DEFAULT_MAX_LENGTH, *, costs: CostModel | None = None,
                 prior_alpha: float = 0.6, prior_strength: float = 4.0,
                 shared_prior_strength: float = 8.0, decay: float = 0.95,
                 shrink: float = 3.0, allow_zero: bool = True, min_samples: float = 2.0,
                 probe_every: int = 8, prior_key: str = "default",
                 clock: Callable[[], float] = time.perf_counter,
                 running: Callable[[], int] | None = None,
                 gate: SpeculationGate | None = None) -> None:
        self.initial = max(0, min(initial, max_length))
        self.max_length = max_length
        self.costs = costs if costs is not None else CostModel()
        self.prior_key = prior_key
        # Once recent sessions of this kind have drafted, their acceptance is the prior,
        # weighted as up to shared_prior_strength trials of the session's own: a new
        # session then stops a draft that does not pay here within a round or two, where
        # the generic prior would let it draft until its own evidence outweighs it. Its
        # own rounds (at most about 1 / (1 - decay) trials) still outweigh either prior.
        shared, evidence = self.costs.acceptance_evidence(prior_key)
        if evidence >= SHARED_PRIOR_MIN_EVIDENCE:
            prior_alpha = shared
            prior_strength = max(prior_strength, min(shared_prior_strength, evidence))
        prior_alpha = min(0.95, max(0.05, prior_alpha))
        self.prior = (prior_alpha * prior_strength, (1 - prior_alpha) * prior_strength)
        self.decay = decay
        self.shrink = shrink
        self.allow_zero = allow_zero
        self.min_samples = min_samples
        self.probe_every = probe_every
        self._probe_interval = probe_every
        self._idle_rounds = 0  # consecutive rounds at k = 0
        self._undrafted_ahead = 1  # this round: rounds until the policy may draft again
        self._clock = clock
        self.successes = 0.0  # discounted accepted proposals
        self.failures = 0.0  # discounted rejections (rounds that stopped early)
        self.chain = ChainAcceptance(max_length, decay)
        self.rounds = 0  # drafting rounds (observe)
        self._verified = 0  # every round verified, model-free ones (observe_undrafted) too
        # The length chosen for each drafting round (observe), in order; a round that
        # verified a model-free proposal instead (observe_undrafted) is not in it.
        self.chosen: list[int] = []
        self._choice: int | None = None
        self._round_started: float | None = None
        # The previous round, costed once its wall time is known.
        self._last: _PendingRound | None = None
        # Load: the coordinator's count of running generations (None: not known), and
        # what the next forward is expected to hold, from the last Verify's BatchInfo.
        self.running = running
        self.gate = gate
        self.gated_off = False  # this round: the gate turned drafting off
        self.gate_arm: Arm | None = None  # this round: what the gate allows (None: no gate)
        self._running_at_call = 0
        self.load = RUNNING_ALONE
        self._reference = self.initial  # the k other sessions draft, from their rows
        # Per tree node in the order the draft adds them (depth by depth, the most likely
        # first): how often node i was offered and kept, discounted over drafting rounds.
        self.alternatives_offered: list[float] = []
        self.alternatives_kept: list[float] = []
        # Rounds whose k load made shorter than the session alone would have drafted.
        self.load_limited_rounds = 0
        self.load_limited = False  # this round's
        self.alone_choice: int | None = None  # this round's choice had it run alone

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

    def shared_value(self, k: int, expected: float | None = None,
                     alternatives: int = 0) -> float | None:
        """Tokens per second the deployment gains from a round drafting k under the
        current load (shared_rate); alone, the session's own rate."""
        seconds = self.costs.round_seconds(k)
        if seconds is None or seconds <= 0:
            return None
        tokens = self.expected_tokens(k) if expected is None else expected
        return self._round_value(tokens, seconds, k + 1 + alternatives)

    @property
    def model_free(self) -> bool:
        return self.gate_arm is None or self.gate_arm >= Arm.MODEL_FREE

    def value(self, k: int) -> float | None:
        return self.shared_value(k)

    def undrafted_value(self, k: int, expected_tokens: float) -> float | None:
        """shared_value of a round verifying k tokens that did not come from the draft
        model (no Propose wait)."""
        seconds = self.costs.round_seconds(k, drafted=False)
        if seconds is None or seconds <= 0:
            return None
        return self._round_value(expected_tokens, seconds, k + 1)

    def _round_value(self, tokens: float, seconds: float, rows: int) -> float:
        """A round's own rate alone; under load, shared_rate with the others' rows."""
        if self.load.alone:
            return tokens / seconds
        per_row = self.costs.per_row_seconds()
        shared = per_row * self.load.other_rows
        reference_s = (self.costs.round_seconds(self._reference) or seconds) + shared
        others_rate = self.expected_tokens(self._reference) / reference_s
        return shared_rate(tokens, seconds + shared, rows, self.load, per_row, others_rate,
                           reference_s)

    def shared_values(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for k in range(0 if self.allow_zero else 1, self.max_length + 1):
            value = self.shared_value(k)
            if value is not None:
                out[k] = value
        return out

    def alternative_keep_rate(self, index: int) -> float:
        """How often the draft's index-th alternative is kept when offered, with a weak
        prior of one in ten: a node not offered for a while returns to the prior and is
        tried again."""
        offered = kept = 0.0
        if index < len(self.alternatives_offered):
            offered, kept = self.alternatives_offered[index], self.alternatives_kept[index]
        return (kept + 0.1) / (offered + 1.0)

    def shares_forward(self) -> bool:
        return not self.load.alone

    def next_alternatives(self, limit: int) -> int:
        """How many alternatives (a token tree's nodes beside the chain) to verify this
        round, at most `limit`.

        Alone, each is one more row of the session's own forward, so the tree grows node
        by node, in the order the draft adds them, while the token a node is expected to
        add (its own keep rate over the round's seconds) covers what its row costs (the
        measured cost per row: where verifying more rows costs more, trees shrink, down
        to chains). Under load (other sessions expected in the forward) the tree is a
        chain: every row lengthens the forward all of them wait for, and a node's keep
        rate buys one session a token where the same row costs each of the others a
        share of theirs (docs/performance.md#token-trees measures it)."""
        if limit <= 0:
            return limit
        if self.shares_forward():
            return 0
        k = self._choice if self._choice is not None else self._reference
        seconds = self.costs.round_seconds(k)
        if k == 0 or seconds is None or seconds <= 0:
            return limit if k else 0
        cost = self.costs.per_row_seconds() * self.expected_tokens(k) / seconds ** 2
        count = 0
        while count < limit and self.alternative_keep_rate(count) / seconds >= cost:
            count += 1
        return count

    def _observe_alternatives(self, offered: int, kept: Sequence[int]) -> None:
        """One drafting round's tree: every node's evidence ages, the offered ones gain a
        trial and the kept ones (the accepted path's) a success."""
        grow = offered - len(self.alternatives_offered)
        if grow > 0:
            self.alternatives_offered += [0.0] * grow
            self.alternatives_kept += [0.0] * grow
        for index in range(len(self.alternatives_offered)):
            self.alternatives_offered[index] *= self.decay
            self.alternatives_kept[index] *= self.decay
        for index in range(offered):
            self.alternatives_offered[index] += 1.0
        for index in kept:
            if index < offered:
                self.alternatives_kept[index] += 1.0

    # -- LengthPolicy ----------------------------------------------------------------------
    def next_length(self) -> int:
        now = self._clock()
        if self._last is not None and self._round_started is not None:
            last = self._last  # now that its wall is known
            # The per-k costs are the session's own: what the others' rows added to its
            # forward is taken out (and added back for the load of each round chosen).
            # A round that decoded several tokens is costed as that many rounds of one.
            shared = self.costs.per_row_seconds() * last.other_rows
            verify_s = max(0.0, last.verify_s / last.steps - shared)
            round_s = max(0.0, (now - self._round_started) / last.steps - shared)
            if last.drafted:
                self.costs.observe(last.k, last.draft_s, verify_s, round_s)
            else:
                self.costs.observe_undrafted(last.k, verify_s, round_s)
        self._last = None
        self._round_started = now
        self._running_at_call = self.running() if self.running is not None else 0
        self._undrafted_ahead = 1
        self._choice = self._choose()
        self.gated_off = False
        if self.gate is not None:
            self.gate_arm = self.gate.arm(max(1, self._running_at_call))
            if self.gate_arm < Arm.DRAFT:
                self.gated_off = self._choice > 0
                self._choice = 0
                # The gate plays its arm for an epoch of wall time: each call of it counts.
                self._undrafted_ahead = EVERY_ROUND
        if self.rounds > 0:
            self._note_load_limit(self._choice)
        return self._choice

    def _note_load_limit(self, chosen: int) -> None:
        self.load_limited = False
        self.alone_choice = None
        if self.load.alone:
            return
        rates = self.rates()
        if rates:
            self.alone_choice = max(rates, key=lambda k: (rates[k], -k))
            self.load_limited = chosen < self.alone_choice
            self.load_limited_rounds += self.load_limited

    def _choose(self) -> int:
        first = 0 if self.allow_zero else 1
        lengths = range(first, self.max_length + 1)
        known = {k: self.costs.samples(k) for k in lengths}
        unmeasured = [k for k in lengths if known[k] < self.min_samples]
        if unmeasured and self.rounds == 0:  # round 1 carries the prefill: not a sample
            return self.initial
        if unmeasured:  # sweep, nearest to the starting length first
            return min(unmeasured, key=lambda k: (known[k], abs(k - self.initial), k))
        rates = self.shared_values()
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
            value = self.shared_value(k, expected_tokens(optimistic, k))
            if value is not None and value > rates[0]:
                return best_drafting
        self._idle_rounds += 1
        if self._idle_rounds < self._probe_interval:
            self._undrafted_ahead = self._probe_interval - self._idle_rounds
            return 0
        self._idle_rounds = 0  # probe; back off further if it fails again
        self._probe_interval = min(64, 2 * self._probe_interval)
        return best_drafting

    def undrafted_rounds(self) -> int:
        """Rounds from this one on that draft nothing as the policy stands: while the
        draft does not pay, until its next probe; while the speculation gate turns drafting
        off, any number; else 1 (asked after next_length)."""
        return self._undrafted_ahead

    def observe(self, asked: int, accepted_len: int, proposal: Proposal | None,
                verification: Verification) -> None:
        if verification.steps > 1:  # each decoded token stood for an idle round
            self._idle_rounds = min(self._idle_rounds + verification.steps - 1,
                                    self._probe_interval - 1)
        # Evidence and costs are per requested length: a proposal the confidence gate ended
        # early counts as the chain stopping there, so E(k) and the cost of asking k both
        # include what the gate does.
        self.rounds += 1
        if self._choice is not None:
            self.chosen.append(self._choice)
            self._choice = None
        if proposal is not None and proposal.tokens:
            self._observe_alternatives(len(proposal.alternatives), verification.kept_branches)
        if asked > 0:  # evidence ages per drafting round: k = 0 rounds teach nothing
            self.successes = self.successes * self.decay + accepted_len
            self.failures = self.failures * self.decay + (1.0 if accepted_len < asked else 0.0)
            self.chain.record(asked, accepted_len)
            self.costs.record_acceptance(self.prior_key, accepted_len, accepted_len < asked)
        self._observe_round(asked, proposal, verification, drafted=True)

    def observe_undrafted(self, proposal: Proposal, verification: Verification) -> None:
        """A round that verified a model-free proposal (prompt lookup, the suffix cache)
        instead of drafting: its costs and load only; its acceptance is its proposer's."""
        self._choice = None
        self._observe_round(len(proposal.tokens) + len(proposal.alternatives), proposal,
                            verification, drafted=False)

    def _observe_round(self, k: int, proposal: Proposal | None, verification: Verification,
                       drafted: bool) -> None:
        self._verified += 1
        own_rows = 1 + (len(proposal.tokens) + len(proposal.alternatives) if proposal else 0)
        batch = verification.batch
        running_now = self.running() if self.running is not None else 0
        self.load = expected_load(batch, own_rows, self._running_at_call, running_now)
        if not self.load.alone:  # what the others draft: their rows less the one verified
            self._reference = max(0, min(self.max_length,
                                         round(self.load.rows_per_other) - 1))
        resynced = verification.resyncs or (proposal is not None and proposal.resyncs)
        # Round 1 carries the prompt's prefill; a resync re-sends the history: not typical.
        if self._verified > 1 and not resynced:
            other_rows = max(0, batch.rows - own_rows) if batch.known else 0
            self._last = _PendingRound(k, proposal.elapsed_s if proposal and drafted else None,
                                       verification.elapsed_s, other_rows, drafted,
                                       verification.steps)
            if batch.known and verification.forward_s > 0:
                self.costs.observe_forward(batch.rows,
                                           verification.forward_s / verification.steps)


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
                  costs: CostModel | None = None, greedy: bool = True,
                  running: Callable[[], int] | None = None,
                  gate: SpeculationGate | None = None) -> LengthPolicy:
    """The policy a request asks for: adaptive (starting at num_draft_tokens) or fixed.

    Adaptive sessions of one deployment share `costs` (a coordinator holds one; None: a
    model of this session's own) and learn a prior acceptance per kind of request
    (greedy or sampled accept differently); `running` counts the generations the
    caller runs now (its load); `gate`, the deployment's SpeculationGate, may turn
    drafting off at that load.
    """
    if adaptive and num_draft_tokens > 0:
        # Past DEFAULT_MAX_LENGTH tokens a CPU verify costs more than the extra acceptance
        # brings, and every length allowed is swept once; a request asking more raises it.
        longest = min(max_length, max(DEFAULT_MAX_LENGTH, num_draft_tokens))
        return AdaptiveLength(num_draft_tokens, max(1, longest),
                              costs=costs,
                              prior_key=acceptance_key(greedy), running=running,
                              gate=gate)
    return FixedLength(num_draft_tokens)
