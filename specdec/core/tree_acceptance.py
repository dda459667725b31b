"""Exact acceptance of a token tree of draft tokens, greedy and sampled; pure functions.

**Numbering.** A round's draft is a tree over the committed prefix. Node -1 is the root
(the committed prefix). Nodes 0..k-1 are the chain, the main path: chain node j's parent
is j - 1. Nodes k..k+B-1 are branches: branch b (node k + b) has parent branch_parents[b],
an id in [-1, k + b), so every parent precedes its children. A node's children in rank
order are its chain child first (chain node 0 for the root, j + 1 for chain node j), then
its branch children in increasing branch index. target_probs holds k + 1 + B rows, the
target's processed distribution after each node: node n's row is n + 1. draft_probs holds
one row per node with at least one child, in increasing node id: the processed draft
distribution q that node's children were drawn from. With B = 0 both are the chain's
layouts ([k + 1, V] and [k, V]), and the verdict is the chain's.

**Walk.** Verification walks from the root. Greedy: go to the first child, in rank order,
whose token is the argmax of the node's target row; where none is, that argmax is the
next token. Sampled, at a node with target row p and draft row q whose children
x_0, x_1, ... were drawn from q without replacement: child r is accepted with probability
min(1, p(x_r) / q_r(x_r)), where q_r is q with the tokens of the r earlier siblings removed
and renormalised (the law x_r was drawn from); on rejection p becomes
norm(max(0, p - q_r)) and the next sibling is tried. The walk continues at an accepted
child; where every child is rejected the target draws the next token from the last p. At
a leaf the target draws the next token from the leaf's row (the bonus).

**Why this is exact.** Each sibling test is one standard speculative step of the current
residual target against q_r, the law the sibling was actually drawn from given the
earlier siblings, so a node emits exactly its target row whatever the draft proposes
(recursive rejection sampling without replacement; SpecInfer's multi-step speculative
sampling is the with-replacement variant, which tests every sibling against q itself).
Induction over the remaining siblings: if the rest of a node's procedure emits the
current residual, the step before it emits q_r(x) min(1, p(x)/q_r(x)) +
(1 - sum_y min(q_r(y), p(y))) norm(max(0, p - q_r))(x) = p(x). An accepted child then
emits its own target row, the target's law given the tokens before it.

**Deterministic nodes.** A proposer that chooses a node's children without drawing them
(prompt lookup, the suffix cache) gives the node a q row that is one-hot at its first
child. Every child x_r of such a node is a point mass: q_r = delta(x_r), so x_r is
accepted with probability min(1, p(x_r)) = p(x_r) and on rejection p becomes
norm(max(0, p - delta(x_r))), which is p with x_r removed and renormalised. The induction
above holds unchanged with q_r = delta(x_r): delta(x_r)(x) min(1, p(x)) + (1 - p(x_r))
norm(p without x_r)(x) = p(x), so such a node emits its target row exactly too, whatever
children the proposer chose, since none of them was drawn at the node. Rank 0 is the
chain's test with the row as given. A one-hot row at a node with several children can
only mean this: a drawn node's siblings have q > 0, and a one-hot q has room for one.

**The drafter's contract.** This holds only when the number of children a node gets is
fixed before its children are drawn: it may depend on the node's q and on anything drawn
at smaller depths, never on the values of its own children, and every drawn child is kept
in the order it was drawn (:func:`draw_siblings` draws them so). Choosing or discarding
siblings after seeing them changes the law they were drawn from, and q_r no longer
describes it.

**Randomness.** A node at depth d (the root has depth 0) keys its random numbers at
position first_position + d, the absolute position of its children: the coin of the
sibling of rank r is uniforms(seed, [position], ACCEPT, rank=r), and the target's own draw
there is the EMIT stream. Rank 0 is the chain's coin, and rank 0 uses the rows as given
with the chain's arithmetic, so a chain verifies bit for bit as
:func:`specdec.core.rejection.verify_stochastic` does. The walk reads at most one node per
depth, so no uniform is used twice in a round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core.rejection import Verdict, residual, verify_greedy, verify_stochastic
from specdec.core.sampling import (
    Purpose,
    SamplingParams,
    draw,
    sample_with_uniforms,
    uniforms,
)

ROOT = -1


@dataclass(frozen=True)
class Alternatives:
    """The draft tokens beside its chain: the other nodes of a token tree, verified in
    the same forward. Node ids: -1 is the committed prefix, 0..k-1 the chain (node j
    follows node j - 1), k + i alternative i; tokens[i] follows node parents[i], which is
    -1, a chain node or an earlier alternative. A node's children, in rank order: its
    chain child first, then its alternatives by index (specdec.core.tree_acceptance)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} alternative tokens but "
                             f"{len(self.parents)} parents")

    def __len__(self) -> int:
        return len(self.tokens)

    def check(self, num_draft_tokens: int) -> None:
        """Raise ValueError unless every parent is -1, a chain node or an earlier
        alternative."""
        for index, parent in enumerate(self.parents):
            if not -1 <= parent < num_draft_tokens + index:
                raise ValueError(
                    f"alternative {index} (node {num_draft_tokens + index}): parent "
                    f"{parent} is outside [-1, {num_draft_tokens + index}) (the committed "
                    f"prefix, the {num_draft_tokens} chain tokens and the alternatives "
                    "before it)")

    def depths(self, num_draft_tokens: int) -> tuple[int, ...]:
        """Each alternative's depth: 1 for a child of the committed prefix."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(parent + 2 if parent < num_draft_tokens
                          else depths[parent - num_draft_tokens] + 1)
        return tuple(depths)

    def children(self, node: int, num_draft_tokens: int) -> list[int]:
        """A node's children in rank order: its chain child, then its alternatives."""
        chain = [node + 1] if node + 1 < num_draft_tokens else []
        return chain + [num_draft_tokens + index for index, parent in enumerate(self.parents)
                        if parent == node]

    def kept_ranks(self, num_draft_tokens: int, accepted_len: int,
                   branch_path: tuple[int, ...]) -> list[int]:
        """The rank of the kept child at each depth along an accepted path (0: the chain's
        token, or an alternative's first child)."""
        ranks = [0] * accepted_len
        node = accepted_len - 1
        for index in branch_path:
            ranks.append(self.children(node, num_draft_tokens).index(num_draft_tokens + index))
            node = num_draft_tokens + index
        return ranks

    def q_nodes(self, num_draft_tokens: int) -> list[int]:
        """The nodes with children, by id: those a sampled tree carries a q row for."""
        return sorted({*range(-1, num_draft_tokens - 1), *self.parents})


