"""Suffix decoding's data: counted suffix trees, drafts as token trees, the bounded and
per-tenant global cache, and the exact rule for deterministic siblings."""

from __future__ import annotations

import pytest
import torch
from exact_law import chi_square_pvalue

from specdec.core.acceptance import SharedCalibration
from specdec.core.history import TokenHistory
from specdec.core.sampling import SamplingParams
from specdec.core.stats import SUFFIX
from specdec.core.suffix_cache import (
    NODE_BYTES,
    ROOT,
    SuffixCache,
    SuffixDraft,
    SuffixTree,
    speculate,
)
from specdec.core.suffix_proposer import (
    SuffixEvidence,
    SuffixProposer,
    draft_to_proposal,
    matched_depth,
)
from specdec.core.tree_acceptance import verify_tree


def walk(tree: SuffixTree, path: list[int]) -> int:
    node = ROOT
    for token in path:
        child = tree.child(node, token)
        assert child is not None, path
        node = child
    return tree.count(node)


def test_a_tree_counts_every_short_substring() -> None:
    tree = SuffixTree(max_depth=3)
    tree.add([1, 2, 3, 1, 2, 4])
    assert walk(tree, [1, 2]) == 2 and walk(tree, [1, 2, 3]) == 1 and walk(tree, [1, 2, 4]) == 1
    assert walk(tree, [2]) == 2 and walk(tree, [3, 1, 2]) == 1
    with pytest.raises(AssertionError):
        walk(tree, [2, 3, 1, 2])  # longer than max_depth
    # Distinct substrings of length <= 3: 1,2,3,4; 12,23,31,24; 123,231,312,124.
    assert tree.nodes == 12 and tree.bytes == 12 * NODE_BYTES


def test_incremental_appends_equal_one_add_and_remove_undoes_it() -> None:
    whole, grown = SuffixTree(4), SuffixTree(4)
    tokens = [5, 1, 5, 1, 5, 2, 7, 5, 1]
    whole.add(tokens)
    open_paths: list = []
    for token in tokens:
        open_paths = grown.append(open_paths, token)
    assert whole.nodes == grown.nodes
    for start in range(len(tokens)):
        for end in range(start + 1, min(len(tokens), start + 4) + 1):
            assert walk(whole, tokens[start:end]) == walk(grown, tokens[start:end])
    whole.add([9, 9, 1])
    whole.remove(tokens)
    assert whole.nodes == 5 and walk(whole, [9, 9, 1]) == 1 and walk(whole, [9]) == 2
    whole.remove([9, 9, 1])
    assert whole.nodes == 0 and list(whole.children(ROOT)) == []
    whole.add(tokens)  # freed ids are reused
    assert whole.nodes == grown.nodes and walk(whole, [5, 1, 5]) == 2


def test_the_tree_is_invisible_to_the_garbage_collector() -> None:
    """No Python object per node: a full collection never walks a cached tree."""
    import gc

    tree = SuffixTree(8)
    tree.add([1, 2])
    before = len(gc.get_objects())
    tree.add(list(range(300)) * 2)
    assert tree.nodes > 1000
    assert not gc.is_tracked(tree._edges)
    assert len(gc.get_objects()) - before < 50


