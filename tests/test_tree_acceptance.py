"""Exactness of token-tree acceptance (specdec/core/tree_acceptance.py).

Analytic: the one-node law of recursive rejection sampling without replacement, enumerated
over every ordered sibling draw, equals the target row; the implementation's acceptance
thresholds and residuals equal the enumeration's (forced uniforms). Empirical: the joint
law of the first two tokens a depth-2 tree emits, drafted with draw_siblings from a toy
two-step model, fits the target's enumerated law by chi-square, and two plausible wrong
rules are rejected by the same test. Greedy trees emit the target's greedy text; a chain
(no branches) verifies bit for bit as specdec.core.rejection does.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from exact_law import chi_square_pvalue

from specdec.core import tree_acceptance
from specdec.core.rejection import verify_greedy, verify_stochastic
from specdec.core.sampling import Purpose, SamplingParams, draw, process_logits, uniforms
from specdec.core.tree_acceptance import TreeVerdict, draw_siblings, verify_tree

# A node's children, in rank order, keyed by the node's token path from the root (() is
# the root). Sibling tokens are distinct, so a token path names one node.
Children = dict[tuple[int, ...], list[int]]
Row = Callable[[tuple[int, ...]], torch.Tensor]


def random_dist(vocab: int, generator: torch.Generator, zeros: int = 0) -> torch.Tensor:
    weights = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 2 + 0.02
    if zeros:
        weights[torch.randperm(vocab, generator=generator)[:zeros]] = 0
    return weights / weights.sum()


@dataclass(frozen=True)
class FlatTree:
    """A tree in verify_tree's numbering, with each node's token path (index: node id + 1)."""

    draft_tokens: torch.Tensor
    branch_tokens: list[int]
    branch_parents: list[int]
    paths: list[tuple[int, ...]]

    @property
    def num_chain(self) -> int:
        return int(self.draft_tokens.shape[0])

    def kept_path(self, verdict: TreeVerdict) -> tuple[int, ...]:
        """The token path of the last kept node (() when nothing is kept)."""
        if verdict.branch_path:
            return self.paths[self.num_chain + verdict.branch_path[-1] + 1]
        return self.paths[verdict.accepted_len]


def flatten(children: Children) -> FlatTree:
    """Chain: rank-0 children from the root. Branches: the other nodes in depth-first
    preorder, visiting children in rank order, so parents precede children and a node's
    branch children keep their rank order."""
    chain: list[tuple[int, ...]] = []
    while children.get(chain[-1] if chain else ()):
        parent = chain[-1] if chain else ()
        chain.append(parent + (children[parent][0],))
    node_id = {(): -1} | {path: j for j, path in enumerate(chain)}
    branch_tokens: list[int] = []
    branch_parents: list[int] = []
    branch_paths: list[tuple[int, ...]] = []

    def visit(path: tuple[int, ...]) -> None:
        for token in children.get(path, []):
            child = path + (token,)
            if child not in node_id:
                node_id[child] = len(chain) + len(branch_tokens)
                branch_tokens.append(token)
                branch_parents.append(node_id[path])
                branch_paths.append(child)
            visit(child)

    visit(())
    return FlatTree(torch.tensor([path[-1] for path in chain], dtype=torch.int64),
                    branch_tokens, branch_parents, [()] + chain + branch_paths)


def verify_flat(tree: FlatTree, children: Children, target_row: Row, draft_row: Row,
                params: SamplingParams, first_position: int) -> TreeVerdict:
    target_probs = torch.stack([target_row(path) for path in tree.paths])
    with_children = [path for path in tree.paths if children.get(path)]
    draft_probs = (torch.stack([draft_row(path) for path in with_children])
                   if with_children else None)
    return verify_tree(tree.draft_tokens, tree.branch_tokens, tree.branch_parents,
                       draft_probs, target_probs, params, first_position)


# ---------------------------------------------------------------- the one-node law


def reference_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    diff = torch.clamp(p - q, min=0.0)
    return diff / diff.sum() if float(diff.sum()) > 0 else p


def without(q: torch.Tensor, removed: Sequence[int]) -> torch.Tensor | None:
    """q with the removed tokens zeroed and renormalised; None when no mass is left."""
    rest = q.clone()
    rest[list(removed)] = 0.0
    return rest / rest.sum() if float(rest.sum()) > 0 else None


def node_law(p: torch.Tensor, q: torch.Tensor, siblings: int,
             removed: tuple[int, ...] = ()) -> torch.Tensor:
    """The exact law a node emits with `siblings` more children drawn without replacement
    from q (minus the removed ones): enumerate every next draw x with its probability
    q_r(x), accept it with min(1, p(x)/q_r(x)), otherwise recurse on the residual."""
    q_r = without(q, removed) if siblings else None
    if q_r is None:
        return p  # no more children: the target draws from the current p
    law = torch.zeros_like(p)
    for x in torch.nonzero(q_r).flatten().tolist():
        accept = min(1.0, float(p[x] / q_r[x]))
        law[x] += q_r[x] * accept
        if accept < 1.0:
            law += q_r[x] * (1 - accept) * node_law(reference_residual(p, q_r), q, siblings - 1,
                                                    removed + (x,))
    return law


V = 6
ONE_NODE_CASES: dict[str, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]] = {
    "random": lambda g: (random_dist(V, g), random_dist(V, g)),
    "zeros_in_q": lambda g: (random_dist(V, g), random_dist(V, g, zeros=2)),
    "zeros_in_p": lambda g: (random_dist(V, g, zeros=2), random_dist(V, g)),
    "zeros_in_both": lambda g: (random_dist(V, g, zeros=2), random_dist(V, g, zeros=3)),
    "equal": lambda g: (lambda d: (d, d.clone()))(random_dist(V, g, zeros=1)),
    "disjoint": lambda g: (torch.tensor([0.5, 0.3, 0.2, 0, 0, 0], dtype=torch.float64),
                           torch.tensor([0, 0, 0, 0.6, 0.3, 0.1], dtype=torch.float64)),
    "one_hot_q": lambda g: (random_dist(V, g),
                            torch.nn.functional.one_hot(torch.tensor(2), V).double()),
    "two_token_q": lambda g: (random_dist(V, g, zeros=1),
                              torch.tensor([0, 0.7, 0, 0.3, 0, 0], dtype=torch.float64)),
}


@pytest.mark.parametrize("siblings", [1, 2, 3])
@pytest.mark.parametrize("case", sorted(ONE_NODE_CASES))
def test_one_node_law_without_replacement_equals_the_target_row(case: str,
                                                                siblings: int) -> None:
    generator = torch.Generator().manual_seed(100 * siblings + len(case))
    for _ in range(10):
        p, q = ONE_NODE_CASES[case](generator)
        law = node_law(p, q, siblings)
        assert torch.allclose(law, p, atol=1e-9), (case, siblings, law, p)


def test_one_node_law_detects_the_wrong_rules() -> None:
    """The identity has power: testing siblings against q (the with-replacement rule) or
    against the original p instead of the residual gives another law."""

    def wrong_law(p: torch.Tensor, q: torch.Tensor, siblings: int, removed: tuple[int, ...],
                  use_q_r: bool, update_p: bool, original_p: torch.Tensor) -> torch.Tensor:
        q_r = without(q, removed) if siblings else None
        if q_r is None:
            return p
        tested = q_r if use_q_r else q
        law = torch.zeros_like(p)
        for x in torch.nonzero(q_r).flatten().tolist():
            accept = min(1.0, float(p[x] / tested[x])) if tested[x] > 0 else 1.0
            law[x] += q_r[x] * accept
            nxt = reference_residual(p, tested) if update_p else original_p
            law += q_r[x] * (1 - accept) * wrong_law(nxt, q, siblings - 1, removed + (x,),
                                                     use_q_r, update_p, original_p)
        return law

    generator = torch.Generator().manual_seed(3)
    p, q = random_dist(V, generator), random_dist(V, generator)
    against_q = wrong_law(p, q, 3, (), use_q_r=False, update_p=True, original_p=p)
    no_update = wrong_law(p, q, 3, (), use_q_r=True, update_p=False, original_p=p)
    assert (against_q - p).abs().sum() > 1e-3
    assert (no_update - p).abs().sum() > 1e-3


@dataclass
class ForcedStreams:
    """Stands in for the module's uniforms and draw: the ACCEPT coin of each rank is set by
    the test, and every EMIT draw records the row it was asked to draw from."""

    accept: dict[int, float]
    emitted: list[tuple[int, torch.Tensor]]

    def uniforms(self, seed: int, positions: range | list[int], purpose: Purpose, *,
                 rank: int = 0) -> torch.Tensor:
        assert purpose == Purpose.ACCEPT
        return torch.tensor([self.accept[rank]] * len(positions), dtype=torch.float64)

    def draw(self, probs: torch.Tensor, params: SamplingParams, first_position: int,
             purpose: Purpose) -> torch.Tensor:
        assert purpose == Purpose.EMIT and probs.shape[0] == 1
        self.emitted.append((first_position, probs[0].double().clone()))
        return probs.argmax(dim=-1)


@pytest.mark.parametrize("case", sorted(ONE_NODE_CASES))
def test_the_implementation_tests_each_sibling_as_the_enumeration_does(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """For every ordered draw of three siblings, verify_tree accepts rank t exactly when its
    coin is below the enumeration's min(1, p_t(x)/q_t(x)) (checked 1e-9 either side), and
    when all are rejected it draws from the enumeration's last residual. With the
    one-node identity above, that makes the implementation's node law the target row."""
    generator = torch.Generator().manual_seed(len(case))
    p, q = ONE_NODE_CASES[case](generator)
    leaf_row = torch.full((V,), 1.0 / V, dtype=torch.float64)
    params = SamplingParams(temperature=1.0, seed=0)
    first_position = 5
    margin = 1e-9
    checked = 0
    for order in itertools.permutations(range(V), min(3, int((q > 0).sum()))):
        # The enumeration's coins and residuals along this draw.
        current, thresholds, residuals, drawable = p, [], [], True
        for rank, x in enumerate(order):
            q_r = without(q, order[:rank])
            if q_r is None or q_r[x] == 0:
                drawable = False
                break
            thresholds.append(min(1.0, float(current[x] / q_r[x])))
            current = reference_residual(current, q_r)
            residuals.append(current)
        if not drawable:
            continue
        tree = flatten({(): list(order)})
        target_probs = torch.stack([p] + [leaf_row] * len(order))
        for accepted_rank in [*range(len(order)), None]:
            last = len(order) if accepted_rank is None else accepted_rank
            if any(thresholds[s] + margin >= 1.0 for s in range(last)):
                continue  # rank s is always accepted: this outcome has probability 0
            if accepted_rank is not None and thresholds[accepted_rank] <= margin:
                continue  # rank t is never accepted
            streams = ForcedStreams({s: thresholds[s] + margin for s in range(last)}, [])
            if accepted_rank is not None:
                streams.accept[accepted_rank] = thresholds[accepted_rank] - margin
            monkeypatch.setattr(tree_acceptance, "uniforms", streams.uniforms)
            monkeypatch.setattr(tree_acceptance, "draw", streams.draw)
            verdict = verify_tree(tree.draft_tokens, tree.branch_tokens, tree.branch_parents,
                                  q[None], target_probs, params, first_position)
            kept = tree.kept_path(verdict)
            if accepted_rank is None:
                assert kept == ()
                (position, row), = streams.emitted
                assert position == first_position
                assert torch.allclose(row, residuals[-1], atol=1e-9), (order, row)
            else:
                assert kept == (order[accepted_rank],)
                assert [position for position, _ in streams.emitted] == [first_position + 1]
            checked += 1
    assert checked > 0