NO_ALTERNATIVES = Alternatives()


@dataclass(frozen=True)
class TreeVerdict:
    accepted_len: int  # chain nodes kept (a prefix of the chain)
    branch_path: tuple[int, ...]  # branch indices b (not node ids) kept after them, root to leaf
    next_token: int  # the target's own token after the kept path (correction or bonus)


@dataclass(frozen=True)
class _Tree:
    """The checked structure of a draft tree; lists are indexed by node id + 1 (root = 0)."""

    num_chain: int
    tokens: list[int]  # tokens[n + 1]; the root's entry is unused (-1)
    children: list[list[int]]  # children[n + 1], node ids in rank order
    draft_row: list[int]  # draft_row[n + 1]: node n's row of draft_probs, -1 if it has none

    @property
    def num_rows_with_children(self) -> int:
        return sum(1 for row in self.draft_row if row >= 0)


def _build_tree(draft_tokens: torch.Tensor, branch_tokens: Sequence[int],
                branch_parents: Sequence[int], vocab: int) -> _Tree:
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be 1-D [k], got shape {tuple(draft_tokens.shape)}")
    if len(branch_tokens) != len(branch_parents):
        raise ValueError(f"{len(branch_tokens)} branch tokens but "
                         f"{len(branch_parents)} branch parents")
    k = draft_tokens.shape[0]
    tokens = [ROOT] + [int(t) for t in draft_tokens.tolist()] + [int(t) for t in branch_tokens]
    for node, token in enumerate(tokens[1:]):
        if not 0 <= token < vocab:
            raise ValueError(f"node {node}: token {token} is outside the vocabulary [0, {vocab})")
    branches = Alternatives(tuple(tokens[k + 1:]), tuple(int(p) for p in branch_parents))
    branches.check(k)
    children = [branches.children(node, k) for node in range(ROOT, len(tokens) - 1)]
    rows = {node: row for row, node in enumerate(branches.q_nodes(k))}
    draft_row = [rows.get(node, -1) for node in range(ROOT, len(tokens) - 1)]
    return _Tree(k, tokens, children, draft_row)


