"""CLI flags for telemetry, following the SPECDEC_* convention of specdec.config.

--tracing on|off           SPECDEC_TRACING        (OTEL_SDK_DISABLED=true also turns it off)
--trace-dir DIR            SPECDEC_TRACE_DIR      where `<role>.jsonl` files go (default
                                                  $XDG_STATE_HOME/specdec/traces, i.e.
                                                  ~/.local/state/specdec/traces); `specdec
                                                  traces` reads the same directory
--trace-file PATH|none     SPECDEC_TRACE_FILE     overrides `<trace-dir>/<role>.jsonl`
--trace-tokens on|off      SPECDEC_TRACE_TOKENS   put token ids (content) on spans
--metrics-port N           SPECDEC_METRICS_PORT   Prometheus /metrics (default 9464
                                                  coordinator, 9465 draft, 9466 target);
                                                  -1 turns it off, 0 picks a free port
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from specdec.telemetry.metrics import DEFAULT_METRICS_PORTS

# A trace file rotates to <file>.1 past this size (one old file kept).
TRACE_FILE_MAX_MB = 100



def default_trace_dir() -> str:
    """Where trace files go unless told: the user's state directory, not the current one."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(state) / "specdec" / "traces")


DEFAULT_TRACE_DIR = default_trace_dir()


def add_setting(parser: argparse.ArgumentParser, flag: str, default: object, help: str,
                type: type = str) -> None:
    # Same rule as specdec.config.add_setting; imported lazily there would pull in torch.
    env = "SPECDEC_" + flag.lstrip("-").replace("-", "_").upper()
    raw = os.environ.get(env)
    value = type(raw) if raw not in (None, "") else default
    parser.add_argument(flag, default=value, type=type,
                        help=f"{help} (env {env}; default: {default})")


def add_trace_dir_setting(parser: argparse.ArgumentParser) -> None:
    add_setting(parser, "--trace-dir", DEFAULT_TRACE_DIR,
                "directory of the OTLP/JSON-lines trace files, one per service; each "
                f"rotates to <file>.1 past {TRACE_FILE_MAX_MB} MiB, so a service keeps at most "
                f"{2 * TRACE_FILE_MAX_MB} MiB")


def add_telemetry_settings(parser: argparse.ArgumentParser) -> None:
    add_setting(parser, "--tracing", "on", "OpenTelemetry tracing: on or off")
    add_trace_dir_setting(parser)
    add_setting(parser, "--trace-file", "",
                "trace file (OTLP/JSON lines); 'none' writes no file, empty means "
                "<trace-dir>/<role>.jsonl")
    add_setting(parser, "--trace-tokens", "off", "record token ids on spans: on or off")
    ports = ", ".join(f"{port} {role}" for role, port in DEFAULT_METRICS_PORTS.items())
    add_setting(parser, "--metrics-port", None,
                f"Prometheus /metrics port (-1: off, 0: any free port; unset: {ports})",
                type=int)


def metrics_port_for(args: argparse.Namespace, role: str) -> int:
    port = getattr(args, "metrics_port", None)
    return DEFAULT_METRICS_PORTS[role] if port is None else int(port)


def trace_file_for(args: argparse.Namespace, role: str) -> Path | None:
    value = str(getattr(args, "trace_file", "") or "").strip()
    if value.lower() in {"none", "off", "-"}:
        return None
    if value:
        return Path(value)
    directory = getattr(args, "trace_dir", "") or DEFAULT_TRACE_DIR
    return Path(directory) / f"{role}.jsonl"