def test_speculation_follows_frequencies_best_first() -> None:
    tree = SuffixTree(8)
    tree.add([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5])
    draft = speculate(tree, [7, 1, 2], max_tokens=8, depth_limit=8, max_spec_factor=4.0,
                      min_token_prob=0.2)
    assert draft is not None and draft.match_length == 2
    # After (1, 2): 3 always; then 4 twice in three, 5 once.
    assert draft.tokens[:2] == (3, 4) and draft.probs[:2] == pytest.approx((1.0, 2 / 3))
    nodes = list(zip(draft.tokens, draft.parents, draft.probs, strict=True))
    assert (5, 0, pytest.approx(1 / 3)) in nodes
    assert list(draft.probs) == sorted(draft.probs, reverse=True)  # best first
    assert all(draft.parents[i] < i for i in range(len(draft)))
    capped = speculate(tree, [7, 1, 2], 8, 8, max_spec_factor=2.0, min_token_prob=0.2)
    assert capped is not None and len(capped) == 4  # 2 tokens per matched token
    floor = speculate(tree, [7, 1, 2], 8, 8, 2.0, min_token_prob=0.5)
    assert floor is not None and 5 not in floor.tokens
    short = speculate(tree, [7, 1, 2], 8, depth_limit=1, max_spec_factor=2.0,
                      min_token_prob=0.1)
    assert short is not None and short.tokens == (3,)  # no node deeper than 1
    assert speculate(tree, [8, 9], 8, 8) is None


def test_a_draft_becomes_a_chain_and_alternatives_with_one_hot_q() -> None:
    tree = SuffixTree(8)
    tree.add([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 6])
    draft = speculate(tree, [1, 2], 10, 8, 5.0, 0.2)
    assert draft is not None
    proposal = draft_to_proposal(draft, 10, SamplingParams(temperature=1.0, seed=0))
    assert proposal.source == SUFFIX and proposal.tokens == [3, 4, 1, 2, 3, 4]
    # The chain follows each node's most frequent child; the rest hang where they occur.
    alternatives = proposal.alternatives
    assert (6, -1) in zip(alternatives.tokens, alternatives.parents, strict=True)
    assert (5, 0) in zip(alternatives.tokens, alternatives.parents, strict=True)
    alternatives.check(len(proposal.tokens))
    rows = alternatives.q_nodes(len(proposal.tokens))
    assert proposal.probs is not None and proposal.probs.shape == (len(rows), 10)
    assert torch.equal(proposal.probs.sum(dim=1), torch.ones(len(rows)))
    assert int(proposal.probs[0].argmax()) == 3  # the root's row: its first child, the chain's
    greedy = draft_to_proposal(draft, 10, SamplingParams())
    assert greedy.probs is None and greedy.tokens == proposal.tokens


def test_the_request_tree_proposes_from_its_own_prompt() -> None:
    proposer = SuffixProposer(vocab_size=16, max_tokens=4, max_spec_factor=4.0)
    found = proposer.propose(TokenHistory([3, 1, 4, 1, 5, 9, 2, 3, 1, 4]), 8, SamplingParams())
    assert found is not None and found.tokens[:2] == [1, 5]
    assert proposer.propose(TokenHistory([1, 2, 3]), 8, SamplingParams()) is None
    assert proposer.propose(TokenHistory([3, 1, 4, 3, 1]), 0, SamplingParams()) is None


def test_the_request_tree_follows_its_history_and_starts_afresh_on_another() -> None:
    """Rounds index only what was committed since; a history that no longer extends the
    indexed one (same length, other tokens) is indexed from the start, so drafts equal
    a fresh proposer's either way."""
    def fresh() -> SuffixProposer:
        return SuffixProposer(vocab_size=16, max_tokens=4, max_spec_factor=4.0)

    kept, history = fresh(), TokenHistory([3, 1, 4, 1, 5])
    for more in ([9, 2, 3], [1, 4], [1, 5, 9]):
        history.extend(more)
        assert kept.draft(history, 8) == fresh().draft(history, 8)
    other = TokenHistory([(token + 7) % 16 for token in history.tokens])
    new = fresh()
    assert new.draft(other, 8) is not None and kept.draft(other, 8) == new.draft(other, 8)
    assert kept.tree.nodes == new.tree.nodes  # nothing of the first history is left


