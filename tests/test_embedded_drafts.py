"""The embedded drafts are stored in bfloat16 and load in any precision the service picks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specdec.engine import models
from specdec.engine.backends.cpu import load_causal_lm
from specdec.engine.int8 import Int8Linear
from specdec.engine.kernels import int8_runs


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


@pytest.mark.parametrize("name", [models.DEFAULT_DRAFT, models.FEATURE_DRAFT])
def test_a_reduced_vocabulary_draft_computes_only_the_rows_it_proposes(name: str) -> None:
    """The UNK input row is never proposed (the runner drops its logit), so the loaded
    head has the map's rows: its logits are the stored head's on those rows, and in int8
    the head takes the int8 operator (the map's 8,192 rows fit its blocks; 8,193 did not)."""
    loaded = load_causal_lm(name, torch.device("cpu"), torch.float32, progress=False,
                            linear_kernel="torch", attention_kernel="sdpa")
    assert loaded.token_map is not None
    rows = loaded.token_map.shape[0]
    model = loaded.model
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.out_features == rows and embedding.num_embeddings == rows + 1
    # the stored head is the embedding (tied): the cut head is its first rows, shared
    assert torch.equal(head.weight, embedding.weight[:rows])
    assert head.weight.data_ptr() == embedding.weight.data_ptr()
    config = json.loads((Path(models.resolve(name)) / "config.json").read_text())
    ids = torch.tensor([[1, 2, 3, rows]])  # the last one is the UNK input row
    extra = ({"target_hidden": torch.randn(1, 4, config["specdec_target_hidden_size"])}
             if "specdec_target_hidden_size" in config else {})
    with torch.inference_mode():
        logits = model(input_ids=ids, **extra).logits
        # the stored head over the last hidden state (the feature draft's forward
        # takes the target's states, so it is checked by shape only)
        stored_head = None if extra else torch.nn.functional.linear(
            model.model(input_ids=ids).last_hidden_state, embedding.weight)
    assert logits.shape[-1] == rows
    if stored_head is not None:
        torch.testing.assert_close(logits, stored_head[..., :rows])

    if int8_runs(torch.device("cpu"), torch.bfloat16):
        quantized = load_causal_lm(name, torch.device("cpu"), torch.bfloat16, progress=False,
                                   linear_kernel="int8", attention_kernel="rowwise")
        assert isinstance(quantized.model.get_output_embeddings(), Int8Linear)
