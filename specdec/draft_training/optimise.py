"""The optimiser loop both drafts train with: AdamW, 50 warm-up steps, cosine decay to a
tenth, clipped gradients, a checkpoint every few minutes that the next run resumes from."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

Batch = TypeVar("Batch")
WARMUP_STEPS = 50
RECENT = 50  # steps the reported metrics average over


def learning_rate(peak: float, step: int, total_steps: int) -> float:
    warmup = min(1.0, (step + 1) / WARMUP_STEPS)
    decay = 0.5 * (1 + math.cos(math.pi * step / total_steps))
    return peak * warmup * (0.1 + 0.9 * decay)


def optimise(model: torch.nn.Module, parameters: Sequence[torch.nn.Parameter],
             schedule: Sequence[Batch], total_steps: int, peak_lr: float,
             step_loss: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]],
             checkpoint: Path, *, label: str, metrics: Sequence[str],
             checkpoint_every_s: float = 300.0) -> tuple[int, dict[str, float]]:
    """Run schedule[step] for step up to total_steps, from the checkpoint if there is one.

    step_loss returns the loss to minimise and the named metrics to report. Returns the
    step this run resumed from and the metrics averaged over the last RECENT steps."""
    optimizer = torch.optim.AdamW(parameters, lr=peak_lr, weight_decay=0.0)
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    resumed_from_step = step
    model.train()
    last_save = time.monotonic()
    recent: list[dict[str, float]] = []

    def means() -> dict[str, Any]:  # Any: rich takes the fields as **kwargs
        return {name: sum(r[name] for r in recent) / max(1, len(recent)) for name in metrics}

    shown = " ".join(f"{name} {{task.fields[{name}]:.3f}}" for name in metrics)
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn(shown))
    with Progress(*columns) as bar:
        empty: dict[str, Any] = {name: float("nan") for name in metrics}
        task = bar.add_task("steps", total=total_steps, completed=step, **empty)
        while step < total_steps:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(peak_lr, step, total_steps)
            loss, values = step_loss(schedule[step])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            step += 1
            recent = (recent + [values])[-RECENT:]
            bar.update(task, completed=step, **means())
            if time.monotonic() - last_save > checkpoint_every_s or step == total_steps:
                tmp = checkpoint.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, tmp)
                tmp.rename(checkpoint)
                last_save = time.monotonic()
                reported = " ".join(f"{name} {value:.4f}" for name, value in means().items())
                print(f"step {step}/{total_steps} {reported}", flush=True)
    model.eval()
    return resumed_from_step, means()