def test_a_long_prompt_is_indexed_from_its_latest_tokens() -> None:
    """With prompt_tokens = 10 the request tree holds what a tree of the last 10 tokens
    holds, and drafts as it does, also as the output grows."""
    prompt = [(7 * i) % 13 for i in range(40)]
    windowed = SuffixProposer(16, 4, max_spec_factor=4.0, prompt_tokens=10)
    history, recent = TokenHistory(prompt), TokenHistory(prompt[-10:])
    for more in ([], [3, 5], [10, 4, 11]):
        history.extend(more)
        recent.extend(more)
        whole = SuffixProposer(16, 4, max_spec_factor=4.0, prompt_tokens=0)
        assert windowed.draft(history, 8) == whole.draft(recent, 8)
        assert windowed.tree.nodes == whole.tree.nodes
    unlimited = SuffixProposer(16, 4, max_spec_factor=4.0, prompt_tokens=0)
    unlimited.draft(history, 8)
    assert unlimited.tree.nodes > windowed.tree.nodes  # the limit took effect


def test_the_global_cache_evicts_oldest_first_by_count_and_by_memory() -> None:
    cache = SuffixCache(max_depth=4, max_requests=2, max_bytes=1 << 30)
    for response in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        cache.add("t", response)
    usage = cache.usage()
    assert usage.requests == 2 and usage.tenants == 1
    assert cache.speculate("t", [1, 2], 4, 4, 1.0, 0.1) is None  # the oldest went
    assert cache.speculate("t", [7, 8], 4, 4, 1.0, 0.1) is not None
    small = SuffixCache(max_depth=4, max_requests=100, max_bytes=40 * NODE_BYTES)
    for start in range(0, 200, 10):
        small.add("t", list(range(start, start + 10)))
        assert small.usage().bytes <= 40 * NODE_BYTES
    assert small.usage().requests < 20
    assert small.speculate("t", [190, 191], 4, 4, 1.0, 0.1) is not None
    off = SuffixCache(max_requests=0)
    off.add("t", [1, 2, 3])
    assert off.usage().requests == 0 and not off.enabled


def test_one_tenants_responses_never_speculate_for_another() -> None:
    cache = SuffixCache(max_depth=6, max_requests=10)
    cache.add("alice", [10, 11, 12, 13, 14])
    assert cache.speculate("alice", [10, 11], 4, 4, 2.0, 0.1) is not None
    assert cache.speculate("bob", [10, 11], 4, 4, 2.0, 0.1) is None
    alice = SuffixProposer(16, 4, cache, "alice")
    bob = SuffixProposer(16, 4, cache, "bob")
    assert alice.propose(TokenHistory([9, 10, 11]), 4, SamplingParams()) is not None
    assert bob.propose(TokenHistory([9, 10, 11]), 4, SamplingParams()) is None
    bob.finish([10, 11, 15])
    found = bob.propose(TokenHistory([9, 10, 11]), 4, SamplingParams())
    assert found is not None and found.tokens == [15]


def test_evidence_compares_scores_with_what_the_target_kept() -> None:
    tree = SuffixTree(8)
    tree.add([1, 2, 3, 4, 1, 2, 3, 5])
    draft = speculate(tree, [1, 2], 4, 8, 2.0, 0.1)
    assert draft is not None
    assert matched_depth(draft, [3, 5, 0]) == (2, 3)
    assert matched_depth(draft, [7]) == (0, 1)
    evidence = SuffixEvidence(prior=0.5, prior_strength=1.0, decay=1.0)
    evidence.observe(draft, [3, 5, 0])  # scored 1 + 0.5 + 0.5 + 0.5 (all judged), kept 2
    assert evidence.calibration == pytest.approx((0.5 + 2) / (1 + 2.5))
    assert evidence.expected_tokens(draft, 1) == pytest.approx(1 + evidence.calibration)

    def flat(nodes: int, expected: float) -> float:  # every round costs one second
        return expected

    assert evidence.nodes_to_use(draft, flat, None) == (len(draft), None)
    nodes, value = evidence.nodes_to_use(draft, flat, rival=1.0)
    assert nodes == len(draft) and value == pytest.approx(evidence.expected_tokens(draft, nodes))
    assert evidence.nodes_to_use(draft, flat, rival=100.0) == (0, None)