def is_point_mass(row: torch.Tensor, token: int) -> bool:
    """Whether q row puts all its mass on token: a deterministic node's row."""
    return float(row[token]) == 1.0 and float(row.sum()) == 1.0


def _check_sampled_siblings(tree: _Tree, draft_probs: torch.Tensor) -> None:
    """Every sampled child must be drawable: siblings distinct (drawn without replacement)
    and q(x) > 0, so q_r(x_r) > 0 and q_r has mass for every rank r; or, at a
    deterministic node (a row one-hot at its first child), siblings distinct."""
    for index, kids in enumerate(tree.children):
        if not kids:
            continue
        row = draft_probs[tree.draft_row[index]]
        deterministic = is_point_mass(row, tree.tokens[kids[0] + 1])
        seen: set[int] = set()
        for rank, child in enumerate(kids):
            token = tree.tokens[child + 1]
            if token in seen:
                raise ValueError(f"node {child} (rank {rank} under node {index - 1}): token "
                                 f"{token} repeats an earlier sibling, so q_r({token}) = 0 "
                                 "(siblings are drawn without replacement)")
            if not deterministic and not float(row[token]) > 0.0:
                raise ValueError(f"node {child} (rank {rank} under node {index - 1}): token "
                                 f"{token} has draft probability 0, so the draft could not "
                                 "have drawn it")
            seen.add(token)


def _without_tokens(q: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """q with the given tokens removed and renormalised, in float64: the law of the next
    sibling drawn without replacement after them."""
    remaining = q.double().clone()
    remaining[tokens] = 0.0
    mass = remaining.sum()
    if not float(mass) > 0.0:
        raise ValueError(f"the draft row has no mass left after removing tokens {tokens}")
    return remaining / mass


def _choose_child(p: torch.Tensor, q: torch.Tensor, sibling_tokens: list[int], seed: int,
                  position: int) -> tuple[int, torch.Tensor]:
    """Test the siblings in rank order; return the accepted rank, or -1 and the residual the
    target draws from. Rank 0 runs exactly the chain's test and residual; at a
    deterministic node every later rank is tested against a point mass on its token."""
    removed: list[int] = []
    deterministic = is_point_mass(q, sibling_tokens[0])
    for rank, token in enumerate(sibling_tokens):
        if rank == 0:
            q_rank = q
        elif deterministic:
            q_rank = torch.zeros_like(q)
            q_rank[token] = 1.0
        else:
            q_rank = _without_tokens(q, removed)
        u = float(uniforms(seed, [position], Purpose.ACCEPT, rank=rank)[0])
        # u * q_r(x) < p(x) has probability min(1, p(x) / q_r(x)); q_r(x) > 0 (checked).
        if u * float(q_rank[token]) < float(p[token]):
            return rank, p
        p = residual(p, q_rank)
        removed.append(token)
    return -1, p


def verify_tree(draft_tokens: torch.Tensor, branch_tokens: Sequence[int],
                branch_parents: Sequence[int], draft_probs: torch.Tensor | None,
                target_probs: torch.Tensor, params: SamplingParams,
                first_position: int) -> TreeVerdict:
    """Exact verification of a draft tree (layout and rule in the module docstring).

    draft_tokens [k] is the chain; branch_tokens[b] hangs under branch_parents[b];
    target_probs [k + 1 + B, V]; draft_probs [nodes with children, V], needed only when
    sampling. Raises ValueError naming the problem for a malformed tree or rows, and for a
    sampled child the draft could not have drawn.
    """
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be 2-D [rows, V], got shape "
                         f"{tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    tree = _build_tree(draft_tokens, branch_tokens, branch_parents, vocab)
    nodes = len(tree.tokens) - 1
    if target_probs.shape[0] != nodes + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows for {nodes} nodes: "
                         f"one per node plus the root's, {nodes + 1}, are needed")
    path: list[int] = []
    if params.greedy:
        choices = target_probs.argmax(dim=-1).tolist()
        node = ROOT
        while True:
            choice = choices[node + 1]
            child = next((c for c in tree.children[node + 1] if tree.tokens[c + 1] == choice),
                         None)
            if child is None:
                return _verdict(tree, path, choice)
            path.append(child)
            node = child
    needed = tree.num_rows_with_children
    if needed and draft_probs is None:
        raise ValueError("sampled verification needs the draft probabilities q")
    if draft_probs is not None and tuple(draft_probs.shape) != (needed, vocab):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}; one row per node "
                         f"with children is needed: ({needed}, {vocab})")
    if params.seed is None:
        raise ValueError("sampled verification needs a seed: call SamplingParams.with_seed()")
    if needed:
        assert draft_probs is not None
        _check_sampled_siblings(tree, draft_probs)
    node = ROOT
    while True:
        position = first_position + len(path)
        kids = tree.children[node + 1]
        p = target_probs[node + 1]
        if kids:
            assert draft_probs is not None
            q = draft_probs[tree.draft_row[node + 1]]
            rank, p = _choose_child(p, q, [tree.tokens[c + 1] for c in kids], params.seed,
                                    position)
            if rank >= 0:
                path.append(kids[rank])
                node = kids[rank]
                continue
        token = draw(p.unsqueeze(0), params, position, Purpose.EMIT)
        return _verdict(tree, path, int(token[0]))


