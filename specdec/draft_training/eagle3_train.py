"""Train an EAGLE-3 draft (specdec.engine.eagle3) with the training-time test.

At decode time the draft's first step reads the target's states (fused by `fc`) for every
committed position, and each later step reads the draft's own output state for the
token it drafted before. Training does the same ("training-time test", EAGLE-3): step 0
runs the draft over the whole sequence with the target's states; step j feeds each
position's step j-1 output state back with the next token, so the entry at index t of
step j is the j-th drafted token of a chain that starts after position t. Its attention
sees step 0's keys at positions <= t (what the KV cache holds from the target's states)
and its own chain's keys from steps 1..j, nothing else. Step j's loss is the
cross-entropy to the target's distribution over the draft vocabulary (its top-k labels;
mass outside the vocabulary is lost), weighted by decay**j.

`ttt_logits` is a pure function of the draft and tensors; the loss and the held-out
measure both use it. One EAGLE-3 decoder layer (the standard draft).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from specdec.draft_training.heldout import HeldOutSet
from specdec.draft_training.producers import target_aux_states
from specdec.draft_training.train import Record, right_pad
from specdec.engine.eagle3 import (
    Eagle3DraftForCausalLM,
    Eagle3Settings,
    default_aux_layer_ids,
    eagle3_config,
)
from specdec.engine.hidden_states import decoder_layers

LOSS_DECAY = 0.8  # weight of step j's loss: decay**j (EAGLE-3's choice)


def make_eagle3_draft(target: PreTrainedModel, token_map: list[int],
                      aux_layer_ids: tuple[int, ...] | None = None,
                      norm_before_residual: bool = True) -> Eagle3DraftForCausalLM:
    """A one-layer EAGLE-3 draft for a Llama-family target over the draft vocabulary
    token_map (sorted target ids). Its embeddings are the target's (frozen: a saved
    draft shares them), its LM head the target's rows for token_map, its final norm the
    target's, its layer the target's last one with the embedding half of q/k/v small;
    `fc` starts by passing the highest aux layer's state through."""
    base = target.config
    layers = int(base.num_hidden_layers)
    # EAGLE-3's layers, kept inside a target too shallow for them
    aux = aux_layer_ids or tuple(min(max(i, 0), layers - 1)
                                 for i in default_aux_layer_ids(layers))
    hidden = int(base.hidden_size)
    settings = Eagle3Settings(len(token_map), hidden, tuple(aux), norm_before_residual)
    known = {key: getattr(base, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
        "rope_parameters", "hidden_act", "attention_bias", "mlp_bias") if hasattr(base, key)}
    layer_config: dict[str, Any] = {**known, "num_hidden_layers": 1}
    draft = Eagle3DraftForCausalLM(eagle3_config(layer_config, settings))
    source_layer: Any = decoder_layers(target)[layers - 1]
    rows = torch.tensor(token_map)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[rows].float())
        final_norm: Any = target.base_model.norm
        draft.model.norm.load_state_dict(final_norm.state_dict())
        layer: Any = draft.model.layers[0]
        for name in ("q_proj", "k_proj", "v_proj"):
            wide = getattr(layer.self_attn, name).weight
            source = getattr(source_layer.self_attn, name).weight.float()
            wide[:, :hidden] = source * 0.1
            wide[:, hidden:] = source
        layer.self_attn.o_proj.load_state_dict(source_layer.self_attn.o_proj.state_dict())
        layer.mlp.load_state_dict(source_layer.mlp.state_dict())
        layer.post_attention_layernorm.load_state_dict(
            source_layer.post_attention_layernorm.state_dict())
        layer.input_layernorm.load_state_dict(source_layer.input_layernorm.state_dict())
        layer.hidden_norm.load_state_dict(source_layer.input_layernorm.state_dict())
        draft.fc.weight.zero_()
        draft.fc.weight[:, (len(aux) - 1) * hidden:] = torch.eye(hidden)
        d2t, t2d = draft.d2t, draft.t2d
        assert isinstance(d2t, torch.Tensor) and isinstance(t2d, torch.Tensor)
        d2t.copy_(rows - torch.arange(len(token_map)))
        t2d.zero_()
        t2d[rows] = True
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft.float()


