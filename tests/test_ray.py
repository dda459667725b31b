"""`specdec ray`: replicas as Ray actors on a local Ray instance, as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from tiny_models import save_tiny_pair

from specdec.grpc_server import check_health
from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.ray_replicas import ReplicaSpec
from specdec.stack import free_port

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


def test_ray_places_replicas_and_serves_exact_greedy_output(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    target, draft = save_tiny_pair(tmp_path / "models")
    port = free_port()
    env = {**os.environ, "SPECDEC_METRICS_PORT": "-1", "SPECDEC_TRACING": "off",
           "RAY_ADDRESS": ""}  # a local Ray for this run, even beside a configured cluster
    ray = subprocess.Popen(
        [*SPECDEC, "ray", "--target-model", str(target), "--draft-model", str(draft),
         "--target-replicas", "2", "--target-replica-cpus", "0.5",
         "--draft-replica-cpus", "0.5", "--coordinator-port", str(port),
         "--startup-timeout-s", "180"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    lines: list[str] = []
    try:
        assert ray.stdout is not None
        for line in ray.stdout:  # blocks until `specdec ray` reports ready (or exits)
            lines.append(line)
            if line.startswith("ready"):
                break
        output = "".join(lines)
        assert lines and lines[-1].startswith("ready"), output
        replicas = [line.split()[3] for line in lines
                    if line.startswith(("target replica", "draft replica"))]
        assert len(replicas) == 3 and len(set(replicas)) == 3, output
        assert all(check_health(address) for address in replicas)

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            speculative = [stub.Generate(request(16, 3), timeout=120) for _ in range(3)]
            target_only = stub.Generate(request(16, 0), timeout=120)
        for response in speculative:
            assert list(response.token_ids) == list(target_only.token_ids)
        assert sum(r.stats.draft_tokens for r in speculative) > 0
    finally:
        os.killpg(ray.pid, signal.SIGINT)  # what Ctrl-C does
        rest, _ = ray.communicate(timeout=120)
    assert ray.returncode == 0, "".join(lines) + rest
    assert "stopped: coordinator and 3 replicas" in rest
    assert not any(check_health(address, timeout_s=0.3) for address in replicas)
