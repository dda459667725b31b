"""`specdec soak`: load, faults and cancellations against a local replicated stack, bounded
in time, all on 127.0.0.1.

Starts 2 draft and 2 target replicas and one coordinator routing over them, computes
each prompt's greedy output serially, then runs N concurrent clients over the public API
for the duration: most requests run to the end (their output must equal the serial
reference), some are cancelled mid-stream, some get a deadline that expires
mid-generation. Every --kill-every-s seconds one draft or target replica (in turn) is
killed with SIGKILL and restarted on its port. After the load, it waits past the session
TTL and reads each replica's sessions and KV bytes from /metrics (both must be back to
zero) and compares threads, file descriptors and RSS with the values before the load.

The report (printed, and written as JSON with --json) counts requests completed, failed
by status, greedy outputs differing from their reference, and requests that ended
without a status; the exit status is 1 when any of these checks fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.config import add_setting

ROLES = ("target", "draft")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "soak", help="bounded load, cancellation and replica-kill test of a local stack")
    add_setting(parser, "--soak-clients", 16, "concurrent clients", type=int)
    add_setting(parser, "--soak-duration-s", 600.0, "how long the load runs", type=float)
    add_setting(parser, "--kill-every-s", 60.0,
                "kill a draft or target replica (in turn) with SIGKILL this often, then "
                "restart it (0 = never)", type=float)
    add_setting(parser, "--replicas", 2, "draft and target replicas each", type=int)
    add_setting(parser, "--soak-ttl-s", 5.0,
                "the services' session TTL: every session must be gone twice this long "
                "after the load", type=float)
    add_setting(parser, "--soak-prompts", 8, "distinct prompts (each with its reference)",
                type=int)
    add_setting(parser, "--soak-max-new-tokens", 32, "tokens per request", type=int)
    add_setting(parser, "--cancel-fraction", 0.1, "requests cancelled mid-stream",
                type=float)
    add_setting(parser, "--deadline-fraction", 0.1,
                "requests whose deadline expires mid-generation", type=float)
    parser.add_argument("--target-model", default=None,
                        help="target model (default: the services' SPECDEC_TARGET_MODEL)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model (default: the services' SPECDEC_DRAFT_MODEL)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra flag for every `specdec serve` (repeatable, e.g. "
                        "--serve-arg=--dtype=float32)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--log-dir", default="", help="service logs (default: a temp dir)")
    parser.add_argument("--json", default="", help="also write the report here")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


@dataclass
class Process:
    """One `specdec serve` child, restartable on the same ports."""

    role: str
    name: str
    port: int
    metrics_port: int
    command: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)

    def kill_and_restart(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def resources(pid: int) -> dict[str, float]:
    import psutil

    process = psutil.Process(pid)
    return {"threads": process.num_threads(), "fds": process.num_fds(),
            "rss_mb": round(process.memory_info().rss / 2**20, 1)}


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


def expected_failure(kind: str, code: str, details: str) -> bool:
    """Whether a request of this kind may end with this status.

    A request that runs to the end must succeed. One whose deadline expires may end
    DEADLINE_EXCEEDED, or UNAVAILABLE when the coordinator was still waiting for a target
    (a killed replica's sessions move, which takes longer than the shortest deadlines):
    the coordinator answers just before the deadline, naming the target. A cancelled one
    ends CANCELLED on the client's side."""
    if kind == "deadline":
        return code == "DEADLINE_EXCEEDED" or (
            code == "UNAVAILABLE" and "before the request deadline" in details)
    return kind == "cancel" and code == "CANCELLED"


def run(args: argparse.Namespace) -> int:
    report = soak(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if report["ok"] else 1


def soak(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import grpc

    from specdec.grpc_server import wait_healthy
    from specdec.model_service import model_info
    from specdec.models import DEFAULT_TARGET
    from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
    from specdec.stack import SERVICE_THREAD_ENV, free_port

    rng = random.Random(args.seed)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="specdec-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**SERVICE_THREAD_ENV, **os.environ, "SPECDEC_SESSION_TTL_S": str(args.soak_ttl_s),
           "SPECDEC_TRACING": os.environ.get("SPECDEC_TRACING", "off")}
    models: list[str] = []
    if args.target_model:
        models += ["--target-model", args.target_model]
    if args.draft_model:
        models += ["--draft-model", args.draft_model]
    serve = [sys.executable, "-m", "specdec.cli", "serve"]
    processes: list[Process] = []
    for role in ROLES:
        for index in range(args.replicas):
            port, metrics = free_port(), free_port()
            processes.append(Process(
                role, f"{role}-{index}", port, metrics,
                [*serve, role, "--port", str(port), "--metrics-port", str(metrics), *models,
                 *args.serve_arg], log_dir / f"{role}-{index}.log", env))
    replicas = {role: ",".join(p.endpoint for p in processes if p.role == role)
                for role in ROLES}
    coordinator_port = free_port()
    coordinator = Process(
        "coordinator", "coordinator", coordinator_port, free_port(),
        [*serve, "coordinator", "--port", str(coordinator_port), "--metrics-port", "-1",
         "--draft-endpoint", replicas["draft"], "--target-endpoint", replicas["target"],
         *models, *args.serve_arg], log_dir / "coordinator.log", env)
    everything = [*processes, coordinator]
    stop_killing = threading.Event()
    try:
        for role in ROLES:  # targets first: drafts time their precision at load
            starting = [p for p in processes if p.role == role]
            for process in starting:
                process.start()
            for process in starting:
                if not wait_healthy(process.endpoint, args.startup_timeout_s):
                    raise RuntimeError(f"{process.name} did not start; log: {process.log}")
        coordinator.start()
        if not wait_healthy(coordinator.endpoint, args.startup_timeout_s):
            raise RuntimeError(f"the coordinator did not start; log: {coordinator.log}")

        vocab = model_info(args.target_model or os.environ.get(
            "SPECDEC_TARGET_MODEL", DEFAULT_TARGET)).vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 24))]
                   for _ in range(args.soak_prompts)]
        channel = grpc.insecure_channel(coordinator.endpoint)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        def request(prompt: list[int]) -> Any:
            return coordinator_pb2.GenerateRequest(prompt_token_ids=prompt,
                                                   max_new_tokens=args.soak_max_new_tokens)

        references = [list(stub.Generate(request(p), timeout=600).token_ids) for p in prompts]
        baseline = {p.name: resources(p.proc.pid) for p in everything if p.proc is not None}

        tally = Tally()
        end = time.monotonic() + args.soak_duration_s
        kills: list[dict[str, Any]] = []

        def killer() -> None:
            victims = [p for role in ("draft", "target") for p in processes if p.role == role]
            turn = 0
            while args.kill_every_s > 0 and not stop_killing.wait(args.kill_every_s):
                if time.monotonic() >= end:
                    return
                # Alternate roles; the same index of each in turn.
                victim = victims[(turn % 2) * args.replicas + (turn // 2) % args.replicas]
                turn += 1
                victim.kill_and_restart()
                kills.append({"replica": victim.name, "at_s": round(
                    args.soak_duration_s - (end - time.monotonic()), 1)})

        def client(seed: int) -> None:
            local = random.Random(seed)
            while time.monotonic() < end:
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
                        stub.Generate(request(prompts[index]),
                                      timeout=local.uniform(0.05, 1.0))
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
                            if not expected_failure(kind, code.name, error.details() or ""):
                                tally.unexpected[f"{kind}: {code.name}"] += 1
                                tally.note(f"{kind}: {code.name}: {error.details()}")
                except Exception as error:  # noqa: BLE001 - counted: a request without a status
                    with tally.lock:
                        tally.no_status += 1
                        tally.note(f"{kind}: {type(error).__name__}: {error}")

        started = time.monotonic()
        kill_thread = threading.Thread(target=killer, name="soak-killer", daemon=True)
        kill_thread.start()
        clients = [threading.Thread(target=client, args=(args.seed * 1000 + i,),
                                    name=f"soak-client-{i}") for i in range(args.soak_clients)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        stop_killing.set()
        kill_thread.join()
        load_s = time.monotonic() - started
        for process in processes:  # restarted replicas must be back before the final read
            wait_healthy(process.endpoint, args.startup_timeout_s)

        # Sessions of finished, cancelled and expired requests are released by the
        # coordinator; those whose replica died went with it; the TTL covers the rest.
        time.sleep(args.soak_ttl_s * 2 + 1)
        after_gauges = {p.name: model_gauges(p.metrics_port) for p in processes}
        after = {p.name: resources(p.proc.pid) for p in everything if p.proc is not None}
        channel.close()
        held_sessions = sum(g.get("specdec_active_sessions", 0) for g in after_gauges.values())
        held_bytes = sum(g.get("specdec_kv_cache_bytes", 0) for g in after_gauges.values())
        unexpected = dict(tally.unexpected)
        ok = (tally.differing == 0 and tally.no_status == 0 and held_sessions == 0
              and held_bytes == 0 and tally.completed > 0 and not unexpected)
        return {
            "ok": ok, "clients": args.soak_clients, "duration_s": round(load_s, 1),
            "replicas": {role: args.replicas for role in ROLES},
            "requests": dict(tally.by_kind), "completed": tally.completed,
            "status": dict(tally.by_status), "unexpected_status": unexpected,
            "cancelled_by_client": tally.cancelled_by_client,
            "differing_greedy_outputs": tally.differing, "ended_without_status":
                tally.no_status,
            "kills": kills, "held_after_ttl": {"sessions": held_sessions,
                                               "kv_bytes": held_bytes,
                                               "by_replica": after_gauges},
            "resources_before": baseline, "resources_after": after,
            "restarted": [p.name for p in processes if p.restarts],
            "examples": tally.examples, "log_dir": str(log_dir),
        }
    finally:
        stop_killing.set()
        coordinator.stop()
        for process in processes:
            process.stop()
