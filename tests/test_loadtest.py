"""`specdec bench --concurrency`: the load test end to end against tiny models on loopback;
the report's structure and its error accounting (speed is not asserted)."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry
from service_harness import Services
from tiny_models import tiny_llama

from coordinator.endpoints import StaticEndpoints
from coordinator.server import build_coordinator_server
from coordinator.servicer import CoordinatorServicer, CoordinatorSettings
from specdec.bench.load import (
    LoadPrompt,
    LoadSettings,
    parse_load_mode,
    percentile,
    request_for,
    run_load,
    write_outputs,
)
from specdec.bench.process_cpu import ProcessCpu, cpu_row, used_between
from specdec.proto.specdec.v1 import coordinator_pb2_grpc
from specdec.telemetry.service import Telemetry

VOCAB = 32
PROMPTS = [LoadPrompt(f"p{i}", [1 + i, 2 + (3 * i) % 11, 3 + (5 * i) % 13, 4])
           for i in range(4)]


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    torch.set_num_threads(1)
    stack = Services(tiny_llama(VOCAB, seed=2, layers=1), tiny_llama(VOCAB, seed=1))
    yield stack
    stack.close()


def coordinator_stub(services: Services, settings: CoordinatorSettings
                     ) -> tuple[coordinator_pb2_grpc.CoordinatorStub, object]:
    servicer = CoordinatorServicer(
        services.coordinator.target,
        StaticEndpoints(services.target_endpoint, services.draft_endpoint),
        settings=settings, channels=services.channels,
        telemetry=Telemetry("coordinator", registry=CollectorRegistry()))
    server = build_coordinator_server(servicer)
    channel = grpc.insecure_channel(server.address)
    return coordinator_pb2_grpc.CoordinatorStub(channel), (server, channel)


def close(handles: object) -> None:
    server, channel = handles  # type: ignore[misc]
    channel.close()
    server.stop(0)


def test_load_modes_parse() -> None:
    assert parse_load_mode("target-only") == parse_load_mode("0")
    assert parse_load_mode("k=3").num_draft_tokens == 3
    adaptive = parse_load_mode("adaptive")
    assert adaptive.adaptive and adaptive.num_draft_tokens > 0
    with pytest.raises(ValueError, match="target-only, adaptive or k=N"):
        parse_load_mode("fast")
    chain = parse_load_mode("adaptive+a0")
    assert (chain.name, chain.adaptive, chain.num_alternatives) == ("adaptive+a0", True, 0)
    tree = parse_load_mode("k=4+a10")
    assert (tree.name, tree.num_draft_tokens, tree.num_alternatives) == ("k=4+a10", 4, 10)
    assert request_for(tree, LoadPrompt("p", [1, 2]), 8).speculation.num_alternatives == 10
    assert not request_for(parse_load_mode("adaptive"), LoadPrompt("p", [1, 2]),
                           8).speculation.HasField("num_alternatives")
    flat = parse_load_mode("k=2+f2")
    assert (flat.num_alternatives, flat.max_alternative_depth) == (2, 1)
    assert request_for(flat, LoadPrompt("p", [1, 2]), 8).speculation.max_alternative_depth == 1
    assert parse_load_mode("adaptive+a2").max_alternative_depth == 0
    with pytest.raises(ValueError, match=r"\+aN"):
        parse_load_mode("k=4+b2")
    plain = parse_load_mode("adaptive+s0+p0")
    assert (plain.suffix_tokens, plain.lookup_tokens, plain.num_alternatives) == (0, 0, None)
    request = request_for(plain, LoadPrompt("p", [1, 2]), 8).speculation
    assert request.HasField("prompt_lookup_tokens") and request.prompt_lookup_tokens == 0
    assert request.HasField("suffix_tokens") and request.suffix_tokens == 0
    assert parse_load_mode("k=3+p2+a1").name == "k=3+p2+a1"
    assert not parse_load_mode("k=3+p2").adaptive
    for bad in ("adaptive+p1+p2", "adaptive+a1+f1", "target-only+p0"):
        with pytest.raises(ValueError):
            parse_load_mode(bad)
    sampled = request_for(replace(tree, temperature=1.0, top_p=0.9), LoadPrompt("p", [1, 2]), 8)
    assert (sampled.sampling.temperature, round(sampled.sampling.top_p, 3)) == (1.0, 0.9)
    assert sampled.sampling.HasField("seed")  # one seed per prompt, the same in every mode


def test_cpu_columns_are_cores_busy_and_the_coordinators_ms_per_round() -> None:
    used = used_between({"coordinator": 1.0, "draft": 2.0, "target": 5.0},
                        {"coordinator": 1.5, "target": 9.0})  # the draft's process had gone
    assert used == {"coordinator": 0.5, "target": 4.0}
    assert cpu_row(used, 4.0, 100) == {"coordinator_cores": 0.125, "target_cores": 1.0,
                                       "coordinator_ms_per_round": 5.0}
    assert cpu_row(used, 4.0, 0) == {"coordinator_cores": 0.125, "target_cores": 1.0}


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_the_load_test_reports_every_mode_at_every_level(services, tmp_path) -> None:
    stub, handles = coordinator_stub(services, CoordinatorSettings())
    try:
        progress = io.StringIO()
        # The services run in this process here: its CPU time stands for the coordinator's.
        report = run_load(stub, LoadSettings((1, 2, 4), ("target-only", "k=2", "adaptive"),
                                             max_new_tokens=10, warmup_tokens=2),
                          PROMPTS, out=progress, cpu=ProcessCpu({"coordinator": os.getpid()}))
    finally:
        close(handles)
    rows = report["levels"]
    # Modes interleaved within each level, levels ascending.
    assert [(r["concurrency"], r["mode"]) for r in rows] == [
        (c, m) for c in (1, 2, 4) for m in ("target-only", "k=2", "adaptive")]
    for row in rows:
        assert row["requests"] == row["completed"] == len(PROMPTS)
        assert row["errors"] == {} and row["failed"] == row["over_capacity"] == 0
        assert row["output_tokens"] == 10 * len(PROMPTS) and row["output_throughput"] > 0
        for key in ("p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p50_itl_ms", "p99_itl_ms",
                    "p50_e2e_ms", "p99_e2e_ms"):
            assert row[key] is not None and row[key] > 0, key
        assert row["p50_e2e_ms"] <= row["p99_e2e_ms"]
        assert row["compared"] == len(PROMPTS) and row["mismatches"] == 0
        assert row["coordinator_cores"] > 0 and row["coordinator_ms_per_round"] > 0
        assert "draft_cores" not in row  # no process sampled for it
    speculative = [r for r in rows if r["mode"] != "target-only"]
    assert all(r["draft_tokens_per_round"] > 0 for r in speculative)
    assert len(report["requests"]) == 9 * len(PROMPTS)
    assert "requests" in progress.getvalue()  # a progress line per finished request
    paths = write_outputs(report, tmp_path, "specdec bench --concurrency 1,2,4")
    assert json.loads(paths["json"].read_text())["levels"] == rows
    markdown = paths["markdown"].read_text()
    assert "| clients | mode |" in markdown and "mismatches" in markdown
    assert "| clients | mode | coordinator CPU ms/round | coordinator cores |" in markdown
    assert paths["plot"].stat().st_size > 0


def test_repeated_passes_alternate_the_modes_order_and_report_each_modes_median(
        services, tmp_path) -> None:
    stub, handles = coordinator_stub(services, CoordinatorSettings())
    try:
        report = run_load(stub, LoadSettings((2,), ("target-only", "k=2", "adaptive"),
                                             max_new_tokens=6, warmup_tokens=0, repeats=3),
                          PROMPTS[:2], out=io.StringIO())
    finally:
        close(handles)
    rows = report["levels"]
    forward, backward = ["target-only", "k=2", "adaptive"], ["adaptive", "k=2", "target-only"]
    assert [(r["repeat"], r["mode"]) for r in rows] == [
        (repeat, mode) for repeat, order in enumerate((forward, backward, forward))
        for mode in order]
    assert all(r["mismatches"] == 0 and r["compared"] == 2 for r in rows)
    # Each pass's ratio is over that pass's own target-only phase.
    for row in rows:
        if row["mode"] != "target-only":
            (base,) = [r for r in rows
                       if r["mode"] == "target-only" and r["repeat"] == row["repeat"]]
            assert row["speedup"] == round(row["output_throughput"]
                                           / base["output_throughput"], 3)
    by_mode = {p["mode"]: p for p in report["passes"]}
    assert set(by_mode) == {"k=2", "adaptive"}
    for mode, summary in by_mode.items():
        assert summary["speedups"] == [r["speedup"] for r in rows if r["mode"] == mode]
        assert summary["median_speedup"] == sorted(summary["speedups"])[1]
        assert summary["min_speedup"] == min(summary["speedups"])
    markdown = write_outputs(report, tmp_path, "bench")["markdown"].read_text()
    assert "over 3 passes" in markdown and "| pass |" in markdown
    assert f"**{by_mode['k=2']['median_speedup']:.3g}x**" in markdown
    with pytest.raises(ValueError, match="--repeats must be at least 1"):
        run_load(stub, LoadSettings((1,), ("target-only",), repeats=0), PROMPTS)


def test_requests_over_capacity_count_apart_from_failures(services) -> None:
    settings = CoordinatorSettings(max_concurrent_requests=1, max_queued_requests=0)
    stub, handles = coordinator_stub(services, settings)
    try:
        report = run_load(stub, LoadSettings((1, 4), ("target-only",), max_new_tokens=16,
                                             warmup_tokens=0, min_rounds=2),
                          PROMPTS, out=io.StringIO())
    finally:
        close(handles)
    serial, loaded = report["levels"]
    assert serial["errors"] == {} and serial["completed"] == len(PROMPTS)
    assert loaded["requests"] == 8
    assert loaded["over_capacity"] > 0 and loaded["failed"] == 0
    assert loaded["errors"] == {"RESOURCE_EXHAUSTED": loaded["over_capacity"]}
    assert loaded["completed"] + loaded["over_capacity"] == loaded["requests"]
    assert loaded["mismatches"] == 0  # the requests served are still exact
    refused = [r for r in report["requests"] if r["code"] == "RESOURCE_EXHAUSTED"]
    assert all("SPECDEC_MAX_CONCURRENT_REQUESTS" in r["error"] for r in refused)


def test_a_prompt_without_token_ids_goes_as_chat_text() -> None:
    from specdec.bench.load import request_for

    mode = parse_load_mode("adaptive")
    by_text = request_for(mode, LoadPrompt("t", [], "Hello there"), 8)
    assert by_text.prompt == "Hello there" and by_text.chat and not by_text.prompt_token_ids
    by_ids = request_for(mode, PROMPTS[0], 8)
    assert list(by_ids.prompt_token_ids) == PROMPTS[0].token_ids and not by_ids.prompt
    assert by_ids.speculation.adaptive and by_ids.max_new_tokens == 8


def test_requests_per_client_below_one_is_refused_before_anything_starts() -> None:
    from specdec.cli import build_parser
    from specdec.commands.bench import run_load_command

    args = build_parser("bench").parse_args(
        ["bench", "--concurrency", "8", "--requests-per-client", "0"])
    with pytest.raises(ValueError, match="--requests-per-client must be at least 1, got 0"):
        run_load_command(args, "")
