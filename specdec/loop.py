"""The speculative loop, written against the Drafter and Verifier interfaces.

One round: the draft proposes k tokens, the target verifies them in one pass and
returns how many it keeps plus one token of its own; the committed history grows by
accepted_len + 1. Every service call names the committed position, so the caches stay
in sync however rounds end. The same loop runs in tests, benchmarks and the coordinator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.history import HiddenStateLog, TokenHistory
from specdec.interfaces import Drafter, DraftUnavailable, Proposal, Verifier
from specdec.policy import (
    AlternativesPolicy,
    CostedPolicy,
    DraftBackoff,
    FixedLength,
    LengthPolicy,
)
from specdec.prompt_lookup import LookupEvidence, PromptLookup
from specdec.rejection import NO_ALTERNATIVES
from specdec.sampling import SamplingParams
from specdec.stats import GenerationStats


@dataclass
class GenerateConfig:
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int = 4  # 0 = target only
    # Stop a proposal after a token the draft gives less than this probability (0 = off).
    draft_confidence: float = 0.0
    # Greedy: this many of the draft's next-best tokens verified beside its chain (0 = off).
    num_alternatives: int = 0
    # Tried before the draft each round; a hit replaces the draft's proposal (None = off).
    prompt_lookup: PromptLookup | None = None
    eos_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    session_id: str = ""


@dataclass(frozen=True)
class RoundEvent:
    """What one round did; observers (tracing, metrics, streaming) read it."""

    index: int
    position_before: int
    position_after: int
    asked: int  # of the draft model (0 in a prompt-lookup round)
    proposal: Proposal | None  # proposal.source says whose
    accepted_len: int  # draft tokens kept: the chain's, and a kept alternative
    emitted: list[int]
    bonus: bool
    verify_s: float
    verify_forward_s: float
    resyncs: int
    degraded: bool
    alternative_token: int | None = None  # kept in place of proposal.tokens[accepted_len - 1]


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "length", "eos" or "stop"
    stats: GenerationStats
    text: str | None = None


class StopChecker:
    """Finds stop strings in the decoded continuation; decoding is the caller's."""

    def __init__(self, stop: Sequence[str], decode: Callable[[list[int]], str] | None) -> None:
        if stop and decode is None:
            raise ValueError("stop strings need a tokenizer to decode the output")
        self.stop = [s for s in stop if s]
        self.decode = decode

    def find(self, token_ids: list[int]) -> tuple[int, str] | None:
        """(tokens to keep, text before the stop string) if a stop string appeared."""
        if not self.stop or self.decode is None:
            return None
        text = self.decode(token_ids)
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if not hits:
            return None
        cut = min(index for index, _ in hits)
        # Keep the shortest token prefix whose text contains the stop string's start.
        for keep in range(1, len(token_ids) + 1):
            if len(self.decode(token_ids[:keep])) > cut:
                return keep, text[:cut]
        return len(token_ids), text[:cut]


def _draft_inputs_ready(committed: TokenHistory) -> bool:
    """A feature draft needs the target's state at every committed position but the last
    (the token the target has not seen yet); the first round, target-only, provides them."""
    log = committed.target_hidden
    return log is None or len(log) >= len(committed) - 1


def _lookup_to_use(found: Proposal, evidence: LookupEvidence, policy: LengthPolicy,
                   asked: int) -> Proposal | None:
    """The lookup hit, cut to its best length, or None when the draft's round (or, with
    the draft off, a target-only round) is expected to emit tokens faster."""
    if not isinstance(policy, CostedPolicy):
        return found
    keep = evidence.tokens_to_use(len(found.tokens), policy.undrafted_round_seconds,
                                  policy.rate(asked))
    if keep == 0:
        return None
    if keep == len(found.tokens):
        return found
    return dataclasses.replace(found, tokens=found.tokens[:keep],
                               probs=found.probs[:keep] if found.probs is not None else None)


