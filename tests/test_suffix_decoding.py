"""Suffix decoding in the loop: greedy output unchanged, chains and trees; the sampled
law unchanged (chi-square); the choice between sources; metrics and spans per source."""

from __future__ import annotations

import pytest
import torch
from exact_law import chi_square_pvalue, target_law
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_greedy_and_kv import PROMPT, hf_greedy
from tiny_models import tiny_llama

from specdec.core.acceptance import SharedCalibration
from specdec.core.adaptive import AdaptiveLength
from specdec.core.cost_model import CostModel
from specdec.core.interfaces import Proposal, Verification
from specdec.core.loop import GenerateConfig, GenerationResult, RoundEvent, generate
from specdec.core.policy import FixedLength
from specdec.core.prompt_lookup import PromptLookup
from specdec.core.sampling import SamplingParams
from specdec.core.stats import DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX
from specdec.core.suffix_cache import SuffixCache, SuffixDraft
from specdec.core.suffix_proposer import SuffixProposer
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.telemetry import names
from specdec.telemetry.round_tracer import round_attributes
from specdec.telemetry.service import Telemetry


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def run(target: torch.nn.Module, draft: torch.nn.Module | None, prompt: list[int],
        suffix: SuffixProposer | None, *, new_tokens: int = 40,
        params: SamplingParams | None = None, lookup: PromptLookup | None = None,
        session_id: str = "") -> tuple[GenerationResult, list[RoundEvent]]:
    events: list[RoundEvent] = []
    result = generate(LocalDrafter(ModelRunner(draft)) if draft is not None else None,
                      LocalVerifier(ModelRunner(target)), prompt,
                      GenerateConfig(max_new_tokens=new_tokens, num_draft_tokens=2,
                                     sampling=params or SamplingParams(), prompt_lookup=lookup,
                                     suffix=suffix, session_id=session_id),
                      on_round=events.append)
    return result, events


def suffix_rounds(events: list[RoundEvent]) -> list[RoundEvent]:
    return [e for e in events if e.proposal is not None and e.proposal.source == SUFFIX]


# A target whose greedy answer to PROMPT * 2 hardly repeats itself (a periodic answer
# would make every draft a chain).
VARIED = dict(vocab_size=64, seed=25)


@pytest.mark.parametrize("with_draft", [False, True], ids=["suffix-only", "with-draft"])
def test_greedy_output_equals_the_targets_with_chains_and_trees(with_draft: bool) -> None:
    target = tiny_llama(**VARIED)
    draft = tiny_llama(64, seed=4, layers=1) if with_draft else None
    prompt = PROMPT * 2
    expected = hf_greedy(target, prompt, 40)
    cache = SuffixCache(max_depth=12, max_requests=16)
    # Earlier responses: the answer itself and variants of it, so that the drafts branch
    # where the variants part from it.
    cache.add("", expected)
    for cut in (5, 12, 20, 28):
        cache.add("", [*expected[cut - 5:cut], (expected[cut] + 1) % 64,
                       *expected[cut + 1:cut + 6]])
    suffix = SuffixProposer(64, 8, cache, max_depth=12, max_spec_factor=2.0)
    result, events = run(target, draft, prompt, suffix)
    assert result.token_ids == expected
    used = suffix_rounds(events)
    assert used and sum(e.accepted_len for e in used) > 10, "suffix rounds kept little"
    assert all(e.asked == 0 for e in used)  # the draft model sat those rounds out
    assert any(len(e.proposal.alternatives) for e in used if e.proposal is not None)
    assert result.stats.suffix_draft_tokens > 0
    assert result.stats.suffix_accepted_tokens <= result.stats.accepted_tokens
    assert cache.usage().requests == 6  # the response joined the cache


def test_a_tree_whose_kept_path_leaves_the_chain_stays_exact() -> None:
    target = tiny_llama(**VARIED)
    prompt = PROMPT * 2
    expected = hf_greedy(target, prompt, 30)
    cache = SuffixCache(max_depth=12, max_requests=16)
    # Where the answer's text was seen before, a wrong continuation was seen more often
    # than the right one: the chain takes the wrong one, the right one is its sibling.
    for cut in (8, 24):
        wrong = [*expected[cut - 8:cut], (expected[cut] + 3) % 64]
        cache.add("", wrong)
        cache.add("", wrong)
        cache.add("", expected[cut - 8:cut + 4])
    result, events = run(target, None, prompt,
                         SuffixProposer(64, 8, cache, max_depth=12, max_spec_factor=2.0,
                                        min_token_prob=0.05), new_tokens=30)
    assert result.token_ids == expected
    assert any(e.kept_branches for e in suffix_rounds(events)), "no alternative was kept"


