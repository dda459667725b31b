"""The loop's suffix-decoding proposer: one request's tree plus the global cache.

Each round the request's own tree (its prompt and output so far, extended as tokens are
committed) and the tenant's global tree (specdec.core.suffix_cache.SuffixCache) each grow
a draft from the committed text's tail; the higher-scoring one is proposed as a token
tree: its most probable path is the chain, the other nodes are Alternatives. The tree is
chosen without drawing anything, so every node's q is one-hot at its first child and the
rule of specdec.core.tree_acceptance for deterministic nodes verifies it exactly, in
every sampling mode. A suffix round costs no draft forward; the draft's cache catches up
at its next Propose, as after a prompt-lookup round (CacheMirror).

SuffixEvidence calibrates a draft's score (its expected kept tokens under the counted
frequencies) against what the target keeps, so the loop can weigh a suffix round against
prompt lookup and the draft model in tokens per second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdec.core.acceptance import SharedCalibration
from specdec.core.history import TokenHistory
from specdec.core.interfaces import Proposal
from specdec.core.policy import best_undrafted_length
from specdec.core.sampling import SamplingParams
from specdec.core.stats import SUFFIX
from specdec.core.suffix_cache import (
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MIN_TOKEN_PROB,
    SuffixCache,
    SuffixDraft,
    SuffixTree,
    speculate,
)
from specdec.core.tree_acceptance import Alternatives
from specdec.settings import default


def draft_to_proposal(draft: SuffixDraft, vocab_size: int, params: SamplingParams,
                      elapsed_s: float = 0.0) -> Proposal:
    """A draft as the loop's Proposal: the chain follows each node's first (most probable)
    child from the root; the other nodes are alternatives in the draft's order, which
    keeps every parent before its children. Sampled requests get one-hot q rows, one per
    node with children (Alternatives.q_nodes), each at the node's first child."""
    first_child: dict[int, int] = {}
    for index, parent in enumerate(draft.parents):
        first_child.setdefault(parent, index)
    chain: list[int] = []
    node = -1
    while node in first_child:
        node = first_child[node]
        chain.append(node)
    ids = {old: new for new, old in enumerate(chain)}
    others = [index for index in range(len(draft)) if index not in ids]
    for offset, old in enumerate(others):
        ids[old] = len(chain) + offset
    ids[-1] = -1
    alternatives = Alternatives(tuple(draft.tokens[old] for old in others),
                                tuple(ids[draft.parents[old]] for old in others))
    tokens = [draft.tokens[old] for old in chain]
    probs = None
    if not params.greedy:
        node_tokens = [*tokens, *alternatives.tokens]
        first_of: dict[int, int] = {}
        for new in range(len(node_tokens)):  # rank 0: the chain child, else the first
            parent = new - 1 if new < len(chain) else alternatives.parents[new - len(chain)]
            first_of.setdefault(parent, node_tokens[new])
        rows = alternatives.q_nodes(len(tokens))
        probs = torch.zeros(len(rows), vocab_size)
        probs[torch.arange(len(rows)), torch.tensor([first_of[row] for row in rows])] = 1.0
    return Proposal(tokens, probs, elapsed_s, alternatives=alternatives, source=SUFFIX)


def matched_depth(draft: SuffixDraft, emitted: Sequence[int]) -> tuple[int, int]:
    """(tokens of the draft's deepest path equal to emitted's start, how deep emitted lets
    the draft be judged). With a deterministic tree the kept path is exactly that match,
    whoever proposed the round, since the emitted tokens have the target's law."""
    node, depth = -1, 0
    for token in emitted:
        child = next((index for index, parent in enumerate(draft.parents)
                      if parent == node and draft.tokens[index] == token), None)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth, len(emitted)


