"""Measured cost curves and the measured-cost bound (docs/design.md, "Choosing the draft length").

T_target(k): one target forward that appends k new tokens to a warm KV cache (the verify
step for a draft of k - 1 tokens), and T_draft(1): one draft forward of one token. Both
are measured through ModelRunner.extend, the call the services make, at a fixed context
length, rolling back to the same position every time, and summarised by the median.

S(gamma) = E[tokens](alpha, gamma) * T_target(1) / (gamma * T_draft(1) + T_target(gamma + 1)),
E[tokens] = (1 - alpha^(gamma + 1)) / (1 - alpha).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.engine.runner import ModelRunner
from specdec.engine.timing import extend_timer, round_robin

# Bytes per second for cost files written before the bench measured the machine's read
# rate (read_bandwidth): the reference machine's, at 2 threads.
DEFAULT_BANDWIDTH = 15e9
# read_bandwidth's buffer: far beyond the usual CPU caches, so it streams from memory as a
# decode step's weights do.
BANDWIDTH_PROBE_BYTES = 256 * 1024 * 1024


@dataclass
class CostCurve:
    """Median seconds per forward; target_s[k] = T_target(k), k new tokens."""

    label: str
    target_s: dict[int, float]
    draft_s: float
    target_iqr: dict[int, tuple[float, float]] = field(default_factory=dict)
    draft_iqr: tuple[float, float] = (0.0, 0.0)
    context: int = 0
    target_weight_bytes: int = 0
    draft_weight_bytes: int = 0
    bandwidth: float = DEFAULT_BANDWIDTH

    def t_target(self, k: float) -> float:
        """T_target at k new tokens, linear between measured points, clamped at the ends."""
        points = sorted(self.target_s)
        if k <= points[0]:
            return self.target_s[points[0]]
        if k >= points[-1]:
            if len(points) < 2:
                return self.target_s[points[-1]]
            a, b = points[-2], points[-1]
            slope = (self.target_s[b] - self.target_s[a]) / (b - a)
            return self.target_s[b] + slope * (k - b)
        low = max(p for p in points if p <= k)
        high = min(p for p in points if p >= k)
        if low == high:
            return self.target_s[low]
        frac = (k - low) / (high - low)
        return self.target_s[low] + frac * (self.target_s[high] - self.target_s[low])

    def floor_s(self, weight_bytes: int) -> float:
        """Reading the weights once at the machine's bandwidth: a forward's lower bound."""
        return weight_bytes / self.bandwidth

    def to_dict(self) -> dict[str, object]:
        target_floor = self.floor_s(self.target_weight_bytes)
        draft_floor = self.floor_s(self.draft_weight_bytes)
        return {
            "label": self.label, "context": self.context,
            "t_target_s": {str(k): v for k, v in sorted(self.target_s.items())},
            "t_target_iqr_s": {str(k): list(v) for k, v in sorted(self.target_iqr.items())},
            "t_draft_1_s": self.draft_s, "t_draft_1_iqr_s": list(self.draft_iqr),
            "target_weight_bytes": self.target_weight_bytes,
            "draft_weight_bytes": self.draft_weight_bytes,
            "bandwidth_bytes_per_s": self.bandwidth,
            "target_floor_s": target_floor, "draft_floor_s": draft_floor,
            "t_target_over_floor": {str(k): v / target_floor if target_floor else None
                                    for k, v in sorted(self.target_s.items())},
            "t_draft_over_floor": self.draft_s / draft_floor if draft_floor else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> CostCurve:
        target = {int(k): float(v) for k, v in data["t_target_s"].items()}  # type: ignore[attr-defined]
        return cls(str(data["label"]), target, float(data["t_draft_1_s"]),  # type: ignore[arg-type]
                   context=int(data.get("context", 0)),  # type: ignore[call-overload]
                   target_weight_bytes=int(data.get("target_weight_bytes", 0)),  # type: ignore[call-overload]
                   draft_weight_bytes=int(data.get("draft_weight_bytes", 0)),  # type: ignore[call-overload]
                   target_iqr={int(k): (float(low), float(high)) for k, (low, high)
                               in data.get("t_target_iqr_s", {}).items()},  # type: ignore[attr-defined]
                   draft_iqr=tuple(data.get("t_draft_1_iqr_s", (0.0, 0.0))),  # type: ignore[arg-type]
                   bandwidth=float(data.get("bandwidth_bytes_per_s",  # type: ignore[arg-type]
                                            DEFAULT_BANDWIDTH)))


def expected_tokens(alpha: float, gamma: float) -> float:
    """Tokens per round for per-token acceptance alpha and gamma drafted tokens."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def bound(curve: CostCurve, alpha: float, gamma: float) -> float:
    """S(gamma): the speedup over target-only that the measured costs allow."""
    denominator = gamma * curve.draft_s + curve.t_target(gamma + 1)
    return expected_tokens(alpha, gamma) * curve.t_target(1) / denominator


