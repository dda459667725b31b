"""What each draft design costs beside the target, the speed-up bound that cost allows,
and, given a streaming training run of each design, what each reached per CPU-hour.

For three draft designs (token-2l-8k, today's: a token draft of 2 layers over an 8k
vocabulary; token-4l-16k: 4 layers over a 16k vocabulary; eagle3: an EAGLE-3 head, one
layer reading three of the target's layer states), at the precision the services pick
by default (`--dtype auto`: int8 linear weights where the int8 operator runs, and the
fused step where a design fits it):
- T_draft(1), the one-token draft step (blocks of steps, the designs in turn), and T_target(k)
  (specdec.bench.costs.measure_costs, the calls the services make; one curve for all), and
  c = T_draft(1) / T_target(1);
- the bound S(gamma) = E[tokens](alpha, gamma) T_target(1) / (gamma T_draft(1) +
  T_target(gamma + 1)) at the best gamma for each alpha given, and the alpha each design
  needs for a bound of 1.6x (the issue's goal through the services).
Timing does not depend on the weights, so the designs are timed untrained.

With `--run DESIGN=WORK_DIR` for each design (the --work-dir of a `specdec train-draft
--stream` run), it also reads each run's held-out curve and reports, at the CPU time the
shortest run reached (each curve interpolated there), the hand-written held-out's top-1
agreement and sum min(p, q), the share of the target's answer tokens outside the
design's vocabulary, and the bound S at those acceptances (top-1 for greedy, sum min(p, q)
for T=1). `--out PREFIX` writes PREFIX.json and PREFIX.png (every curve on one plot,
against CPU-hours of the training process, all threads).

    .venv/bin/python scripts/measure_draft_designs.py --alphas 0.45,0.55,0.65
    .venv/bin/python scripts/measure_draft_designs.py --run token-2l-8k=work/a \\
        --run token-4l-16k=work/b --run eagle3=work/c --out docs/results/drafts/cpu-designs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GAMMAS = range(1, 8)
STEPS_PER_BLOCK = 4
DESIGNS = {
    "token-2l-8k": "token draft, 2 layers, 8k vocabulary (today's)",
    "token-4l-16k": "token draft, 4 layers, 16k vocabulary",
    "eagle3": "EAGLE-3 head, 1 layer, 8k vocabulary",
}
TOP1, ACCEPTANCE = "top1_agreement", "expected_acceptance"


def measure_design_costs(threads: int, repeats: int
                         ) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The target's precision, each design's CostCurve (untrained weights) and whether
    the fused step runs it (fused_step.install's answer)."""
    from specdec.bench.costs import measure_costs, weight_bytes
    from specdec.draft_training.eagle3_train import make_eagle3_draft
    from specdec.draft_training.train import load_draft, make_draft
    from specdec.engine.attention import apply_attention_kernel
    from specdec.engine.backends.cpu import load_causal_lm
    from specdec.engine.fused_step import install as install_fused_step
    from specdec.engine.kernels import apply_linear_kernel
    from specdec.engine.models import keep_proposed_rows, load_pretrained, resolve
    from specdec.engine.runner import ModelRunner
    from specdec.engine.timing import extend_timer, random_tokens, round_robin
    from specdec.settings import INT8_IF_AVAILABLE, default

    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    target_name = default("target-model")
    target = load_causal_lm(target_name, cpu, torch.bfloat16, progress=False,
                            linear_kernel=INT8_IF_AVAILABLE, fused_step=default("fused-step"))
    target_runner = ModelRunner(target.model, row_invariance=target.row_invariance)
    vocab = int(target.model.config.vocab_size)
    target_dir = str(resolve(target_name))
    today, token_map = load_draft(Path(str(resolve(default("draft-model")))))
    # A 16k vocabulary: today's ids, then the lowest other ids (timing only).
    mapped = set(token_map)
    extra = [i for i in range(vocab) if i not in mapped][:16384 - len(token_map)]
    wider = sorted(token_map + extra)
    models = {
        "token-2l-8k": (today, token_map),
        "token-4l-16k": (make_draft(target_dir, wider, 4), wider),
        "eagle3": (make_eagle3_draft(
            load_pretrained(target_name, cpu, torch.float32, progress=False).model,
            token_map), token_map),
    }
    # One target curve for every design, so that their bounds differ by the draft's step
    # alone; the drafts' steps interleaved, so that a drifting machine slows each alike.
    shared = measure_costs(target_runner, None, label="target", repeats=repeats)
    runners, steps = {}, {}
    for key, (model, ids) in models.items():
        if key != "eagle3":
            keep_proposed_rows(model, len(ids))  # as the draft service loads a token draft
        model = model.to(torch.bfloat16).eval()
        apply_linear_kernel(model, INT8_IF_AVAILABLE)
        apply_attention_kernel(model, "auto")
        step = install_fused_step(model, default("fused-step"))  # where the design fits it
        map_tensor = None if hasattr(model, "draft_to_target") else torch.tensor(ids)
        runners[key] = ModelRunner(model, target_vocab_size=vocab, token_map=map_tensor)
        steps[key] = step
    tokens = random_tokens(min(vocab, 4096), shared.context + 1)
    timers = {key: extend_timer(runner, tokens[:-1], tokens[-1:])
              for key, runner in runners.items()}

    def block(call: Any) -> Any:
        # STEPS_PER_BLOCK steps back to back, as a Propose runs them (the draft's weights
        # stay in cache between its steps), then the next design's block
        return lambda: statistics.median(call() for _ in range(STEPS_PER_BLOCK))

    try:
        samples = round_robin({key: block(call) for key, (call, _) in timers.items()},
                              max(repeats, 11))
    finally:
        for _, release in timers.values():
            release()
    curves = {key: dataclasses.replace(shared, label=key,
                                       draft_s=statistics.median(samples[key]),
                                       draft_weight_bytes=weight_bytes(runners[key].model))
              for key in runners}
    return str(target.precision), curves, steps


