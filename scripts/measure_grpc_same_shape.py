"""Speculative decoding over gRPC against target-only over the same gRPC stack.

`specdec bench` compares every system with in-process target-only; on a small machine the
three services share the cores (1 thread each), so this script gives the same-shape
ratio: one `specdec serve` stack, the bench prompts, configurations interleaved.

    .venv/bin/python scripts/measure_grpc_same_shape.py --prompts-per-category 2 --repeats 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.prompts import load_prompts, select  # noqa: E402
from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402
from specdec.stack import start_stack  # noqa: E402

CONFIGS = {"target-only (k=0)": (0, False), "k=1": (1, False), "k=2": (2, False),
           "adaptive": (4, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--torch-threads", type=int, default=1, help="per service")
    args = parser.parse_args()
    prompts = [p.text for p in select(load_prompts(), args.prompts_per_category)]
    stack = start_stack("127.0.0.1", {}, ["--torch-threads", str(args.torch_threads)])
    try:
        stack.wait_healthy(300)
        channel = grpc.insecure_channel(stack.endpoint("coordinator"))
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        def run(k: int, adaptive: bool, prompt: str, new_tokens: int) -> tuple[int, float]:
            request = coordinator_pb2.GenerateRequest(prompt=prompt, chat=True,
                                                      max_new_tokens=new_tokens)
            request.speculation.num_draft_tokens = k
            request.speculation.adaptive = adaptive
            started = time.perf_counter()
            response = stub.Generate(request, timeout=600)
            return len(response.token_ids), time.perf_counter() - started

        for k, adaptive in CONFIGS.values():  # warm-up; adaptive sweeps its cost table
            for _ in range(3 if adaptive else 1):
                run(k, adaptive, prompts[0], 40)
        totals: dict[str, list[float]] = {name: [0, 0.0] for name in CONFIGS}
        for _ in range(args.repeats):
            for prompt in prompts:
                for name, (k, adaptive) in CONFIGS.items():
                    tokens, seconds = run(k, adaptive, prompt, args.max_new_tokens)
                    totals[name][0] += tokens
                    totals[name][1] += seconds
        base = totals["target-only (k=0)"][0] / totals["target-only (k=0)"][1]
        for name, (generated, elapsed) in totals.items():
            rate = generated / elapsed
            print(f"{name}: {rate:.2f} tok/s, {rate / base:.2f}x target-only over gRPC")
        channel.close()
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