def test_a_new_sessions_suffix_calibration_starts_from_the_deployments() -> None:
    """Sessions of one deployment record into a shared calibration; a new session starts
    from what it measured (here: drafts keep about a third of their score), not from the
    fixed prior, so it declines a draft the prior would have taken."""
    tree = SuffixTree(8)
    tree.add([1, 2, 3, 4, 1, 2, 3, 5])
    draft = speculate(tree, [1, 2], 4, 8, 2.0, 0.1)  # scores 1 + 0.5 + 0.5 + 0.5
    assert draft is not None
    shared = SharedCalibration(min_scored=10.0)
    assert shared.rate() is None
    earlier = SuffixEvidence(shared=shared)
    for index in range(20):  # one round in five keeps 2 of 2.5 scored, the rest 0 of 1
        earlier.observe(draft, [3, 5, 0] if index % 5 == 0 else [7])
    rate = shared.rate()
    assert rate == pytest.approx(2 / 6.5, rel=0.05)
    new = SuffixEvidence(prior=0.8, prior_strength=2.0, shared=shared)
    guess = SuffixEvidence(prior=0.8, prior_strength=2.0)  # no deployment
    assert new.calibration == pytest.approx(rate) and guess.calibration == pytest.approx(0.8)

    def costed(nodes: int, expected: float) -> float:  # a round costs 1 + nodes / 4 s
        return expected / (1 + nodes / 4)

    assert guess.nodes_to_use(draft, costed, rival=1.1)[0] > 0
    assert new.nodes_to_use(draft, costed, rival=1.1) == (0, None)


# -- deterministic siblings: accept x_r with p_r(x_r), else remove x_r -------------------
@pytest.mark.parametrize("siblings", [[2], [2, 0], [2, 0, 3], [1, 3]])
def test_deterministic_siblings_emit_the_target_row(siblings: list[int]) -> None:
    vocab = 12
    p = torch.softmax(torch.linspace(1.0, -1.0, vocab), dim=0)
    q = torch.zeros(1, vocab)
    q[0, siblings[0]] = 1.0  # a deterministic node's row: one-hot at its first child
    # A depth-1 tree: the chain's first token and its siblings as alternatives of the root.
    chain = torch.tensor([siblings[0]])
    flat = torch.full((vocab,), 1 / vocab)
    target = torch.stack([p, flat, *[flat] * (len(siblings) - 1)])
    samples = []
    for seed in range(3000):
        verdict = verify_tree(chain, siblings[1:], [-1] * (len(siblings) - 1), q, target,
                              SamplingParams(temperature=1.0, seed=seed), 7)
        first = (siblings[0] if verdict.accepted_len else
                 siblings[1 + verdict.branch_path[0]] if verdict.branch_path
                 else verdict.next_token)
        samples.append((first,))
    law = {(token,): float(p[token]) for token in range(vocab)}
    assert chi_square_pvalue(samples, law) > 1e-3


def test_a_drawn_node_still_needs_q_for_each_sibling() -> None:
    q = torch.tensor([[0.5, 0.5, 0.0]])
    target = torch.full((3, 3), 1 / 3)
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_tree(torch.tensor([0]), [2], [-1], q, target,
                    SamplingParams(temperature=1.0, seed=1), 0)


def test_a_drafts_chain_is_its_first_path_in_best_first_order() -> None:
    # node 0 and 2 follow the committed text; 1 and 4 follow 0; 3 follows 1
    draft = SuffixDraft(tokens=(5, 6, 7, 8, 9), parents=(-1, 0, -1, 1, 0),
                        probs=(0.9, 0.8, 0.1, 0.7, 0.05), match_length=3)
    chain = draft.chain()
    assert chain == SuffixDraft((5, 6, 8), (-1, 0, 1), (0.9, 0.8, 0.7), 3)
    assert chain.chain() == chain and draft.cut(1).chain() == draft.cut(1)
