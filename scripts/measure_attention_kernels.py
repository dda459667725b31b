"""T_target(rows) with two attention kernels, interleaved on one model.

    .venv/bin/python scripts/measure_attention_kernels.py [--contexts 64,256,512 --rows 1,2,4,8]
    .venv/bin/python scripts/measure_attention_kernels.py --dtype bfloat16 \
        --kernels rowwise@1,rowwise --contexts 64,128,256 --rows 1,3,5,8

A kernel is one of sdpa, grouped, rowwise; "rowwise@N" is rowwise with its chain rows
shared per N-key block (rowwise@1: one SDPA call per row, the kernel before the
sixteenth session). For every repeat, context length and row count the two kernels run
back to back on the same warm cache (switched in place), so a busy phase of the machine
hits both alike. Prints the median forward time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import attention, models  # noqa: E402
from specdec.history import TokenHistory  # noqa: E402
from specdec.runner import ModelRunner  # noqa: E402


def forward_s(runner: ModelRunner, context: list[int], rows: int) -> float:
    block = context[:rows]
    started = time.perf_counter()
    runner.extend("ab", len(context), TokenHistory(context).fingerprint(), block,
                  num_logits=rows)
    return time.perf_counter() - started


def switch(model: torch.nn.Module, kernel: str, default_block: int) -> None:
    name, _, block = kernel.partition("@")
    attention.apply_attention_kernel(model, name)
    attention.KEY_BLOCK = int(block) if block else default_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="64,256,512")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kernels", default="sdpa,grouped", help="two kernels: A,B")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    if len(kernels) != 2:
        parser.error("--kernels takes two kernels, A,B")
    torch.set_num_threads(args.torch_threads)
    loaded = models.load_causal_lm("smollm2-135m-instruct", torch.device("cpu"),
                                   models.parse_dtype(args.dtype), progress=False)
    runner = ModelRunner(loaded.model)
    default_block = attention.KEY_BLOCK
    generator = torch.Generator().manual_seed(0)
    first, second = kernels
    print(f"| context | rows | {first} ms | {second} ms | {second} / {first} |\n"
          "|---|---|---|---|---|")
    for context_len in (int(c) for c in args.contexts.split(",")):
        context = torch.randint(100, 40000, (context_len,), generator=generator).tolist()
        runner.extend("ab", 0, 0, context)
        for rows in (int(r) for r in args.rows.split(",")):
            times: dict[str, list[float]] = {k: [] for k in kernels}
            for repeat in range(args.repeats + 2):
                for kernel in kernels if repeat % 2 else kernels[::-1]:
                    switch(loaded.model, kernel, default_block)
                    seconds = forward_s(runner, context, rows)
                    if repeat >= 2:  # warm-up
                        times[kernel].append(seconds)
            a, b = (statistics.median(times[k]) * 1000 for k in kernels)
            print(f"| {context_len} | {rows} | {a:.1f} | {b:.1f} | {b / a:.2f} |", flush=True)
        runner.release("ab")


if __name__ == "__main__":
    main()
