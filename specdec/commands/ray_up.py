"""`specdec ray`: draft and target replicas as Ray actors, the coordinator here."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.commands.up import service_args
from specdec.config import add_service_settings, add_setting, serve_parser
from specdec.telemetry.settings import add_telemetry_settings, trace_file_for

if TYPE_CHECKING:
    from coordinator.endpoints import ReplicaEndpoints
    from specdec.serving.ray_replicas import Replicas, ReplicaSpec

log = logging.getLogger(__name__)

# Environment the replicas need wherever Ray places them: tracing export, model cache,
# offline hub, inductor's cache of the compiled draft, and the OpenMP waiting policy
# `specdec up` gives its services.
FORWARDED_ENV_PREFIXES = ("OTEL_", "SPECDEC_", "HF_", "TORCHINDUCTOR_")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ray", help="run draft and target replicas as Ray actors across a Ray cluster, "
        "and the coordinator in this process, until Ctrl-C")
    add_setting(parser, "--ray-address", "",
                "Ray cluster to join: host:port, or 'auto' for the one `ray start` began on "
                "this node (empty: RAY_ADDRESS if set, else a local Ray for this run only)")
    for role in ("draft", "target"):
        add_setting(parser, f"--{role}-replicas", 1, f"{role} service replicas", type=int)
        add_setting(parser, f"--{role}-replica-cpus", 1.0,
                    f"CPUs Ray reserves per {role} replica (also its torch threads unless "
                    "--torch-threads is set)", type=float)
        add_setting(parser, f"--{role}-replica-gpus", 0.0,
                    f"GPUs Ray reserves per {role} replica (use with --device cuda)",
                    type=float)
    add_setting(parser, "--host", "127.0.0.1", "interface the coordinator listens on")
    add_setting(parser, "--coordinator-port", 50051, "coordinator port (0 = any free port)",
                type=int)
    add_setting(parser, "--startup-timeout-s", 300.0,
                "how long to wait for every replica to load and serve (and for a "
                "replacement to)", type=float)
    add_setting(parser, "--watch-interval-s", 10.0,
                "how often to check that every replica's actor is alive; a dead one is "
                "replaced", type=float)
    add_setting(parser, "--placement", "default",
                "how Ray places the replicas: default (Ray's hybrid policy, which fills a "
                "node up to a load threshold first) or spread (round-robin over the nodes, "
                "so the replicas of one role sit on different nodes)",
                choices=("default", "spread"))
    add_service_settings(parser)
    add_telemetry_settings(parser)
    parser.set_defaults(func=run)


def replica_env() -> dict[str, str]:
    from specdec.serving.stack import SERVICE_THREAD_ENV

    forwarded = {name: value for name, value in os.environ.items()
                 if name.startswith(FORWARDED_ENV_PREFIXES)}
    return {**SERVICE_THREAD_ENV, **forwarded}


def replica_telemetry_argv(args: argparse.Namespace) -> list[str]:
    """Tracing as asked; each replica its own trace file and any free metrics port."""
    argv = ["--tracing", args.tracing, "--trace-tokens", args.trace_tokens,
            "--trace-dir", str(Path(args.trace_dir).resolve()),
            "--metrics-port", "-1" if args.metrics_port == -1 else "0"]
    if trace_file_for(args, "coordinator") is None:
        argv += ["--trace-file", "none"]
    return argv


def run(args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError:
        raise RuntimeError("specdec ray needs Ray: pip install 'specdec[ray]'") from None

    from specdec.serving.grpc_server import serve_until_signal
    from specdec.serving.ray_replicas import ReplicaSpec, start_replicas
    from specdec.telemetry.service import Telemetry

    specs = [ReplicaSpec(role, getattr(args, f"{role}_replicas"),
                         getattr(args, f"{role}_replica_cpus"),
                         getattr(args, f"{role}_replica_gpus"), args.torch_threads)
             for role in ("target", "draft")]
    check_reachable(args.ray_address)
    # "local": a Ray of this run's own, even where `ray start` left this node's address
    # on record (ray.init(None) would join that cluster, or wait on it when it is gone).
    address = args.ray_address or os.environ.get("RAY_ADDRESS") or "local"
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    except ConnectionError as error:
        raise RuntimeError(f"cannot reach the Ray cluster at {args.ray_address!r}: {error} "
                           "(is `ray start` running there? see --ray-address)") from None
    try:
        resources = ray.cluster_resources()
        print(f"Ray cluster: {resources.get('CPU', 0):g} CPUs, "
              f"{resources.get('GPU', 0):g} GPUs; starting "
              f"{args.target_replicas} target and {args.draft_replicas} draft replicas",
              flush=True)
        check_capacity(specs, resources)
        argv = [*service_args(args), *replica_telemetry_argv(args)]
        replicas = start_replicas(specs, argv, replica_env(), args.startup_timeout_s,
                                  spread=args.placement == "spread")
        try:
            for info in replicas.infos:
                metrics = f"  metrics :{info.metrics_port}" if info.metrics_port else ""
                print(f"{info.role} replica {info.index}  {info.address}  "
                      f"node {info.node_id[:12]}  pid {info.pid}{metrics}", flush=True)
            coordinator_args = serve_parser().parse_args([
                "coordinator", "--host", args.host, "--port", str(args.coordinator_port),
                "--draft-endpoint", replicas.endpoints("draft"),
                "--target-endpoint", replicas.endpoints("target"), *service_args(args)])
            from coordinator import server

            telemetry = Telemetry.from_args(args, "coordinator")
            handle, endpoints = server.create_with_endpoints(coordinator_args,
                                                             telemetry=telemetry)
            stopped = threading.Event()
            watcher = threading.Thread(
                target=_watch, args=(replicas, endpoints, stopped, args.watch_interval_s,
                                     args.startup_timeout_s), daemon=True)
            watcher.start()
            print(f"ready: specdec generate \"Hello\" --endpoint {handle.address}   "
                  "(Ctrl-C stops the coordinator and every replica)", flush=True)
            try:
                serve_until_signal(handle, args.grace_s)
            finally:
                stopped.set()
        finally:
            replicas.stop(args.grace_s)
        print(f"stopped: coordinator and {len(replicas.actors)} replicas", flush=True)
        return 0
    finally:
        ray.shutdown()  # disconnects; a local Ray started by this run also stops


def check_capacity(specs: Sequence[ReplicaSpec], resources: Mapping[str, float]) -> None:
    """Fail at once, with the arithmetic, when the cluster cannot hold every replica at
    the same time (Ray would keep them pending until --startup-timeout-s)."""
    for resource, flag, per_replica in (("CPU", "cpus", "num_cpus"),
                                        ("GPU", "gpus", "num_gpus")):
        terms = [(spec, getattr(spec, per_replica)) for spec in specs]
        needed = sum(spec.count * each for spec, each in terms)
        have = float(resources.get(resource, 0.0))
        if needed <= have + 1e-9:
            continue
        sum_text = " + ".join(f"{spec.count} {spec.role} x {each:g}" for spec, each in terms
                              if each)
        flags = " / ".join(f"--{spec.role}-replica-{flag}" for spec, _ in terms)
        raise RuntimeError(
            f"the Ray cluster has {have:g} {resource}s but the replicas need {sum_text} = "
            f"{needed:g}; lower {flags} (e.g. 0.5 each), run fewer replicas, or add nodes")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a host:port nothing listens on (ray.init would retry for minutes)."""
    if not address or address == "auto" or "://" in address:
        return  # a local Ray, this node's, or a Ray Client URI: ray.init reports those
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError(f"--ray-address {address!r} is not host:port, 'auto' or empty")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise RuntimeError(f"cannot reach the Ray cluster at {address!r}: {error} (is "
                           "`ray start --head` running there? see --ray-address)") from None


def _watch(replicas: Replicas, endpoints: ReplicaEndpoints, stopped: threading.Event,
           interval_s: float, timeout_s: float) -> None:
    """Replace replicas that die. Until a replacement serves, the coordinator routes
    around the dead one (sessions move and re-send their prefix); then the replica set
    lists the new address and new sessions spread over it again."""
    while not stopped.wait(interval_s):
        for dead in replicas.dead():
            if stopped.is_set():
                return
            log.warning("%s replica %d (%s) is gone; starting a replacement", dead.role,
                        dead.index, dead.address)
            try:
                info = replicas.replace(dead, timeout_s)
            except RuntimeError as error:  # tried again at the next check
                log.error("could not replace %s replica %d: %s", dead.role, dead.index,
                          error)
                continue
            replica_set = endpoints.target if info.role == "target" else endpoints.draft
            if replica_set is not None:
                replica_set.replace_static(replicas.addresses(info.role))
            metrics = f"  metrics :{info.metrics_port}" if info.metrics_port else ""
            print(f"replaced {info.role} replica {info.index}: {dead.address} -> "
                  f"{info.address}  node {info.node_id[:12]}  pid {info.pid}{metrics}",
                  flush=True)
