"""Where a Ray draft replica loads its model: docs/benchmarks.md section 4p.

Starts a local Ray instance (2 CPUs) and two draft replicas side by side, both with the
services' OpenMP setting (`specdec.stack.SERVICE_THREAD_ENV`) and 2 torch threads:

- split: the model loads on the actor's main thread and its forwards run on
  SessionTable's compute thread (`specdec ray` before the twentieth session);
- one-thread: `ServiceReplica` as committed, which loads on the compute thread that then
  runs the forwards (`specdec.compute.on_own_compute_thread`).

Then it sends Propose(3) rounds to the two in turn (the order flips every round), greedy,
a new session every 40 rounds, and prints per replica the median wall time of a Propose,
the median model time the replica reports, and the voluntary context switches and CPU
time of all the replica process's threads per round, plus the threads that switched most.

    python scripts/measure_ray_replica_threads.py --rounds 150   # about 1 min
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import ray  # noqa: E402
from measure_service_threads import sched_snapshot  # noqa: E402  (this folder)

from coordinator.clients import GrpcDrafter  # noqa: E402
from specdec.commands.serve import serve_parser  # noqa: E402
from specdec.history import TokenHistory  # noqa: E402
from specdec.model_service import model_info  # noqa: E402
from specdec.ray_replicas import ReplicaInfo, ServiceReplica  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.stack import SERVICE_THREAD_ENV  # noqa: E402

PROMPT = [1, 504, 3458, 314, 253, 1789, 30, 1023, 4066, 288, 1562, 2]
ROUNDS_PER_SESSION = 40
WARMUP_ROUNDS = 10


class SplitReplica(ServiceReplica):
    """Loads on the actor's main thread; forwards on SessionTable's own compute thread."""

    def __init__(self, role: str, index: int, argv: list[str]) -> None:
        from specdec.telemetry.service import Telemetry

        args = serve_parser().parse_args([role, *argv, "--host", "127.0.0.1", "--port", "0"])
        self.telemetry = Telemetry.from_args(args, role)
        self.handle = importlib.import_module(f"{role}_service.server").create(
            args, telemetry=self.telemetry)
        self.info = ReplicaInfo(role, index, f"127.0.0.1:{self.handle.port}",
                                ray.get_runtime_context().get_node_id(),
                                self.telemetry.metrics_port, os.getpid())


def thread_counters(pid: int) -> dict[int, tuple[str, int, float]]:
    """tid -> (name, voluntary switches, ms on a CPU) for every thread of pid."""
    return {tid: (name, voluntary, on_cpu_ns / 1e6)
            for (_, tid), (name, on_cpu_ns, _, _, _, voluntary)
            in sched_snapshot({"replica": pid}).items()}


def totals(counters: dict[int, tuple[str, int, float]]) -> tuple[int, float]:
    return (sum(voluntary for _, voluntary, _ in counters.values()),
            sum(on_cpu for _, _, on_cpu in counters.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=150, help="measured rounds per replica")
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    argv = ["--torch-threads", str(args.torch_threads), "--metrics-port", "-1",
            "--tracing", "off"]
    options = {"num_cpus": 1, "max_restarts": 0,
               "runtime_env": {"env_vars": SERVICE_THREAD_ENV}}
    infos: dict[str, ReplicaInfo] = {}
    actors: list[Any] = []  # Ray kills an actor once its last handle is gone
    # One loads at a time: a draft times its precision as it loads.
    for index, (name, cls) in enumerate((("split", SplitReplica),
                                         ("one-thread", ServiceReplica))):
        actors.append(ray.remote(cls).options(**options).remote("draft", index, argv))
        infos[name] = ray.get(actors[-1].describe.remote())  # type: ignore[attr-defined]
    vocab = model_info(serve_parser().parse_args(["draft"]).target_model).vocab_size
    drafters = {}
    for name, info in infos.items():
        address = f"127.0.0.1:{info.address.rsplit(':', 1)[1]}"
        drafters[name] = GrpcDrafter(grpc.insecure_channel(address), address,
                                     vocab_size=vocab, timeout_s=60)

    wall_ms: dict[str, list[float]] = {name: [] for name in infos}
    model_ms: dict[str, list[float]] = {name: [] for name in infos}
    switched: dict[str, int] = dict.fromkeys(infos, 0)
    cpu_ms: dict[str, float] = dict.fromkeys(infos, 0.0)
    first: dict[str, dict[int, tuple[str, int, float]]] = {}
    histories: dict[str, TokenHistory] = {}
    names = list(infos)
    for step in range(args.rounds + WARMUP_ROUNDS):
        if step == WARMUP_ROUNDS:
            first = {name: thread_counters(infos[name].pid) for name in names}
        for name in (names if step % 2 else names[::-1]):
            if step % ROUNDS_PER_SESSION == 0:
                histories[name] = TokenHistory(list(PROMPT))
            before = totals(thread_counters(infos[name].pid))
            started = time.perf_counter()
            proposal = drafters[name].propose(f"s{step // ROUNDS_PER_SESSION}",
                                              histories[name], 3, SamplingParams())
            elapsed = time.perf_counter() - started
            after = totals(thread_counters(infos[name].pid))
            histories[name].extend(proposal.tokens)
            if step >= WARMUP_ROUNDS:
                wall_ms[name].append(elapsed * 1e3)
                model_ms[name].append(proposal.forward_s * 1e3)
                switched[name] += after[0] - before[0]
                cpu_ms[name] += after[1] - before[1]
    for name in names:
        rounds = len(wall_ms[name])
        print(f"{name:>10}: Propose(3) wall median {statistics.median(wall_ms[name]):.2f} ms, "
              f"model median {statistics.median(model_ms[name]):.2f} ms; per round "
              f"{switched[name] / rounds:.1f} voluntary switches, {cpu_ms[name] / rounds:.1f} "
              f"ms on a CPU ({rounds} rounds)")
        last = thread_counters(infos[name].pid)
        busiest = sorted(((last[tid][1] - first[name].get(tid, ("", 0, 0.0))[1], last[tid][0], tid)
                          for tid in last), reverse=True)[:4]
        print(" " * 12 + "most voluntary switches per round: " + ", ".join(
            f"{label}/{tid} {count / rounds:.1f}" for count, label, tid in busiest))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
