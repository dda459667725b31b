"""Per-position acceptance of a proposer's chain, discounted so that it follows the text.

Position i of a round is a trial when the proposer offered an i-th token and tokens
1..i-1 were accepted, and an accept when token i was accepted too. A round verifying the
first `length` proposed tokens then emits E = 1 + sum_j prod_{i <= j} a_i tokens on
average, with a_i the position's rate shrunk towards a prior mean. Counts are discounted
per recorded round, so code, lists and prose each pull the estimate their way in turn.

The draft model's adaptive length (specdec.core.adaptive) and the prompt-lookup gate
(specdec.core.prompt_lookup) each keep one per session. SharedChainAcceptance is one fed by
every session of a deployment: a new session's lookup estimate starts from the rates this
deployment's text has shown rather than from a fixed guess. SharedCalibration does the same
for the suffix cache's calibration of its drafts' scores (kept tokens per scored token).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# A prior mean: one for every position, or one per position.
PriorMean = float | Callable[[int], float]


class ChainAcceptance:
    """Discounted trials and accepts per position 1..max_length of a proposed chain."""

    def __init__(self, max_length: int, decay: float) -> None:
        self.decay = decay
        self.trials = [0.0] * (max_length + 1)  # indexed by position; [0] is unused
        self.accepts = [0.0] * (max_length + 1)

    @property
    def max_length(self) -> int:
        return len(self.trials) - 1

    def record(self, offered: int, accepted_len: int) -> None:
        """One round: `offered` tokens proposed, the first `accepted_len` accepted. A
        round that emitted fewer tokens than were offered (an end) passes offered = the
        tokens it could judge; positions past the first rejection are not trials."""
        self.trials = [count * self.decay for count in self.trials]
        self.accepts = [count * self.decay for count in self.accepts]
        for position in range(1, min(offered, accepted_len + 1, self.max_length) + 1):
            self.trials[position] += 1.0
            if position <= accepted_len:
                self.accepts[position] += 1.0

    def rate(self, position: int, prior_mean: PriorMean, prior_strength: float) -> float:
        """Acceptance at `position`; the prior alone past max_length."""
        mean = prior_mean(position) if callable(prior_mean) else prior_mean
        if not 1 <= position <= self.max_length:
            return mean
        return (self.accepts[position] + mean * prior_strength) / (
            self.trials[position] + prior_strength)

    def expected_tokens(self, length: int, prior_mean: PriorMean,
                        prior_strength: float) -> float:
        """Tokens a round verifying the first `length` proposed tokens emits on average."""
        total, survive = 1.0, 1.0
        for position in range(1, length + 1):
            survive *= self.rate(position, prior_mean, prior_strength)
            total += survive
        return total


class SharedChainAcceptance:
    """A ChainAcceptance that every session of a deployment records into (thread-safe),
    discounted slowly, so it holds the last few hundred rounds of all of them."""

    def __init__(self, max_length: int, decay: float = 0.995, min_trials: float = 10.0) -> None:
        self.min_trials = min_trials
        self._chain = ChainAcceptance(max_length, decay)
        self._lock = threading.Lock()

    @property
    def max_length(self) -> int:
        return self._chain.max_length

    def record(self, offered: int, accepted_len: int) -> None:
        with self._lock:
            self._chain.record(offered, accepted_len)

    def rate(self, position: int) -> float | None:
        """The measured acceptance at `position`; None with fewer than min_trials
        (discounted) trials there."""
        with self._lock:
            chain = self._chain
            if not 1 <= position <= chain.max_length or chain.trials[position] < self.min_trials:
                return None
            return chain.accepts[position] / chain.trials[position]


class SharedChainAcceptances:
    """A SharedChainAcceptance per kind of request (acceptance_key), made on first use."""

    def __init__(self) -> None:
        self._by_key: dict[str, SharedChainAcceptance] = {}
        self._lock = threading.Lock()

    def get(self, key: str, max_length: int) -> SharedChainAcceptance:
        with self._lock:
            shared = self._by_key.get(key)
            if shared is None or shared.max_length < max_length:
                shared = self._by_key[key] = SharedChainAcceptance(max_length)
            return shared


class SharedCalibration:
    """A ratio kept / scored that every session of a deployment records into (thread-safe),
    discounted slowly, so it holds the last few hundred rounds of all of them."""

    def __init__(self, decay: float = 0.995, min_scored: float = 10.0) -> None:
        self.decay = decay
        self.min_scored = min_scored
        self._kept = self._scored = 0.0
        self._lock = threading.Lock()

    def record(self, kept: float, scored: float) -> None:
        with self._lock:
            self._kept = self._kept * self.decay + kept
            self._scored = self._scored * self.decay + scored

    def rate(self) -> float | None:
        """kept / scored; None until min_scored (discounted) is recorded."""
        with self._lock:
            return self._kept / self._scored if self._scored >= self.min_scored else None


class SharedCalibrations:
    """A SharedCalibration per kind of request (acceptance_key), made on first use."""

    def __init__(self) -> None:
        self._by_key: dict[str, SharedCalibration] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> SharedCalibration:
        with self._lock:
            return self._by_key.setdefault(key, SharedCalibration())


def acceptance_key(greedy: bool) -> str:
    """The kind of request a deployment keeps acceptance priors per: greedy and sampled
    requests accept differently."""
    return "greedy" if greedy else "sampled"