# ---------------------------------------------------------------- chi-square, depth 2


@dataclass(frozen=True)
class ToyModel:
    """A two-step model as tables: p(x1), p(x2 | x1) for the target, q likewise for the
    draft. Rows past depth 1 (only the bonus after a depth-2 node reads them) reuse
    p(. | last token)."""

    p1: torch.Tensor
    p2: torch.Tensor  # [V, V]: row x1 is p(x2 | x1)
    q1: torch.Tensor
    q2: torch.Tensor

    def target_row(self, path: tuple[int, ...]) -> torch.Tensor:
        return self.p1 if not path else self.p2[path[-1]]

    def draft_row(self, path: tuple[int, ...]) -> torch.Tensor:
        return self.q1 if not path else self.q2[path[-1]]

    def joint_law(self) -> dict[tuple[int, ...], float]:
        return {(a, b): float(self.p1[a] * self.p2[a, b])
                for a in range(len(self.p1)) for b in range(len(self.p1))}


def toy_model(seed: int, target_zeros: int = 0, draft_zeros: int = 0,
              draft_closeness: float = 0.0) -> ToyModel:
    """Random tables over V tokens; draft rows mix in draft_closeness of the target row
    (then zero their own draft_zeros tokens), so acceptance is frequent when it is high."""
    generator = torch.Generator().manual_seed(seed)

    def rows(count: int, zeros: int) -> torch.Tensor:
        return torch.stack([random_dist(V, generator, zeros) for _ in range(count)])

    p = rows(V + 1, target_zeros)
    q = draft_closeness * p + (1 - draft_closeness) * rows(V + 1, 0)
    if draft_zeros:
        for row in q:
            row[torch.randperm(V, generator=generator)[:draft_zeros]] = 0
    q = q / q.sum(dim=-1, keepdim=True)
    return ToyModel(p[0], p[1:], q[0].float(), q[1:].float())


