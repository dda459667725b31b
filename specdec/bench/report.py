"""RunRecords -> per configuration and category statistics (the JSON summary).

tokens/s of a group in one repeat = its new tokens / its wall seconds; the median and
range are over repeats, the quartiles over prompts. For speculative runs:
- acceptance rate = accepted / drafted; mean accepted length = 1 + accepted / drafting
  rounds (vLLM's meanings);
- k = drafted tokens per round and tokens per round (all rounds), alpha = the per-token
  acceptance with E[tokens](alpha, k) = tokens per round;
- bound = tokens per round * T_target(1) / (k * T_draft(1) + T_target(k + 1)) with the
  calibrated costs: S(gamma) of docs/design.md at the acceptance and the
  draft length the run actually had (for adaptive, the mean length it chose);
- ratio = achieved speedup over target-only / bound;
- lookup share = the part of the drafted tokens that prompt lookup proposed, and its own
  acceptance rate;
- chosen lengths (adaptive, in process) = the policy's choice in every round it ran; the
  rounds that verified a prompt-lookup hit instead are in the lookup share.
For specdec over gRPC also, against target-only through the same services (k=0):
- same-shape speedup = tokens/s / that of the gRPC k=0 run;
- same-shape bound = tokens per round * T_target(1) / (draft forward + target forward per
  round), every time measured inside the services during the runs themselves (T_target(1)
  from the k=0 run), so the bound is S(gamma) at the costs the deployment really had, and
  the ratio is what transport, serialisation and coordination leave of it. Per-round means
  include the prefill forward in both runs.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from specdec.bench.configs import GRPC, GRPC_TARGET_ONLY, SPECULATIVE, TARGET_ONLY, RunRecord
from specdec.bench.costs import CostCurve, alpha_from_tokens_per_round

ALL = "all"


def _rate(records: Iterable[RunRecord]) -> float:
    rows = list(records)
    seconds = sum(r.seconds for r in rows)
    return sum(r.new_tokens for r in rows) / seconds if seconds > 0 else 0.0


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]] if values else [0.0, 0.0]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def group_stats(rows: list[RunRecord], curve: CostCurve,
                with_bound: bool = True) -> dict[str, Any]:
    by_repeat: dict[int, list[RunRecord]] = defaultdict(list)
    for row in rows:
        by_repeat[row.repeat].append(row)
    rates = [_rate(group) for _, group in sorted(by_repeat.items())]
    out: dict[str, Any] = {
        "runs": len(rows), "new_tokens": sum(r.new_tokens for r in rows),
        "tokens_per_s": statistics.median(rates), "tokens_per_s_range": [min(rates), max(rates)],
        "tokens_per_s_repeats": rates,
        "prompt_tokens_per_s_iqr": _quartiles([r.tokens_per_s for r in rows]),
    }
    rounds = sum(r.rounds for r in rows)
    if not rounds:
        return out
    drafted = sum(r.draft_tokens for r in rows)
    accepted = sum(r.accepted_tokens for r in rows)
    drafts = sum(r.num_drafts for r in rows)
    tokens_per_round = out["new_tokens"] / rounds
    k = drafted / rounds
    out.update({
        "rounds": rounds, "tokens_per_round": tokens_per_round,
        "mean_draft_length": k if drafted else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "alpha": alpha_from_tokens_per_round(tokens_per_round, k) if drafted else None,
    })
    lookup_drafted = sum(r.lookup_draft_tokens for r in rows)
    if drafted:  # prompt lookup's part of the drafted and of the accepted tokens
        out["lookup_share"] = lookup_drafted / drafted
        out["lookup_acceptance_rate"] = (sum(r.lookup_accepted_tokens for r in rows)
                                         / lookup_drafted if lookup_drafted else None)
    if drafted and with_bound:  # only for runs of the draft whose costs the curve holds
        modelled_s = k * curve.draft_s + curve.t_target(k + 1)
        out["bound"] = tokens_per_round * curve.t_target(1) / modelled_s
    if any(r.verify_s for r in rows):
        per_round = {
            "draft_model_ms": sum(r.draft_forward_s for r in rows),
            "draft_transport_ms": sum(r.draft_s - r.draft_forward_s for r in rows),
            "target_model_ms": sum(r.verify_forward_s for r in rows),
            "target_transport_ms": sum(r.verify_s - r.verify_forward_s for r in rows),
            "other_ms": sum(r.seconds - r.draft_s - r.verify_s for r in rows),
        }
        out["per_round"] = {key: 1000 * value / rounds for key, value in per_round.items()}
        out["per_round"]["bytes"] = sum(r.wire_bytes for r in rows) / rounds
    chosen = Counter(k for r in rows for k in r.chosen)
    if chosen:
        out["chosen_lengths"] = {str(k): n for k, n in sorted(chosen.items())}
    return out


def same_shape_stats(rows: list[RunRecord], base: list[RunRecord]) -> dict[str, float]:
    """Speedup and bound of gRPC runs against target-only over the same services."""
    base_rounds = sum(r.rounds for r in base)
    rounds = sum(r.rounds for r in rows)
    if not base_rounds or not rounds or not _rate(base):
        return {}
    out = {"speedup_same_shape": _rate(rows) / _rate(base)}
    target_1_s = sum(r.verify_forward_s for r in base) / base_rounds
    round_s = sum(r.draft_forward_s + r.verify_forward_s for r in rows) / rounds
    if sum(r.draft_tokens for r in rows) and round_s > 0 and target_1_s > 0:
        tokens_per_round = sum(r.new_tokens for r in rows) / rounds
        out["bound_same_shape"] = tokens_per_round * target_1_s / round_s
        out["bound_same_shape_ratio"] = out["speedup_same_shape"] / out["bound_same_shape"]
    return out


def _greedy_match(rows: list[RunRecord],
                  baseline: dict[tuple[str, int], list[int]]) -> float | None:
    pairs = [(r.token_ids, baseline.get((r.prompt_id, r.repeat))) for r in rows if r.token_ids]
    pairs = [(a, b) for a, b in pairs if b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


WORKLOAD = "workload:"  # the prefix of a workload's group beside the categories


def is_category(key: str) -> bool:
    """Whether an entry's key names a category (not ALL, a workload or the config's facts)."""
    return key not in ("system", "length", ALL) and not key.startswith(WORKLOAD)


def _having(attribute: str, value: str) -> Callable[[RunRecord], bool]:
    return lambda record: bool(getattr(record, attribute) == value)


def _groups(records: list[RunRecord]) -> list[tuple[str, Callable[[RunRecord], bool]]]:
    """ALL, each workload (when the run had more than one), then each category."""
    groups: list[tuple[str, Callable[[RunRecord], bool]]] = [(ALL, lambda record: True)]
    workloads = sorted({r.workload for r in records})
    if len(workloads) > 1:
        groups += [(WORKLOAD + name, _having("workload", name)) for name in workloads]
    groups += [(category, _having("category", category))
               for category in sorted({r.category for r in records})]
    return groups


def summarise(records: list[RunRecord], curve: CostCurve,
              other_draft_systems: tuple[str, ...] = ()) -> dict[str, Any]:
    """{mode: {config: {group: stats}}} plus speedups, bound ratios and greedy match; the
    groups are ALL, "workload:NAME" per workload when there are several, and the categories.

    other_draft_systems run another draft than the one `curve` measured: no bound."""
    grouped: dict[str, dict[str, list[RunRecord]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        grouped[record.mode][record.config].append(record)
    groups = _groups(records)
    summary: dict[str, Any] = {}
    for mode, configs in grouped.items():
        baseline_rows = configs.get(TARGET_ONLY, [])
        grpc_baseline_rows = configs.get(GRPC_TARGET_ONLY, [])
        baseline_tokens = {(r.prompt_id, r.repeat): r.token_ids for r in baseline_rows}
        # Greedy output is the target's own at the services' thread counts: speculative
        # gRPC runs are checked against target-only through the same processes. (oneDNN
        # splits a reduction by thread count, so the in-process target at other thread
        # counts may break a near-tie the other way; `specdec-grpc k=0` against
        # `target-only` shows how often.)
        grpc_tokens = {(r.prompt_id, r.repeat): r.token_ids for r in grpc_baseline_rows}
        mode_out: dict[str, Any] = {}
        for name, rows in configs.items():
            entry: dict[str, Any] = {"system": rows[0].system, "length": rows[0].length}
            for group, member in groups:
                subset = [r for r in rows if member(r)]
                if not subset:
                    continue
                stats = group_stats(subset, curve,
                                    with_bound=rows[0].system not in other_draft_systems)
                base = [r for r in baseline_rows if member(r)]
                if base:
                    base_stats = group_stats(base, curve)
                    stats["speedup"] = stats["tokens_per_s"] / base_stats["tokens_per_s"]
                    if "bound" in stats and rows[0].system in SPECULATIVE:
                        stats["bound_ratio"] = stats["speedup"] / stats["bound"]
                if rows[0].system == GRPC and name != GRPC_TARGET_ONLY:
                    same_base = [r for r in grpc_baseline_rows if member(r)]
                    stats.update(same_shape_stats(subset, same_base))
                reference = (grpc_tokens if rows[0].system == GRPC and grpc_tokens
                             and name != GRPC_TARGET_ONLY else baseline_tokens)
                match = _greedy_match(subset, reference) if mode == "greedy" else None
                if match is not None:
                    stats["greedy_match"] = match
                entry[group] = stats
            mode_out[name] = entry
        summary[mode] = mode_out
    return summary
