"""Run draft, target and coordinator as child processes on one host (`up`, `demo`).

The children live exactly as long as the parent: they share one process group of their
own (so a Ctrl-C in the terminal reaches only the parent, which stops them in order), and
each asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG), which covers a
parent killed outright. A child counts as ready only once it has written its own pid to
its ready file after binding its port, so a service answering on the same port from some
other stack is never taken for it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc

from specdec.serving.security import SecuritySettings, channel_credentials

# The draft and target share the host's cores: OpenMP threads wait passively with a
# short spin, which covers the gaps inside one forward without an idle service's threads
# spinning against the busy one's, or against the call's own gRPC and Python work once a
# forward ends (docs/performance.md compares spin counts).
SERVICE_THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
TORCH_THREADS_FLAG = "--torch-threads"
TORCH_THREADS_ENV = "SPECDEC_TORCH_THREADS"

# Stop order: the coordinator first, so no new rounds reach the model services.
ROLES = ("coordinator", "draft", "target")

# Set by start_stack in each child's environment, read by the child (die_with_parent,
# announce_ready).
PARENT_PID_ENV = "SPECDEC_PARENT_PID"
READY_FILE_ENV = "SPECDEC_READY_FILE"
_PR_SET_PDEATHSIG = 1


_handed_out: set[int] = set()  # ports free_port returned in this process
_handed_out_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and none that this process was given before: the
    kernel readily hands a just-released port out again, and callers pick several ports
    (a stack's services, their /metrics) before any child binds one."""
    held: list[socket.socket] = []
    try:
        with _handed_out_lock:
            for _ in range(256):
                sock = socket.socket()
                held.append(sock)  # still bound: the kernel cannot offer it again
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
                if port not in _handed_out:
                    _handed_out.add(port)
                    return port
    finally:
        for sock in held:
            sock.close()
    raise RuntimeError(f"no free port on {host}: 256 tries gave ports handed out before")


def co_located_threads(cpus: int) -> dict[str, int]:
    """Torch threads for a draft and a target on one host of `cpus` CPUs: every CPU for
    each.

    One request's draft and target take turns, so each forward may use every core.
    Under concurrent load their forwards overlap, but the speculation gate keeps the
    draft's share of the work small and the services' OpenMP threads wait passively
    (SERVICE_THREAD_ENV), so an overlapping draft forward costs the target less than
    the cores a split would leave it without; docs/performance.md measures both layouts
    at one and eight clients."""
    return {"draft": cpus, "target": cpus}


def _last_value(args: Sequence[str], flag: str) -> str | None:
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == flag]
    values += [arg.split("=", 1)[1] for arg in args if arg.startswith(flag + "=")]
    return values[-1] if values else None


def split_threads(service_args: Sequence[str], role_args: Mapping[str, Sequence[str]],
                  env: Mapping[str, str], cpus: int) -> dict[str, list[str]]:
    """role_args, plus co_located_threads for each model service whose torch threads
    are left at 0 (auto) by its flags and the environment."""
    out = {role: list(args) for role, args in role_args.items()}
    split = co_located_threads(cpus)
    for role, threads in split.items():
        chosen = (_last_value(out.get(role, ()), TORCH_THREADS_FLAG)
                  or _last_value(service_args, TORCH_THREADS_FLAG)
                  or env.get(TORCH_THREADS_ENV) or "0")
        if chosen.strip() == "0":
            out[role] = [*out.get(role, ()), TORCH_THREADS_FLAG, str(threads)]
    return out


def host_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def die_with_parent() -> None:
    """In a child of start_stack: have the kernel send SIGTERM when the parent dies.

    Linux only (prctl); elsewhere the parent's own signal handlers stop the children. If
    the parent is already gone by now, stop at once.
    """
    parent = os.environ.pop(PARENT_PID_ENV, "")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def announce_ready(address: str) -> None:
    """In a child of start_stack, once its server is bound and serving: write its pid."""
    path = os.environ.pop(READY_FILE_ENV, "")
    if path:
        Path(path).write_text(f"{os.getpid()} {address}\n")


def port_holder(port: int) -> str:
    """Who listens on a TCP port, as far as /proc tells ("pid 123: specdec serve ..."),
    or "" where that cannot be seen (another user's process, not Linux)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" \
                        and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return ""
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (pid_dir / "fd").iterdir()):
                argv = (pid_dir / "cmdline").read_bytes().split(b"\0")
                words = [Path(argv[0].decode()).name] + [a.decode() for a in argv[1:] if a]
                if len(words) > 2 and words[1:3] == ["-m", "specdec.cli"]:
                    words = ["specdec", *words[3:]]
                return f"pid {pid_dir.name}: {' '.join(words)[:120]}"
    return ""


def check_ports_free(host: str, ports: Mapping[str, int]) -> None:
    """Raise RuntimeError naming the first port (by what it is for) that cannot be bound,
    and what holds it if that can be seen. Ports 0 and below are skipped."""
    for name, port in ports.items():
        if port <= 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            # As the gRPC and metrics servers bind: a closed connection's TIME_WAIT on the
            # port does not stop them, a listener does.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as error:
                holder = port_holder(port)
                held = f", held by {holder}" if holder else ""
                raise RuntimeError(f"{name} port {port} on {host} is in use{held} "
                                   f"({error.strerror}); stop that or choose another port"
                                   ) from None


def last_error_line(path: Path) -> str:
    """The last line of a log that looks like an error (else its last line), trimmed."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines()
                 if line.strip()]
    except OSError:
        return ""
    markers = ("error", "Error", "ERROR", "Exception", "Killed")
    errors = [line for line in lines if any(marker in line for marker in markers)]
    line = (errors or lines or [""])[-1]
    return line if len(line) <= 300 else line[:297] + "..."


