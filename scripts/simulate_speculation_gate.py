"""How close the speculation gate gets to the best arm's rate, on simulated load.

No models run: each arm has a fixed true output rate (relative to target-only), every
one-second epoch multiplies all rates by one log-normal noise draw (what a real epoch's
mix of prompts and arrivals does), and optionally the requests change every 15 s between
easy and hard phases that scale all arms alike (0.4x and 1x). Rounds of 50 ms ask the
gate for its arm and report the tokens that arm would have produced. Efficiency is the
rate the gate's choices earned over the best arm's, after the first 20 s (median over
seeds); "no gate" is every source always allowed (the draft arm's rate).

    python scripts/simulate_speculation_gate.py --seeds 10 --noise 0.15
"""

from __future__ import annotations

import argparse
import random
import statistics

from specdec.core.speculation_gate import SpeculationGate

# (target-only, model-free, draft): true rates relative to target-only
SCENARIOS = {
    "every proposal costs (busy CPU, hand-written prompts)": (1.0, 0.9, 0.92),
    "lookup pays, the draft does not (repetitive text)": (1.0, 1.07, 1.0),
    "everything pays (one request)": (1.0, 1.1, 1.3),
    "the draft pays a little": (1.0, 1.0, 1.06),
    "all equal": (1.0, 1.0, 1.0),
}


def efficiency(rates: tuple[float, float, float], noise: float, phases: bool, seed: int,
               seconds: float = 300.0, warmup_s: float = 20.0) -> float:
    rng = random.Random(seed)
    now = [0.0]
    gate = SpeculationGate(clock=lambda: now[0])
    earned = best = 0.0
    epoch, draw = -1, 1.0
    while now[0] < seconds:
        if int(now[0]) != epoch:
            epoch, draw = int(now[0]), rng.lognormvariate(0.0, noise)
        scale = (0.4 if (int(now[0]) // 15) % 2 == 0 else 1.0) if phases else 1.0
        arm = gate.arm(8)
        now[0] += 0.05
        gate.record(round(40.0 * rates[arm] * scale * draw * 0.05 * 100), 8)
        if now[0] > warmup_s:
            earned += rates[arm]
            best += max(rates)
    return earned / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--noise", type=float, default=0.15,
                        help="standard deviation of an epoch's log rate")
    args = parser.parse_args()
    print(f"epoch noise {args.noise} (log sd), {args.seeds} seeds, 300 s each, 8 running")
    print("| arms (target-only, model-free, draft) | steady | easy/hard phases | no gate |")
    print("|---|---|---|---|")
    for name, rates in SCENARIOS.items():
        cells = [statistics.median(efficiency(rates, args.noise, phases, seed)
                                   for seed in range(args.seeds)) for phases in (False, True)]
        print(f"| {name} {rates} | {cells[0]:.3f} | {cells[1]:.3f} "
              f"| {rates[-1] / max(rates):.3f} |")


if __name__ == "__main__":
    main()
