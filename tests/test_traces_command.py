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


def test_send_replays_the_files_to_an_otlp_endpoint(
        trace_dir: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2,
        trace_service_pb2_grpc,
    )

    received: list = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        directory, trace_id, result = trace_dir
        assert main(["traces", "--trace-dir", str(directory), "--send",
                     f"http://127.0.0.1:{port}"]) == 0
    finally:
        server.stop(0)
    spans = [span for request in received for resource in request.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    assert {span.trace_id.hex() for span in spans} == {trace_id}
    assert sum(span.name == "specdec.round" for span in spans) == result.stats.rounds
    assert f"sent {len(spans)} spans" in capsys.readouterr().out