def test_each_round_proposes_from_one_source_and_says_which() -> None:
    target, draft = tiny_llama(16, seed=3), tiny_llama(16, seed=4, layers=1)
    prompt = PROMPT * 2
    expected = hf_greedy(target, prompt, 40)
    cache = SuffixCache(max_depth=12, max_requests=4)
    cache.add("", expected[10:])
    result, events = run(target, draft, prompt, SuffixProposer(16, 8, cache, max_depth=12),
                         lookup=PromptLookup(16, max_tokens=4, min_ngram=1))
    assert result.token_ids == expected
    sources = {e.proposal.source for e in events if e.proposal is not None}
    assert SUFFIX in sources and len(sources) >= 2, sources
    event = suffix_rounds(events)[0]
    attributes = round_attributes(event, False)
    assert attributes[names.SOURCE] == SUFFIX and attributes[names.ASKED] == 0
    assert attributes[names.ACCEPTED] == event.accepted_len
    assert {DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX} >= sources


@pytest.mark.parametrize("adaptive", [False, True])
def test_only_adaptive_requests_share_the_suffix_calibration(adaptive: bool) -> None:
    """As for lookup: a fixed-length request neither reads nor feeds the deployment's
    calibration, so its choices do not follow other requests."""
    target, draft = tiny_llama(16, seed=3), tiny_llama(16, seed=4, layers=1)
    prompt = PROMPT * 2
    cache = SuffixCache(max_depth=12, max_requests=4)
    cache.add("", hf_greedy(target, prompt, 40)[10:])
    shared = SharedCalibration(min_scored=1e-9)
    policy = AdaptiveLength(2, 4, costs=CostModel()) if adaptive else FixedLength(2)
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      prompt, GenerateConfig(max_new_tokens=40, num_draft_tokens=2,
                                             suffix=SuffixProposer(16, 8, cache, max_depth=12),
                                             suffix_calibration=shared), policy=policy)
    assert result.stats.suffix_drafts > 0 or adaptive
    assert (shared.rate() is not None) == adaptive


def test_metrics_count_drafted_and_accepted_tokens_per_source() -> None:
    from prometheus_client import CollectorRegistry

    telemetry = Telemetry("coordinator", registry=CollectorRegistry())
    target = tiny_llama(16, seed=3)
    prompt = PROMPT * 2
    expected = hf_greedy(target, prompt, 30)
    cache = SuffixCache(max_depth=12, max_requests=4)
    cache.add("", expected)
    telemetry.watch_suffix_cache(cache.usage)
    config = GenerateConfig(max_new_tokens=30, num_draft_tokens=2,
                            suffix=SuffixProposer(16, 8, cache, max_depth=12))
    with telemetry.request("r", len(prompt), config) as observed:
        result = generate(None, observed.verifier(LocalVerifier(ModelRunner(target))), prompt,
                          config, on_round=observed.on_round)
        observed.finish(result)
    assert telemetry.coordinator_metrics is not None
    text = generate_latest(telemetry.coordinator_metrics.registry).decode()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    by_source = (("source", SUFFIX),)
    stats = result.stats
    assert values[("specdec_num_drafts_per_source_total", by_source)] == stats.suffix_drafts > 0
    assert values[("specdec_num_draft_tokens_per_source_total", by_source)] == (
        stats.suffix_draft_tokens)
    assert values[("specdec_num_accepted_tokens_per_source_total", by_source)] == (
        stats.suffix_accepted_tokens)
    assert values[("specdec_suffix_cache_requests", ())] == 2  # the answer joined it
    assert values[("specdec_suffix_cache_bytes", ())] == cache.usage().bytes > 0


# -- exactness under sampling: the joint law of the first tokens ----------------------------
VOCAB, LENGTH, SAMPLES = 8, 3, 2500
LAW_PROMPT = [1, 5, 2, 1, 5]
# Earlier responses that branch after the prompt's tail (1, 5): trees with siblings.
EARLIER = ([1, 5, 2, 3, 4], [1, 5, 2, 6, 1], [1, 5, 4, 4, 2], [5, 7, 0, 1, 5, 2],
           [1, 5, 3, 3, 3])


