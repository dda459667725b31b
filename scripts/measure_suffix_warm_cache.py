"""Suffix decoding once the global tree holds many answers of the same kind.

Starts the three services (`specdec serve`, as `specdec bench` does) with suffix decoding
on and answers --warm prompts under one cache_salt: for `--workload repetition` the
repetition workload's three families generated from another seed, for `prompts` the
draft-training prompt set's templated chat prompts (none equal to a bench prompt). Then
it runs that workload's bench prompts (`--prompts-per-category`) one request at a time,
greedy, in four configurations interleaved per prompt:

- target-only (`speculation.method: none`) through the same services: the baseline;
- adaptive without suffix decoding (`suffix_tokens: 0`);
- adaptive with suffix decoding on a cold tree (a salt of its own: only the request's
  own text and nothing earlier);
- adaptive with suffix decoding on the warm tree (the warm phase's salt).

Prints tokens/s (all tokens over all time) and the ratio to target-only, tokens per
round, and whether every output equals target-only's:

    .venv/bin/python scripts/measure_suffix_warm_cache.py --warm 120

--warm-clients N answers the warm prompts N at a time (the tree is the same either way;
the coordinator adds each answer as its request ends).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.prompts import BenchPrompt, load_prompts, prompt_encoder, select  # noqa: E402
from specdec.bench.workloads import SEED, repetition_prompts  # noqa: E402
from specdec.draft_training.prompts import generate_prompts  # noqa: E402
from specdec.engine import models  # noqa: E402

CONFIGS = ("target-only", "adaptive, no suffix", "suffix, cold tree", "suffix, warm tree")


def request(prompt_ids: list[int], config: str, max_new_tokens: int, salt: str):  # noqa: ANN201
    from specdec.proto.specdec.v1 import coordinator_pb2

    message = coordinator_pb2.GenerateRequest(prompt_token_ids=prompt_ids,
                                              max_new_tokens=max_new_tokens, cache_salt=salt)
    if config == "target-only":
        message.speculation.method = "none"
    elif config == "adaptive, no suffix":
        message.speculation.suffix_tokens = 0
    return message


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=120, help="answers in the warm tree")
    parser.add_argument("--warm-clients", type=int, default=1,
                        help="requests answered at once while the tree is warmed")
    parser.add_argument("--workload", choices=("repetition", "prompts"), default="repetition")
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--suffix-max-tokens", type=int, default=16)
    args = parser.parse_args()

    import grpc
    from transformers import AutoTokenizer

    from specdec.proto.specdec.v1 import coordinator_pb2_grpc
    from specdec.serving.stack import start_stack

    if args.workload == "repetition":
        bench = repetition_prompts()
        candidates = repetition_prompts(seed=SEED + 1, per_family=-(-args.warm // 3))
    else:
        bench = load_prompts()
        candidates = [BenchPrompt(f"warm-{i}", p.category, p.text)
                      for i, p in enumerate(generate_prompts(count=2 * args.warm, seed=1))]
    measured = select(bench, args.prompts_per_category)
    texts = {p.transcript for p in bench}
    warm = [p for p in candidates if p.transcript not in texts][: args.warm]
    encode = prompt_encoder(AutoTokenizer.from_pretrained(models.prepare_smollm2()))
    stack = start_stack("127.0.0.1", {}, ["--draft-compile", "off"],
                        env={"SPECDEC_SUFFIX_MAX_TOKENS": str(args.suffix_max_tokens)},
                        draft_after_target_s=300)
    try:
        stack.wait_healthy(600)
        stub = coordinator_pb2_grpc.CoordinatorStub(
            grpc.insecure_channel(stack.endpoint("coordinator")))
        started = time.monotonic()

        def answer(prompt: BenchPrompt) -> None:
            stub.Generate(request(encode(prompt), "suffix, warm tree", args.max_new_tokens,
                                  "warm"), timeout=600)

        with ThreadPoolExecutor(args.warm_clients) as pool:
            for index, _ in enumerate(pool.map(answer, warm)):
                if (index + 1) % 20 == 0:
                    print(f"warm tree: {index + 1}/{len(warm)} answers, "
                          f"{time.monotonic() - started:.0f} s", flush=True)
        totals = {c: [0, 0.0, 0] for c in CONFIGS}  # tokens, seconds, rounds
        equal = {c: 0 for c in CONFIGS}
        for index, prompt in enumerate(measured):
            ids = encode(prompt)
            reference: list[int] | None = None
            for config in CONFIGS:
                salt = "warm" if config == "suffix, warm tree" else f"cold-{index}-{config}"
                begun = time.perf_counter()
                response = stub.Generate(request(ids, config, args.max_new_tokens, salt),
                                         timeout=600)
                elapsed = time.perf_counter() - begun
                tokens = list(response.token_ids)
                reference = tokens if reference is None else reference
                equal[config] += tokens == reference
                total = totals[config]
                total[0] += len(tokens)
                total[1] += elapsed
                total[2] += response.stats.rounds
        base = totals["target-only"][0] / totals["target-only"][1]
        print(f"\n{len(measured)} {args.workload} prompts x {args.max_new_tokens} tokens, greedy, "
              f"after {len(warm)} warm answers; {os.cpu_count()} CPUs")
        print("| configuration | tokens/s | vs target-only | tokens per round "
              "| equal to target-only |")
        print("|---|---|---|---|---|")
        for config in CONFIGS:
            tokens, seconds, rounds = totals[config]
            rate = tokens / seconds
            print(f"| {config} | {rate:.1f} | {rate / base:.2f}x | {tokens / max(1, rounds):.2f} "
                  f"| {equal[config]}/{len(measured)} |")
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
