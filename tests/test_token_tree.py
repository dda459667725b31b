"""Token trees: the draft's alternatives beside its chain, verified in one forward."""

from __future__ import annotations

import pytest
import torch
from test_greedy_and_kv import PROMPT, hf_greedy
from tiny_models import tiny_gpt2, tiny_llama

from specdec.core.history import TokenHistory
from specdec.core.loop import GenerateConfig, RoundEvent, generate
from specdec.core.sampling import SamplingParams
from specdec.core.tree_acceptance import Alternatives, verify
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.engine.steps import alternatives_budget
from specdec.errors import InvalidRequest


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def _rows(choices: list[int], vocab: int = 10) -> torch.Tensor:
    """Logit rows whose argmax is each of choices."""
    rows = torch.zeros(len(choices), vocab)
    rows[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return rows


def test_tree_bookkeeping() -> None:
    # Chain of 3 (nodes 0-2); alternative 0 (node 3) beside chain token 0, alternative 1
    # (node 4) after alternative 0, alternative 2 (node 5) beside chain token 2.
    tree = Alternatives((7, 8, 9), (-1, 3, 1))
    assert tree.depths(3) == (1, 2, 3)
    assert tree.children(-1, 3) == [0, 3] and tree.children(3, 3) == [4]
    assert tree.children(2, 3) == [] and tree.children(1, 3) == [2, 5]
    assert tree.q_nodes(3) == [-1, 0, 1, 3]
    assert tree.kept_ranks(3, 0, (0, 1)) == [1, 0]
    assert tree.kept_ranks(3, 2, (2,)) == [0, 0, 1]
    with pytest.raises(ValueError, match="outside"):
        Alternatives((7,), (3,)).check(3)
    with pytest.raises(ValueError, match="1 alternative tokens but 2 parents"):
        Alternatives((2,), (1, 1))


def test_greedy_walk_follows_the_targets_choice_through_the_tree() -> None:
    draft = torch.tensor([4, 5, 6])
    tree = Alternatives((7, 8, 9), (-1, 3, 1))
    greedy = SamplingParams()
    # Rows: root, chain 0-2, then alternatives 0-2. The target picks 7 (alternative 0),
    # then 8 (its child), then 2.
    target = _rows([7, 0, 0, 0, 8, 2, 0])
    verdict = verify(draft, None, target, greedy, 0, tree)
    assert (verdict.accepted_len, verdict.branch_path, verdict.next_token) == (0, (0, 1), 2)
    # The chain kept to token 1, then alternative 2 beside chain token 2, then its row.
    target = _rows([4, 5, 9, 0, 0, 0, 3])
    verdict = verify(draft, None, target, greedy, 0, tree)
    assert (verdict.accepted_len, verdict.branch_path, verdict.next_token) == (2, (2,), 3)
    # No node matches: the target's own choice, as for a chain.
    target = _rows([1, 0, 0, 0, 0, 0, 0])
    verdict = verify(draft, None, target, greedy, 0, tree)
    assert (verdict.accepted_len, verdict.branch_path, verdict.next_token) == (0, (), 1)
    # The whole chain kept: the bonus.
    target = _rows([4, 5, 6, 2, 0, 0, 0])
    verdict = verify(draft, None, target, greedy, 0, tree)
    assert (verdict.accepted_len, verdict.branch_path, verdict.next_token) == (3, (), 2)
    assert alternatives_budget(4) == 10 and alternatives_budget(16) == 0


def _tree_events(target: torch.nn.Module, draft: torch.nn.Module, k: int, alternatives: int,
                 params: SamplingParams | None = None, new_tokens: int = 40,
                 max_alternative_depth: int = 0
                 ) -> tuple[list[int], list[RoundEvent], ModelRunner, ModelRunner]:
    events: list[RoundEvent] = []
    draft_runner, target_runner = ModelRunner(draft), ModelRunner(target)
    result = generate(LocalDrafter(draft_runner), LocalVerifier(target_runner), PROMPT,
                      GenerateConfig(max_new_tokens=new_tokens, num_draft_tokens=k,
                                     num_alternatives=alternatives,
                                     max_alternative_depth=max_alternative_depth,
                                     sampling=params or SamplingParams(), session_id="s"),
                      on_round=events.append)
    return result.token_ids, events, draft_runner, target_runner


def _noisy(make_target, seed: int = 1) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A target, and a draft that is the target with noise: often right, often second."""
    target = make_target(64, seed=seed)
    draft = make_target(64, seed=seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return target, draft


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize(("num_draft_tokens", "alternatives"), [(1, 3), (3, 2), (5, 8)])
def test_greedy_with_trees_equals_target_greedy(make_target, num_draft_tokens: int,
                                                alternatives: int) -> None:
    target, draft = _noisy(make_target)
    tokens, events, _, _ = _tree_events(target, draft, num_draft_tokens, alternatives)
    assert tokens == hf_greedy(target, PROMPT, 40)
    kept = [event for event in events if event.kept_branches]
    assert kept, "no alternative was kept: the path under test never ran"
    for event in kept:  # the kept path's tokens are the alternatives', in order
        assert event.proposal is not None
        tree = event.proposal.alternatives
        chain_kept = event.accepted_len - len(event.kept_branches)
        assert event.emitted[chain_kept:event.accepted_len] == [
            tree.tokens[index] for index in event.kept_branches]
        assert tree.kept_ranks(len(event.proposal.tokens), chain_kept,
                               event.kept_branches)[chain_kept] > 0


def test_trees_go_deeper_than_one_level_and_paths_through_them_are_kept() -> None:
    target, draft = _noisy(tiny_llama, seed=3)
    tokens, events, _, _ = _tree_events(target, draft, 4, 8, new_tokens=60)
    assert tokens == hf_greedy(target, PROMPT, 60)
    deep = [event for event in events if event.proposal is not None
            and max(event.proposal.alternatives.depths(len(event.proposal.tokens)),
                    default=0) >= 2
            and any(parent >= len(event.proposal.tokens)
                    for parent in event.proposal.alternatives.parents)]
    assert deep, "no alternative ever had children of its own"
    assert any(len(event.kept_branches) >= 2 for event in events), \
        "no accepted path ran through two alternatives"


def test_alternatives_one_level_deep_all_follow_chain_tokens() -> None:
    """max_alternative_depth 1: the same prompt and draft as the deep-tree test above, and
    every alternative's parent is a chain node; the output is still the target's."""
    target, draft = _noisy(tiny_llama, seed=3)
    tokens, events, _, _ = _tree_events(target, draft, 4, 8, new_tokens=60,
                                        max_alternative_depth=1)
    assert tokens == hf_greedy(target, PROMPT, 60)
    trees = [event.proposal for event in events
             if event.proposal is not None and event.proposal.alternatives]
    assert trees and sum(len(tree.alternatives) for tree in trees) > len(trees)
    for tree in trees:
        assert all(parent < len(tree.tokens) for parent in tree.alternatives.parents)
    assert any(event.kept_branches for event in events)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)],
                         ids=["greedy", "sampled"])
def test_trees_leave_no_trace_in_either_cache(params: SamplingParams) -> None:
    target, draft = tiny_llama(64, seed=1), tiny_llama(64, seed=2, layers=1)
    target_runner, draft_runner = ModelRunner(target), ModelRunner(draft)
    drafter, verifier = LocalDrafter(draft_runner), LocalVerifier(target_runner)
    committed = TokenHistory(PROMPT)
    proposal = drafter.propose("s", committed, 3, params.with_seed(), num_alternatives=6)
    assert proposal.alternatives, "the draft proposed no tree"
    # The draft keeps the committed tokens and the chain it fed, not the tree's nodes.
    assert draft_runner._sessions["s"].history.tokens == PROMPT + proposal.tokens[:-1]
    draft_cache = draft_runner._sessions["s"].cache.get_seq_length()  # type: ignore[union-attr]
    assert draft_cache == len(PROMPT) + len(proposal.tokens) - 1
    if not params.greedy:
        assert proposal.probs is not None
        assert proposal.probs.shape[0] == len(proposal.alternatives.q_nodes(3))
    verification = verifier.verify("s", committed, proposal.tokens, proposal.probs,
                                   params.with_seed(), proposal.alternatives)
    # The target's cache holds the committed tokens and the chain, not the alternatives.
    assert target_runner._sessions["s"].history.tokens == PROMPT + proposal.tokens
    cache_length = target_runner._sessions["s"].cache.get_seq_length()  # type: ignore[union-attr]
    assert cache_length == len(PROMPT) + len(proposal.tokens)
    assert verification.accepted_tokens <= len(proposal.tokens)


def test_sampled_trees_keep_alternatives_and_reproduce_with_the_seed() -> None:
    target, draft = _noisy(tiny_llama)
    params = SamplingParams(temperature=1.0, seed=7)
    first, events, _, _ = _tree_events(target, draft, 3, 6, params)
    again, _, _, _ = _tree_events(target, draft, 3, 6, params)
    assert first == again
    assert any(event.kept_branches for event in events), "no sampled alternative was kept"


def test_verifier_and_runner_refuse_bad_trees() -> None:
    runner = ModelRunner(tiny_llama(64, seed=1))
    with pytest.raises(InvalidRequest, match="outside"):
        LocalVerifier(runner).verify("s", TokenHistory(PROMPT), [5], None, SamplingParams(),
                                     Alternatives((6,), (1,)))
    q = torch.full((1, 64), 1 / 64)
    with pytest.raises(InvalidRequest, match="rows"):  # node 1 has a child but no q row
        LocalVerifier(runner).verify("s", TokenHistory(PROMPT), [5], q,
                                     SamplingParams(temperature=1.0, seed=1),
                                     Alternatives((6, 7), (-1, 1)))
    with pytest.raises(InvalidRequest, match="branch parents"):
        runner.extend("t", 0, 0, [1, 2, 3], num_logits=1, branch_parents=[2])


def test_round_spans_report_the_tree_and_the_kept_ranks() -> None:
    from specdec.core.interfaces import Proposal
    from specdec.telemetry import names as n
    from specdec.telemetry.round_tracer import rejection_attributes, round_attributes

    # Chain 4, 5, 6; alternative 0 beside chain token 0, alternative 1 under it. The target
    # kept alternative 0, then alternative 1, then emitted its own 9.
    tree = Alternatives((7, 8), (-1, 3))
    proposal = Proposal([4, 5, 6], None, 0.01, alternatives=tree)
    event = RoundEvent(0, 10, 13, 3, proposal, 2, [7, 8, 9], False, 0.05, 0.04, 0, False,
                       kept_branches=(0, 1))
    attributes = round_attributes(event, record_tokens=False)
    assert attributes[n.TREE_DEPTH] == 3 and attributes[n.ALTERNATIVES] == 2
    assert attributes[n.ACCEPTED] == 2 and attributes[n.ALTERNATIVE_KEPT] is True
    assert list(attributes[n.KEPT_RANKS]) == [1, 0]  # type: ignore[arg-type]
    rejection = rejection_attributes(event, record_tokens=False)
    assert rejection is not None and rejection[n.REJECT_DRAFT_INDEX] == 0
