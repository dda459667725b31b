"""`specdec http`: the OpenAI-compatible HTTP API in front of a coordinator.

With --tls-cert-file / --tls-key-file it serves HTTPS; with --tls-ca-file it calls the
coordinator over TLS, verifying the coordinator's certificate (specdec.serving.security)."""

from __future__ import annotations

import argparse
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from specdec.config import add_setting
from specdec.engine.models import DEFAULT_TARGET
from specdec.serving.http_api.app import HttpSettings
from specdec.serving.security import SecuritySettings, https_files, warn_if_exposed
from specdec.serving.stack import PARENT_PID_ENV, free_port
from specdec.settings import HTTP_SECURITY_SETTINGS, add_settings, default

DEFAULT_HTTP_PORT: int = default("http-port")
DEFAULTS = HttpSettings()
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health")


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
    add_settings(parser, HTTP_SECURITY_SETTINGS)


def settings_from_args(args: argparse.Namespace) -> HttpSettings:
    if args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    return HttpSettings(coordinator_endpoint=args.coordinator_endpoint,
                        served_model_name=args.served_model_name or args.target_model,
                        default_max_tokens=args.default_max_tokens,
                        request_timeout_s=args.request_timeout_s,
                        security=SecuritySettings.from_args(args))


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

    from specdec.serving.http_api.app import create_app

    settings = settings_from_args(args)
    served = https_files(settings.security)
    app = create_app(settings)
    if served is None:
        warn_if_exposed(args.http_host, args.http_port, ROUTES, tls=False, client_auth=False)
    scheme = "https" if served else "http"
    print(f"http serving on {scheme}://{args.http_host}:{args.http_port} (coordinator "
          f"{args.coordinator_endpoint}{' over TLS' if app.state.tls_to_coordinator else ''})",
          flush=True)
    # uvicorn stops gracefully on SIGTERM, then raises the signal again under the
    # handler it found: this one makes that a prompt, clean exit.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    # No access log: one line per request costs the event loop time it shares with the
    # streams; errors are still logged.
    uvicorn.run(app, host=args.http_host, port=args.http_port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5,
                ssl_certfile=served[0] if served else None,
                ssl_keyfile=served[1] if served else None)
    return 0


@dataclass
class HttpProcess:
    """`specdec http` as a child process (`specdec up`)."""

    url: str
    process: subprocess.Popen[bytes]
    log: IO[bytes] | None = None
    ca_file: str = ""  # verifies an https:// url's certificate (empty = the system's roots)

    def healthy(self) -> bool:
        context = (ssl.create_default_context(cafile=self.ca_file or None)
                   if self.url.startswith("https:") else None)
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2,
                                        context=context) as reply:
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
               log_path: Path | None = None, host: str = "127.0.0.1",
               env: Mapping[str, str] | None = None) -> HttpProcess:
    """Start `specdec http` in front of `coordinator` and wait until /health answers 200.

    env: SPECDEC_* variables over this process's environment; with SPECDEC_TLS_CERT_FILE
    and SPECDEC_TLS_KEY_FILE it serves HTTPS, checked against SPECDEC_TLS_CA_FILE."""
    port = port or free_port(host)
    environ = {**os.environ, **(env or {})}
    security = SecuritySettings.from_environ(environ)
    log = open(log_path, "wb") if log_path is not None else None  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "http", "--http-host", host,
         "--http-port", str(port), "--coordinator-endpoint", coordinator,
         "--target-model", target_model],
        stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True,
        # It dies with this process, like the stack's children (specdec.serving.stack).
        env={**environ, PARENT_PID_ENV: str(os.getpid())})
    scheme = "https" if security.tls else "http"
    http = HttpProcess(f"{scheme}://{host}:{port}", process, log, security.tls_ca_file)
    deadline = time.monotonic() + timeout_s
    while not http.healthy():
        if process.poll() is not None or time.monotonic() > deadline:
            code = http.stop()
            where = f"; log: {log_path}" if log_path else ""
            raise RuntimeError(f"the HTTP API on port {port} did not become healthy "
                               f"(exit {code}){where}")
        time.sleep(0.2)
    return http
