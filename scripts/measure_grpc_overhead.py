"""Per-round cost of the gRPC path versus the in-process loop, and bytes on the wire.

    .venv/bin/python scripts/measure_grpc_overhead.py [--new-tokens 32 --repeats 3]

Default pair: the SmolLM2-135M-Instruct target and the trained draft, or the target's
first 2 layers while the trained draft is absent. The draft and target services run as
`specdec serve` processes (as `specdec up` starts them); the loop runs here with the same
gRPC clients the coordinator uses, so every round is observed. Then the same request goes
end to end through the coordinator.

Model time differs between runs (this is a shared CPU), so the overhead is measured as
the time each round spends outside the model forwards: wait - forward, summed over
Propose and Verify. In-process that is sampling and bookkeeping; over gRPC it adds
serialization, the network stack and the services' request handling. Tracing is off
in the services here (its cost is measured separately). Prints medians.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: the services and this process alternate on the same cores,
# and spinning OpenMP threads of an idle process slow the busy one.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from coordinator.clients import ChannelPool, GrpcDrafter, GrpcVerifier, ProbsRelay  # noqa: E402
from specdec import models  # noqa: E402
from specdec.draft_fallback import default_draft_or_truncated  # noqa: E402
from specdec.local import LocalDrafter, LocalVerifier  # noqa: E402
from specdec.loop import GenerateConfig, RoundEvent, generate  # noqa: E402
from specdec.model_service import model_info  # noqa: E402
from specdec.runner import ModelRunner  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.stack import start_stack  # noqa: E402

PROMPT = "Explain in three sentences why the sky is blue."
MODES = {
    "greedy": SamplingParams(),
    "T=1 (dense q)": SamplingParams(temperature=1.0),
    "T=1 top-k 50 (sparse q)": SamplingParams(temperature=1.0, top_k=50),
}


@dataclass
class Rounds:
    wall_ms: list[float] = field(default_factory=list)
    outside_model_ms: list[float] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)


def run_loop(drafter, verifier, prompt_ids: list[int], params: SamplingParams, k: int,
             new_tokens: int, eos: tuple[int, ...], out: Rounds, seed: int) -> None:
    import time

    config = GenerateConfig(max_new_tokens=new_tokens, num_draft_tokens=k, eos_token_ids=eos,
                            sampling=SamplingParams(params.temperature, params.top_k,
                                                    params.top_p, params.min_p, seed))
    last = [time.perf_counter()]

    def on_round(event: RoundEvent) -> None:
        now = time.perf_counter()
        # Round 0 carries the prompt's prefill: not a steady-state round.
        if event.index > 0 and event.proposal is not None:
            proposal = event.proposal
            out.wall_ms.append((now - last[0]) * 1000)
            out.outside_model_ms.append(1000 * (proposal.elapsed_s - proposal.forward_s
                                                + event.verify_s - event.verify_forward_s))
        last[0] = now

    wire_before = []

    class CountingVerifier:  # collects the bytes of each round's Propose + Verify
        def __init__(self, inner) -> None:
            self.inner = inner

        def verify(self, *args):
            result = self.inner.verify(*args)
            wire_before.append(result.wire_bytes)
            return result

        def release(self, session_id: str) -> None:
            self.inner.release(session_id)

    class CountingDrafter:
        def __init__(self, inner) -> None:
            self.inner = inner

        def propose(self, *args):
            proposal = self.inner.propose(*args)
            wire_before.append(proposal.wire_bytes)
            return proposal

        def release(self, session_id: str) -> None:
            self.inner.release(session_id)

    generate(CountingDrafter(drafter), CountingVerifier(verifier), prompt_ids, config,
             on_round=on_round)
    # Pairs (Propose, Verify) per round, in order.
    out.wire_bytes += [wire_before[i] + wire_before[i + 1]
                       for i in range(0, len(wire_before) - 1, 2)]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads everywhere")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k, n = args.num_draft_tokens, args.new_tokens
    modes = [m.strip() for m in args.modes.split(",")]

    draft_path, trained = default_draft_or_truncated()
    print(f"target: {models.DEFAULT_TARGET}; draft: "
          f"{'trained ' if trained else 'target truncated to 2 layers, '}{draft_path}")
    target = models.load_causal_lm(models.DEFAULT_TARGET, torch.device("cpu"), torch.float32,
                                   progress=False)
    draft = models.load_causal_lm(draft_path, torch.device("cpu"), torch.float32,
                                  progress=False)
    assert target.tokenizer is not None
    prompt_ids = list(target.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True,
        return_dict=True)["input_ids"])
    info = model_info(models.DEFAULT_TARGET)
    vocab = info.vocab_size

    local: dict[str, Rounds] = {m: Rounds() for m in modes}
    remote: dict[str, Rounds] = {m: Rounds() for m in modes}
    drafter_local = LocalDrafter(ModelRunner(draft.model, target_vocab_size=vocab,
                                             token_map=draft.token_map))
    verifier_local = LocalVerifier(ModelRunner(target.model))
    for mode in modes:
        for repeat in range(args.repeats):
            run_loop(drafter_local, verifier_local, prompt_ids, MODES[mode], k, n,
                     info.eos_token_ids, local[mode], seed=repeat)
        print(f"in-process {mode}: {len(local[mode].wall_ms)} rounds", file=sys.stderr)

    log_dir = Path(tempfile.mkdtemp(prefix="specdec-measure-"))
    stack = start_stack(service_args=["--target-model", models.DEFAULT_TARGET,
                                      "--draft-model", draft_path,
                                      "--torch-threads", str(args.threads)],
                        log_dir=log_dir,
                        env={"SPECDEC_METRICS_PORT": "0", "SPECDEC_TRACING": "off"})
    end_to_end: dict[str, list[float]] = {}
    try:
        stack.wait_healthy(300)
        channels = ChannelPool()
        for mode in modes:
            for repeat in range(args.repeats):
                relay = ProbsRelay()
                drafter = GrpcDrafter(channels.get(stack.endpoint("draft")),
                                      stack.endpoint("draft"), vocab_size=vocab,
                                      timeout_s=60, relay=relay)
                verifier = GrpcVerifier(channels.get(stack.endpoint("target")),
                                        stack.endpoint("target"), call_timeout_s=120,
                                        relay=relay)
                run_loop(drafter, verifier, prompt_ids, MODES[mode], k, n, info.eos_token_ids,
                         remote[mode], seed=repeat)
            print(f"gRPC {mode}: {len(remote[mode].wall_ms)} rounds", file=sys.stderr)
        end_to_end = through_coordinator(stack.endpoint("coordinator"), k, n, args.repeats)
        channels.close()
    finally:
        stack.stop()

    print(f"\n{n} new tokens x {args.repeats} runs per mode, {k} draft tokens per round, "
          f"{args.threads} torch threads; medians over steady-state rounds\n")
    header = (f"{'mode':<26}{'round in-proc':>14}{'round gRPC':>12}{'outside model':>15}"
              f"{'':>3}{'overhead':>10}{'':>3}{'bytes/round':>12}")
    print(header)
    print(f"{'':<26}{'ms':>14}{'ms':>12}{'in-proc/gRPC ms':>18}{'ms (%)':>13}{'':>12}")
    for mode in modes:
        a, b = local[mode], remote[mode]
        base = median(a.outside_model_ms)
        over = median(b.outside_model_ms) - base
        pct = 100 * over / median(a.wall_ms)
        print(f"{mode:<26}{median(a.wall_ms):>14.1f}{median(b.wall_ms):>12.1f}"
              f"{base:>9.2f} /{median(b.outside_model_ms):>6.2f}"
              f"{over:>9.2f} ({pct:4.1f}%){median([float(x) for x in b.wire_bytes]):>12,.0f}")
    if end_to_end:
        print("\nend to end through the coordinator (greedy, per generated token, ms): "
              + ", ".join(f"{name} {value:.1f}" for name, value in end_to_end.items()))
    return 0


def through_coordinator(endpoint: str, k: int, n: int, repeats: int) -> dict[str, float]:
    from specdec.commands.generate import build_request, call

    out: dict[str, float] = {}
    for name, draft_tokens in (("speculative", k), ("target-only", 0)):
        per_token = []
        for _ in range(repeats):
            response = call(endpoint, build_request(PROMPT, chat=True, max_new_tokens=n,
                                                    num_draft_tokens=draft_tokens,
                                                    fixed=draft_tokens > 0),
                            stream=False, timeout_s=600)
            per_token.append(1000 * response.stats.total_seconds / len(response.token_ids))
        out[name] = median(per_token)
    return out


if __name__ == "__main__":
    sys.exit(main())
