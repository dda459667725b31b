"""A stand-in draft while the trained one is absent: the target's first N layers.

A truncated copy shares the target's tokenizer, embeddings and LM head, so it needs no
vocabulary mapping; its acceptance rate is modest but it exercises the whole system.
Built once into the model cache (or any directory) as safetensors.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from specdec.engine.models import DEFAULT_DRAFT, DEFAULT_TARGET, model_cache_dir, resolve

log = logging.getLogger(__name__)


def truncated_copy(source: str | Path, out_dir: Path, layers: int = 2) -> Path:
    """Save the first `layers` decoder layers of the causal LM at `source` into out_dir."""
    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists():
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model.save_pretrained(tmp_dir, safe_serialization=True)
    try:
        AutoTokenizer.from_pretrained(source).save_pretrained(tmp_dir)
        GenerationConfig.from_pretrained(source).save_pretrained(tmp_dir)
    except OSError:
        pass  # a tokenizer-less source (tiny test models) gives a tokenizer-less draft
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir


def default_draft_or_truncated(layers: int = 2) -> tuple[str, bool]:
    """(draft model path, True if it is the trained default) for demos and benchmarks."""
    try:
        return str(resolve(DEFAULT_DRAFT)), True
    except FileNotFoundError:
        target = resolve(DEFAULT_TARGET, progress=False)
        out = model_cache_dir() / f"{DEFAULT_TARGET}-{layers}layers"
        log.info("trained draft absent: using the target's first %d layers (%s)", layers, out)
        return str(truncated_copy(target, out, layers)), False
