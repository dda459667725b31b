"""`specdec soak`: load, faults and cancellations against a replicated stack, bounded in
time, all on this machine.

Starts 2 draft and 2 target replicas and one coordinator routing over them, computes
each prompt's greedy output serially, then runs N concurrent clients over the public API
for the duration: most requests run to the end (their output must equal the serial
reference), some are cancelled mid-stream, some get a deadline that expires
mid-generation. Every --kill-every-s seconds one draft or target replica (in turn) is
killed with SIGKILL and comes back. After the load, once every replica serves again, each
prompt runs once more (its output must still equal the reference); then it waits past the
session TTL, reads each replica's sessions and KV bytes from /metrics (both must be back
to zero) and compares threads, file descriptors and RSS with the values before the load.

Two stacks:

- local (the default): each replica and the coordinator is a `specdec serve` child; a
  killed replica is restarted on its port.
- --ray: a two-node Ray cluster on this machine (`ray start --head` and a second `ray
  start` joining it, each in its own session) and `specdec ray --placement spread` on
  it, so each node holds replicas of both roles; the coordinator runs in the `specdec
  ray` driver. At --remove-node-at of the duration, every process of the second node
  (raylet, agents, the replicas on it) is killed with SIGKILL: the node is gone, and
  `specdec ray`'s watcher replaces its replicas on the head node. A killed replica is
  replaced the same way. At the end every process of both nodes is stopped, also on
  Ctrl-C or SIGTERM, and any that remains is counted as a failure.

The report (printed, and written as JSON with --json) counts requests completed, failed
by status, greedy outputs differing from their reference, and requests that ended
without a status, and lists the checks that failed; the exit status is 1 when any did.
"""


from __future__ import annotations

import argparse
import os
import random
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.soak_stacks import (
    ROLES,
    LocalStack,
    RayStack,
    Stack,
    resources,
)


