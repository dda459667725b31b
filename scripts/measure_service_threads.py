"""Thread settings of the three co-located services, A/B in one run: tokens/s over gRPC.

Starts the stack (`specdec.stack.start_stack`, as `specdec up` does) once per variant and
sends the same requests (greedy unless --mode) through the coordinator: k = 0 and adaptive
speculation, 2 repeats of 8 bench prompts, the second repeat timed. A variant is
`THREADS[/DRAFT_THREADS][:KEY=VALUE,...][@WORKERS]`: torch threads of the target (and of
the draft, default the same), environment for the services (OpenMP settings; a key
`draft.NAME` or `target.NAME` sets NAME for that service only), and the gRPC worker
threads of both model services (default: as served). docs/benchmarks.md section 4g:

    .venv/bin/python scripts/measure_service_threads.py 1 2 2:GOMP_SPINCOUNT=300000

Medians of tokens/s per request, and for adaptive the mean per-round split of the
loop's time: draft and target model time, the wait on each beyond it (transport,
request handling, waking up), and the rest. Then the target's forward per round at k = 0
and adaptive and their gap, both from one stack, so drift between stacks cancels (section
4l: `--mode t1 --prompts-per-category 1 2 1/2 2 1/2`). Variants run in the order given;
interleave repeats of them (`2 1 2 1`) on a noisy machine.

--sched adds, per process and per timed run, what the kernel's scheduler counted for its
threads (/proc/PID/task/TID/schedstat, status and stat): CPU time, time runnable but
waiting for a core, involuntary and voluntary context switches and minor page faults,
per round. A thread that burns a core while another service computes shows up there
(section 4n), and so does an OpenMP worker that sleeps at every barrier (section 4o).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from specdec.bench.configs import GRPC, MODES, BenchConfig  # noqa: E402
from specdec.bench.prompts import chat_encoder, load_prompts, select  # noqa: E402
from specdec.bench.systems import grpc_request  # noqa: E402
from specdec.draft_fallback import default_draft_or_truncated  # noqa: E402
from specdec.models import DEFAULT_TARGET, load_tokenizer  # noqa: E402
from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402
from specdec.stack import start_stack  # noqa: E402

ROLES = ("draft", "target")


def parse_variant(text: str) -> tuple[int, int, dict[str, dict[str, str]], int | None]:
    """Threads of target and draft, environment per role ("" = every service), workers."""
    rest, _, workers = text.partition("@")
    threads, _, env_text = rest.partition(":")
    target_threads, _, draft_threads = threads.partition("/")
    env: dict[str, dict[str, str]] = {"": {}, **{role: {} for role in ROLES}}
    for item in filter(None, env_text.split(",")):
        key, _, value = item.partition("=")
        role, dot, name = key.partition(".")
        if dot and role in ROLES:
            env[role][name] = value
        else:
            env[""][key] = value
    return (int(target_threads), int(draft_threads or target_threads), env,
            int(workers) if workers else None)


Sched = tuple[str, int, int, int, int, int]


def sched_snapshot(pids: dict[str, int]) -> dict[tuple[str, int], Sched]:
    """Per (role, tid): name, ns on a CPU, ns waiting for one, involuntary switches, minor
    page faults, voluntary switches."""
    snapshot = {}
    for role, pid in pids.items():
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                on_cpu, waiting, _ = (task / "schedstat").read_text().split()
                name = (task / "comm").read_text().strip()
                status = (task / "status").read_text()
                minor_faults = int((task / "stat").read_text().rpartition(")")[2].split()[7])
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended between listing and reading
            switches = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            voluntary = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
            snapshot[(role, int(task.name))] = (name, int(on_cpu), int(waiting), switches,
                                                minor_faults, voluntary)
    return snapshot


def sched_report(before: dict[tuple[str, int], Sched], after: dict[tuple[str, int], Sched],
                 rounds: int, wall_s: float) -> list[str]:
    """Lines: per role the ms on a CPU / waiting per round, and its busiest threads."""
    rows: dict[str, list[tuple[float, float, float, float, float, str]]] = {}
    for key, (name, *counts) in after.items():
        start = before.get(key, (name, 0, 0, 0, 0, 0))[1:]
        on_cpu, waiting, switches, faults, voluntary = (
            now - then for now, then in zip(counts, start, strict=True))
        rows.setdefault(key[0], []).append(
            (on_cpu / 1e6 / rounds, waiting / 1e6 / rounds, switches / rounds,
             faults / rounds, voluntary / rounds, f"{name}/{key[1]}"))
    lines = [f"wall {1000 * wall_s / rounds:.1f} ms per round"]
    for role, threads in rows.items():
        threads.sort(reverse=True)
        busiest = ", ".join(f"{label} {cpu:.1f}/{wait:.1f}/{nvcsw:.1f}/{vcsw:.1f}"
                            for cpu, wait, nvcsw, _, vcsw, label in threads[:4] if cpu >= 0.05)
        lines.append(f"{role:<12} cpu {sum(t[0] for t in threads):6.1f} ms, waiting "
                     f"{sum(t[1] for t in threads):5.1f} ms, involuntary switches "
                     f"{sum(t[2] for t in threads):5.1f}, minor faults "
                     f"{sum(t[3] for t in threads):6.1f} per round; busiest "
                     f"(cpu/wait/nvcsw/vcsw): {busiest}")
    return lines


def per_round_ms(stats: list[coordinator_pb2.GenerationStats]) -> dict[str, float]:
    """Mean ms per round: draft model / wait beyond it, target model / wait, the rest."""
    rounds = max(1, sum(s.rounds for s in stats))
    parts = {
        "draft": sum(s.draft_forward_seconds for s in stats),
        "draft wait": sum(s.draft_seconds - s.draft_forward_seconds for s in stats),
        "target": sum(s.verify_forward_seconds for s in stats),
        "target wait": sum(s.verify_seconds - s.verify_forward_seconds for s in stats),
        "other": sum(s.total_seconds - s.draft_seconds - s.verify_seconds for s in stats)}
    return {name: 1000 * value / rounds for name, value in parts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="THREADS[/DRAFT][:K=V,...][@WORKERS]")
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mode", default="greedy", choices=sorted(MODES))
    parser.add_argument("--sched", action="store_true",
                        help="report each process's CPU and run-queue time per round")
    args = parser.parse_args()
    draft, _ = default_draft_or_truncated()
    encode = chat_encoder(load_tokenizer(DEFAULT_TARGET))
    prompts = [encode(p.text) for p in select(load_prompts(), args.prompts_per_category)]
    for variant in args.variants:
        target_threads, draft_threads, env, workers = parse_variant(variant)
        served = ["--draft-model", draft, "--dtype", "bfloat16", "--max-draft-tokens", "16"]
        extra = ["--max-workers", str(workers)] if workers else []
        role_args: dict[str, Sequence[str]] = {
            "target": ["--torch-threads", str(target_threads), *extra],
            "draft": ["--torch-threads", str(draft_threads), *extra]}
        stack = start_stack("127.0.0.1", {}, served, env={"SPECDEC_TRACING": "off", **env[""]},
                            role_args=role_args, role_env={role: env[role] for role in ROLES})
        try:
            stack.wait_healthy(300)
            channel = grpc.insecure_channel(stack.endpoint("coordinator"))
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            rates = {}
            stats: dict[str, list[coordinator_pb2.GenerationStats]] = {"0": [], "adaptive": []}
            pids = {role: proc.pid for role, proc in stack.processes.items()}
            pids["client"] = os.getpid()
            sched: dict[str, list[str]] = {}
            for length in stats:
                timed = []
                for repeat in range(2):  # the first warms the services' caches and costs
                    before, started_all = sched_snapshot(pids), time.perf_counter()
                    for ids in prompts:
                        request = grpc_request(BenchConfig(GRPC, length), MODES[args.mode], ids,
                                               args.max_new_tokens, seed=0)
                        started = time.perf_counter()
                        response = stub.Generate(request, timeout=600)
                        if repeat:
                            timed.append(len(response.token_ids)
                                         / (time.perf_counter() - started))
                            stats[length].append(response.stats)
                rounds = max(1, sum(s.rounds for s in stats[length]))
                sched[length] = sched_report(before, sched_snapshot(pids), rounds,
                                             time.perf_counter() - started_all)
                rates[length] = statistics.median(timed)
            channel.close()
        finally:
            stack.stop()
        print(f"{variant:<32} target-only {rates['0']:6.2f} tok/s  adaptive "
              f"{rates['adaptive']:6.2f} tok/s  ratio {rates['adaptive'] / rates['0']:.2f}",
              flush=True)
        split = {length: per_round_ms(runs) for length, runs in stats.items()}
        print(f"{'':<32} adaptive per round, ms: " + ", ".join(
            f"{name} {ms:.1f}" for name, ms in split["adaptive"].items()), flush=True)
        forward = {length: parts["target"] for length, parts in split.items()}
        print(f"{'':<32} target forward per round: k=0 {forward['0']:.1f} ms, adaptive "
              f"{forward['adaptive']:.1f} ms, gap {forward['adaptive'] - forward['0']:+.1f} ms",
              flush=True)
        if args.sched:
            for length, lines in sched.items():
                for line in lines:
                    print(f"{'':<32} sched k={length}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
