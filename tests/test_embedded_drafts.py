"""The embedded drafts are stored in bfloat16 and load in any precision the service picks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specdec.engine import models
from specdec.engine.backends.cpu import load_causal_lm


@pytest.mark.parametrize("name", [models.DEFAULT_DRAFT, models.FEATURE_DRAFT])
def test_embedded_draft_is_stored_in_bfloat16_and_loads_in_float32(name: str) -> None:
    folder = Path(models.resolve(name))
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    with safe_open(str(folder / "model.safetensors"), "pt") as stored:
        stored_tensors = {key: stored.get_tensor(key) for key in stored.keys()}  # noqa: SIM118
    assert {tensor.dtype for tensor in stored_tensors.values()} == {torch.bfloat16}

    loaded = load_causal_lm(name, torch.device("cpu"), torch.float32, progress=False,
                                   linear_kernel="torch", attention_kernel="sdpa")
    parameters = dict(loaded.model.named_parameters())
    assert {p.dtype for p in parameters.values()} == {torch.float32}
    # The float32 weights are the stored bfloat16 values, exactly (tied heads share one).
    for key, tensor in stored_tensors.items():
        assert torch.equal(parameters[key].detach(), tensor.float()), key
    assert loaded.token_map is not None
    with torch.inference_mode():
        ids = torch.tensor([[1, 2, 3]])
        extra = ({"target_hidden": torch.zeros(1, 3, config["specdec_target_hidden_size"])}
                 if "specdec_target_hidden_size" in config else {})
        logits = loaded.model(input_ids=ids, **extra).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
