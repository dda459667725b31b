"""`specdec up`: draft, target, coordinator and the HTTP API as local processes until
stopped.

The services stop whenever `up` does: Ctrl-C, SIGTERM, a closed terminal (SIGHUP), an
error in `up`, or `up` killed outright (specdec.serving.stack). Every port is checked before
anything starts, and "ready" is printed only once this run's own processes serve.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import time
from pathlib import Path

from specdec.commands.http import DEFAULT_HTTP_PORT, start_http
from specdec.config import DEFAULT_PORTS, add_service_settings, add_setting
from specdec.serving.security import SecuritySettings
from specdec.serving.stack import Stack, check_ports_free, start_stack
from specdec.settings import DEFAULT_METRICS_PORTS, SERVICE_SETTINGS
from specdec.telemetry.settings import add_telemetry_settings

HOST = "127.0.0.1"
ROLES = ("coordinator", "draft", "target")

# Flags of `up` that are forwarded unchanged to each `specdec serve`.
FORWARDED = tuple(name.replace("-", "_") for name in SERVICE_SETTINGS)


def add_stack_settings(parser: argparse.ArgumentParser, default_ports: bool = True) -> None:
    for role in ROLES:
        default = DEFAULT_PORTS[role] if default_ports else 0
        add_setting(parser, f"--{role}-port", default,
                    f"{role} port (0 = any free port)", type=int)
    add_setting(parser, "--startup-timeout-s", 300.0,
                "how long to wait for all three to report healthy", type=float)
    add_setting(parser, "--log-dir", "", "write each service's log to DIR/<role>.log "
                "instead of this terminal")
    add_service_settings(parser)
    # The flags `specdec serve` and `specdec ray` take; --metrics-port N here is the
    # coordinator's, with the draft and target on N+1 and N+2.
    add_telemetry_settings(parser)


def service_args(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for name in FORWARDED:
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


def metrics_ports(args: argparse.Namespace) -> dict[str, int]:
    """Each role's metrics port: unset = the roles' defaults, -1 = off, 0 = any free
    port, N = coordinator N, draft N+1, target N+2."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        return dict(DEFAULT_METRICS_PORTS)
    if port <= 0:
        return {role: port for role in ROLES}
    return {role: port + offset for offset, role in enumerate(ROLES)}


def telemetry_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """Per role: the observability flags for its `specdec serve`."""
    shared = ["--tracing", args.tracing, "--trace-tokens", args.trace_tokens,
              "--trace-dir", str(Path(args.trace_dir).expanduser())]
    if str(args.trace_file or "").lower() in {"none", "off", "-"}:
        shared += ["--trace-file", "none"]  # a single path would mix three services' spans
    return {role: [*shared, "--metrics-port", str(port)]
            for role, port in metrics_ports(args).items()}


def child_commands(args: argparse.Namespace) -> tuple[list[str], dict[str, list[str]]]:
    """The flags every child gets, and each role's own: the one place `up` builds its
    children's command lines."""
    return service_args(args), telemetry_args(args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up", help="start draft, target, coordinator and the HTTP API on 127.0.0.1 until "
        "Ctrl-C")
    add_stack_settings(parser)
    parser.add_argument("--secure", action="store_true",
                        help="TLS everywhere, mutual TLS between the services and a generated "
                        "API key on the public API (certificates in a new private directory)")
    add_setting(parser, "--http-port", DEFAULT_HTTP_PORT,
                "port of the OpenAI-compatible HTTP API (docs/http.md; 0 = any free port, "
                "-1 = no HTTP API)", type=int)
    parser.set_defaults(func=run)


def secure_setup() -> tuple[dict[str, str], str]:
    """`--secure`: certificates and an API key in a new private directory; the children's
    environment, and the key."""
    import tempfile

    from specdec.serving.security import secure_stack_env

    directory = Path(tempfile.mkdtemp(prefix="specdec-secure-"))  # mode 0700
    env, api_key = secure_stack_env(directory)
    print(f"secure: certificates and API keys in {directory}")
    return env, api_key


