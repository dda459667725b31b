"""Confidence-gated drafting: the draft stops early when unsure; output and law unchanged."""

from __future__ import annotations

import pytest
import torch
from exact_law import chi_square_pvalue, target_law
from test_greedy_and_kv import PROMPT, hf_greedy
from tiny_models import tiny_llama

from specdec.core.history import TokenHistory
from specdec.core.loop import GenerateConfig, generate
from specdec.core.sampling import SamplingParams
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.engine.steps import SyncPoint, draft_step


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def test_draft_step_stops_after_the_first_unsure_token() -> None:
    draft = tiny_llama(64, seed=2, layers=1, logit_scale=3.0)
    runner = ModelRunner(draft)
    sync = SyncPoint("s", 0, 0, PROMPT)
    full = draft_step(runner, sync, 6, SamplingParams())
    assert len(full.tokens) == 6
    # The greedy confidences along that path decide where a threshold stops it.
    logits = draft(torch.tensor([PROMPT + full.tokens])).logits[0, len(PROMPT) - 1:].float()
    confidences = torch.softmax(logits, dim=-1).max(dim=-1).values[:6].tolist()
    threshold = sorted(confidences[:5])[2]  # some tokens above it, some below
    stop = next(i for i, c in enumerate(confidences[:5]) if c < threshold)
    gated = draft_step(runner, sync, 6, SamplingParams(), min_confidence=threshold)
    assert gated.tokens == full.tokens[: stop + 1]
    assert runner.kv_length("s") == len(PROMPT) + stop  # the last proposal is never fed
    assert draft_step(runner, sync, 6, SamplingParams(), min_confidence=1.0).tokens == \
        full.tokens[:1]  # at least one token


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9])
def test_gated_greedy_equals_target_greedy(threshold: float) -> None:
    target, draft = tiny_llama(64, seed=1), tiny_llama(64, seed=2, layers=1, logit_scale=3.0)
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT, GenerateConfig(max_new_tokens=40, num_draft_tokens=6,
                                             draft_confidence=threshold))
    assert result.token_ids == hf_greedy(target, PROMPT, 40)
    per_round = result.stats.draft_tokens / result.stats.num_drafts
    assert 1.0 <= per_round < 6.0  # the gate shortened some proposals


def test_gated_sampling_keeps_the_target_law() -> None:
    vocab, prompt, length = 8, [1, 5, 2], 3
    target = tiny_llama(vocab, seed=11, logit_scale=0.5)
    draft = tiny_llama(vocab, seed=12, layers=1, logit_scale=2.0)
    params = SamplingParams(temperature=1.0)
    law = target_law(target, prompt, params, length)
    drafter, verifier = LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target))
    samples, drafted, rounds = [], 0, 0
    for seed in range(2500):
        config = GenerateConfig(max_new_tokens=length, num_draft_tokens=3, draft_confidence=0.35,
                                sampling=SamplingParams(temperature=1.0, seed=seed),
                                session_id=f"s{seed}")
        result = generate(drafter, verifier, prompt, config)
        samples.append(tuple(result.token_ids))
        drafted += result.stats.draft_tokens
        rounds += result.stats.num_drafts
    assert 1.0 < drafted / rounds < 2.0  # proposals of varying length, stopped by the gate
    assert chi_square_pvalue(samples, law) > 1e-3


def test_history_unchanged_by_gate() -> None:
    """A stopped proposal leaves the draft's cache where the mirror expects it."""
    draft = tiny_llama(64, seed=2, layers=1, logit_scale=3.0)
    drafter = LocalDrafter(ModelRunner(draft))
    committed = TokenHistory(PROMPT)
    first = drafter.propose("s", committed, 6, SamplingParams(), min_confidence=0.99)
    committed.extend(first.tokens)
    second = drafter.propose("s", committed, 6, SamplingParams(), min_confidence=0.99)
    assert second.resyncs == 0 and len(second.tokens) >= 1


def test_policies_see_the_requested_length_and_the_shorter_proposal() -> None:
    from specdec.core.interfaces import Proposal, Verification
    from specdec.core.policy import FixedLength

    seen: list[tuple[int, int]] = []

    class Recording(FixedLength):
        def observe(self, asked: int, accepted_len: int, proposal: Proposal | None,
                    verification: Verification) -> None:
            seen.append((asked, len(proposal.tokens) if proposal else 0))

    target, draft = tiny_llama(64, seed=1), tiny_llama(64, seed=2, layers=1, logit_scale=3.0)
    generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)), PROMPT,
             GenerateConfig(max_new_tokens=40, draft_confidence=0.6), policy=Recording(6))
    drafting = [(asked, drafted) for asked, drafted in seen if asked]  # the last may ask 0
    assert all(asked <= 6 and 1 <= drafted <= asked for asked, drafted in drafting)
    # The cap (6, or what is left of max_new_tokens near the end), not what the gate let through.
    assert any(asked == 6 and drafted < 6 for asked, drafted in drafting)


def test_coordinator_applies_the_default_gate_to_adaptive_requests_only() -> None:
    from coordinator.validation import Limits, validate
    from specdec.proto.specdec.v1 import coordinator_pb2

    limits = Limits(64, 256, 100, 16, 4, default_draft_confidence=0.4)

    def gate(**speculation: object) -> float:
        request = coordinator_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=4)
        for name, value in speculation.items():
            setattr(request.speculation, name, value)
        return validate(request, limits, None).draft_confidence

    assert gate() == pytest.approx(0.4)  # no speculation: adaptive, so the default gate
    assert gate(num_draft_tokens=3) == 0.0
    assert gate(num_draft_tokens=3, adaptive=True) == pytest.approx(0.4)
    assert gate(num_draft_tokens=3, adaptive=True, draft_confidence=0.0) == 0.0
    assert gate(num_draft_tokens=3, draft_confidence=0.7) == pytest.approx(0.7)
