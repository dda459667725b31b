"""What the speculative loop needs from "something that proposes" and "something that checks".

Implementations: in-process (specdec.engine.local) and gRPC clients (coordinator.clients). Both
keep a CacheMirror per session: the tokens they believe the remote KV cache holds, from
which each call's committed position, fingerprint and catch-up tokens follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec.core.history import SyncPoint, TokenHistory
from specdec.core.sampling import SamplingParams
from specdec.core.stats import DRAFT_MODEL
from specdec.core.tree_acceptance import NO_ALTERNATIVES, Alternatives


@dataclass(frozen=True)
class ForwardBatch:
    """The forward a Propose or Verify ran in, as the service reports it (BatchInfo).

    All zero: unknown (a service that does not batch reports nothing); the call then
    counts as having run alone."""

    sessions: int = 0  # sessions whose rows shared the forward, this one included
    rows: int = 0  # token rows in that forward, all sessions together
    queue_wait_s: float = 0.0  # how long the call waited for a forward to take it
    queued: int = 0  # calls waiting for the next forward when this one ran

    @property
    def known(self) -> bool:
        return self.sessions > 0 or self.rows > 0


ALONE = ForwardBatch()


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # dense [rows, target vocab] q; None for greedy requests
    elapsed_s: float  # wall time of the call as the loop saw it
    forward_s: float = 0.0  # model time inside the draft service
    resyncs: int = 0
    wire_bytes: int = 0
    # The token tree's other nodes, verified beside the chain; q has a row for each of
    # them with children after the chain's rows.
    alternatives: Alternatives = NO_ALTERNATIVES
    source: str = DRAFT_MODEL
    batch: ForwardBatch = ALONE


@dataclass(frozen=True)
class Verification:
    accepted_len: int  # leading draft tokens of the chain kept
    next_token: int  # the target's own: recovered at a rejection, else the bonus token
    elapsed_s: float
    forward_s: float = 0.0
    resyncs: int = 0
    wire_bytes: int = 0
    # The target's hidden states from hidden_position on, for the tokens this call
    # committed to its cache; only when the committed history carries a HiddenStateLog.
    hidden: torch.Tensor | None = None
    hidden_position: int = 0
    # The alternatives kept after the chain's accepted_len tokens (before next_token):
    # their indices in the proposal's Alternatives and their tokens, root to leaf.
    kept_branches: tuple[int, ...] = ()
    branch_tokens: tuple[int, ...] = ()
    batch: ForwardBatch = ALONE
    # A round without draft tokens that asked for decode_steps: the target's tokens
    # after next_token, one forward each.
    decoded: tuple[int, ...] = ()

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens kept this round: the accepted path, kept alternatives included."""
        return self.accepted_len + len(self.branch_tokens)

    @property
    def steps(self) -> int:
        """Target forwards the round took one after another: 1, or 1 + decoded."""
        return 1 + len(self.decoded)

    def emitted(self, draft_tokens: list[int]) -> list[int]:
        """The tokens this round adds to the committed history."""
        return [*draft_tokens[: self.accepted_len], *self.branch_tokens, self.next_token,
                *self.decoded]


class DraftUnavailable(Exception):
    """The draft could not answer in time; the loop continues target-only (still exact)."""


class Drafter(Protocol):
    @property
    def needs_target_hidden(self) -> bool:
        """True for a feature draft: the loop then keeps the target's hidden states in
        committed.target_hidden and drafts only once they cover the committed prefix.
        Such a drafter may name the states it reads as `target_hidden_spec` (a
        HiddenSpec; without it, the target's final state in float16)."""
        ...

    def propose(self, session_id: str, committed: TokenHistory, num_tokens: int,
                params: SamplingParams, min_confidence: float = 0.0,
                num_alternatives: int = 0, max_alternative_depth: int = 0) -> Proposal:
        """Up to num_tokens tokens: fewer only when min_confidence stops the draft.
        num_alternatives: a token tree with up to that many alternatives beside the
        chain, in Proposal.alternatives, at most max_alternative_depth levels below the
        chain (0: no limit)."""
        ...

    def release(self, session_id: str) -> None: ...


class Verifier(Protocol):
    def verify(self, session_id: str, committed: TokenHistory, draft_tokens: list[int],
               draft_probs: torch.Tensor | None, params: SamplingParams,
               alternatives: Alternatives = NO_ALTERNATIVES, decode_steps: int = 1,
               stop_token_ids: Sequence[int] = ()) -> Verification:
        """Returns the target's hidden states too when committed.target_hidden is set.
        decode_steps: without draft tokens, the verifier may decode up to that many target
        tokens (Verification.decoded), ending after one of stop_token_ids; a verifier whose
        round trips cost nothing decodes one."""
        ...

    def release(self, session_id: str) -> None: ...


@dataclass
class CacheMirror:
    """The caller's copy of the token list a remote KV cache holds for one session."""

    tokens: list[int] = field(default_factory=list)

    def plan(self, session_id: str, committed: TokenHistory) -> SyncPoint:
        """The sync point of the next call. The service may hold the whole committed
        history already (its speculative tokens were what the round emitted), but a step
        needs at least one input token to produce logits: it then rolls back one token and
        re-feeds it."""
        position = committed.common_prefix(self.tokens)
        if position == len(committed) and position > 0:
            position -= 1
        return SyncPoint(session_id, position, committed.fingerprint(position),
                         committed.tokens[position:])

    def full_resync(self, session_id: str, committed: TokenHistory) -> SyncPoint:
        self.tokens = []
        return SyncPoint(session_id, 0, 0, list(committed.tokens), committed.prefill_length)

    def record(self, committed: TokenHistory, speculative: list[int]) -> None:
        self.tokens = committed.tokens + speculative

    def record_proposal(self, committed: TokenHistory, proposed: list[int]) -> None:
        """After a draft call, which fed every proposed token but the last. A draft that
        reads the target's states keeps none of them: the next call re-feeds the accepted
        ones with the target's states, so its cache holds target-state entries for every
        committed position, as in training (EAGLE's training-time test)."""
        self.record(committed, [] if committed.target_hidden is not None else proposed[:-1])


def draft_hidden_rows(committed: TokenHistory, sync: SyncPoint) -> torch.Tensor:
    """The target's states a feature draft reads with sync's catch-up tokens: the one
    before each of them (HiddenStateLog.before). DraftUnavailable when they are not known
    yet: the round goes target-only, which fills them in."""
    log = committed.target_hidden
    rows = None if log is None else log.before(sync.committed_position, len(sync.append))
    if rows is None:
        raise DraftUnavailable("the target's hidden states do not cover the committed "
                               "prefix yet")
    return rows
