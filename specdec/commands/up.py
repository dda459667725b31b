"""`specdec up`: draft, target and coordinator as local processes until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

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
        "up", help="start draft, target and coordinator on 127.0.0.1 until Ctrl-C")
    add_stack_settings(parser)
    parser.add_argument("--secure", action="store_true",
                        help="TLS everywhere, mutual TLS between the services and a generated "
                        "API key on the public API (certificates in a new private directory)")
    parser.set_defaults(func=run)


def secure_setup() -> tuple[dict[str, str], str]:
    """`--secure`: certificates and an API key in a new private directory; the children's
    environment, and the flags a caller then needs."""
    import tempfile

    from specdec.security import secure_stack_env

    directory = Path(tempfile.mkdtemp(prefix="specdec-secure-"))  # mode 0700
    env, api_key = secure_stack_env(directory)
    print(f"secure: certificates and API keys in {directory}")
    return env, (f" --tls-ca-file {env['SPECDEC_TLS_CA_FILE']} --api-key {api_key}")


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
    env, call_flags = secure_setup() if getattr(args, "secure", False) else ({}, "")
    stack = start(args, env=env or None)
    for role in ("coordinator", "draft", "target"):
        print(f"{role:<12} {stack.endpoint(role)}  (pid {stack.processes[role].pid})")
    print(f"ready: specdec generate \"Hello\" --endpoint {stack.endpoint('coordinator')}"
          f"{call_flags}   (Ctrl-C stops all three)", flush=True)
    try:
        while not stack.dead():
            time.sleep(0.5)
        print(f"stopping: {', '.join(stack.dead())} exited")
        return 1
    except KeyboardInterrupt:
        print("stopping...", flush=True)
        return 0
    finally:
        codes = stack.stop()
        print("stopped: " + ", ".join(f"{role} exit {code}" for role, code in codes.items()))