def best_bound(curve: Any, alpha: float) -> float:
    from specdec.bench.costs import bound

    return max(bound(curve, alpha, g) for g in GAMMAS)


def alpha_for(curve: Any, speedup: float) -> float:
    return next((a / 100 for a in range(5, 100) if best_bound(curve, a / 100) >= speedup),
                math.nan)


def at_cpu_s(curve: list[dict[str, Any]], cpu_s: float, key: str) -> float:
    """The curve's figure at cpu_s, linear between the points around it."""
    points = [(p["cpu_s"], p[key]) for p in curve if key in p and "cpu_s" in p]
    for (s0, v0), (s1, v1) in zip(points, points[1:], strict=False):
        if s0 <= cpu_s <= s1:
            return v0 if s1 == s0 else v0 + (v1 - v0) * (cpu_s - s0) / (s1 - s0)
    return points[-1][1] if points and cpu_s >= points[-1][0] else math.nan


def outside_vocabulary(stream_dir: Path) -> float:
    """The share of the target's answer tokens on the hand-written held-out set that the
    run's draft vocabulary lacks (each counts as a miss in top-1 agreement)."""
    from specdec.draft_training.handwritten import HANDWRITTEN
    from specdec.draft_training.stream import HELD_OUT_FILE

    held_out = torch.load(stream_dir / HELD_OUT_FILE.format(HANDWRITTEN))["held_out"]
    vocabulary = set(held_out["token_map"])
    answers = [token for sequence, start in zip(held_out["sequences"],
                                                held_out["answer_starts"], strict=True)
               for token in sequence[start:]]
    return sum(token not in vocabulary for token in answers) / max(1, len(answers))


