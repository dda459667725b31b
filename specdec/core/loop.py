"""The speculative loop, written against the Drafter and Verifier interfaces.

One round: the draft proposes k tokens, the target verifies them in one pass and
returns how many it keeps plus one token of its own; the committed history grows by
accepted_len + 1. Every service call names the committed position, so the caches stay
in sync however rounds end. The same loop runs in tests, benchmarks and the coordinator.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.core.acceptance import SharedCalibration, SharedChainAcceptance
from specdec.core.history import FINAL_STATE, HiddenStateLog, TokenHistory
from specdec.core.interfaces import Drafter, DraftUnavailable, Proposal, Verification, Verifier
from specdec.core.offers import Offer, lookup_offer, suffix_offer
from specdec.core.policy import (
    AlternativesPolicy,
    CostedPolicy,
    DecodeAhead,
    DraftBackoff,
    FixedLength,
    LengthPolicy,
)
from specdec.core.prompt_lookup import LookupEvidence, NgramIndex, PromptLookup
from specdec.core.sampling import SamplingParams
from specdec.core.stats import GenerationStats
from specdec.core.suffix_cache import SuffixDraft
from specdec.core.suffix_proposer import SuffixEvidence, SuffixProposer
from specdec.core.tree_acceptance import NO_ALTERNATIVES
from specdec.settings import default


@dataclass
class GenerateConfig:
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int = default("num-draft-tokens")  # 0 = target only
    # Stop a proposal after a token the draft gives less than this probability (0 = off).
    draft_confidence: float = 0.0
    # A token tree: up to this many alternatives verified beside the chain (0 = a chain),
    # at most this many levels below it (1 = each follows a chain token; 0 = no limit).
    num_alternatives: int = 0
    max_alternative_depth: int = 0
    # Model-free proposers, tried before the draft each round; the hit expected to emit
    # tokens fastest replaces the draft's proposal (None = off).
    prompt_lookup: PromptLookup | None = None
    suffix: SuffixProposer | None = None
    # The deployment's lookup acceptance (CostModel.lookup_acceptance), the prior of an
    # adaptive request's lookup estimate; a fixed-length request keeps its own, so that
    # its choices do not follow other requests.
    lookup_acceptance: SharedChainAcceptance | None = None
    # The same for the suffix cache's calibration (CostModel.suffix_calibration).
    suffix_calibration: SharedCalibration | None = None
    eos_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    session_id: str = ""
    # A round without a proposal may have the target decode up to this many tokens in one
    # call while the policy will not draft (DecodeAhead), ending at an EOS: the tokens are
    # the same, the round trips between them are saved (1: a token per round).
    max_decode_steps: int = 1


@dataclass(frozen=True)
class RoundEvent:
    """What one round did; observers (tracing, metrics, streaming) read it."""

    index: int
    position_before: int
    position_after: int
    asked: int  # of the draft model (0 in a model-free round: lookup, suffix)
    proposal: Proposal | None  # proposal.source says whose
    accepted_len: int  # draft tokens kept: the chain's, and a kept alternative
    emitted: list[int]
    bonus: bool
    verify_s: float
    verify_forward_s: float
    resyncs: int
    degraded: bool
    # Alternatives kept after the chain's tokens (indices into proposal.alternatives).
    kept_branches: tuple[int, ...] = ()


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


@dataclass
class _Generation:
    """The state of one generate call; each method is one job of a round."""

    drafter: Drafter | None
    verifier: Verifier
    config: GenerateConfig
    policy: LengthPolicy
    backoff: DraftBackoff
    stopper: StopChecker
    params: SamplingParams
    session_id: str
    committed: TokenHistory
    prompt_len: int
    num_alternatives: int
    lookup_evidence: LookupEvidence | None
    lookup_index: NgramIndex | None = None
    suffix_evidence: SuffixEvidence | None = None
    costed: CostedPolicy | None = None  # the policy, where it prices rounds
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)
    finish_reason: str = "length"
    stop_text: str | None = None

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - (len(self.committed) - self.prompt_len)

    def draft_length(self) -> int:
        """Tokens to ask of the draft model this round (0: none). A round emits the
        accepted tokens plus one, so drafting past remaining - 1 is waste."""
        asked = min(self.policy.next_length(), self.remaining - 1)
        if self.drafter is None or not _draft_inputs_ready(self.committed):
            return 0
        return asked

    def look_up(self, asked: int) -> tuple[Proposal | None, SuffixDraft | None,
                                           Proposal | None]:
        """(the lookup's hit, the suffix cache's draft, the proposal to verify instead of
        drafting: whichever model-free one promises most, if it beats the draft's round;
        None: draft)."""
        if self.remaining <= 1 or (self.costed is not None and not self.costed.model_free):
            return None, None, None
        offers: list[Offer] = []
        lookup, found = self.config.prompt_lookup, None
        if lookup is not None and self.lookup_evidence is not None:
            found = lookup.propose(self.committed, self.remaining - 1, self.params,
                                   self.lookup_index)
            offer = (lookup_offer(found, self.lookup_evidence, self.policy, asked)
                     if found is not None else None)
            offers += [offer] if offer is not None else []
        suffix, drafted = self.config.suffix, None
        if suffix is not None and self.suffix_evidence is not None:
            drafted = suffix.draft(self.committed, self.remaining - 1)
            offer = (suffix_offer(drafted, suffix, self.suffix_evidence, self.policy, asked,
                                  self.params) if drafted is not None else None)
            offers += [offer] if offer is not None else []
        best = max(offers, key=lambda offer: offer.value, default=None)
        return found, drafted, best.proposal if best is not None else None

    def draft(self, asked: int) -> Proposal | None:
        """The draft model's proposal, or None: nothing asked, or the draft is backing off
        or unavailable (the round goes target-only, still exact)."""
        if asked == 0:
            return None
        if not self.backoff.ready():
            self.stats.degraded = True
            return None
        # A load-aware policy turns alternatives off when their rows cost the batch more
        # than they gain.
        alternatives = (self.policy.next_alternatives(self.num_alternatives)
                        if isinstance(self.policy, AlternativesPolicy) else self.num_alternatives)
        try:
            proposal = self.drafter.propose(  # type: ignore[union-attr]
                self.session_id, self.committed, asked, self.params,
                self.config.draft_confidence, alternatives, self.config.max_alternative_depth)
        except DraftUnavailable:
            self.backoff.failed()
            self.stats.degraded = True
            return None
        self.backoff.succeeded()
        return proposal

    def decode_steps(self, proposal: Proposal | None) -> int:
        """Target tokens this round's call may decode: 1 with a proposal or in the first
        round, else as many as the policy will go without drafting, within
        max_decode_steps and what remains (a feature draft needs the target's states of
        each token: 1)."""
        if (proposal is not None or self.committed.target_hidden is not None
                or not isinstance(self.policy, DecodeAhead) or self.stats.rounds == 0):
            return 1  # the first round's token streams right after the prefill
        return max(1, min(self.policy.undrafted_rounds(), self.config.max_decode_steps,
                          self.remaining))

    def verify(self, proposal: Proposal | None) -> Verification:
        draft_tokens = proposal.tokens if proposal else []
        verification = self.verifier.verify(
            self.session_id, self.committed, draft_tokens, proposal.probs if proposal else None,
            self.params, proposal.alternatives if proposal else NO_ALTERNATIVES,
            self.decode_steps(proposal), self.config.eos_token_ids)
        if self.committed.target_hidden is not None and verification.hidden is not None:
            self.committed.target_hidden.record(verification.hidden_position,
                                                verification.hidden)
        return verification

    def commit(self, emitted: list[int]) -> list[int]:
        """Append the round's tokens up to and including an EOS; returns those appended."""
        for cut, token in enumerate(emitted):
            if token in self.config.eos_token_ids:
                emitted, self.finish_reason = emitted[: cut + 1], "eos"
                break
        self.committed.extend(emitted)
        return emitted

    def record(self, proposal: Proposal | None, verification: Verification) -> None:
        """The round's counts and times into the request's stats."""
        self.stats.record_round(len(proposal.tokens) if proposal else 0,
                                verification.accepted_tokens,
                                len(proposal.alternatives) if proposal else 0,
                                len(verification.branch_tokens),
                                proposal.source if proposal else "")
        if proposal:
            self.stats.draft_s += proposal.elapsed_s
            self.stats.draft_forward_s += proposal.forward_s
            self.stats.resyncs += proposal.resyncs
            self.stats.wire_bytes += proposal.wire_bytes
        self.stats.decoded_tokens += len(verification.decoded)
        self.stats.verify_s += verification.elapsed_s
        self.stats.verify_forward_s += verification.forward_s
        self.stats.resyncs += verification.resyncs
        self.stats.wire_bytes += verification.wire_bytes
        if self.stats.rounds == 1:
            self.stats.first_token_s = time.perf_counter() - self.started

    def cut_at_stop_string(self, emitted: list[int], position_before: int) -> list[int]:
        """Truncate the output at a stop string that appeared; returns what of this
        round's tokens stays."""
        hit = self.stopper.find(self.committed.tokens[self.prompt_len:])
        if hit is None:
            return emitted
        keep, self.stop_text = hit
        self.committed.truncate(self.prompt_len + keep)
        self.finish_reason = "stop"
        return emitted[: max(0, len(self.committed) - position_before)]

    def release(self) -> None:
        for service in (self.drafter, self.verifier):
            if service is not None:
                # Best effort: a service that is down has lost the cache anyway, and the
                # services also drop idle sessions after a TTL.
                with contextlib.suppress(Exception):
                    service.release(self.session_id)

    def result(self, decode: Callable[[list[int]], str] | None) -> GenerationResult:
        output = self.committed.tokens[self.prompt_len:][: self.config.max_new_tokens]
        self.stats.total_s = time.perf_counter() - self.started
        text = self.stop_text if self.stop_text is not None else (
            decode(output) if decode else None)
        return GenerationResult(output, self.finish_reason, self.stats, text)


