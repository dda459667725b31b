"""Speculative verification: accept min(1, p/q), resample norm(max(0, p - q)), bonus token.

Pure functions on tensors, vectorised over draft positions and vocabulary
(Leviathan et al. 2023, Chen et al. 2023). The caller passes *processed* fp32
distributions: q exactly as the draft sampled from, p from the same SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.sampling import Purpose, SamplingParams, draw, uniforms


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
