"""The one place a specdec gRPC server is built: thread pool, message limits, health,
reflection, interceptors, graceful stop. Draft, target and coordinator all go through
`build_server`, so cross-cutting concerns (OpenTelemetry, auth) plug in here once.

    handle = build_server([Service(name, register)], host="127.0.0.1", port=50052,
                          interceptors=telemetry.server_interceptors())
    serve_until_signal(handle)
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.compute import MainThreadExecutor
from specdec.settings import default

log = logging.getLogger(__name__)

# q for a long draft over a 49k vocabulary is a few MB; gRPC's default cap is 4 MB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MESSAGE_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


@dataclass(frozen=True)
class Service:
    name: str  # full service name, e.g. "specdec.v1.Draft"
    register: Callable[[grpc.Server], None]  # e.g. lambda s: add_DraftServicer_to_server(x, s)


@dataclass
class ServerHandle:
    server: grpc.Server
    address: str  # host:port actually bound (port 0 resolved)
    health: health.HealthServicer
    service_names: list[str]
    on_stop: list[Callable[[], None]] = field(default_factory=list)
    _stopped: bool = False

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, let in-flight calls finish for grace_s, run on_stop hooks."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        for hook in self.on_stop:
            try:
                hook()
            except Exception:  # noqa: BLE001 - one failing hook must not skip the others
                log.exception("stop hook failed")

    def wait(self, timeout_s: float | None = None) -> bool:
        return bool(self.server.wait_for_termination(timeout_s))


def build_server(services: Sequence[Service], *, host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = default("max-workers"),
                 interceptors: Sequence[grpc.ServerInterceptor] = (),
                 options: Sequence[tuple[str, object]] = (),
                 maximum_concurrent_rpcs: int | None = None) -> ServerHandle:
    """Create, bind and start a server; port 0 picks a free port (see handle.address).

    maximum_concurrent_rpcs: calls beyond it are answered RESOURCE_EXHAUSTED by gRPC
    itself instead of waiting, unbounded, for a thread (None: no limit)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=list(interceptors), maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        # No SO_REUSEPORT: a second server on a busy port must fail, not share traffic.
        options=[*MESSAGE_OPTIONS, ("grpc.so_reuseport", 0), *options])
    for service in services:
        service.register(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [service.name for service in services]
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(bind)
    except RuntimeError as error:
        raise RuntimeError(f"cannot listen on {bind}: {error}") from None
    if not bound:
        raise RuntimeError(f"cannot listen on {bind}")
    server.start()
    for name in ("", *names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = bind.rsplit(":", 1)[0] + f":{bound}"
    log.info("serving %s on %s", ", ".join(names), address)
    return ServerHandle(server, address, health_servicer, names)


def serve_until_signal(handle: ServerHandle, grace_s: float = 5.0,
                       work: MainThreadExecutor | None = None) -> None:
    """Block until SIGINT/SIGTERM (or the server stops), then stop gracefully.

    work: the main thread's queue of model work (specdec.compute); the main thread runs
    it while serving, and while the server drains, since in-flight calls wait on it."""
    work = work or MainThreadExecutor()  # nothing queued: the main thread only waits
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %d: stopping %s", signum, handle.address)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        work.run_until(lambda: stop.is_set() or handle._stopped)
    finally:
        stopping = threading.Thread(target=handle.stop, args=(grace_s,), name="stop")
        stopping.start()
        work.run_until(lambda: not stopping.is_alive())
        stopping.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_health(endpoint: str, service: str = "", timeout_s: float = 1.0) -> bool:
    """One grpc.health.v1 Check; False on any failure."""
    with grpc.insecure_channel(endpoint) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def wait_healthy(endpoint: str, timeout_s: float, service: str = "",
                 alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll health until SERVING, the deadline passes, or alive() says the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        if check_health(endpoint, service):
            return True
        time.sleep(0.2)
    return False
