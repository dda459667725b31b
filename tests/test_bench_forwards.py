"""The load report's per-phase view of the target's forwards (specdec.bench.forwards),
from Verify server spans; tests/test_observability_e2e.py checks it against the target's
own histograms on real services."""

from __future__ import annotations

import pytest

from specdec.bench.forwards import forward_stats, with_forward_stats
from specdec.bench.load import render_markdown
from specdec.telemetry import names as n
from specdec.telemetry.reader import KIND_CLIENT, KIND_SERVER, SpanRecord

MS = 1_000_000


def verify(start_ms: int, forward_ms: float, sessions: int, rows: int,
           kind: int = KIND_SERVER, name: str = "/specdec.v1.Target/Verify") -> SpanRecord:
    return SpanRecord("t", f"s{start_ms}", "", name, kind, start_ms * MS,
                      (start_ms + 1) * MS, {n.FORWARD_MS: forward_ms, n.BATCH_SESSIONS: sessions,
                                            n.BATCH_ROWS: rows}, [], "target", "target")


def test_a_forward_shared_by_sessions_counts_once() -> None:
    spans = [
        # 0-100 ms: one forward of 2 sessions (40 ms, 6 rows), then one alone (20 ms, 3 rows)
        verify(0, 40.0, 2, 6), verify(1, 40.0, 2, 6), verify(50, 20.0, 1, 3),
        # not the target's forwards, or outside the window
        verify(10, 99.0, 1, 9, kind=KIND_CLIENT), verify(10, 99.0, 1, 9, name="/x/Propose"),
        verify(100, 99.0, 1, 9),
    ]
    stats = forward_stats(spans, 0, 100 * MS)
    assert stats is not None
    assert stats.forwards == pytest.approx(2.0)
    assert stats.busy == pytest.approx(0.6)  # 60 ms of forwards in 100 ms
    assert stats.sessions_per_forward == pytest.approx(1.5)
    assert stats.rows_per_forward == pytest.approx(4.5)
    assert stats.ms_per_forward == pytest.approx(30.0)
    assert forward_stats(spans, 200 * MS, 300 * MS) is None


def test_a_verify_that_decoded_several_tokens_counts_its_forwards() -> None:
    # Two sessions decoding 4 tokens each in lockstep (4 forwards of 2 rows, 80 ms in all),
    # then a one-token Verify alone (20 ms, 1 row).
    decoding = [verify(0, 80.0, 2, 2), verify(1, 80.0, 2, 2), verify(50, 20.0, 1, 1)]
    for span in decoding[:2]:
        span.attributes[n.STEPS] = 4
    stats = forward_stats(decoding, 0, 200 * MS)
    assert stats is not None
    assert stats.forwards == pytest.approx(5.0)
    assert stats.busy == pytest.approx(0.5)  # 100 ms of forwards in 200 ms
    assert stats.sessions_per_forward == pytest.approx(9 / 5)
    assert stats.rows_per_forward == pytest.approx(9 / 5)
    assert stats.ms_per_forward == pytest.approx(20.0)


def test_the_report_shows_a_forward_table_only_where_the_trace_had_forwards() -> None:
    rows = [{"concurrency": 8, "mode": mode, "workload": "prompts", "window_ns": window,
             "errors": {}} for mode, window in (("target-only", [0, 100 * MS]),
                                                ("adaptive", [500 * MS, 600 * MS]))]
    report = {"settings": {"prompts": 1, "max_new_tokens": 4, "modes": ["target-only",
                                                                         "adaptive"]},
              "meta": {}, "levels": rows}
    assert "target busy" not in render_markdown(report, "c")
    with_forward_stats(rows, [verify(0, 40.0, 2, 6), verify(1, 40.0, 2, 6)])
    assert rows[0]["target_busy"] == pytest.approx(0.4) and "target_busy" not in rows[1]
    markdown = render_markdown(report, "c")
    assert "| clients | mode | forwards | target busy |" in markdown
    assert "| 8 | target-only | 1 | 40% | 2 | 6 | 40.0 |" in markdown
