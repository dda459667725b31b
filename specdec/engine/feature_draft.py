"""A draft that reads the target's hidden states (EAGLE-style feature conditioning).

A standalone draft must rebuild the context from tokens with a couple of layers; the
target's last hidden state at position p-1 already holds that context (its LM head turns
it into the next-token distribution). This draft's input at position p is
fc([embedding(x_p); h_{p-1}]), where h_{p-1} is the target's final-norm output at p-1 for
committed positions and the draft's own output for positions it drafted itself. Its
output at p is its estimate of the target's h_p, and its LM head (the target's
embeddings restricted to a reduced vocabulary) turns that into q for x_{p+1}.

The target's hidden states only shape q, which travels with the proposal and is what the
rejection sampler compares with p, so speculative decoding stays exact whatever they are
(rounded to float16 on the wire, or zeros where none exists: position -1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from specdec.errors import InvalidRequest

# config.json key that marks a feature draft and records the hidden size it reads.
TARGET_HIDDEN_SIZE_KEY = "specdec_target_hidden_size"
# A fixed factor on the target's states before the input layer: SmolLM2's final-norm
# outputs are ~16x larger than its embeddings, and at that scale the first updates of a
# zero-initialised input path swamp the embeddings.
TARGET_HIDDEN_SCALE_KEY = "specdec_target_hidden_scale"


class FeatureDraftForCausalLM(LlamaForCausalLM):
    """A Llama stack whose inputs mix token embeddings with the target's hidden states."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        target_hidden = int(getattr(config, TARGET_HIDDEN_SIZE_KEY))
        self.feature_fc = nn.Linear(config.hidden_size + target_hidden, config.hidden_size)

    @property
    def target_hidden_size(self) -> int:
        return int(getattr(self.config, TARGET_HIDDEN_SIZE_KEY))

    def forward(self, input_ids: torch.Tensor | None = None, *,  # type: ignore[override]
                target_hidden: torch.Tensor | None = None, logits_to_keep: int = 0,
                **kwargs: Any) -> Any:
        """target_hidden: [batch, tokens, target hidden], the target's state one position
        before each input token. Everything else is LlamaForCausalLM's."""
        if input_ids is None or target_hidden is None:
            raise ValueError("a feature draft needs input_ids and the target's hidden states")
        embeds = self.model.embed_tokens(input_ids)
        scale = float(getattr(self.config, TARGET_HIDDEN_SCALE_KEY, 1.0))
        mixed = self.feature_fc(torch.cat([embeds, target_hidden.to(embeds.dtype) * scale],
                                          dim=-1))
        return super().forward(inputs_embeds=mixed, logits_to_keep=logits_to_keep, **kwargs)


def is_feature_draft(model: nn.Module) -> bool:
    return isinstance(model, FeatureDraftForCausalLM)


_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "norm_f")


def final_norm(model: PreTrainedModel) -> nn.Module:
    """The module whose output is the hidden state the LM head reads (all positions)."""
    decoder = model.base_model
    for name in _FINAL_NORM_NAMES:
        norm = getattr(decoder, name, None)
        if isinstance(norm, nn.Module):
            return norm
    raise InvalidRequest(f"the target ({type(model).__name__}) has no final norm named "
                         f"{'/'.join(_FINAL_NORM_NAMES)} to read hidden states from, so it "
                         "cannot serve a feature draft")
