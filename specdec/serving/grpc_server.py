"""The one place a specdec gRPC server is built: thread pool, message limits, health,
reflection, interceptors, graceful stop. Draft, target and coordinator all go through
`build_server`, so cross-cutting concerns (OpenTelemetry, auth) plug in here once.

    handle = build_server([Service(name, register)], host="127.0.0.1", port=50052,
                          interceptors=telemetry.server_interceptors())
    serve_until_signal(handle)
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as reflection_service

from specdec.serving.compute import MainThreadExecutor
from specdec.serving.security import DEFAULT_MAX_MESSAGE_MB, message_options, warn_if_exposed
from specdec.settings import default

log = logging.getLogger(__name__)

# gRPC's own default cap is 4 MB, below q of a long draft over a large vocabulary.
MAX_MESSAGE_BYTES = DEFAULT_MAX_MESSAGE_MB * 1024 * 1024
MESSAGE_OPTIONS = message_options(MAX_MESSAGE_BYTES)


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
                 credentials: grpc.ServerCredentials | None = None,
                 client_auth: bool = False, reflection: bool = True,
                 health_port: int | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 maximum_concurrent_rpcs: int | None = None) -> ServerHandle:
    """Create, bind and start a server; port 0 picks a free port (see handle.address).

    credentials: TLS (specdec.serving.security.server_credentials; client_auth says whether they
    require client certificates), None = plaintext. health_port: also serve the health
    service alone, in plaintext, on that port of the same host (probes that cannot speak
    TLS); it reports what the main port's health service reports.
    maximum_concurrent_rpcs: calls beyond it are answered RESOURCE_EXHAUSTED by gRPC
    itself instead of waiting, unbounded, for a thread (None: no limit)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        # Outermost: it parses each request with the deserializer the inner ones keep,
        # so they all see messages, and a malformed one ends INVALID_ARGUMENT first.
        interceptors=[ParseRequests(), *interceptors],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        # No SO_REUSEPORT: a second server on a busy port must fail, not share traffic.
        options=[*message_options(max_message_bytes), ("grpc.so_reuseport", 0), *options])
    for service in services:
        service.register(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [service.name for service in services]
    if reflection:
        reflection_service.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection_service.SERVICE_NAME], server)
    bind = _bind_address(host, port)
    bound = _add_port(server, bind, credentials)
    probes: grpc.Server | None = None
    if health_port is not None:
        probes = grpc.server(futures.ThreadPoolExecutor(max_workers=2,
                                                        thread_name_prefix="grpc-health"),
                             options=[*message_options(64 * 1024), ("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probes)
        _add_port(probes, _bind_address(host, health_port), None)
        probes.start()
    server.start()
    for name in ("", *names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = bind.rsplit(":", 1)[0] + f":{bound}"
    warn_if_exposed(host, bound, names, tls=credentials is not None, client_auth=client_auth)
    log.info("serving %s on %s%s", ", ".join(names), address,
             " (TLS)" if credentials is not None else "")
    handle = ServerHandle(server, address, health_servicer, names)
    if probes is not None:
        def stop_probes() -> None:
            probes.stop(0).wait()

        handle.on_stop.append(stop_probes)
    return handle


class ParseRequests(grpc.ServerInterceptor):
    """Parse unary requests in the handler instead of in gRPC: gRPC answers a request it
    cannot deserialize with INTERNAL, which blames the server for the caller's bytes;
    here a malformed message gets INVALID_ARGUMENT naming its type."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None or not (
                handler.unary_unary or handler.unary_stream):
            return handler
        parse = handler.request_deserializer
        unary = handler.unary_unary is not None
        inner = handler.unary_unary if unary else handler.unary_stream

        def parsed(data: bytes, context: grpc.ServicerContext) -> Any:
            try:
                request = parse(data)
            except Exception as error:  # noqa: BLE001 - DecodeError, or a type's own check
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the request is not a valid message for {details.method}: "
                              f"{type(error).__name__}: {error}")
            return inner(request, context)

        wrap = (grpc.unary_unary_rpc_method_handler if unary
                else grpc.unary_stream_rpc_method_handler)
        return wrap(parsed, request_deserializer=None,
                    response_serializer=handler.response_serializer)


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _add_port(server: grpc.Server, bind: str,
              credentials: grpc.ServerCredentials | None) -> int:
    try:
        bound = (server.add_secure_port(bind, credentials) if credentials is not None
                 else server.add_insecure_port(bind))
    except RuntimeError as error:
        raise RuntimeError(f"cannot listen on {bind}: {error}") from None
    if not bound:
        raise RuntimeError(f"cannot listen on {bind}")
    return int(bound)


def freeze_loaded_objects() -> None:
    """Move what a service has loaded by now (its model, tokenizer and libraries, which
    live as long as the process) out of the garbage collector's sight: a full collection
    then no longer walks it, stalling the service's calls meanwhile."""
    gc.collect()
    gc.freeze()


def serve_until_signal(handle: ServerHandle, grace_s: float = 5.0,
                       work: MainThreadExecutor | None = None,
                       exit_deadline_s: float | None = None) -> None:
    """Block until SIGINT/SIGTERM (or the server stops), then stop gracefully.

    work: the main thread's queue of model work (specdec.serving.compute); the main thread runs
    it while serving, and while the server drains, since in-flight calls wait on it.
    exit_deadline_s: for a process that serves only this (`specdec serve`), exit with
    status 1 if it still runs this long after the stop began (exit_if_still_running)."""
    work = work or MainThreadExecutor()  # nothing queued: the main thread only waits
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %d: stopping %s", signum, handle.address)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        work.run_until(lambda: stop.is_set() or handle._stopped)
    finally:
        if exit_deadline_s is not None:
            exit_if_still_running(exit_deadline_s)
        stopping = threading.Thread(target=handle.stop, args=(grace_s,), name="stop")
        stopping.start()
        work.run_until(lambda: not stopping.is_alive())
        stopping.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_if_still_running(after_s: float) -> None:
    """Exit the process with status 1 if it is still running after_s from now, first
    writing every thread's stack to stderr (the service's log).

    A stop that waits on a thread that never ends would otherwise keep the process, and
    its port, forever; a child of `specdec up` whose parent died has nobody to SIGKILL
    it. The timer is a daemon thread, so it also fires while the interpreter's exit
    waits for other threads."""

    def expire() -> None:
        time.sleep(after_s)
        log.error("still running %.0f s after the stop began: exiting; the threads were:",
                  after_s)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=expire, name="stop-deadline", daemon=True).start()


def check_health(endpoint: str, service: str = "", timeout_s: float = 1.0,
                 credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> bool:
    """One grpc.health.v1 Check (over TLS with credentials); False on any failure."""
    channel = (grpc.secure_channel(endpoint, credentials, options=list(options))
               if credentials is not None else
               grpc.insecure_channel(endpoint, options=list(options)))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def wait_healthy(endpoint: str, timeout_s: float, service: str = "",
                 alive: Callable[[], bool] = lambda: True,
                 credentials: grpc.ChannelCredentials | None = None) -> bool:
    """Poll health until SERVING, the deadline passes, or alive() says the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        if check_health(endpoint, service, credentials=credentials):
            return True
        time.sleep(0.2)
    return False
