"""AdaptiveLength: picks the rate-maximising draft length on simulated sessions; exactness."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from tiny_models import tiny_llama

from specdec.bench.costs import CostCurve, expected_tokens
from specdec.core.acceptance import ChainAcceptance
from specdec.core.adaptive import (
    RUNNING_ALONE,
    AdaptiveLength,
    HeuristicLength,
    SharedLoad,
    expected_load,
    length_policy,
    shared_rate,
)
from specdec.core.cost_model import CostModel, CostTable, RowCost
from specdec.core.interfaces import ALONE, ForwardBatch, Proposal, Verification
from specdec.core.loop import GenerateConfig, generate
from specdec.core.offers import lookup_offer, suffix_offer
from specdec.core.policy import FixedLength
from specdec.core.prompt_lookup import LookupEvidence
from specdec.core.sampling import SamplingParams
from specdec.core.stats import PROMPT_LOOKUP
from specdec.core.suffix_cache import SuffixDraft
from specdec.core.suffix_proposer import SuffixEvidence, SuffixProposer
from specdec.core.tree_acceptance import Alternatives
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner


def test_chain_acceptance_counts_positions_up_to_the_first_rejection() -> None:
    chain = ChainAcceptance(max_length=3, decay=1.0)
    chain.record(offered=5, accepted_len=5)  # longer than tracked: counts stop at 3
    chain.record(offered=3, accepted_len=1)  # position 2 rejected, position 3 never judged
    assert chain.trials[1:] == [2.0, 2.0, 1.0] and chain.accepts[1:] == [2.0, 1.0, 1.0]
    assert chain.rate(4, 0.3, 2.0) == 0.3  # untracked: the prior alone
    rate_1, rate_2 = (2 + 0.5) / (2 + 1), (1 + 0.5) / (2 + 1)
    assert chain.expected_tokens(2, 0.5, 1.0) == pytest.approx(1 + rate_1 + rate_1 * rate_2)
    halved = ChainAcceptance(max_length=1, decay=0.5)
    halved.record(1, 1)
    halved.record(1, 0)
    assert halved.trials[1] == 1.5 and halved.accepts[1] == 0.5


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(policy: AdaptiveLength | HeuristicLength, clock: FakeClock, alpha: float,
             draft_s: float, verify_s: dict[int, float], rounds: int,
             overhead_s: float = 0.001, seed: int = 0) -> Counter[int]:
    """Rounds with i.i.d. per-token acceptance and exact costs; returns the k chosen."""
    rng = random.Random(seed)
    chosen: Counter[int] = Counter()
    for _ in range(rounds):
        k = policy.next_length()
        chosen[k] += 1
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        proposal = Proposal(list(range(k)), None, k * draft_s) if k else None
        verification = Verification(accepted, 0, verify_s[k])
        clock.now += (k * draft_s) + verify_s[k] + overhead_s
        policy.observe(k, accepted, proposal, verification)
    return chosen


def best_k(alpha: float, draft_s: float, verify_s: dict[int, float], overhead_s: float) -> int:
    rates = {k: expected_tokens(alpha, k) / (k * draft_s + v + overhead_s)
             for k, v in verify_s.items()}
    return max(rates, key=rates.__getitem__)


# T_target(k + 1) shaped like the reference CPU: a jump after one row, then slow growth.
VERIFY = {0: 0.060, 1: 0.110, 2: 0.115, 3: 0.120, 4: 0.126, 5: 0.132, 6: 0.140, 7: 0.150,
          8: 0.160}


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.95])
def test_settles_on_the_rate_maximising_length(alpha: float) -> None:
    clock = FakeClock()
    policy = AdaptiveLength(4, 8, clock=clock, decay=0.98)
    chosen = simulate(policy, clock, alpha, 0.012, VERIFY, 400)
    optimum = best_k(alpha, 0.012, VERIFY, 0.001)
    late = Counter(policy.chosen[-150:])
    top = late.most_common(1)[0][0]
    # Noise in the acceptance estimate may move it one step when neighbours are close.
    rate = {k: expected_tokens(alpha, k) / (k * 0.012 + VERIFY[k] + 0.001) for k in VERIFY}
    assert abs(top - optimum) <= 1 and rate[top] >= 0.93 * rate[optimum], (alpha, late)
    assert sum(chosen.values()) == 400


def test_stops_drafting_when_acceptance_is_poor_and_probes_again() -> None:
    clock = FakeClock()
    policy = AdaptiveLength(4, 8, clock=clock)
    simulate(policy, clock, 0.02, 0.012, VERIFY, 200)
    late = policy.chosen[-100:]
    assert late.count(0) >= 80
    assert any(k > 0 for k in late), "never probes the draft again"


def test_follows_a_change_in_acceptance() -> None:
    clock = FakeClock()
    policy = AdaptiveLength(4, 8, clock=clock)
    simulate(policy, clock, 0.95, 0.012, VERIFY, 150)
    high = Counter(policy.chosen[-50:]).most_common(1)[0][0]
    simulate(policy, clock, 0.3, 0.012, VERIFY, 150, seed=1)
    low = Counter(policy.chosen[-50:]).most_common(1)[0][0]
    assert high >= 6 and low <= 2


def test_sweeps_every_length_once_per_cost_model_then_reuses_it() -> None:
    clock = FakeClock()
    costs = CostModel()
    first = AdaptiveLength(4, 8, costs=costs, clock=clock, min_samples=1)
    simulate(first, clock, 0.8, 0.012, VERIFY, 20)
    assert set(first.chosen[:11]) == set(range(9))
    second = AdaptiveLength(4, 8, costs=costs, clock=clock, min_samples=1)
    simulate(second, clock, 0.8, 0.012, VERIFY, 8)
    assert {0, 8}.isdisjoint(second.chosen)  # no second sweep: only plausible lengths


# T_target(k + 1) where drafting pays at high acceptance and not at low.
VERIFY_MID = {0: 0.060, 1: 0.080, 2: 0.085, 3: 0.090, 4: 0.095, 5: 0.100, 6: 0.105,
              7: 0.110, 8: 0.115}


def drafting_rounds_of_a_second_session(strength: float, alpha: float, seed: int,
                                        rounds: int) -> list[int]:
    """The lengths a session chooses after one of the same deployment that accepted at
    0.3 for 80 rounds (so that drafting does not pay there)."""
    clock, costs = FakeClock(), CostModel()
    simulate(AdaptiveLength(4, 8, costs=costs, clock=clock), clock, 0.3, 0.012, VERIFY_MID, 80,
             seed=seed)
    second = AdaptiveLength(4, 8, costs=costs, clock=clock, shared_prior_strength=strength)
    simulate(second, clock, alpha, 0.012, VERIFY_MID, rounds, seed=seed + 100)
    return second.chosen


def test_a_new_session_takes_the_deployments_acceptance_as_a_firm_prior() -> None:
    """Before sessions of a kind have drafted, the generic prior (0.6, worth 4 trials);
    after, their acceptance, worth up to 8: a new session's optimistic estimate is then
    close to what drafting gives here, so it stops a draft that does not pay sooner. A
    session whose text accepts far better still finds that out and drafts long."""
    costs = CostModel()
    fresh = AdaptiveLength(4, 8, costs=costs)
    assert fresh.prior == pytest.approx((2.4, 1.6))
    for _ in range(4):  # 8 trials: not yet evidence enough
        costs.record_acceptance("default", 1, True)
    assert AdaptiveLength(4, 8, costs=costs).prior == pytest.approx((2.4, 1.6))
    for _ in range(15):
        costs.record_acceptance("default", 0, True)
        costs.record_acceptance("default", 1, True)
    shared, evidence = costs.acceptance_evidence("default")
    assert evidence > 8.0 and 0.3 < shared < 0.4
    informed = AdaptiveLength(4, 8, costs=costs)
    assert informed.prior == pytest.approx((8 * shared, 8 * (1 - shared)))
    generic_strength = AdaptiveLength(4, 8, costs=costs, shared_prior_strength=4.0)
    assert informed.alpha() == pytest.approx(shared)
    assert informed.upper_alpha() < generic_strength.upper_alpha() - 0.03
    for seed in range(4):
        chosen = drafting_rounds_of_a_second_session(8.0, 0.95, seed, 100)
        assert sorted(chosen[-20:])[10] >= 3, chosen


def test_seeded_from_a_calibration_needs_no_sweep() -> None:
    curve = CostCurve("fake", {k + 1: v for k, v in VERIFY.items()}, 0.012)
    costs = CostModel.from_curve(curve, 8, weight=2.0)
    clock = FakeClock()
    policy = AdaptiveLength(4, 8, costs=costs, clock=clock)
    simulate(policy, clock, 0.8, 0.012, VERIFY, 30)
    assert abs(Counter(policy.chosen[2:]).most_common(1)[0][0]
               - best_k(0.8, 0.012, VERIFY, 0.001)) <= 1


def test_cost_table_interpolates_and_extrapolates() -> None:
    table = CostTable()
    assert table.estimate(3) is None
    table.observe(2, 0.2)
    table.observe(6, 0.6)
    assert table.estimate(4) == pytest.approx(0.4)
    assert table.estimate(8) == pytest.approx(0.6)
    assert table.estimate(8, proportional=True) == pytest.approx(0.8)
    table.observe(2, 0.4)  # second sample: full weight is 1/2
    assert table.estimate(2) == pytest.approx(0.3)


def test_heuristic_schedule() -> None:
    policy = HeuristicLength(4, 16)
    verification = Verification(0, 0, 0.0)
    policy.observe(4, 4, None, verification)
    assert policy.next_length() == 6
    policy.observe(6, 2, None, verification)
    assert policy.next_length() == 5
    for _ in range(10):
        policy.observe(5, 0, None, verification)
    assert policy.next_length() == 1


def test_length_policy_choice() -> None:
    assert isinstance(length_policy(3, False), FixedLength)
    assert isinstance(length_policy(0, True), FixedLength)  # target only stays target only
    policy = length_policy(3, True, max_length=6, costs=CostModel())
    assert isinstance(policy, AdaptiveLength) and policy.max_length == 6
    assert policy.next_length() == 3


def test_adaptive_generation_is_still_greedy_exact() -> None:
    torch.set_num_threads(1)
    target, draft = tiny_llama(64, seed=1), tiny_llama(64, seed=2, layers=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    baseline = generate(None, LocalVerifier(ModelRunner(target)), prompt,
                        GenerateConfig(max_new_tokens=40, num_draft_tokens=0))
    policy = AdaptiveLength(2, 6, costs=CostModel(), min_samples=1)
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      prompt, GenerateConfig(max_new_tokens=40), policy=policy)
    assert result.token_ids == baseline.token_ids
    assert len(policy.chosen) == result.stats.rounds


def test_coordinator_uses_adaptive_length_for_adaptive_requests() -> None:
    from coordinator.servicer import make_policy

    policy = make_policy(4, True, max_length=16, greedy=False)
    assert isinstance(policy, AdaptiveLength)
    assert policy.max_length == 8 and policy.prior_key == "sampled"
    assert isinstance(make_policy(4, False, max_length=16, greedy=True), FixedLength)
    wide = make_policy(12, True, max_length=16, greedy=True)
    assert isinstance(wide, AdaptiveLength) and wide.max_length == 12


# -- with the confidence gate: proposals may end before the requested length --------------
SURE, ACCEPT_SURE, ACCEPT_UNSURE = 0.75, 0.95, 0.2


def gated_round(k: int, rng: random.Random) -> tuple[int, int]:
    """(drafted, accepted) for a cap of k: each token is sure with probability SURE; the gate
    ends the proposal after an unsure one, which is rarely accepted."""
    drafted, accepted, alive = 0, 0, True
    while drafted < k:
        drafted += 1
        sure = rng.random() < SURE
        if alive and rng.random() < (ACCEPT_SURE if sure else ACCEPT_UNSURE):
            accepted += 1
        else:
            alive = False
        if not sure:
            break
    return drafted, accepted


def gated_rate(k: int, draft_s: float, rounds: int = 20000) -> float:
    rng = random.Random(k)
    tokens = seconds = 0.0
    for _ in range(rounds):
        drafted, accepted = gated_round(k, rng)
        tokens += accepted + 1
        seconds += drafted * draft_s + VERIFY[drafted] + 0.001
    return tokens / seconds


def test_adaptive_with_the_gate_picks_a_near_best_cap_and_finishes_its_sweep() -> None:
    clock, rng = FakeClock(), random.Random(5)
    policy = AdaptiveLength(4, 8, clock=clock, decay=0.98)
    for _ in range(400):
        k = policy.next_length()
        drafted, accepted = gated_round(k, rng) if k else (0, 0)
        proposal = Proposal(list(range(drafted)), None, drafted * 0.012) if k else None
        verification = Verification(accepted, 0, VERIFY[drafted])
        clock.now += drafted * 0.012 + VERIFY[drafted] + 0.001
        policy.observe(k, accepted, proposal, verification)
    # Costs are kept per requested length, so every length gets measured even though the
    # gate rarely lets 8 tokens through; the sweep ends.
    assert all(policy.costs.samples(k) >= policy.min_samples for k in range(9))
    rates = {k: gated_rate(k, 0.012) for k in range(1, 9)}
    rates[0] = 1 / (VERIFY[0] + 0.001)
    assert max(rates, key=rates.__getitem__) >= 4  # long caps pay here, thanks to the gate
    top = Counter(policy.chosen[-150:]).most_common(1)[0][0]
    assert rates[top] >= 0.95 * max(rates.values()), (top, rates)


# -- under load: other sessions share the verify forward ---------------------------------
def forward_s(rows: int, fixed_s: float, per_row_s: float) -> float:
    return fixed_s + per_row_s * rows


def aggregate_rate(k: int, sessions: int, alpha: float, draft_s: float, fixed_s: float,
                   per_row_s: float, overhead_s: float) -> float:
    """Tokens per second of `sessions` symmetric sessions all drafting k."""
    round_s = k * draft_s + forward_s(sessions * (k + 1), fixed_s, per_row_s) + overhead_s
    return sessions * expected_tokens(alpha, k) / round_s


def simulate_load(policy: AdaptiveLength, clock: FakeClock, alpha: float, sessions: int,
                  rounds: int, draft_s: float, fixed_s: float, per_row_s: float,
                  overhead_s: float = 0.002, seed: int = 0) -> None:
    """Rounds of one session among `sessions` symmetric ones: the others draft what this
    one drafted last round, and every Verify reports the shared forward's BatchInfo."""
    rng = random.Random(seed)
    others_k = policy.chosen[-1] if policy.chosen else policy.initial
    for _ in range(rounds):
        k = policy.next_length()
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        rows = (k + 1) + (sessions - 1) * (others_k + 1)
        forward = forward_s(rows, fixed_s, per_row_s)
        batch = ForwardBatch(sessions=sessions, rows=rows) if sessions > 1 else ALONE
        proposal = Proposal(list(range(k)), None, k * draft_s) if k else None
        verification = Verification(accepted, 0, forward + 0.001, forward, batch=batch)
        clock.now += k * draft_s + forward + 0.001 + overhead_s
        policy.observe(k, accepted, proposal, verification)
        others_k = k


