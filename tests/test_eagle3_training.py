"""EAGLE-3 training (specdec.draft_training.eagle3_train): the training-time test computes
what the served draft computes, step for step, and a few steps of training on the
target's labels move the draft towards the target."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import tiny_eagle3_draft, tiny_llama

from specdec.draft_training.eagle3_train import (
    eagle3_loss,
    make_eagle3_draft,
    ttt_logits,
)
from specdec.draft_training.producers import make_record, target_aux_states, top_k_labels

VOCAB = 32
AUX = (2, 0, 1)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(1)
    target = tiny_llama(VOCAB, seed=1, layers=3).eval()
    draft = tiny_eagle3_draft(target, seed=2, aux_layer_ids=AUX, draft_vocab=20,
                              norm_before_residual=True).float()
    return target, draft


def _served_logits(draft: Any, ids: torch.Tensor, fused_before: torch.Tensor, start: int,
                   steps: int) -> list[torch.Tensor]:
    """The draft as the engine runs it: positions 0..start read the target's (fused)
    states into the cache, then each drafted token reads the draft's own state before
    `norm` at the position before it (teacher-forced tokens)."""
    module, output = draft.state_module()
    seen: list[torch.Tensor] = []
    handle = (module.register_forward_hook(lambda _m, _i, out: seen.append(out)) if output
              else module.register_forward_pre_hook(lambda _m, args: seen.append(args[0])))
    try:
        out = draft(input_ids=ids[:, : start + 1], target_hidden=fused_before[:, : start + 1],
                    use_cache=True)
        logits = [out.logits[0, start]]
        cache = out.past_key_values
        for step in range(1, steps):
            own = seen[-1][:, -1:]
            out = draft(input_ids=ids[:, start + step: start + step + 1], target_hidden=own,
                        cache=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0, -1])
    finally:
        handle.remove()
    return logits


def test_every_training_time_test_step_equals_the_served_draft(pair) -> None:
    target, draft = pair
    ids = torch.tensor([[1, 5, 7, 3, 9, 4, 11, 2, 8, 6]])
    with torch.no_grad():
        _, aux = target_aux_states(target, AUX, ids)
        steps = 4
        trained = ttt_logits(draft, ids, aux, torch.tensor([ids.shape[1]]), steps)
        fused = draft.fuse(aux)
        before = torch.cat([torch.zeros_like(fused[:, :1]), fused[:, :-1]], dim=1)
        for start in (0, 2, 5):
            served = _served_logits(draft, ids, before, start, steps)
            for step in range(steps):
                torch.testing.assert_close(trained[step][0, start], served[step],
                                           rtol=1e-4, atol=1e-4)


def test_padding_does_not_change_a_sequence(pair) -> None:
    target, draft = pair
    ids = torch.tensor([[1, 5, 7, 3, 9, 4], [2, 8, 6, 0, 0, 0]])
    with torch.no_grad():
        _, aux = target_aux_states(target, AUX, ids)
        both = ttt_logits(draft, ids, aux, torch.tensor([6, 3]), 3)
        alone = ttt_logits(draft, ids[1:, :3], aux[1:, :3], torch.tensor([3]), 3)
    for step in range(3):
        valid = 3 - step
        torch.testing.assert_close(both[step][1, :valid], alone[step][0, :valid],
                                   rtol=1e-4, atol=1e-4)


def _records(target: torch.nn.Module, count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    records = []
    for _ in range(count):
        prompt = torch.randint(0, VOCAB, (4,), generator=generator).tolist()
        new = torch.randint(0, VOCAB, (8,), generator=generator).tolist()
        ids = torch.tensor([prompt + new])
        with torch.no_grad():
            last, aux = target_aux_states(target, AUX, ids)
            logits = target.lm_head(last)[0, len(prompt) - 1: -1]
        record = make_record("chat", 1.0, prompt, new, *top_k_labels(logits, 8))
        record["aux_states"] = aux[0].to(torch.bfloat16)
        records.append(record)
    return records


def test_training_lowers_the_loss_and_freezes_the_shared_embeddings() -> None:
    torch.manual_seed(0)
    target = tiny_llama(VOCAB, seed=1, layers=5).eval()
    token_map = list(range(0, VOCAB, 2)) + [1, 3]
    draft = make_eagle3_draft(target, sorted(token_map))
    assert draft.eagle3.aux_layer_ids == (2, 2, 2)  # EAGLE-3's choice for 5 layers
    assert draft.draft_to_target().tolist() == sorted(token_map)
    embeddings = draft.model.embed_tokens.weight.clone()
    rows = torch.full((VOCAB,), -1)
    rows[torch.tensor(sorted(token_map))] = torch.arange(len(token_map))
    records = _records(target, 8)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    first = float(eagle3_loss(draft, records, rows, steps=3).detach())
    for _ in range(30):
        loss = eagle3_loss(draft, records, rows, steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(eagle3_loss(draft, records, rows, steps=3).detach()) < 0.9 * first
    assert torch.equal(draft.model.embed_tokens.weight, embeddings)


def test_the_loss_is_the_weighted_cross_entropy_of_every_labelled_step() -> None:
    """Against a direct computation from ttt_logits: every answer position counts, also
    one whose most probable target token lies outside the draft vocabulary."""
    target = tiny_llama(VOCAB, seed=1, layers=5).eval()
    token_map = list(range(0, VOCAB, 3))
    draft = make_eagle3_draft(target, token_map)
    rows = torch.full((VOCAB,), -1)
    rows[torch.tensor(token_map)] = torch.arange(len(token_map))
    records = _records(target, 3)
    assert any(int(r["topk_ids"][i, 0]) not in token_map
               for r in records for i in range(len(r["new_ids"])))
    steps, decay = 3, 0.8
    with torch.no_grad():
        loss = float(eagle3_loss(draft, records, rows, steps=steps, decay=decay))
        expected = 0.0
        for step in range(steps):
            terms = []
            for record in records:
                ids = torch.cat([record["prompt_ids"], record["new_ids"]]).long()[None]
                logits = ttt_logits(draft, ids, record["aux_states"][None].float(),
                                    torch.tensor([ids.shape[1]]), steps)[step][0]
                start = len(record["prompt_ids"]) - 1
                for i in range(len(record["new_ids"])):
                    chain = start + i - step
                    if chain < 0:
                        continue
                    log_q = torch.log_softmax(logits[chain].float(), dim=-1)
                    terms.append(-sum(float(p) * float(log_q[rows[int(t)]])
                                      for t, p in zip(record["topk_ids"][i],
                                                      record["topk_probs"][i].float(), strict=True)
                                      if rows[int(t)] >= 0))
            expected += decay ** step * sum(terms) / len(terms)
        expected /= sum(decay ** step for step in range(steps))
    assert abs(loss - expected) < 1e-4 * max(1.0, abs(expected))