class UniformQSuffix(SuffixProposer):
    """A plausible bug: a deterministic proposal reported as if drawn uniformly."""

    def proposal(self, draft: SuffixDraft, params: SamplingParams,
                 elapsed_s: float = 0.0) -> Proposal:
        proposal = super().proposal(draft, params, elapsed_s)
        if proposal.probs is None:
            return proposal
        uniform = torch.full_like(proposal.probs, 1.0 / self.vocab_size)
        return Proposal(proposal.tokens, uniform, elapsed_s,
                        alternatives=proposal.alternatives, source=SUFFIX)


def sampled_outputs(proposer_type: type[SuffixProposer], params: SamplingParams
                    ) -> tuple[list[tuple[int, ...]], int, int]:
    target = tiny_llama(VOCAB, seed=11, logit_scale=0.5)
    verifier = LocalVerifier(ModelRunner(target))
    # Each sample's output joins the cache too: later samples see those trees.
    cache = SuffixCache(max_depth=6, max_requests=SAMPLES + len(EARLIER))
    for response in EARLIER:
        cache.add("", response)
    samples, suffix_tokens, alternatives = [], 0, 0
    for seed in range(SAMPLES):
        seeded = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p,
                                seed)
        suffix = proposer_type(VOCAB, 6, cache, max_depth=6, max_spec_factor=3.0,
                               min_token_prob=0.05)
        result = generate(None, verifier, LAW_PROMPT, GenerateConfig(
            max_new_tokens=LENGTH, sampling=seeded, num_draft_tokens=2, suffix=suffix,
            session_id=f"s{seed}"))
        samples.append(tuple(result.token_ids))
        suffix_tokens += result.stats.suffix_draft_tokens
        alternatives += result.stats.alternatives
    return samples, suffix_tokens, alternatives


# T1, as the wrong-q test below: top-p's zeros for deterministic proposals are checked
# with prompt lookup's (tests/test_prompt_lookup.py), trees' with tests/test_exactness.py.
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0)], ids=["T1"])
def test_sampled_law_with_suffix_chains_and_trees_matches_target(
        params: SamplingParams) -> None:
    target = tiny_llama(VOCAB, seed=11, logit_scale=0.5)
    with torch.inference_mode():
        law = target_law(target, LAW_PROMPT, params, LENGTH)
    samples, suffix_tokens, alternatives = sampled_outputs(SuffixProposer, params)
    assert suffix_tokens > SAMPLES and alternatives > SAMPLES // 2  # chains and trees ran
    assert chi_square_pvalue(samples, law) > 1e-3


def test_a_wrong_suffix_q_is_rejected_by_the_same_test() -> None:
    params = SamplingParams(temperature=1.0)
    target = tiny_llama(VOCAB, seed=11, logit_scale=0.5)
    with torch.inference_mode():
        law = target_law(target, LAW_PROMPT, params, LENGTH)
    samples, _, _ = sampled_outputs(UniformQSuffix, params)
    assert chi_square_pvalue(samples, law) < 1e-6


class _SharedForwardPolicy:
    """A costed, load-aware policy whose costs are not known yet."""

    model_free = True

    def __init__(self, shared: bool) -> None:
        self.shared = shared

    def next_length(self) -> int:
        return 2

    def value(self, k: int) -> float | None:
        return None

    def undrafted_value(self, k: int, expected_tokens: float) -> float | None:
        return None

    def observe_undrafted(self, proposal: Proposal, verification: Verification) -> None:
        pass  # the costs stay unknown

    def next_alternatives(self, limit: int) -> int:
        return 0 if self.shared else limit

    def shares_forward(self) -> bool:
        return self.shared


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared-forward"])
def test_a_suffix_tree_is_verified_as_a_chain_when_others_share_the_forward(
        shared: bool) -> None:
    from specdec.core.offers import suffix_offer
    from specdec.core.suffix_proposer import SuffixEvidence

    draft = SuffixDraft(tokens=(5, 6, 7, 8), parents=(-1, 0, -1, 1),
                        probs=(0.9, 0.8, 0.1, 0.7), match_length=3)
    offer = suffix_offer(draft, SuffixProposer(16, 8), SuffixEvidence(),
                          _SharedForwardPolicy(shared), 2, SamplingParams())
    assert offer is not None
    proposal = offer.proposal
    assert proposal.source == SUFFIX and proposal.tokens == [5, 6, 8]
    alternatives = proposal.alternatives
    assert (alternatives is None or not alternatives.tokens) == shared