LOADS = [1, 2, 4, 8, 16, 32, 64]


def settle_under_loads(alpha: float, draft_s: float, fixed_s: float,
                       per_row_s: float) -> dict[int, int]:
    """The length a session settles on at each load, the load rising step by step."""
    clock = FakeClock()
    policy = AdaptiveLength(4, 8, clock=clock, costs=CostModel(), decay=0.98)
    simulate_load(policy, clock, alpha, 1, 120, draft_s, fixed_s, per_row_s)  # the sweep
    settled = {}
    for sessions in LOADS:
        simulate_load(policy, clock, alpha, sessions, 120, draft_s, fixed_s, per_row_s,
                      seed=sessions)
        settled[sessions] = Counter(policy.chosen[-60:]).most_common(1)[0][0]
    return settled


def test_expected_load_reads_batch_info_and_all_zero_as_alone() -> None:
    assert expected_load(ALONE, own_rows=3).alone
    assert expected_load(ForwardBatch(), own_rows=3, running_then=4, running_now=8).alone
    load = expected_load(ForwardBatch(sessions=4, rows=15, queued=2), own_rows=3)
    # 3 others with 12 rows between them; the 2 queued calls join the next forward.
    assert load.sessions == 6 and load.other_rows == pytest.approx(5 * 4)
    grown = expected_load(ForwardBatch(sessions=4, rows=15), own_rows=3, running_then=4,
                          running_now=8)
    assert grown.sessions == 8 and grown.other_rows == pytest.approx(7 * 4)
    assert expected_load(ForwardBatch(sessions=1, rows=3), own_rows=3).alone


