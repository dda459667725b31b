"""`specdec bench` behaviour on tiny random models: configurations, JSON, markdown, plots.

No timing assertions: the numbers of a tiny model on a shared CPU mean nothing.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cpu_features import BF16_AUTO_LINEAR
from service_harness import Services
from tiny_models import tiny_feature_draft, tiny_llama

from specdec.bench.configs import LLAMA_CPP_SYSTEMS, MODES, SYSTEMS, build_configs
from specdec.bench.costs import (
    CostCurve,
    alpha_from_tokens_per_round,
    bound,
    expected_tokens,
    measure_costs,
    read_bandwidth,
)
from specdec.bench.harness import BenchModels, BenchSettings, cost_label, run_bench
from specdec.bench.prompts import CATEGORIES, BenchPrompt, load_prompts, select
from specdec.commands.bench import add_parser, load_result, settings_from_args, write_outputs
from specdec.draft_training.prompts import generate_prompts
from specdec.draft_training.wide_prompts import generate_wide_prompts
from specdec.engine.shapes import DEFAULT_ALTERNATIVES


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def test_prompt_set_is_hand_written_and_disjoint_from_training_prompts() -> None:
    prompts = load_prompts()
    assert 36 <= len(prompts) <= 48
    assert {p.category for p in prompts} == set(CATEGORIES)
    assert len({p.id for p in prompts}) == len(prompts)
    assert min(sum(p.category == c for p in prompts) for c in CATEGORIES) >= 8
    generated = {_normal(p.text) for p in generate_prompts(count=20000)}
    assert len(generated) > 5000
    wide = {_normal(p.text) for p in generate_wide_prompts()}  # all it can make
    assert len(wide) > 4000
    generated |= wide
    overlap = [p.id for p in prompts if _normal(p.text) in generated]
    assert not overlap, f"bench prompts equal to training prompts: {overlap}"


def test_select_interleaves_categories() -> None:
    prompts = [BenchPrompt(f"{c}-{i}", c, f"{c} {i}") for c in ("a", "b") for i in range(3)]
    assert [p.id for p in select(prompts, 2)] == ["a-0", "b-0", "a-1", "b-1"]
    assert len(select(prompts, None)) == 6


def test_bound_formula() -> None:
    curve = CostCurve("x", {1: 0.1, 2: 0.2, 5: 0.2}, 0.01)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4.0
    # S(4) = E * T(1) / (4 T_d + T(5))
    assert bound(curve, 0.5, 4) == pytest.approx(expected_tokens(0.5, 4) * 0.1 / 0.24)
    assert curve.t_target(3.5) == pytest.approx(0.2)
    assert alpha_from_tokens_per_round(expected_tokens(0.7, 4), 4) == pytest.approx(0.7)


def test_configs_validate_names() -> None:
    names = [c.name for c in build_configs(("target-only", "specdec-grpc"), ("2", "adaptive"))]
    # gRPC brings its own same-shape baseline, target-only through the services (k=0)
    assert names == ["target-only", "specdec-grpc k=0", "specdec-grpc k=2",
                     "specdec-grpc k=adaptive"]
    with pytest.raises(ValueError):
        build_configs(("nope",), ("2",))
    with pytest.raises(ValueError):
        build_configs(("specdec-local",), ("0",))


def test_quick_flag_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDEC_DRAFT_COMPILE", raising=False)  # conftest sets it

    def settings_for(*flags: str) -> BenchSettings:
        parser = argparse.ArgumentParser()
        add_parser(parser.add_subparsers())  # reads SPECDEC_* now
        return settings_from_args(parser.parse_args(["bench", *flags]))

    settings = settings_for("--quick", "--repeats", "3")
    assert settings.modes == ("greedy",) and settings.per_category == 1
    assert settings.lengths == ("2", "4", "adaptive", "adaptive+a0") and settings.repeats == 3
    # A quick run leaves the draft eager, unless a flag or the environment asks.
    assert settings.draft_compile == "off"
    assert settings_for().draft_compile == "auto"
    assert settings_for("--quick", "--draft-compile", "auto").draft_compile == "auto"
    monkeypatch.setenv("SPECDEC_DRAFT_COMPILE", "on")
    assert settings_for("--quick").draft_compile == "on"


def test_draft_precision_flags_reach_the_settings_and_the_cost_label(
        tiny_pair: BenchModels) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    default = settings_from_args(parser.parse_args(["bench", "--dtype", "bfloat16"]))
    assert default.draft_precision == ("auto", "auto")
    same = settings_from_args(parser.parse_args(["bench", "--draft-dtype", "same"]))
    assert same.dtype == "auto"  # int8 weights where the operator runs, with bf16 activations
    assert same.draft_precision == ("bfloat16", "int8-if-available")
    assert cost_label(same, replace(tiny_pair, draft_precision="")) == "auto@int8@rowwise"
    own = settings_from_args(parser.parse_args(
        ["bench", "--dtype", "bfloat16", "--draft-dtype", "float32",
         "--draft-linear-kernel", "torch"]))
    assert own.draft_precision == ("float32", "torch")
    assert cost_label(own, tiny_pair) == f"bfloat16@{BF16_AUTO_LINEAR}@rowwise"
    # The table's label stays short; the chooser's timings belong to the report header.
    tiny_pair.draft_precision = "float32/torch"
    tiny_pair.draft_precision_detail = ("float32/torch, the fastest one-token step of "
                                        "bfloat16/onednn 5.0 ms, float32/torch 3.7 ms")
    assert cost_label(own, tiny_pair) == f"bfloat16@{BF16_AUTO_LINEAR}@rowwise, draft float32/torch"


def tiny_bench_models(tmp_path: Path) -> BenchModels:
    """A tiny target and a reduced-vocabulary draft (31 ids + UNK), saved for the gRPC
    system, as the bench's models."""
    torch.manual_seed(0)
    target = tiny_llama(64, seed=1)
    token_map = torch.arange(0, 64, 2)[:31]
    draft = tiny_llama(32, seed=2, layers=1)
    draft.save_pretrained(tmp_path / "draft")
    (tmp_path / "draft" / "token_map.json").write_text(
        json.dumps({"target_ids": token_map.tolist()}))
    return BenchModels(target, draft, token_map, None, (), str(tmp_path / "draft"))


