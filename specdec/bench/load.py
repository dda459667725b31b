"""`specdec bench --concurrency 1,2,4,8,16`: closed-loop clients over the public gRPC API.

At each concurrency level C, C client threads share a queue of requests (the committed
prompt set, greedy) and each sends its next GenerateStream as soon as its last one ends.
The modes (target-only, a fixed draft length, adaptive) run one after another within a
level, so the machine's drift over the run falls on all of them alike. With several
workloads (`--workload all`) each runs on its own within a level, its modes in turn, so
every workload has its own throughput and its ratio over target-only at that level.
With `--repeats N` each level and workload runs its modes N times, every other pass in
reverse order (A B C, C B A, ...), and the report adds each mode's median ratio over the
passes: a phase's throughput on a shared machine drifts by more than the effects a
speculation policy makes, so one pass per mode cannot tell them apart.

Measures, with the meanings of vLLM's `bench serve`:
- output throughput: output tokens of the level's successful requests over the level's
  wall time (first request sent to last answer); request throughput likewise.
- TTFT: request sent to the first stream message carrying tokens.
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1), per request.
- ITL: the gaps between successive token-carrying stream messages (a speculative round
  sends several tokens in one message, so its ITL is a round's time, not a token's).
- end-to-end latency: request sent to the last message.
- errors by gRPC status code; RESOURCE_EXHAUSTED (over the coordinator's admission
  limits) counts apart from the other failures.
- mismatches: successful requests whose tokens differ from the serial (concurrency 1,
  target-only) output for the same prompt; greedy decoding is exact, so this must be 0.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from specdec.bench.configs import SUFFIXES
from specdec.bench.process_cpu import CPU_COLUMNS, ProcessCpu, cpu_row, used_between
from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

TARGET_ONLY = "target-only"
ADAPTIVE = "adaptive"
DEFAULT_LOAD_MODES = (TARGET_ONLY, "k=4", ADAPTIVE)
ADAPTIVE_START = 4  # the first round's length of an adaptive request
OVER_CAPACITY = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class LoadMode:
    name: str
    num_draft_tokens: int
    adaptive: bool = False
    num_alternatives: int | None = None  # a token tree's alternatives (None: as served)
    max_alternative_depth: int = 0  # 1: alternatives one level deep; 0: no limit
    lookup_tokens: int | None = None  # prompt lookup's tokens per round (None: as served)
    suffix_tokens: int | None = None  # suffix decoding's tokens per round (None: as served)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


def parse_load_mode(text: str) -> LoadMode:
    """'target-only' (or '0'), 'adaptive', or a fixed length 'k=N' (or 'N'); a speculative
    mode may end in the bench's length suffixes (specdec.bench.configs.SUFFIXES), which
    combine: '+aN' a token tree of up to N alternatives ('+a0': a chain), '+fN' N
    alternatives one level deep (each follows a chain token), '+pN' at most N prompt
    lookup tokens per round and '+sN' at most N suffix decoding tokens ('+p0', '+s0':
    off), e.g. 'adaptive+s0+p0'."""
    name = text.strip()
    base, *options = name.split("+")
    values: dict[str, int] = {}
    for option in options:
        if option[:1] not in SUFFIXES or not option[1:].isdigit() or option[0] in values:
            raise ValueError(f"unknown load mode {name!r}: the suffixes are " + ", ".join(
                f"+{letter}N ({what})" for letter, what in SUFFIXES.items())
                + ", each at most once")
        values[option[0]] = int(option[1:])
    if "a" in values and "f" in values:
        raise ValueError(f"load mode {name!r}: +aN and +fN both set the alternatives")
    mode = LoadMode(name, ADAPTIVE_START, adaptive=True,
                    num_alternatives=values.get("a", values.get("f")),
                    max_alternative_depth=int("f" in values),
                    lookup_tokens=values.get("p"), suffix_tokens=values.get("s"))
    if base in (TARGET_ONLY, "0", "k=0"):
        if options:
            raise ValueError(f"load mode {name!r}: target-only takes no suffixes")
        return LoadMode(TARGET_ONLY, 0)
    if base == ADAPTIVE:
        return mode
    digits = base.removeprefix("k=")
    if not digits.isdigit():
        raise ValueError(f"unknown load mode {name!r}: use target-only, adaptive or k=N, "
                         "optionally with suffixes such as +a0")
    if not int(digits):
        return LoadMode(TARGET_ONLY, 0)
    return replace(mode, name="+".join([f"k={int(digits)}", *options]),
                   num_draft_tokens=int(digits), adaptive=False)


@dataclass(frozen=True)
class LoadPrompt:
    id: str
    token_ids: list[int]  # empty: `text` goes as a chat prompt, tokenized by the coordinator
    text: str = ""
    workload: str = "prompts"  # specdec.bench.workloads


@dataclass
class RequestRecord:
    mode: str
    concurrency: int
    prompt_id: str
    code: str  # "OK" or the gRPC status name
    e2e_s: float
    ttft_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    error: str = ""


@dataclass
class LevelRun:
    mode: str
    concurrency: int
    wall_s: float
    records: list[RequestRecord]
    workload: str = "prompts"
    window_ns: tuple[int, int] = (0, 0)  # wall clock (time.time_ns) at its start and end
    repeat: int = 0  # which pass over the modes
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per service role


def request_for(mode: LoadMode, prompt: LoadPrompt, max_new_tokens: int,
                cache_salt: str = "") -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest(
        cache_salt=cache_salt,
        max_new_tokens=max_new_tokens,
        speculation=coordinator_pb2.SpeculationParams(
            num_draft_tokens=mode.num_draft_tokens, adaptive=mode.adaptive),
        request_id=f"load-{mode.name}-{prompt.id}")
    if mode.num_alternatives is not None:
        request.speculation.num_alternatives = mode.num_alternatives
    request.speculation.max_alternative_depth = mode.max_alternative_depth
    if mode.lookup_tokens is not None:
        request.speculation.prompt_lookup_tokens = mode.lookup_tokens
    if mode.suffix_tokens is not None:
        request.speculation.suffix_tokens = mode.suffix_tokens
    if mode.temperature > 0:
        # One seed per prompt: every mode and level draws the same prompt's output from
        # the same stream.
        request.sampling.temperature = mode.temperature
        request.sampling.top_p = mode.top_p
        request.sampling.seed = zlib.crc32(prompt.id.encode())
    if prompt.token_ids:
        request.prompt_token_ids.extend(prompt.token_ids)
    else:
        request.prompt, request.chat = prompt.text, True
    return request


def stream_one(stub: coordinator_pb2_grpc.CoordinatorStub, mode: LoadMode,
               prompt: LoadPrompt, concurrency: int, max_new_tokens: int,
               timeout_s: float, cache_salt: str = "") -> RequestRecord:
    """One GenerateStream, timed message by message."""
    started = time.perf_counter()
    record = RequestRecord(mode.name, concurrency, prompt.id, "OK", 0.0)
    last: float | None = None
    try:
        for message in stub.GenerateStream(
                request_for(mode, prompt, max_new_tokens, cache_salt), timeout=timeout_s):
            now = time.perf_counter()
            if message.token_ids:
                if last is None:
                    record.ttft_s = now - started
                else:
                    record.itl_s.append(now - last)
                last = now
                record.token_ids.extend(message.token_ids)
            if message.finish_reason:
                record.rounds = message.stats.rounds
                record.draft_tokens = message.stats.draft_tokens
                record.accepted_tokens = message.stats.accepted_tokens
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        record.code = code.name
        record.error = (error.details() if isinstance(error, grpc.Call) else str(error)) or ""
    record.e2e_s = time.perf_counter() - started
    record.output_tokens = len(record.token_ids)
    return record


def run_level(stub: coordinator_pb2_grpc.CoordinatorStub, mode: LoadMode,
              concurrency: int, prompts: Sequence[LoadPrompt], requests: int,
              max_new_tokens: int, timeout_s: float,
              on_done: Callable[[RequestRecord], None] = lambda record: None,
              workload: str = "prompts", repeat: int = 0) -> LevelRun:
    """`requests` requests over the prompts in turn, from `concurrency` closed-loop clients."""
    # Each pass over the prompts fills a suffix cache of its own (per mode, level, workload
    # and repeat), so no request meets its own prompt's earlier answer.
    work: queue.Queue[tuple[LoadPrompt, str]] = queue.Queue()
    for index in range(requests):
        work.put((prompts[index % len(prompts)],
                  f"{mode.name}/{concurrency}/{workload}/{repeat}/{index // len(prompts)}"))
    records: list[RequestRecord] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                prompt, cache_salt = work.get_nowait()
            except queue.Empty:
                return
            record = stream_one(stub, mode, prompt, concurrency, max_new_tokens, timeout_s,
                                cache_salt)
            with lock:
                records.append(record)
            on_done(record)

    started, started_ns = time.perf_counter(), time.time_ns()
    threads = [threading.Thread(target=client, name=f"load-client-{i}", daemon=True)
               for i in range(concurrency)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:  # Ctrl-C: no client starts another request
        while not work.empty():
            work.get_nowait()
        raise
    return LevelRun(mode.name, concurrency, time.perf_counter() - started, records, workload,
                    (started_ns, time.time_ns()), repeat)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between order statistics; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 2)


def summarise_level(run: LevelRun, serial: dict[str, list[int]]) -> dict[str, Any]:
    ok = [r for r in run.records if r.code == "OK"]
    errors = Counter(r.code for r in run.records if r.code != "OK")
    output_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.ttft_s is not None and r.output_tokens > 1]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    compared = [r for r in ok if r.prompt_id in serial]
    mismatches = sum(r.token_ids != serial[r.prompt_id] for r in compared)
    rounds = sum(r.rounds for r in ok)
    draft_tokens = sum(r.draft_tokens for r in ok)
    return {
        "mode": run.mode, "concurrency": run.concurrency, "workload": run.workload,
        "repeat": run.repeat, "requests": len(run.records),
        "completed": len(ok), "wall_s": round(run.wall_s, 3), "window_ns": list(run.window_ns),
        "output_tokens": output_tokens,
        "output_throughput": round(output_tokens / run.wall_s, 2) if run.wall_s > 0 else 0.0,
        "request_throughput": round(len(ok) / run.wall_s, 3) if run.wall_s > 0 else 0.0,
        "mean_ttft_ms": _ms(sum(ttft) / len(ttft)) if ttft else None,
        "p50_ttft_ms": _ms(percentile(ttft, 50)), "p99_ttft_ms": _ms(percentile(ttft, 99)),
        "mean_tpot_ms": _ms(sum(tpot) / len(tpot)) if tpot else None,
        "p50_tpot_ms": _ms(percentile(tpot, 50)), "p99_tpot_ms": _ms(percentile(tpot, 99)),
        "p50_itl_ms": _ms(percentile(itl, 50)), "p99_itl_ms": _ms(percentile(itl, 99)),
        "p50_e2e_ms": _ms(percentile(e2e, 50)), "p99_e2e_ms": _ms(percentile(e2e, 99)),
        "errors": dict(sorted(errors.items())),
        "over_capacity": errors.get(OVER_CAPACITY, 0),
        "failed": sum(count for code, count in errors.items() if code != OVER_CAPACITY),
        "compared": len(compared), "mismatches": mismatches,
        "draft_tokens_per_round": round(draft_tokens / rounds, 2) if rounds else 0.0,
        "acceptance": round(sum(r.accepted_tokens for r in ok) / draft_tokens, 3)
        if draft_tokens else None,
        **cpu_row(run.cpu_s, run.wall_s, rounds),
    }


@dataclass(frozen=True)
class LoadSettings:
    concurrency: tuple[int, ...]
    modes: tuple[str, ...] = DEFAULT_LOAD_MODES
    max_new_tokens: int = 64
    # Requests per (level, mode): at least one per prompt and `min_rounds` per client.
    min_rounds: int = 1
    timeout_s: float = 600.0
    warmup_tokens: int = 8
    progress: bool = True
    # Sampling of every request: greedy (0), or temperature and top-p with a seed per
    # prompt; greedy runs compare every output with the serial target-only one.
    temperature: float = 0.0
    top_p: float = 1.0
    # Passes over the modes at each level and workload, every other one in reverse order.
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {self.repeats}")


def requests_at(level: int, prompts: int, min_rounds: int) -> int:
    return max(prompts, level * min_rounds)


def run_load(stub: coordinator_pb2_grpc.CoordinatorStub, settings: LoadSettings,
             prompts: Sequence[LoadPrompt], *, meta: dict[str, Any] | None = None,
             out: Any = None, cpu: ProcessCpu | None = None) -> dict[str, Any]:
    """Every mode at every level (the modes in turn within a level); the report. cpu:
    the services' processes, whose CPU time each phase reports (specdec.bench.process_cpu)."""
    out = out if out is not None else sys.stderr
    modes = [replace(parse_load_mode(name), temperature=settings.temperature,
                     top_p=settings.top_p) for name in settings.modes]
    levels = sorted(set(settings.concurrency))
    if not levels or levels[0] < 1:
        raise ValueError(f"concurrency levels must be positive integers, got {levels}")
    target_only = LoadMode(TARGET_ONLY, 0, temperature=settings.temperature,
                           top_p=settings.top_p)
    by_workload: dict[str, list[LoadPrompt]] = {}
    for prompt in prompts:
        by_workload.setdefault(prompt.workload, []).append(prompt)
    plan = [(level, workload, repeat, mode) for level in levels for workload in by_workload
            for repeat in range(settings.repeats)
            for mode in (modes if repeat % 2 == 0 else modes[::-1])]
    # Sampled outputs have no serial reference to equal: nothing to compare.
    reference_in_plan = settings.temperature > 0 or any(
        level == 1 and mode == target_only for level, _, _, mode in plan)
    total = sum(requests_at(level, len(by_workload[workload]), settings.min_rounds)
                for level, workload, _, _ in plan)
    if not reference_in_plan:
        total += len(prompts)
    done = 0
    started = time.perf_counter()
    interactive = bool(getattr(out, "isatty", lambda: False)()) and settings.progress

    def progress(label: str, run_errors: int) -> Callable[[RequestRecord], None]:
        def on_done(record: RequestRecord) -> None:
            nonlocal done
            done += 1
            if settings.progress:
                line = (f"[{done}/{total} requests, {time.perf_counter() - started:.0f} s] "
                        f"{label}: last {record.code} in {record.e2e_s:.2f} s")
                out.write(("\r" + line.ljust(78)) if interactive else line + "\n")
                out.flush()
        return on_done

    if settings.warmup_tokens > 0:  # first calls load kernels and caches: not measured
        for mode in modes:
            stream_one(stub, mode, prompts[0], 1, settings.warmup_tokens, settings.timeout_s)
    serial: dict[str, list[int]] = {}
    runs: list[LevelRun] = []
    if not reference_in_plan:  # the serial greedy outputs the others are compared with
        reference = run_level(stub, target_only, 1, prompts, len(prompts),
                              settings.max_new_tokens, settings.timeout_s,
                              progress("serial reference", 0))
        serial = {r.prompt_id: r.token_ids for r in reference.records if r.code == "OK"}
    several = len(by_workload) > 1
    for level, workload, repeat, mode in plan:
        chosen = by_workload[workload]
        label = (f"{mode.name} c={level}" + (f" {workload}" if several else "")
                 + (f" pass {repeat + 1}/{settings.repeats}" if settings.repeats > 1 else ""))
        before = cpu.sample() if cpu is not None else {}
        run = run_level(stub, mode, level, chosen,
                        requests_at(level, len(chosen), settings.min_rounds),
                        settings.max_new_tokens, settings.timeout_s, progress(label, 0),
                        workload, repeat)
        run.cpu_s = used_between(before, cpu.sample()) if cpu is not None else {}
        if level == 1 and mode == target_only and settings.temperature == 0:
            serial.update({r.prompt_id: r.token_ids for r in run.records if r.code == "OK"})
        runs.append(run)
    if interactive:
        out.write("\n")
    rows = with_ratios([summarise_level(run, serial) for run in runs])
    return {"settings": {**asdict(settings), "prompts": len(prompts),
                         "workloads": list(by_workload)},
            "meta": {**(meta or {}), "wall_s": round(time.perf_counter() - started, 1)},
            "levels": rows, "passes": over_passes(rows),
            "requests": [asdict(r) for run in runs for r in run.records]}


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's output throughput over target-only's at its level, workload and pass
    (None where target-only did not run there)."""
    base = {(row["concurrency"], row["workload"], row["repeat"]): row["output_throughput"]
            for row in rows if row["mode"] == TARGET_ONLY}
    for row in rows:
        reference = base.get((row["concurrency"], row["workload"], row["repeat"]))
        row["speedup"] = (round(row["output_throughput"] / reference, 3)
                          if reference and row["mode"] != TARGET_ONLY else None)
    return rows


def over_passes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each speculative mode's ratios over target-only at a level and workload, one per
    pass, with their median and range."""
    ratios: dict[tuple[int, str, str], list[float]] = {}
    for row in rows:
        if row["speedup"] is not None:
            ratios.setdefault((row["concurrency"], row["workload"], row["mode"]),
                              []).append(row["speedup"])
    return [{"concurrency": level, "workload": workload, "mode": mode, "speedups": values,
             "median_speedup": round(percentile(values, 50) or 0.0, 3),
             "min_speedup": min(values), "max_speedup": max(values)}
            for (level, workload, mode), values in ratios.items()]


