"""Per-request speculative-decoding statistics, with vLLM's meanings."""

from __future__ import annotations

from dataclasses import dataclass, field

# Proposal.source: who proposed a round's tokens (here, not in specdec.core.interfaces, so that
# telemetry can read them without importing torch).
DRAFT_MODEL = "draft"
PROMPT_LOOKUP = "prompt_lookup"  # specdec.core.prompt_lookup: copied from earlier text
SUFFIX = "suffix"  # specdec.core.suffix_proposer: what followed the same text before
SOURCES = (DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX)


@dataclass
class GenerationStats:
    rounds: int = 0
    num_drafts: int = 0  # rounds that asked the draft for at least one token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    alternatives: int = 0  # token-tree nodes verified beside the chain
    kept_alternatives: int = 0  # of them on accepted paths, counted in accepted_tokens too
    # Prompt lookup's part of num_drafts / draft_tokens / accepted_tokens.
    lookup_drafts: int = 0
    lookup_draft_tokens: int = 0
    lookup_accepted_tokens: int = 0
    # Suffix decoding's part of them.
    suffix_drafts: int = 0
    suffix_draft_tokens: int = 0
    suffix_accepted_tokens: int = 0
    # Target tokens decoded after the first in rounds without a proposal (decode steps):
    # the target's forwards are rounds + decoded_tokens.
    decoded_tokens: int = 0
    resyncs: int = 0
    degraded: bool = False
    draft_s: float = 0.0  # time the loop waited on Propose
    verify_s: float = 0.0  # time the loop waited on Verify
    draft_forward_s: float = 0.0  # model time inside the draft
    verify_forward_s: float = 0.0  # model time inside the target
    wire_bytes: int = 0
    total_s: float = 0.0
    first_token_s: float = 0.0

    def record_round(self, num_drafted: int, accepted_len: int, alternatives: int = 0,
                     kept_alternatives: int = 0, source: str = "") -> None:
        """accepted_len: draft tokens kept, the accepted path's alternatives included;
        source: the proposal's (Proposal.source)."""
        self.rounds += 1
        if num_drafted == 0:
            return
        if source == PROMPT_LOOKUP:
            self.lookup_drafts += 1
            self.lookup_draft_tokens += num_drafted
            self.lookup_accepted_tokens += accepted_len
        elif source == SUFFIX:
            self.suffix_drafts += 1
            self.suffix_draft_tokens += num_drafted
            self.suffix_accepted_tokens += accepted_len
        self.alternatives += alternatives
        self.kept_alternatives += kept_alternatives
        self.num_drafts += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += accepted_len
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for position in range(accepted_len):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per drafting round, bonus or correction included (vLLM)."""
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else 1.0
