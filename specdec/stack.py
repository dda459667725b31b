"""Run draft, target and coordinator as child processes on one host (`up`, `demo`)."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc

from specdec.grpc_server import wait_healthy
from specdec.security import SecuritySettings, channel_credentials

# The draft and target alternate on the same cores. Before forwards ran on one
# compute thread per service, libgomp's default spin let an idle service's threads
# slow the busy one's forward ~7x here (2 cores); fully passive waiting wakes the
# team for each of a forward's ~200 small GEMMs instead (T_target(1) 37 -> 63 ms).
# A short spin covers the gaps inside a forward: with each service's tensor work on
# one compute thread (specdec.model_service), 2 threads each beat 1 thread each
# (target-only over gRPC 25.0-26.4 against 17.7-21.3 tok/s). A 10x longer spin
# (300000) measured level with this one (docs/benchmarks.md section 4g).
SERVICE_THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}

# Stop order: the coordinator first, so no new rounds reach the model services.
ROLES = ("coordinator", "draft", "target")


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Stack:
    host: str
    ports: dict[str, int]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    _files: list[IO[bytes]] = field(default_factory=list)
    # TLS towards the children when their SPECDEC_TLS_* settings ask for it (health checks)
    credentials: grpc.ChannelCredentials | None = None

    def endpoint(self, role: str) -> str:
        return f"{self.host}:{self.ports[role]}"

    def dead(self) -> list[str]:
        return [role for role, proc in self.processes.items() if proc.poll() is not None]

    def wait_healthy(self, timeout_s: float,
                     roles: Sequence[str] = ("target", "draft", "coordinator")) -> None:
        deadline = time.monotonic() + timeout_s
        for role in roles:
            proc = self.processes[role]
            ok = wait_healthy(self.endpoint(role), max(0.0, deadline - time.monotonic()),
                              alive=functools.partial(_alive, proc),
                              credentials=self.credentials)
            if not ok:
                where = f"; log: {self.logs[role]}" if role in self.logs else ""
                state = ("exited with " + str(proc.returncode)) if proc.poll() is not None \
                    else f"not healthy after {timeout_s:.0f} s"
                raise RuntimeError(f"{role} on {self.endpoint(role)} {state}{where}")

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM each (graceful stop), then SIGKILL what is left; return exit codes."""
        for role in ROLES:
            proc = self.processes.get(role)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int | None] = {}
        for role in ROLES:
            proc = self.processes.get(role)
            if proc is None:  # never started
                continue
            try:
                codes[role] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[role] = proc.wait()
        for handle in self._files:
            handle.close()
        return codes


def start_stack(host: str = "127.0.0.1", ports: dict[str, int] | None = None,
                service_args: Sequence[str] = (), log_dir: Path | None = None,
                env: dict[str, str] | None = None,
                role_args: dict[str, Sequence[str]] | None = None,
                role_env: dict[str, dict[str, str]] | None = None,
                draft_after_target_s: float = 0.0) -> Stack:
    """Start the three `specdec serve` processes; call wait_healthy() next.

    Children get their own session, so a Ctrl-C in the terminal reaches only the parent,
    which then stops them in order. role_args / role_env: extra flags / environment for
    one role (they win). draft_after_target_s > 0: start the draft only once the target
    is healthy (waiting at most that long), because the draft times its precision as it
    loads (--draft-dtype auto): beside the target's load on the same 2 cores it measured
    19.5-22.7 ms for steps of 4-8 ms and chose the slowest kernel (docs/benchmarks.md 4j).
    """
    ports = dict(ports or {})
    for role in ROLES:
        ports[role] = ports.get(role) or free_port(host)
    stack = Stack(host, ports)
    child_env = {**SERVICE_THREAD_ENV, **os.environ, **(env or {})}
    stack.credentials = channel_credentials(SecuritySettings.from_environ(child_env))
    for role in ("target", "draft", "coordinator"):
        if role == "draft" and draft_after_target_s > 0:
            try:
                stack.wait_healthy(draft_after_target_s, roles=("target",))
            except BaseException:
                stack.stop()
                raise
        command = [sys.executable, "-m", "specdec.cli", "serve", role, "--host", host,
                   "--port", str(ports[role]), *service_args, *(role_args or {}).get(role, ())]
        if role == "coordinator":
            command += ["--draft-endpoint", stack.endpoint("draft"),
                        "--target-endpoint", stack.endpoint("target")]
        output: IO[bytes] | None = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            stack.logs[role] = log_dir / f"{role}.log"
            output = open(stack.logs[role], "wb")  # noqa: SIM115 - closed by stop()
            stack._files.append(output)
        stack.processes[role] = subprocess.Popen(
            command, env={**child_env, **(role_env or {}).get(role, {})}, stdout=output,
            stderr=subprocess.STDOUT if output else None, start_new_session=True)
    return stack
