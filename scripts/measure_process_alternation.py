"""Is a service's forward slower, or only colder? One run, docs/benchmarks.md section 4o.

Starts the three services (`specdec.stack.start_stack`, as `specdec up` does) and loads
the same draft and target in this process, then alternates two kinds of block:

- warm: rounds of the in-process models back to back (what `specdec-local` in the bench
  does: the draft and the target share this process's threads, round after round);
- cold: a round through the draft and target services, then one in process, in turn
  (every in-process round then follows another process's work, as every service call
  does in a gRPC round).

A round drafts k tokens (k cycles through --lengths; 0 = target only) and verifies them,
greedy, on a random 50-token context grown to 250 tokens. It prints the median draft and
target forward per k for in process warm, in process cold and the services. If in
process cold matches the services and both sit above in process warm, the services'
slower forward comes from running after another process, not from the service.

    python scripts/measure_process_alternation.py --blocks 40   # about 5 min
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from coordinator.clients import GrpcDrafter, GrpcVerifier  # noqa: E402
from specdec.draft_fallback import default_draft_or_truncated  # noqa: E402
from specdec.draft_precision import load_draft  # noqa: E402
from specdec.history import TokenHistory  # noqa: E402
from specdec.interfaces import Drafter, Verifier  # noqa: E402
from specdec.local import LocalDrafter, LocalVerifier  # noqa: E402
from specdec.model_service import load_runner, model_info, serving_runner  # noqa: E402
from specdec.models import DEFAULT_TARGET  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.stack import start_stack  # noqa: E402

GREEDY = SamplingParams()


class Shape:
    """One drafter/verifier pair with its own growing context."""

    def __init__(self, name: str, drafter: Drafter, verifier: Verifier, seed: int) -> None:
        self.name, self.drafter, self.verifier = name, drafter, verifier
        self.rng = random.Random(seed)
        self.session = 0
        self.committed = self.fresh()

    def fresh(self) -> TokenHistory:
        return TokenHistory([self.rng.randrange(100, 40000) for _ in range(50)])

    def round(self, length: int) -> tuple[float, float]:
        """One round of `length` draft tokens: (draft forward ms, target forward ms)."""
        if len(self.committed) > 250:
            session_id = f"{self.name}-{self.session}"
            self.drafter.release(session_id)
            self.verifier.release(session_id)
            self.session += 1
            self.committed = self.fresh()
        session_id = f"{self.name}-{self.session}"
        tokens: list[int] = []
        draft_ms = 0.0
        if length:
            proposal = self.drafter.propose(session_id, self.committed, length, GREEDY)
            tokens, draft_ms = proposal.tokens, proposal.forward_s * 1e3
        verified = self.verifier.verify(session_id, self.committed, tokens, None, GREEDY)
        self.committed.extend(verified.emitted(tokens))
        return draft_ms, verified.forward_s * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=40, help="warm and cold blocks in all")
    parser.add_argument("--lengths", default="0,2,3", help="draft lengths, in turn")
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--draft-dtype", default="float32")
    parser.add_argument("--draft-linear-kernel", default="torch")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/specdec-alternation"))
    args = parser.parse_args()
    lengths = [int(k) for k in args.lengths.split(",")]
    torch.set_num_threads(args.torch_threads)
    draft_path, _ = default_draft_or_truncated()
    # The same precision on both sides, eager: only where the work runs differs.
    precision = ["--draft-dtype", args.draft_dtype, "--draft-linear-kernel",
                 args.draft_linear_kernel, "--draft-compile", "off"]
    stack = start_stack("127.0.0.1", {}, [
        "--target-model", DEFAULT_TARGET, "--draft-model", str(draft_path),
        "--torch-threads", str(args.torch_threads), "--metrics-port", "0", *precision],
        log_dir=args.log_dir, draft_after_target_s=300)
    try:
        stack.wait_healthy(300)
        vocab = model_info(DEFAULT_TARGET).vocab_size
        draft_at, target_at = stack.endpoint("draft"), stack.endpoint("target")
        services = Shape(
            "services",
            GrpcDrafter(grpc.insecure_channel(draft_at), draft_at, vocab_size=vocab,
                        timeout_s=60),
            GrpcVerifier(grpc.insecure_channel(target_at), target_at, call_timeout_s=60), 1)
        cpu = torch.device("cpu")
        target = load_runner(DEFAULT_TARGET, device=cpu, dtype=torch.bfloat16)
        draft = load_draft(str(draft_path), cpu, args.draft_dtype, args.draft_linear_kernel,
                           shared_dtype=torch.bfloat16, attention_kernel="auto",
                           target_vocab_size=vocab)
        local = Shape("local", LocalDrafter(serving_runner(draft.loaded, target_vocab_size=vocab)),
                      LocalVerifier(target), 2)
        times: dict[tuple[str, str, int], list[float]] = {}

        def record(label: str, length: int, measured: tuple[float, float], keep: bool) -> None:
            if keep:
                for part, ms in zip(("draft", "target"), measured, strict=True):
                    if part == "target" or length:
                        times.setdefault((label, part, length), []).append(ms)

        for block in range(args.blocks):
            keep = block >= 2  # the first warm and cold blocks warm up
            if block % 2 == 0:
                for i in range(2 * len(lengths) + 1):
                    length = lengths[i % len(lengths)]
                    record("in process, warm", length, local.round(length), keep and i > 0)
            else:
                for i in range(2 * len(lengths)):
                    length = lengths[i % len(lengths)]
                    record("services", length, services.round(length), keep)
                    record("in process, cold", length, local.round(length), keep)
        labels = ("in process, warm", "in process, cold", "services")
        print(f"median forward ms, {args.blocks} blocks "
              f"({len(times[(labels[0], 'target', lengths[0])])} rounds per cell)")
        print(f"{'':<14}" + "".join(f"{label:>18}" for label in labels))
        for part in ("draft", "target"):
            for length in lengths:
                cells = [times.get((label, part, length)) for label in labels]
                if all(cells):
                    print(f"{part} k={length:<7}" + "".join(
                        f"{statistics.median(cell):18.2f}" for cell in cells if cell))
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
