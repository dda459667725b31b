"""Conversations for streaming distillation: the contexts the draft learns to continue.

Three kinds of context, mixed in every batch:
- a user turn from the project's prompt sets (their training split);
- a user turn the target writes itself (Magpie: the target samples after the chat
  template's user-turn prefix, so the turn reads like what a user of this model asks);
- a further user turn, written the same way, on a conversation the stream finished
  earlier (multi-turn continuation).

The user turns of the hand-written held-out set (heldout.py), the held-out prompts of
both prompt sets and any excluded text (the bench prompts, given by the caller) never
become a user turn: a turn equal to one, up to case and spacing, is dropped.

Sampling the user turn from the same prefix repeats itself, so a written turn that is a
near-duplicate of a recently kept one (RecentTurns) is dropped too.
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from specdec.draft_training.datagen import PROMPT_SETS, interleave_by_category
from specdec.draft_training.handwritten import handwritten_texts, normal
from specdec.draft_training.prompts import Prompt, split

# (prefixes, temperature, max_new_tokens) -> sampled continuations, each cut after the
# end-of-turn token when it came (so a turn without it was cut short).
WriteTurns = Callable[[list[list[int]], float, int], list[list[int]]]
KINDS = ("prompt-set", "magpie", "multi-turn")
_SENTINELS = ("SPECDEC_FIRST_TURN", "SPECDEC_ANSWER", "SPECDEC_NEXT_TURN")
# Two turns whose word 3-gram sets have a Jaccard similarity of at least this are one
# turn reworded: a changed word at either end of a dozen-word turn stays above it, a
# changed word in the middle or a different question falls below.
NEAR_DUPLICATE = 0.7
RECENT_TURNS = 4096  # kept written turns a new one is compared with
EXACT_TURNS = 65536  # kept written turns a new one may not equal (up to case and spacing)
Shingle = tuple[str, ...]


def shingles(text: str, n: int = 3) -> frozenset[Shingle]:
    """The word n-grams of `text` up to case, spacing and punctuation; a text of fewer
    than n words is its one shingle."""
    words = re.findall(r"\w+", normal(text))
    if len(words) < n:
        return frozenset({tuple(words)})
    return frozenset(tuple(words[i: i + n]) for i in range(len(words) - n + 1))


def similarity(a: str, b: str) -> float:
    """Jaccard similarity of the two texts' shingles."""
    first, second = shingles(a), shingles(b)
    return len(first & second) / len(first | second)


class RecentTurns:
    """The shingles of the last `size` kept turns, indexed by shingle so that a new turn
    is compared only with the kept turns it shares one with; and the last `exact` kept
    turns, normalised."""

    def __init__(self, size: int = RECENT_TURNS, exact: int = EXACT_TURNS,
                 threshold: float = NEAR_DUPLICATE) -> None:
        self.size, self.threshold = size, threshold
        self.kept: deque[tuple[int, frozenset[Shingle]]] = deque()
        self.holding: dict[Shingle, set[int]] = {}  # shingle -> kept turns holding it
        self.counts: dict[int, int] = {}  # kept turn -> its number of shingles
        self.added = 0
        self.exact: deque[str] = deque(maxlen=exact)
        self.exact_set: set[str] = set()

    def keep(self, text: str) -> bool:
        """Keep `text` unless it equals or nearly duplicates a kept turn; whether kept."""
        key, mine = normal(text), shingles(text)
        shared = Counter(turn for s in mine for turn in self.holding.get(s, ()))
        if key in self.exact_set or any(
                n / (len(mine) + self.counts[turn] - n) >= self.threshold
                for turn, n in shared.items()):
            return False
        if len(self.exact) == self.exact.maxlen:
            self.exact_set.discard(self.exact[0])
        self.exact.append(key)
        self.exact_set.add(key)
        turn, self.added = self.added, self.added + 1
        self.kept.append((turn, mine))
        self.counts[turn] = len(mine)
        for s in mine:
            self.holding.setdefault(s, set()).add(turn)
        if len(self.kept) > self.size:
            old, old_shingles = self.kept.popleft()
            del self.counts[old]
            for s in old_shingles:
                self.holding[s].discard(old)
                if not self.holding[s]:
                    del self.holding[s]
        return True


@functools.cache
def split_prompt_sets() -> tuple[tuple[list[Prompt], list[Prompt]], ...]:
    """(training, held-out) prompts of each of the project's prompt sets, made once per
    process (the wide set tries many fills before it stops finding new ones)."""
    return tuple(split(make()) for _, make in PROMPT_SETS.values())


@functools.cache
def held_out_texts() -> frozenset[str]:
    """Every held-out prompt of the project's prompt sets, normalised."""
    return frozenset(normal(p.text) for _, held_out in split_prompt_sets() for p in held_out)


def training_prompts(seed: int) -> list[str]:
    """Both prompt sets' training split, categories interleaved, shuffled by seed."""
    prompts = [p for train, _ in split_prompt_sets() for p in interleave_by_category(train)]
    random.Random(seed).shuffle(prompts)
    return [p.text for p in prompts]


@dataclass(frozen=True)
class Context:
    kind: str  # one of KINDS
    prompt_ids: list[int]  # everything before the assistant's answer


