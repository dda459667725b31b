"""Thread settings of the three co-located services, A/B in one run: tokens/s over gRPC.

Starts the stack (`specdec.stack.start_stack`, as `specdec up` does) once per variant and
sends the same greedy requests through the coordinator: target-only (k = 0) and adaptive
speculation, 2 repeats of 8 bench prompts, the second repeat timed. A variant is
`THREADS[/DRAFT_THREADS][:KEY=VALUE,...][@WORKERS]`: torch threads of the target (and of
the draft, default the same), environment for the services (OpenMP settings), and the
gRPC worker threads of both model services (default: as served). docs/benchmarks.md
section 4g:

    .venv/bin/python scripts/measure_service_threads.py 1 2 2:GOMP_SPINCOUNT=300000

Medians of tokens/s per request. Variants run in the order given; interleave repeats of
them (`2 1 2 1`) on a noisy machine.
"""

from __future__ import annotations

import argparse
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
from specdec.proto.specdec.v1 import coordinator_pb2_grpc  # noqa: E402
from specdec.stack import start_stack  # noqa: E402


def parse_variant(text: str) -> tuple[int, int, dict[str, str], int | None]:
    rest, _, workers = text.partition("@")
    threads, _, env_text = rest.partition(":")
    target_threads, _, draft_threads = threads.partition("/")
    env = dict(item.split("=", 1) for item in env_text.split(",") if item)
    return (int(target_threads), int(draft_threads or target_threads), env,
            int(workers) if workers else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="THREADS[/DRAFT][:K=V,...][@WORKERS]")
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
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
        stack = start_stack("127.0.0.1", {}, served, env={"SPECDEC_TRACING": "off", **env},
                            role_args=role_args)
        try:
            stack.wait_healthy(300)
            channel = grpc.insecure_channel(stack.endpoint("coordinator"))
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            rates = {}
            for length in ("0", "adaptive"):
                timed = []
                for repeat in range(2):  # the first warms the services' caches and costs
                    for ids in prompts:
                        request = grpc_request(BenchConfig(GRPC, length), MODES["greedy"], ids,
                                               args.max_new_tokens, seed=0)
                        started = time.perf_counter()
                        response = stub.Generate(request, timeout=600)
                        if repeat:
                            timed.append(len(response.token_ids)
                                         / (time.perf_counter() - started))
                rates[length] = statistics.median(timed)
            channel.close()
        finally:
            stack.stop()
        print(f"{variant:<32} target-only {rates['0']:6.2f} tok/s  adaptive "
              f"{rates['adaptive']:6.2f} tok/s  ratio {rates['adaptive'] / rates['0']:.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
