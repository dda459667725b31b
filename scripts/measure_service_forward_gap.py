"""The target service's forward per round, k = 0 against adaptive, inside one stack.

    .venv/bin/python scripts/measure_service_forward_gap.py 2 1 2 1
    .venv/bin/python scripts/measure_service_forward_gap.py 2:GOMP_SPINCOUNT=3000000 2

A variant is `THREADS[:KEY=VALUE,...]`: the target service's torch threads and extra
environment for it alone. Per variant the stack starts once (`specdec.stack.start_stack`,
the draft after the target, tracing off), and the same prompts go through the coordinator
with k = 0 and then adaptive, 3 passes, the last 2 counted. Printed: the target's own
forward time per round (the services' `verify_forward_seconds`) for each, and the gap.
Both sides of the gap come from one stack, so drift of the machine between stacks cancels
(docs/benchmarks.md section 4l). Variants run in the order given; interleave them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from specdec.bench.configs import GRPC, MODES, BenchConfig  # noqa: E402
from specdec.bench.prompts import chat_encoder, load_prompts, select  # noqa: E402
from specdec.bench.systems import grpc_request  # noqa: E402
from specdec.draft_fallback import default_draft_or_truncated  # noqa: E402
from specdec.models import DEFAULT_TARGET, load_tokenizer  # noqa: E402
from specdec.proto.specdec.v1 import coordinator_pb2_grpc  # noqa: E402
from specdec.stack import start_stack  # noqa: E402

LENGTHS = ("0", "adaptive")


def forward_ms_per_round(stub: coordinator_pb2_grpc.CoordinatorStub, prompts: list[list[int]],
                         mode: str, max_new_tokens: int) -> dict[str, float]:
    rounds = dict.fromkeys(LENGTHS, 0)
    forward_s = dict.fromkeys(LENGTHS, 0.0)
    for repeat in range(3):  # the first warms the services' caches and cost tables
        for length in LENGTHS:
            for ids in prompts:
                request = grpc_request(BenchConfig(GRPC, length), MODES[mode], ids,
                                       max_new_tokens, seed=repeat)
                stats = stub.Generate(request, timeout=600).stats
                if repeat:
                    rounds[length] += stats.rounds
                    forward_s[length] += stats.verify_forward_seconds
    return {length: 1000 * forward_s[length] / max(1, rounds[length]) for length in LENGTHS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="THREADS[:KEY=VALUE,...] of the target")
    parser.add_argument("--mode", default="t1", choices=sorted(MODES))
    parser.add_argument("--prompts-per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    draft, _ = default_draft_or_truncated()
    encode = chat_encoder(load_tokenizer(DEFAULT_TARGET))
    prompts = [encode(p.text) for p in select(load_prompts(), args.prompts_per_category)]
    served = ["--draft-model", draft, "--dtype", "bfloat16", "--max-draft-tokens", "16"]
    for variant in args.variants:
        threads, _, env_text = variant.partition(":")
        target_env = dict(item.split("=", 1) for item in env_text.split(",") if item)
        stack = start_stack("127.0.0.1", {}, served, env={"SPECDEC_TRACING": "off"},
                            role_args={"target": ["--torch-threads", threads]},
                            role_env={"target": target_env}, draft_after_target_s=300)
        try:
            stack.wait_healthy(300)
            channel = grpc.insecure_channel(stack.endpoint("coordinator"))
            per_round = forward_ms_per_round(coordinator_pb2_grpc.CoordinatorStub(channel),
                                             prompts, args.mode, args.max_new_tokens)
            channel.close()
        finally:
            stack.stop()
        gap = per_round["adaptive"] - per_round["0"]
        print(f"target {variant:<28} forward per round: k=0 {per_round['0']:.1f} ms, "
              f"adaptive {per_round['adaptive']:.1f} ms, gap {gap:+.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
