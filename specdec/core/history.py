"""Token histories with prefix fingerprints: how two processes agree on a committed prefix.

Every Propose/Verify names a committed position and the fingerprint of the tokens before
it; a service whose cache holds a different prefix (a restart, an eviction, a stale
replica) detects it in O(1) and asks to be re-synced instead of silently diverging.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

_MODULUS = (1 << 61) - 1  # Mersenne prime: a polynomial hash with a tiny collision rate
_BASE = 1_000_003


def extend_fingerprint(fingerprint: int, token: int) -> int:
    return (fingerprint * _BASE + token + 1) % _MODULUS


class TokenHistory:
    """A token list that knows the fingerprint of each of its prefixes."""

    __slots__ = ("tokens", "_fingerprints", "target_hidden", "prefill_length")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._fingerprints: list[int] = [0]
        # Set by the loop when its draft reads the target's hidden states; the verifier
        # returns them for the positions it commits whenever this is present.
        self.target_hidden: HiddenStateLog | None = None
        self.extend(tokens)
        # The tokens it was created with (a prompt): what a session's first forward
        # prefills in one piece.
        self.prefill_length = len(self.tokens)

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
        if self.target_hidden is not None:
            self.target_hidden.truncate(length)

    def fingerprint(self, length: int | None = None) -> int:
        return self._fingerprints[len(self.tokens) if length is None else length]

    def extends(self, length: int, fingerprint: int) -> bool:
        """Whether this history's first `length` tokens have `fingerprint`: the text a
        caller indexed up to `length` is still its prefix (O(1))."""
        return length <= len(self.tokens) and self._fingerprints[length] == fingerprint

    def common_prefix(self, other: Sequence[int]) -> int:
        limit = min(len(self.tokens), len(other))
        for index in range(limit):
            if self.tokens[index] != other[index]:
                return index
        return limit


WIRE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class HiddenSpec:
    """Which of the target's states a draft reads, and how they travel.

    layers: the inputs of these decoder layers, side by side in this order (EAGLE-3's
    low, middle and high states); none: the final norm's output (what the LM head reads).
    wire_dtype: one of WIRE_DTYPES, the precision of the rows between services. They
    shape only q, so any precision keeps decoding exact; the residual stream before a
    late layer can leave float16's range, where bfloat16 keeps it.
    """

    layers: tuple[int, ...] = ()
    wire_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"hidden states travel as one of {', '.join(WIRE_DTYPES)}, "
                             f"not {self.wire_dtype!r}")


FINAL_STATE = HiddenSpec()  # the final norm's output in float16: the feature draft's


class HiddenStateLog:
    """The target's hidden state at each committed position, as verification returns
    them: what a feature draft reads (specdec.engine.feature_draft, specdec.engine.eagle3);
    `spec` says which states they are."""

    def __init__(self, spec: HiddenSpec = FINAL_STATE) -> None:
        self.spec = spec
        self._rows: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._rows)

    def record(self, position: int, rows: torch.Tensor) -> None:
        """rows[i] is the state at position + i; rows past a gap cannot be placed."""
        if position > len(self._rows):
            return
        del self._rows[position:]
        self._rows.extend(rows.unbind(0))

    def truncate(self, length: int) -> None:
        del self._rows[length:]

    def before(self, start: int, count: int) -> torch.Tensor | None:
        """States at positions start-1 .. start+count-2, one per token appended at start..
        (zeros before position 0); None if any of them is not known yet."""
        if not self._rows or start + count - 1 > len(self._rows):
            return None
        rows = self._rows[max(0, start - 1): start + count - 1]
        if start == 0:
            rows = [torch.zeros_like(self._rows[0]), *rows]
        return torch.stack(rows)


@dataclass(frozen=True)
class SyncPoint:
    """What the caller believes the service holds, and the committed tokens it lacks."""

    session_id: str
    committed_position: int
    fingerprint: int
    append: list[int]
    # At committed_position 0: the leading tokens the session's first forward prefilled
    # (its prompt; 0: not known). A re-sent session replays its cache the same way.
    prefill_length: int = 0

    @property
    def next_position(self) -> int:
        """Absolute position of the first token generated after this sync."""
        return self.committed_position + len(self.append)