def alpha_from_tokens_per_round(tokens_per_round: float, gamma: float) -> float:
    """Invert E[tokens](alpha, gamma): the per-token acceptance that explains a run."""
    if gamma <= 0:
        return 0.0
    if tokens_per_round <= 1.0:
        return 0.0
    if tokens_per_round >= gamma + 1.0:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_tokens(mid, gamma) < tokens_per_round:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a forward must read: parameters and quantised packed weights, tied ones once."""
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    for module in model.modules():  # dynamic int8 Linear keeps its weight in a packed param
        packed = getattr(module, "_packed_params", None)
        if packed is not None and callable(getattr(module, "weight", None)):
            weight = module.weight()  # type: ignore[operator]
            total += weight.numel() * weight.element_size()
    return total


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


@functools.cache
def read_bandwidth(*, threads: int, probe_bytes: int = BANDWIDTH_PROBE_BYTES,
                   repeats: int = 5) -> float:
    """The machine's memory read rate at `threads` torch threads (torch's count, which
    keys the cache: measured once per process), bytes per second: the fastest of
    `repeats` sums over a buffer of probe_bytes (a decode step's floor is its weight
    bytes over this)."""
    buffer = torch.ones(probe_bytes // 4, dtype=torch.float32)
    buffer.sum()  # its pages are touched before the clock starts
    fastest = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        fastest = min(fastest, time.perf_counter() - started)
    return probe_bytes / fastest


def measure_costs(target: ModelRunner, draft: ModelRunner | None, *, label: str,
                  context_len: int = 64, max_k: int = 9, repeats: int = 7,
                  progress: Callable[[], None] | None = None) -> CostCurve:
    """T_target(k) for k = 1..max_k and T_draft(1) at a context of context_len tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(target.vocab.target_vocab_size, 4096)
    context = torch.randint(10, vocab, (context_len,), generator=generator).tolist()
    extra = torch.randint(10, vocab, (max_k,), generator=generator).tolist()
    timers: dict[int, tuple[Callable[[], float], Callable[[], None]]] = {}
    try:
        for k in range(1, max_k + 1):
            timers[k] = extend_timer(target, context, extra[:k])
        # Round-robin over k, so that a slow phase of the machine hits every k alike rather
        # than the one k timed in that block.
        samples = round_robin({k: call for k, (call, _) in timers.items()}, repeats,
                              on_last_round=progress)
    finally:
        for _, release in timers.values():
            release()
    target_s = {k: statistics.median(values) for k, values in samples.items()}
    target_iqr = {k: _quartiles(values) for k, values in samples.items()}
    draft_s, draft_iqr, draft_bytes = math.nan, (math.nan, math.nan), 0
    if draft is not None:
        draft_call, draft_release = extend_timer(draft, context, extra[:1])
        try:
            draft_samples = round_robin({1: draft_call}, max(repeats, 11))[1]
        finally:
            draft_release()
        draft_s, draft_iqr = statistics.median(draft_samples), _quartiles(draft_samples)
        draft_bytes = weight_bytes(draft.model)
        if progress is not None:
            progress()
    return CostCurve(label, target_s, draft_s, target_iqr, draft_iqr, context_len,
                     weight_bytes(target.model), draft_bytes,
                     read_bandwidth(threads=torch.get_num_threads()))
