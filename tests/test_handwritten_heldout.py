"""The hand-written held-out set: its shape, no generator prompt equal to or holding one
of its user turns, the guard that keeps them out of every training context, and the
evaluation and the held-out curve measuring it first."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_pair, tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.draft_training import datagen, heldout, stream_prompts
from specdec.draft_training.handwritten import (
    HANDWRITTEN,
    handwritten_held_out,
    handwritten_texts,
    normal,
)
from specdec.draft_training.heldout import (
    GENERATED,
    build_held_out,
    held_out_sets,
    measure_agreement,
)
from specdec.draft_training.prompts import Prompt, generate_prompts, split
from specdec.draft_training.stream_prompts import ChatFormat, ConversationSource
from specdec.draft_training.wide_prompts import generate_wide_prompts

KINDS = ("advice", "explanation", "how-to", "story", "code", "comparison", "rewriting", "lists")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random target with SmolLM2's tokenizer."""
    target, _ = save_tiny_pair(tmp_path_factory.mktemp("handwritten"))
    return target


def test_the_set_has_every_kind_and_multi_turn_conversations() -> None:
    prompts = handwritten_held_out()
    kinds = Counter(p.kind for p in prompts)
    assert set(kinds) == set(KINDS) and min(kinds.values()) >= 9 and len(prompts) >= 72
    assert sum(len(p.turns) > 1 for p in prompts) >= 20
    assert len({p.id for p in prompts}) == len(prompts)
    turns = [normal(text) for p in prompts for text in p.user_turns]
    assert len(set(turns)) == len(turns) == len(handwritten_texts())
    for prompt in prompts:
        roles = [role for role, _ in prompt.turns]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], prompt.id
        assert all(content.strip() for _, content in prompt.turns), prompt.id
    # kinds in turn, so the first prompts of the set cover every kind
    assert {p.kind for p in prompts[:len(KINDS)]} == set(KINDS)


def test_no_generator_prompt_equals_or_holds_a_handwritten_turn() -> None:
    # Every prompt the generators make with the settings the pipeline uses: the templated
    # set stops finding new fills below 20000, and the wide set is made whole.
    generated = {normal(p.text) for p in [*generate_prompts(count=20000),
                                          *generate_wide_prompts()]}
    assert len(generated) > 9000
    assert not generated & handwritten_texts()
    holding = [(turn, text) for text in generated for turn in handwritten_texts()
               if turn in text]
    assert not holding, holding[:3]


def _user_turns(tokenizer, prompt_ids: list[int]) -> list[str]:
    text = tokenizer.decode(prompt_ids)
    return [turn.split("<|im_end|>")[0].strip() for turn in text.split("<|im_start|>user\n")[1:]]


