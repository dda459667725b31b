"""CLI flags for telemetry, following the SPECDEC_* convention of specdec.config.

--tracing on|off           SPECDEC_TRACING        (OTEL_SDK_DISABLED=true also turns it off)
--trace-dir DIR            SPECDEC_TRACE_DIR      where `<role>.jsonl` files go; `specdec
                                                  traces` reads the same directory
--trace-file PATH|none     SPECDEC_TRACE_FILE     overrides `<trace-dir>/<role>.jsonl`
--trace-tokens on|off      SPECDEC_TRACE_TOKENS   put token ids (content) on spans
--metrics-port N           SPECDEC_METRICS_PORT   Prometheus /metrics (default 9464
                                                  coordinator, 9465 draft, 9466 target);
                                                  -1 turns it off, 0 picks a free port
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec.settings import (
    DEFAULT_METRICS_PORTS,
    TELEMETRY_SETTINGS,
    TRACE_FILE_MAX_MB,
    _default_trace_dir,
    add_settings,
    default,
)

__all__ = ["TRACE_FILE_MAX_MB", "default_trace_dir"]

default_trace_dir = _default_trace_dir

DEFAULT_TRACE_DIR: str = default("trace-dir")


def add_trace_dir_setting(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, ["trace-dir"])


def add_telemetry_settings(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, TELEMETRY_SETTINGS)


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
