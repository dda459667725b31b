"""`specdec ray`: replicas as Ray actors on a local Ray instance, as a real process."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from tiny_models import save_tiny_pair

from specdec.commands.ray_up import check_reachable
from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.serving.grpc_server import check_health
from specdec.serving.ray_replicas import ReplicaSpec
from specdec.serving.stack import free_port

pytestmark = pytest.mark.slow

SPECDEC = [sys.executable, "-m", "specdec.cli"]


def test_replica_spec_validates_and_matches_threads_to_cpus() -> None:
    assert ReplicaSpec("target", 2, num_cpus=2.0).threads == 2
    assert ReplicaSpec("draft", 1, num_cpus=0.5).threads == 1
    assert ReplicaSpec("draft", 1, num_cpus=4.0, torch_threads=2).threads == 2
    with pytest.raises(ValueError, match="at least 1"):
        ReplicaSpec("target", 0, num_cpus=1.0)
    with pytest.raises(ValueError, match="unknown replica role"):
        ReplicaSpec("coordinator", 1, num_cpus=1.0)


def request(max_new_tokens: int, draft_tokens: int) -> coordinator_pb2.GenerateRequest:
    message = coordinator_pb2.GenerateRequest(prompt="Hello there", chat=True,
                                              max_new_tokens=max_new_tokens)
    message.speculation.num_draft_tokens = draft_tokens
    return message


class Output:
    """`specdec ray`'s stdout, read on a thread so a wait can time out."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def _lines(self, timeout_s: float) -> Iterator[str]:
        """Lines as they come, until the process closes its stdout or time runs out."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                return
            if line is None:
                return
            yield line

    def until(self, prefix: str, timeout_s: float) -> str:
        for line in self._lines(timeout_s):
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no line starting {prefix!r}:\n" + "".join(self.lines))

    def rest(self, timeout_s: float) -> str:
        return "".join(self._lines(timeout_s))


def generate_all(port: int) -> tuple[list[coordinator_pb2.GenerateResponse],
                                     coordinator_pb2.GenerateResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        speculative = [stub.Generate(request(16, 3), timeout=120) for _ in range(3)]
        target_only = stub.Generate(request(16, 0), timeout=120)
    return speculative, target_only


def test_ray_places_replicas_serves_exact_greedy_output_and_replaces_a_dead_one(
        tmp_path: Path) -> None:
    torch.set_num_threads(1)
    target, draft = save_tiny_pair(tmp_path / "models")
    port = free_port()
    env = {**os.environ, "SPECDEC_METRICS_PORT": "-1", "SPECDEC_TRACING": "off",
           "SPECDEC_WATCH_INTERVAL_S": "1",
           "RAY_ADDRESS": ""}  # a local Ray for this run, even beside a configured cluster
    ray = subprocess.Popen(
        [*SPECDEC, "ray", "--target-model", str(target), "--draft-model", str(draft),
         "--target-replicas", "2", "--target-replica-cpus", "0.5",
         "--draft-replica-cpus", "0.5", "--coordinator-port", str(port),
         "--startup-timeout-s", "180"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    output = Output(ray)
    try:
        output.until("ready", timeout_s=300)
        listed = [line.split() for line in output.lines
                  if line.startswith(("target replica", "draft replica"))]
        replicas = [fields[3] for fields in listed]
        assert len(replicas) == 3 and len(set(replicas)) == 3, "".join(output.lines)
        assert all(check_health(address) for address in replicas)

        speculative, target_only = generate_all(port)
        for response in speculative:
            assert list(response.token_ids) == list(target_only.token_ids)
        assert sum(r.stats.draft_tokens for r in speculative) > 0

        # A replica's process dies (OOM kill, node loss): a new one takes its place and
        # the coordinator routes to it.
        victim = next(fields for fields in listed if fields[:3] == ["target", "replica", "0"])
        os.kill(int(victim[victim.index("pid") + 1]), signal.SIGKILL)
        replaced = output.until("replaced target replica 0", timeout_s=180).split()
        assert replaced[4] == victim[3] and replaced[6] not in replicas
        assert check_health(replaced[6])
        replicas.append(replaced[6])
        speculative, again = generate_all(port)
        assert list(again.token_ids) == list(target_only.token_ids)
        for response in speculative:
            assert list(response.token_ids) == list(target_only.token_ids)
    finally:
        os.killpg(ray.pid, signal.SIGINT)  # what Ctrl-C does
        ray.wait(timeout=120)
        rest = output.rest(timeout_s=10)
    assert ray.returncode == 0, "".join(output.lines) + rest
    assert "stopped: coordinator and 3 replicas" in rest
    assert not any(check_health(address, timeout_s=0.3) for address in replicas)


def test_an_unreachable_ray_address_fails_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot reach the Ray cluster"):
        check_reachable(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - started < 5
    with pytest.raises(RuntimeError, match="not host:port"):
        check_reachable("headnode")
    check_reachable("auto")  # resolved by ray.init itself
