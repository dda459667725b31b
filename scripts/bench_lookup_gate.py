"""`specdec bench` with one extra in-process configuration: adaptive without the lookup gate.

The gate (specdec.loop._lookup_to_use) prices a prompt-lookup hit against the draft's
round only for policies that can price rounds (specdec.policy.CostedPolicy). Here the
length "adaptive@0.4" (the default confidence gate, written out) runs the same
AdaptiveLength behind a wrapper without those methods, so the loop verifies every hit in
full, as before the gate; "adaptive" is the gated default. In-process systems only (the
services always gate adaptive requests). docs/benchmarks.md section 4g quotes the results;
the run's output directory was not committed:

    .venv/bin/python scripts/bench_lookup_gate.py --out /tmp/bench-lookup-gate \
        --systems target-only,specdec-local --lengths adaptive+p0,adaptive@0.4,adaptive \
        --modes greedy --prompts-per-category 3 --repeats 2 --max-new-tokens 64
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specdec.bench.systems as systems  # noqa: E402
from specdec.adaptive import CostModel  # noqa: E402
from specdec.bench.configs import BenchConfig  # noqa: E402
from specdec.cli import main  # noqa: E402
from specdec.interfaces import Proposal, Verification  # noqa: E402
from specdec.policy import LengthPolicy  # noqa: E402

UNGATED_MARKER = 0.4  # "adaptive@0.4": the default gate, so only the lookup gate differs


class WithoutPrices:
    """A LengthPolicy that hides the inner policy's prices from the loop."""

    def __init__(self, inner: LengthPolicy) -> None:
        self.inner = inner
        self.chosen: list[int] = getattr(inner, "chosen", [])

    def next_length(self) -> int:
        return self.inner.next_length()

    def observe(self, asked: int, accepted_len: int, proposal: Proposal | None,
                verification: Verification) -> None:
        self.inner.observe(asked, accepted_len, proposal, verification)


_served_policy = systems.local_policy


def local_policy(config: BenchConfig, costs: CostModel, greedy: bool,
                 max_length: int) -> LengthPolicy:
    policy = _served_policy(config, costs, greedy, max_length)
    return WithoutPrices(policy) if config.gate == UNGATED_MARKER else policy


if __name__ == "__main__":
    systems.local_policy = local_policy
    sys.exit(main(["bench", *sys.argv[1:]]))