def test_the_stream_drops_every_context_holding_a_handwritten_turn(
        tiny_target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    chat = ChatFormat(tokenizer)
    handwritten = [text for p in handwritten_held_out()[:6] for text in p.user_turns]
    mangled = [f"  {text.upper()}\n" for text in handwritten]
    allowed = "How long should I let bread dough rise in a cold kitchen?"
    # only the hand-written guard: the prompt sets' held-out prompts are not these
    monkeypatch.setattr(stream_prompts, "held_out_texts", frozenset)
    monkeypatch.setattr(stream_prompts, "training_prompts",
                        lambda seed: [*mangled, allowed, *handwritten])
    # written turns no two of which are near-duplicates (stream_prompts.RecentTurns)
    written = [f"How long should I let {dough} dough rise in a {room}?"
               for dough in ("bread", "pizza", "bagel", "brioche", "focaccia", "pretzel")
               for room in ("cold kitchen", "warm oven", "damp cellar", "sunny window")]
    rng = random.Random(0)

    def write_turns(prefixes: list[list[int]], temperature: float, n: int) -> list[list[int]]:
        return [chat.encode(rng.choice(mangled) if rng.random() < 0.5 else rng.choice(written))
                + [chat.end_of_turn] for _ in prefixes]

    source = ConversationSource(tokenizer, write_turns, mix=(0.4, 0.4, 0.2))
    turns, kinds = [], set()
    for _ in range(6):
        for context in source.next_batch(8):
            kinds.add(context.kind)
            turns += _user_turns(tokenizer, context.prompt_ids)
            source.remember(context.prompt_ids, chat.encode("Sure.") + [chat.end_of_turn])
    assert not [t for t in turns if normal(t) in handwritten_texts()]
    assert kinds == {"prompt-set", "magpie", "multi-turn"}
    assert source.dropped_turns > 0 and normal(allowed) in {normal(t) for t in turns}


def test_the_data_shards_prompts_drop_a_handwritten_turn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    handwritten = [text for p in handwritten_held_out()[8:16] for text in p.user_turns]
    others = ["Tell me about otters.", "Write a limerick about a sleepy cat."]
    prompts = [Prompt("chat", f" {text.lower()} ") for text in handwritten]
    prompts += [Prompt("story", text) for text in others]
    training = [p for p in prompts if not p.held_out]  # what the split leaves for training
    assert any(normal(p.text) in handwritten_texts() for p in training)
    monkeypatch.setitem(datagen.PROMPT_SETS, "templated", ("shard", lambda: prompts))
    kept = datagen.training_split("templated")
    assert {p.text for p in kept} == {p.text for p in training if p.text in others}


def test_the_evaluation_reports_the_handwritten_set_first(
        tiny_target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.draft_training.evaluate import evaluate, held_out_prompt_ids
    from specdec.engine.runner import ModelRunner

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    for name, (prefix, make) in list(datagen.PROMPT_SETS.items()):  # a few hundred each
        monkeypatch.setitem(datagen.PROMPT_SETS, name,
                            (prefix, lambda make=make: make(count=300)))
    chosen = held_out_prompt_ids(tokenizer, 9, HANDWRITTEN)
    expected = [tokenizer.apply_chat_template(p.messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"]
                for p in handwritten_held_out()[:9]]
    assert [ids for _, ids in chosen] == [list(ids) for ids in expected]
    assert [kind for kind, _ in chosen] == [p.kind for p in handwritten_held_out()[:9]]

    target = tiny_llama(len(tokenizer), seed=1, layers=2)
    draft = tiny_llama(len(tokenizer), seed=2, layers=1)
    report = evaluate(ModelRunner(draft), ModelRunner(target), tokenizer, num_prompts=1,
                      max_new_tokens=3, gamma=2)
    rows = [(row["prompt_set"], row["temperature"]) for row in report["acceptance"]]
    assert rows == [(HANDWRITTEN, 0.0), (HANDWRITTEN, 1.0), ("templated", 0.0),
                    ("templated", 1.0), ("wide", 0.0)]
    assert all(row["greedy_matches_target"] for row in report["acceptance"]
               if row["temperature"] == 0.0)


def test_the_curve_measures_the_handwritten_conversations_first(
        tiny_target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = (split(generate_prompts(count=300)), split(generate_wide_prompts(count=300)))
    monkeypatch.setattr(heldout, "split_prompt_sets", lambda: small)
    sets = held_out_sets(10)
    assert list(sets) == [HANDWRITTEN, GENERATED]
    assert sets[HANDWRITTEN] == [p.messages for p in handwritten_held_out()[:10]]
    conversations = [m for m in sets[HANDWRITTEN] if len(m) > 1][:1]
    assert conversations  # a multi-turn conversation among the first ten
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    token_map = list(range(0, len(tokenizer), 3))
    held_out = build_held_out(target, tokenizer, token_map, conversations, 3)
    rendered = tokenizer.apply_chat_template(conversations[0], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    start = held_out.answer_starts[0]
    assert held_out.sequences[0][:start] == list(rendered)
    assert len(held_out.sequences[0]) > start
    draft = AutoModelForCausalLM.from_pretrained(tiny_target.parent / "draft")
    figures = measure_agreement(draft, held_out)  # reads the rows of the mapped ids
    assert figures["positions"] == len(held_out.sequences[0]) - start