def model_gauges(metrics_port: int) -> dict[str, float]:
    """specdec_active_sessions and specdec_kv_cache_bytes of one service's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                timeout=10) as page:
        text = page.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("specdec_active_sessions", "specdec_kv_cache_bytes"):
            values[family.name] = sum(sample.value for sample in family.samples)
    return values


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    completed: int = 0
    differing: int = 0
    cancelled_by_client: int = 0
    no_status: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(text)


def expected_failure(kind: str, code: str) -> bool:
    """Whether a request of this kind may end with this status.

    A request that runs to the end must succeed. One whose deadline expires ends
    DEADLINE_EXCEEDED: from the coordinator, just before the deadline, naming the target
    it waited for when a killed replica's sessions were still moving; or from the
    client's own timer. A cancelled one ends CANCELLED on the client's side."""
    if kind == "deadline":
        return code == "DEADLINE_EXCEEDED"
    return kind == "cancel" and code == "CANCELLED"


def soak(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from specdec.serving.stack import SERVICE_THREAD_ENV

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="specdec-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**SERVICE_THREAD_ENV, **os.environ, "SPECDEC_SESSION_TTL_S": str(args.soak_ttl_s),
           "SPECDEC_TRACING": os.environ.get("SPECDEC_TRACING", "off")}
    stack: Stack = (RayStack(args, env, log_dir) if args.ray
                    else LocalStack(args, env, log_dir))
    stopping = threading.Event()
    load_started = [time.monotonic()]
    try:
        report, failed = load(args, stack, stopping, load_started)
    finally:
        stopping.set()
        stack.stop()
    extra, stack_failed = stack.report(load_started[0])
    failed += stack_failed
    report.update(extra, ok=not failed, failed_checks=failed, log_dir=str(log_dir))
    return report


def load(args: argparse.Namespace, stack: Stack, stopping: threading.Event,
         load_started: list[float]) -> tuple[dict[str, Any], list[str]]:
    """Start the stack, compute the references, run the clients and the faults, and read
    what is held afterwards. load_started[0] is set when the clients start."""
    import grpc

    from specdec.engine.models import DEFAULT_TARGET, model_info
    from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

    rng = random.Random(args.seed)
    stack.start()
    vocab = model_info(args.target_model or os.environ.get(
        "SPECDEC_TARGET_MODEL", DEFAULT_TARGET)).vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 24))]
               for _ in range(args.soak_prompts)]
    channel = grpc.insecure_channel(stack.coordinator_endpoint)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)

    def request(prompt: list[int]) -> Any:
        return coordinator_pb2.GenerateRequest(prompt_token_ids=prompt,
                                               max_new_tokens=args.soak_max_new_tokens)

    references = [list(stub.Generate(request(p), timeout=600).token_ids) for p in prompts]
    baseline = {name: resources(pid) for name, pid in stack.pids().items()}

    tally = Tally()
    end = time.monotonic() + args.soak_duration_s
    kills: list[dict[str, Any]] = []

    def elapsed() -> float:
        return round(args.soak_duration_s - (end - time.monotonic()), 1)

    def put_off(fault: Callable[[], bool]) -> None:
        """Run a fault; one the stack puts off is tried again each second until the end."""
        while time.monotonic() < end and not fault():
            if stopping.wait(1.0):
                return

    def killer() -> None:
        turn = 0

        def kill() -> bool:
            nonlocal turn
            if (name := stack.kill(turn)) is None:
                return False
            turn += 1
            kills.append({"replica": name, "at_s": elapsed()})
            return True

        while args.kill_every_s > 0 and not stopping.wait(args.kill_every_s):
            put_off(kill)

    def remover(ray: RayStack) -> None:
        if not stopping.wait(args.soak_duration_s * args.remove_node_at):
            put_off(lambda: ray.remove_node(elapsed()))

    def client(seed: int) -> None:
        local = random.Random(seed)
        while time.monotonic() < end and not stopping.is_set():
            index = local.randrange(len(prompts))
            draw = local.random()
            kind = ("cancel" if draw < args.cancel_fraction else
                    "deadline" if draw < args.cancel_fraction + args.deadline_fraction
                    else "full")
            with tally.lock:
                tally.by_kind[kind] += 1
            try:
                if kind == "full":
                    tokens = [t for piece in stub.GenerateStream(
                        request(prompts[index]), timeout=300) for t in piece.token_ids]
                    with tally.lock:
                        tally.completed += 1
                        tally.by_status["OK"] += 1
                        if tokens != references[index]:
                            tally.differing += 1
                            tally.note(f"prompt {index}: {tokens} != {references[index]}")
                elif kind == "deadline":
                    stub.Generate(request(prompts[index]), timeout=local.uniform(0.05, 1.0))
                    with tally.lock:
                        tally.by_status["OK"] += 1
                else:
                    stream = stub.GenerateStream(request(prompts[index]), timeout=300)
                    stop_after = local.randint(1, 4)
                    for count, _ in enumerate(stream, 1):
                        if count >= stop_after:
                            stream.cancel()
                            break
                    with tally.lock:
                        tally.cancelled_by_client += 1
            except grpc.RpcError as error:
                code = error.code()
                with tally.lock:
                    if code is None:
                        tally.no_status += 1
                    else:
                        tally.by_status[code.name] += 1
                        if not expected_failure(kind, code.name):
                            tally.unexpected[f"{kind}: {code.name}"] += 1
                            tally.note(f"{kind}: {code.name}: {error.details()}")
            except Exception as error:  # noqa: BLE001 - counted: a request without a status
                with tally.lock:
                    tally.no_status += 1
                    tally.note(f"{kind}: {type(error).__name__}: {error}")

    load_started[0] = time.monotonic()
    faults = [threading.Thread(target=killer, name="soak-killer", daemon=True)]
    if isinstance(stack, RayStack) and args.remove_node_at < 1:
        faults.append(threading.Thread(target=remover, args=(stack,), name="soak-remover",
                                       daemon=True))
    for thread in faults:
        thread.start()
    clients = [threading.Thread(target=client, args=(args.seed * 1000 + i,),
                                name=f"soak-client-{i}") for i in range(args.soak_clients)]
    try:
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
    finally:
        stopping.set()  # also ends the clients on Ctrl-C
    for thread in faults:
        thread.join()
    load_s = time.monotonic() - load_started[0]
    stack.settle()  # replicas killed or lost must be back before the final read
    # Once more each, with every replica serving again (restarted or replaced ones among
    # them): the outputs must still equal the references.
    after_recovery = Counter[str]()
    for index, prompt in enumerate(prompts):
        try:
            tokens = list(stub.Generate(request(prompt), timeout=120).token_ids)
            after_recovery["differing" if tokens != references[index] else "equal"] += 1
        except grpc.RpcError as error:
            after_recovery[error.code().name if error.code() else "no status"] += 1

    # Sessions of finished, cancelled and expired requests are released by the
    # coordinator; those whose replica died went with it; the TTL covers the rest.
    time.sleep(args.soak_ttl_s * 2 + 1)
    after_gauges = {r.name: model_gauges(r.metrics_port)
                    for r in sorted(stack.replicas(), key=lambda r: r.name)}
    after = {name: resources(pid) for name, pid in stack.pids().items()}
    channel.close()
    held_sessions = sum(g.get("specdec_active_sessions", 0) for g in after_gauges.values())
    held_bytes = sum(g.get("specdec_kv_cache_bytes", 0) for g in after_gauges.values())
    unexpected = dict(tally.unexpected)
    failed = [check for check, failing in (
        ("greedy outputs differ from their reference", tally.differing),
        ("requests ended without a status", tally.no_status),
        ("sessions held after the TTL", held_sessions),
        ("KV bytes held after the TTL", held_bytes),
        ("no request completed", not tally.completed),
        ("unexpected statuses", unexpected),
        ("outputs after recovery differ or fail",
         after_recovery["equal"] != len(prompts))) if failing]
    return {
        "mode": "ray" if args.ray else "local",
        "clients": args.soak_clients, "duration_s": round(load_s, 1),
        "replicas": {role: args.replicas for role in ROLES},
        "requests": dict(tally.by_kind), "completed": tally.completed,
        "status": dict(tally.by_status), "unexpected_status": unexpected,
        "cancelled_by_client": tally.cancelled_by_client,
        "differing_greedy_outputs": tally.differing,
        "ended_without_status": tally.no_status,
        "after_recovery": dict(after_recovery),
        "kills": kills, "held_after_ttl": {"sessions": held_sessions, "kv_bytes": held_bytes,
                                           "by_replica": after_gauges},
        "resources_before": baseline, "resources_after": after,
        "examples": tally.examples,
    }, failed
