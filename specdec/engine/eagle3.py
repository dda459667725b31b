"""EAGLE-3 drafts: one decoder layer over the target's low, middle and high layers.

The target's residual stream at the inputs of a few of its layers (EAGLE-3 reads layers
2, L/2 and L-3 of L) is fused by one linear map `fc` (n x target hidden -> hidden). The
draft's input at position p pairs the embedding of x_p with the fused state of p-1; its
first layer normalises the two halves apart (`input_layernorm`, `hidden_norm`), attends
over their concatenation (q/k/v read 2 x hidden) and keeps the state half as the residual
(normalised first with `norm_before_residual`). `norm` and `lm_head` then give logits over
a draft vocabulary, which `d2t` maps onto the target's (target id = draft id + d2t[id]);
`t2d` marks the target ids the draft vocabulary holds.

For a token it drafted itself the draft has no target state: it reads its own output
state for the position before instead (the residual stream before `norm`, or after it
with `norm_output`), which is already in its input space and skips `fc`.

Tensor and config names follow the speculators layout (specdec.engine.eagle3_formats
reads and writes both ecosystem layouts). The target's states only shape q, which
travels with the proposal, so decoding stays exact whatever they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from specdec.core.history import HiddenSpec

# config.json attribute holding Eagle3Settings (specdec's own copy of the draft's facts).
EAGLE3_KEY = "specdec_eagle3"


@dataclass(frozen=True)
class Eagle3Settings:
    """What an EAGLE-3 draft reads and how (the speculators config's EAGLE-3 fields)."""

    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose inputs it reads, in fc's order
    norm_before_residual: bool = False
    norm_output: bool = False  # feed back the state after `norm` (speculators' Eagle 3.1)
    wire_dtype: str = "bfloat16"  # how the target's states travel (HiddenSpec)

    @property
    def fused_width(self) -> int:
        """Width of the target rows the draft reads: the aux states side by side."""
        return len(self.aux_layer_ids) * self.target_hidden_size

    @property
    def hidden_spec(self) -> HiddenSpec:
        return HiddenSpec(self.aux_layer_ids, self.wire_dtype)

    def to_config(self) -> dict[str, Any]:
        return {**asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}

    @classmethod
    def from_config(cls, value: dict[str, Any]) -> Eagle3Settings:
        return cls(**{**value, "aux_layer_ids": tuple(int(i) for i in value["aux_layer_ids"])})


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice for a target of num_layers layers (speculators and vLLM take the
    same): the inputs of layers 2, L/2 and L-3."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3FirstLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose input is [embedding; state] (2 x hidden wide)."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool) -> None:
        super().__init__(config, layer_idx=0)
        width = 2 * config.hidden_size
        attention = self.self_attn
        head_dim = int(attention.head_dim)
        heads = int(config.num_attention_heads)
        kv_heads = int(config.num_key_value_heads or heads)
        bias = bool(config.attention_bias)
        attention.q_proj = nn.Linear(width, heads * head_dim, bias=bias)
        attention.k_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        attention.v_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, hidden_states: torch.Tensor,  # type: ignore[override]
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Any = None,
                use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                **kwargs: Any) -> torch.Tensor:
        embeds, state = hidden_states.chunk(2, dim=-1)
        normed = self.hidden_norm(state)
        residual = normed if self.norm_before_residual else state
        attention_input = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attended, _ = self.self_attn(hidden_states=attention_input,
                                     attention_mask=attention_mask, position_ids=position_ids,
                                     cache=cache, use_cache=use_cache,
                                     position_embeddings=position_embeddings, **kwargs)
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3DraftForCausalLM(LlamaForCausalLM):
    """A Llama stack of EAGLE-3 layers: config.vocab_size is the target's vocabulary (the
    embeddings read target ids), lm_head's rows the draft vocabulary."""

    def __init__(self, config: LlamaConfig) -> None:
        config.tie_word_embeddings = False
        super().__init__(config)
        settings = self.eagle3
        self.model.layers[0] = Eagle3FirstLayer(config, settings.norm_before_residual)
        self.fc = nn.Linear(settings.fused_width, config.hidden_size, bias=False)
        self.lm_head = nn.Linear(config.hidden_size, settings.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(settings.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def eagle3(self) -> Eagle3Settings:
        return Eagle3Settings.from_config(getattr(self.config, EAGLE3_KEY))

    def draft_to_target(self) -> torch.Tensor:
        """The target id of each draft row (d2t holds offsets)."""
        d2t = self.d2t
        assert isinstance(d2t, torch.Tensor)
        return torch.arange(d2t.shape[0], device=d2t.device) + d2t

    def fuse(self, target_rows: torch.Tensor) -> torch.Tensor:
        """[n, fused width] target states -> [n, hidden], the draft's input space."""
        # The model's compute dtype (fc may hold int8 weights, which have no .weight).
        return self.fc(target_rows.to(self.model.embed_tokens.weight.dtype))

    def state_module(self) -> tuple[nn.Module, bool]:
        """The module around which the fed-back state is read, and whether it is that
        module's output (else its input): `norm`'s input, or its output with
        norm_output."""
        return self.model.norm, self.eagle3.norm_output

    def forward(self, input_ids: torch.Tensor | None = None, *,  # type: ignore[override]
                target_hidden: torch.Tensor | None = None, logits_to_keep: int = 0,
                **kwargs: Any) -> Any:
        """target_hidden: [batch, tokens, hidden], the state one position before each
        input token in the draft's input space (`fuse`d target states, or its own)."""
        if input_ids is None or target_hidden is None:
            raise ValueError("an EAGLE-3 draft needs input_ids and the states before them")
        embeds = self.model.embed_tokens(input_ids)
        paired = torch.cat([embeds, target_hidden.to(embeds.dtype)], dim=-1)
        return super().forward(inputs_embeds=paired, logits_to_keep=logits_to_keep, **kwargs)


def is_eagle3_draft(model: nn.Module) -> bool:
    return isinstance(model, Eagle3DraftForCausalLM)


def eagle3_config(layer: dict[str, Any], settings: Eagle3Settings) -> LlamaConfig:
    """The draft's LlamaConfig from a decoder layer's config (as transformer_layer_config
    holds it) and its EAGLE-3 settings."""
    known = {key: value for key, value in layer.items()
             if key not in ("architectures", "model_type", "torch_dtype", "dtype",
                            "transformers_version", EAGLE3_KEY)}
    config = LlamaConfig(**known)
    config.tie_word_embeddings = False
    setattr(config, EAGLE3_KEY, settings.to_config())
    return config
