"""The rowwise attention's C++ operator against its SDPA fallback, in the target's forward.

Loads the target as the cpu-tuned backend serves it under `--dtype auto` (int8 weights,
rowwise attention, the fused step) and times decode-sized forwards of one session whose
cache holds --context tokens, alternating forward by forward between the operator and
one SDPA call per row. Output: markdown on stdout.

    .venv/bin/python scripts/measure_rowwise_attention.py --threads 2 --rows 1,2,3,5,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,3,5,8", help="rows per forward, comma-separated")
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    import torch

    from specdec.engine import attention, models
    from specdec.engine.backends.cpu import load_causal_lm
    from specdec.engine.runner import ModelRunner

    torch.set_num_threads(args.threads)
    operator = attention.native_rowwise_attention()
    if operator is None:
        raise SystemExit("the rowwise attention operator does not build here")
    loaded = load_causal_lm(models.DEFAULT_TARGET, torch.device("cpu"), torch.bfloat16,
                            progress=False, linear_kernel="int8", fused_step="auto")
    runner = ModelRunner(loaded.model)
    context = list(range(1000, 1000 + args.context))
    runner.extend("s", 0, 0, context)
    kinds: dict[str, Callable[[], Callable[..., torch.Tensor] | None]] = {
        "operator": attention.native_rowwise_attention, "SDPA per row": lambda: None}

    def forward(kind: str, rows: int) -> float:
        attention.native_rowwise_attention = kinds[kind]  # type: ignore[assignment]
        position = len(context)
        fingerprint = runner._sessions["s"].history.fingerprint(position)
        started = time.perf_counter()
        runner.extend("s", position, fingerprint, list(range(2000, 2000 + rows)),
                      num_logits=rows)
        return time.perf_counter() - started

    print(f"threads {args.threads}, context {args.context} tokens, median of "
          f"{args.repeats} alternating forwards\n")
    print("| rows | operator ms | SDPA per row ms | ratio |")
    print("|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for kind in kinds:
            forward(kind, rows)
        for _ in range(args.repeats):
            for kind in kinds:
                times[kind].append(forward(kind, rows))
        fast, slow = (statistics.median(times[kind]) * 1e3 for kind in kinds)
        print(f"| {rows} | {fast:.1f} | {slow:.1f} | {fast / slow:.2f} |", flush=True)
    attention.native_rowwise_attention = kinds["operator"]  # type: ignore[assignment]


if __name__ == "__main__":
    main()
