"""The benchmark's prompt set: ~40 hand-written prompts in four categories.

Written by hand in a different style from the draft's templated training prompts
(specdec.draft_training.prompts); tests/test_bench.py checks that none coincides.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("prompts.jsonl")
CATEGORIES = ("chat", "story", "factual", "code")


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str  # the last user turn
    workload: str = "prompts"  # specdec.bench.workloads.WORKLOADS
    # Earlier turns of a conversation, (role, content) in order; empty: one user turn.
    history: tuple[tuple[str, str], ...] = ()

    @property
    def messages(self) -> list[tuple[str, str]]:
        """The conversation as (role, content): the history, then the user's `text`."""
        return [*self.history, ("user", self.text)]

    @property
    def transcript(self) -> str:
        """The conversation as plain text (the text alone for one user turn)."""
        if not self.history:
            return self.text
        return "\n\n".join(f"{role}: {content}" for role, content in self.messages)


def load_prompts(path: Path = PROMPTS_FILE) -> list[BenchPrompt]:
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(BenchPrompt(row["id"], row["category"], row["prompt"]))
    return prompts


def select(prompts: list[BenchPrompt], per_category: int | None) -> list[BenchPrompt]:
    """The first per_category prompts of each category (all with None), interleaved."""
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    chosen = [group[:per_category] if per_category else group for group in by_category.values()]
    longest = max((len(group) for group in chosen), default=0)
    return [group[i] for i in range(longest) for group in chosen if i < len(group)]


def chat_encoder(tokenizer: object | None) -> Callable[[str], list[int]]:
    """Prompt text -> token ids the way `specdec generate --chat` sends them."""
    encode = prompt_encoder(tokenizer)
    return lambda text: encode(BenchPrompt("", "", text))


def prompt_encoder(tokenizer: object | None) -> Callable[[BenchPrompt], list[int]]:
    """A prompt's conversation -> token ids in the chat template (one user turn the way
    `specdec generate --chat` sends it)."""
    if tokenizer is None:  # tiny test models: a deterministic byte-level stand-in
        return lambda prompt: [3 + (byte % 50) for byte in prompt.transcript.encode()][:48]

    def encode(prompt: BenchPrompt) -> list[int]:
        rendered = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": role, "content": content} for role, content in prompt.messages],
            add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    return encode
