"""Speculative verification: accept min(1, p/q), resample norm(max(0, p - q)), bonus token.

Pure functions on tensors, vectorised over draft positions and vocabulary
(Leviathan et al. 2023, Chen et al. 2023). The caller passes *processed* fp32
distributions: q exactly as the draft sampled from, p from the same SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import Purpose, SamplingParams, draw, uniforms


@dataclass(frozen=True)
class Alternatives:
    """The draft tokens beside its chain: the other nodes of a token tree, verified in
    the same forward. Node ids: -1 is the committed prefix, 0..k-1 the chain (node j
    follows node j - 1), k + i alternative i; tokens[i] follows node parents[i], which is
    -1, a chain node or an earlier alternative. A node's children, in rank order: its
    chain child first, then its alternatives by index (specdec.tree_acceptance)."""

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
class Verdict:
    accepted_len: int  # leading draft tokens of the chain kept
    next_token: int  # the recovered token at the first rejection, or the bonus token
    # The alternatives kept after the chain's accepted_len tokens (then next_token), by
    # index, root to leaf.
    branch_path: tuple[int, ...] = ()


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row; falls back to p where p <= q everywhere (p == q)."""
    diff = torch.clamp(p - q, min=0.0)
    mass = diff.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, diff / mass.clamp_min(torch.finfo(diff.dtype).tiny), p)


def verify_greedy(draft_tokens: torch.Tensor, target_probs: torch.Tensor) -> Verdict:
    """Temperature 0: keep draft tokens while they equal the target's argmax.

    target_probs: [k + 1] rows; the target's argmax at the first mismatch (or after the
    last draft token) is the next token, so every kept token is the target's argmax after
    the tokens before it.
    """
    target_choice = target_probs.argmax(dim=-1)
    k = draft_tokens.shape[0]
    matches = (draft_tokens == target_choice[:k]).to(torch.int64)
    accepted_len = int(matches.cumprod(dim=0).sum())
    return Verdict(accepted_len, int(target_choice[accepted_len]))


def verify_stochastic(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                      target_probs: torch.Tensor, params: SamplingParams,
                      first_position: int) -> Verdict:
    """Exact speculative sampling for one sequence.

    draft_tokens [k], draft_probs [k, V], target_probs [k + 1, V]; draft token i sits at
    absolute position first_position + i, which keys its random numbers.
    """
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=target_probs.device)
    p_of_token = target_probs[rows, draft_tokens].double()
    q_of_token = draft_probs[rows, draft_tokens].double()
    u = uniforms(params.seed or 0, range(first_position, first_position + k), Purpose.ACCEPT)
    # u * q < p  <=>  u < p / q, which has probability min(1, p / q); q > 0 since it was drawn.
    accepted = (u.to(p_of_token.device) * q_of_token < p_of_token).to(torch.int64)
    accepted_len = int(accepted.cumprod(dim=0).sum())
    if accepted_len < k:
        fix_probs = residual(target_probs[accepted_len], draft_probs[accepted_len])
    else:
        fix_probs = target_probs[k]
    token = draw(fix_probs.unsqueeze(0), params, first_position + accepted_len, Purpose.EMIT)
    return Verdict(accepted_len, int(token[0]))


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           target_probs: torch.Tensor, params: SamplingParams, first_position: int,
           alternatives: Alternatives = NO_ALTERNATIVES) -> Verdict:
    """Dispatch on the request: greedy needs no q; sampling needs q for every draft token
    (and, with alternatives, for every node with children). With alternatives the draft
    is a token tree, walked by specdec.tree_acceptance.

    draft_probs: one row per node with children (Alternatives.q_nodes), V columns;
    target_probs: [k + 1 + len(alternatives), V].
    """
    if alternatives:
        # The tree's rule builds on this module's residual, so it is imported here.
        from specdec.tree_acceptance import verify_tree

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
