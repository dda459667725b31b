"""`specdec up` / `generate` as real processes, with tiny models that use the real
SmolLM2 tokenizer (so text prompts, chat and stop strings work end to end)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from child_process import read_until
from cpu_features import BF16_AUTO_LINEAR
from tiny_models import save_tiny_pair

from specdec.proto.specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec.serving.grpc_server import check_health
from specdec.serving.stack import free_port

SPECDEC = [sys.executable, "-m", "specdec.cli"]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)
    return save_tiny_pair(tmp_path_factory.mktemp("models"))


def start_up(pair: tuple[Path, Path], log_dir: Path, env: dict[str, str]
             ) -> tuple[subprocess.Popen[str], dict[str, int], list[str]]:
    """`specdec up` on ports probed free, its lines until "ready" (or its error).

    A port probed free can be taken by a parallel test's server before `up` checks it or
    its service binds it; `up` then exits naming the port, and one new set is tried."""
    target, draft = pair
    for attempt in range(2):
        ports = {role: free_port() for role in ("coordinator", "draft", "target")}
        up = subprocess.Popen(
            [*SPECDEC, "up", "--target-model", str(target), "--draft-model", str(draft),
             "--dtype", "bfloat16", "--draft-dtype", "float32", "--draft-linear-kernel",
             "torch", "--log-dir", str(log_dir), "--startup-timeout-s", "120",
             "--http-port", "-1",
             *(arg for role, port in ports.items() for arg in (f"--{role}-port", str(port)))],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines = read_until(up, "ready")
        text = "".join(lines)
        if attempt == 0 and not (lines and lines[-1].startswith("ready")) \
                and ("cannot listen on" in text or "is in use" in text):
            up.wait(timeout=60)
            continue
        break
    return up, ports, lines


def test_up_generate_and_ctrl_c(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    # Any free metrics ports and no trace files: other stacks may run beside this one.
    env = {**os.environ, "SPECDEC_TORCH_THREADS": "1", "SPECDEC_METRICS_PORT": "0",
           "SPECDEC_TRACING": "off"}
    up, ports, lines = start_up(tiny_pair, tmp_path / "logs", env)
    endpoint = f"127.0.0.1:{ports['coordinator']}"
    try:
        assert lines and lines[-1].startswith("ready"), "".join(lines)
        for role, port in ports.items():
            assert check_health(f"127.0.0.1:{port}"), role
        with grpc.insecure_channel(f"127.0.0.1:{ports['draft']}") as channel:
            described = draft_pb2_grpc.DraftStub(channel).Describe(
                draft_pb2.DescribeRequest(), timeout=10)
        # What operators see (the suite's SPECDEC_DRAFT_COMPILE=off, tests/conftest.py).
        assert described.precision == "float32/torch (as set); forward eager (--draft-compile off)"

        result = subprocess.run(
            [*SPECDEC, "generate", "Hello there", "--chat", "--max-new-tokens", "12",
             "--temperature", "1", "--seed", "3", "--json", "--endpoint", endpoint],
            capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0, result.stderr
        response = json.loads(result.stdout)
        assert response["finish_reason"] in ("length", "eos")
        assert response["stats"]["rounds"] > 0 and response["stats"]["prompt_tokens"] > 3

        streamed = subprocess.run(
            [*SPECDEC, "generate", "Hello there", "--chat", "--max-new-tokens", "12",
             "--temperature", "1", "--seed", "3", "--stream", "--endpoint", endpoint],
            capture_output=True, text=True, timeout=120, env=env)
        assert streamed.returncode == 0, streamed.stderr
        assert "acceptance rate" in streamed.stderr  # the text alone on stdout
        assert streamed.stdout == response["text"] + "\n"

        bad = subprocess.run(
            [*SPECDEC, "generate", "x", "--max-new-tokens", "0", "--endpoint", endpoint],
            capture_output=True, text=True, timeout=180, env=env)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        up.send_signal(signal.SIGINT)  # what Ctrl-C does
        rest, _ = up.communicate(timeout=120)
    assert up.returncode == 0, rest
    assert "stopped: coordinator exit 0, draft exit 0, target exit 0" in rest
    # The draft runs in its own precision; the target keeps the shared one.
    assert "float32, torch linear, grouped attention" in (tmp_path / "logs/draft.log").read_text()
    assert f"bfloat16, {BF16_AUTO_LINEAR} linear, rowwise attention" in \
        (tmp_path / "logs/target.log").read_text()
    time.sleep(0.2)
    assert not any(check_health(f"127.0.0.1:{port}", timeout_s=0.3) for port in ports.values())


def test_demo_streams_an_answer_and_compares_with_target_only(
        tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """`make demo`'s command, on the tiny pair: warm-up, adaptive run, then new prompts
    speculative and target-only in turn, the same tokens, and the stack stopped."""
    target, draft = tiny_pair
    env = {**os.environ, "SPECDEC_TORCH_THREADS": "1", "SPECDEC_METRICS_PORT": "0",
           "SPECDEC_TRACING": "off"}
    result = subprocess.run(
        [*SPECDEC, "demo", "--target-model", str(target), "--draft-model", str(draft),
         "--max-new-tokens", "16", "--repeats", "2", "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "speculative decoding, adaptive draft length" in result.stdout
    assert "identical output: yes" in result.stdout
    assert "median of 2 prompts" in result.stdout
    # Absolute speeds beside the ratio: both runs' generated tokens over their seconds.
    assert re.search(r"target only [0-9.]+ s, [0-9.]+ tok/s; speculative [0-9.]+ s, "
                     r"[0-9.]+ tok/s", " ".join(result.stdout.split()))
    assert "stopped: coordinator exit 0, draft exit 0, target exit 0" in result.stdout


def test_draft_precision_settings_default_to_auto_and_follow_the_shared_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from specdec.config import add_model_settings, draft_compile, draft_precision

    def parsed(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_model_settings(parser)
        return parser.parse_args(argv)

    assert draft_precision(parsed()) == ("auto", "int8-if-available")  # --dtype auto
    assert draft_precision(parsed("--draft-dtype", "same")) == ("bfloat16",
                                                                "int8-if-available")
    assert draft_precision(parsed("--draft-dtype", "same", "--dtype", "float32",
                                  "--linear-kernel", "torch")) == ("float32", "torch")
    monkeypatch.setenv("SPECDEC_DRAFT_DTYPE", "float32")
    assert draft_precision(parsed("--draft-linear-kernel", "skinny")) == ("float32", "skinny")
    with pytest.raises(SystemExit):  # argparse: an unknown kernel is a usage error
        parsed("--draft-linear-kernel", "fast")
    monkeypatch.delenv("SPECDEC_DRAFT_COMPILE", raising=False)
    assert draft_compile(parsed()) == "auto"
    monkeypatch.setenv("SPECDEC_DRAFT_COMPILE", "on")
    assert draft_compile(parsed()) == "on"
    assert draft_compile(parsed("--draft-compile", "off")) == "off"
    with pytest.raises(SystemExit):
        parsed("--draft-compile", "yes")


@pytest.mark.slow
@pytest.mark.xdist_group("draft-compile")
def test_the_first_request_after_ready_compiles_nothing(tmp_path: Path) -> None:
    """The embedded pair with the draft compiled: the first request after `ready` (chat,
    streamed, adaptive with token trees: what a new user sends first) finds every graph
    it needs compiled (sampled rounds run the same forwards: tests/test_draft_compile.py).
    A graph compiled while serving shows in dynamo's recompile log, and takes seconds
    (tracing alone, with inductor's cache warm), past the draft's deadline (shortened
    here: the draft's step takes milliseconds), so the answer would be degraded. The
    group runs it on the worker whose test_draft_compile fixture compiles the same draft
    first, so inductor's cache spares it the code generation."""
    env = {**os.environ, "SPECDEC_TORCH_THREADS": "1", "SPECDEC_METRICS_PORT": "0",
           "SPECDEC_TRACING": "off", "SPECDEC_DRAFT_COMPILE": "on",
           "SPECDEC_DRAFT_TIMEOUT_MS": "2000", "TORCH_LOGS": "recompiles"}
    ports = {role: free_port() for role in ("coordinator", "draft", "target")}
    up = subprocess.Popen(
        [*SPECDEC, "up", "--draft-dtype", "float32", "--draft-linear-kernel", "torch",
         "--log-dir", str(tmp_path / "logs"), "--startup-timeout-s", "600",
         "--http-port", "-1",
         *(arg for role, port in ports.items() for arg in (f"--{role}-port", str(port)))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = read_until(up, "ready")
        assert lines and lines[-1].startswith("ready"), "".join(lines)
        draft_log = tmp_path / "logs/draft.log"
        compiled_before = draft_log.read_text().count("Recompiling")
        result = subprocess.run(
            [*SPECDEC, "generate", "Give me three tips for a job interview.", "--chat",
             "--stream", "--json", "--max-new-tokens", "48", "--endpoint",
             f"127.0.0.1:{ports['coordinator']}"],
            capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        stats = json.loads(result.stdout)["stats"]
        assert stats["rounds"] > 0
        assert not stats.get("degraded") and not stats.get("resyncs"), stats
        assert draft_log.read_text().count("Recompiling") == compiled_before
    finally:
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=120)
    assert "compiled in" in draft_log.read_text()