def test_row_cost_fits_forward_seconds_against_rows() -> None:
    costs = RowCost()
    costs.observe(5, 0.0315)
    assert costs.per_row_seconds() is None  # one row count says nothing about a slope
    for rows in (1, 8, 32, 64, 8, 1):
        costs.observe(rows, 0.030 + 0.0003 * rows)
    assert costs.per_row_seconds() == pytest.approx(0.0003, rel=0.1)


def test_shared_rate_alone_is_the_own_rate_and_falls_with_the_sharers() -> None:
    alone = shared_rate(3.0, 0.06, 5, RUNNING_ALONE, 0.001, 40.0, 0.06)
    assert alone == pytest.approx(3.0 / 0.06)
    values = [shared_rate(3.0, 0.06, 5, SharedLoad(b, 4.0 * (b - 1)), 0.001, 40.0, 0.06)
              for b in (1, 2, 8, 32)]
    assert values == sorted(values, reverse=True) and values[0] == alone


@pytest.mark.parametrize("alpha", [0.6, 0.85])
def test_under_load_long_drafts_fade_smoothly_with_no_throughput_cliff(alpha: float) -> None:
    # A forward of reference-CPU shape: a fixed part and a small cost per row.
    draft_s, fixed_s, per_row_s = 0.004, 0.030, 0.0006
    settled = settle_under_loads(alpha, draft_s, fixed_s, per_row_s)
    lengths = [settled[b] for b in LOADS]
    assert lengths == sorted(lengths, reverse=True), settled  # never longer under more load
    assert lengths[0] > lengths[-1], settled
    for sessions, k in settled.items():
        rates = {j: aggregate_rate(j, sessions, alpha, draft_s, fixed_s, per_row_s, 0.003)
                 for j in range(9)}
        # Near the best the deployment can do at every load: no batch size at which the
        # rule falls off a cliff.
        assert rates[k] >= 0.9 * max(rates.values()), (sessions, k, settled)