class SuffixEvidence:
    """Per session: how the drafts' scores compare with the tokens the target kept.

    A round's score counts only nodes no deeper than the emitted tokens reach (the rest
    could not be judged); kept = the matched depth. Every round with a draft is evidence,
    used or not (as for LookupEvidence). The counts are discounted per round and shrunk
    towards a prior mean with the weight of `prior_strength` scored tokens: the
    deployment's calibration (`shared`, recorded into as well) once it is measured, else
    `prior` kept per scored token."""

    def __init__(self, prior: float = 0.8, prior_strength: float = 2.0, decay: float = 0.95,
                 shared: SharedCalibration | None = None) -> None:
        self.prior = prior
        self.prior_strength = prior_strength
        self.decay = decay
        self.shared = shared
        self.kept = self.scored = 0.0

    def observe(self, draft: SuffixDraft, emitted: Sequence[int]) -> None:
        kept, judged = matched_depth(draft, emitted)
        scored = sum(prob for index, prob in enumerate(draft.probs)
                     if draft.depth(index) <= judged)
        self.kept = self.kept * self.decay + kept
        self.scored = self.scored * self.decay + scored
        if self.shared is not None:
            self.shared.record(kept, scored)

    @property
    def calibration(self) -> float:
        measured = self.shared.rate() if self.shared is not None else None
        prior = self.prior if measured is None else measured
        return (self.kept + prior * self.prior_strength) / (self.scored + self.prior_strength)

    def expected_tokens(self, draft: SuffixDraft, nodes: int) -> float:
        """Tokens a round verifying the draft's first `nodes` nodes emits on average."""
        return 1.0 + self.calibration * sum(draft.probs[:nodes])

    def nodes_to_use(self, draft: SuffixDraft, value: Callable[[int, float], float | None],
                     rival: float | None) -> tuple[int, float | None]:
        """best_undrafted_length over the draft's nodes in best-first order (every prefix
        is a tree)."""
        return best_undrafted_length(len(draft), lambda nodes: self.expected_tokens(draft, nodes),
                                     value, rival)


@dataclass
class SuffixProposer:
    """One request's suffix decoding: its own tree over prompt and output, and the
    tenant's part of the global cache (None: this request's text only)."""

    vocab_size: int
    max_tokens: int  # most nodes a draft has (the coordinator's SPECDEC_SUFFIX_MAX_TOKENS)
    cache: SuffixCache | None = None
    tenant: str = ""
    max_depth: int = default("suffix-max-tree-depth")
    max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR
    min_token_prob: float = DEFAULT_MIN_TOKEN_PROB
    # The tree starts from at most this many of the latest committed tokens (0: all):
    # indexing costs the coordinator time and memory per token, and prompt lookup still
    # searches the whole text.
    prompt_tokens: int = default("suffix-prompt-tokens")
    tree: SuffixTree = field(init=False)
    _indexed: int = field(init=False, default=0)  # committed length the tree reflects
    _fingerprint: int = field(init=False, default=0)  # the committed text's at that length
    _open_paths: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"a suffix proposer needs max_tokens >= 1, got {self.max_tokens}")
        self.tree = SuffixTree(self.max_depth)

    def _index(self, committed: TokenHistory) -> None:
        """Bring the request's tree up to the committed text, in the time of the tokens
        added since (it only grows during a generation; a cut at a stop string ends it,
        and a history that no longer extends the indexed one is indexed afresh, from its
        latest prompt_tokens tokens)."""
        if self._indexed == 0 or not committed.extends(self._indexed, self._fingerprint):
            self.tree, self._open_paths = SuffixTree(self.max_depth), []
            self._indexed = (max(0, len(committed) - self.prompt_tokens)
                             if self.prompt_tokens > 0 else 0)
        for token in committed.tokens[self._indexed:]:
            self._open_paths = self.tree.append(self._open_paths, token)
        self._indexed, self._fingerprint = len(committed), committed.fingerprint()

    def draft(self, committed: TokenHistory, limit: int) -> SuffixDraft | None:
        """The best-scoring draft of at most max_tokens nodes, none deeper than limit."""
        if limit <= 0:
            return None
        self._index(committed)
        tokens = committed.tokens
        budget = self.max_tokens
        own = speculate(self.tree, tokens, budget, limit, self.max_spec_factor,
                        self.min_token_prob)
        shared = (self.cache.speculate(self.tenant, tokens, budget, limit,
                                       self.max_spec_factor, self.min_token_prob)
                  if self.cache is not None else None)
        if own is None or (shared is not None and shared.score > own.score):
            return shared
        return own

    def proposal(self, draft: SuffixDraft, params: SamplingParams,
                 elapsed_s: float = 0.0) -> Proposal:
        return draft_to_proposal(draft, self.vocab_size, params, elapsed_s)

    def propose(self, committed: TokenHistory, limit: int,
                params: SamplingParams) -> Proposal | None:
        started = time.perf_counter()
        found = self.draft(committed, limit)
        if found is None:
            return None
        return self.proposal(found, params, time.perf_counter() - started)

    def finish(self, output: Sequence[int]) -> None:
        """The request's output joins the tenant's global tree."""
        if self.cache is not None:
            self.cache.add(self.tenant, output)
