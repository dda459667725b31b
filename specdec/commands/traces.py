"""`specdec traces`: read the services' trace files with no tracing back end.

    specdec traces                 recent requests: time, latency, tokens, acceptance, rounds
    specdec traces <trace_id>      one request: round table and waterfall (id prefix is fine)
    specdec traces ... --json      the same as JSON, for scripts
    specdec traces --send http://127.0.0.1:4317   replay the files into an OTLP back end
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from specdec.telemetry.settings import add_trace_dir_setting


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "traces", help="list traced requests, or show one round by round",
        description="Join the coordinator, draft and target trace files (OTLP/JSON lines) "
                    "by trace id and show requests.")
    parser.add_argument("trace_id", nargs="?", help="trace id (or a unique prefix) to show")
    add_trace_dir_setting(parser)
    parser.add_argument("--file", action="append", type=Path, default=None,
                        help="read these files instead of --trace-dir (repeatable)")
    parser.add_argument("--limit", type=int, default=20, help="requests to list (default 20)")
    parser.add_argument("--max-spans", type=int, default=400,
                        help="spans in the timeline (default 400)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--send", metavar="ENDPOINT",
                        help="send the trace files to this OTLP/gRPC endpoint (Phoenix, "
                             "Jaeger, a Collector), e.g. http://127.0.0.1:4317")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so the other subcommands do not pay for rich at start-up.
    from rich.console import Console

    from specdec.telemetry import reader, render

    paths = args.file or reader.trace_files(Path(args.trace_dir))
    if not paths:
        raise FileNotFoundError(f"no trace files (*.jsonl) in {args.trace_dir}; start the "
                                "services with tracing on, or pass --trace-dir / --file")
    if args.send:
        from specdec.telemetry.replay import send_files

        print(f"sent {send_files(paths, args.send)} spans to {args.send}")
        return 0
    spans = reader.load_spans(paths)
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
        console = Console(width=max(console.width, 200))
    if args.trace_id is None:
        summaries = reader.list_requests(spans, args.limit)
        if args.json:
            print(json.dumps([asdict(s) for s in summaries], indent=2))
        elif not summaries:
            console.print(f"no requests in {len(paths)} trace file(s)")
        else:
            console.print(render.requests_table(summaries))
        return 0
    detail = reader.request_detail(spans, reader.resolve_trace_id(spans, args.trace_id))
    if args.json:
        print(json.dumps(reader.detail_to_json(detail), indent=2))
    else:
        render.render_detail(detail, console, args.max_spans)
    return 0
