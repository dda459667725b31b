"""`specdec bench`: target-only, transformers and specdec (in-process and over gRPC) side by
side on the same prompts; writes bench.json, bench.md and PNG plots."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.config import add_setting, env_name
from specdec.settings import add_settings, default

COMPILE_AUTO, COMPILE_OFF = "auto", "off"

DEFAULT_LOAD_MODES = ("target-only", "k=4", "adaptive")  # specdec.bench.load's, torch-free

if TYPE_CHECKING:  # torch-heavy: imported when a command runs, not when the CLI parses
    from specdec.bench.harness import BenchResult

# The draft runs eager in a quick run: compiling it took 51 s of a 173 s quick run with
# an empty inductor cache (2 cores), for 1-2 % of a round (docs/performance.md).
# `--concurrency --quick`: 8 prompts, 24 tokens (under 3 minutes on 2 cores).
LOAD_QUICK = {"prompts_per_category": 2, "max_new_tokens": 24, "draft_compile": COMPILE_OFF}
QUICK = {"modes": "greedy", "lengths": "2,4,adaptive,adaptive+a0", "prompts_per_category": 1,
         "repeats": 1, "max_new_tokens": 32, "calibration_repeats": 3, "warmup_tokens": 24,
         "draft_compile": COMPILE_OFF}


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from specdec.bench.configs import LENGTHS, LOCAL_TOKEN_DRAFT, MODES, SYSTEMS

    parser = subparsers.add_parser(
        "bench", help="benchmark target-only, transformers and specdec side by side")
    add_setting(parser, "--target-model", default("target-model"), "target model")
    add_setting(parser, "--draft-model", default("draft-model"), "draft model")
    add_setting(parser, "--assistant-model", "",
                "token-only draft for transformers' assisted generation (default: the draft "
                "model, or specdec-draft when the draft model is a feature draft)")
    add_setting(parser, "--dtype", default("dtype"),
                "dtype of every system: bfloat16, float32 (the draft's: see --draft-dtype)")
    add_settings(parser, ["backend", "torch-threads", "linear-kernel", "attention-kernel",
                          "draft-dtype", "draft-linear-kernel", "draft-compile", "fused-step"])
    # prompts, repetition (specdec.bench.workloads) or all: both, with ratios per workload;
    # also for --concurrency.
    add_settings(parser, ["workload"], grouped=False)
    # None = not set by flag or environment, so that --quick can turn the compile off.
    parser.set_defaults(draft_compile=os.environ.get(env_name("--draft-compile")) or None)
    parser.add_argument("--grpc-torch-threads", type=int, default=0,
                        help="torch threads of each `specdec serve` process of the gRPC "
                        "system (0 = torch default, as `specdec up` starts them)")
    parser.add_argument("--quick", action="store_true",
                        help="greedy, 1 prompt per category, k in 2,4,adaptive,adaptive+a0, "
                        "32 tokens, the draft not compiled (under 3 minutes on 2 cores); "
                        "explicit flags and SPECDEC_* variables still win")
    parser.add_argument("--modes", default=None,
                        help=f"sampling modes (default: {','.join(MODES)}); with "
                        "--concurrency one mode (default: greedy)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"systems to run; also {LOCAL_TOKEN_DRAFT} (specdec in process "
                        "with --assistant-model, beside a feature draft)")
    parser.add_argument("--lengths", default=None,
                        help=f"draft lengths (default: {','.join(LENGTHS)}; also 'heuristic'); "
                        "a +aN suffix makes the draft a token tree of up to N alternatives "
                        "(default: as served); "
                        "'confident' = the longest length ended by the confidence gate; "
                        "adaptive@G / confident@G set the gate G (default 0.4)")
    parser.add_argument("--prompts-per-category", type=int, default=None,
                        help="first N prompts of each category (default: all)")
    parser.add_argument("--sampled-lengths", default=None,
                        help="draft lengths in the sampled modes (default: as --lengths)")
    parser.add_argument("--sampled-prompts-per-category", type=int, default=None,
                        help="prompts per category in the sampled modes (default: as greedy)")
    parser.add_argument("--repeats", type=int, default=None, help="passes over the prompts "
                        "(default 2); with --concurrency, passes over the modes at each level "
                        "(default 1), every other one in reverse order, reported with each "
                        "mode's median ratio over target-only")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 96")
    parser.add_argument("--max-adaptive-length", type=int, default=default("max-adaptive-length"),
                        help="longest draft the adaptive policy may choose")
    parser.add_argument("--compare-dtypes", default="",
                        help="also measure cost curves in these formats, e.g. "
                        "float32,bfloat16,int8; FORMAT@KERNEL picks the linear kernel, "
                        "e.g. float32@torch,float32@skinny")
    parser.add_argument("--calibration-repeats", type=int, default=None)
    parser.add_argument("--costs-only", action="store_true",
                        help="only measure T_target(k) and T_draft(1) (in --compare-dtypes, "
                        "default --dtype); writes costs.json and costs.md")
    parser.add_argument("--report-from", default=None, metavar="BENCH_JSON",
                        help="measure nothing: write the summary, markdown and plots of an "
                        "earlier run's bench.json (or its directory) again with this "
                        "version's report code, into --out")
    parser.add_argument("--concurrency", default=None, metavar="LEVELS",
                        help="load test instead: closed-loop clients over GenerateStream at "
                        "each of these concurrency levels, e.g. 1,2,4,8,16; writes load.json, "
                        "load.md and load.png")
    parser.add_argument("--load-modes", default=",".join(DEFAULT_LOAD_MODES),
                        help="with --concurrency: the modes run at each level (target-only, "
                        "k=N, adaptive), with --lengths' suffixes: +aN a token tree of N "
                        "alternatives (+a0 a chain), +pN / +sN prompt lookup / suffix tokens "
                        "(0: off); e.g. adaptive+s0+p0")
    parser.add_argument("--requests-per-client", type=int, default=1, metavar="N",
                        help="with --concurrency: at least N requests per client at each "
                        "level, mode and workload (default 1: one wave, each prompt once), "
                        "so a level's throughput is not its slowest request's")
    parser.add_argument("--endpoint", default="",
                        help="with --concurrency: a running coordinator (host:port) instead "
                        "of a stack started for the run")
    parser.add_argument("--out", default="bench-out", help="output directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> object:
    from specdec.bench.configs import LENGTHS, MODES
    from specdec.bench.harness import BenchSettings

    quick = QUICK if args.quick else {}

    def pick(name: str, default: object) -> object:
        value = getattr(args, name)
        return value if value is not None else quick.get(name, default)

    modes = _csv(str(pick("modes", ",".join(MODES))))
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return BenchSettings(
        target_model=args.target_model, draft_model=args.draft_model,
        assistant_model=args.assistant_model, dtype=args.dtype,
        torch_threads=args.torch_threads, linear_kernel=args.linear_kernel,
        attention_kernel=args.attention_kernel, draft_dtype=args.draft_dtype,
        draft_linear_kernel=args.draft_linear_kernel,
        draft_compile=str(pick("draft_compile", COMPILE_AUTO)), fused_step=args.fused_step,
        grpc_torch_threads=args.grpc_torch_threads, modes=modes,
        systems=_csv(args.systems),
        lengths=_csv(str(pick("lengths", ",".join(LENGTHS)))),
        per_category=pick("prompts_per_category", None),  # type: ignore[arg-type]
        sampled_lengths=_csv(args.sampled_lengths) if args.sampled_lengths else None,
        sampled_per_category=args.sampled_prompts_per_category,
        repeats=int(pick("repeats", 2)),  # type: ignore[call-overload]
        max_new_tokens=int(pick("max_new_tokens", 96)),  # type: ignore[call-overload]
        max_length=args.max_adaptive_length,
        calibration_repeats=int(pick("calibration_repeats", 7)),  # type: ignore[call-overload]
        compare_dtypes=_csv(args.compare_dtypes),
        warmup_tokens=int(quick.get("warmup_tokens", 40)),  # type: ignore[call-overload]
        progress=not args.no_progress, workload=args.workload)


def other_draft_systems(data: dict) -> tuple[str, ...]:
    """Systems that ran another draft than the cost curves' (a feature draft's run)."""
    from specdec.bench.configs import HF_ASSISTED, LOCAL_TOKEN_DRAFT

    settings, meta = data["settings"], data["meta"]
    if meta.get("assistant_model", settings["draft_model"]) == settings["draft_model"]:
        return ()
    return (HF_ASSISTED, LOCAL_TOKEN_DRAFT)


def write_outputs(result: BenchResult, out_dir: Path, command: str) -> dict[str, Path]:
    from specdec.bench.markdown import render
    from specdec.bench.plots import write_plots
    from specdec.bench.report import summarise

    out_dir.mkdir(parents=True, exist_ok=True)
    data = result.to_dict()
    summary = summarise(result.records, result.costs,
                        other_draft_systems(data))
    data["summary"] = summary
    data["command"] = command
    paths = {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md"}
    paths["json"].write_text(json.dumps(data, separators=(",", ":")))
    paths["markdown"].write_text(render(data, summary, command))
    for index, path in enumerate(write_plots(summary, out_dir)):
        paths[f"plot{index}"] = path
    return paths


def load_result(path: Path) -> tuple[BenchResult, str]:
    """An earlier run's bench.json (or its directory) as the BenchResult it was written
    from, and the command that ran it."""
    from specdec.bench.configs import RunRecord
    from specdec.bench.costs import CostCurve
    from specdec.bench.harness import BenchResult, BenchSettings

    if path.is_dir():
        path = path / "bench.json"
    data = json.loads(path.read_text())
    settings: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value
                                for key, value in data["settings"].items()}
    return BenchResult(BenchSettings(**settings), CostCurve.from_dict(data["costs"]),
                       [RunRecord(**record) for record in data["records"]],
                       [CostCurve.from_dict(curve) for curve in data["dtype_costs"]],
                       data["meta"]), data.get("command", "specdec bench")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the services like Ctrl-C does


def write_costs(curves: list[object], out_dir: Path, command: str, threads: int) -> Path:
    from specdec.bench.harness import machine_info
    from specdec.bench.markdown import cost_table

    out_dir.mkdir(parents=True, exist_ok=True)
    data = [curve.to_dict() for curve in curves]  # type: ignore[attr-defined]
    machine = machine_info()
    (out_dir / "costs.json").write_text(json.dumps(
        {"command": command, "machine": machine, "costs": data}, indent=1))
    lines = ["# specdec bench --costs-only", "", f"- command: `{command}`",
             f"- machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
             f"{threads or machine['torch_threads']} threads, load average "
             + "/".join(f"{x:.1f}" for x in machine["load_average"]), "",
             *cost_table(data), ""]
    path = out_dir / "costs.md"
    path.write_text("\n".join(lines))
    return path


def run(args: argparse.Namespace) -> int:

    signal.signal(signal.SIGTERM, _interrupt)
    if args.report_from:  # measures nothing, so the measuring flags do not apply
        result, command = load_result(Path(args.report_from))
        paths = write_outputs(result, Path(args.out), command)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    # The services it starts inherit these: traces beside its report (unless told where),
    # metrics on any free ports, so a bench runs beside `specdec up`.
    own = {name: value for name, value in (
        ("SPECDEC_TRACE_DIR", str(Path(args.out).resolve() / "traces")),
        ("SPECDEC_METRICS_PORT", "0")) if not os.environ.get(name)}
    os.environ.update(own)
    try:
        return _measure(args)
    finally:
        for name in own:
            os.environ.pop(name, None)


def _measure(args: argparse.Namespace) -> int:
    from specdec.bench.harness import run_bench, run_costs

    argv = sys.argv[1:]
    command = "specdec " + shlex.join(argv) if argv[:1] == ["bench"] else "specdec bench"
    if args.concurrency:
        return run_load_command(args, command)
    settings = settings_from_args(args)
    if args.costs_only:
        path = write_costs(run_costs(settings), Path(args.out), command,  # type: ignore[arg-type]
                           args.torch_threads)
        print(path.read_text())
        return 0
    result = run_bench(settings)  # type: ignore[arg-type]
    paths = write_outputs(result, Path(args.out), command)
    print((Path(args.out) / "bench.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def run_load_command(args: argparse.Namespace, command: str) -> int:
    """`specdec bench --concurrency ...`: the load test (specdec.bench.load)."""
    if args.requests_per_client < 1:
        raise ValueError(f"--requests-per-client must be at least 1, got "
                         f"{args.requests_per_client}")
    import grpc

    from specdec.bench.harness import machine_info
    from specdec.bench.load import LoadPrompt, LoadSettings, run_load, write_outputs
    from specdec.bench.process_cpu import ProcessCpu
    from specdec.bench.prompts import prompt_encoder, select
    from specdec.bench.workloads import workload_prompts
    from specdec.engine.models import load_tokenizer
    from specdec.proto.specdec.v1 import coordinator_pb2_grpc

    quick = LOAD_QUICK if args.quick else {}
    levels = tuple(int(level) for level in _csv(args.concurrency))
    per_category: int | None = (args.prompts_per_category
                                if args.prompts_per_category is not None
                                else quick.get("prompts_per_category"))  # type: ignore[assignment]
    max_new_tokens = args.max_new_tokens or int(quick.get("max_new_tokens", 64))  # type: ignore[call-overload]
    from specdec.bench.configs import MODES

    sampling = _csv(args.modes) if args.modes else ("greedy",)
    if len(sampling) != 1 or sampling[0] not in MODES:
        raise ValueError(f"with --concurrency, --modes names one sampling mode ({', '.join(MODES)}"
                         f"), got {args.modes!r}")
    mode = MODES[sampling[0]]
    settings = LoadSettings(levels, _csv(args.load_modes), max_new_tokens=max_new_tokens,
                            min_rounds=args.requests_per_client,
                            progress=not args.no_progress, temperature=mode.temperature,
                            top_p=mode.top_p,
                            repeats=args.repeats if args.repeats is not None else 1)
    stack = None
    endpoint = args.endpoint
    if not endpoint:
        from specdec.bench.harness import BenchSettings, ProcessStack

        compile_setting = args.draft_compile or str(quick.get("draft_compile", COMPILE_AUTO))
        stack = ProcessStack(BenchSettings(
            target_model=args.target_model, draft_model=args.draft_model, dtype=args.dtype,
            grpc_torch_threads=args.grpc_torch_threads, linear_kernel=args.linear_kernel,
            attention_kernel=args.attention_kernel, draft_dtype=args.draft_dtype,
            draft_linear_kernel=args.draft_linear_kernel, draft_compile=compile_setting,
            fused_step=args.fused_step))
        print(f"starting the services (logs in {stack.log_dir})", file=sys.stderr)
        endpoint = stack.stack.endpoint("coordinator")
    try:
        if stack is not None:
            stack.wait()
        chosen = select(workload_prompts(args.workload), per_category)
        try:
            encode = prompt_encoder(load_tokenizer(args.target_model))
            prompts = [LoadPrompt(p.id, encode(p), workload=p.workload) for p in chosen]
        except (OSError, ValueError) as error:  # the coordinator applies its own template
            print(f"no local tokenizer for {args.target_model} ({error}); sending the "
                  "prompts as text (a conversation as its transcript in one user turn)",
                  file=sys.stderr)
            prompts = [LoadPrompt(p.id, [], p.transcript, p.workload) for p in chosen]
        cpu = (ProcessCpu({role: process.pid
                           for role, process in stack.stack.processes.items()})
               if stack is not None else None)
        with grpc.insecure_channel(endpoint) as channel:
            report = run_load(coordinator_pb2_grpc.CoordinatorStub(channel), settings, prompts,
                              meta={"machine": machine_info(), "endpoint": endpoint,
                                    "target_model": args.target_model,
                                    "draft_model": args.draft_model, "dtype": args.dtype},
                              cpu=cpu)
    finally:
        if stack is not None:
            stack.close()  # the services flush their traces as they stop
    if stack is not None:
        _add_forward_stats(report)
    paths = write_outputs(report, Path(args.out), command)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _add_forward_stats(report: dict[str, Any]) -> None:
    """The target's forwards per phase (specdec.bench.forwards), from the trace file its
    service wrote, when there is one."""
    from specdec.bench.forwards import with_forward_stats
    from specdec.telemetry.reader import load_spans

    trace_dir = os.environ.get("SPECDEC_TRACE_DIR")
    path = Path(trace_dir) / "target.jsonl" if trace_dir else None
    if path is not None and path.is_file():
        with_forward_stats(report["levels"], load_spans([path]))
