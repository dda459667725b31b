"""Prompt lookup: model-free proposals copied from earlier text, exact in every mode."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from exact_law import chi_square_pvalue, target_law
from test_greedy_and_kv import PROMPT, hf_greedy
from test_speculation_gate import FixedGate
from tiny_models import tiny_gpt2, tiny_llama

from specdec.core.acceptance import SharedChainAcceptance
from specdec.core.adaptive import AdaptiveLength
from specdec.core.cost_model import CostModel
from specdec.core.history import TokenHistory
from specdec.core.interfaces import Proposal, Verification
from specdec.core.loop import GenerateConfig, RoundEvent, generate
from specdec.core.policy import FixedLength
from specdec.core.prompt_lookup import (
    LookupEvidence,
    NgramIndex,
    PromptLookup,
    find_continuation,
)
from specdec.core.sampling import SamplingParams
from specdec.core.speculation_gate import Arm
from specdec.core.stats import DRAFT_MODEL, PROMPT_LOOKUP
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def test_the_text_after_the_latest_earlier_occurrence_of_the_tail() -> None:
    assert find_continuation([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    # Two earlier occurrences of the tail (1, 2): the latest one's continuation.
    assert find_continuation([1, 2, 3, 1, 2, 4, 1, 2], 1) == [4]
    # A longer matching n-gram wins over a later, shorter one.
    assert find_continuation([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2], 1, max_ngram=3) == [5]
    assert find_continuation([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2], 1, max_ngram=2) == [6]


def test_a_repetition_continues_past_the_end_of_the_text() -> None:
    # The tail (7, 8) last occurred 3 tokens back: period 3, so 9, 7, 8, 9, 7.
    assert find_continuation([7, 8, 9, 7, 8], 5) == [9, 7, 8, 9, 7]
    assert find_continuation([4, 4, 4], 4) == [4, 4, 4, 4]


def test_no_match_no_proposal() -> None:
    assert find_continuation([1, 2, 3, 4], 4) == []
    assert find_continuation([1, 2, 3, 1], 4) == []  # a 1-gram match is below min_ngram=2
    assert find_continuation([1, 2, 3, 1], 4, min_ngram=1) == [2, 3, 1, 2]
    assert find_continuation([1, 2, 1, 2], 0) == []
    assert find_continuation([], 4) == [] and find_continuation([5], 4) == []


def scanned_continuation(tokens: list[int], max_tokens: int, min_ngram: int,
                         max_ngram: int) -> list[int]:
    """The lookup's rule by a plain scan of the whole history."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        starts = [start for start in range(len(tokens) - n)
                  if tokens[start:start + n] == tokens[-n:]]
        if starts:
            out: list[int] = []
            for offset in range(max_tokens):
                index = starts[-1] + n + offset
                out.append(tokens[index] if index < len(tokens) else out[index - len(tokens)])
            return out
    return []


@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(2, 4), (1, 3)])
def test_the_kept_index_answers_as_a_scan_of_the_whole_history(min_ngram: int,
                                                               max_ngram: int) -> None:
    """A generation's index, updated round by round (a few tokens each, and once a
    history that no longer extends it: a cut), answers every round as a scan would."""
    generator = torch.Generator().manual_seed(min_ngram)
    index = NgramIndex(min_ngram, max_ngram)
    history = TokenHistory([int(t) for t in torch.randint(0, 5, (12,), generator=generator)])
    asked = 0
    for round_index in range(120):
        if round_index == 60:  # a different history of the same length: indexed afresh
            history = TokenHistory([(token + 1) % 5 for token in history.tokens])
        expected = scanned_continuation(history.tokens, 6, min_ngram, max_ngram)
        assert index.continuation(history, 6) == expected
        asked += bool(expected)
        history.extend(int(t) for t in torch.randint(0, 5, (1 + round_index % 4,),
                                                     generator=generator))
    assert asked > 60  # most rounds found a match: the comparison is not vacuous