def generate(drafter: Drafter | None, verifier: Verifier, prompt_ids: Sequence[int],
             config: GenerateConfig, *, policy: LengthPolicy | None = None,
             decode: Callable[[list[int]], str] | None = None,
             on_round: Callable[[RoundEvent], None] | None = None,
             backoff: DraftBackoff | None = None) -> GenerationResult:
    """Speculative decoding of prompt_ids until max_new_tokens, an EOS or a stop string.

    Each round proposes tokens (a prompt-lookup hit or a suffix-cache draft, whichever
    promises most, else the draft model, else none),
    verifies them in one target pass, and commits the accepted tokens plus one of the
    target's: the recovered token at the first rejection, or the bonus token after a
    fully accepted proposal.
    """
    gen = _start(drafter, verifier, prompt_ids, config, policy, backoff, decode)
    try:
        while gen.remaining > 0:
            asked = gen.draft_length()
            found, drafted, proposal = gen.look_up(asked)
            looked_up = proposal is not None  # the draft model sits this round out
            if not looked_up:
                proposal = gen.draft(asked)
            verification = gen.verify(proposal)
            draft_tokens = proposal.tokens if proposal else []
            position_before = len(gen.committed)
            emitted = gen.commit(verification.emitted(draft_tokens))
            if found is not None and gen.lookup_evidence is not None:
                gen.lookup_evidence.observe(found.tokens, emitted)
            if drafted is not None and gen.suffix_evidence is not None:
                gen.suffix_evidence.observe(drafted, emitted)
            gen.record(proposal, verification)
            if not looked_up:  # the policy's acceptance evidence is the draft model's
                gen.policy.observe(asked if proposal else 0, verification.accepted_tokens,
                                   proposal, verification)
            elif gen.costed is not None and proposal is not None:
                gen.costed.observe_undrafted(proposal, verification)
            emitted = gen.cut_at_stop_string(emitted, position_before)
            if on_round is not None:
                bonus = bool(draft_tokens) and verification.accepted_len == len(draft_tokens)
                on_round(RoundEvent(
                    gen.stats.rounds - 1, position_before, len(gen.committed),
                    0 if looked_up else asked, proposal, verification.accepted_tokens,
                    emitted, bonus, verification.elapsed_s, verification.forward_s,
                    verification.resyncs + (proposal.resyncs if proposal else 0),
                    proposal is None and asked > 0, verification.kept_branches))
            if gen.finish_reason != "length":
                break
    finally:
        gen.release()
    result = gen.result(decode)
    if config.suffix is not None:
        config.suffix.finish(result.token_ids)
    return result