@pytest.fixture()
def tiny_pair(tmp_path: Path) -> BenchModels:
    return tiny_bench_models(tmp_path)


def test_cost_calibration_measures_every_length_and_frees_its_sessions(
        tiny_pair: BenchModels) -> None:
    from specdec.engine.runner import ModelRunner

    torch.set_num_threads(1)
    target = ModelRunner(tiny_pair.target)
    draft = ModelRunner(tiny_pair.draft, 64, token_map=tiny_pair.token_map)
    ticks: list[None] = []
    curve = measure_costs(target, draft, label="tiny", context_len=16, max_k=5, repeats=3,
                          progress=lambda: ticks.append(None))
    assert sorted(curve.target_s) == [1, 2, 3, 4, 5]
    assert all(value > 0 for value in curve.target_s.values()) and curve.draft_s > 0
    assert all(low <= curve.target_s[k] <= high for k, (low, high) in curve.target_iqr.items())
    assert len(ticks) == 6  # one per target length, one for the draft
    assert not target._sessions and not draft._sessions  # calibration sessions released
    # The floor is the weights over this machine's read rate, measured once per process.
    assert curve.bandwidth == read_bandwidth(threads=1)
    assert 1e8 < curve.bandwidth < 1e13  # a memory system's rate, bytes per second
    assert curve.to_dict()["target_floor_s"] == curve.target_weight_bytes / curve.bandwidth


