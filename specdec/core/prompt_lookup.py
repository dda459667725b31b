"""Prompt lookup: draft tokens copied from earlier in the text, with no model.

Where the last n committed tokens (n from max_ngram down to min_ngram) occurred before,
the tokens that followed their latest earlier occurrence are proposed (transformers'
PromptLookupCandidateGenerator, vLLM's "ngram" method). Answers repeat their prompt's
names, code repeats identifiers, small models repeat themselves, and a matched n-gram's
next token is the target's more often than the draft model's guess
(scripts/draft_confidence_calibration.py measures both on the bench prompts).

The loop tries it before the draft model each round: a hit costs no draft forward. With
an adaptive policy the hit is used only when its expected tokens per second beat the
draft's (LookupEvidence), since how often a match is right depends on the text. The
proposal is deterministic, so its q is one-hot: the rule accepts token x with
probability p(x) and, on rejection, samples from p with x removed. Exactness holds for
every sampling mode.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.core.acceptance import ChainAcceptance, SharedChainAcceptance
from specdec.core.history import TokenHistory
from specdec.core.interfaces import Proposal
from specdec.core.policy import best_undrafted_length
from specdec.core.sampling import SamplingParams
from specdec.core.stats import PROMPT_LOOKUP
from specdec.settings import default

# Most tokens one lookup proposes (0 = off): a hit's tokens cost one target row each and
# no draft time.
DEFAULT_LOOKUP_TOKENS: int = default("prompt-lookup-tokens")
# The n-gram lengths matched, longest first. A 1-gram matches at most positions but its
# next token is right no more often than the draft model's, so matching starts at 2.
DEFAULT_MIN_NGRAM: int = default("prompt-lookup-min")
DEFAULT_MAX_NGRAM: int = default("prompt-lookup-max")


def find_continuation(tokens: Sequence[int], max_tokens: int, min_ngram: int = DEFAULT_MIN_NGRAM,
                      max_ngram: int = DEFAULT_MAX_NGRAM) -> list[int]:
    """Up to max_tokens tokens that followed the latest earlier occurrence of the longest
    matching tail n-gram (max_ngram >= n >= min_ngram); [] when none occurred."""
    if max_tokens <= 0 or min_ngram < 1:
        return []
    history = torch.tensor(tokens, dtype=torch.long)
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        # Windows that end before the last token: each is followed by at least one token.
        windows = history[:-1].unfold(0, n, 1)
        starts = (windows == history[-n:]).all(dim=1).nonzero()
        if len(starts):
            source = int(starts[-1]) + n
            # Copy token by token so that a match inside a repeating stretch continues
            # the repetition past the end of the history (period p: p tokens, then again).
            out: list[int] = []
            for offset in range(max_tokens):
                index = source + offset
                out.append(tokens[index] if index < len(tokens) else out[index - len(tokens)])
            return out
    return []


@dataclass(frozen=True)
class PromptLookup:
    """The loop's model-free proposer; vocab_size is the target's (q spans it)."""

    vocab_size: int
    max_tokens: int = DEFAULT_LOOKUP_TOKENS
    min_ngram: int = DEFAULT_MIN_NGRAM
    max_ngram: int = DEFAULT_MAX_NGRAM

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got "
                             f"{self.min_ngram} and {self.max_ngram}")

    def propose(self, committed: TokenHistory, limit: int,
                params: SamplingParams) -> Proposal | None:
        """A proposal of at most min(max_tokens, limit) tokens, or None without a match."""
        started = time.perf_counter()
        tokens = find_continuation(committed.tokens, min(self.max_tokens, limit),
                                   self.min_ngram, self.max_ngram)
        if not tokens:
            return None
        probs = None
        if not params.greedy:
            probs = torch.zeros(len(tokens), self.vocab_size)
            probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Proposal(tokens, probs, time.perf_counter() - started, source=PROMPT_LOOKUP)


class LookupEvidence:
    """Per session: how often the lookup's i-th token turned out to be the target's.

    Every round in which the lookup found a match is evidence, used or not: the emitted
    tokens have the target's law whoever proposed, so the share of rounds whose emitted
    token i equals the lookup's (given tokens 1..i-1 did) estimates its acceptance
    probability p(x_i) in every sampling mode. No exploration is needed to keep the
    estimate current. Counts are discounted per observation, like the draft's.

    shared: the deployment's rates (SharedChainAcceptance), recorded into and used as the
    prior where they are measured; elsewhere the prior is `prior`. A position the session
    has not judged lately (the lookup unused, so only token 1 was judged) then returns to
    what this deployment's text shows, not to a fixed guess.
    """

    def __init__(self, max_tokens: int, prior: float = 0.6, prior_strength: float = 2.0,
                 decay: float = 0.95, shared: SharedChainAcceptance | None = None) -> None:
        self.prior = prior
        self.prior_strength = prior_strength
        self.shared = shared
        self.chain = ChainAcceptance(max_tokens, decay)

    def observe(self, proposed: Sequence[int], emitted: Sequence[int]) -> None:
        """proposed: the lookup's tokens this round; emitted: the tokens committed."""
        matched = 0
        for token, target_token in zip(proposed, emitted, strict=False):
            if token != target_token:
                break
            matched += 1
        # Fewer emitted than proposed tokens (a rejection, an end) censor the rest.
        judged = min(len(proposed), len(emitted))
        self.chain.record(judged, matched)
        if self.shared is not None:
            self.shared.record(judged, matched)

    def prior_mean(self, position: int) -> float:
        measured = self.shared.rate(position) if self.shared is not None else None
        return self.prior if measured is None else measured

    def acceptance(self, position: int) -> float:
        return self.chain.rate(position, self.prior_mean, self.prior_strength)

    def expected_tokens(self, length: int) -> float:
        """Tokens a round verifying the first `length` lookup tokens emits on average."""
        return self.chain.expected_tokens(length, self.prior_mean, self.prior_strength)

    def tokens_to_use(self, available: int,
                      value: Callable[[int, float], float | None],
                      rival: float | None) -> tuple[int, float | None]:
        """best_undrafted_length over the lookup's first tokens."""
        return best_undrafted_length(available, self.expected_tokens, value, rival)
