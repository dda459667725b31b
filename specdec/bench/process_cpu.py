"""The CPU time each service process used in each phase of a load test.

A coordinator's work per round (the loop, prompt lookup and the suffix cache, the calls to
draft and target, tracing, the stream to the client) sets how many rounds per second one
coordinator process drives, and so how many coordinator replicas a deployment needs beside
its target. `specdec bench --concurrency` reports, per phase, the coordinator's CPU
milliseconds per round and the CPU cores each service kept busy (CPU seconds over the
phase's wall seconds), from the processes' own counters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psutil

CPU_COLUMNS = (("coordinator_ms_per_round", "coordinator CPU ms/round"),
               ("coordinator_cores", "coordinator cores"), ("draft_cores", "draft cores"),
               ("target_cores", "target cores"))


class ProcessCpu:
    """User plus system CPU seconds of each role's process, as sampled."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self._processes = {role: psutil.Process(pid) for role, pid in pids.items()}

    def sample(self) -> dict[str, float]:
        """Each live process's CPU seconds so far (a process that has gone is left out)."""
        seconds: dict[str, float] = {}
        for role, process in self._processes.items():
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            seconds[role] = times.user + times.system
        return seconds


def used_between(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds each role used between two samples."""
    return {role: after[role] - before[role] for role in after if role in before}


def cpu_row(used_s: Mapping[str, float], wall_s: float, rounds: int) -> dict[str, Any]:
    """A phase's report columns: each role's cores busy, and the coordinator's CPU
    milliseconds per round of the phase's completed requests."""
    row: dict[str, Any] = {}
    for role, seconds in used_s.items():
        if wall_s > 0:
            row[f"{role}_cores"] = round(seconds / wall_s, 3)
    if "coordinator" in used_s and rounds > 0:
        row["coordinator_ms_per_round"] = round(1000.0 * used_s["coordinator"] / rounds, 3)
    return row
