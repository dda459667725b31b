"""`specdec bench --workload`: the generated repetition workload (deterministic, every
family, material the answer repeats, none of it in the draft's training prompts) and
tiny-model runs of the bench and the load test with both workloads side by side."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from service_harness import Services
from test_bench import tiny_bench_models
from tiny_models import tiny_llama

from specdec import settings
from specdec.bench.harness import BenchModels, BenchSettings, run_bench
from specdec.bench.load import LoadPrompt, LoadSettings, run_load
from specdec.bench.prompts import CATEGORIES, load_prompts, prompt_encoder, select
from specdec.bench.workloads import (
    FAMILIES,
    PER_FAMILY,
    PROMPTS,
    REPETITION,
    SCHEMA,
    WORKLOADS,
    bench_texts,
    repetition_prompts,
    workload_prompts,
)
from specdec.commands.bench import add_parser, settings_from_args, write_outputs
from specdec.draft_training.prompts import generate_prompts
from specdec.draft_training.wide_prompts import generate_wide_prompts

ROOT = Path(__file__).resolve().parent.parent


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def test_the_workload_is_the_same_every_time_and_its_seed_changes_it() -> None:
    first, again = repetition_prompts(), repetition_prompts()
    assert first == again
    assert repetition_prompts(seed=1) != first
    # The same in a fresh interpreter with another hash seed: nothing depends on set order.
    code = ("import json; from specdec.bench.workloads import repetition_prompts; "
            "print(json.dumps([[p.id, p.text, p.history] for p in repetition_prompts()]))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert json.loads(out) == [[p.id, p.text, [list(turn) for turn in p.history]]
                               for p in first]


def test_every_family_is_present_with_distinct_prompts() -> None:
    prompts = repetition_prompts()
    assert [p.category for p in prompts] == [f for f in FAMILIES for _ in range(PER_FAMILY)]
    assert {p.workload for p in prompts} == {REPETITION}
    assert len({p.id for p in prompts}) == len({p.text for p in prompts}) == len(prompts)
    # Different functions and classes: every code-edit snippet opens with its own name.
    heads = {re.search(r"```python\n(\w+ \w+)", p.text).group(1)  # type: ignore[union-attr]
             for p in prompts if p.category == "code-edit"}
    assert len(heads) == PER_FAMILY and any(h.startswith("class ") for h in heads)
    # "all" is both workloads; per category selection keeps every family and category.
    everything = workload_prompts("all")
    assert [p.id for p in everything] == [p.id for p in load_prompts()] + [p.id for p in prompts]
    assert {p.workload for p in workload_prompts(PROMPTS)} == {PROMPTS}
    assert {p.category for p in select(everything, 1)} == set(CATEGORIES) | set(FAMILIES)
    with pytest.raises(ValueError):
        workload_prompts("nope")
    assert (*WORKLOADS, "all") == settings.BENCH_WORKLOADS


def test_the_prompts_hold_what_the_answer_repeats() -> None:
    prompts = repetition_prompts()
    for prompt in prompts:
        if prompt.category == "code-edit":
            code = prompt.text.split("```python\n")[1].removesuffix("```")
            assert len(code.splitlines()) >= 9 and prompt.text.startswith(
                "Return the following Python code with one change:")
            # a renamed or replaced name is one the code holds
            for name in re.findall(r"`(\w+)` (?:to|instead)", prompt.text):
                assert name in code, (prompt.id, name)
        elif prompt.category == "extraction":
            assert prompt.text.count(SCHEMA) == 1  # one schema, the same in every prompt
            number = re.search(r"INV-\d{4}-\d{4}", prompt.text)
            assert number is not None
        else:
            assert [role for role, _ in prompt.messages] == ["user", "assistant"] * 2 + ["user"]
            answers = [content for role, content in prompt.history if role == "assistant"]
            later_turns = [prompt.history[2][1], prompt.text]
            quoted = [q for turn in later_turns for q in re.findall(r'"([^"]+)"', turn)]
            assert len(quoted) == 3
            assert all(any(q in answer for answer in answers) for q in quoted), prompt.id
            # the second answer gives the first one's list again, changed in one place
            first, second = ({line.split(". ", 1)[1] for line in a.splitlines()
                              if line[:1].isdigit()} for a in answers)
            assert len(first & second) >= len(first) - 1 >= 4


def test_no_bench_text_is_a_training_prompt() -> None:
    """The held-out check of tests/test_bench.py, for every message of both workloads."""
    texts = bench_texts()
    # one message per single-turn prompt, five per conversation
    assert len(texts) == len(load_prompts()) + 2 * PER_FAMILY + 5 * PER_FAMILY
    generated = {_normal(p.text) for p in generate_prompts(count=20000)}
    generated |= {_normal(p.text) for p in generate_wide_prompts()}
    overlap = [text[:60] for text in texts if _normal(text) in generated]
    assert not overlap, f"bench texts equal to training prompts: {overlap}"


def test_a_conversation_goes_through_the_chat_template_turn_by_turn() -> None:
    class Template:
        def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: object) -> str:
            return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<a>"

        def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) for c in text]}

    prompt = next(p for p in repetition_prompts() if p.history)
    ids = prompt_encoder(Template())(prompt)
    rendered = "".join(map(chr, ids))
    assert rendered.count("<assistant>") == 2 and rendered.count("<user>") == 3
    assert rendered.endswith(f"<user>{prompt.text}</user><a>")


def test_the_workload_flag_reaches_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    def parsed(*flags: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_parser(parser.add_subparsers())  # reads SPECDEC_* now
        return parser.parse_args(["bench", *flags])

    monkeypatch.delenv("SPECDEC_WORKLOAD", raising=False)
    assert settings_from_args(parsed()).workload == "prompts"  # type: ignore[attr-defined]
    assert settings_from_args(parsed("--workload", "all")).workload == "all"  # type: ignore[attr-defined]
    monkeypatch.setenv("SPECDEC_WORKLOAD", "repetition")
    assert parsed().workload == "repetition"
    with pytest.raises(SystemExit):
        parsed("--workload", "nope")


@pytest.fixture()
def tiny_pair(tmp_path: Path) -> BenchModels:
    return tiny_bench_models(tmp_path)


def test_tiny_run_of_both_workloads_reports_ratios_per_workload(
        tiny_pair: BenchModels, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    settings = BenchSettings(
        modes=("greedy",), systems=("target-only", "specdec-local", "specdec-grpc"),
        lengths=("2",), per_category=1, repeats=1, max_new_tokens=6, max_length=4,
        calibration_repeats=1, warmup_tokens=4, progress=False, workload="all")

    def services() -> Services:
        return Services(tiny_pair.draft, tiny_pair.target, draft_token_map=tiny_pair.token_map)

    result = run_bench(settings, tiny_pair, services)  # type: ignore[arg-type]
    paths = write_outputs(result, tmp_path / "out", "specdec bench --workload all")
    data = json.loads(paths["json"].read_text())
    assert data["meta"]["workloads"] == [PROMPTS, REPETITION]
    assert {r["workload"] for r in data["records"]} == {PROMPTS, REPETITION}
    assert {r["category"] for r in data["records"]} == set(CATEGORIES) | set(FAMILIES)
    greedy = data["summary"]["greedy"]
    for workload in ("workload:prompts", "workload:repetition"):
        assert greedy["specdec-local k=2"][workload]["speedup"] > 0
        grpc = greedy["specdec-grpc k=2"][workload]
        assert grpc["speedup_same_shape"] > 0 and grpc["greedy_match"] == 1.0
    markdown = paths["markdown"].read_text()
    assert "### greedy: per workload" in markdown and "same shape" in markdown
    per_category = markdown.split("### greedy: per category")[1].split("###")[0]
    assert "workload:" not in per_category and "| code-edit |" in per_category


def test_the_load_test_runs_each_workload_and_its_ratio_at_each_level() -> None:
    torch.set_num_threads(1)
    stack = Services(tiny_llama(32, seed=2, layers=1), tiny_llama(32, seed=1))
    prompts = [LoadPrompt(f"{workload}-{i}", [1 + i, 2 + 3 * i, 3, 4], workload=workload)
               for workload in (PROMPTS, REPETITION) for i in range(2)]
    try:
        report = run_load(stack.stub, LoadSettings(
            (1, 2), ("target-only", "k=2"), max_new_tokens=6, warmup_tokens=0,
            progress=False), prompts)
    finally:
        stack.close()
    rows = report["levels"]
    assert [(r["concurrency"], r["workload"], r["mode"]) for r in rows] == [
        (c, w, m) for c in (1, 2) for w in (PROMPTS, REPETITION) for m in ("target-only", "k=2")]
    assert all(r["completed"] == 2 and r["mismatches"] == 0 for r in rows)
    assert all((r["speedup"] is None) == (r["mode"] == "target-only") for r in rows)
    assert report["settings"]["workloads"] == [PROMPTS, REPETITION]
