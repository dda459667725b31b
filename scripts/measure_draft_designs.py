"""What each draft design costs beside the target, and the speed-up bound that cost allows.

For three draft designs (today's token draft: 2 layers over
an 8k vocabulary; a larger token draft: 4 layers over a 16k vocabulary; an EAGLE-3 head:
one layer reading three of the target's layer states), at the precision the services
pick by default (`--dtype auto`: int8 linear weights where the int8 operator runs, and
the fused step where a design fits it):
- T_draft(1), the one-token draft step, and T_target(k) (specdec.bench.costs.measure_costs,
  the calls the services make), and c = T_draft(1) / T_target(1);
- the bound S(gamma) = E[tokens](alpha, gamma) T_target(1) / (gamma T_draft(1) +
  T_target(gamma + 1)) at the best gamma for each alpha given, and the alpha each design
  needs for a bound of 1.6x (the issue's goal through the services).
The larger draft and the EAGLE-3 head are built untrained (timing does not depend on
the weights); their acceptance is what training would have to reach.

    .venv/bin/python scripts/measure_draft_designs.py --alphas 0.45,0.55,0.65
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GAMMAS = range(1, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", default="0.45,0.55,0.65",
                        help="per-token acceptance rates to evaluate the bound at")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (default: every CPU, as `specdec up` gives each "
                        "service)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.costs import bound, measure_costs
    from specdec.draft_training.eagle3_train import make_eagle3_draft
    from specdec.draft_training.train import load_draft, make_draft
    from specdec.engine.attention import apply_attention_kernel
    from specdec.engine.backends.cpu import load_causal_lm
    from specdec.engine.fused_step import install as install_fused_step
    from specdec.engine.kernels import apply_linear_kernel
    from specdec.engine.models import load_pretrained, resolve
    from specdec.engine.runner import ModelRunner
    from specdec.settings import INT8_IF_AVAILABLE, default

    cpu = torch.device("cpu")
    target_name = default("target-model")
    target = load_causal_lm(target_name, cpu, torch.bfloat16, progress=False,
                            linear_kernel=INT8_IF_AVAILABLE, fused_step=default("fused-step"))
    target_runner = ModelRunner(target.model, row_invariance=target.row_invariance)
    vocab = int(target.model.config.vocab_size)
    target_dir = str(resolve(target_name))
    draft_dir = Path(str(resolve(default("draft-model"))))
    today, token_map = load_draft(draft_dir)
    # A 16k vocabulary: today's ids, then the lowest other ids (timing only).
    mapped = set(token_map)
    extra = [i for i in range(vocab) if i not in mapped][:16384 - len(token_map)]
    wider = sorted(token_map + extra)
    designs = {
        "token draft, 2 layers, 8k vocabulary (today's)": (today, token_map),
        "token draft, 4 layers, 16k vocabulary": (make_draft(target_dir, wider, 4), wider),
        "EAGLE-3 head, 1 layer, 8k vocabulary": (make_eagle3_draft(
            load_pretrained(target_name, cpu, torch.float32, progress=False).model,
            token_map), token_map),
    }
    alphas = [float(a) for a in args.alphas.split(",")]
    print(f"target: {target.precision}, {args.threads} thread(s)")
    print("| design | T_draft(1) ms | T_target(1) ms | c | "
          + " | ".join(f"bound S at alpha {a}" for a in alphas) + " | alpha for 1.6x |")
    print("|---|---|---|---|" + "---|" * len(alphas) + "---|")
    for label, (model, ids) in designs.items():
        model = model.to(torch.bfloat16).eval()
        apply_linear_kernel(model, INT8_IF_AVAILABLE)
        apply_attention_kernel(model, "auto")
        step = install_fused_step(model, default("fused-step"))  # where the design fits it
        map_tensor = None if hasattr(model, "draft_to_target") else torch.tensor(ids)
        draft_runner = ModelRunner(model, target_vocab_size=vocab, token_map=map_tensor)
        curve = measure_costs(target_runner, draft_runner, label=label, repeats=args.repeats)
        best = [max(bound(curve, a, g) for g in GAMMAS) for a in alphas]
        needed = next((a / 100 for a in range(5, 100)
                       if max(bound(curve, a / 100, g) for g in GAMMAS) >= 1.6), float("nan"))
        print(f"| {label} ({step}) | {curve.draft_s * 1e3:.1f} | {curve.t_target(1) * 1e3:.1f} | "
              f"{curve.draft_s / curve.t_target(1):.3f} | "
              + " | ".join(f"{s:.2f}x" for s in best) + f" | {needed:.2f} |", flush=True)


if __name__ == "__main__":
    main()
