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
    """The draft's next-best tokens, verified beside its chain in the same forward (a
    token tree one level deep; greedy only). tokens[i] is an alternative to the chain's
    draft token number depths[i] (1-based): it follows the chain's first depths[i] - 1
    tokens. The target's choice at the first rejected depth may be one of them."""

    tokens: tuple[int, ...] = ()
    depths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.depths):
            raise ValueError(f"{len(self.tokens)} alternative tokens but "
                             f"{len(self.depths)} depths")

    def __len__(self) -> int:
        return len(self.tokens)


NO_ALTERNATIVES = Alternatives()


@dataclass(frozen=True)
class Verdict:
    accepted_len: int  # leading draft tokens of the chain kept
    next_token: int  # the recovered token at the first rejection, or the bonus token
    # Index into the Alternatives of the one the target chose at the first rejected depth
    # (it is kept after the chain's accepted_len tokens, then next_token); -1 = none.
    alternative: int = -1

    def is_bonus(self, num_draft_tokens: int) -> bool:
        return self.accepted_len == num_draft_tokens


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row; falls back to p where p <= q everywhere (p == q)."""
    diff = torch.clamp(p - q, min=0.0)
    mass = diff.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, diff / mass.clamp_min(torch.finfo(diff.dtype).tiny), p)


def verify_greedy(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                  alternatives: Alternatives = NO_ALTERNATIVES) -> Verdict:
    """Temperature 0: keep draft tokens while they equal the target's argmax.

    target_probs: [k + 1 + len(alternatives)] rows, the chain's then one per alternative
    (the target's scores of the token after it). Where the chain stops, an alternative
    at that depth equal to the target's choice is kept, and its row gives the next token:
    every kept token is still the target's argmax after the tokens before it.
    """
    target_choice = target_probs.argmax(dim=-1)
    k = draft_tokens.shape[0]
    matches = (draft_tokens == target_choice[:k]).to(torch.int64)
    accepted_len = int(matches.cumprod(dim=0).sum())
    choice = int(target_choice[accepted_len])
    if accepted_len < k:
        for index, (token, depth) in enumerate(zip(alternatives.tokens, alternatives.depths,
                                                   strict=True)):
            if depth == accepted_len + 1 and token == choice:
                return Verdict(accepted_len, int(target_choice[k + 1 + index]), index)
    return Verdict(accepted_len, choice)


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
    """Dispatch on the request: greedy needs no q; sampling needs q for every draft token.
    Alternatives are greedy only: a sampled tree needs another acceptance rule."""
    if alternatives and not params.greedy:
        raise ValueError("alternatives are verified under greedy decoding only")
    if params.greedy or draft_tokens.numel() == 0:
        if draft_tokens.numel() == 0 and not params.greedy:
            token = draw(target_probs[:1], params, first_position, Purpose.EMIT)
            return Verdict(0, int(token[0]))
        return verify_greedy(draft_tokens, target_probs, alternatives)
    if draft_probs is None:
        raise ValueError("sampled verification needs the draft probabilities q")
    return verify_stochastic(draft_tokens, draft_probs, target_probs, params, first_position)