def generate(drafter: Drafter | None, verifier: Verifier, prompt_ids: Sequence[int],
             config: GenerateConfig, *, policy: LengthPolicy | None = None,
             decode: Callable[[list[int]], str] | None = None,
             on_round: Callable[[RoundEvent], None] | None = None,
             backoff: DraftBackoff | None = None) -> GenerationResult:
    params = config.sampling.with_seed()
    session_id = config.session_id or uuid.uuid4().hex
    policy = policy or FixedLength(config.num_draft_tokens)
    backoff = backoff or DraftBackoff()
    stopper = StopChecker(config.stop, decode)
    num_alternatives = config.num_alternatives if params.greedy else 0
    committed = TokenHistory(prompt_ids)
    if drafter is not None and getattr(drafter, "needs_target_hidden", False):
        committed.target_hidden = HiddenStateLog()
    prompt_len = len(committed)
    lookup_evidence = (LookupEvidence(config.prompt_lookup.max_tokens)
                       if config.prompt_lookup is not None else None)
    stats = GenerationStats()
    started = time.perf_counter()
    finish_reason = "length"
    stop_text: str | None = None
    try:
        while len(committed) - prompt_len < config.max_new_tokens:
            remaining = config.max_new_tokens - (len(committed) - prompt_len)
            # A round emits accepted_len + 1 tokens, so drafting past remaining - 1 is waste.
            asked = min(policy.next_length(), remaining - 1)
            if drafter is None or not _draft_inputs_ready(committed):
                asked = 0
            round_alternatives = (policy.next_alternatives(num_alternatives)
                                  if isinstance(policy, AlternativesPolicy) else num_alternatives)
            proposal = found = None
            if config.prompt_lookup is not None and remaining > 1:
                found = config.prompt_lookup.propose(committed, remaining - 1, params)
            if found is not None and lookup_evidence is not None:
                proposal = _lookup_to_use(found, lookup_evidence, policy, asked)
            looked_up = proposal is not None
            if looked_up:
                pass  # the draft model sits this round out; its cache catches up next time
            elif asked > 0 and backoff.ready():
                try:
                    proposal = drafter.propose(session_id, committed, asked, params,  # type: ignore[union-attr]
                                               config.draft_confidence, round_alternatives)
                    backoff.succeeded()
                except DraftUnavailable:
                    backoff.failed()
                    stats.degraded = True
            elif asked > 0:
                stats.degraded = True
            draft_tokens = proposal.tokens if proposal else []
            verification = verifier.verify(
                session_id, committed, draft_tokens, proposal.probs if proposal else None,
                params, proposal.alternatives if proposal else NO_ALTERNATIVES)
            if committed.target_hidden is not None and verification.hidden is not None:
                committed.target_hidden.record(verification.hidden_position, verification.hidden)
            emitted = verification.emitted(draft_tokens)
            accepted = verification.accepted_tokens
            position_before = len(committed)
            for cut, token in enumerate(emitted):
                if token in config.eos_token_ids:
                    emitted, finish_reason = emitted[: cut + 1], "eos"
                    break
            committed.extend(emitted)
            if found is not None and lookup_evidence is not None:
                lookup_evidence.observe(found.tokens, emitted)
            stats.record_round(len(draft_tokens), accepted,
                               len(proposal.alternatives) if proposal else 0,
                               verification.alternative_token is not None,
                               proposal.source if proposal else "")
            if not looked_up:  # the policy's evidence and costs are the draft model's
                policy.observe(asked if proposal else 0, accepted, proposal, verification)
            if proposal:
                stats.draft_s += proposal.elapsed_s
                stats.draft_forward_s += proposal.forward_s
                stats.resyncs += proposal.resyncs
                stats.wire_bytes += proposal.wire_bytes
            stats.verify_s += verification.elapsed_s
            stats.verify_forward_s += verification.forward_s
            stats.resyncs += verification.resyncs
            stats.wire_bytes += verification.wire_bytes
            if stats.rounds == 1:
                stats.first_token_s = time.perf_counter() - started
            hit = stopper.find(committed.tokens[prompt_len:])
            if hit is not None:
                keep, stop_text = hit
                committed.truncate(prompt_len + keep)
                emitted = emitted[: max(0, len(committed) - position_before)]
                finish_reason = "stop"
            if on_round is not None:
                on_round(RoundEvent(
                    stats.rounds - 1, position_before, len(committed),
                    0 if looked_up else asked, proposal,
                    accepted, emitted,
                    bool(draft_tokens) and verification.accepted_len == len(draft_tokens),
                    verification.elapsed_s, verification.forward_s,
                    verification.resyncs + (proposal.resyncs if proposal else 0),
                    proposal is None and asked > 0, verification.alternative_token))
            if finish_reason != "length":
                break
        output = committed.tokens[prompt_len:][: config.max_new_tokens]
    finally:
        for service in (drafter, verifier):
            if service is not None:
                # Best effort: a service that is down has lost the cache anyway, and the
                # services also drop idle sessions after a TTL.
                with contextlib.suppress(Exception):
                    service.release(session_id)
    stats.total_s = time.perf_counter() - started
    text = stop_text if stop_text is not None else (decode(output) if decode else None)
    return GenerationResult(output, finish_reason, stats, text)
