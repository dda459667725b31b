"""The replicated stacks `specdec soak` runs its load against: local `specdec serve`
children, or `specdec ray` on a two-node Ray cluster on this machine (specdec.bench.soak)."""


from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

ROLES = ("target", "draft")

# A lost node's actors count as dead once the GCS misses the node's health checks: here 3
# missed checks a second apart (Ray's defaults: 5, 3 s apart), so `specdec ray`'s watcher
# replaces them sooner.
RAY_HEALTH_CHECKS = {"RAY_health_check_initial_delay_ms": "1000",
                     "RAY_health_check_period_ms": "1000",
                     "RAY_health_check_failure_threshold": "3"}


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
        from specdec.serving.stack import free_port, host_cpus, split_threads

        self.args = args
        serve = [sys.executable, "-m", "specdec.cli", "serve"]
        # Each draft/target pair gets its share of the cores, given to both as `specdec
        # up` gives them, unless --serve-arg or SPECDEC_TORCH_THREADS sets the threads.
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
        from specdec.serving.grpc_server import wait_healthy

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
        from specdec.serving.grpc_server import wait_healthy

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

        from specdec.serving.stack import free_port

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
        from specdec.serving.grpc_server import wait_healthy

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
        from specdec.serving.grpc_server import wait_healthy

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