@dataclass
class Stack:
    host: str
    ports: dict[str, int]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    ready_dir: Path | None = None
    _files: list[IO[bytes]] = field(default_factory=list)
    # TLS towards the children when their SPECDEC_TLS_* settings ask for it (health checks)
    credentials: grpc.ChannelCredentials | None = None

    def endpoint(self, role: str) -> str:
        return f"{self.host}:{self.ports[role]}"

    def dead(self) -> list[str]:
        return [role for role, proc in self.processes.items() if proc.poll() is not None]

    def ready(self, role: str) -> bool:
        """The child itself wrote its ready file (its pid) and its port answers health."""
        proc = self.processes[role]
        if proc.poll() is not None:
            return False
        if self.ready_dir is not None:
            try:
                pid = int((self.ready_dir / role).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return False
            if pid != proc.pid:
                return False
        from specdec.serving.grpc_server import check_health

        return check_health(self.endpoint(role), credentials=self.credentials)

    def failure(self, role: str) -> str:
        """One line: why a child is not serving (its exit and its log's last error)."""
        proc = self.processes[role]
        state = (f"exited with code {proc.returncode}" if proc.poll() is not None
                 else "is not serving")
        cause = last_error_line(self.logs[role]) if role in self.logs else ""
        where = f" (log: {self.logs[role]})" if role in self.logs else ""
        return f"{role} on {self.endpoint(role)} {state}{': ' + cause if cause else ''}{where}"

    def wait_healthy(self, timeout_s: float,
                     roles: Sequence[str] = ("target", "draft", "coordinator")) -> None:
        deadline = time.monotonic() + timeout_s
        for role in roles:
            proc = self.processes[role]
            while not self.ready(role):
                if proc.poll() is not None:
                    raise RuntimeError(self.failure(role))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.failure(role)}: not ready after "
                                       f"{timeout_s:.0f} s (--startup-timeout-s)")
                time.sleep(0.2)

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
        # Anything the children started in their process group (compile workers) goes too.
        group = next((proc.pid for proc in self.processes.values()), None)
        if group is not None:
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
        for handle in self._files:
            handle.close()
        if self.ready_dir is not None:
            shutil.rmtree(self.ready_dir, ignore_errors=True)
        return codes


def start_stack(host: str = "127.0.0.1", ports: dict[str, int] | None = None,
                service_args: Sequence[str] = (), log_dir: Path | None = None,
                env: dict[str, str] | None = None,
                role_args: Mapping[str, Sequence[str]] | None = None,
                role_env: dict[str, dict[str, str]] | None = None,
                draft_after_target_s: float = 0.0) -> Stack:
    """Start the three `specdec serve` processes; call wait_healthy() next.

    Children share a process group of their own, so a Ctrl-C in the terminal reaches
    only the parent, which then stops them in order; each dies with the parent
    (die_with_parent) and reports ready through its ready file (announce_ready). The
    kernel ties a child to the thread that started it, so call this from a thread that
    outlives the stack (the main thread).
    role_args / role_env: extra flags / environment for one role (they win). A model
    service whose torch threads are 0 (auto) gets its share of the host's CPUs
    (co_located_threads).
    draft_after_target_s > 0: start the draft only once the target
    is healthy (waiting at most that long), because the draft times its precision choices
    as it loads (--draft-dtype auto), and timings taken beside the target's load pick
    slow kernels.
    """
    ports = dict(ports or {})
    for role in ROLES:
        ports[role] = ports.get(role) or free_port(host)
    stack = Stack(host, ports, ready_dir=Path(tempfile.mkdtemp(prefix="specdec-ready-")))
    child_env = {**SERVICE_THREAD_ENV, **os.environ, **(env or {}),
                 PARENT_PID_ENV: str(os.getpid())}
    role_args = split_threads(service_args, role_args or {}, child_env, host_cpus())
    group = 0  # the first child starts the group, the others join it
    stack.credentials = channel_credentials(SecuritySettings.from_environ(child_env))
    for role in ("target", "draft", "coordinator"):
        if role == "draft" and draft_after_target_s > 0:
            try:
                stack.wait_healthy(draft_after_target_s, roles=("target",))
            except BaseException:
                stack.stop()
                raise
        command = [sys.executable, "-m", "specdec.cli", "serve", role, "--host", host,
                   "--port", str(ports[role]), *service_args, *role_args.get(role, ())]
        if role == "coordinator":
            command += ["--draft-endpoint", stack.endpoint("draft"),
                        "--target-endpoint", stack.endpoint("target")]
        output: IO[bytes] | None = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            stack.logs[role] = log_dir / f"{role}.log"
            output = open(stack.logs[role], "wb")  # noqa: SIM115 - closed by stop()
            stack._files.append(output)
        ready_file = {READY_FILE_ENV: str(stack.ready_dir / role)} if stack.ready_dir else {}
        stack.processes[role] = subprocess.Popen(
            command, env={**child_env, **(role_env or {}).get(role, {}), **ready_file},
            stdout=output, stderr=subprocess.STDOUT if output else None,
            process_group=group)
        group = group or stack.processes[role].pid
    return stack
