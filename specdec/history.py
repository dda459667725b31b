"""Token histories with prefix fingerprints: how two processes agree on a committed prefix.

Every Propose/Verify names a committed position and the fingerprint of the tokens before
it; a service whose cache holds a different prefix (a restart, an eviction, a stale
replica) detects it in O(1) and asks to be re-synced instead of silently diverging.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_MODULUS = (1 << 61) - 1  # Mersenne prime: a polynomial hash with a tiny collision rate
_BASE = 1_000_003


def extend_fingerprint(fingerprint: int, token: int) -> int:
    return (fingerprint * _BASE + token + 1) % _MODULUS


class TokenHistory:
    """A token list that knows the fingerprint of each of its prefixes."""

    __slots__ = ("tokens", "_fingerprints")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._fingerprints: list[int] = [0]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        fingerprint = self._fingerprints[-1]
        for token in tokens:
            token = int(token)
            fingerprint = extend_fingerprint(fingerprint, token)
            self.tokens.append(token)
            self._fingerprints.append(fingerprint)

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
        del self._fingerprints[length + 1:]

    def fingerprint(self, length: int | None = None) -> int:
        return self._fingerprints[len(self.tokens) if length is None else length]

    def common_prefix(self, other: Sequence[int]) -> int:
        limit = min(len(self.tokens), len(other))
        for index in range(limit):
            if self.tokens[index] != other[index]:
                return index
        return limit
