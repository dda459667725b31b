"""`specdec demo`: bring the stack up, stream one chat answer, print stats, stop.

Streams one greedy answer with speculative decoding (adaptive draft length, as the docs
recommend), then times --repeats other everyday prompts, each speculative and then
target-only, so the output shows the speed-up and that speculation did not change a
single token. Each timed prompt is new to the coordinator when its speculative run
starts: its suffix cache has not seen that answer, so the speed-up is a first request's,
not a repeated one's. One request on a 2-core machine varies by 10-20 % from run to run,
so the speed-up is the ratio of the medians, with the range of the pairs beside it. A
short untimed request first warms both services (the first forwards of a process pay
one-off costs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from specdec.commands.up import add_stack_settings, start
from specdec.engine.models import DEFAULT_DRAFT

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
# The timed prompts, one per repeat.
TIMED_PROMPTS = (
    "Write a short e-mail to a colleague asking to move our meeting to Thursday.",
    "What are three good habits for staying healthy while working from home?",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me a simple recipe for a vegetable soup.",
    "Why do leaves change colour in autumn?",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="start the services, stream a chat answer with stats, stop them")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--no-compare", action="store_true",
                        help="skip the timed target-only and speculative runs")
    parser.add_argument("--repeats", type=timed_prompt_count, default=3,
                        help=f"timed prompts (1-{len(TIMED_PROMPTS)}), each run speculative "
                             "and target-only")
    parser.add_argument("--fixed-length", action="store_true",
                        help="draft --num-draft-tokens every round instead of adapting")
    add_stack_settings(parser, default_ports=False)
    parser.set_defaults(func=run)


def timed_prompt_count(text: str) -> int:
    value = int(text)
    if not 1 <= value <= len(TIMED_PROMPTS):
        raise argparse.ArgumentTypeError(
            f"must be in [1, {len(TIMED_PROMPTS)}] (one new prompt each), got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specdec.commands.generate import build_request, call, stats_table

    console = Console()
    if args.draft_model == DEFAULT_DRAFT:
        from specdec.engine.draft_fallback import default_draft_or_truncated

        args.draft_model, trained = default_draft_or_truncated()
        if not trained:
            console.print("[yellow]the trained draft is not in specdec/assets/draft yet; "
                          f"using the target's first 2 layers ({args.draft_model})[/]")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="specdec-demo-"))
    args.log_dir = str(log_dir)
    console.print(f"starting draft, target and coordinator (logs in {log_dir}) ...")
    # A throwaway stack: any free metrics ports, so it runs beside `specdec up`.
    if args.metrics_port is None:
        args.metrics_port = 0
    stack = start(args)
    try:
        endpoint = stack.endpoint("coordinator")
        for role in ("coordinator", "draft", "target"):
            console.print(f"  {role:<12} {stack.endpoint(role)}")
        adaptive = not args.fixed_length
        request = build_request(args.prompt, chat=True, max_new_tokens=args.max_new_tokens,
                                num_draft_tokens=args.num_draft_tokens, fixed=not adaptive)
        warm_up = build_request(args.prompt, chat=True, max_new_tokens=8,
                                num_draft_tokens=args.num_draft_tokens, fixed=not adaptive)
        call(endpoint, warm_up, stream=False, timeout_s=900)
        console.print(f"\n[bold]user:[/] {args.prompt}\n[bold]assistant:[/] ", end="")
        speculative = call(endpoint, request, stream=True, timeout_s=900,
                           echo=lambda text: print(text, end="", flush=True))
        print("\n")
        length = ("adaptive draft length" if adaptive
                  else f"{args.num_draft_tokens} draft tokens per round")
        console.print(stats_table(speculative, f"speculative decoding, {length}"))
        if not args.no_compare:
            timed = compare(endpoint, args, args.repeats, console)
            same = all(tuple(baseline.token_ids) == tuple(fast.token_ids)
                       for baseline, fast in timed)
            console.print(stats_table(timed[-1][0], "target only (last run)"))
            baseline_s = statistics.median(pair[0].stats.total_seconds for pair in timed)
            speculative_s = statistics.median(pair[1].stats.total_seconds for pair in timed)
            ratios = [pair[0].stats.total_seconds / max(1e-9, pair[1].stats.total_seconds)
                      for pair in timed]
            rates = [tokens_per_second([pair[index] for pair in timed]) for index in (0, 1)]
            console.print(f"\nidentical output: {'[green]yes[/]' if same else '[red]NO[/]'}   "
                          f"speed-up: [bold]{baseline_s / max(1e-9, speculative_s):.2f}x[/] "
                          f"(median of {len(timed)} prompts, each run both ways: target only "
                          f"{baseline_s:.2f} s, {rates[0]:.1f} tok/s; "
                          f"speculative {speculative_s:.2f} s, {rates[1]:.1f} tok/s; pairs "
                          f"{min(ratios):.2f}-{max(ratios):.2f}x)")
            if not same:
                return 1
    finally:
        codes = stack.stop()
        console.print("stopped: " + ", ".join(f"{r} exit {c}" for r, c in codes.items()))
    return 0


def tokens_per_second(responses: list[Any]) -> float:
    """Generated tokens over generation seconds, summed over the responses."""
    tokens = sum(len(response.token_ids) for response in responses)
    return tokens / max(1e-9, sum(response.stats.total_seconds for response in responses))


def compare(endpoint: str, args: argparse.Namespace, repeats: int,
            console: Any) -> list[tuple[Any, Any]]:
    """(target-only, speculative) responses to `repeats` prompts, speculative first."""
    from specdec.commands.generate import build_request, call

    console.print(f"\n{repeats} other prompts, each speculative and then target only ...")
    pairs = []
    for index in range(repeats):
        prompt = TIMED_PROMPTS[index]
        request = build_request(prompt, chat=True, max_new_tokens=args.max_new_tokens,
                                num_draft_tokens=args.num_draft_tokens,
                                fixed=args.fixed_length)
        baseline = build_request(prompt, chat=True, max_new_tokens=args.max_new_tokens,
                                 num_draft_tokens=0)
        fast = call(endpoint, request, stream=False, timeout_s=900)
        pairs.append((call(endpoint, baseline, stream=False, timeout_s=900), fast))
    return pairs
