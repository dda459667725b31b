"""The fused step against transformers' forward on the same int8 model, side by side.

Loads the target (and the token draft) as the cpu-tuned backend serves them under
`--dtype auto` with the fused step installed, and times each forward shape through three
runners, alternating call by call over one session each whose cache holds --context
tokens: the fused step with its C++ layer operators, the fused step running each layer's
operations from Python (where those operators do not build), and transformers' forward.
Then splits one forward's time into the int8 products and everything else (torch's
profiler). Output: markdown on stdout.

    .venv/bin/python scripts/measure_fused_step.py --threads 1 --rows 1,4,8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,8", help="rows per forward, comma-separated")
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from specdec.engine import models
    from specdec.engine.backends.cpu import load_causal_lm
    from specdec.engine.runner import ModelRunner

    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}, context {args.context} tokens, median of "
          f"{args.repeats} alternating calls\n")
    print("| model | rows | fused step ms | its layers from Python ms | transformers forward ms "
          "| fused / transformers |")
    print("|---|---|---|---|---|---|")
    profiles: list[str] = []
    for name, source, vocab in (("target", models.DEFAULT_TARGET, None),
                                ("draft", models.DEFAULT_DRAFT, 49152)):
        loaded = load_causal_lm(source, torch.device("cpu"), torch.bfloat16, progress=False,
                                linear_kernel="int8", fused_step="auto")
        if not loaded.precision.endswith("fused step"):
            raise SystemExit(f"the {name} does not take the fused step here: {loaded.precision}")
        runners = {}
        for kind in ("fused", "python layers", "transformers"):
            runner = ModelRunner(loaded.model, target_vocab_size=vocab,
                                 token_map=loaded.token_map)
            if kind == "transformers":
                runner._fused_step = None
            elif kind == "python layers" and runner._fused_step is not None:
                step = copy.copy(runner._fused_step)
                step.native = [None] * len(step.native)  # type: ignore[attr-defined]
                runner._fused_step = step
            runner.extend("s", 0, 0, list(range(1000, 1000 + args.context)))
            runners[kind] = runner

        def forward(runner: ModelRunner, rows: int) -> float:
            history = runner._sessions["s"].history
            started = time.perf_counter()
            runner.extend("s", args.context, history.fingerprint(args.context), [5] * rows,
                          num_logits=rows)
            return time.perf_counter() - started

        for rows in rows_list if name == "target" else [1]:
            times: dict[str, list[float]] = {kind: [] for kind in runners}
            for _ in range(args.repeats + 2):
                for kind, runner in runners.items():
                    times[kind].append(forward(runner, rows))
            fused, python, stock = (1000 * statistics.median(times[k][2:]) for k in runners)
            print(f"| {name} | {rows} | {fused:.2f} | {python:.2f} | {stock:.2f} | "
                  f"{fused / stock:.2f} |")
        if name == "target":
            for kind, runner in runners.items():
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(10):
                        forward(runner, 1)
                events = prof.key_averages()
                total = sum(e.self_cpu_time_total for e in events) / 10 / 1000
                products = sum(e.self_cpu_time_total for e in events
                               if e.key == "specdec::int8_linear") / 10 / 1000
                calls = sum(e.count for e in events if e.key == "specdec::int8_linear") // 10
                profiles.append(f"| {kind} | {total:.1f} | {products:.1f} ({calls} calls) | "
                                f"{total - products:.1f} |")
    print("\nOne-row target forward under torch's profiler (self CPU time, ms):\n")
    print("| forward | total | int8 products | everything else |")
    print("|---|---|---|---|")
    print("\n".join(profiles))


if __name__ == "__main__":
    main()
