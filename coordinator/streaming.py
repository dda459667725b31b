"""Cut a growing generation into stream messages without ever taking text back.

Two things may still change the tail of what was generated so far: a stop string that
is completed by a later round (the output is cut before it), and a multi-byte character
split across tokens (decoded as U+FFFD until its last byte arrives). So the chunker
holds back a trailing U+FFFD and, when stop strings are set, the last len(stop) - 1
characters and the tokens behind them; the final message carries the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StreamChunker:
    def __init__(self, decode: Callable[[list[int]], str] | None, stop: Sequence[str]) -> None:
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent_text = ""
        self.sent_tokens = 0

    def update(self, tokens: list[int]) -> tuple[str, list[int]]:
        """The (text, token ids) safe to send now, given all tokens generated so far."""
        if self.decode is None:
            return "", self._take(tokens, len(tokens))
        text = self.decode(tokens)
        if any(s in text for s in self.stop):
            return "", []  # this round hit a stop string: the final message cuts before it
        if not text.startswith(self.sent_text):
            return "", []  # decoding revised earlier text: wait for the final message
        safe = len(text.rstrip("\ufffd")) - self.holdback
        if safe <= len(self.sent_text):
            return "", []
        if self.holdback == 0:
            count = len(tokens)
        else:  # tokens whose text lies wholly inside the safe part
            count = self.sent_tokens
            while count < len(tokens) and len(self.decode(tokens[: count + 1])) <= safe:
                count += 1
        delta = text[len(self.sent_text):safe]
        self.sent_text += delta
        return delta, self._take(tokens, count)

    def finish(self, text: str, tokens: list[int]) -> tuple[str, list[int]]:
        """The remainder, given the final text and token ids."""
        delta = text[len(self.sent_text):]
        self.sent_text = text
        return delta, self._take(tokens, len(tokens))

    def _take(self, tokens: list[int], count: int) -> list[int]:
        new = tokens[self.sent_tokens:count]
        self.sent_tokens = max(self.sent_tokens, count)
        return new