def test_proposals_carry_a_one_hot_q_when_sampling() -> None:
    lookup = PromptLookup(vocab_size=10, max_tokens=4)
    committed = TokenHistory([1, 2, 3, 9, 1, 2])
    greedy = lookup.propose(committed, 8, SamplingParams())
    assert greedy is not None and greedy.tokens == [3, 9, 1, 2] and greedy.probs is None
    assert greedy.source == PROMPT_LOOKUP
    sampled = lookup.propose(committed, 2, SamplingParams(temperature=1.0))  # limit wins
    assert sampled is not None and sampled.tokens == [3, 9] and sampled.probs is not None
    assert torch.equal(sampled.probs, torch.eye(10)[[3, 9]])
    assert lookup.propose(TokenHistory([1, 2, 3]), 8, SamplingParams()) is None
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        PromptLookup(vocab_size=10, min_ngram=3, max_ngram=2)


def _events(target: torch.nn.Module, draft: torch.nn.Module | None, num_draft_tokens: int,
            lookup: PromptLookup, prompt: list[int], new_tokens: int = 40,
            params: SamplingParams | None = None, policy: object = None,
            ) -> tuple[list[int], list[RoundEvent]]:
    events: list[RoundEvent] = []
    result = generate(LocalDrafter(ModelRunner(draft)) if draft is not None else None,
                      LocalVerifier(ModelRunner(target)), prompt,
                      GenerateConfig(max_new_tokens=new_tokens, num_draft_tokens=num_draft_tokens,
                                     sampling=params or SamplingParams(), prompt_lookup=lookup),
                      on_round=events.append, policy=policy)  # type: ignore[arg-type]
    return result.token_ids, events


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("num_draft_tokens", [0, 2])
def test_greedy_with_prompt_lookup_equals_target_greedy(make_target, num_draft_tokens: int) -> None:
    target = make_target(16, seed=3)
    draft = make_target(16, seed=4) if num_draft_tokens else None
    prompt = PROMPT * 2
    tokens, events = _events(target, draft, num_draft_tokens,
                             PromptLookup(16, max_tokens=5), prompt)
    assert tokens == hf_greedy(target, prompt, 40)
    lookups = [e for e in events if e.proposal is not None and e.proposal.source == PROMPT_LOOKUP]
    assert any(e.accepted_len for e in lookups), "no lookup token was kept: path never ran"
    assert all(e.asked == 0 for e in lookups)  # the draft model sat those rounds out
    if num_draft_tokens:
        assert any(e.proposal is not None and e.proposal.source == DRAFT_MODEL for e in events)


def test_lookup_rounds_feed_the_policys_costs_not_the_drafts_evidence() -> None:
    target, draft = tiny_llama(16, seed=3), tiny_llama(16, seed=4, layers=1)
    policy = AdaptiveLength(2, 4, costs=CostModel())
    tokens, events = _events(target, draft, 2, PromptLookup(16, max_tokens=5, min_ngram=1),
                             PROMPT * 2, policy=policy)
    drafted = [e for e in events if e.proposal is None or e.proposal.source != PROMPT_LOOKUP]
    assert len(drafted) < len(events)
    assert policy.rounds == len(drafted)
    looked_up = {len(e.proposal.tokens) for e in events[1:-1]
                 if e.proposal is not None and e.proposal.source == PROMPT_LOOKUP}
    assert policy.costs.undrafted.mean and set(policy.costs.undrafted.mean) <= looked_up
    # The choices the bench reports are those of the rounds the policy ran, in order (the
    # loop caps a choice at the tokens still to generate, less the round's own one).
    prompt_len = len(PROMPT * 2)
    assert [min(choice, 40 - (e.position_before - prompt_len) - 1)
            for choice, e in zip(policy.chosen, drafted, strict=True)] == [e.asked for e in drafted]
    assert tokens == hf_greedy(target, PROMPT * 2, 40)


