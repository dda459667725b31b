"""The hand-written held-out set: everyday conversations written by hand, no generator's
output, that no training context may hold (tests/test_handwritten_heldout.py).

A leaf module: the prompt generators' data paths (datagen, stream_prompts) read it to
leave its user turns out, and the held-out measurements (heldout, evaluate) to measure
on it.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

HANDWRITTEN_FILE = Path(__file__).with_name("handwritten_heldout.jsonl")
HANDWRITTEN = "hand-written"  # the hand-written set's name in reports
Messages = list[dict[str, str]]  # a conversation as the chat template takes it


def normal(text: str) -> str:
    """Text compared up to case and spacing."""
    return " ".join(text.lower().split())


@dataclass(frozen=True)
class HandwrittenPrompt:
    """A conversation of the hand-written held-out set; its last turn is the user's."""

    id: str
    kind: str  # advice, explanation, how-to, story, code, comparison, rewriting, lists
    turns: tuple[tuple[str, str], ...]  # (role, content) in order

    @property
    def messages(self) -> Messages:
        return [{"role": role, "content": content} for role, content in self.turns]

    @property
    def user_turns(self) -> list[str]:
        return [content for role, content in self.turns if role == "user"]


@functools.cache
def handwritten_held_out() -> tuple[HandwrittenPrompt, ...]:
    """The hand-written held-out set, kinds in turn (the file's order within a kind)."""
    by_kind: dict[str, list[HandwrittenPrompt]] = {}
    for line in HANDWRITTEN_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            turns = tuple((m["role"], m["content"]) for m in row["messages"])
            by_kind.setdefault(row["kind"], []).append(
                HandwrittenPrompt(row["id"], row["kind"], turns))
    mixed = itertools.chain.from_iterable(itertools.zip_longest(*by_kind.values()))
    return tuple(p for p in mixed if p is not None)


@functools.cache
def handwritten_texts() -> frozenset[str]:
    """Every user turn of the hand-written set, normalised (stream_prompts.normal): text
    no training context may hold as a user turn."""
    return frozenset(normal(text) for p in handwritten_held_out() for text in p.user_turns)
