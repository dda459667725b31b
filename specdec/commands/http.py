"""`specdec http`: the OpenAI-compatible HTTP API in front of a coordinator."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from specdec.config import add_setting
from specdec.http_api.app import HttpSettings
from specdec.models import DEFAULT_TARGET
from specdec.settings import add_settings, default
from specdec.stack import PARENT_PID_ENV, free_port

DEFAULT_HTTP_PORT: int = default("http-port")
DEFAULTS = HttpSettings()


def add_http_settings(parser: argparse.ArgumentParser) -> None:
    """Settings of the HTTP process (`specdec up` takes --http-port only)."""
    add_settings(parser, ["http-host", "http-port", "coordinator-endpoint"], grouped=False)
    add_setting(parser, "--target-model", DEFAULT_TARGET,
                "the coordinator's target model; its name is the served model name unless "
                "--served-model-name is set")
    add_setting(parser, "--served-model-name", "",
                "the model id /v1/models lists and requests name (empty = --target-model)")
    add_setting(parser, "--default-max-tokens", DEFAULTS.default_max_tokens,
                "max_tokens of requests that set neither max_tokens nor "
                "max_completion_tokens", type=int)
    add_setting(parser, "--request-timeout-s", DEFAULTS.request_timeout_s,
                "deadline of one generation (HTTP 504 after it)", type=float)


def settings_from_args(args: argparse.Namespace) -> HttpSettings:
    if args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    return HttpSettings(coordinator_endpoint=args.coordinator_endpoint,
                        served_model_name=args.served_model_name or args.target_model,
                        default_max_tokens=args.default_max_tokens,
                        request_timeout_s=args.request_timeout_s)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "http", help="serve the OpenAI-compatible HTTP API (chat/completions, completions, "
        "models, health) in front of a coordinator")
    add_http_settings(parser)
    parser.set_defaults(func=run)


def _exit_cleanly(signum: int, frame: object) -> None:
    # The server has shut down by now. os._exit skips the interpreter's teardown of the
    # modules the CLI imports (torch, transformers), which is most of the stop time.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from specdec.http_api.app import create_app

    app = create_app(settings_from_args(args))
    print(f"http serving on http://{args.http_host}:{args.http_port} "
          f"(coordinator {args.coordinator_endpoint})", flush=True)
    # uvicorn stops gracefully on SIGTERM, then raises the signal again under the
    # handler it found: this one makes that a prompt, clean exit.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    # No access log: one line per request costs the event loop time it shares with the
    # streams; errors are still logged.
    uvicorn.run(app, host=args.http_host, port=args.http_port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5)
    return 0


@dataclass
class HttpProcess:
    """`specdec http` as a child process (`specdec up`)."""

    url: str
    process: subprocess.Popen[bytes]
    log: IO[bytes] | None = None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        if self.log is not None:
            self.log.close()
        return code


def start_http(coordinator: str, port: int, target_model: str, timeout_s: float,
               log_path: Path | None = None, host: str = "127.0.0.1") -> HttpProcess:
    """Start `specdec http` in front of `coordinator` and wait until /health answers 200."""
    port = port or free_port(host)
    log = open(log_path, "wb") if log_path is not None else None  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "http", "--http-host", host,
         "--http-port", str(port), "--coordinator-endpoint", coordinator,
         "--target-model", target_model],
        stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True,
        # It dies with this process, like the stack's children (specdec.stack).
        env={**os.environ, PARENT_PID_ENV: str(os.getpid())})
    http = HttpProcess(f"http://{host}:{port}", process, log)
    deadline = time.monotonic() + timeout_s
    while not http.healthy():
        if process.poll() is not None or time.monotonic() > deadline:
            code = http.stop()
            where = f"; log: {log_path}" if log_path else ""
            raise RuntimeError(f"the HTTP API on port {port} did not become healthy "
                               f"(exit {code}){where}")
        time.sleep(0.2)
    return http