@pytest.mark.parametrize("played", list(Arm), ids=lambda arm: arm.label)
def test_the_speculation_gates_arm_limits_every_source(played: Arm) -> None:
    """Target-only: no proposal at all, lookup hits included (their rows cost a shared
    forward too); model-free: lookup rounds but no draft model; draft: both. The output
    is the target's greedy text under every arm."""
    target, draft = tiny_llama(16, seed=3), tiny_llama(16, seed=4, layers=1)
    policy = AdaptiveLength(2, 4, costs=CostModel(), gate=FixedGate(played))
    tokens, events = _events(target, draft, 2, PromptLookup(16, max_tokens=5, min_ngram=1),
                             PROMPT * 2, policy=policy)
    sources = {e.proposal.source for e in events if e.proposal is not None}
    assert sources == {Arm.TARGET_ONLY: set(), Arm.MODEL_FREE: {PROMPT_LOOKUP},
                       Arm.DRAFT: {PROMPT_LOOKUP, DRAFT_MODEL}}[played]
    assert tokens == hf_greedy(target, PROMPT * 2, 40)


def test_stats_split_out_the_lookup_part() -> None:
    target, draft = tiny_llama(16, seed=3), tiny_llama(16, seed=4, layers=1)
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT * 2, GenerateConfig(max_new_tokens=40, num_draft_tokens=2,
                                                 prompt_lookup=PromptLookup(16, min_ngram=1)))
    stats = result.stats
    assert 0 < stats.lookup_drafts < stats.num_drafts
    assert 0 < stats.lookup_draft_tokens < stats.draft_tokens
    assert stats.lookup_accepted_tokens <= min(stats.accepted_tokens, stats.lookup_draft_tokens)


def test_evidence_counts_the_lookup_tokens_the_target_emitted() -> None:
    evidence = LookupEvidence(max_tokens=4, prior=0.5, prior_strength=2.0, decay=1.0)
    assert evidence.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)  # the prior alone
    evidence.observe([3, 9, 1], [3, 9, 4])  # two kept, the third was not the target's
    evidence.observe([5, 6], [7])  # rejected at once; position 2 was never tried
    assert evidence.chain.trials[1:4] == [2.0, 1.0, 1.0]
    assert evidence.chain.accepts[1:4] == [1.0, 1.0, 0.0]
    assert evidence.acceptance(1) == pytest.approx((1 + 1) / (2 + 2))
    assert evidence.acceptance(3) == pytest.approx((0 + 1) / (1 + 2))
    decayed = LookupEvidence(max_tokens=2, decay=0.5)
    decayed.observe([1], [1])
    decayed.observe([1], [2])
    assert decayed.chain.trials[1] == 1.5 and decayed.chain.accepts[1] == 0.5


def test_evidence_chooses_the_fastest_length_or_the_draft() -> None:
    evidence = LookupEvidence(max_tokens=4, prior=0.5, prior_strength=2.0)

    def priced(seconds: dict[int, float]) -> Callable[[int, float], float | None]:
        return lambda length, expected: (expected / seconds[length] if length in seconds
                                         else None)

    flat = priced({length: 1.0 for length in range(5)})
    # Without prices (a fixed policy) every token found is verified.
    assert evidence.tokens_to_use(3, flat, None) == (3, None)
    # Verification costs the same for any length: the longest emits most.
    assert evidence.tokens_to_use(3, flat, rival=1.0) == (3, evidence.expected_tokens(3))
    # A round of 2 costs 3x one of 1: 1.5 tokens/s beats 1.75 / 3.
    steep = priced({1: 1.0, 2: 3.0, 3: 3.0})
    assert evidence.tokens_to_use(3, steep, rival=1.0) == (1, 1.5)
    # The draft's round is expected to be faster than any lookup length: no lookup.
    assert evidence.tokens_to_use(3, flat, rival=2.0) == (0, None)
    # A length not priced yet: no basis to choose, so all of them.
    assert evidence.tokens_to_use(3, priced({1: 1.0}), rival=1.0) == (3, None)


