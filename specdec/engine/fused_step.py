"""Decode-sized forwards of an int8 Llama without transformers' module stack.

On a CPU a one-token step of the target spends about a third of its time outside its
matrix products: module calls, keyword plumbing, mask building, output records, and
three products for q/k/v and two for gate/up where one each would do. FusedStep runs
the computation of transformers' LlamaForCausalLM forward op for op, with
- q/k/v and gate/up each as one int8 product over the concatenated weights: the int8
  operator sums an output in an order fixed by the layer's input width alone, so each
  output gets the bits its own layer gives it (the layers' buffers become views of the
  fused ones: no second copy of the weights);
- transformers' own RMSNorm forward and rotary function, called directly, without the
  decoder layers' module calls and keyword plumbing;
- no mask building: a chain is causal, and a token tree's mask or a packed batch's
  layout goes to the rowwise attention kernel as transformers passes it;
- the final norm and the LM head on the kept rows only (both act row by row), the head
  in whatever kernel the model has it;
- each layer in C++ (csrc/llama_layer.cpp: the same computation in the same order, the
  norms, rotary embedding, residual adds and SiLU times up loops that round as ATen's
  operations do, the int8 products, SiLU and the attention the same operators; the final
  norm too), where that operator builds and the layer has the usual
  shape (fused q/k/v and gate/up, SiLU): one call per layer for one sequence or a
  packed batch of sessions (each session's cache update and attention included), or
  one call each before and after the attention where a session has no cache yet,
  instead of some fifty interpreter calls;
- a KV cache that grows in place (kv_cache.GrowingCache, which the runner gives every
  session of a model with the fused step): a forward writes its rows' keys and values
  instead of copying each layer's cache to append them.

Its logits and KV cache equal transformers' forward bit for bit
(tests/test_fused_step.py), so greedy equality and the row-invariance guarantees carry
over unchanged. It runs decode-sized forwards: at most DECODE_ROWS new rows per session,
alone or packed. Prefills, hidden-state capture and models that read hidden states go
through transformers' forward.

The cpu-tuned backend installs it at load, on the target and on a token draft, where the
model fits (`fits`): a Llama-family model whose decoder layers' linear layers all run the
int8 operator and whose attention is the rowwise kernel, which is `--dtype auto` on a CPU
where the operator builds. `--fused-step off` keeps transformers' forward (and so does
`--draft-compile on` for the draft, whose compiled forward is then what runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from specdec.engine.attention import (
    PACKING_KWARG,
    ROWWISE_NAME,
    PackedBatch,
    native_rowwise_attention,
    row_plan_for,
    rowwise_sdpa_forward,
)
from specdec.engine.cpu_operators import OptionalOperators
from specdec.engine.extend import FUSED_STEP_ATTRIBUTE
from specdec.engine.int8 import BLOCK, Int8Linear, int8_product
from specdec.engine.kv_cache import GrowingCache, GrowingLayer
from specdec.settings import FUSED_STEP_CHOICES

ARCHITECTURES = ("LlamaForCausalLM",)
FUSED = "fused step"  # what install reports when it installed the step
LAYER_OPERATORS = OptionalOperators(
    "specdec_llama_layer", "llama_layer.cpp",
    ("llama_attention_inputs", "llama_layer_output", "llama_decode_layer", "rms_norm",
     "rms_norm_sum_lanes"),
    "the fused step runs each layer's operations from Python",
    # Each float operation rounds on its own, as ATen's do: no fused multiply-adds.
    flags=("-ffp-contract=off",))


@dataclass(frozen=True)
class _Product:
    """One int8 product's operands (int8_pack's layout), possibly of fused layers."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return int8_product(input, self.codes, self.scales, self.offsets, self.bias)


