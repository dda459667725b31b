"""Does returning the target's hidden states (for a feature draft) slow a verify forward?

Interleaved A/B on one model: a 2-row extend at a 64-token context with hidden_rows 0 and
2 alternately, 40 times each; medians of the last 35.
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec import models
from specdec.history import TokenHistory
from specdec.runner import ModelRunner


def main() -> None:
    torch.set_num_threads(2)
    target = models.load_causal_lm(models.DEFAULT_TARGET, torch.device("cpu"), torch.float32,
                                   progress=False)
    runner = ModelRunner(target.model)
    context = list(range(100, 164))
    runner.extend("ab", 0, 0, context)
    fingerprint = TokenHistory(context).fingerprint()
    times: dict[int, list[float]] = {0: [], 2: []}
    for _ in range(40):
        for rows in times:
            started = time.perf_counter()
            runner.extend("ab", len(context), fingerprint, [5, 6], num_logits=2,
                          hidden_rows=rows)
            times[rows].append(time.perf_counter() - started)
    for rows, samples in times.items():
        print(f"hidden_rows {rows}: median {statistics.median(samples[5:]) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