def test_speculation_stops_when_rows_dominate_the_forward_and_resumes_as_load_falls() -> None:
    draft_s, fixed_s, per_row_s = 0.004, 0.030, 0.003  # a row-bound forward
    clock = FakeClock()
    policy = AdaptiveLength(4, 8, clock=clock, costs=CostModel(), decay=0.98)
    simulate_load(policy, clock, 0.7, 1, 120, draft_s, fixed_s, per_row_s)
    assert Counter(policy.chosen[-40:]).most_common(1)[0][0] > 0
    simulate_load(policy, clock, 0.7, 48, 120, draft_s, fixed_s, per_row_s, seed=1)
    assert Counter(policy.chosen[-40:]).most_common(1)[0][0] == 0  # target-only rounds
    assert policy.load_limited_rounds > 0
    simulate_load(policy, clock, 0.7, 1, 120, draft_s, fixed_s, per_row_s, seed=2)
    assert Counter(policy.chosen[-40:]).most_common(1)[0][0] > 0  # drafting again


def test_a_model_free_proposal_pays_for_the_rows_it_adds_to_a_shared_forward() -> None:
    """A suffix draft costs no draft forward, but under load each of its rows lengthens
    the forward every other session waits for: a weak one that beats the draft's round
    alone is declined when many sessions share a row-bound forward."""
    draft_s, fixed_s, per_row_s = 0.004, 0.030, 0.003
    weak = SuffixDraft(tokens=tuple(range(8)), parents=(-1, 0, 1, 2, 3, 4, 5, 6),
                       probs=(0.3,) * 8, match_length=2)
    proposer, evidence = SuffixProposer(16, 8), SuffixEvidence(prior=1.0)
    clock = FakeClock()
    policy = AdaptiveLength(4, 8, clock=clock, costs=CostModel(), decay=0.98)
    simulate_load(policy, clock, 0.7, 1, 120, draft_s, fixed_s, per_row_s)
    asked = policy.next_length()
    assert asked > 0
    alone = suffix_offer(weak, proposer, evidence, policy, asked, SamplingParams())
    assert alone is not None and alone.proposal.tokens == list(range(8))
    simulate_load(policy, clock, 0.7, 48, 120, draft_s, fixed_s, per_row_s, seed=1)
    asked = policy.next_length()
    assert asked == 0  # target-only rounds for the draft, as the row cost says
    own_rate = evidence.expected_tokens(weak, 1) / policy.costs.round_seconds(1, drafted=False)
    assert own_rate > policy.rate(0)  # by its own rate alone, it would still be taken
    assert suffix_offer(weak, proposer, evidence, policy, asked, SamplingParams()) is None


