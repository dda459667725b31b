"""Draft and target services as Ray actors, placed across a Ray cluster (`specdec ray`).

Each actor runs the same gRPC server `specdec serve draft|target` runs; Ray only picks
the node, reserves the replica's CPUs / GPUs and keeps the process. The coordinator stays
outside Ray (in the `specdec ray` process) and reaches every replica over gRPC, with the
same replica-set routing and health handling as on Kubernetes. Ray is optional
(`pip install 'specdec[ray]'`) and imported only when a cluster is used.
"""

from __future__ import annotations

import logging
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


class ServiceReplica:
    """One draft or target service inside a Ray actor process."""

    def __init__(self, role: str, index: int, argv: Sequence[str]) -> None:
        import importlib

        import ray

        from specdec.commands.serve import serve_parser
        from specdec.telemetry.service import Telemetry

        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # Port 0: any free port, so several replicas can share a node.
        args = serve_parser().parse_args([role, *argv, "--host", "0.0.0.0", "--port", "0"])
        if not args.trace_file:  # one file per replica, not one per role
            args.trace_file = str(Path(args.trace_dir) / f"{role}-{index}.jsonl")
        self.telemetry = Telemetry.from_args(args, role)
        module = importlib.import_module(f"{role}_service.server")
        self.handle = module.create(args, telemetry=self.telemetry)
        context = ray.get_runtime_context()
        self.info = ReplicaInfo(role, index,
                                f"{ray.util.get_node_ip_address()}:{self.handle.port}",
                                context.get_node_id(), self.telemetry.metrics_port)

    def describe(self) -> ReplicaInfo:
        return self.info

    def stop(self, grace_s: float) -> None:
        self.handle.stop(grace_s)


@dataclass
class Replicas:
    """The started actors, by role, with what each reported."""

    actors: list[Any]
    infos: list[ReplicaInfo]

    def endpoints(self, role: str) -> str:
        """The coordinator's --draft-endpoint / --target-endpoint: a host:port list."""
        return ",".join(info.address for info in self.infos if info.role == role)

    def dead(self, timeout_s: float = 5.0) -> list[ReplicaInfo]:
        """Replicas whose actor is gone (node lost, process killed); a slow one is not."""
        import ray
        from ray.exceptions import RayActorError

        pings = [actor.describe.remote() for actor in self.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        gone = []
        for ping, info in zip(pings, self.infos, strict=True):
            if ping in ready:
                try:
                    ray.get(ping)
                except RayActorError:
                    gone.append(info)
        return gone

    def stop(self, grace_s: float) -> None:
        """Graceful stop (in-flight calls finish), then the actors are killed."""
        import ray

        pending = [actor.stop.remote(grace_s) for actor in self.actors]
        try:
            ray.get(pending, timeout=grace_s + 10)
        except Exception as error:  # a dead replica cannot stop; kill the rest anyway
            log.warning("graceful stop of the replicas: %s", error)
        for actor in self.actors:
            ray.kill(actor)


def start_replicas(specs: Sequence[ReplicaSpec], service_argv: Sequence[str],
                   env: dict[str, str], timeout_s: float) -> Replicas:
    """Start the replicas of each spec in turn (those of one spec load in parallel) and
    wait until each serves. Specs in turn, target first: a draft times its precision as
    it loads (--draft-dtype auto), which a target loading on the same node disturbs."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    actor_class = ray.remote(ServiceReplica)
    replicas = Replicas([], [])
    deadline = time.monotonic() + timeout_s  # for all of them together
    try:
        for spec in specs:
            argv = [*service_argv, "--torch-threads", str(spec.threads)]
            started: list[Any] = [actor_class.options(  # type: ignore[attr-defined]
                num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=0,
                runtime_env={"env_vars": env}).remote(spec.role, index, argv)
                for index in range(spec.count)]
            replicas.actors += started
            for index, actor in enumerate(started):
                label = f"{spec.role} replica {index}"
                try:
                    replicas.infos.append(ray.get(
                        actor.describe.remote(), timeout=max(0.0, deadline - time.monotonic())))
                except GetTimeoutError:
                    raise RuntimeError(
                        f"{label} did not start within {timeout_s:.0f} s: the cluster may "
                        "lack the CPUs/GPUs it asks for (see `ray status`)") from None
                except RayActorError as error:
                    raise RuntimeError(f"{label} failed to start: {error}") from None
    except BaseException:
        for actor in replicas.actors:
            ray.kill(actor)
        raise
    return replicas
