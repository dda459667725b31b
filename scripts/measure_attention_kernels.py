"""T_target(k) with transformers' SDPA against specdec's grouped attention, interleaved.

    .venv/bin/python scripts/measure_attention_kernels.py [--contexts 64,256,512 --rows 1,2,4,8]

One target model; for every repeat, context length and row count the two attention
kernels run back to back on the same warm cache (switched in place), so a busy phase of
the machine hits both alike. Prints the median forward time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import models  # noqa: E402
from specdec.attention import apply_attention_kernel  # noqa: E402
from specdec.history import TokenHistory  # noqa: E402
from specdec.runner import ModelRunner  # noqa: E402

KERNELS = ("sdpa", "grouped")


def forward_s(runner: ModelRunner, context: list[int], rows: int) -> float:
    block = context[:rows]
    started = time.perf_counter()
    runner.extend("ab", len(context), TokenHistory(context).fingerprint(), block,
                  num_logits=rows)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="64,256,512")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    loaded = models.load_causal_lm("smollm2-135m-instruct", torch.device("cpu"), torch.float32,
                                   progress=False)
    runner = ModelRunner(loaded.model)
    generator = torch.Generator().manual_seed(0)
    print("| context | rows | sdpa ms | grouped ms | grouped / sdpa |\n|---|---|---|---|---|")
    for context_len in (int(c) for c in args.contexts.split(",")):
        context = torch.randint(100, 40000, (context_len,), generator=generator).tolist()
        runner.extend("ab", 0, 0, context)
        for rows in (int(r) for r in args.rows.split(",")):
            times: dict[str, list[float]] = {k: [] for k in KERNELS}
            for repeat in range(args.repeats + 2):
                for kernel in KERNELS if repeat % 2 else KERNELS[::-1]:
                    apply_attention_kernel(loaded.model, kernel)
                    seconds = forward_s(runner, context, rows)
                    if repeat >= 2:  # warm-up
                        times[kernel].append(seconds)
            sdpa, grouped = (statistics.median(times[k]) * 1000 for k in KERNELS)
            print(f"| {context_len} | {rows} | {sdpa:.1f} | {grouped:.1f} | "
                  f"{grouped / sdpa:.2f} |", flush=True)
        runner.release("ab")


if __name__ == "__main__":
    main()
