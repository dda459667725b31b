"""What a round costs this deployment, measured: shared by every session of a process.

The wall time of Propose per draft length k, of Verify per k and the rest of a round are
EMAs per k (CostTable), optionally seeded from a calibration (MeasuredCosts). Rounds whose
tokens did not come from the draft model (prompt lookup, the suffix cache) verify exactly
the tokens proposed, where a drafted round asked for k may verify fewer (the confidence
gate ends it early), so their Verify waits have a table of their own. A forward's seconds
against the rows it carried are a fitted line (RowCost): it prices what a row adds to a
forward other sessions share, and a model-free length longer than any measured one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Protocol

from specdec.core.acceptance import SharedCalibrations, SharedChainAcceptances
from specdec.settings import default

DEFAULT_MAX_DRAFT_TOKENS: int = default("max-draft-tokens")


class MeasuredCosts(Protocol):
    """A calibration of forward times (specdec.bench.costs.CostCurve is one)."""

    draft_s: float  # one draft forward

    def t_target(self, k: float) -> float:
        """One target forward over k new tokens."""
        ...


def interpolated(points: Mapping[int, float], k: int) -> float | None:
    """points[k], else linear between the nearest measured lengths on either side of k;
    None where k lies outside them."""
    if k in points:
        return points[k]
    below = [j for j in points if j < k]
    above = [j for j in points if j > k]
    if not below or not above:
        return None
    low, high = max(below), min(above)
    return points[low] + (k - low) / (high - low) * (points[high] - points[low])


class CostTable:
    """EMA seconds per draft length k, with interpolation for lengths not measured yet."""

    def __init__(self, ema: float = 0.2) -> None:
        self.ema = ema
        self.mean: dict[int, float] = {}
        self.count: dict[int, float] = {}

    def observe(self, k: int, seconds: float, weight: float = 1.0) -> None:
        n = self.count.get(k, 0.0)
        old = self.mean.get(k, seconds)
        step = max(self.ema, weight / (n + weight))  # the first samples count fully
        self.mean[k] = old + step * (seconds - old)
        self.count[k] = n + weight

    def estimate(self, k: int, proportional: bool = False) -> float | None:
        if not self.mean:
            return None
        inside = interpolated(self.mean, k)
        if inside is not None:
            return inside
        nearest = max(self.mean) if k > max(self.mean) else min(self.mean)
        if proportional and nearest > 0:  # k forwards of one token each
            return self.mean[nearest] * k / nearest
        return self.mean[nearest]


class RowCost:
    """Seconds of a forward against the rows in it: a discounted least-squares line
    T(R) = fixed + per_row * R over (BatchInfo.rows, forward seconds) observations."""

    def __init__(self, decay: float = 0.995, min_spread: float = 1.0) -> None:
        self.decay = decay
        self.min_spread = min_spread  # rows: the standard deviation a slope needs
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._n = self._n * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds

    def per_row_seconds(self) -> float | None:
        """The line's slope (never negative), or None until rows have varied enough."""
        if self._n < 2.0:
            return None
        mean_x = self._x / self._n
        variance = self._xx / self._n - mean_x * mean_x
        if variance < self.min_spread ** 2:
            return None
        covariance = self._xy / self._n - mean_x * self._y / self._n
        return max(0.0, covariance / variance)