def _verdict(tree: _Tree, path: list[int], next_token: int) -> TreeVerdict:
    # A branch's children are branches, so the chain nodes of a path come first.
    chain = sum(1 for node in path if node < tree.num_chain)
    branches = tuple(node - tree.num_chain for node in path[chain:])
    return TreeVerdict(chain, branches, next_token)


def draw_siblings(probs: torch.Tensor, params: SamplingParams, position: int,
                  count: int) -> list[int]:
    """Up to count distinct tokens from one processed row probs [V], drawn without
    replacement: the children of one tree node, in rank order.

    Rank 0 is draw(probs[None], params, position, DRAFT)[0], the chain's draw; rank r
    draws from probs with the earlier ranks removed, with the DRAFT uniform of rank r at the
    same position. Stops early when no mass is left, so the count depends on probs alone.
    Greedy: the count most probable tokens with mass (ties: lowest id), rank 0 the argmax;
    a caller that wants alternatives passes a row that ranks them (a processed greedy row is
    one-hot and gives one token).
    """
    if probs.dim() != 1:
        raise ValueError(f"draw_siblings takes one row [V], got shape {tuple(probs.shape)}")
    if count < 0:
        raise ValueError(f"draw_siblings: count must be >= 0, got {count}")
    remaining = probs.double().clone()
    count = min(count, int((remaining > 0).sum()))
    if params.greedy:
        # A stable sort keeps the lowest id first among equal probabilities.
        order = torch.sort(remaining, descending=True, stable=True).indices
        return [int(t) for t in order[:count].tolist()]
    if params.seed is None:
        raise ValueError("sampled drafting needs a seed: call SamplingParams.with_seed()")
    tokens: list[int] = []
    for rank in range(count):
        if rank == 0:
            token = int(draw(probs.unsqueeze(0), params, position, Purpose.DRAFT)[0])
        else:
            u = uniforms(params.seed, [position], Purpose.DRAFT, rank=rank)
            token = int(sample_with_uniforms(remaining.unsqueeze(0), u)[0])
        tokens.append(token)
        remaining[token] = 0.0
    return tokens


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           target_probs: torch.Tensor, params: SamplingParams, first_position: int,
           alternatives: Alternatives = NO_ALTERNATIVES) -> Verdict:
    """Dispatch on the request: greedy needs no q; sampling needs q for every draft token
    (and, with alternatives, for every node with children). With alternatives the draft
    is a token tree, walked by verify_tree.

    draft_probs: one row per node with children (Alternatives.q_nodes), V columns;
    target_probs: [k + 1 + len(alternatives), V].
    """
    if alternatives:
        tree = verify_tree(draft_tokens, alternatives.tokens, alternatives.parents,
                           None if params.greedy else draft_probs, target_probs, params,
                           first_position)
        return Verdict(tree.accepted_len, tree.next_token, tree.branch_path)
    if params.greedy or draft_tokens.numel() == 0:
        if draft_tokens.numel() == 0 and not params.greedy:
            token = draw(target_probs[:1], params, first_position, Purpose.EMIT)
            return Verdict(0, int(token[0]))
        return verify_greedy(draft_tokens, target_probs)
    if draft_probs is None:
        raise ValueError("sampled verification needs the draft probabilities q")
    return verify_stochastic(draft_tokens, draft_probs, target_probs, params, first_position)