# Tree shapes, fixed in advance: children at the root, then children under each root child
# by rank. Which one a trial uses depends on the trial index only.
SHAPES = ((3, (2, 1, 0)), (2, (1, 2)), (3, (0, 2, 1)))
FIRST_POSITION = 11


def draft_tree(model: ToyModel, params: SamplingParams, shape: tuple[int, Sequence[int]]
               ) -> Children:
    at_root, below = shape
    children: Children = {(): draw_siblings(model.q1, params, FIRST_POSITION, at_root)}
    for rank, token in enumerate(children[()]):
        if below[rank]:
            children[(token,)] = draw_siblings(model.q2[token], params, FIRST_POSITION + 1,
                                               below[rank])
    return children


def first_two_tokens(model: ToyModel, trials: int
                     ) -> tuple[list[tuple[int, ...]], Counter[tuple[int, int]]]:
    """The first two tokens of each trial: the kept path, then the next token; a second
    token the round did not emit is drawn from the exact p(x2 | x1). Also counts which kind
    of node was kept, to show the branches are exercised."""
    second_draws = torch.Generator().manual_seed(12345)
    samples: list[tuple[int, ...]] = []
    kinds: Counter[tuple[int, int]] = Counter()
    for trial in range(trials):
        params = SamplingParams(temperature=1.0, seed=trial)
        children = draft_tree(model, params, SHAPES[trial % len(SHAPES)])
        tree = flatten(children)
        verdict = verify_flat(tree, children, model.target_row, model.draft_row, params,
                              FIRST_POSITION)
        tokens = tree.kept_path(verdict) + (verdict.next_token,)
        if len(tokens) == 1:
            tokens += (int(torch.multinomial(model.p2[tokens[0]], 1,
                                             generator=second_draws)),)
        samples.append(tokens[:2])
        kinds[(verdict.accepted_len, len(verdict.branch_path))] += 1
    return samples, kinds