def _start(drafter: Drafter | None, verifier: Verifier, prompt_ids: Sequence[int],
           config: GenerateConfig, policy: LengthPolicy | None, backoff: DraftBackoff | None,
           decode: Callable[[list[int]], str] | None) -> _Generation:
    params = config.sampling.with_seed()
    committed = TokenHistory(prompt_ids)
    if drafter is not None and getattr(drafter, "needs_target_hidden", False):
        committed.target_hidden = HiddenStateLog(getattr(drafter, "target_hidden_spec",
                                                         FINAL_STATE))
    policy = policy or FixedLength(config.num_draft_tokens)
    costed = policy if isinstance(policy, CostedPolicy) else None
    shared_lookup = config.lookup_acceptance if costed is not None else None
    shared_suffix = config.suffix_calibration if costed is not None else None
    return _Generation(
        drafter, verifier, config,
        policy=policy,
        backoff=backoff or DraftBackoff(),
        stopper=StopChecker(config.stop, decode),
        params=params,
        session_id=config.session_id or uuid.uuid4().hex,
        committed=committed,
        prompt_len=len(committed),
        num_alternatives=config.num_alternatives,
        lookup_evidence=(LookupEvidence(config.prompt_lookup.max_tokens, shared=shared_lookup)
                         if config.prompt_lookup is not None else None),
        lookup_index=config.prompt_lookup.index() if config.prompt_lookup is not None else None,
        suffix_evidence=(SuffixEvidence(shared=shared_suffix)
                         if config.suffix is not None else None),
        costed=costed)
