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

from specdec.rejection import Verdict, verify
from specdec.runner import ModelRunner
from specdec.sampling import Purpose, SamplingParams, draw, process_logits


@dataclass(frozen=True)
class SyncPoint:
    """What the caller believes the service holds, and the committed tokens it lacks."""

    session_id: str
    committed_position: int
    fingerprint: int
    append: list[int]

    @property
    def next_position(self) -> int:
        """Absolute position of the first token generated after this sync."""
        return self.committed_position + len(self.append)


@dataclass(frozen=True)
class DraftOutput:
    tokens: list[int]  # target ids
    probs: torch.Tensor | None  # [k, usable draft rows] q in draft space; None when greedy
    kv_length: int
    forward_s: float


@dataclass(frozen=True)
class VerifyOutput:
    verdict: Verdict
    kv_length: int
    forward_s: float
    tokens_processed: int
    # The target's hidden states of the tokens this round committed to its cache (the
    # sync's append plus the accepted draft tokens), from sync.committed_position; only
    # when asked (a feature draft reads them).
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
               target_hidden: torch.Tensor | None = None) -> DraftOutput:
    """target_hidden: for a feature draft, the target's hidden state one position before
    each of sync.append's tokens; its own output state stands in for the tokens it drafts."""
    reads_hidden = runner.needs_target_hidden
    result = runner.extend(sync.session_id, sync.committed_position, sync.fingerprint,
                           sync.append, num_logits=1, hidden_rows=int(reads_hidden),
                           target_hidden=target_hidden)
    forward_s = result.forward_s
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    logits = result.logits
    for index in range(num_tokens):
        probs = process_logits(logits, params)
        model_id = draw(probs, params, sync.next_position + index, Purpose.DRAFT)
        token = int(runner.vocab.model_to_target_ids(model_id)[0])
        tokens.append(token)
        rows.append(probs[0])
        if min_confidence > 0 and index + 1 < num_tokens and \
                confidence(logits, probs, model_id, params.greedy) < min_confidence:
            break
        if index + 1 < num_tokens:  # the last proposal is never fed: verification decides
            step = runner.append(sync.session_id, [token], hidden_rows=int(reads_hidden),
                                 target_hidden=result.hidden)
            logits, forward_s = step.logits, forward_s + step.forward_s
            result = step
    probs_out = None if params.greedy else torch.stack(rows)
    return DraftOutput(tokens, probs_out, runner.kv_length(sync.session_id), forward_s)


def verify_step(runner: ModelRunner, sync: SyncPoint, draft_tokens: list[int],
                draft_probs: torch.Tensor | None, params: SamplingParams,
                return_hidden: bool = False) -> VerifyOutput:
    """draft_probs: dense [k, target vocab] q (ignored when greedy)."""
    block = sync.append + draft_tokens
    result = runner.extend(sync.session_id, sync.committed_position, sync.fingerprint, block,
                           num_logits=len(draft_tokens) + 1,
                           hidden_rows=len(block) if return_hidden else 0)
    # Greedy needs only argmax, which the raw logits give without a softmax.
    target_probs = result.logits if params.greedy else process_logits(result.logits, params)
    tokens = torch.tensor(draft_tokens, dtype=torch.long, device=target_probs.device)
    if draft_probs is not None:
        draft_probs = draft_probs.to(target_probs.device)
    verdict = verify(tokens, draft_probs, target_probs, params, sync.next_position)
    hidden = None
    if result.hidden is not None:
        hidden = result.hidden[: len(sync.append) + verdict.accepted_len]
    return VerifyOutput(verdict, result.kv_length, result.forward_s, result.tokens_processed,
                        hidden)