def test_tiny_run_writes_json_markdown_and_plots(tiny_pair: BenchModels, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    settings = BenchSettings(
        modes=("greedy", "t1"), lengths=("1", "3", "adaptive", "heuristic", "3+a0"),
        # llama.cpp runs the embedded target's GGUF, not this tiny pair.
        systems=tuple(system for system in SYSTEMS if system not in LLAMA_CPP_SYSTEMS),
        per_category=2,
        sampled_lengths=("3", "adaptive"), sampled_per_category=1, repeats=2, max_new_tokens=10,
        max_length=4, calibration_repeats=1, warmup_tokens=8, progress=False,
        compare_dtypes=("float32",))
    prompts = [p for p in load_prompts() if p.id[-2:] in ("01", "02")]

    def services() -> Services:
        return Services(tiny_pair.draft, tiny_pair.target, draft_token_map=tiny_pair.token_map,
                        draft_precision_text="float32/torch (as set)")

    def runners(name: str) -> tuple[object, object]:
        from specdec.engine.runner import ModelRunner

        return (ModelRunner(tiny_pair.target),
                ModelRunner(tiny_pair.draft, 64, token_map=tiny_pair.token_map))

    result = run_bench(settings, tiny_pair, services, prompts, runners)  # type: ignore[arg-type]
    paths = write_outputs(result, tmp_path / "out", "specdec bench --tiny")
    data = json.loads(paths["json"].read_text())
    expected = {"target-only", "hf-generate", "hf-assisted", "specdec-local k=1",
                "specdec-local k=3", "specdec-local k=adaptive", "specdec-local k=heuristic",
                "specdec-local k=3+a0", "specdec-grpc k=0", "specdec-grpc k=1",
                "specdec-grpc k=3", "specdec-grpc k=adaptive", "specdec-grpc k=3+a0"}
    assert set(data["meta"]["configs"]) == expected
    assert set(data["summary"]) == {"greedy", "t1"}
    # greedy: every config on 8 prompts; t1: target-only, 2 HF, 2 local, 3 gRPC on 4 prompts
    assert len(data["records"]) == (len(expected) * 8 + 8 * 4) * 2
    assert set(data["summary"]["t1"]) == {"target-only", "hf-generate", "hf-assisted",
                                          "specdec-local k=3", "specdec-local k=adaptive",
                                          "specdec-grpc k=0", "specdec-grpc k=3",
                                          "specdec-grpc k=adaptive"}
    greedy = data["summary"]["greedy"]
    for name in expected:
        entry = greedy[name]
        assert set(CATEGORIES) <= set(entry) and entry["all"]["tokens_per_s"] > 0
        assert len(entry["all"]["tokens_per_s_repeats"]) == 2
        if name == "specdec-grpc k=0":
            assert entry["all"]["greedy_match"] == 1.0 and "bound" not in entry["all"]
        elif name.startswith("specdec"):
            stats = entry["all"]
            assert stats["greedy_match"] == 1.0  # exactness, whatever the draft
            assert 0 <= stats["acceptance_rate"] <= 1 and stats["bound"] > 0
            assert "bound_ratio" in stats and stats["per_round"]["target_model_ms"] > 0
    assert greedy["specdec-grpc k=3"]["all"]["per_round"]["bytes"] > 0
    same_shape = greedy["specdec-grpc k=3"]["all"]
    assert same_shape["speedup_same_shape"] > 0 and same_shape["bound_same_shape"] > 0
    assert same_shape["bound_same_shape_ratio"] == pytest.approx(
        same_shape["speedup_same_shape"] / same_shape["bound_same_shape"])
    assert greedy["specdec-local k=adaptive"]["all"]["chosen_lengths"]
    assert set(data["costs"]["t_target_s"]) == {str(k) for k in range(1, 10)}
    assert [c["label"] for c in data["dtype_costs"]] == ["float32"]
    # The draft service's own precision, asked over gRPC (it may differ from the bench's).
    assert data["meta"]["grpc_draft_precision"] == "float32/torch (as set)"
    markdown = paths["markdown"].read_text()
    assert "the gRPC draft service chose float32/torch (as set)" in markdown
    for needle in ("## Measured costs", "## greedy", "## t1", "per category", "per round",
                   "specdec-grpc k=adaptive", "hf-assisted", "## Goals",
                   "against target-only over gRPC", "the services' own costs"):
        assert needle in markdown
    plots = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert plots == ["breakdown-greedy.png", "breakdown-t1.png", "speedup-greedy.png",
                     "speedup-t1.png"]
    # --report-from: the same JSON and markdown again, from the JSON alone
    again, command = load_result(tmp_path / "out")
    assert command == "specdec bench --tiny"
    rewritten = write_outputs(again, tmp_path / "again", command)
    assert json.loads(rewritten["json"].read_text()) == data
    assert rewritten["markdown"].read_text() == markdown


def test_alternatives_suffix_sets_the_alternatives_and_keeps_the_length() -> None:
    from specdec.bench.systems import alternatives, grpc_request

    configs = {c.name: c for c in build_configs(("specdec-local",),
                                                ("2", "2+a0", "adaptive@0.6+a3"))}
    plain, chain, gated = (configs[f"specdec-local k={n}"] for n in
                           ("2", "2+a0", "adaptive@0.6+a3"))
    assert plain.alternatives is None and alternatives(plain) == 0  # a fixed length: a chain
    adaptive = build_configs(("specdec-local",), ("adaptive",))[0]
    assert alternatives(adaptive) == DEFAULT_ALTERNATIVES
    assert (chain.fixed_length, chain.alternatives, alternatives(chain)) == (2, 0, 0)
    assert (gated.policy, gated.gate, gated.alternatives) == ("adaptive", 0.6, 3)
    request = grpc_request(chain, MODES["greedy"], [1, 2], 8, seed=1)
    assert request.speculation.HasField("num_alternatives")
    assert request.speculation.num_alternatives == 0
    assert not grpc_request(plain, MODES["greedy"], [1, 2], 8, 1).speculation.HasField(
        "num_alternatives")  # as served
    with pytest.raises(ValueError, match="alternatives"):
        build_configs(("specdec-local",), ("2+ax",))


def test_lookup_suffix_sets_prompt_lookup_and_combines_with_alternatives() -> None:
    from specdec.bench.systems import grpc_request, prompt_lookup
    from specdec.core.prompt_lookup import DEFAULT_LOOKUP_TOKENS

    configs = {c.name: c for c in build_configs(("specdec-local",),
                                                ("adaptive", "adaptive+p0", "2+a0+p4"))}
    plain, off, both = (configs[f"specdec-local k={n}"] for n in
                        ("adaptive", "adaptive+p0", "2+a0+p4"))
    served = prompt_lookup(plain, 100)
    assert served is not None and served.max_tokens == DEFAULT_LOOKUP_TOKENS
    assert off.lookup_tokens == 0 and prompt_lookup(off, 100) is None
    assert (both.fixed_length, both.alternatives, both.lookup_tokens) == (2, 0, 4)
    request = grpc_request(both, MODES["greedy"], [1, 2], 8, seed=1)
    assert request.speculation.prompt_lookup_tokens == 4
    assert not grpc_request(plain, MODES["greedy"], [1, 2], 8, 1).speculation.HasField(
        "prompt_lookup_tokens")  # as served
    with pytest.raises(ValueError, match="prompt lookup tokens"):
        build_configs(("specdec-local",), ("2+p",))


def test_gate_suffix_sets_the_confidence_gate() -> None:
    from specdec.bench.systems import draft_confidence

    configs = {c.name: c for c in build_configs(("specdec-local",),
                                                ("1", "adaptive", "adaptive@0", "confident@0.6"))}
    assert draft_confidence(configs["specdec-local k=1"]) == 0.0
    assert draft_confidence(configs["specdec-local k=adaptive"]) == 0.4
    assert draft_confidence(configs["specdec-local k=adaptive@0"]) == 0.0
    assert configs["specdec-local k=adaptive@0"].policy == "adaptive"
    assert draft_confidence(configs["specdec-local k=confident@0.6"]) == 0.6
    for bad in ("3@0.5", "adaptive@2", "adaptive@x"):
        with pytest.raises(ValueError, match="confidence gate"):
            build_configs(("specdec-local",), (bad,))


def test_lookup_share_counts_prompt_lookup_part_of_drafted_tokens() -> None:
    from specdec.bench.configs import RunRecord
    from specdec.bench.markdown import round_table
    from specdec.bench.report import group_stats

    curve = CostCurve("test", {1: 0.03, 2: 0.03, 3: 0.03}, 0.005)
    # 10 drafted tokens, 4 of them from prompt lookup, of which 3 were accepted
    rows = [RunRecord("l", "specdec-local", "2", "greedy", "p", "chat", 0, 5, 12, 0.5,
                      rounds=5, num_drafts=5, draft_tokens=10, accepted_tokens=7,
                      verify_s=0.4, verify_forward_s=0.3, lookup_draft_tokens=4,
                      lookup_accepted_tokens=3)]
    stats = group_stats(rows, curve)
    assert stats["lookup_share"] == pytest.approx(0.4)
    assert stats["lookup_acceptance_rate"] == pytest.approx(0.75)
    table = round_table({"specdec-local k=2": {"system": "specdec-local", "all": stats}})
    assert table[-1].endswith("| 40% (75%) |")
    plain = group_stats([RunRecord("n", "specdec-local", "2", "greedy", "p", "chat", 0, 5, 12,
                                   0.5, rounds=5, num_drafts=5, draft_tokens=10,
                                   accepted_tokens=7)], curve)
    assert plain["lookup_share"] == 0 and plain["lookup_acceptance_rate"] is None


def test_same_shape_bound_uses_the_services_own_forward_times() -> None:
    from specdec.bench.configs import RunRecord
    from specdec.bench.report import same_shape_stats

    # target-only over gRPC: 10 rounds of 1 token, 30 ms forward each, 0.5 s in all
    base = [RunRecord("g0", "specdec-grpc", "0", "greedy", "p", "chat", 0, 5, 10, 0.5,
                      rounds=10, verify_s=0.4, verify_forward_s=0.3)]
    # speculative: 4 rounds, 2.5 tokens each; per round 5 ms drafting + 35 ms verifying
    rows = [RunRecord("g1", "specdec-grpc", "1", "greedy", "p", "chat", 0, 5, 10, 0.25,
                      rounds=4, draft_tokens=4, draft_forward_s=0.02, verify_s=0.18,
                      verify_forward_s=0.14)]
    stats = same_shape_stats(rows, base)
    assert stats["speedup_same_shape"] == pytest.approx(40 / 20)
    assert stats["bound_same_shape"] == pytest.approx(2.5 * 0.030 / 0.040)
    assert stats["bound_same_shape_ratio"] == pytest.approx(2.0 / (2.5 * 0.75))
    assert "bound_same_shape" not in same_shape_stats(base, base)  # nothing drafted


def test_feature_draft_run_uses_a_token_only_assistant_for_transformers(tmp_path: Path) -> None:
    """specdec runs the feature draft (in process and over gRPC, exact), transformers'
    assisted generation and specdec-local-token-draft the token-only assistant, and the
    report says so."""
    torch.set_num_threads(1)
    target = tiny_llama(64, seed=1)
    feature_draft = tiny_feature_draft(64, 32, seed=4)
    assistant = tiny_llama(64, seed=2, layers=1)
    models = BenchModels(target, feature_draft, None, None, (), assistant=assistant)
    settings = BenchSettings(
        assistant_model="tiny-assistant", modes=("greedy",), lengths=("1", "adaptive"),
        systems=("target-only", "hf-assisted", "specdec-local", "specdec-grpc",
                 "specdec-local-token-draft"),
        per_category=1, repeats=1, max_new_tokens=10, max_length=4, calibration_repeats=1,
        warmup_tokens=8, progress=False)
    prompts = [p for p in load_prompts() if p.id.endswith("01")]
    result = run_bench(settings, models, lambda: Services(feature_draft, target), prompts)
    paths = write_outputs(result, tmp_path / "out", "specdec bench --tiny")
    data = json.loads(paths["json"].read_text())
    greedy = data["summary"]["greedy"]
    for name in ("specdec-local k=1", "specdec-local k=adaptive", "specdec-grpc k=1",
                 "specdec-grpc k=adaptive"):
        assert greedy[name]["all"]["greedy_match"] == 1.0
        assert greedy[name]["all"]["acceptance_rate"] >= 0
    assert greedy["hf-assisted"]["all"]["greedy_match"] == 1.0
    # The token-only draft in specdec's own loop, same run: exact, drafting, no bound (the
    # cost curves describe the feature draft).
    token_draft = greedy["specdec-local-token-draft k=1"]["all"]
    assert token_draft["greedy_match"] == 1.0 and "bound" not in token_draft
    assert token_draft["acceptance_rate"] != greedy["specdec-local k=1"]["all"]["acceptance_rate"]
    assert data["meta"]["assistant_model"] == "tiny-assistant"
    assert "assisted generation runs `tiny-assistant`" in paths["markdown"].read_text()


def test_the_cost_comparison_loads_what_dtype_auto_serves(tmp_path: Path) -> None:
    """`specdec bench --costs-only` measures the default --dtype auto: int8 weights where the
    operator runs, loaded with the bench's --fused-step as the services load them."""
    from specdec.bench.dtypes import load_runners
    from specdec.engine.int8 import Int8Linear

    tiny_llama(64, seed=1, hidden=64).save_pretrained(tmp_path / "target")
    tiny_llama(64, seed=2, layers=1, hidden=64).save_pretrained(tmp_path / "draft")
    settings = BenchSettings(target_model=str(tmp_path / "target"),
                             draft_model=str(tmp_path / "draft"))
    target, draft = load_runners(settings, "auto")
    assert any(isinstance(module, Int8Linear) for module in target.model.modules())
    assert any(isinstance(module, Int8Linear) for module in draft.model.modules())