def test_a_model_free_round_is_priced_by_what_such_rounds_cost() -> None:
    """Prompt lookup and the suffix cache verify every token they propose, often more than
    the draft is ever asked for. Their rounds' costs are measured on their own: a length
    past the draft's is first priced from the longest drafted one plus the per-row cost,
    then at what it took, and a hit is cut to the length that pays."""
    clock = FakeClock()
    costs = CostModel()
    policy = AdaptiveLength(4, 8, clock=clock, costs=costs)
    flat = {k: 0.100 for k in range(9)}  # verifying up to 9 rows costs one forward
    simulate(policy, clock, 0.2, 0.004, flat, rounds=60)  # a poor draft: lookup should win
    evidence = LookupEvidence(max_tokens=16, prior=0.9, prior_strength=2.0)
    hit = Proposal(list(range(16)), None, 0.0, source=PROMPT_LOOKUP)

    def offered_length() -> int:
        offer = lookup_offer(hit, evidence, policy, policy.next_length())
        assert offer is not None
        return len(offer.proposal.tokens)

    assert offered_length() == 16  # flat as far as measured, so all of it
    # The 16-token round took 0.4 s: where the forward is compute-bound past 9 rows.
    policy.observe_undrafted(hit, Verification(12, 0, 0.400))
    clock.now += 0.401
    assert offered_length() < 16
    assert costs.round_seconds(16, drafted=False) == pytest.approx(0.401, abs=0.002)
    assert 0.1 < costs.round_seconds(12, drafted=False) < 0.4  # between the measured ones
    assert set(costs.verify.mean) == set(range(9))  # the draft's table: its rounds only


