"""PNG plots: speedup against draft length per category, and the per-round time split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.bench.configs import HF_ASSISTED, SPECULATIVE
from specdec.bench.report import ALL, is_category

SEGMENTS = (("draft_model_ms", "draft model"), ("draft_transport_ms", "draft wait - model"),
            ("target_model_ms", "target model"), ("target_transport_ms", "target wait - model"),
            ("other_ms", "other (loop, client)"))


def _fixed_points(configs: dict[str, Any], system: str, category: str
                  ) -> tuple[list[int], list[float]]:
    points = sorted((int(e["length"]), e[category]["speedup"]) for e in configs.values()
                    if e["system"] == system and e["length"].isdigit()
                    and category in e and "speedup" in e[category])
    return [p[0] for p in points], [p[1] for p in points]


def speedup_plot(mode: str, configs: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = [c for c in next(iter(configs.values())) if c == ALL or is_category(c)]
    systems = [s for s in SPECULATIVE if any(e["system"] == s for e in configs.values())]
    fig, axes = plt.subplots(1, len(systems), figsize=(6 * len(systems), 4.2), squeeze=False)
    for ax, system in zip(axes[0], systems, strict=True):
        for index, category in enumerate(categories):
            color = f"C{index}"
            xs, ys = _fixed_points(configs, system, category)
            width = 2.5 if category == ALL else 1.2
            ax.plot(xs, ys, marker="o", color=color, linewidth=width, label=category)
            adaptive = configs.get(f"{system} k=adaptive", {}).get(category, {})
            if "speedup" in adaptive:
                ax.scatter([adaptive["mean_draft_length"]], [adaptive["speedup"]], marker="*",
                           s=160, color=color, edgecolor="black", zorder=5)
            hf = configs.get(HF_ASSISTED, {}).get(category, {})
            if category == ALL and "speedup" in hf:
                ax.axhline(hf["speedup"], color="gray", linestyle="--",
                           label="transformers assisted (all)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{system}, {mode} (star: adaptive at its mean k)")
        ax.set_xlabel("draft length k")
        ax.set_ylabel("speedup over target-only")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def breakdown_plot(mode: str, configs: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, e in configs.items() if e[ALL].get("per_round")]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(names) + 2), 4.5))
    bottoms = [0.0] * len(names)
    for index, (key, label) in enumerate(SEGMENTS):
        values = [configs[n][ALL]["per_round"][key] for n in names]
        ax.bar(range(len(names)), values, bottom=bottoms, color=f"C{index}", label=label)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_xticks(range(len(names)), [n.replace("specdec-", "") for n in names], rotation=60,
                  ha="right", fontsize=8)
    ax.set_ylabel("ms per round")
    ax.set_title(f"time per round, {mode}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for mode, configs in summary.items():
        if any(e["system"] in SPECULATIVE for e in configs.values()):
            paths.append(speedup_plot(mode, configs, out_dir / f"speedup-{mode}.png"))
        if any(e[ALL].get("per_round") for e in configs.values()):
            paths.append(breakdown_plot(mode, configs, out_dir / f"breakdown-{mode}.png"))
    return paths
