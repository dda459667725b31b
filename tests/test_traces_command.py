"""`specdec traces` lists and renders a traced request from the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.cli import main
from tests.telemetry_helpers import file_telemetry, run_request


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, object]:
    directory = tmp_path_factory.mktemp("traces")
    telemetry = file_telemetry(directory / "coordinator.jsonl")
    result, trace_id = run_request(telemetry, request_id="cli-req")
    telemetry.shutdown()
    return directory, trace_id, result


def test_list_shows_the_request(trace_dir: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    directory, trace_id, _ = trace_dir
    assert main(["traces", "--trace-dir", str(directory)]) == 0
    out = capsys.readouterr().out
    assert trace_id[:8] in out and "Recent requests" in out


def test_list_json(trace_dir: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    directory, trace_id, result = trace_dir
    assert main(["traces", "--trace-dir", str(directory), "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    assert summary["trace_id"] == trace_id
    assert summary["rounds"] == result.stats.rounds
    assert summary["new_tokens"] == len(result.token_ids)
    assert summary["request_id"] == "cli-req"


def test_show_one_request_by_prefix(trace_dir: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    directory, trace_id, result = trace_dir
    assert main(["traces", trace_id[:10], "--trace-dir", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "Rounds" in out and "Timeline" in out and "specdec.generate" in out
    assert out.count("round ") >= result.stats.rounds  # one waterfall row per round


def test_show_json_has_round_table(trace_dir: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    directory, trace_id, result = trace_dir
    assert main(["traces", trace_id, "--trace-dir", str(directory), "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert len(detail["rounds"]) == result.stats.rounds
    assert sum(r["accepted"] for r in detail["rounds"]) == result.stats.accepted_tokens
    assert detail["spans"][0]["name"] == "specdec.generate"


def test_unknown_trace_id_is_an_error(trace_dir: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    directory, _, _ = trace_dir
    assert main(["traces", "ffffffffffff", "--trace-dir", str(directory)]) == 2
    assert "no trace" in capsys.readouterr().err


def test_torn_last_line_is_skipped(tmp_path: Path, trace_dir: tuple,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    directory, trace_id, _ = trace_dir
    copy = tmp_path / "coordinator.jsonl"
    copy.write_text((directory / "coordinator.jsonl").read_text() + '{"resourceSpans": [')
    assert main(["traces", "--trace-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["trace_id"] == trace_id
