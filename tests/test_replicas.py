"""Replicas behind the coordinator's discovery, with real processes.

Two draft and two target replicas run as `specdec serve` subprocesses on loopback (tiny
random models saved to a tmp dir); one coordinator, in this process so the test can read
its metrics, finds them through a static list. Killing (SIGKILL) the replica serving a
generation moves the session to the other one with the output unchanged; concurrent
sessions spread over the replicas.

The tests run in file order on shared replicas: the spread test needs all four alive, the
kill tests then take one target and one draft down for good.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
import torch
from tiny_models import tiny_llama
from transformers import PreTrainedModel

from coordinator import server as coordinator_server
from coordinator.clients import ChannelPool, _code, _invoke
from coordinator.endpoints import ReplicaEndpoints, endpoint_spec
from coordinator.routing import ChannelClosed, ReplicaRoute
from coordinator.servicer import CoordinatorServicer, CoordinatorSettings
from specdec.commands import serve
from specdec.core.loop import GenerateConfig, generate
from specdec.core.prompt_lookup import PromptLookup
from specdec.core.sampling import SamplingParams
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.models import model_info
from specdec.engine.runner import ModelRunner
from specdec.proto.specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specdec.serving.discovery import ReplicaSet, rank
from specdec.serving.grpc_server import ServerHandle, build_server, check_health, wait_healthy
from specdec.serving.stack import free_port
from specdec.telemetry.service import Telemetry

VOCAB = 32
PROMPT = [1, 5, 7, 3]
LONG = 200  # tokens: long enough that a kill after the first message lands mid-way
FAST = CoordinatorSettings(draft_backoff_initial_s=0.01, draft_backoff_max_s=0.05)
SESSIONS = "specdec_replica_sessions_total"
Stub = TypeVar("Stub")


@dataclass
class Models:
    target: PreTrainedModel
    draft: PreTrainedModel
    target_dir: Path
    draft_dir: Path


@dataclass
class Replica:
    role: str
    port: int
    process: subprocess.Popen[bytes]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


@dataclass
class Coordinator:
    servicer: CoordinatorServicer
    server: ServerHandle
    stub: coordinator_pb2_grpc.CoordinatorStub

    def pins(self, role: str, endpoints: list[str]) -> dict[str, float]:
        """Sessions pinned to each replica so far (the spread metric)."""
        registry = self.servicer.telemetry.registry
        return {e: registry.get_sample_value(SESSIONS, {"role": role, "endpoint": e}) or 0.0
                for e in endpoints}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("replica-models")
    target, draft = tiny_llama(VOCAB, seed=1), tiny_llama(VOCAB, seed=2, layers=1)
    for model, name in ((target, "target"), (draft, "draft")):
        # No EOS: every generation runs its full length, so a kill lands mid-way.
        model.config.eos_token_id = model.generation_config.eos_token_id = None
        model.save_pretrained(root / name)
    return Models(target, draft, root / "target", root / "draft")


@pytest.fixture(scope="module")
def replicas(models: Models, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, list[Replica]]]:
    logs = tmp_path_factory.mktemp("replica-logs")
    # Passive OpenMP waiting: spinning idle threads would slow the busy processes ~7x.
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "SPECDEC_TRACING": "off",
           "SPECDEC_METRICS_PORT": "-1"}
    started: list[Replica] = []
    try:
        for role in ("target", "target", "draft", "draft"):
            port = free_port()
            with open(logs / f"{role}-{port}.log", "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "specdec.cli", "serve", role, "--port", str(port),
                     "--target-model", str(models.target_dir),
                     "--draft-model", str(models.draft_dir), "--torch-threads", "1",
                     "--dtype", "float32"],  # the in-process reference runs float32
                    env=env, stdout=log, stderr=subprocess.STDOUT)
            started.append(Replica(role, port, process))
        for replica in started:
            assert wait_healthy(replica.endpoint, 120, alive=replica.alive), \
                (logs / f"{replica.role}-{replica.port}.log").read_text()[-2000:]
        yield {role: [r for r in started if r.role == role] for role in ("target", "draft")}
    finally:
        for replica in started:
            if replica.process.poll() is None:
                replica.kill()


@pytest.fixture(scope="module")
def coordinator(models: Models, replicas: dict[str, list[Replica]]) -> Iterator[Coordinator]:
    # Wired like coordinator.server.create (test_dns_endpoint_spec runs that), by hand for
    # a short draft backoff, which is no flag: the killed draft's replacement must be
    # tried well before a 200-token generation ends.
    channels = ChannelPool()
    endpoints = ReplicaEndpoints(",".join(r.endpoint for r in replicas["target"]),
                                 ",".join(r.endpoint for r in replicas["draft"]),
                                 health_check=check_health, on_replicas=channels.retain)
    servicer = CoordinatorServicer(model_info(str(models.target_dir)), endpoints,
                                   settings=FAST, channels=channels,
                                   telemetry=Telemetry("coordinator"))
    handle = build_server([servicer.service()], max_workers=32)
    channel = grpc.insecure_channel(handle.address)
    yield Coordinator(servicer, handle, coordinator_pb2_grpc.CoordinatorStub(channel))
    channel.close()
    handle.stop(0)
    endpoints.close()
    channels.close()


def request(max_new_tokens: int, *, k: int = 3, seed: int | None = None
            ) -> coordinator_pb2.GenerateRequest:
    message = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT,
                                              max_new_tokens=max_new_tokens)
    message.speculation.num_draft_tokens = k
    if seed is not None:  # sampled; otherwise greedy
        message.sampling.CopyFrom(common_pb2.SamplingParams(temperature=1.0, top_k=8,
                                                            seed=seed))
    return message


def in_process(models: Models, max_new_tokens: int, seed: int | None = None) -> list[int]:
    """The same generation without services: what every replica layout must reproduce."""
    params = SamplingParams() if seed is None else SamplingParams(temperature=1.0, top_k=8,
                                                                  seed=seed)
    # The coordinator's default prompt lookup: every layout must reproduce its rounds too.
    config = GenerateConfig(max_new_tokens=max_new_tokens, sampling=params, num_draft_tokens=3,
                            prompt_lookup=PromptLookup(VOCAB))
    drafter = LocalDrafter(ModelRunner(models.draft, target_vocab_size=VOCAB))
    return generate(drafter, LocalVerifier(ModelRunner(models.target)), PROMPT,
                    config).token_ids


def stream(coordinator: Coordinator, message: coordinator_pb2.GenerateRequest,
           after_first: Callable[[], None]) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    tokens: list[int] = []
    last = None
    for index, piece in enumerate(coordinator.stub.GenerateStream(message, timeout=60)):
        tokens += piece.token_ids
        last = piece
        if index == 0:
            after_first()
    assert last is not None and last.finish_reason == "length"
    return tokens, last


def kill_serving(coordinator: Coordinator, group: list[Replica],
                 before: dict[str, float]) -> Callable[[], None]:
    """A callback that SIGKILLs the replica the running session was pinned to."""

    def kill() -> None:
        now = coordinator.pins(group[0].role, [r.endpoint for r in group])
        serving = [r for r in group if now[r.endpoint] > before[r.endpoint]]
        assert len(serving) == 1, (before, now)
        serving[0].kill()

    return kill


# -- routing, without servers -------------------------------------------------------------
def no_stub(endpoint: str, make: Callable[[grpc.Channel], Stub]) -> Stub:
    raise AssertionError("no call expected")


def test_a_gone_replica_moves_the_session_down_its_ranking() -> None:
    replica_set = ReplicaSet("10.0.0.1:1,10.0.0.2:1,10.0.0.3:1", start=False)
    order = rank("s", replica_set.all_endpoints())
    pins: list[str] = []
    route = ReplicaRoute(replica_set, no_stub, "s", on_pin=pins.append)
    assert route.endpoint == order[0] and route.can_move
    assert route.gone(grpc.StatusCode.UNAVAILABLE)
    assert not route.gone(grpc.StatusCode.DEADLINE_EXCEEDED)  # slow is not gone
    assert route.move() and route.endpoint == order[1]
    assert order[0] not in replica_set.endpoints()  # marked down for every session
    assert route.move() and route.move() is False  # the third, then none left
    assert pins == order and route.endpoint == order[2]


def test_a_single_replica_is_waited_for_not_marked_down() -> None:
    replica_set = ReplicaSet("10.0.0.1:1", start=False)
    route = ReplicaRoute(replica_set, no_stub, "s")
    assert not route.can_move and not route.move()
    assert replica_set.endpoints() == ["10.0.0.1:1"]


def test_a_replica_that_left_dns_moves_its_sessions() -> None:
    answer = ["10.0.0.1", "10.0.0.2"]
    replica_set = ReplicaSet("dns:///draft:7", start=False,
                             resolver=lambda name, port: [f"{a}:{port}" for a in answer])
    route = ReplicaRoute(replica_set, no_stub, "s")
    pinned = route.endpoint
    answer.remove(pinned.split(":")[0])
    replica_set.refresh()
    # The pool closed its channel: a call in flight ends CANCELLED, which now means gone.
    assert route.left_discovery() and route.gone(grpc.StatusCode.CANCELLED)
    assert route.move() and route.endpoint != pinned


def test_channels_of_departed_replicas_are_closed() -> None:
    pool = ChannelPool()
    stale = pool.stub("127.0.0.1:1", target_pb2_grpc.TargetStub)
    kept = pool.stub("127.0.0.1:2", target_pb2_grpc.TargetStub)
    pool.retain(["127.0.0.1:2"])
    assert pool.stub("127.0.0.1:2", target_pb2_grpc.TargetStub) is kept
    assert pool.stub("127.0.0.1:1", target_pb2_grpc.TargetStub) is not stale
    with pytest.raises(ChannelClosed) as caught:  # a call racing the close: gone, not a crash
        _invoke(stale.Verify, target_pb2.VerifyRequest(), timeout=1)
    assert _code(caught.value) == grpc.StatusCode.UNAVAILABLE
    pool.close()


def test_endpoint_specs() -> None:
    assert endpoint_spec("b:2,a:1").static == ("a:1", "b:2")
    assert endpoint_spec("target", default_port=50053).static == ("target:50053",)
    # A gRPC target URI discovery cannot parse stays one replica, resolved by gRPC.
    assert endpoint_spec("unix:///tmp/target.sock").static == ("unix:///tmp/target.sock",)


# -- real replicas, in this order --------------------------------------------------------
def test_dns_endpoint_spec(models: Models, replicas: dict[str, list[Replica]]) -> None:
    """`dns:///localhost:<port>` through the coordinator's own flags and server factory."""
    port = replicas["target"][0].port
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "coordinator", "--target-model", str(models.target_dir),
         "--target-endpoint", f"dns:///localhost:{port}", "--draft-endpoint", "none"])
    args.port = 0  # any free port (`specdec serve` would take the role's default)
    endpoints = ReplicaEndpoints(f"dns:///localhost:{port}")
    try:
        assert f"127.0.0.1:{port}" in endpoints.target.all_endpoints()
    finally:
        endpoints.close()
    handle = coordinator_server.create(args)
    try:
        with grpc.insecure_channel(handle.address) as channel:
            response = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
                request(20, k=0), timeout=60)
    finally:
        handle.stop(0)
    assert list(response.token_ids) == in_process(models, 20)


