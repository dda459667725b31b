"""Three real `specdec serve` processes on loopback: one request is one trace across the
three services' files, with the right parent-child structure; Prometheus counters
scraped over HTTP equal the response stats; `specdec traces` renders the request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.cli import main
from specdec.proto.specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specdec.serving.grpc_server import wait_healthy
from specdec.serving.stack import free_port
from specdec.telemetry import names as n
from specdec.telemetry import reader
from tests.tiny_models import tiny_llama

ROLES = ("target", "draft", "coordinator")
REPO = Path(__file__).resolve().parents[1]
# Every test reads the one stack the module fixture starts: on one worker, it starts once.
pytestmark = pytest.mark.xdist_group("observability-stack")


@dataclass
class Stack:
    ports: dict[str, int]
    metrics_ports: dict[str, int]
    trace_dir: Path
    processes: dict[str, subprocess.Popen[bytes]]

    def scrape(self, role: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        url = f"http://127.0.0.1:{self.metrics_ports[role]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> None:
        for role in reversed(ROLES):  # coordinator first
            if self.processes[role].poll() is None:
                self.processes[role].send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def _save_tiny(directory: Path, **kwargs: int) -> str:
    model = tiny_llama(**kwargs)
    # No end-of-sequence token: requests run to max_new_tokens, a known number of rounds.
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("observability")
    target = _save_tiny(root / "target", vocab_size=32, seed=2)
    draft = _save_tiny(root / "draft", vocab_size=32, seed=1, layers=1)
    ports = {role: free_port() for role in ROLES}
    metrics = {role: free_port() for role in ROLES}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPECDEC_"))}
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    env["SPECDEC_DRAFT_COMPILE"] = "off"  # as the rest of the suite (tests/conftest.py)
    processes = {}
    for role in ROLES:
        command = [sys.executable, "-m", "specdec.cli", "serve", role, "--port",
                   str(ports[role]), "--target-model", target, "--draft-model", draft,
                   "--torch-threads", "1", "--trace-dir", str(root / "traces"),
                   "--trace-tokens", "on", "--metrics-port", str(metrics[role])]
        if role == "coordinator":
            command += ["--draft-endpoint", f"127.0.0.1:{ports['draft']}",
                        "--target-endpoint", f"127.0.0.1:{ports['target']}"]
        log = open(root / f"{role}.log", "wb")  # noqa: SIM115 - lives as long as the process
        processes[role] = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                           stderr=subprocess.STDOUT)
    running = Stack(ports, metrics, root / "traces", processes)
    try:
        for role in ROLES:
            process = processes[role]
            if not wait_healthy(f"127.0.0.1:{ports[role]}", 240,
                                alive=lambda p=process: p.poll() is None):
                log_text = (root / f"{role}.log").read_text()[-3000:]
                pytest.fail(f"{role} did not start:\n{log_text}")
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def served(stack: Stack) -> dict:
    """Two requests (unary and streamed), metrics scraped, then the services stopped so
    their last spans are flushed to the files."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['coordinator']}") as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = coordinator_pb2.GenerateRequest(
            prompt_token_ids=[1, 5, 3, 7, 2], max_new_tokens=16, request_id="e2e-unary",
            sampling=common_pb2.SamplingParams(temperature=1.0, seed=11),
            speculation=coordinator_pb2.SpeculationParams(num_draft_tokens=3))
        unary = stub.Generate(request, timeout=120)
        request.request_id = "e2e-stream"
        streamed = list(stub.GenerateStream(request, timeout=120))
    # The coordinator releases both services' sessions with a fire-and-forget Release
    # after the response; wait (bounded) for them to land before the final scrape.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(
            stack.scrape(role).get(("specdec_active_sessions", ()), 0.0) != 0
            for role in ("draft", "target")):
        time.sleep(0.05)
    scraped = {role: stack.scrape(role) for role in ROLES}
    stack.stop()
    spans = reader.load_spans(reader.trace_files(stack.trace_dir))
    return {"unary": unary, "stream": streamed[-1], "metrics": scraped, "spans": spans,
            "dir": stack.trace_dir}


def _trace(served: dict, key: str) -> list[reader.SpanRecord]:
    trace_id = served[key].trace_id
    assert len(trace_id) == 32
    return [s for s in served["spans"] if s.trace_id == trace_id]


@pytest.mark.parametrize("key,method", [("unary", "Generate"), ("stream", "GenerateStream")])
def test_one_trace_across_three_services(served: dict, key: str, method: str) -> None:
    trace = _trace(served, key)
    stats = served[key].stats
    assert {s.role for s in trace} == {"coordinator", "draft", "target"}
    by_id = {s.span_id: s for s in trace}
    (root,) = [s for s in trace if s.parent_id not in by_id]
    assert root.kind == reader.KIND_SERVER and root.method == method
    assert root.role == "coordinator"
    (generate,) = [s for s in trace if s.name == n.GENERATE_SPAN]
    assert generate.parent_id == root.span_id
    assert generate.attributes[n.ROUNDS] == stats.rounds
    rounds = [s for s in trace if s.name == n.ROUND_SPAN]
    assert len(rounds) == stats.rounds > 1
    assert all(r.parent_id == generate.span_id for r in rounds)
    round_ids = {r.span_id for r in rounds}
    for method_name, role in (("Propose", "draft"), ("Verify", "target")):
        clients = [s for s in trace if s.kind == reader.KIND_CLIENT and s.method == method_name]
        servers = [s for s in trace if s.kind == reader.KIND_SERVER and s.method == method_name]
        assert clients and all(c.parent_id in round_ids and c.role == "coordinator"
                               for c in clients)
        assert len(servers) == len(clients)
        for server in servers:  # the server span's parent is the coordinator's client span
            parent = by_id[server.parent_id]
            assert server.role == role and parent.kind == reader.KIND_CLIENT
            assert parent.method == method_name
            assert server.attributes[n.FORWARD_MS] > 0
            assert server.attributes[n.KV_LENGTH] > 0
            assert server.attributes[n.TOKENS_PROCESSED] > 0
    verifies = [s for s in trace if s.kind == reader.KIND_CLIENT and s.method == "Verify"]
    assert len(verifies) == stats.rounds + stats.resyncs
    # Prompt-lookup rounds call no Propose; their round spans say so.
    assert stats.num_drafts - stats.lookup_drafts == sum(
        1 for s in trace if s.kind == reader.KIND_CLIENT and s.method == "Propose")
    assert stats.lookup_drafts == sum(
        1 for r in rounds if r.attributes[n.SOURCE] == "prompt_lookup")