def test_alternatives_turn_off_under_load_and_stay_on_alone() -> None:
    clock = FakeClock()
    policy = AdaptiveLength(4, 8, clock=clock, costs=CostModel(), decay=0.98)
    simulate_load(policy, clock, 0.7, 1, 120, 0.004, 0.030, 0.0006)
    policy.next_length()
    assert policy.next_alternatives(2) == 2  # alone (or unknown load): as configured
    simulate_load(policy, clock, 0.7, 2, 40, 0.004, 0.030, 0.0006, seed=3)
    policy.next_length()
    assert policy.next_alternatives(2) == 0  # one other session in the forward: a chain
    simulate_load(policy, clock, 0.7, 1, 40, 0.004, 0.030, 0.0006, seed=4)
    policy.next_length()
    assert policy.next_alternatives(2) == 2  # alone again: the tree is back


def test_a_tree_grows_node_by_node_while_each_node_pays_for_its_row() -> None:
    """Each alternative is judged by its own keep rate: the nodes the target keeps often
    are sent, the one it never keeps stops being sent, and after a while unsent it is tried
    again (its evidence fades back to the prior)."""
    clock = FakeClock()
    policy = AdaptiveLength(4, 8, clock=clock, costs=CostModel())
    simulate_load(policy, clock, 0.7, 1, 120, 0.004, 0.030, 0.0006)
    # Node i is kept this often (siblings: at most one, so node 1 in 0.15 of rounds).
    keep = [0.5, 0.3, 0.0]
    rng = random.Random(0)
    sent: list[int] = []
    for round_index in range(400):
        k = max(1, policy.next_length())
        # Rounds 300 on send no tree: node 2's evidence fades back to the prior.
        count = policy.next_alternatives(len(keep)) if round_index < 300 else 0
        sent.append(count)
        tree = Alternatives(tuple(range(count)), (-1,) * count)
        kept = tuple(i for i in range(count) if rng.random() < keep[i])[:1]
        forward = 0.030 + 0.0006 * (k + 1 + count)
        clock.now += k * 0.004 + forward + 0.003
        accepted = 0
        while accepted < k and rng.random() < 0.7:
            accepted += 1
        policy.observe(k, accepted,
                       Proposal(list(range(k)), None, k * 0.004, alternatives=tree),
                       Verification(accepted, 0, forward, forward, kept_branches=kept,
                                    branch_tokens=kept))
        if round_index == 299:
            assert Counter(sent[200:]).most_common(1)[0][0] == 2, Counter(sent)
            assert policy.alternative_keep_rate(2) < 0.05 < policy.alternative_keep_rate(1)
    policy.next_length()
    assert policy.next_alternatives(len(keep)) == 3


