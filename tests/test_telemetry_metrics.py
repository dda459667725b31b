"""Prometheus counters after in-process runs equal the GenerationStats of the responses."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.core.prompt_lookup import PromptLookup
from specdec.core.speculation_gate import Arm, SpeculationGate
from specdec.engine.runner import ModelRunner
from specdec.telemetry.service import Telemetry
from tests.telemetry_helpers import run_request
from tests.tiny_models import tiny_llama


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_counters_equal_summed_stats_over_the_http_endpoint() -> None:
    telemetry = Telemetry("coordinator")  # tracing off: metrics stand on their own
    port = telemetry.serve_metrics(0, addr="127.0.0.1")
    results = [run_request(telemetry, seed=seed, max_new_tokens=10)[0] for seed in (1, 2)]
    results.append(run_request(telemetry, max_new_tokens=10, temperature=0.0,
                               num_alternatives=3)[0])  # greedy: alternatives counted
    results.append(run_request(telemetry, max_new_tokens=24, temperature=0.0,  # 16-token vocab
                               prompt_lookup=PromptLookup(16, min_ngram=1))[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        got = samples(response.read().decode())

    def value(name: str, **labels: str) -> float:
        return got.get((name, tuple(sorted(labels.items()))), 0.0)

    stats = [r.stats for r in results]
    assert value("specdec_num_drafts_total") == sum(s.num_drafts for s in stats)
    assert value("specdec_num_draft_tokens_total") == sum(s.draft_tokens for s in stats)
    assert value("specdec_num_accepted_tokens_total") == sum(s.accepted_tokens for s in stats)
    assert value("specdec_num_alternatives_total") == sum(s.alternatives for s in stats) > 0
    assert value("specdec_num_kept_alternatives_total") == sum(s.kept_alternatives
                                                               for s in stats)
    assert value("specdec_num_lookup_draft_tokens_total") == sum(
        s.lookup_draft_tokens for s in stats) > 0
    assert value("specdec_num_lookup_accepted_tokens_total") == sum(
        s.lookup_accepted_tokens for s in stats)
    assert value("specdec_rounds_total") == sum(s.rounds for s in stats)
    width = max(len(s.accepted_per_position) for s in stats)
    for position in range(width):
        expected = sum(s.accepted_per_position[position] for s in stats
                       if position < len(s.accepted_per_position))
        assert value("specdec_num_accepted_tokens_per_pos_total",
                     position=str(position)) == expected
    assert value("specdec_generation_tokens_total") == sum(len(r.token_ids) for r in results)
    assert value("specdec_requests_total", finish_reason="length") == len(results)
    assert value("specdec_request_latency_seconds_count") == len(results)
    assert value("specdec_round_latency_seconds_count") == sum(s.rounds for s in stats)
    assert value("specdec_verify_latency_seconds_count") == sum(s.rounds for s in stats)
    # Prompt-lookup rounds make no Propose call, so they are not in its histogram.
    assert sum(s.lookup_drafts for s in stats) > 0
    assert value("specdec_propose_latency_seconds_count") == sum(
        s.num_drafts - s.lookup_drafts for s in stats)
    assert value("specdec_active_requests") == 0


def test_failed_request_counts_as_error_and_leaves_no_active_request() -> None:
    telemetry = Telemetry("coordinator")
    try:
        with telemetry.request("r", 3):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    got = samples(_exposition(telemetry))
    assert got[("specdec_requests_total", (("finish_reason", "error"),))] == 1
    assert got[("specdec_active_requests", ())] == 0


def test_model_service_gauges_read_the_runner() -> None:
    telemetry = Telemetry("target")
    runner = ModelRunner(tiny_llama(seed=3))
    telemetry.watch_runner(runner)
    runner.extend("s1", 0, 0, [1, 2, 3, 4])
    telemetry.record_step(forward_s=0.01, tokens_processed=4, kv_length=4,
                          committed_position=0, catch_up_tokens=4)
    got = samples(_exposition(telemetry))
    assert got[("specdec_active_sessions", ())] == 1
    assert got[("specdec_kv_cache_bytes", ())] == runner.total_kv_bytes() > 0
    assert got[("specdec_tokens_processed_total", ())] == 4
    assert got[("specdec_forward_seconds_count", ())] == 1


def _exposition(telemetry: Telemetry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(telemetry.registry).decode()


def test_the_speculation_gates_epochs_are_counted_by_arm() -> None:
    telemetry = Telemetry("coordinator")
    now = [0.0]
    gate = SpeculationGate(clock=lambda: now[0], explore_every=2,
                           on_epoch=telemetry.record_speculation_epoch)
    for _ in range(8):  # eight epochs at one request: drafting, re-tests in between
        gate.arm(1)
        now[0] += 1.0
    got = samples(_exposition(telemetry))
    epochs = {arm.label: got.get(("specdec_speculation_epochs_total", (("arm", arm.label),)), 0)
              for arm in Arm}
    assert sum(epochs.values()) == 8 and epochs["draft"] >= 6
    assert epochs["model-free"] + epochs["target-only"] >= 1


def test_metrics_on_port_0_cannot_take_the_services_own_port(monkeypatch) -> None:
    """`specdec serve --metrics-port 0` starts /metrics before its gRPC port is bound
    (the model loads in between): the kernel must not hand that port to /metrics. It is
    held while port 0 is picked, and free again afterwards."""
    import socket

    from specdec.serving.stack import free_port
    from specdec.telemetry import metrics

    service_port = free_port()
    real = metrics.start_http_server

    def checked(port: int, addr: str, registry):  # noqa: ANN001, ANN202
        probe = socket.socket()
        try:
            with pytest.raises(OSError):
                probe.bind((addr, service_port))
        finally:
            probe.close()
        return real(port, addr=addr, registry=registry)

    monkeypatch.setattr(metrics, "start_http_server", checked)
    port = metrics.start_metrics_server(0, metrics.new_registry(), "127.0.0.1",
                                        avoid=[service_port])
    assert port != service_port
    with socket.socket() as again:
        again.bind(("127.0.0.1", service_port))
