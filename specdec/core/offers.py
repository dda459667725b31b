"""Model-free proposals priced against the draft's round: one choice per round.

Prompt lookup and the suffix cache cost no draft forward; their rows still lengthen the
target's forward, which under load the other sessions share. Each is cut to the length (or
node count) its evidence says pays most, and offered only when it is expected to be worth
more than the draft's round (or, with the draft off, a target-only round). The loop
verifies the best offer instead of drafting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specdec.core.interfaces import Proposal
from specdec.core.policy import AlternativesPolicy, CostedPolicy, LengthPolicy
from specdec.core.prompt_lookup import LookupEvidence
from specdec.core.sampling import SamplingParams
from specdec.core.suffix_cache import SuffixDraft
from specdec.core.suffix_proposer import SuffixEvidence, SuffixProposer


@dataclass(frozen=True)
class Offer:
    """A model-free proposal and what it promises: expected tokens per second where the
    policy prices rounds, else expected tokens per round."""

    proposal: Proposal
    value: float


def lookup_offer(found: Proposal, evidence: LookupEvidence,
                 policy: LengthPolicy, asked: int) -> Offer | None:
    """The lookup hit, cut to its best length, or None when the draft's round (or, with
    the draft off, a target-only round) is expected to be worth more."""
    if not isinstance(policy, CostedPolicy):
        return Offer(found, evidence.expected_tokens(len(found.tokens)))
    keep, value = evidence.tokens_to_use(len(found.tokens), policy.undrafted_value,
                                         policy.value(asked))
    if keep == 0:
        return None
    value = value if value is not None else evidence.expected_tokens(keep)
    if keep == len(found.tokens):
        return Offer(found, value)
    return Offer(dataclasses.replace(
        found, tokens=found.tokens[:keep],
        probs=found.probs[:keep] if found.probs is not None else None), value)


def suffix_offer(draft: SuffixDraft, suffix: SuffixProposer, evidence: SuffixEvidence,
                 policy: LengthPolicy, asked: int, params: SamplingParams) -> Offer | None:
    """The suffix draft, cut to its best node count (a prefix of its best-first order is
    a tree), or None when the draft's round is expected to be worth more. When other
    sessions share the forward it is cut to its first path, as the draft's trees are."""
    if isinstance(policy, AlternativesPolicy) and policy.shares_forward():
        draft = draft.chain()
    if not isinstance(policy, CostedPolicy):
        return Offer(suffix.proposal(draft, params), evidence.expected_tokens(draft, len(draft)))
    nodes, value = evidence.nodes_to_use(draft, policy.undrafted_value, policy.value(asked))
    if nodes == 0:
        return None
    value = value if value is not None else evidence.expected_tokens(draft, nodes)
    return Offer(suffix.proposal(draft.cut(nodes), params), value)