def test_a_new_sessions_lookup_estimate_starts_from_the_deployments_rates() -> None:
    """Sessions of one deployment record into a shared estimate; a new session's lookup
    prior is what that text showed (here: the first token rarely right), not the fixed
    guess, so it declines a lookup the guess would have taken."""
    shared = SharedChainAcceptance(4, min_trials=10.0)
    fresh = LookupEvidence(max_tokens=4, prior=0.6, prior_strength=2.0, shared=shared)
    assert shared.rate(1) is None  # nothing measured yet: the fixed prior
    assert fresh.expected_tokens(3) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    earlier = LookupEvidence(max_tokens=4, shared=shared)
    for index in range(60):  # one round in five copies three tokens right
        earlier.observe([1, 2, 3], [1, 2, 3, 4] if index % 5 == 0 else [9])
    first, second = shared.rate(1), shared.rate(2)
    assert first is not None and 0.15 < first < 0.25
    assert second == pytest.approx(1.0)  # 12 trials, all kept
    assert shared.rate(4) is None  # never offered
    new = LookupEvidence(max_tokens=4, prior=0.6, prior_strength=2.0, shared=shared)
    assert new.acceptance(1) == pytest.approx(first)
    assert new.acceptance(4) == pytest.approx(0.6)  # unmeasured: the fixed prior
    # Verifying n tokens costs 1 + n/4 s, a target-only round emits 1 token in 1 s.
    seconds = {0: 1.0, 1: 1.25, 2: 1.5, 3: 1.75}

    def value(length: int, expected: float) -> float:
        return expected / seconds[length]

    guess = LookupEvidence(max_tokens=4, prior=0.6, prior_strength=2.0)  # no deployment
    assert guess.tokens_to_use(3, value, rival=1.0)[0] == 2  # 1.96 tokens in 1.5 s
    assert new.tokens_to_use(3, value, rival=1.0) == (0, None)  # about 1.6 in 1.75 s


@pytest.mark.parametrize("adaptive", [False, True])
def test_only_adaptive_requests_share_lookup_evidence(adaptive: bool) -> None:
    """A fixed-length request's choices must not follow other requests (its seeded tokens
    repeat), so it neither reads nor feeds the deployment's lookup estimate."""
    target, draft = tiny_llama(16, seed=3), tiny_llama(16, seed=4, layers=1)
    shared = SharedChainAcceptance(4, min_trials=1.0)
    policy = AdaptiveLength(2, 4, costs=CostModel()) if adaptive else FixedLength(2)
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT * 2, GenerateConfig(max_new_tokens=30, num_draft_tokens=2,
                                                 prompt_lookup=PromptLookup(16, min_ngram=1),
                                                 lookup_acceptance=shared), policy=policy)
    assert result.stats.lookup_drafts > 0 or adaptive
    assert (shared.rate(1) is not None) == adaptive


class PricedPolicy(FixedLength):
    """A fixed length with fixed prices: stands in for AdaptiveLength's estimates."""

    model_free = True

    def __init__(self, num_draft_tokens: int, draft_rate: float,
                 lookup_seconds: dict[int, float]) -> None:
        super().__init__(num_draft_tokens)
        self.draft_rate = draft_rate
        self.lookup_seconds = lookup_seconds

    def value(self, k: int) -> float | None:
        return self.draft_rate

    def undrafted_value(self, k: int, expected_tokens: float) -> float | None:
        return expected_tokens / self.lookup_seconds.get(k, 100.0)

    def observe_undrafted(self, proposal: Proposal, verification: Verification) -> None:
        pass  # the prices are fixed


