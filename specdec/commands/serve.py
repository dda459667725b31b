"""`specdec serve draft|target|coordinator`: one service in the foreground."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from specdec.settings import (
    ADDRESS_SETTINGS,
    DEFAULT_PORTS,
    SECURITY_SETTINGS,
    SERVICE_SETTINGS,
    TELEMETRY_SETTINGS,
    add_settings,
    default,
)

ROLES = ("coordinator", "draft", "target")
DEFAULT_HOST: str = default("host")
__all__ = ["DEFAULT_HOST", "DEFAULT_PORTS", "ROLES", "add_serve_arguments",
           "add_service_settings", "serve_parser"]


def add_service_settings(parser: argparse.ArgumentParser) -> None:
    """Settings every role accepts, so `specdec up` can pass one set to all three."""
    add_settings(parser, SERVICE_SETTINGS)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", choices=ROLES, help="which service")
    add_settings(parser, ADDRESS_SETTINGS)
    add_service_settings(parser)
    # Not in add_service_settings: `up` hands them over in the environment, and one
    # --health-port cannot serve all three.
    add_settings(parser, SECURITY_SETTINGS)
    # Not in add_service_settings: `up` must not hand one metrics port to all three.
    add_settings(parser, TELEMETRY_SETTINGS)


def serve_parser() -> argparse.ArgumentParser:
    """`specdec serve`'s flags on their own (for services started in other processes)."""
    parser = argparse.ArgumentParser(prog="specdec serve")
    add_serve_arguments(parser)
    return parser


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run one service in the foreground")
    add_serve_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdec.compute import MainThreadExecutor
    from specdec.grpc_server import serve_until_signal
    from specdec.stack import announce_ready

    if not args.port:
        args.port = DEFAULT_PORTS[args.role]
    module = {"draft": "draft_service.server", "target": "target_service.server",
              "coordinator": "coordinator.server"}[args.role]
    from specdec.telemetry.service import Telemetry

    telemetry = Telemetry.from_args(args, args.role)  # traces, and /metrics on its port
    create = importlib.import_module(module).create
    work = MainThreadExecutor()  # model services' forwards run on this thread: specdec.compute
    handle = (create(args, telemetry=telemetry) if args.role == "coordinator"
              else create(args, telemetry=telemetry, executor=work))
    print(f"{args.role} serving on {handle.address}", flush=True)
    announce_ready(handle.address)  # for a parent `specdec up`: this process is serving
    serve_until_signal(handle, args.grace_s, work)
    # Stopped: flush the last spans and skip the interpreter's teardown of torch and
    # transformers, which on a busy host can outlast a supervisor's stop timeout.
    telemetry.flush()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
