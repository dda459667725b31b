"""`specdec up` as a user's terminal sees it: its services live exactly as long as it
does, and a second `up` on the same ports fails at once instead of claiming "ready"."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from child_process import read_until
from tiny_models import save_tiny_pair

from specdec.serving.stack import check_ports_free, free_port, last_error_line

SPECDEC = [sys.executable, "-m", "specdec.cli"]
ENV = {**os.environ, "SPECDEC_TORCH_THREADS": "1", "SPECDEC_TRACING": "off"}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)
    return save_tiny_pair(tmp_path_factory.mktemp("models"))


def up_command(pair: tuple[Path, Path], ports: dict[str, int], metrics_port: int,
               log_dir: Path) -> list[str]:
    target, draft = pair
    return [*SPECDEC, "up", "--target-model", str(target), "--draft-model", str(draft),
            "--draft-dtype", "float32", "--draft-linear-kernel", "torch",
            "--metrics-port", str(metrics_port), "--log-dir", str(log_dir),
            "--startup-timeout-s", "180", "--http-port", "-1",
            *(arg for role, port in ports.items() for arg in (f"--{role}-port", str(port)))]


def wait_ready(process: subprocess.Popen[str]) -> tuple[list[str], dict[str, int]]:
    """Read `up`'s lines until "ready"; return them and the children's pids."""
    lines = read_until(process, "ready")
    assert lines and lines[-1].startswith("ready"), "".join(lines)
    pids = {match[1]: int(match[2]) for line in lines
            if (match := re.match(r"(\w+)\s+\S+\s+\(pid (\d+)\)", line))}
    assert set(pids) == {"coordinator", "draft", "target"}, lines
    return lines, pids


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first), [] once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def start_ticks(pid: int) -> str:
    """When a process started (field 22 of /proc/PID/stat), or "" once it is gone.

    A pid is reused once the kernel's counter wraps (32768 on many hosts, and a parallel
    test run's processes and threads move it fast), so a pid alone does not name one."""
    fields = proc_stat(pid)
    return fields[19] if len(fields) > 19 else ""


def alive(pid: int, started: str) -> bool:
    """The process that started at `started` still runs (a zombie has exited)."""
    fields = proc_stat(pid)
    return len(fields) > 19 and fields[0] != "Z" and fields[19] == started


class Child(NamedTuple):
    pid: int
    started: str  # start_ticks(pid) while it ran


def children(pids: dict[str, int]) -> dict[str, Child]:
    return {role: Child(pid, start_ticks(pid)) for role, pid in pids.items()}


def wait_gone(running: dict[str, Child], timeout_s: float = 60.0) -> list[str]:
    """The roles still running after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [role for role, child in running.items() if alive(*child)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def stuck_report(left: list[str], running: dict[str, Child], log_dir: Path) -> str:
    """What a child that outlived its stop was doing: its threads and its log's end."""
    report = []
    for role in left:
        tasks = Path(f"/proc/{running[role].pid}/task")
        with contextlib.suppress(OSError):
            names = sorted((task / "comm").read_text().strip() for task in tasks.iterdir())
            report.append(f"{role} threads: {names}")
        with contextlib.suppress(OSError):
            lines = (log_dir / f"{role}.log").read_text(errors="replace").splitlines()
            report.append(f"{role}.log ends:\n" + "\n".join(lines[-20:]))
    return "\n".join(report)


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports() -> tuple[dict[str, int], int]:
    """Three gRPC ports and a run of three free metrics ports (N, N+1, N+2)."""
    ports = {role: free_port() for role in ("coordinator", "draft", "target")}
    for _ in range(50):
        base = free_port()
        if all(bindable(base + i) for i in range(3)) and base + 2 < 65536 \
                and not set(range(base, base + 3)) & set(ports.values()):
            return ports, base
    raise AssertionError("no run of three free ports")


@pytest.fixture
def stack(tiny_pair: tuple[Path, Path], tmp_path: Path
          ) -> Iterator[tuple[subprocess.Popen[str], dict[str, int], int, dict[str, Child]]]:
    ports, metrics = free_ports()
    process = subprocess.Popen(up_command(tiny_pair, ports, metrics, tmp_path / "logs"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=ENV)
    try:
        _, pids = wait_ready(process)
        running = children(pids)
        yield process, ports, metrics, running
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
        for child in running.values() if "running" in locals() else ():
            if alive(*child):
                os.kill(child.pid, signal.SIGKILL)


def test_sighup_stops_every_child_and_frees_the_ports(
        stack: tuple[subprocess.Popen[str], dict[str, int], int, dict[str, Child]],
        tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    process, ports, metrics, running = stack
    # A second `up` on the same ports: an error naming the port, before loading anything.
    started = time.monotonic()
    second = subprocess.run(up_command(tiny_pair, ports, metrics, tmp_path / "second"),
                            capture_output=True, text=True, timeout=120, env=ENV)
    assert second.returncode == 2, second.stdout + second.stderr
    assert "ready" not in second.stdout
    assert f"coordinator gRPC port {ports['coordinator']} on 127.0.0.1 is in use" in \
        second.stderr
    assert f"pid {running['coordinator'].pid}" in second.stderr  # who holds it
    assert len(second.stderr.strip().splitlines()) == 1 and "Traceback" not in second.stderr
    assert time.monotonic() - started < 60  # no model was loaded: far under a stack's start
    assert not (tmp_path / "second").exists()

    # A closed terminal: SIGHUP to `up` only.
    process.send_signal(signal.SIGHUP)
    process.wait(timeout=120)
    left = wait_gone(running)
    assert left == [], stuck_report(left, running, tmp_path / "logs")
    used = [*ports.values(), metrics, metrics + 1, metrics + 2]
    assert [port for port in used if not bindable(port)] == []


def test_children_stop_when_up_is_killed_outright(
        stack: tuple[subprocess.Popen[str], dict[str, int], int, dict[str, Child]],
        tmp_path: Path) -> None:
    process, ports, _, running = stack
    process.kill()  # SIGKILL: no handler of `up` runs; the kernel's PR_SET_PDEATHSIG does
    process.wait(timeout=60)
    left = wait_gone(running)
    assert left == [], stuck_report(left, running, tmp_path / "logs")
    assert [port for port in ports.values() if not bindable(port)] == []


def test_a_port_in_use_is_named_with_its_holder() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"target metrics port {port} on 127.0.0.1 "
                           rf"is in use, held by pid {os.getpid()}"):
            check_ports_free("127.0.0.1", {"target gRPC": 0, "target metrics": port})


def test_last_error_line_finds_the_cause(tmp_path: Path) -> None:
    log = tmp_path / "coordinator.log"
    log.write_text("loading\nTraceback (most recent call last):\n  File x\n"
                   "RuntimeError: coordinator: cannot serve metrics on 127.0.0.1:9464\n")
    assert last_error_line(log).startswith("RuntimeError: coordinator: cannot serve metrics")


def test_a_stop_that_hangs_ends_at_its_deadline_with_the_threads_logged() -> None:
    # A non-daemon thread that never ends holds the interpreter's exit forever.
    code = ("import threading, time\n"
            "from specdec.serving.grpc_server import exit_if_still_running\n"
            "def stuck_worker():\n"
            "    time.sleep(3600)\n"
            "threading.Thread(target=stuck_worker).start()\n"
            "exit_if_still_running(2.0)\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=ENV)
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 30
    assert "still running 2 s after the stop began" in result.stderr, result.stderr
    assert "in stuck_worker" in result.stderr and "in _shutdown" in result.stderr
