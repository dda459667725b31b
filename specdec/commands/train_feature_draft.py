"""`specdec train-feature-draft`: the resumable pipeline behind specdec-feature-draft.

Stages: data (the same distillation shards as `train-draft`, shared in --work-dir), hidden
(the target's final hidden states for every shard), train (checkpointed), eval
(held-out acceptance and costs), card. Each stage resumes from what the last run left.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.commands.train_draft import add_data_settings, evaluate_draft, generate_data
from specdec.config import add_setting
from specdec.engine import models

STAGES = ("data", "hidden", "train", "eval", "card")
ASSET_DIR = models.FEATURE_DRAFT_DIR


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-feature-draft",
        help="build the draft that reads the target's hidden states (resumable)")
    parser.add_argument("stages", nargs="*", default=list(STAGES), choices=STAGES,
                        help="stages to run (default: all, in order)")
    add_data_settings(parser, ASSET_DIR)
    # ~25 s a shard on 2 cores (a prefill of each continuation).
    add_setting(parser, "--hidden-budget-s", 6000.0,
                "stop extracting hidden states after this long (train on the shards done)",
                type=float)
    add_setting(parser, "--init-from", models.DEFAULT_DRAFT,
                "the token-only draft to extend (its layers, embeddings and token map), "
                "with a zero-initialised path for the target's states")
    add_setting(parser, "--lr", 2e-4, "peak learning rate", type=float)
    add_setting(parser, "--regression-weight", 0.1,
                "weight of the state-regression loss beside the cross-entropy", type=float)
    add_setting(parser, "--epochs", 3.0, "passes over the data", type=float)
    add_setting(parser, "--eval-prompts", 24,
                "held-out prompts of each set for evaluation (the hand-written set first, "
                "then the prompt sets')", type=int)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdec.draft_training import feature_train

    work_dir, out_dir = Path(args.work_dir), Path(args.out_dir)
    hidden_dir = work_dir / "hidden"
    target_dir = str(models.prepare_smollm2())
    if "data" in args.stages:
        generate_data(args, target_dir, work_dir)
    if "hidden" in args.stages:
        feature_train.extract_hidden_states(target_dir, work_dir / "data", hidden_dir,
                                            time_budget_s=args.hidden_budget_s)
    if "train" in args.stages:
        summary = feature_train.train_feature_draft(
            target_dir, work_dir / "data", hidden_dir, work_dir, out_dir,
            str(models.resolve(args.init_from)), epochs=args.epochs, lr=args.lr,
            regression_weight=args.regression_weight)
        print(json.dumps(summary, indent=2))
    if "eval" in args.stages:
        report = evaluate_draft(target_dir, out_dir, args.eval_prompts)
        (work_dir / "feature_eval_report.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
    if "card" in args.stages:
        from specdec.draft_training.card import write_feature_model_card

        write_feature_model_card(out_dir, work_dir)
        print(f"model card: {out_dir / 'README.md'}")
    return 0
