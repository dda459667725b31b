"""`specdec demo`: bring the stack up, stream one chat answer, print stats, stop.

Runs the same greedy request twice, speculative (adaptive draft length, as the docs
recommend) and target-only, so the output shows both the speed-up and that speculation
did not change a single token. A short untimed request first warms both services (the
first forwards of a process pay one-off costs), so neither timed run carries them.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from specdec.commands.up import add_stack_settings, start
from specdec.models import DEFAULT_DRAFT

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="start the services, stream a chat answer with stats, stop them")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--no-compare", action="store_true",
                        help="skip the target-only run used for comparison")
    parser.add_argument("--fixed-length", action="store_true",
                        help="draft --num-draft-tokens every round instead of adapting")
    add_stack_settings(parser, default_ports=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specdec.commands.generate import build_request, call, stats_table

    console = Console()
    if args.draft_model == DEFAULT_DRAFT:
        from specdec.draft_fallback import default_draft_or_truncated

        args.draft_model, trained = default_draft_or_truncated()
        if not trained:
            console.print("[yellow]the trained draft is not in specdec/assets/draft yet; "
                          f"using the target's first 2 layers ({args.draft_model})[/]")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="specdec-demo-"))
    args.log_dir = str(log_dir)
    console.print(f"starting draft, target and coordinator (logs in {log_dir}) ...")
    # A throwaway stack: any free metrics ports, so it runs beside `specdec up`.
    stack = start(args, env={"SPECDEC_METRICS_PORT": os.environ.get("SPECDEC_METRICS_PORT")
                             or "0"})
    try:
        endpoint = stack.endpoint("coordinator")
        for role in ("coordinator", "draft", "target"):
            console.print(f"  {role:<12} {stack.endpoint(role)}")
        adaptive = not args.fixed_length
        request = build_request(args.prompt, chat=True, max_new_tokens=args.max_new_tokens,
                                num_draft_tokens=args.num_draft_tokens, adaptive=adaptive)
        warm_up = build_request(args.prompt, chat=True, max_new_tokens=8,
                                num_draft_tokens=args.num_draft_tokens, adaptive=adaptive)
        call(endpoint, warm_up, stream=False, timeout_s=900)
        console.print(f"\n[bold]user:[/] {args.prompt}\n[bold]assistant:[/] ", end="")
        speculative = call(endpoint, request, stream=True, timeout_s=900,
                           echo=lambda text: print(text, end="", flush=True))
        print("\n")
        length = ("adaptive draft length" if adaptive
                  else f"{args.num_draft_tokens} draft tokens per round")
        console.print(stats_table(speculative, f"speculative decoding, {length}"))
        if not args.no_compare:
            request.speculation.num_draft_tokens = 0
            request.speculation.adaptive = False
            console.print("\nsame request, target only ...")
            baseline = call(endpoint, request, stream=False, timeout_s=900)
            console.print(stats_table(baseline, "target only"))
            same = list(baseline.token_ids) == list(speculative.token_ids)
            speedup = baseline.stats.total_seconds / max(1e-9, speculative.stats.total_seconds)
            console.print(f"\nidentical output: {'[green]yes[/]' if same else '[red]NO[/]'}   "
                          f"speed-up: [bold]{speedup:.2f}x[/]")
            if not same:
                return 1
    finally:
        codes = stack.stop()
        console.print("stopped: " + ", ".join(f"{r} exit {c}" for r, c in codes.items()))
    return 0
