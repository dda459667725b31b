"""Measure what observability costs the speculative loop: tracing on vs off.

Runs the in-process loop (LocalDrafter/LocalVerifier, no network) in three modes,
interleaved so background load hits all of them alike, and reports medians:
  off      no observer at all
  metrics  Prometheus recording only (tracing off)
  tracing  request + round spans to the OTLP/JSON-lines file (batched) + metrics,
           i.e. what the coordinator does per request
The gRPC interceptors' cost (client + server span per call) is not in this number; the
end-to-end test's services measure it (see docs/observability.md).

    .venv/bin/python scripts/measure_tracing_overhead.py                  # tiny models
    .venv/bin/python scripts/measure_tracing_overhead.py --real --repeats 5  # SmolLM2-135M
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.local import LocalDrafter, LocalVerifier  # noqa: E402
from specdec.loop import GenerateConfig, GenerationResult, generate  # noqa: E402
from specdec.runner import ModelRunner  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.telemetry.service import Telemetry  # noqa: E402
from specdec.telemetry.tracing import build_tracer_provider  # noqa: E402

MODES = ("off", "metrics", "tracing")


def tiny_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    from tests.tiny_models import tiny_llama

    return tiny_llama(vocab_size=64, seed=1, layers=1), tiny_llama(vocab_size=64, seed=2)


def real_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """SmolLM2-135M as target; its first 2 layers as the draft (same vocabulary)."""
    from specdec.models import DEFAULT_TARGET, load_causal_lm

    target = load_causal_lm(DEFAULT_TARGET, torch.device("cpu"), torch.float32).model
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:2]
    draft.config.num_hidden_layers = 2
    return draft, target


def run_once(mode: str, telemetry: dict[str, Telemetry], drafter: LocalDrafter,
             verifier: LocalVerifier, prompt: list[int],
             config: GenerateConfig) -> tuple[float, float, GenerationResult]:
    """(wall s, process CPU s, result). CPU time counts the exporter thread too and is
    less disturbed than wall time by other processes on a shared machine."""
    started, cpu_started = time.perf_counter(), time.process_time()
    if mode == "off":
        result = generate(drafter, verifier, prompt, config)
    else:
        with telemetry[mode].request("bench", len(prompt), config) as observed:
            result = generate(observed.drafter(drafter), observed.verifier(verifier), prompt,
                              config, on_round=observed.on_round)
            observed.finish(result)
    return time.perf_counter() - started, time.process_time() - cpu_started, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M instead of tiny models")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    draft_model, target_model = real_pair() if args.real else tiny_pair()
    drafter = LocalDrafter(ModelRunner(draft_model))
    verifier = LocalVerifier(ModelRunner(target_model))
    prompt = [1, 17, 33, 5, 9, 12, 40, 3]
    config = GenerateConfig(max_new_tokens=args.max_new_tokens,
                            num_draft_tokens=args.num_draft_tokens,
                            sampling=SamplingParams(temperature=0.8, seed=1234))
    trace_dir = Path(tempfile.mkdtemp(prefix="specdec-overhead-"))
    telemetry = {
        "metrics": Telemetry("coordinator"),
        "tracing": Telemetry("coordinator", build_tracer_provider(
            "coordinator", trace_file=trace_dir / "coordinator.jsonl")),
    }
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    rounds = 0
    tokens: list[int] | None = None
    for mode in MODES:  # warm-up: first forwards allocate
        run_once(mode, telemetry, drafter, verifier, prompt, config)
    order = list(MODES)
    for _ in range(args.repeats):
        random.shuffle(order)
        for mode in order:
            elapsed, cpu_s, result = run_once(mode, telemetry, drafter, verifier, prompt,
                                              config)
            times[mode].append(elapsed)
            cpu[mode].append(cpu_s)
            rounds = result.stats.rounds
            tokens = tokens or result.token_ids
            assert result.token_ids == tokens, "observability changed the output"
    telemetry["tracing"].shutdown()
    base = statistics.median(times["off"])
    cpu_base = statistics.median(cpu["off"])
    report = {"models": "smollm2-135m (+2-layer slice draft)" if args.real else "tiny",
              "repeats": args.repeats, "rounds_per_request": rounds,
              "new_tokens": len(tokens or []), "trace_file": str(trace_dir)}
    for mode in MODES:
        median = statistics.median(times[mode])
        report[mode] = {"median_ms": round(median * 1e3, 3),
                        "overhead_ms": round((median - base) * 1e3, 3),
                        "overhead_pct": round((median - base) / base * 100, 2),
                        "overhead_us_per_round": round((median - base) / rounds * 1e6, 1)}
        cpu_median = statistics.median(cpu[mode])
        report[mode]["cpu_median_ms"] = round(cpu_median * 1e3, 3)
        report[mode]["cpu_overhead_us_per_round"] = round(
            (cpu_median - cpu_base) / rounds * 1e6, 1)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['models']}: {rounds} rounds, {report['new_tokens']} tokens per request, "
              f"{args.repeats} repeats (medians)")
        for mode in MODES:
            r = report[mode]
            print(f"  {mode:8s} {r['median_ms']:9.2f} ms/request   overhead "
                  f"{r['overhead_ms']:+7.2f} ms ({r['overhead_pct']:+.1f}%), "
                  f"{r['overhead_us_per_round']:+.0f} us/round wall, "
                  f"{r['cpu_overhead_us_per_round']:+.0f} us/round CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
