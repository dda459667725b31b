"""Two or more `specdec up` stacks with different settings, one request at a time, in turn.

Each stack runs the same pair on its own ports with the environment given for it
(settings are SPECDEC_* variables, e.g. SPECDEC_TRACING=off). Requests go to the stacks
in turn (only one stack works at a time), k=0 and the default speculation, over the
same prompts, each stack first in turn, so a drifting VM slows every stack alike; ratios
are paired per request.
`--checkout NAME=DIR` runs stack NAME from another checkout of specdec (say a `git worktree`
of an earlier commit); give it its own TORCH_EXTENSIONS_DIR, as the C++ operators build per
source. Output: markdown on stdout.

    .venv/bin/python scripts/compare_stacks.py tracing-on: tracing-off:SPECDEC_TRACING=off
    .venv/bin/python scripts/compare_stacks.py --checkout before=/tmp/before \
        before:TORCH_EXTENSIONS_DIR=/tmp/before-kernels now:
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how vaccines train the immune system, in plain words.",
           "Write a Python function that checks whether a string is a palindrome.",
           "Give me five tips for sleeping better.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stacks", nargs="+",
                        help="NAME:VAR=VALUE,VAR=VALUE (the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--first-port", type=int, default=50100)
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                        help="run stack NAME from the specdec checkout in DIR")
    args = parser.parse_args()
    checkouts = dict(item.split("=", 1) for item in args.checkout)

    import grpc

    from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

    processes, stubs = {}, {}
    try:
        for index, spec in enumerate(args.stacks):
            name, _, settings = spec.partition(":")
            env = {**os.environ, **dict(item.split("=", 1) for item in settings.split(",")
                                        if item)}
            port = args.first_port + 10 * index
            command = [sys.executable, "-m", "specdec.cli", "up", "--http-port", "-1",
                       "--coordinator-port", str(port + 1), "--draft-port", str(port + 2),
                       "--target-port", str(port + 3), "--metrics-port", str(port + 4)]
            process = subprocess.Popen(command, env=env, cwd=checkouts.get(name),
                                       stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
            processes[name] = process
            assert process.stdout is not None
            for line in process.stdout:
                if line.startswith("ready"):
                    break
            else:
                raise SystemExit(f"stack {name} did not start")
            stubs[name] = coordinator_pb2_grpc.CoordinatorStub(
                grpc.insecure_channel(f"127.0.0.1:{port + 1}"))
            print(f"stack {name} ready", file=sys.stderr, flush=True)

        def generate(stub: coordinator_pb2_grpc.CoordinatorStub, prompt: str,
                     speculative: bool) -> float:
            speculation = None if speculative else coordinator_pb2.SpeculationParams(
                num_draft_tokens=0)
            stats = stub.Generate(coordinator_pb2.GenerateRequest(
                prompt=prompt, chat=True, max_new_tokens=args.max_new_tokens,
                speculation=speculation)).stats
            return stats.completion_tokens / stats.total_seconds

        for stub in stubs.values():  # warm-up
            generate(stub, PROMPTS[0], False)
            generate(stub, PROMPTS[0], True)
        rates: dict[tuple[str, bool], list[float]] = {}
        names = list(stubs)
        turn = 0
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                # Each stack goes first in turn, prompt by prompt: a request right after
                # another stack's may find the machine busier (exports, spinning threads).
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for speculative in (False, True):
                    for name in order:
                        rates.setdefault((name, speculative), []).append(
                            generate(stubs[name], prompt, speculative))
        base = next(iter(stubs))
        print("| stack | mode | tokens/s (median) | x the first, paired median |")
        print("|---|---|---|---|")
        for speculative in (False, True):
            for name in stubs:
                own, first = rates[(name, speculative)], rates[(base, speculative)]
                ratio = statistics.median(a / b for a, b in zip(own, first, strict=True))
                print(f"| {name} | {'speculative' if speculative else 'k=0'} | "
                      f"{statistics.median(own):.1f} | {ratio:.3f} |")
    finally:
        for process in processes.values():
            process.send_signal(2)
        for process in processes.values():
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
