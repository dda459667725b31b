"""`specdec soak`: the soak harness (specdec.bench.soak) from the command line."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path
from types import FrameType

from specdec.config import add_setting


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "soak", help="bounded load, cancellation and replica-kill test of a replicated stack "
        "(local processes, or `specdec ray` on a two-node Ray cluster with --ray)")
    add_setting(parser, "--soak-clients", 16, "concurrent clients", type=int)
    add_setting(parser, "--soak-duration-s", 600.0, "how long the load runs", type=float)
    add_setting(parser, "--kill-every-s", 60.0,
                "kill a draft or target replica (in turn) with SIGKILL this often; it is "
                "restarted (local) or replaced (--ray) (0 = never)", type=float)
    add_setting(parser, "--replicas", 2, "draft and target replicas each", type=int)
    add_setting(parser, "--soak-ttl-s", 5.0,
                "the services' session TTL: every session must be gone twice this long "
                "after the load", type=float)
    add_setting(parser, "--soak-prompts", 8, "distinct prompts (each with its reference)",
                type=int)
    add_setting(parser, "--soak-max-new-tokens", 32, "tokens per request", type=int)
    add_setting(parser, "--cancel-fraction", 0.1, "requests cancelled mid-stream",
                type=float)
    add_setting(parser, "--deadline-fraction", 0.1,
                "requests whose deadline expires mid-generation", type=float)
    parser.add_argument("--ray", action="store_true",
                        help="run the replicas under `specdec ray` on a two-node Ray cluster "
                        "started on this machine, and remove the second node mid-load")
    add_setting(parser, "--replica-cpus", 0.5,
                "with --ray: CPUs Ray reserves per replica; each node offers enough for "
                "every replica, so one node can hold them all", type=float)
    add_setting(parser, "--remove-node-at", 0.5,
                "with --ray: when to remove the second node, as a fraction of "
                "--soak-duration-s (1 or more = never)", type=float)
    add_setting(parser, "--ray-watch-interval-s", 2.0,
                "with --ray: how often `specdec ray` checks for dead replicas", type=float)
    parser.add_argument("--target-model", default=None,
                        help="target model (default: the services' SPECDEC_TARGET_MODEL)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model (default: the services' SPECDEC_DRAFT_MODEL)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra flag for every `specdec serve` (or `specdec ray`) "
                        "(repeatable, e.g. --serve-arg=--dtype=float32)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--log-dir", default="", help="service logs (default: a temp dir)")
    parser.add_argument("--json", default="", help="also write the report here")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    if threading.current_thread() is threading.main_thread():
        # SIGTERM stops the stack as Ctrl-C does (no replica or Ray node left behind).
        signal.signal(signal.SIGTERM, _interrupt)
    from specdec.bench.soak import soak

    report = soak(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if report["ok"] else 1