@pytest.mark.parametrize("draft_rate, lookup_seconds, lookup_lengths", [
    (1e6, {}, set()),  # the draft's rounds are priced far above any lookup
    (0.0, {1: 1.0}, {1}),  # lookup rounds past one token priced out
], ids=["declined", "cut-to-1"])
def test_a_priced_policy_gates_and_cuts_lookup_hits(draft_rate: float,
                                                    lookup_seconds: dict[int, float],
                                                    lookup_lengths: set[int]) -> None:
    target, draft = tiny_llama(16, seed=3), tiny_llama(16, seed=4, layers=1)
    lookup = PromptLookup(16, max_tokens=5, min_ngram=1)
    _, unpriced = _events(target, draft, 2, lookup, PROMPT * 2)
    assert any(e.proposal is not None and e.proposal.source == PROMPT_LOOKUP for e in unpriced)
    tokens, events = _events(target, draft, 2, lookup, PROMPT * 2,
                             policy=PricedPolicy(2, draft_rate, lookup_seconds))
    assert tokens == hf_greedy(target, PROMPT * 2, 40)
    assert {len(e.proposal.tokens) for e in events
            if e.proposal is not None and e.proposal.source == PROMPT_LOOKUP} == lookup_lengths


# -- exactness under sampling: the joint law of the first tokens ----------------------------
VOCAB, LENGTH, SAMPLES = 8, 3, 2500
LAW_PROMPT = [1, 5, 2, 1, 5]  # 1-gram matches at most positions of an 8-token vocabulary


class UniformQLookup(PromptLookup):
    """A plausible bug: a deterministic proposal reported as if drawn uniformly."""

    def propose(self, committed: TokenHistory, limit: int, params: SamplingParams,
                index: NgramIndex | None = None) -> Proposal | None:
        proposal = super().propose(committed, limit, params, index)
        if proposal is None or proposal.probs is None:
            return proposal
        uniform = torch.full_like(proposal.probs, 1.0 / self.vocab_size)
        return Proposal(proposal.tokens, uniform, proposal.elapsed_s, source=PROMPT_LOOKUP)


def _samples(target: torch.nn.Module, draft: torch.nn.Module, params: SamplingParams,
             lookup: PromptLookup, cut_to_one: bool = False,
             ) -> tuple[list[tuple[int, ...]], int]:
    drafter, verifier = LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target))
    samples, lookup_tokens = [], 0
    for seed in range(SAMPLES):
        seeded = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p, seed)
        # cut_to_one: every hit verified as its first token alone (one-hot q cut to 1 row).
        policy = PricedPolicy(2, 0.0, {1: 1.0}) if cut_to_one else None
        result = generate(drafter, verifier, LAW_PROMPT, GenerateConfig(
            max_new_tokens=LENGTH, sampling=seeded, num_draft_tokens=2, prompt_lookup=lookup,
            session_id=f"s{seed}"), policy=policy)
        samples.append(tuple(result.token_ids))
        lookup_tokens += result.stats.lookup_draft_tokens
    return samples, lookup_tokens


@pytest.mark.parametrize("params, cut_to_one", [
    (SamplingParams(temperature=1.0, top_p=0.8), False),
    (SamplingParams(temperature=1.0), True),
], ids=["topp0.8", "T1-cut"])
def test_sampled_law_with_prompt_lookup_matches_target(params: SamplingParams,
                                                       cut_to_one: bool) -> None:
    target = tiny_llama(VOCAB, seed=11, logit_scale=0.5)
    draft = tiny_llama(VOCAB, seed=12, layers=1, logit_scale=0.5)
    with torch.inference_mode():
        law = target_law(target, LAW_PROMPT, params, LENGTH)
    samples, lookup_tokens = _samples(target, draft, params,
                                      PromptLookup(VOCAB, max_tokens=2, min_ngram=1), cut_to_one)
    assert lookup_tokens > SAMPLES  # lookup proposed in most requests: the path is tested
    assert chi_square_pvalue(samples, law) > 1e-3


def test_a_wrong_lookup_q_is_rejected_by_the_same_test() -> None:
    target = tiny_llama(VOCAB, seed=11, logit_scale=0.5)
    draft = tiny_llama(VOCAB, seed=12, layers=1, logit_scale=0.5)
    params = SamplingParams(temperature=1.0)
    with torch.inference_mode():
        law = target_law(target, LAW_PROMPT, params, LENGTH)
    samples, _ = _samples(target, draft, params, UniformQLookup(VOCAB, max_tokens=2, min_ngram=1))
    assert chi_square_pvalue(samples, law) < 1e-6
