"""`specdec train-draft`: the resumable pipeline behind the embedded default draft.

Stages: data (target continuations + top-k distributions, sharded), train (distillation,
checkpointed), eval (acceptance on the hand-written held-out set, then on the prompt
sets' held-out prompts, and costs), card (model card from the figures).
Each stage resumes from what the previous run left in --work-dir.

`--stream` runs streaming self-distillation instead (specdec/draft_training/stream.py):
the target labels contexts as they are produced and the draft trains on them, from the
committed draft (or the checkpoint in --work-dir), for --time-budget-min.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.config import add_setting
from specdec.engine import models
from specdec.settings import SETTINGS, default

if TYPE_CHECKING:
    from specdec.draft_training.stream_settings import StreamSettings

STAGES = ("data", "train", "eval", "card")
ASSET_DIR = models.DRAFT_DIR


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train-draft", help="build the default draft (resumable)")
    # A type check, not `choices`: Python 3.11's argparse checks an empty "*" positional's
    # default list against the choices and refuses a bare `specdec train-draft`.
    parser.add_argument("stages", nargs="*", default=list(STAGES), type=_stage,
                        help=f"stages to run: {', '.join(STAGES)} (default: all, in order)")
    add_data_settings(parser, ASSET_DIR)
    add_setting(parser, "--draft-layers", 2, "transformer layers in the draft", type=int)
    add_setting(parser, "--draft-vocab", 8192, "reduced vocabulary of the draft head", type=int)
    add_setting(parser, "--epochs", 3.0, "passes over the data", type=float)
    add_setting(parser, "--lr", 5e-4, "peak learning rate", type=float)
    add_setting(parser, "--init-draft", "",
                "continue distilling this trained draft (a folder with token_map.json) "
                "instead of starting from the target's first layers")
    add_setting(parser, "--eval-prompts", 24,
                "held-out prompts of each set for evaluation (the hand-written set first, "
                "then the prompt sets')", type=int)
    add_stream_settings(parser)
    parser.set_defaults(func=run)


def _stage(name: str) -> str:
    if name not in STAGES:
        raise argparse.ArgumentTypeError(f"{name!r} is not a stage ({', '.join(STAGES)})")
    return name


def add_stream_settings(parser: argparse.ArgumentParser) -> None:
    from specdec.draft_training.stream_settings import DRAFT_KINDS, PRODUCERS, StreamSettings

    defaults = StreamSettings()
    group = parser.add_argument_group("streaming self-distillation (--stream)")
    group.add_argument("--stream", action="store_true",
                       help="distil on a stream of freshly labelled contexts instead of "
                            "the stages (resumable; --work-dir/stream)")
    add_setting(group, "--time-budget-min", defaults.time_budget_s / 60,
                "minutes of streaming this run", type=float)
    add_setting(group, "--producer", defaults.producer, "what writes the text the target "
                "labels", choices=PRODUCERS)
    add_setting(group, "--stream-lr", defaults.lr, "peak learning rate", type=float)
    add_setting(group, "--stream-mix", ",".join(f"{w:g}" for w in defaults.mix),
                "weights of the contexts' kinds: user turns from the prompt sets, turns "
                "the target writes (Magpie), further turns on finished conversations",
                type=_mix, metavar="PROMPT_SET,MAGPIE,MULTI_TURN")
    add_setting(group, "--stream-draft-kind", defaults.draft_kind,
                "token: a draft that reads tokens only; eagle3: a one-layer EAGLE-3 draft "
                "that reads the target's layer states (written in the speculators layout; "
                "with a token draft's folder as --stream-from, a new one over its "
                "vocabulary)", choices=DRAFT_KINDS)
    add_setting(group, "--stream-ttt-steps", defaults.ttt_steps,
                "EAGLE-3: drafted steps of each training-time test", type=int)
    add_setting(group, "--stream-target", models.DEFAULT_TARGET,
                "the target to distil from (an embedded name, a directory or a hub id)")
    add_setting(group, "--stream-from", str(ASSET_DIR),
                "the draft a new run starts from (a folder with token_map.json), or 'new': "
                "one made from the target (--draft-layers, --draft-vocab) in --work-dir")
    add_setting(group, "--stream-out", "",
                "where the streamed draft is written (default: --work-dir/stream/draft)")
    add_setting(group, "--device", default("device"), SETTINGS["device"].help)
    add_setting(group, "--stream-produce-batch", defaults.produce_batch,
                "contexts per producer call (hundreds on a GPU)", type=int)
    add_setting(group, "--stream-train-batch", defaults.train_batch,
                "records per optimiser step", type=int)
    add_setting(group, "--stream-passes", defaults.passes,
                "times the trainer may use one record", type=int)
    add_setting(group, "--stream-checkpoint-every-s", defaults.checkpoint_every_s,
                "seconds between checkpoints (each adds a point to the held-out curve)",
                type=float)
    group.add_argument("--measure-producers", action="store_true",
                       help="print each producer's labelled tokens/s and exit")


def _mix(text: str) -> tuple[float, float, float]:
    try:
        weights = tuple(float(part) for part in text.split(","))
    except ValueError:
        weights = ()
    if (len(weights) != 3 or not all(math.isfinite(w) and w >= 0 for w in weights)
            or not sum(weights) > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not three non-negative weights PROMPT_SET,MAGPIE,MULTI_TURN with a "
            "positive sum (e.g. 0.15,0.55,0.3)")
    return weights[0], weights[1], weights[2]


def add_data_settings(parser: argparse.ArgumentParser, out_dir: Path) -> None:
    """Where the pipeline works and writes, and the distillation data both drafts share."""
    add_setting(parser, "--work-dir", str(models.model_cache_dir().parent / "draft-work"),
                "data shards, checkpoints and reports (not committed)")
    add_setting(parser, "--out-dir", str(out_dir), "where the final draft is written")
    # Both prompt sets' shards took about 110 min on 2 cores (~40 s a shard).
    add_setting(parser, "--data-budget-s", 9000.0, "stop generating data after this long",
                type=float)
    add_setting(parser, "--max-shards", 86,
                "data shards of --batch-size prompts from the templated prompt set", type=int)
    add_setting(parser, "--wide-shards", 80,
                "data shards from the wider prompt set (draft_training/wide_prompts.py)", type=int)
    add_setting(parser, "--batch-size", 48, "prompts per data shard", type=int)
    add_setting(parser, "--data-dtype", "float32",
                "dtype the target generates the data in", choices=("float32", "bfloat16"))
    add_setting(parser, "--data-temperatures", "0,1",
                "decoding temperature of shard i: item i mod n of this list (0 = greedy)")
    add_setting(parser, "--data-seed", 0, "seed of the sampled shards", type=int)


def generate_data(args: argparse.Namespace, target_dir: str, work_dir: Path) -> None:
    import torch

    from specdec.draft_training.datagen import generate_shards

    temperatures = tuple(float(t) for t in args.data_temperatures.split(","))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.data_dtype]
    started = time.monotonic()  # one budget for both prompt sets
    for prompt_set, max_shards in (("templated", args.max_shards), ("wide", args.wide_shards)):
        remaining_s = args.data_budget_s - (time.monotonic() - started)
        generate_shards(target_dir, work_dir / "data", batch_size=args.batch_size,
                        max_shards=max_shards, time_budget_s=remaining_s, prompt_set=prompt_set,
                        dtype=dtype, temperatures=temperatures, seed=args.data_seed)


def run(args: argparse.Namespace) -> int:
    work_dir, out_dir = Path(args.work_dir), Path(args.out_dir)
    if args.stream or args.measure_producers:
        return run_stream(args, str(models.resolve(args.stream_target)), work_dir / "stream")
    target_dir = str(models.prepare_smollm2())
    if "data" in args.stages:
        generate_data(args, target_dir, work_dir)
    if "train" in args.stages:
        from specdec.draft_training.train import train

        summary = train(target_dir, work_dir / "data", work_dir, out_dir,
                        vocab_size=args.draft_vocab, num_layers=args.draft_layers,
                        epochs=args.epochs, lr=args.lr,
                        init_draft=Path(args.init_draft) if args.init_draft else None)
        print(json.dumps(summary, indent=2))
    if "eval" in args.stages:
        report = evaluate_draft(target_dir, out_dir, args.eval_prompts)
        (work_dir / "eval_report.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
    if "card" in args.stages:
        from specdec.draft_training.card import write_model_card

        write_model_card(out_dir, work_dir)
        print(f"model card: {out_dir / 'README.md'}")
    return 0


def evaluate_draft(target_dir: str, draft_dir: Path, num_prompts: int) -> dict:
    import torch

    from specdec.draft_training.evaluate import evaluate
    from specdec.engine.backends.cpu import load_causal_lm
    from specdec.engine.runner import ModelRunner

    target = load_causal_lm(target_dir, torch.device("cpu"), torch.float32)
    draft = load_causal_lm(str(draft_dir), torch.device("cpu"), torch.float32)
    target_runner = ModelRunner(target.model)
    draft_runner = ModelRunner(draft.model, target_vocab_size=target_runner.vocab.target_vocab_size,
                               token_map=draft.token_map)
    assert target.tokenizer is not None
    return evaluate(draft_runner, target_runner, target.tokenizer, num_prompts=num_prompts)


def stream_settings(args: argparse.Namespace) -> StreamSettings:
    """The streaming run the command's flags describe."""
    from specdec.draft_training.stream_settings import StreamSettings

    return StreamSettings(time_budget_s=args.time_budget_min * 60, producer=args.producer,
                          lr=args.stream_lr, device=args.device,
                          produce_batch=args.stream_produce_batch,
                          train_batch=args.stream_train_batch, passes=args.stream_passes,
                          checkpoint_every_s=args.stream_checkpoint_every_s,
                          draft_kind=args.stream_draft_kind, ttt_steps=args.stream_ttt_steps,
                          mix=args.stream_mix)


def run_stream(args: argparse.Namespace, target_dir: str, work_dir: Path) -> int:
    from specdec.bench.workloads import bench_texts
    from specdec.draft_training.stream import measure, new_draft, stream_distill

    settings = stream_settings(args)
    bench = bench_texts()  # every bench workload's messages: never a training turn
    start = (new_draft(target_dir, work_dir / "initial-draft", settings,
                       vocab_size=args.draft_vocab, num_layers=args.draft_layers)
             if args.stream_from == "new" else Path(args.stream_from))
    if args.measure_producers:
        print(json.dumps(measure(target_dir, start, settings, bench), indent=2))
        return 0
    out_dir = Path(args.stream_out) if args.stream_out else work_dir / "draft"
    summary = stream_distill(target_dir, start, work_dir, out_dir, settings, excluded=bench)
    print(json.dumps({k: v for k, v in summary.items() if k != "curve"}, indent=2))
    print(f"draft, curve and plot: {out_dir}")
    return 0
