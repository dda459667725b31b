"""Alternatives: the draft's next-best tokens verified beside its chain (greedy only)."""

from __future__ import annotations

import pytest
import torch
from test_greedy_and_kv import PROMPT, hf_greedy
from tiny_models import tiny_gpt2, tiny_llama

from specdec.errors import InvalidRequest
from specdec.history import TokenHistory
from specdec.local import LocalDrafter, LocalVerifier
from specdec.loop import GenerateConfig, RoundEvent, generate
from specdec.rejection import Alternatives, verify, verify_greedy
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.steps import alternatives_budget, best_alternatives


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def _rows(choices: list[int], vocab: int = 10) -> torch.Tensor:
    """Logit rows whose argmax is each of choices."""
    rows = torch.zeros(len(choices), vocab)
    rows[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return rows


def test_greedy_verdict_keeps_the_alternative_the_target_chose_at_the_rejected_depth() -> None:
    draft = torch.tensor([4, 5, 6])
    alternatives = Alternatives((7, 8, 9), (1, 2, 2))
    # Chain rows: target keeps 4, then picks 9 at depth 2 (draft said 5); bonus rows after.
    target = _rows([4, 9, 0, 0, 1, 2, 3])  # 3 + 1 chain rows, then one per alternative
    verdict = verify_greedy(draft, target, alternatives)
    assert (verdict.accepted_len, verdict.alternative, verdict.next_token) == (1, 2, 3)
    # An alternative at another depth is not taken, even when it is the target's choice.
    target = _rows([7, 0, 0, 0, 1, 2, 3])
    assert verify_greedy(draft, target, Alternatives((7,), (2,))).alternative == -1
    # No alternative matches: the target's own choice, as without alternatives.
    target = _rows([4, 1, 0, 0, 1, 2, 3])
    verdict = verify_greedy(draft, target, alternatives)
    assert (verdict.accepted_len, verdict.alternative, verdict.next_token) == (1, -1, 1)
    # The whole chain kept: the bonus, alternatives unused.
    target = _rows([4, 5, 6, 2, 7, 8, 9])
    verdict = verify_greedy(draft, target, alternatives)
    assert (verdict.accepted_len, verdict.alternative, verdict.next_token) == (3, -1, 2)


def test_alternatives_are_refused_under_sampling() -> None:
    params = SamplingParams(temperature=1.0, seed=1)
    probs = torch.full((2, 10), 0.1)
    with pytest.raises(ValueError, match="greedy decoding only"):
        verify(torch.tensor([1]), probs[:1], probs, params, 0, Alternatives((2,), (1,)))
    with pytest.raises(ValueError, match="1 alternative tokens but 2 depths"):
        Alternatives((2,), (1, 1))


def test_best_alternatives_rank_by_estimated_chance_and_keep_the_budget() -> None:
    candidates = [(0.05, 1, 11), (0.30, 2, 12), (0.20, 1, 13), (0.01, 3, 14)]
    assert best_alternatives(candidates, 2) == Alternatives((13, 12), (1, 2))
    assert best_alternatives(candidates, 0) == Alternatives()
    assert alternatives_budget(4) == 10 and alternatives_budget(16) == 0


def _alternative_events(target: torch.nn.Module, draft: torch.nn.Module, k: int,
                        alternatives: int, new_tokens: int = 40
                        ) -> tuple[list[int], list[RoundEvent]]:
    events: list[RoundEvent] = []
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT, GenerateConfig(max_new_tokens=new_tokens, num_draft_tokens=k,
                                             num_alternatives=alternatives),
                      on_round=events.append)
    return result.token_ids, events


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize(("num_draft_tokens", "alternatives"), [(1, 3), (3, 2), (5, 6)])
def test_greedy_with_alternatives_equals_target_greedy(make_target, num_draft_tokens: int,
                                                       alternatives: int) -> None:
    target = make_target(64, seed=1)
    # A draft that is the target with noise: often right, often second best.
    draft = make_target(64, seed=1)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    tokens, events = _alternative_events(target, draft, num_draft_tokens, alternatives)
    assert tokens == hf_greedy(target, PROMPT, 40)
    kept = [event for event in events if event.alternative_token is not None]
    assert kept, "no alternative was kept: the path under test never ran"
    for event in kept:  # the kept alternative sits where the chain was rejected
        assert event.proposal is not None
        index = event.accepted_len - 1
        assert event.emitted[index] == event.alternative_token
        assert event.alternative_token in event.proposal.alternatives.tokens
        assert event.proposal.tokens[index] != event.alternative_token


def test_alternatives_leave_no_trace_in_either_cache() -> None:
    target, draft = tiny_llama(64, seed=1), tiny_llama(64, seed=2, layers=1)
    target_runner, draft_runner = ModelRunner(target), ModelRunner(draft)
    drafter, verifier = LocalDrafter(draft_runner), LocalVerifier(target_runner)
    committed = TokenHistory(PROMPT)
    proposal = drafter.propose("s", committed, 3, SamplingParams(), num_alternatives=4)
    assert len(proposal.alternatives) == 4
    assert set(proposal.alternatives.depths) <= {1, 2, 3}
    verification = verifier.verify("s", committed, proposal.tokens, None, SamplingParams(),
                                   proposal.alternatives)
    # The target's cache holds the committed tokens and the chain, not the alternatives.
    assert target_runner._sessions["s"].history.tokens == PROMPT + proposal.tokens
    cache_length = target_runner._sessions["s"].cache.get_seq_length()  # type: ignore[union-attr]
    assert cache_length == len(PROMPT) + len(proposal.tokens)
    assert verification.accepted_tokens <= len(proposal.tokens)


def test_drafter_and_runner_refuse_bad_alternatives() -> None:
    runner = ModelRunner(tiny_llama(64, seed=1))
    with pytest.raises(InvalidRequest, match="greedy decoding only"):
        LocalDrafter(runner).propose("s", TokenHistory(PROMPT), 2,
                                     SamplingParams(temperature=1.0, seed=1), num_alternatives=2)
    with pytest.raises(InvalidRequest, match="must lie in"):
        LocalVerifier(runner).verify("s", TokenHistory(PROMPT), [5], None, SamplingParams(),
                                     Alternatives((6,), (2,)))
    with pytest.raises(InvalidRequest, match="branch positions"):
        runner.extend("t", 0, 0, [1, 2, 3], num_logits=1, branch_positions=[0])