class ChatFormat:
    """The chat template's pieces as token ids, cut out of rendered conversations."""

    def __init__(self, tokenizer) -> None:
        first, answer, following = _SENTINELS
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
             {"role": "user", "content": following}], add_generation_prompt=True,
            tokenize=False)
        user_prefix, rest = rendered.split(first)
        assistant_prefix, rest = rest.split(answer)
        between, _ = rest.split(following)
        self.tokenizer = tokenizer
        self.user_prefix = self.encode(user_prefix)  # system turn + the user-turn opening
        self.assistant_prefix = self.encode(assistant_prefix)  # closes the user turn
        between_ids = self.encode(between)
        # What follows an answer starts with the token that ends a turn (<|im_end|> in
        # ChatML); a finished answer ends with it, so the next user turn opens after it.
        self.end_of_turn = between_ids[0]
        self.next_user = between_ids[1:]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def user_turn(self, text: str) -> list[int]:
        """A first user turn as `specdec generate --chat` sends it."""
        return self.conversation([{"role": "user", "content": text}])

    def conversation(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation that ends with a user turn, followed by the assistant prefix."""
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        return self.encode(rendered)


class ConversationSource:
    """Contexts drawn in the proportions of `mix` (weights of prompt-set, magpie and
    multi-turn); written turns come from `write_turns` (the target sampling). A refused
    written turn leaves its context out rather than filling it with a prompt-set turn,
    so the prompt sets' share never grows past their weight. Finished conversations
    handed to `remember` are continued later, one more turn each."""

    def __init__(self, tokenizer, write_turns: WriteTurns, *,
                 mix: tuple[float, float, float], excluded: Iterable[str] = (),
                 seed: int = 0, max_context: int = 384, turn_tokens: int = 48,
                 turn_temperature: float = 1.0, remembered: int = 256) -> None:

        self.chat = ChatFormat(tokenizer)
        self.write_turns = write_turns
        self.excluded = (handwritten_texts() | held_out_texts()
                         | {normal(text) for text in excluded})
        self.rng = random.Random(seed)
        self.mix = mix
        self.max_context = max_context
        self.turn_tokens = turn_tokens
        self.turn_temperature = turn_temperature
        self.finished: deque[list[int]] = deque(maxlen=remembered)
        self._prompts = self._cycle(training_prompts(seed))
        self.recent = RecentTurns()
        self.dropped_turns = 0  # written turns refused: excluded, cut short or empty
        self.near_duplicates = 0  # written turns dropped as near-duplicates (RecentTurns)
        self.written_turns = 0  # written turns kept

    @staticmethod
    def _cycle(texts: list[str]) -> Iterator[str]:
        while True:
            yield from texts

    def allowed(self, text: str) -> bool:
        return normal(text) not in self.excluded

    def remember(self, prompt_ids: list[int], answer_ids: list[int]) -> None:
        """Keep a finished conversation (its answer ended its turn) to continue later."""
        ids = prompt_ids + answer_ids
        room = self.turn_tokens + len(self.chat.next_user) + len(self.chat.assistant_prefix)
        if answer_ids[-1:] == [self.chat.end_of_turn] and len(ids) + room < self.max_context:
            self.finished.append(ids)

    def next_batch(self, size: int) -> list[Context]:
        """`size` contexts drawn by `mix`, less those whose written turn was refused."""
        counts = [0, 0, 0]
        for _ in range(size):
            counts[self.rng.choices(range(3), weights=self.mix)[0]] += 1
        continued = [self.finished.popleft() for _ in range(min(counts[2], len(self.finished)))]
        counts[1] += counts[2] - len(continued)  # no finished conversation yet: new ones
        contexts = [Context("prompt-set", self._prompt_set_turn()) for _ in range(counts[0])]
        prefixes = [self.chat.user_prefix] * counts[1] + [c + self.chat.next_user
                                                          for c in continued]
        kinds = ["magpie"] * counts[1] + ["multi-turn"] * len(continued)
        for kind, prefix, turn in zip(kinds, prefixes, self._written_turns(prefixes),
                                      strict=True):
            if turn is not None:
                contexts.append(Context(kind, prefix + turn + self.chat.assistant_prefix))
        return contexts

    def _prompt_set_turn(self) -> list[int]:
        text = next(self._prompts)
        while not self.allowed(text):  # the training split holds none; excluded text may
            text = next(self._prompts)
        return self.chat.user_turn(text)

    def _written_turns(self, prefixes: list[list[int]]) -> list[list[int] | None]:
        """Each prefix's written user turn without its end-of-turn token, or None where
        the turn is refused or nearly repeats a kept one."""
        if not prefixes:
            return []
        sampled = self.write_turns(prefixes, self.turn_temperature, self.turn_tokens)
        turns: list[list[int] | None] = []
        for ids in sampled:
            text = self.chat.tokenizer.decode(ids[:-1]).strip()
            ended = ids[-1:] == [self.chat.end_of_turn]
            if not (ended and len(ids) > 3 and text and self.allowed(text)):
                self.dropped_turns += 1
                turns.append(None)
            elif not self.recent.keep(text):
                self.near_duplicates += 1
                turns.append(None)
            else:
                self.written_turns += 1
                turns.append(ids[:-1])
        return turns
