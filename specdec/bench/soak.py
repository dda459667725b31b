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
import contextlib
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from specdec.config import add_setting

ROLES = ("target", "draft")

# A lost node's actors count as dead once the GCS misses the node's health checks: here 3
# missed checks a second apart (Ray's defaults: 5, 3 s apart), so `specdec ray`'s watcher
# replaces them sooner.
RAY_HEALTH_CHECKS = {"RAY_health_check_initial_delay_ms": "1000",
                     "RAY_health_check_period_ms": "1000",
                     "RAY_health_check_failure_threshold": "3"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "soak", help="bounded load, cancellation and replica-kill test of a replicated stack "
        "(local processes, or `specdec ray` on a two-node Ray cluster with --ray)")
    add_setting(parser, "--soak-clients", 16, "concurrent clients", type=int)
    add_setting(parser, "--soak-duration-s", 600.0, "how long the load runs", type=float)
    add_setting(parser, "--kill-every-s", 60.0,
                "kill a draft or target replica (in turn) with SIGKILL this often; it is "
                "restarted (local) or replaced (--ray) (0 = never)", type=float)
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
    parser.add_argument("--ray", action="store_true",
                        help="run the replicas under `specdec ray` on a two-node Ray cluster "
                        "started on this machine, and remove the second node mid-load")
    add_setting(parser, "--replica-cpus", 0.5,
                "with --ray: CPUs Ray reserves per replica; each node offers enough for "
                "every replica, so one node can hold them all", type=float)
    add_setting(parser, "--remove-node-at", 0.5,
                "with --ray: when to remove the second node, as a fraction of "
                "--soak-duration-s (1 or more = never)", type=float)
    add_setting(parser, "--ray-watch-interval-s", 2.0,
                "with --ray: how often `specdec ray` checks for dead replicas", type=float)
    parser.add_argument("--target-model", default=None,
                        help="target model (default: the services' SPECDEC_TARGET_MODEL)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model (default: the services' SPECDEC_DRAFT_MODEL)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra flag for every `specdec serve` (or `specdec ray`) "
                        "(repeatable, e.g. --serve-arg=--dtype=float32)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--log-dir", default="", help="service logs (default: a temp dir)")
    parser.add_argument("--json", default="", help="also write the report here")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def victim(turn: int, replicas: int) -> str:
    """The replica a kill takes: roles alternate, draft first; the same index of each in
    turn."""
    return f"{('draft', 'target')[turn % 2]}-{(turn // 2) % replicas}"


@dataclass
class Replica:
    """A draft or target replica as the soak reaches it."""

    name: str  # role-index
    endpoint: str
    metrics_port: int
    pid: int


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
    return {"pid": pid, "threads": process.num_threads(), "fds": process.num_fds(),
            "rss_mb": round(process.memory_info().rss / 2**20, 1)}


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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


class Stack(Protocol):
    """What the load needs of a replicated stack."""

    coordinator_endpoint: str

    def start(self) -> None: ...

    def replicas(self) -> list[Replica]: ...

    def pids(self) -> dict[str, int]:
        """Every process to watch (replicas and the coordinator's), by name."""
        ...

    def kill(self, turn: int) -> str | None:
        """SIGKILL this turn's replica (it comes back) and name it; None when the stack
        puts the kill off."""
        ...

    def settle(self) -> None:
        """Wait until every replica serves again."""
        ...

    def stop(self) -> None: ...

    def report(self, load_started: float) -> tuple[dict[str, Any], list[str]]:
        """The stack's own report entries and its failed checks (after stop)."""
        ...