def read_runs(runs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    from specdec.draft_training.heldout import CURVE_FILE, read_curve

    read = {}
    for key, work_dir in runs.items():
        stream_dir = work_dir / "stream"
        curve = read_curve(stream_dir / CURVE_FILE)
        if not curve or "cpu_s" not in curve[-1]:
            raise SystemExit(f"{stream_dir / CURVE_FILE}: no curve with the process's CPU "
                             "time (cpu_s); run `specdec train-draft --stream` there first")
        read[key] = {"curve": curve, "outside_vocabulary": outside_vocabulary(stream_dir)}
    return read


def plot(runs: dict[str, dict[str, Any]], reference: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for index, (key, run) in enumerate(runs.items()):
        color = f"C{index}"
        for figure_key, line, label in ((TOP1, "-", "top-1"), (ACCEPTANCE, "--", "sum min(p, q)")):
            points = [(p["cpu_s"] / 3600, p[figure_key]) for p in run["curve"]
                      if figure_key in p and "cpu_s" in p]
            axes.plot([x for x, _ in points], [y for _, y in points], marker="o", color=color,
                      linestyle=line, label=f"{key}: {label}")
    axes.axhline(reference, color="grey", linestyle=":", label="default draft: top-1")
    axes.set_xlabel("CPU-hours of the training process (all threads)")
    axes.set_ylabel("hand-written held-out, per token")
    axes.set_title("Draft designs at equal CPU time, trained from new")
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize="x-small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def default_draft_figures(cache_dir: Path) -> dict[str, float]:
    """The committed default draft's hand-written top-1 and sum min(p, q), measured as the
    runs measure theirs (the same conversations and answers; its own vocabulary)."""
    from transformers import AutoTokenizer

    from specdec.draft_training.handwritten import HANDWRITTEN
    from specdec.draft_training.heldout import (
        held_out_sets,
        load_or_build_held_out,
        measure_agreement,
    )
    from specdec.draft_training.stream import load_target
    from specdec.draft_training.stream_settings import StreamSettings
    from specdec.draft_training.train import load_draft
    from specdec.engine.models import resolve
    from specdec.settings import default

    settings = StreamSettings()
    target_dir = str(resolve(default("target-model")))
    draft, token_map = load_draft(Path(str(resolve(default("draft-model")))))
    held_out = load_or_build_held_out(
        cache_dir / "held_out_default_draft.pt", load_target(target_dir, torch.device("cpu")),
        AutoTokenizer.from_pretrained(target_dir), token_map,
        held_out_sets(settings.held_out_prompts)[HANDWRITTEN], settings.held_out_tokens)
    return measure_agreement(draft, held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", default="0.45,0.55,0.65",
                        help="per-token acceptance rates to evaluate the bound at")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (default: every CPU, as `specdec up` gives each "
                        "service)")
    parser.add_argument("--run", action="append", default=[], metavar="DESIGN=WORK_DIR",
                        help=f"a streaming run of a design ({', '.join(DESIGNS)}); repeat")
    parser.add_argument("--out", type=Path, help="with --run: write OUT.json and OUT.png")
    args = parser.parse_args()
    runs = {}
    for item in args.run:
        key, _, work_dir = item.partition("=")
        if key not in DESIGNS or not work_dir:
            parser.error(f"--run {item!r}: expected DESIGN=WORK_DIR, DESIGN one of "
                         f"{', '.join(DESIGNS)}")
        runs[key] = Path(work_dir)
    trained = read_runs(runs)

    precision, curves, steps = measure_design_costs(args.threads, args.repeats)
    alphas = [float(a) for a in args.alphas.split(",")]
    print(f"target: {precision}, {args.threads} thread(s)")
    print("| design | T_draft(1) ms | T_target(1) ms | c | "
          + " | ".join(f"bound S at alpha {a}" for a in alphas) + " | alpha for 1.6x |")
    print("|---|---|---|---|" + "---|" * len(alphas) + "---|")
    for key, curve in curves.items():
        print(f"| {DESIGNS[key]} ({steps[key]}) | {curve.draft_s * 1e3:.2f} | "
              f"{curve.t_target(1) * 1e3:.1f} | {curve.draft_s / curve.t_target(1):.3f} | "
              + " | ".join(f"{best_bound(curve, a):.2f}x" for a in alphas)
              + f" | {alpha_for(curve, 1.6):.2f} |", flush=True)
    if not trained:
        return

    equal_cpu_s = min(run["curve"][-1]["cpu_s"] for run in trained.values())
    print(f"\ntrained from new, at {equal_cpu_s / 3600:.2f} CPU-hours each (the shortest run):")
    print("| design | c | labelled tokens | hand-written top-1 | sum min(p, q) | "
          "outside the vocabulary | bound S greedy | bound S T=1 |")
    print("|---|---|---|---|---|---|---|---|")
    report: dict[str, Any] = {"target": precision, "threads": args.threads,
                              "equal_cpu_s": equal_cpu_s, "designs": {}}
    for key, run in trained.items():
        curve, cost = run["curve"], curves[key]
        top1, acceptance = (at_cpu_s(curve, equal_cpu_s, k) for k in (TOP1, ACCEPTANCE))
        tokens = at_cpu_s(curve, equal_cpu_s, "tokens")
        row = {"c": cost.draft_s / cost.t_target(1), "tokens": tokens, TOP1: top1,
               ACCEPTANCE: acceptance, "outside_vocabulary": run["outside_vocabulary"],
               "bound_greedy": best_bound(cost, top1),
               "bound_t1": best_bound(cost, acceptance),
               "cost": cost.to_dict(), "curve": curve}
        report["designs"][key] = row
        print(f"| {DESIGNS[key]} | {row['c']:.3f} | {tokens:,.0f} | {top1:.3f} | "
              f"{acceptance:.3f} | {row['outside_vocabulary']:.3f} | "
              f"{row['bound_greedy']:.2f}x | {row['bound_t1']:.2f}x |", flush=True)
    reference = default_draft_figures(next(iter(runs.values())) / "stream")
    report["default_draft"] = reference
    print(f"| the default draft (trained on a GPU, for scale) | - | - | "
          f"{reference[TOP1]:.3f} | {reference[ACCEPTANCE]:.3f} | - | - | - |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        plot(trained, reference[TOP1], args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
