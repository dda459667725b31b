"""The summary as markdown tables: costs, per configuration, per category, per round."""

from __future__ import annotations

from typing import Any

from specdec.bench.configs import GRPC, GRPC_TARGET_ONLY, HF_ASSISTED, LOCAL, TARGET_ONLY
from specdec.bench.report import ALL, WORKLOAD, is_category


def _f(value: Any, fmt: str = "{:.2f}", missing: str = "-") -> str:
    return missing if value is None else fmt.format(value)


def _load(machine: dict[str, Any]) -> str:
    return "/".join(f"{x:.1f}" for x in machine.get("load_average", [])) or "?"


def _cost(seconds: float | None, over_floor: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ({_f(over_floor, '{:.1f}')}x)"


def cost_table(curves: list[dict[str, Any]]) -> list[str]:
    ks = sorted({int(k) for c in curves for k in c["t_target_s"]})
    head = "| format | T_draft(1) ms | " + " | ".join(f"T_target({k}) ms" for k in ks) + " |"
    lines = [head, "|" + "---|" * (len(ks) + 2)]
    for c in curves:
        over = c.get("t_target_over_floor", {})
        cells = [_cost(c["t_target_s"].get(str(k)), over.get(str(k))) for k in ks]
        draft = _cost(c["t_draft_1_s"], c.get("t_draft_over_floor"))
        lines.append(f"| {c['label']} | {draft} | " + " | ".join(cells) + " |")
    floor = curves[0]
    lines += ["", f"(N x) = multiple of the bandwidth floor: weight bytes / "
              f"{floor['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, this machine's read rate "
              f"(target {floor['target_floor_s'] * 1000:.1f} ms, "
              f"draft {floor['draft_floor_s'] * 1000:.1f} ms in {floor['label']}). "
              f"Context {floor['context']} tokens, medians."]
    return lines


def config_table(mode: dict[str, Any]) -> list[str]:
    lines = ["| configuration | tokens/s (range) | speedup | accept rate | mean acc. len | "
             "k | alpha | bound S | achieved/bound | greedy match |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in mode.items():
        s = entry[ALL]
        low, high = s["tokens_per_s_range"]
        lines.append(
            f"| {name} | {s['tokens_per_s']:.2f} ({low:.2f}-{high:.2f}) | "
            f"{_f(s.get('speedup'), '{:.2f}x')} | {_f(s.get('acceptance_rate'), '{:.1%}')} | "
            f"{_f(s.get('mean_accepted_length'))} | {_f(s.get('mean_draft_length'))} | "
            f"{_f(s.get('alpha'))} | {_f(s.get('bound'), '{:.2f}x')} | "
            f"{_f(s.get('bound_ratio'))} | {_f(s.get('greedy_match'), '{:.0%}')} |")
    lines += ["", "greedy match: output equal to target-only's, token for token, through the "
              "same processes for specdec-grpc (to `specdec-grpc k=0`), else to `target-only` "
              "in this process, whose thread count may break a near-tie otherwise."]
    return lines


def _rate_cell(stats: dict[str, Any], system: str) -> str:
    """A group's tokens/s, and its speedup over target-only for the other systems."""
    cell = f"{_f(stats.get('tokens_per_s'), '{:.2f}')} tok/s"
    if stats.get("speedup") is not None and system != TARGET_ONLY:
        cell += f", {stats['speedup']:.2f}x"
    return cell


def category_table(mode: dict[str, Any]) -> list[str]:
    categories = [c for c in next(iter(mode.values())) if is_category(c)]
    lines = ["| configuration | " + " | ".join(categories) + " |",
             "|---|" + "---|" * len(categories)]
    for name, entry in mode.items():
        cells = []
        for category in categories:
            s = entry.get(category, {})
            cell = _rate_cell(s, entry["system"])
            if s.get("alpha") is not None:
                cell += f", a={s['alpha']:.2f}"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def workload_table(mode: dict[str, Any]) -> list[str]:
    """Each workload's tokens/s and ratios: over target-only in process and, for specdec
    over gRPC, over target-only through the same services."""
    workloads = [key for key in next(iter(mode.values())) if key.startswith(WORKLOAD)]
    if not workloads:
        return []
    lines = ["| configuration | " + " | ".join(w.removeprefix(WORKLOAD) for w in workloads)
             + " |", "|---|" + "---|" * len(workloads)]
    for name, entry in mode.items():
        cells = []
        for workload in workloads:
            s = entry.get(workload, {})
            cell = _rate_cell(s, entry["system"])
            if s.get("speedup_same_shape") is not None:
                cell += f", {s['speedup_same_shape']:.2f}x same shape"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def same_shape_table(mode: dict[str, Any]) -> list[str]:
    """gRPC runs against target-only through the same services (see bench/report.py)."""
    rows = [(name, entry[ALL]) for name, entry in mode.items()
            if entry["system"] == GRPC and "speedup_same_shape" in entry.get(ALL, {})]
    if not rows:
        return []
    lines = [f"Against `{GRPC_TARGET_ONLY}` (target-only through the same three services); "
             "bound from the forward times measured inside the services in these runs.", "",
             "| configuration | speedup (same shape) | bound S (services' costs) | "
             "achieved/bound |", "|---|---|---|---|"]
    for name, s in rows:
        lines.append(f"| {name} | {s['speedup_same_shape']:.2f}x | "
                     f"{_f(s.get('bound_same_shape'), '{:.2f}x')} | "
                     f"{_f(s.get('bound_same_shape_ratio'))} |")
    return lines


def round_table(mode: dict[str, Any]) -> list[str]:
    lines = ["| configuration | rounds | tokens/round | draft model ms | draft wait - model ms | "
             "target model ms | target wait - model ms | other ms | bytes/round | "
             "lookup share (accept rate) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in mode.items():
        s = entry[ALL]
        p = s.get("per_round")
        if not p:
            continue
        lines.append(
            f"| {name} | {s['rounds']} | {s['tokens_per_round']:.2f} | "
            f"{p['draft_model_ms']:.1f} | {p['draft_transport_ms']:.1f} | "
            f"{p['target_model_ms']:.1f} | {p['target_transport_ms']:.1f} | "
            f"{p['other_ms']:.1f} | {p['bytes']:.0f} | "
            f"{_f(s.get('lookup_share'), '{:.0%}')} "
            f"({_f(s.get('lookup_acceptance_rate'), '{:.0%}')}) |")
    return lines


def goals(summary: dict[str, Any]) -> list[str]:
    greedy = summary.get("greedy", {})
    grpc = greedy.get(f"{GRPC} k=adaptive", {}).get(ALL)
    hf = greedy.get(HF_ASSISTED, {}).get(ALL)
    if not grpc:
        return []
    ratio, speedup = grpc.get("bound_ratio"), grpc.get("speedup")
    lines = ["| goal (greedy; specdec over gRPC, adaptive, unless named) | measured | met |",
             "|---|---|---|"]
    same_ratio, same_speedup = grpc.get("bound_same_shape_ratio"), grpc.get("speedup_same_shape")
    if ratio is not None:
        lines.append(f"| >= 0.9 of the bound at its chosen length (in-process costs) | "
                     f"{ratio:.2f} | {'yes' if ratio >= 0.9 else 'no'} |")
    if same_ratio is not None:
        lines.append(f"| >= 0.9 of the bound at its chosen length (the services' own costs) | "
                     f"{same_ratio:.2f} | {'yes' if same_ratio >= 0.9 else 'no'} |")
    if speedup is not None:
        lines.append(f"| >= 1.5x target-only (in-process) | {speedup:.2f}x | "
                     f"{'yes' if speedup >= 1.5 else 'no'} |")
    if same_speedup is not None:
        lines.append(f"| >= 1.5x target-only over the same gRPC services | "
                     f"{same_speedup:.2f}x | {'yes' if same_speedup >= 1.5 else 'no'} |")
    if hf:
        faster = grpc["tokens_per_s"] > hf["tokens_per_s"]
        lines.append(f"| faster than transformers assisted generation | "
                     f"{grpc['tokens_per_s']:.2f} vs {hf['tokens_per_s']:.2f} tok/s | "
                     f"{'yes' if faster else 'no'} |")
    for system in (LOCAL, GRPC):
        lines += adaptive_vs_fixed(greedy, system)
    return lines


def adaptive_vs_fixed(configs: dict[str, Any], system: str) -> list[str]:
    """Adaptive against the best fixed length of the same system, on the whole prompt set.
    'within noise': the ranges over repeats overlap."""
    adaptive = configs.get(f"{system} k=adaptive", {}).get(ALL)
    fixed = {name: entry[ALL] for name, entry in configs.items()
             if name.startswith(f"{system} k=") and name.split("k=")[1].isdigit()
             and int(name.split("k=")[1]) > 0 and ALL in entry}
    if not adaptive or not fixed:
        return []
    best_name = max(fixed, key=lambda name: fixed[name]["tokens_per_s"])
    best = fixed[best_name]
    ratio = adaptive["tokens_per_s"] / best["tokens_per_s"]
    low, high = adaptive["tokens_per_s_range"]
    best_low, best_high = best["tokens_per_s_range"]
    verdict = ("yes" if ratio >= 1.0 else
               "within noise" if high >= best_low and best_high >= low else "no")
    return [f"| {system}: adaptive >= best fixed length ({best_name.split(' ')[-1]}) | "
            f"{adaptive['tokens_per_s']:.2f} vs {best['tokens_per_s']:.2f} tok/s "
            f"({ratio:.2f}x) | {verdict} |"]


def render(result: dict[str, Any], summary: dict[str, Any], command: str = "") -> str:
    settings, meta = result["settings"], result["meta"]
    machine = meta["machine"]
    out = ["# specdec bench", "",
           f"- command: `{command or 'specdec bench'}`",
           f"- machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
           f"({machine['torch_threads']} threads), {machine['date']}; load average "
           f"{_load(meta.get('machine_at_start', machine))} at start, {_load(machine)} at end "
           "(other jobs on the machine inflate every time alike)",
           f"- pair: target `{settings['target_model']}`, draft `{settings['draft_model']}`, "
           f"dtype {settings['dtype']}"
           + (f" (draft: {meta['draft_precision']})" if meta.get("draft_precision") else "")
           + (f"; the gRPC draft service chose {meta['grpc_draft_precision']}"
              if meta.get("grpc_draft_precision") else "")
           + (" (the trained draft was absent: a stand-in, the target's first 2 layers)"
              if meta.get("draft_trained") is False else "")
           + (f"; transformers' assisted generation runs `{meta['assistant_model']}` (it "
              "cannot run a draft that reads the target's hidden states)"
              if meta.get("assistant_model", settings["draft_model"]) != settings["draft_model"]
              else ""),
           f"- {meta['prompts']} prompts"
           + (f" ({', '.join(meta['workloads'])})" if meta.get("workloads") else "")
           + f" x {settings['repeats']} repeats, "
           f"max_new_tokens {settings['max_new_tokens']}, modes {', '.join(settings['modes'])}; "
           f"wall {meta['wall_s'] / 60:.1f} min", "",
           "## Measured costs", "", *cost_table([result["costs"], *result["dtype_costs"]]), ""]
    goal_lines = goals(summary)
    if goal_lines:
        out += ["## Goals", "", *goal_lines, ""]
    for mode, configs in summary.items():
        out += [f"## {mode}", "", *config_table(configs), "", f"### {mode}: per category", "",
                *category_table(configs), ""]
        per_workload = workload_table(configs)
        if per_workload:
            out += [f"### {mode}: per workload", "", *per_workload, ""]
        same_shape = same_shape_table(configs)
        if same_shape:
            out += [f"### {mode}: specdec over gRPC against target-only over gRPC", "",
                    *same_shape, ""]
        out += [f"### {mode}: per round", "",
                *round_table(configs), ""]
    return "\n".join(out)
