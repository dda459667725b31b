"""EAGLE-3 drafts in the layouts the ecosystem uses: read both, write the speculators one.

speculators layout (vLLM serves it; speculators' Eagle3SpeculatorConfig): config.json has
`speculators_model_type: "eagle3"`, the decoder layer's config in
`transformer_layer_config` (its vocab_size is the target's), `draft_vocab_size`,
`target_hidden_size` (null: the layer's hidden size), `eagle_aux_hidden_state_layer_ids`
(null: EAGLE-3's default for the target), `norm_before_residual` (vLLM takes true where
it is missing), `norm_output`, and `speculators_config` (verifier, proposal methods).
Tensors: `fc.weight`, `layers.<i>.*`, `norm.weight`, `lm_head.weight`, optional
`embed_tokens.weight` (absent: the target's embeddings), and `d2t` (int64 offsets, target
id = draft id + d2t) with `t2d` (bool over the target vocabulary), both absent when the
draft vocabulary is the target's.

Original EAGLE-3 / SpecForge layout: a Llama config with `architectures:
["LlamaForCausalLMEagle3"]`, `draft_vocab_size` and optionally `target_hidden_size`; the
decoder layer's tensors under `midlayer.*` instead of `layers.0.*`, the rest as above;
`norm_before_residual` false unless set; no layer ids (EAGLE-3's default for the target).

Both put the first layer's extra norm at `hidden_norm` and read the layers' inputs
(vLLM's aux hidden state of layer i is the residual stream entering layer i).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specdec.engine.eagle3 import (
    EAGLE3_KEY,
    Eagle3DraftForCausalLM,
    Eagle3Settings,
    default_aux_layer_ids,
    eagle3_config,
)

SPECULATORS = "speculators"
SPECFORGE = "eagle3"  # the original EAGLE-3 layout, as SpecForge also writes it
LAYOUTS = (SPECULATORS, SPECFORGE)
SPECFORGE_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# A specdec-only key: how the target's states travel (HiddenSpec.wire_dtype), written
# only where it is not the default.
WIRE_DTYPE_KEY = "specdec_hidden_states_dtype"
# Tensors the ecosystem's checkpoints may carry that serving does not read.
_IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")


class UnsupportedDraft(ValueError):
    """A draft directory specdec recognises as EAGLE-3 but cannot serve as it is."""


@dataclass(frozen=True)
class TargetFacts:
    """What an EAGLE-3 draft must agree with in the target it drafts for."""

    hidden_size: int
    num_layers: int
    vocab_size: int


def target_facts(config: Any) -> TargetFacts:
    """From a transformers config (a multimodal one's text_config)."""
    config = getattr(config, "text_config", None) or config
    return TargetFacts(int(config.hidden_size), int(config.num_hidden_layers),
                       int(config.vocab_size))


def layout_of(config: dict[str, Any]) -> str | None:
    """SPECULATORS or SPECFORGE for an EAGLE-3 draft's config.json, None for any other
    model; UnsupportedDraft for a speculator specdec does not serve."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise UnsupportedDraft(f"speculators_model_type {kind!r} is not served; specdec "
                                   "serves speculators drafts of type 'eagle3'")
        return SPECULATORS
    architectures = config.get("architectures") or []
    if SPECFORGE_ARCHITECTURE in architectures:
        return SPECFORGE
    if any(str(name).endswith("Eagle3") for name in architectures):
        raise UnsupportedDraft(f"architecture {architectures} is not served; specdec serves "
                               f"{SPECFORGE_ARCHITECTURE} and speculators' eagle3 layout")
    return None


def directory_layout(directory: Path) -> str | None:
    config_path = directory / "config.json"
    if not config_path.is_file():
        return None
    return layout_of(json.loads(config_path.read_text()))


def _settings(config: dict[str, Any], layout: str, target: TargetFacts | None
              ) -> tuple[dict[str, Any], Eagle3Settings]:
    """The decoder layer's config and the EAGLE-3 settings, checked."""
    if layout == SPECULATORS:
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise UnsupportedDraft("a speculators eagle3 config needs "
                                   "transformer_layer_config (a dict)")
        norm_before_residual = bool(config.get("norm_before_residual", True))
    else:
        layer = config
        norm_before_residual = bool(config.get("norm_before_residual", False))
    for flag in ("norm_before_fc", "fc_norm"):
        if config.get(flag) or layer.get(flag):
            raise UnsupportedDraft(f"{flag}: true is not served (no norm before fc)")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise UnsupportedDraft(f"a {model_type!r} decoder layer is not served; specdec "
                               "serves EAGLE-3 drafts with a Llama decoder layer")
    hidden = int(layer["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or hidden)
    layer_ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not layer_ids:
        if target is None:
            raise UnsupportedDraft("the draft names no eagle_aux_hidden_state_layer_ids, "
                                   "so the target's layer count is needed to take EAGLE-3's "
                                   "default (give the target model)")
        layer_ids = default_aux_layer_ids(target.num_layers)
    vocab = int(layer["vocab_size"])
    settings = Eagle3Settings(
        draft_vocab_size=int(config.get("draft_vocab_size") or vocab),
        target_hidden_size=target_hidden, aux_layer_ids=tuple(int(i) for i in layer_ids),
        norm_before_residual=norm_before_residual,
        norm_output=bool(config.get("norm_output", False)),
        wire_dtype=str(config.get(WIRE_DTYPE_KEY, "bfloat16")))
    if target is not None:
        _check_target(settings, vocab, target)
    return layer, settings


def _check_target(settings: Eagle3Settings, vocab: int, target: TargetFacts) -> None:
    if settings.target_hidden_size != target.hidden_size:
        raise UnsupportedDraft(f"the draft reads target states {settings.target_hidden_size} "
                               f"wide; this target's hidden size is {target.hidden_size}")
    if vocab != target.vocab_size:
        raise UnsupportedDraft(f"the draft's target vocabulary holds {vocab} tokens; this "
                               f"target's {target.vocab_size}")
    bad = [i for i in settings.aux_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise UnsupportedDraft(f"aux layer ids {bad} are not among this target's "
                               f"{target.num_layers} layers")


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for path in files:
            tensors.update(load_file(str(path)))
        return tensors
    binaries = sorted(directory.glob("pytorch_model*.bin"))
    if binaries:
        tensors = {}
        for path in binaries:
            tensors.update(torch.load(path, map_location="cpu", weights_only=True))
        return tensors
    raise UnsupportedDraft(f"{directory} holds no *.safetensors or pytorch_model*.bin")


def _module_name(name: str) -> str:
    """A checkpoint tensor's name in Eagle3DraftForCausalLM."""
    if name.startswith("midlayer."):
        name = "layers.0." + name.removeprefix("midlayer.")
    if name.startswith(("layers.", "embed_tokens.", "norm.")):
        return "model." + name
    return name


def target_embeddings(target_source: Path | str) -> torch.Tensor:
    """The target's input embeddings (model.embed_tokens.weight), read from its files."""
    path = Path(target_source)
    for file in sorted(path.glob("*.safetensors")):
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.endswith("embed_tokens.weight"):
                    return handle.get_tensor(name)
    raise UnsupportedDraft(f"the draft has no embed_tokens.weight and the target's "
                           f"embeddings are not in {path}'s safetensors files")


def load_eagle3(directory: Path, dtype: torch.dtype | None = None,
                target: TargetFacts | None = None,
                target_source: Path | str | None = None) -> Eagle3DraftForCausalLM:
    """An EAGLE-3 draft from either layout. dtype: of its float tensors (None: as
    stored). target/target_source: the target it drafts for, to check the draft against
    and to take embeddings from where the draft has none."""
    config = json.loads((directory / "config.json").read_text())
    layout = layout_of(config)
    if layout is None:
        raise UnsupportedDraft(f"{directory} is not an EAGLE-3 draft (no "
                               f"speculators_model_type and no {SPECFORGE_ARCHITECTURE})")
    layer, settings = _settings(config, layout, target)
    tensors = {_module_name(name): tensor for name, tensor in _read_tensors(directory).items()
               if name not in _IGNORED}
    if "model.embed_tokens.weight" not in tensors:
        if target_source is None:
            raise UnsupportedDraft("the draft has no embed_tokens.weight (it shares the "
                                   "target's): give the target model")
        tensors["model.embed_tokens.weight"] = target_embeddings(target_source)
    stored = tensors["fc.weight"].dtype if "fc.weight" in tensors else torch.float32
    model = Eagle3DraftForCausalLM(eagle3_config(layer, settings))
    expected = model.state_dict()
    vocab = int(layer["vocab_size"])
    if "d2t" not in tensors:
        if settings.draft_vocab_size != vocab:
            raise UnsupportedDraft(f"a draft vocabulary of {settings.draft_vocab_size} of "
                                   f"{vocab} tokens needs d2t (draft -> target offsets)")
        tensors["d2t"] = torch.zeros(vocab, dtype=torch.long)
    if "t2d" not in tensors:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(settings.draft_vocab_size) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise UnsupportedDraft(f"{directory} ({layout} layout) does not hold the EAGLE-3 "
                               f"tensors: missing {missing[:6]}, unexpected {unexpected[:6]}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UnsupportedDraft(
                f"{name} is {list(tensor.shape)}, expected {list(expected[name].shape)} "
                f"({len(settings.aux_layer_ids)} aux layers of {settings.target_hidden_size}"
                f", draft vocabulary {settings.draft_vocab_size})")
    tensors["d2t"] = tensors["d2t"].long()
    tensors["t2d"] = tensors["t2d"].bool()
    _check_vocab_maps(tensors["d2t"], tensors["t2d"], vocab)
    model.load_state_dict(tensors, strict=True)
    float_dtype = dtype or stored
    for parameter in model.parameters():
        parameter.data = parameter.data.to(float_dtype)
    return model.eval()


def _check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab: int) -> None:
    """d2t must name distinct target ids (q would lose mass otherwise); t2d must mark
    exactly those."""
    ids = torch.arange(d2t.shape[0]) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise UnsupportedDraft(f"d2t maps draft tokens outside the target vocabulary of "
                               f"{vocab}")
    if ids.unique().numel() != ids.numel():
        raise UnsupportedDraft("d2t maps two draft tokens onto one target token")
    if int(t2d.sum()) != ids.numel() or not bool(t2d[ids].all()):
        raise UnsupportedDraft("t2d does not mark exactly the target tokens d2t maps onto")


# -- writing the speculators layout ---------------------------------------------------------
def speculators_config(model: Eagle3DraftForCausalLM, verifier: str,
                       verifier_architectures: list[str], speculative_tokens: int = 3
                       ) -> dict[str, Any]:
    """config.json of the speculators layout for `model`."""
    settings = model.eagle3
    layer = model.config.to_diff_dict()
    for key in (EAGLE3_KEY, "architectures", "transformers_version", "dtype",
                "torch_dtype"):
        layer.pop(key, None)
    layer.update(model_type="llama", vocab_size=int(model.config.vocab_size),
                 hidden_size=int(model.config.hidden_size),
                 num_hidden_layers=int(model.config.num_hidden_layers),
                 tie_word_embeddings=False)
    config: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": settings.draft_vocab_size,
        "target_hidden_size": settings.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(settings.aux_layer_ids),
        "norm_before_residual": settings.norm_before_residual,
        "norm_output": settings.norm_output,
        "torch_dtype": str(model.fc.weight.dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier,
                         "architectures": verifier_architectures},
        },
    }
    if settings.wire_dtype != Eagle3Settings.wire_dtype:
        config[WIRE_DTYPE_KEY] = settings.wire_dtype
    return config


def speculators_tensors(model: Eagle3DraftForCausalLM, shared_embeddings: bool = False
                        ) -> dict[str, torch.Tensor]:
    """The tensors under the speculators layout's names (d2t/t2d only for a reduced
    draft vocabulary; no embed_tokens with shared_embeddings: the loader takes the
    target's)."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if shared_embeddings and name == "model.embed_tokens.weight":
            continue
        tensors[name.removeprefix("model.")] = tensor.detach().contiguous().cpu()
    if model.eagle3.draft_vocab_size == int(model.config.vocab_size) \
            and not bool(tensors["d2t"].any()):
        del tensors["d2t"], tensors["t2d"]
    return tensors


def save_speculators(model: Eagle3DraftForCausalLM, out_dir: Path, verifier: str,
                     verifier_architectures: list[str], tokenizer_dir: Path | None = None,
                     shared_embeddings: bool = False) -> Path:
    """Write `model` in the speculators layout (config.json, model.safetensors), with the
    tokenizer files of tokenizer_dir where given; shared_embeddings leaves out
    embed_tokens (the target's, which loaders take in its place)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = speculators_config(model, verifier, verifier_architectures)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(speculators_tensors(model, shared_embeddings), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "vocab.json", "merges.txt"):
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return out_dir