CHI_SQUARE_SETTINGS = {
    "dense": dict(seed=1),
    "top_k_zeros": dict(seed=2, target_zeros=2, draft_zeros=2),
    "close_draft": dict(seed=3, draft_closeness=0.6),
}
TRIALS = 6000


@pytest.mark.parametrize("setting", sorted(CHI_SQUARE_SETTINGS))
def test_tree_emits_the_target_joint_law(setting: str) -> None:
    torch.set_num_threads(1)
    model = toy_model(**CHI_SQUARE_SETTINGS[setting])  # type: ignore[arg-type]
    samples, kinds = first_two_tokens(model, TRIALS)
    pvalue = chi_square_pvalue(samples, model.joint_law())
    print(f"{setting}: p-value {pvalue:.4g}, kept (chain, branches): {sorted(kinds.items())}")
    assert pvalue > 1e-3
    # The branches matter: a branch is kept at depth 1, and one below the chain's first node.
    assert sum(n for (chain, branches), n in kinds.items() if chain == 0 and branches) > 100
    assert sum(n for (chain, branches), n in kinds.items() if chain == 1 and branches) > 20


WRONG_RULES = {
    # SpecInfer's with-replacement test applied to siblings drawn without replacement.
    "siblings_tested_against_q": ("_without_tokens", lambda q, tokens: q.double()),
    # Every sibling tested against the original p, and the fallback drawn from it.
    "no_residual_between_siblings": ("residual", lambda p, q: p),
}


