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


class NgramIndex:
    """Where each n-gram of a token history (min_ngram <= n <= max_ngram) last began,
    among those followed by at least one token: a lookup's question, answered in the
    time of the tokens added since the last one, so a round costs the coordinator the
    same at any context length. One per generation; a history that no longer extends
    the indexed one (a cut at a stop string) is indexed afresh."""

    def __init__(self, min_ngram: int = DEFAULT_MIN_NGRAM,
                 max_ngram: int = DEFAULT_MAX_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got "
                             f"{min_ngram} and {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._starts: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start
        self._indexed = 0  # history length the index reflects
        self._fingerprint = 0  # the history's fingerprint at that length

    def _update(self, history: TokenHistory) -> None:
        if not history.extends(self._indexed, self._fingerprint):
            self._starts, self._indexed = {}, 0
        tokens = history.tokens
        # The n-grams now followed by a token that were not at the last update: those
        # ending at positions indexed - 1 .. len - 2. A later start overwrites an earlier
        # one, so each n-gram maps to its latest occurrence.
        for n in range(self.min_ngram, self.max_ngram + 1):
            first, stop = max(0, self._indexed - n), len(tokens) - n
            if stop > first:
                grams = zip(*(tokens[first + i:stop + i] for i in range(n)), strict=True)
                self._starts.update(zip(grams, range(first, stop), strict=True))
        self._indexed, self._fingerprint = len(tokens), history.fingerprint()

    def continuation(self, history: TokenHistory, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the latest earlier occurrence of the
        longest matching tail n-gram; [] when none occurred."""
        if max_tokens <= 0:
            return []
        self._update(history)
        tokens = history.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = self._starts.get(tuple(tokens[-n:]))
            if start is not None:
                source = start + n
                # Copy token by token so that a match inside a repeating stretch continues
                # the repetition past the end of the history (period p: p tokens, then
                # again).
                out: list[int] = []
                for offset in range(max_tokens):
                    index = source + offset
                    out.append(tokens[index] if index < len(tokens) else out[index - len(tokens)])
                return out
        return []


def find_continuation(tokens: Sequence[int], max_tokens: int, min_ngram: int = DEFAULT_MIN_NGRAM,
                      max_ngram: int = DEFAULT_MAX_NGRAM) -> list[int]:
    """NgramIndex.continuation for a one-off question (it indexes the whole history)."""
    if max_tokens <= 0 or not 1 <= min_ngram <= max_ngram:
        return []
    return NgramIndex(min_ngram, max_ngram).continuation(TokenHistory(tokens), max_tokens)


@dataclass(frozen=True)
class PromptLookup:
    """The loop's model-free proposer; vocab_size is the target's (q spans it)."""

    vocab_size: int
    max_tokens: int = DEFAULT_LOOKUP_TOKENS
    min_ngram: int = DEFAULT_MIN_NGRAM
    max_ngram: int = DEFAULT_MAX_NGRAM

    def __post_init__(self) -> None:
        self.index()  # checks the n-gram bounds

    def index(self) -> NgramIndex:
        """A generation's own index of its history, for propose."""
        return NgramIndex(self.min_ngram, self.max_ngram)

    def propose(self, committed: TokenHistory, limit: int, params: SamplingParams,
                index: NgramIndex | None = None) -> Proposal | None:
        """A proposal of at most min(max_tokens, limit) tokens, or None without a match.
        index: the generation's (kept between rounds); None indexes committed afresh."""
        started = time.perf_counter()
        index = index if index is not None else self.index()
        tokens = index.continuation(committed, min(self.max_tokens, limit))
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
