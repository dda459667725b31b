"""`specdec serve draft|target|coordinator`: one service in the foreground."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from specdec.config import DEFAULT_PORTS, add_serve_arguments

# A stopping service exits at most this long after its graceful-stop period: its stop
# hooks close channels and flush spans, which take well under it.
STOP_DEADLINE_MARGIN_S = 20.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run one service in the foreground")
    add_serve_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdec.serving.compute import MainThreadExecutor
    from specdec.serving.grpc_server import freeze_loaded_objects, serve_until_signal
    from specdec.serving.stack import announce_ready

    if not args.port:
        args.port = DEFAULT_PORTS[args.role]
    module = {"draft": "draft_service.server", "target": "target_service.server",
              "coordinator": "coordinator.server"}[args.role]
    from specdec.telemetry.service import Telemetry

    telemetry = Telemetry.from_args(args, args.role)  # traces, and /metrics on its port
    create = importlib.import_module(module).create
    # model services' forwards run on this thread: specdec.serving.compute
    work = MainThreadExecutor()
    handle = (create(args, telemetry=telemetry) if args.role == "coordinator"
              else create(args, telemetry=telemetry, executor=work))
    freeze_loaded_objects()
    print(f"{args.role} serving on {handle.address}", flush=True)
    announce_ready(handle.address)  # for a parent `specdec up`: this process is serving
    serve_until_signal(handle, args.grace_s, work,
                       exit_deadline_s=args.grace_s + STOP_DEADLINE_MARGIN_S)
    # Stopped: flush the last spans and skip the interpreter's teardown of torch and
    # transformers, which on a busy host can outlast a supervisor's stop timeout.
    telemetry.flush()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
