"""Draft and target services as Ray actors, placed across a Ray cluster (`specdec ray`).

Each actor runs the same gRPC server `specdec serve draft|target` runs; Ray only picks
the node, reserves the replica's CPUs / GPUs and keeps the process. The coordinator stays
outside Ray (in the `specdec ray` process) and reaches every replica over gRPC, with the
same replica-set routing and health handling as on Kubernetes. Ray is optional
(`pip install 'specdec[ray]'`) and imported only when a cluster is used.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MODEL_ROLES = ("target", "draft")


@dataclass(frozen=True)
class ReplicaSpec:
    role: str  # "draft" or "target"
    count: int
    num_cpus: float
    num_gpus: float = 0.0
    torch_threads: int = 0  # 0: as many as the CPUs Ray reserves

    def __post_init__(self) -> None:
        if self.role not in MODEL_ROLES:
            raise ValueError(f"unknown replica role {self.role!r}; choose draft or target")
        if self.count < 1:
            raise ValueError(f"--{self.role}-replicas must be at least 1, got {self.count}")
        if self.num_cpus <= 0 or self.num_gpus < 0:
            raise ValueError(f"{self.role} replicas need CPUs > 0 and GPUs >= 0, got "
                             f"{self.num_cpus} CPUs and {self.num_gpus} GPUs")

    @property
    def threads(self) -> int:
        """Threads matching the CPUs Ray reserved unless set, so replicas on one node do
        not oversubscribe its cores (torch's default would take all of them)."""
        return self.torch_threads or max(1, round(self.num_cpus))


@dataclass(frozen=True)
class ReplicaInfo:
    role: str
    index: int
    address: str  # node-ip:port, reachable from the coordinator
    node_id: str
    metrics_port: int | None
    pid: int  # the actor's process on its node


class ServiceReplica:
    """One draft or target service inside a Ray actor process."""

    def __init__(self, role: str, index: int, argv: Sequence[str]) -> None:
        import importlib

        import ray

        from specdec.config import serve_parser
        from specdec.serving.compute import on_own_compute_thread
        from specdec.serving.grpc_server import freeze_loaded_objects
        from specdec.telemetry.service import Telemetry

        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # Port 0: any free port, so several replicas can share a node.
        args = serve_parser().parse_args([role, *argv, "--host", "0.0.0.0", "--port", "0"])
        if not args.trace_file:  # one file per replica, not one per role
            args.trace_file = str(Path(args.trace_dir) / f"{role}-{index}.jsonl")
        self.telemetry = Telemetry.from_args(args, role)
        module = importlib.import_module(f"{role}_service.server")
        # Ray's task loop holds the actor's main thread, so the forwards cannot run there
        # as under `specdec serve`; loading on the thread that runs them keeps the process
        # at one OpenMP pool all the same (specdec/serving/compute.py).
        self.handle = on_own_compute_thread(
            lambda compute: module.create(args, telemetry=self.telemetry, executor=compute))
        freeze_loaded_objects()
        context = ray.get_runtime_context()
        self.info = ReplicaInfo(role, index,
                                f"{ray.util.get_node_ip_address()}:{self.handle.port}",
                                context.get_node_id(), self.telemetry.metrics_port,
                                os.getpid())

    def describe(self) -> ReplicaInfo:
        return self.info

    def stop(self, grace_s: float) -> None:
        self.handle.stop(grace_s)


class Replicas:
    """The started actors, by role, with what each reported; replaces dead ones.

    Thread-safe: `specdec ray`'s watcher replaces replicas while the main thread may stop
    them all.
    """

    def __init__(self, service_argv: Sequence[str], env: dict[str, str],
                 spread: bool = False) -> None:
        self.service_argv = list(service_argv)
        self.env = env
        # Ray's SPREAD strategy: round-robin over the nodes with room, so the replicas of
        # one role land on different nodes; otherwise Ray's default (hybrid) placement.
        self.scheduling = "SPREAD" if spread else "DEFAULT"
        self.actors: list[Any] = []
        self.infos: list[ReplicaInfo] = []
        self._specs: dict[str, ReplicaSpec] = {}
        self._lock = threading.Lock()
        self._stopped = False

    def endpoints(self, role: str) -> str:
        """The coordinator's --draft-endpoint / --target-endpoint: a host:port list."""
        return ",".join(self.addresses(role))

    def addresses(self, role: str) -> list[str]:
        with self._lock:
            return [info.address for info in self.infos if info.role == role]

    def start(self, spec: ReplicaSpec, timeout_s: float) -> None:
        """Start a spec's replicas (they load in parallel) and wait until each serves."""
        self._specs[spec.role] = spec
        started = [self._launch(spec, index) for index in range(spec.count)]
        deadline = time.monotonic() + timeout_s
        for index, actor in enumerate(started):
            info = _wait_ready(actor, f"{spec.role} replica {index}",
                               deadline - time.monotonic(), timeout_s)
            with self._lock:
                self.infos.append(info)

    def replace(self, dead: ReplicaInfo, timeout_s: float) -> ReplicaInfo:
        """Start a new replica in a dead one's place (same role, index and resources);
        it may land on another node and port. Raises RuntimeError if it cannot serve."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the replicas are stopping")
            position = self.infos.index(dead)
            old_actor = self.actors[position]
        actor = self._launch(self._specs[dead.role], dead.index)
        try:
            info = _wait_ready(actor, f"replacement for {dead.role} replica {dead.index}",
                               timeout_s, timeout_s)
        except RuntimeError:
            with self._lock:
                self.actors.remove(actor)
            _kill(actor)
            raise
        with self._lock:
            position = self.infos.index(dead)
            self.infos[position] = info
            self.actors.remove(actor)  # _launch listed it for stop(); now in dead's place
            self.actors[position] = actor
        _kill(old_actor)  # already gone; drops Ray's handle
        return info

    def dead(self, timeout_s: float = 5.0) -> list[ReplicaInfo]:
        """Replicas whose actor is gone (node lost, process killed); a slow one is not."""
        import ray
        from ray.exceptions import RayActorError

        with self._lock:
            pairs = list(zip(self.actors, self.infos, strict=False))
        pings = [actor.describe.remote() for actor, _ in pairs]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        gone = []
        for ping, (_, info) in zip(pings, pairs, strict=True):
            if ping in ready:
                try:
                    ray.get(ping)
                except RayActorError:
                    gone.append(info)
        return gone

    def stop(self, grace_s: float) -> None:
        """Graceful stop (in-flight calls finish), then the actors are killed."""
        import ray

        with self._lock:
            self._stopped = True
            actors = list(self.actors)
        pending = [actor.stop.remote(grace_s) for actor in actors]
        try:
            ray.get(pending, timeout=grace_s + 10)
        except Exception as error:  # a dead replica cannot stop; kill the rest anyway
            log.warning("graceful stop of the replicas: %s", error)
        for actor in actors:
            _kill(actor)

    def _launch(self, spec: ReplicaSpec, index: int) -> Any:
        import ray

        argv = [*self.service_argv, "--torch-threads", str(spec.threads)]
        # Ray's own restart would bring the actor back without telling the coordinator
        # its new address; Replicas.replace does both.
        actor = ray.remote(ServiceReplica).options(  # type: ignore[attr-defined]
            num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=0,
            scheduling_strategy=self.scheduling,
            runtime_env={"env_vars": self.env}).remote(spec.role, index, argv)
        with self._lock:
            self.actors.append(actor)  # listed at once, so stop() also kills one loading
        return actor


def _wait_ready(actor: Any, label: str, left_s: float, timeout_s: float) -> ReplicaInfo:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        info: ReplicaInfo = ray.get(actor.describe.remote(), timeout=max(0.0, left_s))
        return info
    except GetTimeoutError:
        _kill(actor)
        raise RuntimeError(
            f"{label} did not start within {timeout_s:.0f} s: the cluster may lack the "
            "CPUs/GPUs it asks for (see `ray status`)") from None
    except RayActorError as error:
        raise RuntimeError(f"{label} failed to start: {error}") from None


def _kill(actor: Any) -> None:
    import ray

    try:
        ray.kill(actor)
    except Exception as error:  # noqa: BLE001 - an actor already gone cannot be killed
        log.debug("ray.kill: %s", error)


def start_replicas(specs: Sequence[ReplicaSpec], service_argv: Sequence[str],
                   env: dict[str, str], timeout_s: float, spread: bool = False) -> Replicas:
    """Start the replicas of each spec in turn (those of one spec load in parallel) and
    wait until each serves. Specs in turn, target first: a draft times its precision as
    it loads (--draft-dtype auto), which a target loading on the same node disturbs.
    With `spread`, Ray places them round-robin over the nodes (its SPREAD strategy)."""
    replicas = Replicas(service_argv, env, spread)
    deadline = time.monotonic() + timeout_s  # for all of them together
    try:
        for spec in specs:
            replicas.start(spec, deadline - time.monotonic())
    except BaseException:
        for actor in replicas.actors:
            _kill(actor)
        raise
    return replicas
