"""What the target's forwards did during each phase of a load test, from its trace file.

Each Verify server span carries the forward it ran in (specdec.forward_ms,
specdec.batch.sessions, specdec.batch.rows), so a forward shared by s sessions appears in
s spans and counts 1/s in each; a Verify that decoded several tokens (specdec.steps) ran
that many such forwards, counted as of the size of its largest. Over a phase's time window
this says why a mode was faster or slower than another: more forwards, longer ones (more
rows in them), or a target left idle while its callers were elsewhere (busy = forward time
over the window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdec.telemetry import names as n
from specdec.telemetry.reader import KIND_SERVER, SpanRecord


@dataclass(frozen=True)
class ForwardStats:
    forwards: float  # the target's forwards in the window
    busy: float  # their seconds over the window's seconds
    sessions_per_forward: float
    rows_per_forward: float  # prefill rows included
    ms_per_forward: float

    def as_row(self) -> dict[str, float]:
        return {"target_forwards": round(self.forwards), "target_busy": round(self.busy, 3),
                "sessions_per_forward": round(self.sessions_per_forward, 2),
                "rows_per_forward": round(self.rows_per_forward, 1),
                "ms_per_forward": round(self.ms_per_forward, 1)}


def forward_stats(spans: Sequence[SpanRecord], start_ns: int, end_ns: int) -> ForwardStats | None:
    """The target's forwards whose Verify calls began in [start_ns, end_ns); None when the
    window holds none (tracing off, another target, an empty window)."""
    forwards = seconds = rows = 0.0
    calls = 0
    for span in spans:
        if (span.kind != KIND_SERVER or span.method != "Verify"
                or not start_ns <= span.start_ns < end_ns
                or n.FORWARD_MS not in span.attributes):
            continue
        steps = int(span.attributes.get(n.STEPS, 1) or 1)
        share = 1.0 / max(1, int(span.attributes.get(n.BATCH_SESSIONS, 1) or 1))
        calls += steps
        forwards += steps * share
        seconds += share * float(span.attributes[n.FORWARD_MS]) / 1000.0
        rows += steps * share * int(span.attributes.get(n.BATCH_ROWS, 0) or 0)
    if not calls or end_ns <= start_ns:
        return None
    return ForwardStats(forwards, seconds / ((end_ns - start_ns) / 1e9), calls / forwards,
                        rows / forwards, 1000.0 * seconds / forwards)


def with_forward_stats(rows: list[dict[str, Any]], spans: Sequence[SpanRecord]
                       ) -> list[dict[str, Any]]:
    """Each report row (with its phase's window, `window_ns`) and its ForwardStats."""
    for row in rows:
        window = row.get("window_ns")
        stats = forward_stats(spans, window[0], window[1]) if window else None
        if stats is not None:
            row.update(stats.as_row())
    return rows