def draft_token_map(draft: Eagle3DraftForCausalLM) -> list[int]:
    return [int(i) for i in draft.draft_to_target().tolist()]


def ttt_logits(draft: Eagle3DraftForCausalLM, ids: torch.Tensor, aux_states: torch.Tensor,
               lengths: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits over the draft vocabulary of each training-time-test step.

    ids [B, T] target ids (right-padded), aux_states [B, T, fused width] the target's
    states at each position, lengths [B]. Entry [b, t] of step j's logits [B, T, V] is
    the draft's distribution of the token at position t+j+1 when it has drafted
    positions t+1..t+j itself after the committed prefix 0..t (valid while t+j+1 <
    length)."""
    return [draft.lm_head(state) for state in ttt_states(draft, ids, aux_states, lengths,
                                                         steps)]


def ttt_states(draft: Eagle3DraftForCausalLM, ids: torch.Tensor, aux_states: torch.Tensor,
               lengths: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """ttt_logits before the LM head: each step's [B, T, hidden] output after `norm`
    (the loss runs the head on the rows that have labels only)."""
    if len(draft.model.layers) != 1:
        raise ValueError("the training-time test is written for one EAGLE-3 layer, the "
                         f"draft has {len(draft.model.layers)}")
    layer = draft.model.layers[0]
    attention = layer.self_attn
    batch, width = ids.shape
    device = ids.device
    head_dim = int(attention.head_dim)
    fused = draft.fuse(aux_states)
    state = torch.cat([fused.new_zeros(batch, 1, fused.shape[-1]), fused[:, :-1]], dim=1)
    index = torch.arange(width, device=device)
    # step 0's keys: position s <= t and inside the sequence
    visible = (index[None, :] <= index[:, None])[None] \
        & (index[None, None, :] < lengths[:, None, None])
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    norm_output = draft.eagle3.norm_output
    out: list[torch.Tensor] = []
    for step in range(steps):
        shifted = torch.zeros_like(ids)
        shifted[:, : width - step] = ids[:, step:]
        embeds = draft.model.embed_tokens(shifted).to(state.dtype)
        normed = layer.hidden_norm(state)
        residual = normed if layer.norm_before_residual else state
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        q = attention.q_proj(x).view(batch, width, -1, head_dim).transpose(1, 2)
        k = attention.k_proj(x).view(batch, width, -1, head_dim).transpose(1, 2)
        v = attention.v_proj(x).view(batch, width, -1, head_dim).transpose(1, 2)
        positions = (index + step)[None].expand(batch, width)
        cos, sin = draft.model.rotary_emb(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = int(attention.num_key_value_groups)
        keys.append((repeat_kv(k, groups), repeat_kv(v, groups)))
        k0, v0 = keys[0]
        scores = torch.matmul(q, k0.transpose(2, 3)) * attention.scaling
        scores = scores.masked_fill(~visible[:, None], torch.finfo(scores.dtype).min)
        own = [(q * kj).sum(-1, keepdim=True) * attention.scaling for kj, _ in keys[1:]]
        weights = torch.softmax(torch.cat([scores, *own], dim=-1).float(), dim=-1)
        weights = weights.to(q.dtype)
        attended = torch.matmul(weights[..., :width], v0)
        for j, (_, vj) in enumerate(keys[1:]):
            attended = attended + weights[..., width + j: width + j + 1] * vj
        attended = attention.o_proj(attended.transpose(1, 2).reshape(batch, width, -1))
        hidden = residual + attended
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        normed_out = draft.model.norm(hidden)
        out.append(normed_out)
        state = normed_out if norm_output else hidden
    return out


def _batch_tensors(batch: list[Record], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = right_pad([torch.cat([r["prompt_ids"], r["new_ids"]]).long() for r in batch])
    aux, _ = right_pad([r["aux_states"] for r in batch])
    return ids.to(device), aux.to(device), mask.sum(1).to(device)


def eagle3_loss(draft: Eagle3DraftForCausalLM, batch: list[Record], draft_rows: torch.Tensor,
                steps: int, decay: float = LOSS_DECAY) -> torch.Tensor:
    """The weighted training-time-test loss over the answer positions of `batch`
    (records with aux_states). draft_rows: each target id's draft row, -1 outside."""
    device = draft.fc.weight.device
    ids, aux, lengths = _batch_tensors(batch, device)
    states = ttt_states(draft, ids, aux.float(), lengths, steps)
    width, top_k = ids.shape[1], int(batch[0]["topk_ids"].shape[-1])
    label_rows = torch.full((len(batch), width, top_k), -1, dtype=torch.long)
    label_probs = torch.zeros((len(batch), width, top_k))
    has_label = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, record in enumerate(batch):
        start = len(record["prompt_ids"]) - 1  # the position that predicts new_ids[0]
        count = len(record["new_ids"])
        label_rows[row, start: start + count] = draft_rows[record["topk_ids"].long()]
        label_probs[row, start: start + count] = record["topk_probs"].float()
        has_label[row, start: start + count] = True
    label_rows, label_probs = label_rows.to(device), label_probs.to(device)
    has_label = has_label.to(device)
    total = states[0].new_zeros(())
    weights = 0.0
    for step, step_states in enumerate(states):
        rows = label_rows[:, step:]
        labelled = has_label[:, step:]  # [B, T - step]: chains whose next token has a label
        probs = label_probs[:, step:][labelled] * (rows[labelled] >= 0)
        head = draft.lm_head(step_states[:, : width - step][labelled])
        log_q = torch.log_softmax(head.float(), dim=-1)
        picked = log_q.gather(-1, rows[labelled].clamp_min(0))
        positions = labelled.sum().clamp_min(1)
        total = total + decay ** step * -(probs * picked).sum() / positions
        weights += decay ** step
    return total / weights


def measure_eagle3_agreement(draft: Eagle3DraftForCausalLM, target: PreTrainedModel,
                             held_out: HeldOutSet, steps: int) -> dict[str, Any]:
    """heldout.measure_agreement for an EAGLE-3 draft: step 0 (the first drafted token,
    which reads the target's states) as the headline figures, and each step's top-1
    agreement and expected acceptance along the target's greedy answers (step j: after
    j tokens the draft drafted itself, all correct)."""
    layers = draft.eagle3.aux_layer_ids
    token_map = torch.tensor(held_out.token_map)
    device = draft.fc.weight.device
    matches = [0] * steps
    accepted = [0.0] * steps
    counted = [0] * steps
    was_training = draft.training
    draft.eval()
    with torch.inference_mode():
        for sequence, start, p in zip(held_out.sequences, held_out.answer_starts,
                                      held_out.target_probs, strict=True):
            ids = torch.tensor([sequence], device=target.device)
            _, aux = target_aux_states(target, layers, ids)
            logits = ttt_logits(draft, ids.to(device), aux.to(device).float(),
                                torch.tensor([len(sequence)], device=device), steps)
            following = torch.tensor(sequence[start:])
            for step, step_logits in enumerate(logits):
                # predicting position u = start-1+i reads chain t = u - step >= 0
                first = max(0, step - (start - 1))
                chains = torch.arange(start - 1 + first, len(sequence) - 1) - step
                q = torch.softmax(step_logits[0, chains.to(device)].float(), dim=-1).cpu()
                truth = following[first:]
                matches[step] += int((token_map[q.argmax(-1)] == truth).sum())
                accepted[step] += float(torch.minimum(p[first:].float(), q).sum())
                counted[step] += len(truth)
    draft.train(was_training)
    top1 = [m / max(1, c) for m, c in zip(matches, counted, strict=True)]
    expected = [a / max(1, c) for a, c in zip(accepted, counted, strict=True)]
    return {"top1_agreement": top1[0], "expected_acceptance": expected[0],
            "positions": counted[0], "top1_by_step": [round(x, 4) for x in top1],
            "expected_by_step": [round(x, 4) for x in expected]}

