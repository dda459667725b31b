"""The drafts' shared optimiser loop: schedule, progress metrics, checkpoint and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.draft_training.optimise import learning_rate, optimise


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    assert learning_rate(1.0, 0, 1000) == pytest.approx(1 / 50, rel=1e-3)
    assert learning_rate(1.0, 49, 1000) == pytest.approx(1.0, rel=1e-2)
    assert learning_rate(1.0, 500, 1000) == pytest.approx(0.55, rel=1e-3)
    assert learning_rate(1.0, 1000, 1000) == pytest.approx(0.1)


def test_optimise_fits_checkpoints_and_resumes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    inputs = torch.randn(64, 4)
    targets = inputs @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    schedule = [(inputs[i:i + 8], targets[i:i + 8]) for i in range(0, 64, 8)] * 40
    seen: list[int] = []

    def step_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        seen.append(1)
        loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        return loss, {"mse": float(loss.detach())}

    checkpoint = tmp_path / "checkpoint.pt"
    resumed, final = optimise(model, list(model.parameters()), schedule, 300, 0.05, step_loss,
                              checkpoint, label="t", metrics=("mse",))
    assert resumed == 0 and len(seen) == 300 and final["mse"] < 0.05
    assert torch.load(checkpoint)["step"] == 300
    fitted = model.weight.detach().clone()
    resumed, _ = optimise(model, list(model.parameters()), schedule, 300, 0.05, step_loss,
                          checkpoint, label="t", metrics=("mse",))
    assert resumed == 300 and len(seen) == 300  # nothing left to run
    assert torch.equal(model.weight, fitted)