class LocalStack:
    """2 x --replicas `specdec serve` children and a coordinator over them; a killed
    replica is restarted on its port."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], log_dir: Path) -> None:
        from specdec.stack import free_port, host_cpus, split_threads

        self.args = args
        serve = [sys.executable, "-m", "specdec.cli", "serve"]
        # Each draft/target pair gets its share of the cores, split as `specdec up`
        # splits them, unless --serve-arg or SPECDEC_TORCH_THREADS sets the threads.
        threads = split_threads(args.serve_arg, {}, env,
                                max(1, host_cpus() // args.replicas))
        self.processes: list[Process] = []
        for role in ROLES:
            for index in range(args.replicas):
                port, metrics = free_port(), free_port()
                self.processes.append(Process(
                    role, f"{role}-{index}", port, metrics,
                    [*serve, role, "--port", str(port), "--metrics-port", str(metrics),
                     *model_flags(args), *args.serve_arg, *threads.get(role, [])],
                    log_dir / f"{role}-{index}.log", env))
        endpoints = {role: ",".join(p.endpoint for p in self.processes if p.role == role)
                     for role in ROLES}
        port = free_port()
        self.coordinator = Process(
            "coordinator", "coordinator", port, free_port(),
            [*serve, "coordinator", "--port", str(port), "--metrics-port", "-1",
             "--draft-endpoint", endpoints["draft"], "--target-endpoint",
             endpoints["target"], *model_flags(args), *args.serve_arg],
            log_dir / "coordinator.log", env)
        self.coordinator_endpoint = self.coordinator.endpoint

    def start(self) -> None:
        from specdec.grpc_server import wait_healthy

        for role in ROLES:  # targets first: drafts time their precision at load
            starting = [p for p in self.processes if p.role == role]
            for process in starting:
                process.start()
            for process in starting:
                if not wait_healthy(process.endpoint, self.args.startup_timeout_s):
                    raise RuntimeError(f"{process.name} did not start; log: {process.log}")
        self.coordinator.start()
        if not wait_healthy(self.coordinator.endpoint, self.args.startup_timeout_s):
            raise RuntimeError(f"the coordinator did not start; log: {self.coordinator.log}")

    def replicas(self) -> list[Replica]:
        return [Replica(p.name, p.endpoint, p.metrics_port, p.proc.pid)
                for p in self.processes if p.proc is not None]

    def pids(self) -> dict[str, int]:
        return {p.name: p.proc.pid for p in [*self.processes, self.coordinator]
                if p.proc is not None}

    def kill(self, turn: int) -> str | None:
        name = victim(turn, self.args.replicas)
        next(p for p in self.processes if p.name == name).kill_and_restart()
        return name

    def settle(self) -> None:
        from specdec.grpc_server import wait_healthy

        for process in self.processes:
            wait_healthy(process.endpoint, self.args.startup_timeout_s)

    def stop(self) -> None:
        self.coordinator.stop()
        for process in self.processes:
            process.stop()

    def report(self, load_started: float) -> tuple[dict[str, Any], list[str]]:
        return {"restarted": [p.name for p in self.processes if p.restarts]}, []


def session_pids(sid: int) -> list[int]:
    """The live processes of a session (zombies excluded)."""
    import psutil

    found = []
    for process in psutil.process_iter(["status"]):
        try:
            if (process.info["status"] != psutil.STATUS_ZOMBIE
                    and os.getsid(process.pid) == sid):
                found.append(process.pid)
        except (OSError, psutil.Error):
            continue
    return found


class RayNode:
    """One Ray node on this machine, begun by `ray start` in a session of its own: the
    node's processes (GCS on the head, raylet, agents, the actors' workers) all stay in
    that session after `ray start` returns, which is how they are found and killed."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def sid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float) -> None:
        """Returns once the node is registered with the GCS (`ray start` has exited)."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`ray start` for the {self.name} node did not finish within "
                               f"{timeout_s:.0f} s; log: {self.log}") from None
        if code != 0:
            raise RuntimeError(f"`ray start` for the {self.name} node failed (exit {code}); "
                               f"log: {self.log}")

    def holds(self, pid: int) -> bool:
        try:
            return self.proc is not None and os.getsid(pid) == self.sid
        except OSError:
            return False

    def signal_all(self, signum: int) -> int:
        """Send signum to every process of the node; how many there were."""
        if self.proc is None:
            return 0
        pids = session_pids(self.sid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return len(pids)

    def stop(self, grace_s: float = 3.0) -> int:
        """SIGTERM to every process of the node, SIGKILL to those left after grace_s (a
        raylet whose GCS has gone keeps trying to reach it); returns how many are still
        there after that."""
        if self.proc is None:
            return 0
        for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if not self.signal_all(signum):
                break
            deadline = time.monotonic() + wait_s
            while session_pids(self.sid) and time.monotonic() < deadline:
                time.sleep(0.2)
        if self.proc.poll() is None:  # a `ray start` that never returned
            self.proc.wait(5)
        return len(session_pids(self.sid))


LISTED = re.compile(r"(target|draft) replica (\d+)\s+(\S+)\s+node (\S+)\s+pid (\d+)"
                    r"(?:\s+metrics :(\d+))?")
REPLACED = re.compile(r"replaced (target|draft) replica (\d+): (\S+) -> (\S+)\s+node (\S+)"
                      r"\s+pid (\d+)(?:\s+metrics :(\d+))?")


class RayStack:
    """`specdec ray --placement spread` on a two-node Ray cluster begun on this machine;
    its replicas are Ray actors, its coordinator runs in the driver process. Replicas are
    known from the driver's output (each listed at start, each replacement printed)."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], log_dir: Path) -> None:
        import tempfile

        from specdec.stack import free_port

        if args.replicas < 2:
            raise RuntimeError("--ray needs --replicas 2 or more: a replica of each role on "
                               "each of the two nodes")
        self.args = args
        self.log_dir = log_dir
        # Short, so the nodes' socket paths stay within the 107-byte limit; and Ray's
        # address file lands here, not in /tmp/ray where `ray.init("auto")` reads it.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="specdec-ray-"))
        self.env = {name: value for name, value in env.items()
                    if name not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
        self.env.update(RAY_HEALTH_CHECKS, RAY_USAGE_STATS_ENABLED="0",
                        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        self.address = f"127.0.0.1:{free_port()}"
        self.coordinator_endpoint = f"127.0.0.1:{free_port()}"
        cpus = max(1, math.ceil(2 * args.replicas * args.replica_cpus))
        start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--num-cpus", str(cpus),
                 "--temp-dir", str(self.temp_dir), "--object-store-memory", str(100 * 2**20),
                 "--disable-usage-stats"]
        self.head = RayNode("head", [
            *start, "--head", "--port", self.address.rpartition(":")[2],
            "--include-dashboard=false", "--dashboard-port", str(free_port()),
            "--ray-client-server-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port())],
            self.env, log_dir / "ray-head.log")
        self.second = RayNode("second", [
            *start, "--address", self.address,
            "--dashboard-agent-listen-port", str(free_port())],
            self.env, log_dir / "ray-second.log")
        self.driver: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._changed = threading.Condition()
        self._faults = threading.Lock()  # one kill or removal at a time
        self._current: dict[str, Replica] = {}
        self._ready = False
        self._closed = False
        self.placement: dict[str, str] = {}  # replica -> node, at start
        self.replaced: list[dict[str, Any]] = []  # at: time.monotonic()
        self.removal: dict[str, Any] | None = None
        self.left_running = 0
        self.stop_s = 0.0

    def start(self) -> None:
        from specdec.grpc_server import wait_healthy

        timeout_s = self.args.startup_timeout_s
        self.head.start(timeout_s)
        self.second.start(timeout_s)
        n, cpus = str(self.args.replicas), str(self.args.replica_cpus)
        command = [sys.executable, "-m", "specdec.cli", "ray", "--ray-address", self.address,
                   "--placement", "spread", "--target-replicas", n, "--draft-replicas", n,
                   "--target-replica-cpus", cpus, "--draft-replica-cpus", cpus,
                   "--coordinator-port", self.coordinator_endpoint.rpartition(":")[2],
                   "--metrics-port", "0", "--watch-interval-s",
                   str(self.args.ray_watch_interval_s), "--startup-timeout-s", str(timeout_s),
                   *model_flags(self.args), *self.args.serve_arg]
        self.driver = subprocess.Popen(command, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, env=self.env,
                                       start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="soak-ray-output",
                                        daemon=True)
        self._reader.start()
        log = self.log_dir / "ray.log"
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready or self._closed,
                                          timeout_s + 60):
                raise RuntimeError(f"`specdec ray` did not get ready; log: {log}")
            if not self._ready:
                raise RuntimeError(f"`specdec ray` exited before it was ready; log: {log}")
            current = dict(self._current)
        if not wait_healthy(self.coordinator_endpoint, timeout_s):
            raise RuntimeError(f"the coordinator of `specdec ray` does not serve; log: {log}")
        self.placement = {name: "second" if self.second.holds(r.pid) else "head"
                          for name, r in sorted(current.items())}
        for role in ROLES:
            if {node for name, node in self.placement.items()
                    if name.startswith(role)} != {"head", "second"}:
                raise RuntimeError(f"Ray did not place {role} replicas on both nodes: "
                                   f"{self.placement}")

    def _read(self) -> None:
        assert self.driver is not None and self.driver.stdout is not None
        with open(self.log_dir / "ray.log", "a") as log:
            for line in self.driver.stdout:
                log.write(line)
                log.flush()
                self._parse(line)
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _parse(self, line: str) -> None:
        with self._changed:
            if line.startswith("ready:"):
                self._ready = True
            elif listed := LISTED.match(line):
                role, index, address, _, pid, metrics = listed.groups()
                name = f"{role}-{index}"
                self._current[name] = Replica(name, address, int(metrics or 0), int(pid))
            elif replaced := REPLACED.match(line):
                role, index, old, address, _, pid, metrics = replaced.groups()
                name = f"{role}-{index}"
                self._current[name] = Replica(name, address, int(metrics or 0), int(pid))
                self.replaced.append({"replica": name, "at": time.monotonic(),
                                      "from": old, "to": address})
            else:
                return
            self._changed.notify_all()

    def replicas(self) -> list[Replica]:
        with self._changed:
            return list(self._current.values())

    def pids(self) -> dict[str, int]:
        assert self.driver is not None
        return {"driver": self.driver.pid,
                **{r.name: r.pid for r in sorted(self.replicas(), key=lambda r: r.name)}}

    def kill(self, turn: int) -> str | None:
        """Put off (None) while a replica is down, killed or lost and not yet replaced:
        faults never take every replica of a role at once."""
        with self._faults:
            current = {r.name: r for r in self.replicas()}
            if not all(alive(r.pid) for r in current.values()):
                return None
            name = victim(turn, self.args.replicas)
            pid = current[name].pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_until(lambda: not alive(pid), 5.0)
            return name

    def remove_node(self, at_s: float) -> bool:
        """Every process of the second node (raylet, agents, its replicas) dies at once:
        the node is gone, as when its machine fails. Put off (False) while a replica is
        down, as a kill is."""
        with self._faults:
            current = self.replicas()
            if not all(alive(r.pid) for r in current):
                return False
            lost = sorted(r.name for r in current if self.second.holds(r.pid))
            killed = self.second.signal_all(signal.SIGKILL)
            _wait_until(lambda: not session_pids(self.second.sid), 5.0)
            self.removal = {"at_s": at_s, "at": time.monotonic(), "replicas_lost": lost,
                            "processes_killed": killed}
            return True

    def settle(self) -> None:
        from specdec.grpc_server import wait_healthy

        deadline = time.monotonic() + self.args.startup_timeout_s
        with self._changed:
            self._changed.wait_for(
                lambda: self._closed or all(alive(r.pid) for r in self._current.values()),
                self.args.startup_timeout_s)
        for replica in self.replicas():
            wait_healthy(replica.endpoint, max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """The driver first (Ctrl-C: it stops its coordinator and replicas), then every
        process of both nodes."""
        started = time.monotonic()
        if self.driver is not None and self.driver.poll() is None:
            os.killpg(self.driver.pid, signal.SIGINT)
            try:
                self.driver.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.driver.pid, signal.SIGKILL)
                self.driver.wait()
        self.left_running = self.second.stop() + self.head.stop()
        self.stop_s = time.monotonic() - started
        if self._reader is not None:
            self._reader.join(10)
        # Ray's logs (the replicas' among them) join the soak's; the rest goes.
        for logs in self.temp_dir.glob("session_2*/logs"):
            shutil.copytree(logs, self.log_dir / "ray-logs", dirs_exist_ok=True,
                            ignore_dangling_symlinks=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def report(self, load_started: float) -> tuple[dict[str, Any], list[str]]:
        failed = []
        removal = dict(self.removal) if self.removal else None
        replaced = [{"replica": r["replica"], "at_s": round(r["at"] - load_started, 1),
                     "from": r["from"], "to": r["to"]} for r in self.replaced]
        if removal is not None:
            removed_at = removal.pop("at")
            back = {r["replica"] for r in self.replaced if r["at"] > removed_at}
            removal["replaced"] = sorted(back & set(removal["replicas_lost"]))
            if not removal["replicas_lost"]:
                failed.append("the removed node held no replica")
            if set(removal["replicas_lost"]) - back:
                failed.append("a replica of the removed node was not replaced")
        elif self.args.remove_node_at < 1:
            failed.append("the second node was not removed")
        if self.left_running:
            failed.append("Ray processes left running")
        driver_code = self.driver.returncode if self.driver is not None else None
        if driver_code != 0:
            failed.append(f"`specdec ray` exited with {driver_code}")
        return {"restarted": sorted({r["replica"] for r in self.replaced}),
                "ray": {"nodes": 2, "placement": self.placement, "node_removal": removal,
                        "replaced": replaced, "driver_exit": driver_code,
                        "stop_s": round(self.stop_s, 1),
                        "processes_left": self.left_running}}, failed


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def model_flags(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    if args.target_model:
        flags += ["--target-model", args.target_model]
    if args.draft_model:
        flags += ["--draft-model", args.draft_model]
    return flags


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    if threading.current_thread() is threading.main_thread():
        # SIGTERM stops the stack as Ctrl-C does (no replica or Ray node left behind).
        signal.signal(signal.SIGTERM, _interrupt)
    report = soak(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if report["ok"] else 1


def soak(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from specdec.stack import SERVICE_THREAD_ENV

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

    from specdec.model_service import model_info
    from specdec.models import DEFAULT_TARGET
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