# -- report ----------------------------------------------------------------------------
COLUMNS = (("concurrency", "clients"), ("mode", "mode"), ("workload", "workload"),
           ("repeat", "pass"), ("completed", "ok"), ("output_throughput", "out tok/s"),
           ("speedup", "x target-only"), ("request_throughput", "req/s"),
           ("p50_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
           ("mean_tpot_ms", "TPOT mean ms"), ("p50_itl_ms", "ITL p50 ms"),
           ("p99_itl_ms", "ITL p99 ms"), ("p50_e2e_ms", "E2E p50 ms"),
           ("p99_e2e_ms", "E2E p99 ms"), ("draft_tokens_per_round", "draft/round"),
           ("acceptance", "accept"), ("over_capacity", "over capacity"),
           ("failed", "failed"), ("mismatches", "mismatches"))


def _row_cell(row: dict[str, Any], key: str) -> str:
    """A report row's cell; passes count from 1."""
    return str(row["repeat"] + 1) if key == "repeat" else _cell(row.get(key))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def render_markdown(report: dict[str, Any], command: str) -> str:
    settings, meta = report["settings"], report["meta"]
    repeats = settings.get("repeats", 1)
    lines = ["# specdec bench --concurrency", "", f"- command: `{command}`",
             f"- {settings['prompts']} prompts"
             + (f" ({', '.join(settings['workloads'])})" if settings.get("workloads") else "")
             + f", {_sampling(settings)}, "
             f"{settings['max_new_tokens']} new tokens; "
             f"modes {', '.join(settings['modes'])} in turn at each level"
             + (f", {repeats} passes in alternating order" if repeats > 1 else "")
             + "; closed-loop clients over GenerateStream",
             f"- wall time {meta.get('wall_s', 0)} s"]
    if "machine" in meta:
        machine = meta["machine"]
        lines.append(f"- machine: {machine.get('cpu')}, {machine.get('cores')} cores, "
                     "load average " + "/".join(f"{x:.1f}" for x in machine.get(
                         "load_average", [])))
    if "endpoint" in meta:
        lines.append(f"- coordinator: {meta['endpoint']}")
    # The workload and pass columns only when the run had several.
    columns = [(key, title) for key, title in COLUMNS
               if (key != "workload" or len(settings.get("workloads", [])) > 1)
               and (key != "repeat" or repeats > 1)]
    lines += _passes_table(report.get("passes", []), repeats,
                           len(settings.get("workloads", [])) > 1)
    lines += ["", "| " + " | ".join(title for _, title in columns) + " |",
              "|" + "---|" * len(columns)]
    for row in report["levels"]:
        lines.append("| " + " | ".join(_row_cell(row, key) for key, _ in columns) + " |")
    lines += _services_table(report["levels"], [column for column in columns if column[0] in
                                                ("concurrency", "mode", "workload", "repeat")])
    errors = [(row["mode"], row["concurrency"], row["errors"]) for row in report["levels"]
              if row["errors"]]
    lines += ["", "Errors by status code: " + ("; ".join(
        f"{mode} c={level}: " + ", ".join(f"{code} {count}" for code, count in codes.items())
        for mode, level, codes in errors) if errors else "none") + ".", "",
        "x target-only: output throughput over target-only's at the same level (and "
        "workload). TTFT: request to its first tokens. TPOT: (latency - TTFT) / (tokens - "
        "1). ITL: gaps between stream messages (one per round). mismatches: outputs that differ "
        "from the serial target-only output of the same prompt (must be 0).", ""]
    return "\n".join(lines)


def _passes_table(passes: list[dict[str, Any]], repeats: int, workloads: bool) -> list[str]:
    """Each mode's median ratio over target-only across the passes (none for one pass)."""
    if repeats < 2 or not passes:
        return []
    lines = ["", f"x target-only over {repeats} passes: the median of each pass's ratio, and "
             "each pass's ratio in the order run.", "",
             "| clients | mode |" + (" workload |" if workloads else "")
             + " median | each pass |", "|---|---|" + ("---|" if workloads else "") + "---|---|"]
    for row in passes:
        lines.append(f"| {row['concurrency']} | {row['mode']} |"
                     + (f" {row['workload']} |" if workloads else "")
                     + f" **{row['median_speedup']:.3g}x** | "
                     + ", ".join(f"{value:.3g}x" for value in row["speedups"]) + " |")
    return lines


FORWARD_COLUMNS = (("target_forwards", "forwards"), ("target_busy", "target busy"),
                   ("sessions_per_forward", "sessions/forward"),
                   ("rows_per_forward", "rows/forward"), ("ms_per_forward", "ms/forward"))


def _services_table(rows: list[dict[str, Any]], keys: list[tuple[str, str]]) -> list[str]:
    """The target's forwards per phase (specdec.bench.forwards), where its trace had them,
    and the services' CPU time (specdec.bench.process_cpu), where it was sampled."""
    shown = [column for column in (*FORWARD_COLUMNS, *CPU_COLUMNS)
             if any(column[0] in row for row in rows)]
    if not shown:
        return []
    columns = [*keys, *shown]
    lines = ["", "The services in each phase: the target's forwards from its trace (target "
             "busy = forward time over the phase's wall time; rows include prefill), CPU "
             "from the processes (cores = CPU seconds over wall seconds; ms/round over the "
             "completed requests' rounds).", "",
             "| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if any(key in row for key, _ in shown):
            cells = [f"{row[key]:.0%}" if key == "target_busy" and key in row
                     else _row_cell(row, key)
                     for key, _ in columns]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _sampling(settings: dict[str, Any]) -> str:
    temperature = settings.get("temperature", 0.0)
    if not temperature:
        return "greedy"
    top_p = settings.get("top_p", 1.0)
    return f"temperature {temperature:g}" + (f", top-p {top_p:g}" if top_p < 1 else "") + \
        " (seeded; no mismatch check)"


def write_plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = list(dict.fromkeys((row["mode"], row.get("workload", "")) for row in report["levels"]))
    several = len({workload for _, workload in series}) > 1
    for index, (name, workload) in enumerate(series):
        rows = sorted((r for r in report["levels"]
                       if (r["mode"], r.get("workload", "")) == (name, workload)),
                      key=lambda r: r["concurrency"])
        mode = f"{name} {workload}" if several else name
        xs = [r["concurrency"] for r in rows]
        color = f"C{index}"
        throughput.plot(xs, [r["output_throughput"] for r in rows], marker="o", color=color,
                        label=mode)
        latency.plot(xs, [r["p50_e2e_ms"] or float("nan") for r in rows], marker="o",
                     color=color, label=f"{mode} p50")
        latency.plot(xs, [r["p99_e2e_ms"] or float("nan") for r in rows], marker="x",
                     linestyle="--", color=color, label=f"{mode} p99")
    levels = sorted({row["concurrency"] for row in report["levels"]})
    for ax in (throughput, latency):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(level) for level in levels])
        ax.set_xlabel("concurrent clients")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    throughput.set_ylabel("output tokens / s (all clients)")
    throughput.set_title("aggregate throughput")
    latency.set_ylabel("end-to-end latency (ms)")
    latency.set_title("request latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(report: dict[str, Any], out_dir: Path, command: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "load.json", "markdown": out_dir / "load.md",
             "plot": out_dir / "load.png"}
    paths["json"].write_text(json.dumps({**report, "command": command},
                                        separators=(",", ":")))
    paths["markdown"].write_text(render_markdown(report, command))
    write_plot(report, paths["plot"])
    return paths
