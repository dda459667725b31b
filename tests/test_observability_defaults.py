"""Observability defaults: metrics listen where the service does; trace files have a
home outside the current directory; `up` takes the same flags as `ray`."""

from __future__ import annotations

import argparse
import socket
import urllib.request
from pathlib import Path

import pytest

from specdec.telemetry.service import Telemetry
from specdec.telemetry.settings import add_telemetry_settings, default_trace_dir


def own_address() -> str:
    """An address of this machine other than loopback (None-like "" if there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            return str(probe.getsockname()[0])
        except OSError:
            return ""


def test_metrics_listen_on_the_services_host() -> None:
    args = argparse.Namespace(host="127.0.0.1", metrics_port=0, tracing="off")
    telemetry = Telemetry.from_args(args, "draft")
    assert telemetry.metrics_port
    url = f"http://127.0.0.1:{telemetry.metrics_port}/metrics"
    assert b"specdec_" in urllib.request.urlopen(url, timeout=10).read()
    other = own_address()
    if other and not other.startswith("127."):
        with pytest.raises(OSError):  # not on every interface (0.0.0.0)
            socket.create_connection((other, telemetry.metrics_port), timeout=2).close()


def test_traces_default_to_the_state_directory(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_trace_dir() == str(tmp_path / "specdec" / "traces")
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_trace_dir() == str(Path.home() / ".local/state/specdec/traces")


def test_up_and_ray_take_the_same_observability_flags() -> None:
    from specdec.cli import build_parser

    reference = argparse.ArgumentParser()
    add_telemetry_settings(reference)
    flags = {flag for action in reference._actions for flag in action.option_strings
             if flag not in ("-h", "--help")}
    for command in ("up", "ray"):
        parser = build_parser(command)
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[union-attr]
        have = {flag for action in sub._actions for flag in action.option_strings}
        assert flags <= have, (command, flags - have)


def test_up_spreads_one_metrics_port_over_its_three_services() -> None:
    from specdec.commands.up import metrics_ports

    assert metrics_ports(argparse.Namespace(metrics_port=9500)) == {
        "coordinator": 9500, "draft": 9501, "target": 9502}
    assert set(metrics_ports(argparse.Namespace(metrics_port=-1)).values()) == {-1}
    assert metrics_ports(argparse.Namespace(metrics_port=None)) == {
        "coordinator": 9464, "draft": 9465, "target": 9466}