class CostModel:
    """Per-deployment round costs, shared across sessions (thread-safe), and the typical
    acceptance of recent sessions per kind of request, a prior for new sessions."""

    def __init__(self, ema: float = 0.2, acceptance_decay: float = 0.995) -> None:
        self.draft = CostTable(ema)  # Propose wait for k tokens
        self.verify = CostTable(ema)  # Verify wait with k draft tokens (k + 1 new)
        self.overhead = CostTable(ema)  # the rest of a round, under key 0
        self.undrafted = CostTable(ema)  # Verify wait for k model-free tokens, exactly k
        self.rows = RowCost()  # verify forward seconds against the rows it carried
        self.acceptance_decay = acceptance_decay
        self._acceptance: dict[str, list[float]] = {}  # key -> [successes, failures]
        # prompt lookup's per-position acceptance per kind of request (acceptance_key)
        self.lookup_acceptance = SharedChainAcceptances()
        # the suffix cache's calibration of its drafts' scores, per kind of request
        self.suffix_calibration = SharedCalibrations()
        self._lock = threading.Lock()

    def record_acceptance(self, key: str, accepted: int, failed: bool) -> None:
        with self._lock:
            counts = self._acceptance.setdefault(key, [0.0, 0.0])
            counts[0] = counts[0] * self.acceptance_decay + accepted
            counts[1] = counts[1] * self.acceptance_decay + float(failed)

    def acceptance_evidence(self, key: str) -> tuple[float, float]:
        """(recent sessions' per-token acceptance, the discounted trials behind it);
        (0, 0) before any."""
        with self._lock:
            successes, failures = self._acceptance.get(key, (0.0, 0.0))
        total = successes + failures
        return (successes / total if total > 0 else 0.0), total

    @classmethod
    def from_curve(cls, curve: MeasuredCosts, max_length: int = DEFAULT_MAX_DRAFT_TOKENS,
                   weight: float = 0.5) -> CostModel:
        """Seed from a calibration; weight < 1 lets the first real sample replace it."""
        model = cls()
        for k in range(max_length + 1):
            model.verify.observe(k, curve.t_target(k + 1), weight)
            if k:
                model.draft.observe(k, k * curve.draft_s, weight)
        return model

    def samples(self, k: int) -> float:
        with self._lock:
            return self.verify.count.get(k, 0.0)

    def observe(self, k: int, draft_s: float | None, verify_s: float,
                round_s: float | None) -> None:
        with self._lock:
            if draft_s is not None and k > 0:
                self.draft.observe(k, draft_s)
            self.verify.observe(k, verify_s)
            if round_s is not None:
                self.overhead.observe(0, max(0.0, round_s - verify_s - (draft_s or 0.0)))

    def observe_undrafted(self, k: int, verify_s: float, round_s: float | None) -> None:
        """A round that verified k tokens proposed without the draft model."""
        with self._lock:
            self.undrafted.observe(k, verify_s)
            if round_s is not None:
                self.overhead.observe(0, max(0.0, round_s - verify_s))

    def observe_forward(self, rows: int, forward_s: float) -> None:
        with self._lock:
            self.rows.observe(rows, forward_s)

    def per_row_seconds(self) -> float:
        """What one more row adds to a verify forward: the fitted line's slope, else the
        growth of the per-k verify costs (each k verifies one more row), else 0."""
        with self._lock:
            return self._per_row_seconds()

    def _per_row_seconds(self) -> float:
        fitted = self.rows.per_row_seconds()
        if fitted is not None:
            return fitted
        known = sorted(self.verify.mean)
        if len(known) < 2:
            return 0.0
        low, high = known[0], known[-1]
        return max(0.0, (self.verify.mean[high] - self.verify.mean[low]) / (high - low))

    def round_seconds(self, k: int, drafted: bool = True) -> float | None:
        """A round verifying k proposed tokens; drafted=False: proposed without the draft
        model (prompt lookup, the suffix cache), so no Propose wait."""
        with self._lock:
            verify = self.verify.estimate(k) if drafted else self._undrafted_verify(k)
            draft = self.draft.estimate(k, proportional=True) if k and drafted else 0.0
            overhead = self.overhead.estimate(0) or 0.0
        if verify is None or draft is None:
            return None
        return draft + verify + overhead

    def _undrafted_verify(self, k: int) -> float | None:
        """Verify wait for exactly k model-free tokens: measured, else interpolated between
        the nearest measured lengths (model-free ones, else the draft's); past the longest,
        that one grown by the per-row cost of the rows it lacks."""
        points = {**self.verify.mean, **self.undrafted.mean}
        if not points:
            return None
        inside = interpolated(points, k)
        if inside is not None:
            return inside
        longest = max(points)
        if k > longest:
            return points[longest] + self._per_row_seconds() * (k - longest)
        return points[min(points)]
