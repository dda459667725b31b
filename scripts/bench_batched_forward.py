"""Time one packed forward of B sessions against B forwards of one session each.

Each of B sessions holds a prompt of --context random tokens; a step extends every
session by --rows tokens (1: a decode, k + 1: a verification) from the same committed
position, so every repetition does the same work. Prints a markdown table of the
median over --repeats of: B single-session extends, one extend_batch of all B, and
their ratio.

    python scripts/bench_batched_forward.py --batch-sizes 1,2,4,8,16,32 --rows 1,5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.engine import models
from specdec.engine.runner import ExtendRequest, ModelRunner


def _requests(runner: ModelRunner, sessions: int, context: int, rows: int,
              generator: torch.Generator) -> list[ExtendRequest]:
    requests = []
    for index in range(sessions):
        session_id = f"s{index}"
        fingerprint = runner._sessions[session_id].history.fingerprint(context)
        tokens = torch.randint(0, 49152, (rows,), generator=generator).tolist()
        requests.append(ExtendRequest(session_id, context, fingerprint, tokens,
                                      num_logits=rows))
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = models.load_causal_lm(models.DEFAULT_TARGET, torch.device("cpu"), torch.bfloat16,
                                   progress=False)
    runner = ModelRunner(loaded.model)
    sizes = [int(value) for value in args.batch_sizes.split(",")]
    generator = torch.Generator().manual_seed(0)
    for index in range(max(sizes)):
        prompt = torch.randint(0, 49152, (args.context,), generator=generator).tolist()
        runner.extend(f"s{index}", 0, 0, prompt)
    print(f"row-invariant cap: {runner.max_invariant_rows} rows; context {args.context}, "
          f"{args.threads} threads, median of {args.repeats}")
    print("| B | rows/session | B single forwards (ms) | one packed forward (ms) | "
          "packed / single |")
    print("|---|---|---|---|---|")
    for rows in [int(value) for value in args.rows.split(",")]:
        for size in sizes:
            single: list[float] = []
            packed: list[float] = []
            for _ in range(args.repeats + 1):  # the first of each is a warm-up
                requests = _requests(runner, size, args.context, rows, generator)
                started = time.perf_counter()
                for request in requests:
                    runner.extend_batch([request])
                single.append(time.perf_counter() - started)
                started = time.perf_counter()
                runner.extend_batch(requests)
                packed.append(time.perf_counter() - started)
            single_ms = statistics.median(single[1:]) * 1e3
            packed_ms = statistics.median(packed[1:]) * 1e3
            print(f"| {size} | {rows} | {single_ms:.1f} | {packed_ms:.1f} | "
                  f"{packed_ms / single_ms:.2f} |")


if __name__ == "__main__":
    main()
