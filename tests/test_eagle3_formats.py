"""EAGLE-3 drafts in the ecosystem's layouts (specdec.engine.eagle3_formats): both read,
the speculators one written, export -> load bit for bit, and clear errors on the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import assert_speculative_greedy_equals_hf, tiny_eagle3_draft, tiny_llama

from specdec.cli import main
from specdec.engine.eagle3 import EAGLE3_KEY
from specdec.engine.eagle3_formats import (
    SPECFORGE,
    SPECULATORS,
    TargetFacts,
    UnsupportedDraft,
    directory_layout,
    load_eagle3,
    save_speculators,
)
from specdec.engine.models import load_pretrained

VOCAB = 32
FACTS = TargetFacts(hidden_size=32, num_layers=3, vocab_size=VOCAB)
DEFAULT_AUX = (2, 1, 0)  # EAGLE-3's (2, L/2, L-3) for the 3-layer target


def target_model(target_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def write_specforge(model: Any, directory: Path, embeddings: bool = False) -> Path:
    """`model` as the original EAGLE-3 / SpecForge trainers write it: a Llama config with
    LlamaForCausalLMEagle3, midlayer.*, no layer ids; without embeddings it shares the
    target's."""
    directory.mkdir(parents=True)
    config = model.config.to_dict()
    settings = config.pop(EAGLE3_KEY)
    config.update(architectures=["LlamaForCausalLMEagle3"],
                  draft_vocab_size=settings["draft_vocab_size"],
                  target_hidden_size=settings["target_hidden_size"])
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, tensor in model.state_dict().items():
        name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        if name != "embed_tokens.weight" or embeddings:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def assert_same_tensors(left: torch.nn.Module, right: torch.nn.Module) -> None:
    ours, theirs = left.state_dict(), right.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculators_export_then_load_is_bit_for_bit(tmp_path: Path, target_dir: Path,
                                                     dtype: torch.dtype) -> None:
    draft = tiny_eagle3_draft(target_model(target_dir), seed=3, aux_layer_ids=(0, 2, 1),
                              draft_vocab=20, norm_before_residual=True).to(dtype)
    out = save_speculators(draft, tmp_path / "a", "tiny-target", ["LlamaForCausalLM"])
    assert directory_layout(out) == SPECULATORS
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (20, 32)
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 1]
    assert config["norm_before_residual"] is True
    assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] > 0
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].shape == (32, 96)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (32, 64)  # [emb; state]
    assert {"layers.0.hidden_norm.weight", "norm.weight", "lm_head.weight",
            "embed_tokens.weight"} <= tensors.keys()
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["t2d"].shape == (VOCAB,) and int(tensors["t2d"].sum()) == 20
    loaded = load_eagle3(out, target=FACTS)
    assert loaded.eagle3 == draft.eagle3
    assert_same_tensors(loaded, draft)
    again = save_speculators(loaded, tmp_path / "b", "tiny-target", ["LlamaForCausalLM"])
    for name in ("config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (out / name).read_bytes()


def test_a_full_vocabulary_draft_is_written_without_vocabulary_maps(tmp_path: Path,
                                                                    target_dir: Path) -> None:
    draft = tiny_eagle3_draft(target_model(target_dir), seed=4, aux_layer_ids=(0, 1, 2))
    out = save_speculators(draft, tmp_path / "full", "t", [])
    assert not {"d2t", "t2d"} & load_file(str(out / "model.safetensors")).keys()
    assert_same_tensors(load_eagle3(out), draft)


def test_specforge_layout_shares_the_target_embeddings_and_serves_exactly(
        tmp_path: Path, target_dir: Path) -> None:
    target = target_model(target_dir)
    draft = tiny_eagle3_draft(target, seed=5, aux_layer_ids=DEFAULT_AUX, draft_vocab=24)
    directory = write_specforge(draft, tmp_path / "specforge")
    assert directory_layout(directory) == SPECFORGE
    loaded = load_pretrained(str(directory), torch.device("cpu"), torch.float32,
                             progress=False, target_model=str(target_dir)).model
    assert loaded.eagle3.aux_layer_ids == DEFAULT_AUX  # type: ignore[union-attr,operator]
    assert loaded.eagle3.norm_before_residual is False  # type: ignore[union-attr,operator]
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    assert_same_tensors(loaded, draft)
    assert_speculative_greedy_equals_hf(target, target, loaded, lengths=(2, 5))


def test_export_command_writes_what_loads_back(tmp_path: Path, target_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    draft = tiny_eagle3_draft(target_model(target_dir), seed=6, aux_layer_ids=DEFAULT_AUX,
                              draft_vocab=16)
    source = write_specforge(draft, tmp_path / "specforge")
    out = tmp_path / "exported"
    assert main(["export-draft", str(source), "--out", str(out), "--format", "speculators",
                 "--target-model", str(target_dir)]) == 0
    assert "speculators eagle3" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == list(DEFAULT_AUX)
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    from specdec.engine.models import load_eagle3_for

    assert_same_tensors(load_eagle3(out), load_eagle3_for(source, None, str(target_dir)))


def test_export_refuses_a_feature_draft(tmp_path: Path, target_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tiny_models import tiny_feature_draft

    tiny_feature_draft(VOCAB, 32).save_pretrained(tmp_path / "feature")
    assert main(["export-draft", str(tmp_path / "feature"), "--out", str(tmp_path / "x"),
                 "--target-model", str(target_dir)]) == 2
    assert "feature draft, which has no speculators form" in capsys.readouterr().err


def _speculators_dir(tmp_path: Path, target_dir: Path) -> Path:
    draft = tiny_eagle3_draft(target_model(target_dir), seed=7, aux_layer_ids=(0, 1, 2),
                              draft_vocab=20)
    return save_speculators(draft, tmp_path / "d", "t", [])


def _edit(directory: Path, config: dict[str, Any] | None = None,
          tensors: dict[str, torch.Tensor | None] | None = None) -> None:
    if config is not None:
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        stored = load_file(str(directory / "model.safetensors"))
        for name, tensor in tensors.items():
            if tensor is None:
                stored.pop(name)
            else:
                stored[name] = tensor
        save_file(stored, str(directory / "model.safetensors"))


@pytest.mark.parametrize(("config", "tensors", "facts", "message"), [
    ({"speculators_model_type": "mtp"}, None, FACTS, "'mtp' is not served"),
    ({"target_hidden_size": 64}, None, FACTS, "states 64 wide; this target's hidden size is 32"),
    (None, None, TargetFacts(32, 3, 48), "holds 32 tokens; this target's 48"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}, None, FACTS,
     r"aux layer ids \[3\] are not among this target's 3 layers"),
    ({"eagle_aux_hidden_state_layer_ids": None}, None, None,
     "the target's layer count is needed"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 1]}, None, FACTS,
     r"fc.weight is \[32, 96\], expected \[32, 64\] \(2 aux layers"),
    ({"fc_norm": True}, None, FACTS, "fc_norm: true is not served"),
    ({"transformer_layer_config": {"model_type": "qwen3", "hidden_size": 32,
                                   "vocab_size": VOCAB}}, None, FACTS, "'qwen3' decoder layer"),
    (None, {"d2t": torch.zeros(20, dtype=torch.long)}, FACTS, "t2d does not mark exactly"),
    (None, {"d2t": torch.full((20,), 5, dtype=torch.long) - torch.arange(20)}, FACTS,
     "two draft tokens onto one target token"),
    (None, {"d2t": None, "t2d": None}, FACTS, "needs d2t"),
    (None, {"lm_head.weight": None}, FACTS, r"missing \['lm_head.weight'\]"),
    (None, {"embed_tokens.weight": None}, FACTS, "give the target model"),
], ids=["type", "hidden", "vocab", "layer-range", "no-layers", "aux-count", "fc-norm", "qwen3",
        "t2d", "d2t-duplicates", "no-maps", "missing", "no-embeddings"])
def test_clear_errors(tmp_path: Path, target_dir: Path, config: dict[str, Any] | None,
                      tensors: dict[str, torch.Tensor | None] | None,
                      facts: TargetFacts | None, message: str) -> None:
    directory = _speculators_dir(tmp_path, target_dir)
    _edit(directory, config, tensors)
    with pytest.raises(UnsupportedDraft, match=message):
        load_eagle3(directory, target=facts)


def test_the_draft_service_path_names_a_mismatched_target(tmp_path: Path,
                                                          target_dir: Path) -> None:
    directory = _speculators_dir(tmp_path, target_dir)
    other = tmp_path / "wide-target"
    tiny_llama(VOCAB, seed=1, layers=3, hidden=48).save_pretrained(other)
    with pytest.raises(UnsupportedDraft, match="hidden size is 48"):
        load_pretrained(str(directory), torch.device("cpu"), torch.float32, progress=False,
                        target_model=str(other))