def _fuse(layers: Sequence[Int8Linear]) -> list[_Product]:
    """One product for layers of the same input, their outputs side by side, with each
    layer's buffers turned into views of the fused ones; the layers' own products where
    only some of them have a bias or 4-bit codes."""
    if len(layers) == 1 or len({layer.bias is None for layer in layers}) > 1 \
            or len({layer.nibbles for layer in layers}) > 1:
        return [_Product(layer.codes, layer.scales, layer.offsets, layer.bias)
                for layer in layers]
    biases = [layer.bias for layer in layers if layer.bias is not None]
    product = _Product(torch.cat([layer.codes for layer in layers]),
                       torch.cat([layer.scales for layer in layers]),
                       torch.cat([layer.offsets for layer in layers]),
                       torch.cat(biases) if biases else None)
    row = 0
    for layer in layers:
        count = layer.out_features
        layer.codes = product.codes[row // BLOCK:(row + count) // BLOCK]
        layer.scales = product.scales[row:row + count]
        layer.offsets = product.offsets[row:row + count]
        if product.bias is not None:
            layer.bias = product.bias[row:row + count]
        row += count
    return [product]


@dataclass(frozen=True)
class _Layer:
    attention: Any  # the layer's LlamaAttention: what the attention kernel reads
    input_norm: Any  # LlamaRMSNorm
    post_norm: Any
    qkv: list[_Product]
    output: _Product
    gate_up: list[_Product]
    down: _Product
    act: Callable[[torch.Tensor], torch.Tensor]
    widths: tuple[int, int, int]  # q, k, v outputs
    intermediate: int
    head_dim: int
    scaling: float

    def native_arguments(self) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """The arguments of llama_attention_inputs (between hidden and cos, sin) and of
        llama_layer_output (after attended, residual), where the C++ layer operators
        compute exactly what this layer's Python does; None elsewhere."""
        if len(self.qkv) != 1 or len(self.gate_up) != 1 or not _is_silu(self.act) or not (
                _is_llama_rms_norm(self.input_norm) and _is_llama_rms_norm(self.post_norm)):
            return None
        qkv, gate_up, output, down = self.qkv[0], self.gate_up[0], self.output, self.down
        return ((self.input_norm.weight, float(self.input_norm.variance_epsilon), qkv.codes,
                 qkv.scales, qkv.offsets, qkv.bias, *self.widths, self.head_dim),
                (output.codes, output.scales, output.offsets, output.bias,
                 self.post_norm.weight, float(self.post_norm.variance_epsilon),
                 gate_up.codes, gate_up.scales, gate_up.offsets, gate_up.bias,
                 self.intermediate, down.codes, down.scales, down.offsets, down.bias))


def _is_silu(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    return act is F.silu or isinstance(act, nn.SiLU) or (
        type(act).__name__ == "SiLUActivation" and type(act).__module__.startswith("transformers"))


def _is_llama_rms_norm(norm: Any) -> bool:
    return type(norm).forward is LlamaRMSNorm.forward


def fits(model: nn.Module) -> str | None:
    """Why the fused step cannot run this model (None: it can)."""
    config = getattr(model, "config", None)
    if type(model).__name__ not in ARCHITECTURES:
        return f"a {type(model).__name__}, not one of {', '.join(ARCHITECTURES)}"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != ROWWISE_NAME:
        return f"attention {implementation}, not the rowwise kernel"
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", []))
    if not layers:
        return "no decoder layers"
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                       mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if not isinstance(linear, Int8Linear):
                return f"{type(linear).__name__} layers, not int8"
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        return "no LM head"
    return None


class FusedStep:
    """A Llama-family model's decode-sized forward (see the module's docstring)."""

    def __init__(self, model: nn.Module) -> None:
        reason = fits(model)
        if reason is not None:
            raise ValueError(f"the fused step does not fit this model: {reason}")
        source: Any = model
        inner = source.model
        self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm
        # The LM head as the model has it: int8 where its shape allows, else its own kernel
        # (a draft's 8193-row head, say).
        self.lm_head: Callable[[torch.Tensor], torch.Tensor] = (
            _fuse([source.lm_head])[0] if isinstance(source.lm_head, Int8Linear)
            else source.lm_head)
        count = int(source.config.num_hidden_layers)
        self.layers = [self._layer(layer) for layer in list(inner.layers)[:count]]
        # Per layer: the C++ operators' arguments, or None for the Python path.
        self.native: list[tuple[tuple[Any, ...], tuple[Any, ...]] | None] = [None] * count
        arguments = [layer.native_arguments() for layer in self.layers]
        if any(argument is not None for argument in arguments) and \
                LAYER_OPERATORS.get() is not None:
            self.native = arguments

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        attention: Any = layer.self_attn
        mlp: Any = layer.mlp
        qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
        return _Layer(attention, layer.input_layernorm, layer.post_attention_layernorm,
                      _fuse(qkv), _fuse([attention.o_proj])[0],
                      _fuse([mlp.gate_proj, mlp.up_proj]), _fuse([mlp.down_proj])[0],
                      mlp.act_fn, tuple(linear.out_features for linear in qkv),
                      mlp.gate_proj.out_features, attention.head_dim,
                      float(attention.scaling))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                logits_to_keep: int | torch.Tensor,
                attention_mask: torch.Tensor | None = None,
                attention_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
        """The logits [1, kept rows, vocab] of input_ids [1, rows] at position_ids over
        cache (a transformers Cache, or a PackedBatch with its kwarg in
        attention_kwargs), as LlamaForCausalLM's forward computes them; the kept rows:
        the last logits_to_keep (an int), or these row indices."""
        kwargs = attention_kwargs or {}
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(hidden, position_ids)
        batch, rows = input_ids.shape
        operators = LAYER_OPERATORS.get() if any(self.native) else None
        whole = (self._whole_layers(hidden, cache, attention_mask, kwargs)
                 if operators is not None and all(self.native) else None)
        for index, (layer, native) in enumerate(zip(self.layers, self.native, strict=True)):
            if native is not None and operators is not None and whole is not None:
                # The whole layer in one call, which writes the rows' keys and values into
                # the room _whole_layers reserved.
                key_buffers, value_buffers = whole.buffers(index)
                hidden = operators[2](
                    hidden, key_buffers, value_buffers, whole.lengths, whole.rows,
                    whole.prefixes, whole.extras, whole.extra_counts, *native[0], cos, sin,
                    layer.scaling, *native[1])
                continue
            if native is not None and operators is not None:
                query, key, value = operators[0](hidden, *native[0], cos, sin)
                attended = _attend(layer, index, query, key, value, cache, attention_mask,
                                   kwargs)
                hidden = operators[1](attended, hidden, *native[1])
                continue
            residual = hidden
            normed = layer.input_norm.forward(hidden)
            shape = (batch, rows, -1, layer.head_dim)
            parts = [product(normed) for product in layer.qkv]
            query, key, value = (parts[0].split(layer.widths, dim=-1) if len(parts) == 1
                                 else parts)
            query = query.view(shape).transpose(1, 2)
            key = key.view(shape).transpose(1, 2)
            value = value.view(shape).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            attended = _attend(layer, index, query, key, value, cache, attention_mask, kwargs)
            attended = attended.reshape(batch, rows, -1).contiguous()
            hidden = residual + layer.output(attended)
            residual = hidden
            normed = layer.post_norm.forward(hidden)
            if len(layer.gate_up) == 1:
                gate, up = layer.gate_up[0](normed).split(layer.intermediate, dim=-1)
            else:
                gate, up = (product(normed) for product in layer.gate_up)
            # Contiguous, as the gate layer's own output is: the activation's kernel
            # then takes the same (vectorised) path.
            hidden = residual + layer.down(layer.act(gate.contiguous()) * up)
        if whole is not None:
            whole.advance()
        kept = (hidden[:, -logits_to_keep:] if isinstance(logits_to_keep, int)
                else hidden[:, logits_to_keep])
        if operators is not None and _is_llama_rms_norm(self.norm):
            normed = operators[3](kept, self.norm.weight, float(self.norm.variance_epsilon))
        else:
            normed = self.norm.forward(kept)
        return self.lm_head(normed)

    def _whole_layers(self, hidden: torch.Tensor, cache: Any,
                      attention_mask: torch.Tensor | None,
                      kwargs: dict[str, Any]) -> _WholeLayers | None:
        """What every layer's llama_decode_layer call takes, with room reserved in each
        sequence's cache for its rows, where every layer can run as one call: one
        sequence or packed sessions, in bfloat16, each over a GrowingCache whose layers
        all hold keys, each sequence's rows under a pattern the rowwise operator takes,
        which is built; None elsewhere (a first forward, a cache of another kind)."""
        if hidden.dtype != torch.bfloat16 or hidden.device.type != "cpu" \
                or hidden.shape[0] != 1 or native_rowwise_attention() is None:
            return None
        packing = kwargs.get(PACKING_KWARG)
        if isinstance(packing, PackedBatch) and len(kwargs) == 1:
            caches, masks = packing.caches, packing.masks
            rows = [end - begin for begin, end in packing.bounds]
        elif not kwargs:
            caches, rows, masks = [cache], [hidden.shape[1]], [attention_mask]
        else:
            return None
        count = len(self.layers)
        held: list[list[GrowingLayer]] = []
        for sequence_cache in caches:
            if type(sequence_cache) is not GrowingCache:
                return None
            layers = [layer for layer in sequence_cache.layers[:count]
                      if isinstance(layer, GrowingLayer) and layer.length]
            if len(layers) < count:
                return None
            held.append(layers)
        first = self.layers[0]
        groups = first.widths[0] // first.widths[1]  # query heads per key/value head
        plans = []
        for layers, sequence_rows, mask in zip(held, rows, masks, strict=True):
            plan = row_plan_for(mask, sequence_rows, layers[0].length + sequence_rows,
                                groups, hidden.device)
            if plan is None:
                return None
            plans.append(plan)
        for layers, sequence_rows in zip(held, rows, strict=True):
            for layer in layers:
                layer.reserve(sequence_rows)
        return _WholeLayers(held, [layers[0].length for layers in held], rows,
                            [plan.prefixes for plan in plans], [plan.extras for plan in plans],
                            [plan.extra_counts for plan in plans])


@dataclass(frozen=True)
class _WholeLayers:
    """One forward's sequences as every llama_decode_layer call takes them."""

    held: list[list[GrowingLayer]]  # per sequence, its cache's layers
    lengths: list[int]  # positions each sequence's cache holds before the forward
    rows: list[int]  # each sequence's new rows, in order
    prefixes: list[torch.Tensor]  # each sequence's RowPlan
    extras: list[torch.Tensor]
    extra_counts: list[torch.Tensor]

    def buffers(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Layer index's key and value buffers, one per sequence."""
        layers = [layers[index] for layers in self.held]
        return ([layer.key_buffer for layer in layers],  # type: ignore[misc]
                [layer.value_buffer for layer in layers])  # type: ignore[misc]

    def advance(self) -> None:
        """Take the rows every layer wrote into its cache."""
        for layers, rows in zip(self.held, self.rows, strict=True):
            for layer in layers:
                layer.advance(rows)


def _attend(layer: _Layer, index: int, query: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None,
            kwargs: dict[str, Any]) -> torch.Tensor:
    """The layer's new keys and values into the cache, then its rowwise attention over
    them, as transformers' LlamaAttention does between its projections."""
    key, value = cache.update(key, value, index)
    attended, _ = rowwise_sdpa_forward(layer.attention, query, key, value, attention_mask,
                                       dropout=0.0, scaling=layer.scaling, **kwargs)
    return attended


def install(model: nn.Module, setting: str) -> str:
    """Install the fused step on model where the setting and the model allow; returns
    what runs its decode-sized forwards, for the load report."""
    if setting not in FUSED_STEP_CHOICES:
        raise ValueError(f"fused step setting must be one of {FUSED_STEP_CHOICES}, "
                         f"got {setting!r}")
    if setting == "off":
        return "transformers forward (--fused-step off)"
    reason = fits(model)
    if reason is not None:
        return f"transformers forward (fused step: {reason})"
    setattr(model, FUSED_STEP_ATTRIBUTE, FusedStep(model))
    return FUSED