class Schedule:
    """A LengthPolicy that drafts the given lengths in turn (0: a target-only round)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.rounds = 0

    def next_length(self) -> int:
        return self.lengths[min(self.rounds, len(self.lengths) - 1)]

    def observe(self, asked: int, accepted_len: int, proposal: Proposal | None,
                verification: Verification) -> None:
        self.rounds += 1


def test_drafting_resumes_after_a_pause_with_the_draft_cache_caught_up() -> None:
    """After target-only rounds the draft has missed the tokens they committed; its next
    Propose catches them up (SyncPoint), so each proposal after a pause is the one a fresh
    draft makes from the same committed text, and is accepted exactly as often."""
    import grpc
    from service_harness import Services

    from coordinator.clients import GrpcDrafter, GrpcVerifier
    from specdec.core.history import TokenHistory
    from specdec.core.loop import RoundEvent
    from specdec.core.sampling import SamplingParams

    torch.set_num_threads(1)
    vocab = 32
    target, draft = tiny_llama(vocab, seed=1), tiny_llama(vocab, seed=1, layers=2)
    draft.load_state_dict(target.state_dict())  # the target as its draft: all accepted
    other_draft = tiny_llama(vocab, seed=2, layers=1)
    prompt = [1, 5, 7, 3]
    pauses = [3, 3, 0, 0, 0, 3, 0, 3, 3, 0, 0, 3, 3, 3, 3, 3, 3, 3]
    for draft_model, identical in ((draft, True), (other_draft, False)):
        stack = Services(draft_model, target)
        try:
            rounds: list[RoundEvent] = []
            history: list[list[int]] = []
            drafter = GrpcDrafter(grpc.insecure_channel(stack.draft_endpoint),
                                  stack.draft_endpoint, vocab_size=vocab, timeout_s=10)
            verifier = GrpcVerifier(grpc.insecure_channel(stack.target_endpoint),
                                    stack.target_endpoint, call_timeout_s=10)
            result = generate(drafter, verifier, prompt,
                              GenerateConfig(max_new_tokens=40, num_draft_tokens=3),
                              policy=Schedule(pauses), on_round=rounds.append)
            committed = [*prompt, *result.token_ids]
            for event in rounds:
                history.append(committed[:event.position_before])
            drafted = [(event, before) for event, before in zip(rounds, history, strict=True)
                       if event.proposal is not None]
            after_pause = [i for i, event in enumerate(rounds)
                           if event.proposal is not None and i > 0 and rounds[i - 1].asked == 0]
            assert len(after_pause) >= 2  # the schedule paused and resumed
            if identical:
                assert all(event.accepted_len == len(event.proposal.tokens)  # type: ignore[union-attr]
                           for event, _ in drafted)
            fresh = LocalDrafter(ModelRunner(draft_model, target_vocab_size=vocab))
            for n, (event, before) in enumerate(drafted):
                assert event.proposal is not None
                proposal = fresh.propose(f"fresh-{n}", TokenHistory(before),
                                         len(event.proposal.tokens), SamplingParams())
                assert proposal.tokens == event.proposal.tokens, (n, before)
        finally:
            stack.close()
