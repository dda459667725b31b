"""`specdec up`: draft, target, coordinator and the HTTP API as local processes until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

from specdec.commands.http import DEFAULT_HTTP_PORT, start_http
from specdec.commands.serve import DEFAULT_PORTS, add_service_settings
from specdec.config import add_setting
from specdec.stack import Stack, start_stack

# Flags of `up` that are forwarded unchanged to each `specdec serve`.
FORWARDED = ("target_model", "draft_model", "device", "dtype", "torch_threads",
             "linear_kernel", "attention_kernel", "draft_dtype", "draft_linear_kernel",
             "draft_compile",
             "kv_budget_mb", "session_ttl_s", "max_workers",
             "max_draft_tokens", "num_draft_tokens", "draft_confidence", "draft_alternatives",
             "prompt_lookup_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "max_new_tokens_limit",
             "draft_timeout_ms", "target_timeout_s", "grace_s")


def add_stack_settings(parser: argparse.ArgumentParser, default_ports: bool = True) -> None:
    for role in ("coordinator", "draft", "target"):
        default = DEFAULT_PORTS[role] if default_ports else 0
        add_setting(parser, f"--{role}-port", default,
                    f"{role} port (0 = any free port)", type=int)
    add_setting(parser, "--startup-timeout-s", 300.0,
                "how long to wait for all three to report healthy", type=float)
    add_setting(parser, "--log-dir", "", "write each service's log to DIR/<role>.log "
                "instead of this terminal")
    add_service_settings(parser)


def service_args(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for name in FORWARDED:
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up", help="start draft, target, coordinator and the HTTP API on 127.0.0.1 until "
        "Ctrl-C")
    add_stack_settings(parser)
    add_setting(parser, "--http-port", DEFAULT_HTTP_PORT,
                "port of the OpenAI-compatible HTTP API (docs/http.md; 0 = any free port, "
                "-1 = no HTTP API)", type=int)
    parser.set_defaults(func=run)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the stack like Ctrl-C does


def start(args: argparse.Namespace, env: dict[str, str] | None = None) -> Stack:
    # SIGINT explicitly too: a process started from a non-interactive shell's background
    # job inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    ports = {role: getattr(args, f"{role}_port") for role in ("coordinator", "draft", "target")}
    stack = start_stack("127.0.0.1", ports, service_args(args),
                        log_dir=Path(args.log_dir) if args.log_dir else None, env=env,
                        draft_after_target_s=args.startup_timeout_s)
    try:
        stack.wait_healthy(args.startup_timeout_s)
    except BaseException:
        stack.stop()
        raise
    return stack


def run(args: argparse.Namespace) -> int:
    stack = start(args)
    http = None
    try:
        if args.http_port >= 0:
            http = start_http(stack.endpoint("coordinator"), args.http_port, args.target_model,
                              args.startup_timeout_s,
                              Path(args.log_dir) / "http.log" if args.log_dir else None)
    except BaseException:
        stack.stop()
        raise
    for role in ("coordinator", "draft", "target"):
        print(f"{role:<12} {stack.endpoint(role)}  (pid {stack.processes[role].pid})")
    if http is not None:
        print(f"{'http':<12} {http.url}  (pid {http.process.pid})")
    print(f"ready: specdec generate \"Hello\" --endpoint {stack.endpoint('coordinator')}   "
          "(Ctrl-C stops them all)", flush=True)
    try:
        while not stack.dead() and (http is None or http.process.poll() is None):
            time.sleep(0.5)
        print(f"stopping: {', '.join(stack.dead()) or 'http'} exited")
        return 1
    except KeyboardInterrupt:
        print("stopping...", flush=True)
        return 0
    finally:
        if http is not None:
            print(f"stopped: http exit {http.stop()}")
        codes = stack.stop()
        print("stopped: " + ", ".join(f"{role} exit {code}" for role, code in codes.items()))
