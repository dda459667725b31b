"""Terminal views of traces (rich): the request list, the round table, the waterfall."""

from __future__ import annotations

import datetime as dt
import math

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from specdec.telemetry import names as n
from specdec.telemetry.reader import (
    KIND_CLIENT,
    KIND_SERVER,
    RequestDetail,
    RequestSummary,
    RoundRow,
    SpanRecord,
    TimelineRow,
)

ROLE_STYLES = {"coordinator": "cyan", "draft": "yellow", "target": "magenta"}
BAR_WIDTH = 48


def _clock(start_ns: int) -> str:
    return dt.datetime.fromtimestamp(start_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1f}"


def requests_table(summaries: list[RequestSummary]) -> Table:
    table = Table(title="Recent requests (newest first)", title_justify="left")
    for header, justify in (("time", "left"), ("trace id", "left"), ("latency ms", "right"),
                            ("prompt", "right"), ("new", "right"), ("tok/s", "right"),
                            ("rounds", "right"), ("accept", "right"), ("mean len", "right"),
                            ("finish", "left"), ("services", "left")):
        # Ids and times stay whole so they can be copied; the numbers may wrap.
        table.add_column(header, justify=justify,  # type: ignore[arg-type]
                         no_wrap=header in ("time", "trace id"))
    for s in summaries:
        finish = Text(s.finish_reason, style="red" if s.error else "")
        if s.degraded:
            finish.append(" degraded", style="yellow")
        table.add_row(_clock(s.start_ns), s.trace_id, f"{s.latency_ms:.0f}", str(s.prompt_tokens),
                      str(s.new_tokens), f"{s.tokens_per_s:.1f}", str(s.rounds),
                      f"{s.acceptance_rate:.0%}", f"{s.mean_accepted_length:.2f}", finish,
                      ",".join(s.services))
    return table


def summary_panel(s: RequestSummary) -> Panel:
    lines = [
        f"trace {s.trace_id}   request {s.request_id or '-'}   {_clock(s.start_ns)}",
        f"{s.latency_ms:.1f} ms   prompt {s.prompt_tokens}   new {s.new_tokens} "
        f"({s.tokens_per_s:.1f} tok/s)   rounds {s.rounds}   acceptance {s.acceptance_rate:.1%}"
        f"   mean accepted length {s.mean_accepted_length:.2f}",
        f"finish {s.finish_reason}" + ("   DEGRADED (draft unavailable)" if s.degraded else "")
        + ("   ERROR" if s.error else "") + f"   services {', '.join(s.services)}",
    ]
    return Panel("\n".join(lines), title="specdec.generate", title_align="left")


def rounds_table(rows: list[RoundRow]) -> Table:
    table = Table(title="Rounds", title_justify="left")
    headers = ("#", "start ms", "ms", "pos", "asked", "from", "prop", "acc", "emit", "next",
               "rejected at", "propose ms", "draft fwd", "verify ms", "target fwd", "network",
               "resync")
    for header in headers:
        table.add_column(header, justify="left" if header in ("pos", "from", "next")
                         else "right")
    for r in rows:
        accepted = Text(f"{r.accepted}/{r.proposed}",
                        style="green" if r.proposed and r.accepted == r.proposed else "")
        next_kind = Text(r.next_token, style={"bonus": "green", "correction": "red"}.get(
            r.next_token, "dim"))
        table.add_row(
            str(r.index), f"{r.start_ms:.1f}", f"{r.duration_ms:.1f}",
            f"{r.position_before}->{r.position_after}", str(r.asked),
            {"prompt_lookup": "lookup"}.get(r.source, r.source or "-"), str(r.proposed), accepted,
            str(r.emitted), next_kind, "-" if r.rejected_at is None else str(r.rejected_at),
            _ms(r.propose_ms), _ms(r.draft_forward_ms), _ms(r.verify_ms),
            _ms(r.target_forward_ms), _ms(r.network_ms),
            str(r.resyncs) + (" degraded" if r.degraded else ""))
    return table


def span_label(span: SpanRecord) -> str:
    if span.name == n.ROUND_SPAN:
        return f"round {span.attributes.get(n.ROUND_INDEX, '?')}"
    if span.kind in (KIND_CLIENT, KIND_SERVER):
        return f"{span.method} ({'client' if span.kind == KIND_CLIENT else 'server'})"
    return span.name


def _bar(span: SpanRecord, t0: int, total_ns: int, width: int, style: str) -> Text:
    scale = width / max(total_ns, 1)
    begin = min(width - 1, int((span.start_ns - t0) * scale))
    end = max(begin + 1, min(width, math.ceil((span.end_ns - t0) * scale)))
    cells = [" "] * begin + ["█"] * (end - begin) + [" "] * (width - end)
    bar = Text("".join(cells), style=style)
    for event in span.events:  # mark rejections where they happened
        if event.name == n.REJECTION_EVENT and event.time_ns:
            at = min(width - 1, max(0, int((event.time_ns - t0) * scale)))
            bar.stylize("bold red on white", at, at + 1)
    return bar


def waterfall(rows: list[TimelineRow], width: int = BAR_WIDTH, max_rows: int = 400) -> Table:
    t0 = min((r.span.start_ns for r in rows), default=0)
    total = max((r.span.end_ns for r in rows), default=t0) - t0
    table = Table(title=f"Timeline ({total / 1e6:.1f} ms; rejections in red)",
                  title_justify="left")
    table.add_column("span")
    table.add_column("service")
    table.add_column("start ms", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("0" + " " * (width - 2 - len(f"{total / 1e6:.0f}")) + f"{total / 1e6:.0f}",
                     no_wrap=True)
    for row in rows[:max_rows]:
        span = row.span
        style = ROLE_STYLES.get(span.role, "white")
        if span.error:
            style = "red"
        label = Text("  " * row.depth + span_label(span), style="bold" if row.depth == 0 else "")
        table.add_row(label, Text(span.role, style=style), f"{(span.start_ns - t0) / 1e6:.1f}",
                      f"{span.duration_ms:.1f}", _bar(span, t0, total, width, style))
    if len(rows) > max_rows:
        table.caption = f"{len(rows) - max_rows} more spans not shown (--max-spans)"
    return table


def render_detail(detail: RequestDetail, console: Console, max_spans: int = 400) -> None:
    parts: list = []
    if detail.summary is not None:
        parts.append(summary_panel(detail.summary))
    if detail.rounds:
        parts.append(rounds_table(detail.rounds))
    parts.append(waterfall(detail.spans, max_rows=max_spans))
    console.print(Group(*parts))