def test_rejection_events_match_round_attributes(served: dict) -> None:
    rounds = [s for s in _trace(served, "unary") if s.name == n.ROUND_SPAN]
    rejected = [r for r in rounds if r.attributes[n.ACCEPTED] < r.attributes[n.PROPOSED]]
    events = [e for r in rounds for e in r.events if e.name == n.REJECTION_EVENT]
    assert len(events) == len(rejected) > 0
    stats = served["unary"].stats
    assert sum(r.attributes[n.ACCEPTED] for r in rounds) == stats.accepted_tokens
    emitted = [t for r in sorted(rounds, key=lambda r: r.attributes[n.ROUND_INDEX])
               for t in r.attributes[n.EMITTED_TOKEN_IDS]]
    assert emitted == list(served["unary"].token_ids)


def test_prometheus_counters_equal_response_stats(served: dict) -> None:
    got = served["metrics"]["coordinator"]
    both = [served["unary"].stats, served["stream"].stats]

    def value(name: str, **labels: str) -> float:
        return got.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("specdec_num_drafts_total") == sum(s.num_drafts for s in both)
    assert value("specdec_num_draft_tokens_total") == sum(s.draft_tokens for s in both)
    assert value("specdec_num_accepted_tokens_total") == sum(s.accepted_tokens for s in both)
    assert value("specdec_rounds_total") == sum(s.rounds for s in both)
    for position in range(3):
        assert value("specdec_num_accepted_tokens_per_pos_total", position=str(position)) == sum(
            s.accepted_per_position[position] for s in both
            if position < len(s.accepted_per_position))
    assert value("specdec_requests_total", finish_reason="length") == 2
    assert value("specdec_generation_tokens_total") == sum(s.completion_tokens for s in both)
    assert value("specdec_active_requests") == 0
    for role in ("draft", "target"):
        model = served["metrics"][role]
        assert model[("specdec_tokens_processed_total", ())] > 0
        assert model[("specdec_forward_seconds_count", ())] > 0
        assert model[("specdec_active_sessions", ())] == 0  # released after each request
    # One Verify per round (no re-syncs on a healthy stack), counted by the target itself.
    assert served["metrics"]["target"][("specdec_forward_seconds_count", ())] == sum(
        s.rounds for s in both)


def test_forward_stats_from_the_trace_equal_the_targets_histograms(served: dict) -> None:
    """The load report's view of the target's forwards (specdec.bench.forwards) reads its
    Verify spans; over the whole run it counts the forwards, rows and forward seconds the
    target's own histograms counted."""
    from specdec.bench.forwards import forward_stats

    spans = served["spans"]
    start, end = min(s.start_ns for s in spans), max(s.end_ns for s in spans) + 1
    stats = forward_stats(spans, start, end)
    assert stats is not None
    target = served["metrics"]["target"]
    forwards = target[("specdec_batch_sessions_count", ())]
    assert stats.forwards == pytest.approx(forwards) and forwards == sum(
        s.rounds for s in (served["unary"].stats, served["stream"].stats))
    assert stats.sessions_per_forward == pytest.approx(1.0)  # one request at a time
    assert stats.rows_per_forward * forwards == pytest.approx(
        target[("specdec_batch_rows_sum", ())])
    assert stats.ms_per_forward * forwards == pytest.approx(
        1000 * target[("specdec_forward_seconds_sum", ())], rel=1e-3)
    assert 0 < stats.busy < 1


def test_traces_command_renders_the_request(served: dict,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    trace_id = served["unary"].trace_id
    assert main(["traces", "--trace-dir", str(served["dir"]), "--json"]) == 0
    listed = {s["trace_id"]: s for s in json.loads(capsys.readouterr().out)}
    assert listed[trace_id]["request_id"] == "e2e-unary"
    assert listed[trace_id]["services"] == ["coordinator", "draft", "target"]
    assert main(["traces", trace_id, "--trace-dir", str(served["dir"])]) == 0
    out = capsys.readouterr().out
    assert "Propose (server)" in out and "Verify (server)" in out and "Rounds" in out
    assert main(["traces", trace_id[:12], "--trace-dir", str(served["dir"]), "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)
    rows = detail["rounds"]
    assert len(rows) == served["unary"].stats.rounds
    # Server-side model time and the network share come from the other services' files.
    assert all(r["target_forward_ms"] > 0 and r["network_ms"] is not None for r in rows)
    assert all(r["draft_forward_ms"] for r in rows if r["source"] == "draft")
    assert {r["source"] for r in rows if r["proposed"]} <= {"draft", "prompt_lookup"}