@pytest.mark.parametrize("rule", sorted(WRONG_RULES))
def test_a_wrong_sibling_rule_is_rejected_by_the_same_test(
        rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    name, replacement = WRONG_RULES[rule]
    monkeypatch.setattr(tree_acceptance, name, replacement)
    model = toy_model(seed=4, draft_zeros=1)
    samples, _ = first_two_tokens(model, TRIALS)
    pvalue = chi_square_pvalue(samples, model.joint_law())
    print(f"{rule}: p-value {pvalue:.4g}")
    assert pvalue < 1e-6


# ---------------------------------------------------------------- greedy


def test_greedy_keeps_a_branch_path_where_the_chain_is_rejected() -> None:
    vocab = 8
    argmax_after = {-1: 5, 0: 1, 1: 1, 2: 7, 3: 0, 4: 6, 5: 1}  # node id -> its argmax
    draft_tokens = torch.tensor([3, 4])  # the chain: rejected at its first node (3 != 5)
    branch_tokens = [5, 6, 2, 7]  # nodes 2, 3, 4, 5
    branch_parents = [-1, 0, 2, 2]  # 5 at the root; 6 under the chain; 2 and 7 under the 5
    target_probs = torch.nn.functional.one_hot(
        torch.tensor([argmax_after[n] for n in range(-1, 6)]), vocab).float()
    verdict = verify_tree(draft_tokens, branch_tokens, branch_parents, None, target_probs,
                          SamplingParams(), first_position=0)
    # Node 2 (token 5) matches the root's argmax; node 5 (token 7, rank 1 under it) matches
    # node 2's argmax; node 5's argmax is 1.
    assert verdict == TreeVerdict(accepted_len=0, branch_path=(0, 3), next_token=1)


def greedy_row(path: tuple[int, ...], vocab: int) -> torch.Tensor:
    """A fixed random target row for each token path: a toy model of the prefix."""
    digest = hashlib.blake2b(repr(path).encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return process_logits(torch.randn(vocab, generator=generator), SamplingParams(1.0))


def random_greedy_tree(rng: random.Random, vocab: int) -> Children:
    """A chain of 0-3 nodes, then 0-7 branches under random nodes; each token is the
    target's argmax after its parent half the time; siblings stay distinct."""
    children: Children = {}
    nodes: list[tuple[int, ...]] = [()]

    def add(parent: tuple[int, ...]) -> None:
        greedy = int(greedy_row(parent, vocab).argmax())
        token = greedy if rng.random() < 0.5 else rng.randrange(vocab)
        if token not in children.setdefault(parent, []):
            children[parent].append(token)
            nodes.append(parent + (token,))

    for _ in range(rng.randrange(0, 4)):  # the chain: the newest node has no children yet
        add(nodes[-1])
    for _ in range(rng.randrange(0, 8)):
        add(rng.choice(nodes))
    return children


def test_greedy_tree_emits_the_longest_greedy_prefix_it_contains() -> None:
    """Random trees whose nodes often hold the target's argmax: the kept tokens and the next
    token are the target's greedy text, as far as the tree contains it, plus one token."""
    vocab = 4
    rng = random.Random(0)
    lengths: Counter[int] = Counter()
    for _ in range(300):
        children = random_greedy_tree(rng, vocab)
        tree = flatten(children)
        verdict = verify_flat(tree, children, lambda path: greedy_row(path, vocab),
                              lambda path: greedy_row(path, vocab), SamplingParams(), 0)
        greedy_text: tuple[int, ...] = ()
        while greedy_text in set(tree.paths):
            greedy_text += (int(greedy_row(greedy_text, vocab).argmax()),)
        kept = tree.kept_path(verdict)
        assert kept + (verdict.next_token,) == greedy_text
        assert verdict.accepted_len == sum(1 for path in tree.paths[1:tree.num_chain + 1]
                                           if kept[:len(path)] == path)
        lengths[len(kept)] += 1
    assert lengths[0] and lengths[2] and lengths[3]


# ---------------------------------------------------------------- a chain is the chain


@pytest.mark.parametrize("greedy", [False, True])
def test_a_chain_verifies_bit_for_bit_as_the_chain_rule(greedy: bool) -> None:
    generator = torch.Generator().manual_seed(21)
    accepted: Counter[tuple[int, bool]] = Counter()
    for seed in range(400):
        vocab = int(torch.randint(4, 40, (), generator=generator))
        k = int(torch.randint(0, 7, (), generator=generator))
        logits = torch.randn(k + 1, vocab, generator=generator) * 2
        q = torch.softmax(logits[:k] + torch.randn(k, vocab, generator=generator)
                          * float(torch.rand((), generator=generator)) * 2, dim=-1)
        params = SamplingParams(temperature=0.0 if greedy else 1.0, top_k=vocab // 2,
                                seed=seed)
        p = process_logits(logits, params)
        q = process_logits(torch.log(q), params) if k else torch.empty(0, vocab)
        first_position = int(torch.randint(0, 1000, (), generator=generator))
        tokens = (draw(q, SamplingParams(1.0, seed=seed), first_position, Purpose.DRAFT)
                  if k else torch.empty(0, dtype=torch.int64))
        verdict = verify_tree(tokens, [], [], None if greedy else q, p, params, first_position)
        chain = (verify_greedy(tokens, p) if greedy
                 else verify_stochastic(tokens, q, p, params, first_position))
        assert verdict == TreeVerdict(chain.accepted_len, (), chain.next_token), seed
        accepted[(verdict.accepted_len, verdict.accepted_len == k)] += 1
    assert len(accepted) >= 8  # rejections at several depths, and bonus tokens


# ---------------------------------------------------------------- draw_siblings


def test_rank_zero_keeps_the_single_draw_stream_and_ranks_are_independent() -> None:
    key = f"{42}:{17}:{int(Purpose.ACCEPT)}"
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(),
                          "little") & (2**63 - 1)
    expected = torch.rand((), dtype=torch.float64,
                          generator=torch.Generator().manual_seed(seed))
    assert float(uniforms(42, [17], Purpose.ACCEPT)[0]) == float(expected)
    assert torch.equal(uniforms(42, [17], Purpose.ACCEPT, rank=0), expected[None])
    ranks = [float(uniforms(42, [17], Purpose.ACCEPT, rank=r)[0]) for r in range(4)]
    assert len(set(ranks)) == 4
    with pytest.raises(ValueError, match="rank"):
        uniforms(42, [17], Purpose.ACCEPT, rank=-1)


def test_draw_siblings_are_distinct_and_rank_zero_is_the_chain_draw() -> None:
    generator = torch.Generator().manual_seed(8)
    for seed in range(200):
        probs = random_dist(10, generator, zeros=seed % 4).float()
        params = SamplingParams(temperature=1.0, seed=seed)
        tokens = draw_siblings(probs, params, 3, 4)
        assert len(tokens) == 4 and len(set(tokens)) == 4
        assert all(probs[t] > 0 for t in tokens)
        assert tokens[0] == int(draw(probs[None], params, 3, Purpose.DRAFT)[0])


def test_draw_siblings_first_two_ranks_follow_the_without_replacement_law() -> None:
    probs = torch.tensor([0.3, 0.25, 0.0, 0.2, 0.15, 0.1])
    law: dict[tuple[int, ...], float] = {
        (a, b): float(probs[a] * probs[b] / (1 - probs[a]))
        for a in range(6) for b in range(6) if a != b}
    samples = [tuple(draw_siblings(probs, SamplingParams(1.0, seed=seed), 9, 2))
               for seed in range(10_000)]
    pvalue = chi_square_pvalue(samples, law)
    print(f"draw_siblings: p-value {pvalue:.4g}")
    assert pvalue > 1e-3


def test_draw_siblings_stops_when_no_mass_is_left() -> None:
    probs = torch.tensor([0.0, 0.6, 0.0, 0.4, 0.0])
    tokens = draw_siblings(probs, SamplingParams(1.0, seed=1), 0, 5)
    assert sorted(tokens) == [1, 3]
    assert draw_siblings(probs, SamplingParams(1.0, seed=1), 0, 0) == []
    assert draw_siblings(torch.zeros(5), SamplingParams(1.0, seed=1), 0, 3) == []


def test_greedy_siblings_are_the_most_probable_tokens_lowest_id_first() -> None:
    probs = torch.tensor([0.1, 0.3, 0.3, 0.0, 0.3])
    assert draw_siblings(probs, SamplingParams(), 0, 3) == [1, 2, 4]
    assert draw_siblings(probs, SamplingParams(), 0, 9) == [1, 2, 4, 0]
    assert draw_siblings(probs, SamplingParams(), 0, 1) == [int(probs.argmax())]


# ---------------------------------------------------------------- malformed input


def _sampled(**overrides: object) -> Callable[[], TreeVerdict]:
    """A valid sampled tree (chain [1, 2], branch 3 at the root, branch 4 under it), with
    some arguments replaced."""
    uniform = torch.full((5,), 0.2)
    arguments: dict[str, object] = dict(
        draft_tokens=torch.tensor([1, 2]), branch_tokens=[3, 4], branch_parents=[-1, 2],
        draft_probs=uniform.repeat(3, 1), target_probs=uniform.repeat(5, 1),
        params=SamplingParams(1.0, seed=0), first_position=0)
    arguments.update(overrides)
    return lambda: verify_tree(**arguments)  # type: ignore[arg-type]


def test_the_valid_example_verifies() -> None:
    assert isinstance(_sampled()(), TreeVerdict)


@pytest.mark.parametrize("call,match", [
    (_sampled(branch_parents=[-2, 2]), "parent -2"),
    (_sampled(branch_parents=[-1, 3]), "parent 3"),
    (_sampled(branch_parents=[-1]), "2 branch tokens but 1 branch parents"),
    (_sampled(target_probs=torch.full((4, 5), 0.2)), "target_probs has 4 rows"),
    (_sampled(draft_probs=torch.full((2, 5), 0.2)), "draft_probs has shape"),
    (_sampled(draft_probs=None), "needs the draft probabilities"),
    (_sampled(params=SamplingParams(1.0)), "seed"),
    (_sampled(branch_tokens=[1, 4]), "repeats an earlier sibling"),
    (_sampled(branch_tokens=[3, 9]), "outside the vocabulary"),
    (_sampled(draft_probs=torch.tensor([[0.5, 0.5, 0, 0, 0]] + [[0.2] * 5] * 2)),
     "draft probability 0"),
    (_sampled(draft_tokens=torch.tensor([[1, 2]])), "1-D"),
])
def test_malformed_input_raises_a_value_error_naming_it(
        call: Callable[[], TreeVerdict], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
