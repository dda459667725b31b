"""`specdec serve draft|target|coordinator`: one service in the foreground."""

from __future__ import annotations

import argparse
import importlib

from specdec.adaptive import DEFAULT_DRAFT_CONFIDENCE
from specdec.config import add_model_settings, add_setting
from specdec.prompt_lookup import DEFAULT_LOOKUP_TOKENS, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM
from specdec.security import add_security_settings
from specdec.steps import DEFAULT_ALTERNATIVES
from specdec.telemetry.settings import add_telemetry_settings

ROLES = ("coordinator", "draft", "target")
DEFAULT_PORTS = {"coordinator": 50051, "draft": 50052, "target": 50053}
DEFAULT_HOST = "127.0.0.1"


def add_service_settings(parser: argparse.ArgumentParser) -> None:
    """Settings every role accepts, so `specdec up` can pass one set to all three."""
    add_model_settings(parser)
    add_setting(parser, "--session-ttl-s", 600.0,
                "release a session's KV cache after this long without calls", type=float)
    add_setting(parser, "--max-workers", 32, "gRPC server threads", type=int)
    add_setting(parser, "--max-draft-tokens", 16,
                "most tokens drafted per round (a request asking more is rejected)", type=int)
    add_setting(parser, "--num-draft-tokens", 4,
                "draft length when a request does not set speculation", type=int)
    add_setting(parser, "--draft-confidence", DEFAULT_DRAFT_CONFIDENCE,
                "adaptive requests end a round's draft after a token the draft gives less "
                "than this probability (0 = off; a request may set its own)", type=float)
    add_setting(parser, "--draft-alternatives", DEFAULT_ALTERNATIVES,
                "greedy requests also verify this many of the draft's next-best tokens "
                "beside its chain each round (0 = off; a request may set its own)", type=int)
    add_setting(parser, "--prompt-lookup-tokens", DEFAULT_LOOKUP_TOKENS,
                "speculative requests first look the last few tokens up in the text so far "
                "and propose up to this many of the tokens that followed them, without a "
                "draft forward (0 = off; a request may set its own)", type=int)
    add_setting(parser, "--prompt-lookup-min", DEFAULT_MIN_NGRAM,
                "shortest n-gram prompt lookup matches", type=int)
    add_setting(parser, "--prompt-lookup-max", DEFAULT_MAX_NGRAM,
                "longest n-gram prompt lookup matches (tried first)", type=int)
    add_setting(parser, "--max-new-tokens-limit", 2048,
                "largest max_new_tokens a request may ask for", type=int)
    add_setting(parser, "--draft-timeout-ms", 5000.0,
                "per-call deadline of Propose; a slower draft is skipped (target-only, "
                "still exact) and retried with backoff", type=float)
    add_setting(parser, "--target-timeout-s", 30.0,
                "how long one Verify may wait for an unavailable target, retries included",
                type=float)
    add_setting(parser, "--grace-s", 5.0, "graceful-stop period for in-flight calls",
                type=float)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", choices=ROLES, help="which service")
    add_setting(parser, "--host", DEFAULT_HOST, "interface to listen on")
    add_setting(parser, "--port", 0,
                "port (0 = the role's default: coordinator 50051, draft 50052, target 50053)",
                type=int)
    replicas = "host:port, a list host:port,host:port, or dns:///name:port"
    add_setting(parser, "--draft-endpoint", f"127.0.0.1:{DEFAULT_PORTS['draft']}",
                f"coordinator: the draft replicas, {replicas} ('none' = no draft, "
                "target-only)")
    add_setting(parser, "--target-endpoint", f"127.0.0.1:{DEFAULT_PORTS['target']}",
                f"coordinator: the target replicas, {replicas}")
    add_service_settings(parser)
    # Not in add_service_settings: `up` hands them over in the environment, and one
    # --health-port cannot serve all three.
    add_security_settings(parser)
    # Not in add_service_settings: `up` must not hand one metrics port to all three.
    add_telemetry_settings(parser)


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
    serve_until_signal(handle, args.grace_s, work)
    return 0