def test_concurrent_sessions_spread_over_the_replicas(
        models: Models, replicas: dict[str, list[Replica]], coordinator: Coordinator) -> None:
    targets = [r.endpoint for r in replicas["target"]]
    drafts = [r.endpoint for r in replicas["draft"]]
    before_targets, before_drafts = coordinator.pins("target", targets), \
        coordinator.pins("draft", drafts)
    seeds = list(range(16))
    with ThreadPoolExecutor(len(seeds)) as pool:
        outputs = list(pool.map(lambda seed: list(coordinator.stub.Generate(
            request(24, seed=seed), timeout=120).token_ids), seeds))
    # Seeded sampling is keyed by (seed, position): the replica a session lands on and
    # the sessions beside it change nothing.
    assert outputs == [in_process(models, 24, seed) for seed in seeds]
    after_targets, after_drafts = coordinator.pins("target", targets), \
        coordinator.pins("draft", drafts)
    spread = {e: after_targets[e] - before_targets[e] for e in targets}
    assert sum(spread.values()) == len(seeds)
    # Both replicas serve sessions (one channel per endpoint, not gRPC's pick_first).
    # Rendezvous hashing of 16 random session ids leaves a replica empty with
    # probability 2 * 2**-16, so this cannot flake in practice.
    assert min(spread.values()) >= 1, spread
    assert all(after_drafts[e] > before_drafts[e] for e in drafts)


