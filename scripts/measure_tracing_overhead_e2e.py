"""Tracing overhead through the real services: three stacks of `specdec serve`
processes (coordinator, draft, target each), identical except for observability,
requests alternated between them so background load hits all alike. Reports the
median client wall time and the CPU time the three service processes used per request
(from /proc; far less disturbed than wall time when other work shares the machine).

  off      --tracing off --metrics-port -1
  metrics  --tracing off, Prometheus on
  tracing  tracing on (gRPC client/server spans, request/round spans, JSON-lines files
           with the batch processor) and Prometheus on: the default

    .venv/bin/python scripts/measure_tracing_overhead_e2e.py            # tiny models
    .venv/bin/python scripts/measure_tracing_overhead_e2e.py --target-model DIR --draft-model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specdec.proto.specdec.v1 import (  # noqa: E402
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
)
from specdec.serving.grpc_server import wait_healthy  # noqa: E402
from specdec.serving.stack import free_port  # noqa: E402

MODES = {"off": ["--tracing", "off", "--metrics-port", "-1"],
         "metrics": ["--tracing", "off"],
         "tracing": ["--tracing", "on"]}
ROLES = ("target", "draft", "coordinator")


def tiny_models(root: Path) -> tuple[str, str]:
    from tests.tiny_models import tiny_llama

    paths = []
    for name, kwargs in (("target", {"seed": 2}), ("draft", {"seed": 1, "layers": 1})):
        model = tiny_llama(vocab_size=64, **kwargs)
        model.config.eos_token_id = None  # run to max_new_tokens
        model.generation_config.eos_token_id = None
        model.save_pretrained(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


def start(mode: str, root: Path, target: str, draft: str) -> tuple[int, list[subprocess.Popen]]:
    ports = {role: free_port() for role in ROLES}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPECDEC_"))}
    processes = []
    for role in ROLES:
        command = [sys.executable, "-m", "specdec.cli", "serve", role, "--port",
                   str(ports[role]), "--target-model", target, "--draft-model", draft,
                   "--torch-threads", "1", "--trace-dir", str(root / mode),
                   *MODES[mode]]
        if "--metrics-port" not in MODES[mode]:
            command += ["--metrics-port", str(free_port())]
        if role == "coordinator":
            command += ["--draft-endpoint", f"127.0.0.1:{ports['draft']}",
                        "--target-endpoint", f"127.0.0.1:{ports['target']}"]
        log = open(root / f"{mode}-{role}.log", "wb")  # noqa: SIM115 - process lifetime
        processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    for role, process in zip(ROLES, processes, strict=True):
        if not wait_healthy(f"127.0.0.1:{ports[role]}", 300,
                            alive=lambda p=process: p.poll() is None):
            raise RuntimeError(f"{mode} {role} did not start; see {root}/{mode}-{role}.log")
    return ports["coordinator"], processes


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(processes: list[subprocess.Popen]) -> float:
    """User + system CPU of the processes so far (all their threads)."""
    total = 0
    for process in processes:
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / CLOCK_TICKS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-model", default="")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--prompt", default="",
                        help="prompt text (needs the target's tokenizer); default: fixed ids")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="specdec-overhead-e2e-"))
    target, draft = ((args.target_model, args.draft_model) if args.target_model
                     else tiny_models(root))
    stacks = {mode: start(mode, root, target, draft) for mode in MODES}
    request = coordinator_pb2.GenerateRequest(
        max_new_tokens=args.max_new_tokens,
        sampling=common_pb2.SamplingParams(temperature=0.8, seed=1234),
        speculation=coordinator_pb2.SpeculationParams(num_draft_tokens=args.num_draft_tokens))
    if args.prompt:
        request.prompt = args.prompt
    else:
        request.prompt_token_ids.extend([1, 17, 33, 5, 9, 12, 40, 3])
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, float] = dict.fromkeys(MODES, 0.0)
    rounds = 0
    try:
        stubs = {mode: coordinator_pb2_grpc.CoordinatorStub(
            grpc.insecure_channel(f"127.0.0.1:{port}")) for mode, (port, _) in stacks.items()}
        for stub in stubs.values():  # warm-up: connections, first forwards
            stub.Generate(request, timeout=300)
        order = list(MODES)
        for _ in range(args.repeats):
            random.shuffle(order)
            for mode in order:
                cpu_before = cpu_seconds(stacks[mode][1])
                started = time.perf_counter()
                response = stubs[mode].Generate(request, timeout=300)
                times[mode].append(time.perf_counter() - started)
                cpu[mode] += cpu_seconds(stacks[mode][1]) - cpu_before
                rounds = response.stats.rounds
    finally:
        for _, processes in stacks.values():
            for process in processes:
                process.send_signal(signal.SIGTERM)
            for process in processes:
                process.wait(30)
    base = statistics.median(times["off"])
    cpu_base = cpu["off"] / args.repeats
    report: dict = {"rounds_per_request": rounds, "repeats": args.repeats, "dir": str(root)}
    for mode in MODES:
        median = statistics.median(times[mode])
        report[mode] = {"median_ms": round(median * 1e3, 2),
                        "overhead_ms": round((median - base) * 1e3, 2),
                        "overhead_pct": round((median - base) / base * 100, 1),
                        "overhead_us_per_round": round((median - base) / rounds * 1e6)}
        cpu_per_request = cpu[mode] / args.repeats
        report[mode]["cpu_ms_per_request"] = round(cpu_per_request * 1e3, 1)
        report[mode]["cpu_overhead_us_per_round"] = round(
            (cpu_per_request - cpu_base) / rounds * 1e6)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{rounds} rounds per request, {args.repeats} repeats (medians of client wall time)")
        for mode in MODES:
            r = report[mode]
            print(f"  {mode:8s} {r['median_ms']:8.1f} ms/request   overhead "
                  f"{r['overhead_ms']:+6.1f} ms ({r['overhead_pct']:+.1f}%), "
                  f"{r['overhead_us_per_round']:+d} us/round; CPU {r['cpu_ms_per_request']:.1f}"
                  f" ms/request, {r['cpu_overhead_us_per_round']:+d} us/round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
