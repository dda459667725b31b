"""The two model-side steps of a round, shared by the in-process path and the services.

`draft_step` runs on the draft's runner: catch the cache up, then sample up to k tokens
autoregressively and keep q, the exact distribution each was drawn from. With
min_confidence it stops after a token the draft itself gave less than that probability:
such a token is usually rejected, so drafting past it wastes draft and verify time. The
stop depends on the draft's side only, so the rejection sampler stays exact.
`verify_step` runs on the target's runner: one forward over the pending committed
tokens and the k draft tokens, then the rejection sampler next to p, so p (k+1 rows of
the full vocabulary) never crosses the network.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention import MAX_QUERY_ROWS
from specdec.errors import InvalidRequest
from specdec.history import SyncPoint  # noqa: F401  (re-exported for the services)
from specdec.rejection import NO_ALTERNATIVES, Alternatives, Verdict, verify
from specdec.runner import ModelRunner
from specdec.sampling import Purpose, SamplingParams, draw, process_logits
from specdec.settings import default


@dataclass(frozen=True)
class DraftOutput:
    tokens: list[int]  # target ids
    probs: torch.Tensor | None  # [k, usable draft rows] q in draft space; None when greedy
    kv_length: int
    forward_s: float
    alternatives: Alternatives = NO_ALTERNATIVES


# Alternatives per greedy round by default: each is one more row of the target's forward.
DEFAULT_ALTERNATIVES: int = default("draft-alternatives")


def alternatives_budget(num_draft_tokens: int, append_tokens: int = 2) -> int:
    """Most alternatives one verification takes beside k draft tokens: its rows stay
    within a decode-sized forward (MAX_QUERY_ROWS), where the row-invariant kernels cost
    about the same for any row count. append_tokens: the committed tokens a round usually
    re-sends (the last token, or an accepted alternative and the next token)."""
    return max(0, MAX_QUERY_ROWS - append_tokens - num_draft_tokens)


@dataclass(frozen=True)
class VerifyOutput:
    verdict: Verdict
    kv_length: int
    forward_s: float
    tokens_processed: int
    # The target's hidden states of the tokens this round committed (the sync's append,
    # the accepted draft tokens and a kept alternative), from sync.committed_position;
    # only when asked (a feature draft reads them).
    hidden: torch.Tensor | None = None


def confidence(logits: torch.Tensor, probs: torch.Tensor, model_id: torch.Tensor,
               greedy: bool) -> float:
    """The draft's probability of its proposal: under its T=1 softmax when greedy (the
    processed distribution is one-hot there), else under the distribution it sampled."""
    if greedy:
        return float(torch.softmax(logits[0].float(), dim=-1).max())
    return float(probs[0, model_id.reshape(-1)[0]])


def draft_step(runner: ModelRunner, sync: SyncPoint, num_tokens: int,
               params: SamplingParams, min_confidence: float = 0.0,
               target_hidden: torch.Tensor | None = None,
               num_alternatives: int = 0) -> DraftOutput:
    """target_hidden: for a feature draft, the target's hidden state one position before
    each of sync.append's tokens; its own output state stands in for the tokens it drafts.
    num_alternatives (greedy only): also return up to that many of the draft's next-best
    tokens (within alternatives_budget), those most likely to be kept by the draft's own
    estimate: the product of its probabilities of the chain tokens before one and of the
    token itself (the target keeps an alternative only where it rejects the chain's token,
    and mostly where the draft was unsure of it)."""
    if num_alternatives and not params.greedy:
        raise InvalidRequest("alternatives are drafted under greedy decoding only")
    reads_hidden = runner.needs_target_hidden
    result = runner.extend(sync.session_id, sync.committed_position, sync.fingerprint,
                           sync.append, num_logits=1, hidden_rows=int(reads_hidden),
                           target_hidden=target_hidden)
    forward_s = result.forward_s
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    candidates: list[tuple[float, int, int]] = []  # (estimated chance, depth, token)
    reach = 1.0  # the draft's estimate that the target keeps the chain up to this depth
    logits = result.logits
    for index in range(num_tokens):
        probs = process_logits(logits, params)
        model_id = draw(probs, params, sync.next_position + index, Purpose.DRAFT)
        token = int(runner.vocab.model_to_target_ids(model_id)[0])
        tokens.append(token)
        rows.append(probs[0])
        own_q = None  # the draft's T=1 probability of its proposal, once computed
        if num_alternatives:
            draft_q = torch.softmax(logits[0].float(), dim=-1)
            top_q, top_ids = draft_q.topk(min(num_alternatives + 1, draft_q.shape[0]))
            for prob, target_id in zip(top_q.tolist(),
                                       runner.vocab.model_to_target_ids(top_ids).tolist(),
                                       strict=True):
                if target_id != token:
                    candidates.append((reach * prob, index + 1, target_id))
            own_q = float(draft_q[model_id.reshape(-1)[0]])
            reach *= own_q
        if min_confidence > 0 and index + 1 < num_tokens:
            # Alternatives are greedy only, where own_q is the gate's confidence too.
            gate = own_q if own_q is not None else confidence(logits, probs, model_id,
                                                              params.greedy)
            if gate < min_confidence:
                break
        if index + 1 < num_tokens:  # the last proposal is never fed: verification decides
            step = runner.append(sync.session_id, [token], hidden_rows=int(reads_hidden),
                                 target_hidden=result.hidden)
            logits, forward_s = step.logits, forward_s + step.forward_s
            result = step
    probs_out = None if params.greedy else torch.stack(rows)
    return DraftOutput(tokens, probs_out, runner.kv_length(sync.session_id), forward_s,
                       best_alternatives(candidates, min(num_alternatives,
                                                         alternatives_budget(len(tokens)))))


def best_alternatives(candidates: list[tuple[float, int, int]], count: int) -> Alternatives:
    """The count (chance, depth, token) candidates of highest chance, by depth."""
    chosen = sorted(sorted(candidates, key=lambda c: -c[0])[:count], key=lambda c: c[1])
    return Alternatives(tuple(token for _, _, token in chosen),
                        tuple(depth for _, depth, _ in chosen))


def verify_step(runner: ModelRunner, sync: SyncPoint, draft_tokens: list[int],
                draft_probs: torch.Tensor | None, params: SamplingParams,
                return_hidden: bool = False,
                alternatives: Alternatives = NO_ALTERNATIVES) -> VerifyOutput:
    """draft_probs: dense [k, target vocab] q (ignored when greedy). alternatives: greedy
    only, verified as branches of the same forward; they leave the target's cache."""
    if alternatives and not params.greedy:
        raise InvalidRequest("alternatives are verified under greedy decoding only")
    if any(not 1 <= depth <= len(draft_tokens) for depth in alternatives.depths):
        raise InvalidRequest(f"alternative depths {list(alternatives.depths)} must lie in "
                             f"[1, {len(draft_tokens)}] (the draft tokens they replace)")
    chain = sync.append + draft_tokens
    block = chain + list(alternatives.tokens)
    result = runner.extend(sync.session_id, sync.committed_position, sync.fingerprint, block,
                           num_logits=len(draft_tokens) + 1 + len(alternatives),
                           hidden_rows=len(block) if return_hidden else 0,
                           branch_positions=[sync.next_position + depth - 1
                                             for depth in alternatives.depths])
    # Greedy needs only argmax, which the raw logits give without a softmax.
    target_probs = result.logits if params.greedy else process_logits(result.logits, params)
    tokens = torch.tensor(draft_tokens, dtype=torch.long, device=target_probs.device)
    if draft_probs is not None:
        draft_probs = draft_probs.to(target_probs.device)
    verdict = verify(tokens, draft_probs, target_probs, params, sync.next_position,
                     alternatives)
    hidden = None
    if result.hidden is not None:
        hidden = result.hidden[: len(sync.append) + verdict.accepted_len]
        if verdict.alternative >= 0:  # the kept alternative's state follows the chain's
            row = len(chain) + verdict.alternative
            hidden = torch.cat([hidden, result.hidden[row:row + 1]])
    return VerifyOutput(verdict, result.kv_length, result.forward_s, result.tokens_processed,
                        hidden)
