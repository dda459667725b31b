"""How many tokens to draft next round, and when to try a failing draft again."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from specdec.core.interfaces import Proposal, Verification


class LengthPolicy(Protocol):
    def next_length(self) -> int: ...

    def observe(self, asked: int, accepted_len: int, proposal: Proposal | None,
                verification: Verification) -> None:
        """asked: the draft length requested this round (0 if no proposal came back);
        the proposal may hold fewer tokens when the confidence gate ended it."""
        ...


@runtime_checkable
class CostedPolicy(Protocol):
    """A policy that can price a round (AdaptiveLength): the loop then uses a prompt
    lookup hit or a suffix draft only when it is expected to beat the draft's round.

    A round's value is the output tokens per second it adds to the deployment: alone,
    the session's own expected tokens over the round's seconds; when other sessions
    share the forward, less what its rows cost them (each row lengthens the forward all
    of them wait for)."""

    @property
    def model_free(self) -> bool:
        """Whether this round may verify a model-free proposal at all (the deployment's
        speculation gate may allow only target-only rounds); known after next_length."""
        ...

    def value(self, k: int) -> float | None:
        """The value of a round drafting k tokens (None: not known yet)."""
        ...

    def undrafted_value(self, k: int, expected_tokens: float) -> float | None:
        """The value of a round verifying k tokens proposed without the draft model
        (prompt lookup, suffix cache) that is expected to emit expected_tokens."""
        ...

    def observe_undrafted(self, proposal: Proposal, verification: Verification) -> None:
        """A round verified `proposal`, made without the draft model, instead of
        drafting: what it cost prices the next model-free rounds."""
        ...


def best_undrafted_length(available: int, expected_tokens: Callable[[int], float],
                          value: Callable[[int, float], float | None],
                          rival: float | None) -> tuple[int, float | None]:
    """(tokens of a model-free proposal to verify, of `available`, and that round's value):
    the length n whose round is worth most, value(n, expected_tokens(n)) (a CostedPolicy's
    undrafted_value), or 0 when the draft's round (rival) is worth more. Without prices
    (rival None, or a length not priced yet) all of them, valued None."""
    if rival is None:
        return available, None
    best_length, best_value = 0, rival
    for length in range(1, available + 1):
        worth = value(length, expected_tokens(length))
        if worth is None:
            return available, None
        if worth > best_value:
            best_length, best_value = length, worth
    return best_length, best_value if best_length else None


@runtime_checkable
class AlternativesPolicy(Protocol):
    """A policy that also decides how many alternatives a round verifies (AdaptiveLength
    under load: each is one more row in a forward other sessions share)."""

    def next_alternatives(self, limit: int) -> int:
        """At most `limit`; asked after next_length, for the same round."""
        ...

    def shares_forward(self) -> bool:
        """Whether other sessions are expected in this round's forward (then every
        tree node beside a chain lengthens the forward all of them wait for)."""
        ...


@runtime_checkable
class DecodeAhead(Protocol):
    """A policy that knows when it will draft nothing for a while: the loop may then
    ask the target for that many tokens in one call (Verifier.verify's decode_steps),
    which saves the round trips between them and changes no token."""

    def undrafted_rounds(self) -> int:
        """Rounds of one token each, from this one on, that draft nothing as the policy
        stands (1: it decides again next round); asked after next_length."""
        ...


# undrafted_rounds with no end in sight (FixedLength(0), a gated-off epoch): the loop's caps rule.
EVERY_ROUND = 1 << 30


class FixedLength:
    def __init__(self, num_draft_tokens: int) -> None:
        self.num_draft_tokens = num_draft_tokens

    def next_length(self) -> int:
        return self.num_draft_tokens

    def undrafted_rounds(self) -> int:
        return EVERY_ROUND if self.num_draft_tokens == 0 else 1

    def observe(self, asked: int, accepted_len: int, proposal: Proposal | None,
                verification: Verification) -> None:
        pass


class DraftBackoff:
    """Exponential backoff for a draft that failed: skip it, then probe it again."""

    def __init__(self, initial_s: float = 0.25, max_s: float = 5.0,
                 clock: object = time.monotonic) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._clock = clock
        self._delay_s = 0.0
        self._retry_at = 0.0

    def ready(self) -> bool:
        return self._clock() >= self._retry_at  # type: ignore[operator]

    def failed(self) -> None:
        self._delay_s = min(self.max_s, self._delay_s * 2 if self._delay_s else self.initial_s)
        self._retry_at = self._clock() + self._delay_s  # type: ignore[operator]

    def succeeded(self) -> None:
        self._delay_s = 0.0
        self._retry_at = 0.0