def call_instructions(env: dict[str, str], api_key: str) -> tuple[str, str]:
    """What a caller adds to `specdec generate`, and to curl against the HTTP API, for
    the TLS and the key the children run with (`--secure`'s, or SPECDEC_* of this
    environment, whose keys file's keys a caller passes as SPECDEC_API_KEY)."""
    security = SecuritySettings.from_environ({**os.environ, **env})
    ca = security.tls_ca_file if security.tls else ""
    flags = (f" --tls-ca-file {shlex.quote(ca)}" if ca else "") + (
        f" --api-key {api_key}" if api_key else "")
    curl = f" --cacert {shlex.quote(ca)}" if ca else ""
    if api_key:
        curl += f" -H 'Authorization: Bearer {api_key}'"
    elif security.api_keys_file:
        curl += ' -H "Authorization: Bearer $SPECDEC_API_KEY"'
    return flags, curl


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM and SIGHUP stop the stack like Ctrl-C does


def say(text: str) -> None:
    """Print, unless the terminal is gone (after SIGHUP): stopping must go on regardless."""
    with contextlib.suppress(OSError):
        print(text, flush=True)


def start(args: argparse.Namespace, env: dict[str, str] | None = None) -> Stack:
    # SIGINT explicitly too: a process started from a non-interactive shell's background
    # job inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    ports = {role: getattr(args, f"{role}_port") for role in ROLES}
    shared, per_role = child_commands(args)
    check_ports_free(HOST, {
        **{f"{role} gRPC": port for role, port in ports.items()},
        **{f"{role} metrics": port for role, port in metrics_ports(args).items()},
        **({"HTTP API": args.http_port} if getattr(args, "http_port", -1) > 0 else {})})
    stack = start_stack(HOST, ports, shared, role_args=per_role,
                        log_dir=Path(args.log_dir) if args.log_dir else None, env=env,
                        draft_after_target_s=args.startup_timeout_s)
    try:
        stack.wait_healthy(args.startup_timeout_s)
    except BaseException:
        stack.stop()
        raise
    return stack


def run(args: argparse.Namespace) -> int:
    env, api_key = secure_setup() if getattr(args, "secure", False) else ({}, "")
    call_flags, curl_flags = call_instructions(env, api_key)
    stack = start(args, env=env or None)
    http = None
    try:
        if args.http_port >= 0:
            # The same certificates: HTTPS with TLS settings, and TLS to the coordinator.
            http = start_http(stack.endpoint("coordinator"), args.http_port, args.target_model,
                              args.startup_timeout_s,
                              Path(args.log_dir) / "http.log" if args.log_dir else None,
                              env=env)
    except BaseException:
        stack.stop()
        raise
    try:
        for role in ROLES:
            say(f"{role:<12} {stack.endpoint(role)}  (pid {stack.processes[role].pid})")
        if http is not None:
            say(f"{'http':<12} {http.url}  (pid {http.process.pid})")
            say(f"http call: curl{curl_flags} {http.url}/v1/chat/completions -H "
                "'content-type: application/json' -d '{\"messages\": [{\"role\": \"user\", "
                "\"content\": \"Hello\"}]}'")
        say("draft: ready (requests are speculative)" if stack.ready("draft") else
            "draft: loading (requests run target-only until it is)")
        say(f"ready: specdec generate \"Hello\" --endpoint {stack.endpoint('coordinator')}"
            f"{call_flags}   (Ctrl-C stops them all)")
        while not stack.dead() and (http is None or http.process.poll() is None):
            time.sleep(0.5)
        say("stopping: " + ("; ".join(stack.failure(role) for role in stack.dead())
                            or "http exited"))
        return 1
    except KeyboardInterrupt:
        say("stopping...")
        return 0
    finally:
        if http is not None:
            say(f"stopped: http exit {http.stop()}")
        codes = stack.stop()
        say("stopped: " + ", ".join(f"{role} exit {code}" for role, code in codes.items()))