def test_killing_the_serving_target_keeps_the_output(
        models: Models, replicas: dict[str, list[Replica]], coordinator: Coordinator) -> None:
    group = replicas["target"]
    expected = list(coordinator.stub.Generate(request(LONG), timeout=60).token_ids)
    assert expected == in_process(models, LONG)
    before = coordinator.pins("target", [r.endpoint for r in group])
    kill = kill_serving(coordinator, group, before)
    tokens, last = stream(coordinator, request(LONG), kill)
    assert tokens == expected
    assert last.stats.resyncs >= 1
    after = coordinator.pins("target", [r.endpoint for r in group])
    assert all(after[r.endpoint] == before[r.endpoint] + 1 for r in group), (before, after)


def test_killing_the_serving_draft_keeps_the_output(
        models: Models, replicas: dict[str, list[Replica]], coordinator: Coordinator) -> None:
    group = replicas["draft"]
    expected = in_process(models, LONG)
    before = coordinator.pins("draft", [r.endpoint for r in group])
    message = request(LONG)
    message.speculation.prompt_lookup_tokens = 0  # every round asks the draft
    tokens, last = stream(coordinator, message, kill_serving(coordinator, group, before))
    assert tokens == expected
    assert last.stats.resyncs >= 1  # the next Propose re-sent the prefix to the other draft
    after = coordinator.pins("draft", [r.endpoint for r in group])
    assert all(after[r.endpoint] == before[r.endpoint] + 1 for r in group), (before, after)
    assert last.stats.draft_tokens > 0
