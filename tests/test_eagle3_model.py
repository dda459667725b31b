"""EAGLE-3 drafts in process (specdec.engine.eagle3): the target's layer inputs reach the
draft at the right positions, its own state stands in for what it drafts, and
speculative decoding stays exact."""

from __future__ import annotations

import pytest
import torch
from exact_law import chi_square_pvalue, seeded_samples, target_law
from tiny_models import assert_speculative_greedy_equals_hf, tiny_eagle3_draft, tiny_llama

from specdec.core.history import HiddenSpec
from specdec.core.sampling import SamplingParams
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.engine.steps import SyncPoint, draft_step, verify_step
from specdec.errors import InvalidRequest
from specdec.serving import wire

VOCAB = 32
AUX = (2, 0, 1)  # not sorted: fc reads them in this order


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(1)
    target = tiny_llama(VOCAB, seed=1, layers=3)
    return target, tiny_eagle3_draft(target, seed=2, aux_layer_ids=AUX)


def test_greedy_equals_transformers_generate(models) -> None:
    target, draft = models
    assert_speculative_greedy_equals_hf(target, target, draft, lengths=(1, 3, 6))


def test_greedy_with_a_reduced_draft_vocabulary_and_norm_before_residual() -> None:
    target = tiny_llama(VOCAB, seed=4, layers=4)
    draft = tiny_eagle3_draft(target, seed=5, aux_layer_ids=(2, 2, 1), draft_vocab=12,
                              norm_before_residual=True)
    token_map = ModelRunner(draft, VOCAB).vocab.token_map
    assert token_map is not None and len(set(token_map.tolist())) == 12
    assert token_map.tolist() == (torch.arange(12) + draft.d2t).tolist()
    assert_speculative_greedy_equals_hf(target, target, draft, lengths=(2, 4))


def _layer_inputs(target: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The inputs of AUX's layers side by side, from transformers' own hidden_states
    (hidden_states[i] enters layer i)."""
    with torch.no_grad():
        out = target(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in AUX], dim=-1)


@pytest.mark.parametrize("k", [1, 3])
def test_each_proposal_equals_a_recompute_from_the_target_layer_inputs(models, k: int) -> None:
    """Position p reads fc(target layer inputs at p-1) (zeros before 0); a drafted token
    reads the draft's own state before `norm` at the position before it."""
    target, draft = models
    prompt = [1, 5, 7, 3, 9]
    verify = verify_step(ModelRunner(target), SyncPoint("s", 0, 0, prompt), [], None,
                         SamplingParams(), return_hidden=True, hidden_layers=AUX)
    states = _layer_inputs(target, prompt)
    assert verify.hidden is not None and torch.allclose(verify.hidden, states, atol=1e-5)
    rows = torch.cat([torch.zeros(1, states.shape[1]), states[:-1]])
    proposed = draft_step(ModelRunner(draft, VOCAB), SyncPoint("s", 0, 0, prompt), k,
                          SamplingParams(), target_hidden=rows).tokens
    tokens, inputs = list(prompt), draft.fuse(rows)
    expected = []
    captured: list[torch.Tensor] = []
    hook = draft.model.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    with torch.no_grad():
        for _ in range(k):
            logits = draft(input_ids=torch.tensor([tokens]),
                           target_hidden=inputs.unsqueeze(0)).logits
            token = int(draft.draft_to_target()[logits[0, -1].argmax()])
            expected.append(token)
            tokens.append(token)
            inputs = torch.cat([inputs, captured[-1][0, -1:]])
    hook.remove()
    assert proposed == expected


def test_the_target_layer_inputs_change_the_proposals(models) -> None:
    target, draft = models
    prompt = [1, 5, 7, 3, 9]
    rows = torch.cat([torch.zeros(1, 96), _layer_inputs(target, prompt)[:-1]])
    runner = ModelRunner(draft, VOCAB)
    aligned = draft_step(runner, SyncPoint("a", 0, 0, prompt), 4, SamplingParams(),
                         target_hidden=rows).tokens
    shifted = draft_step(runner, SyncPoint("b", 0, 0, prompt), 4, SamplingParams(),
                         target_hidden=rows.roll(1, dims=0)).tokens
    assert aligned != shifted


def test_sampled_law_matches_target() -> None:
    """Joint law of the first 3 tokens at T=0.7, top-k 4 (8-token vocabulary, a 6-token
    draft vocabulary, 2500 runs, chi-square)."""
    vocab, prompt, length = 8, [1, 5, 2], 3
    params = SamplingParams(temperature=0.7, top_k=4)
    target = tiny_llama(vocab, seed=11, layers=3, logit_scale=0.5)
    draft = tiny_eagle3_draft(target, seed=13, aux_layer_ids=(0, 1, 2), draft_vocab=6,
                              logit_scale=0.5)
    law = target_law(target, prompt, params, length)
    drafter, verifier = LocalDrafter(ModelRunner(draft, vocab)), LocalVerifier(ModelRunner(target))
    assert drafter.target_hidden_spec == HiddenSpec((0, 1, 2), "bfloat16")
    samples, accepted = seeded_samples(drafter, verifier, prompt, params, length)
    assert accepted > 300  # the draft's tokens make up a good part of what was sampled
    assert chi_square_pvalue(samples, law) > 1e-3


def test_runner_checks_widths_and_layers(models) -> None:
    target, draft = models
    runner = ModelRunner(draft, VOCAB)
    assert runner.target_hidden_size == 96  # three layer inputs of 32
    with pytest.raises(InvalidRequest, match=r"\[2, 96\]"):
        runner.extend("s", 0, 0, [1, 2], target_hidden=torch.zeros(2, 32))
    with pytest.raises(InvalidRequest, match=r"\[1, 32\]"):  # its own states: 32 wide
        runner.extend("s", 0, 0, [1], target_hidden=torch.zeros(1, 96), own_hidden=True)
    with pytest.raises(InvalidRequest, match="not among this target's 3 decoder layers"):
        ModelRunner(target).extend("t", 0, 0, [1, 2], hidden_rows=2, hidden_layers=(0, 3))


def test_packed_forward_gives_each_request_its_own_states(models) -> None:
    """Two sessions in one forward, one asking for layer inputs and one for the final
    state, each get what they would alone."""
    from specdec.engine.extend import ExtendRequest

    target, _ = models
    runner = ModelRunner(target)
    for session in ("a", "b"):
        runner.extend(session, 0, 0, [1, 5, 7])
    history = runner._sessions["a"].history
    requests = [ExtendRequest("a", 3, history.fingerprint(), [3, 9], 1, 2, hidden_layers=AUX),
                ExtendRequest("b", 3, history.fingerprint(), [3, 9], 1, 2)]
    batched = runner.extend_batch(requests)
    alone_runner = ModelRunner(target)
    alone = alone_runner.extend("c", 0, 0, [1, 5, 7, 3, 9], hidden_rows=2, hidden_layers=AUX)
    final = alone_runner.extend("d", 0, 0, [1, 5, 7, 3, 9], hidden_rows=2)
    assert torch.allclose(batched[0].hidden, alone.hidden, atol=1e-5)  # type: ignore[union-attr,arg-type]
    assert torch.allclose(batched[1].hidden, final.hidden, atol=1e-5)  # type: ignore[union-attr,arg-type]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_hidden_states_travel_in_the_dtype_asked(dtype: str) -> None:
    rows = torch.randn(3, 8) * 300
    message = wire.encode_hidden(rows, dtype)
    assert len(message.values) == rows.numel() * (4 if dtype == "float32" else 2)
    decoded = wire.decode_hidden(message, 3, 8, "h")
    assert torch.equal(decoded, rows.to(getattr(torch, dtype)).float())
    message.dtype = "int8"
    with pytest.raises(InvalidRequest, match="dtype"):
        wire.decode_hidden(message, 3, 8, "h")


def test_a_state_reading_draft_refeeds_accepted_tokens_with_the_targets_states() -> None:
    """Its cache keeps target-state entries for every committed position (as the
    training-time test trains it): after a round, the next sync point starts where the
    round started, so the accepted tokens go back in with the target's states; a
    token-only draft keeps the tokens it fed."""
    from specdec.core.history import HiddenStateLog, TokenHistory
    from specdec.core.interfaces import CacheMirror

    for reads_states, expected_append in ((True, [7, 8, 9, 4]), (False, [4])):
        committed = TokenHistory([1, 2, 3])
        if reads_states:
            committed.target_hidden = HiddenStateLog(HiddenSpec(AUX, "float32"))
        mirror = CacheMirror()
        assert mirror.plan("s", committed).append == [1, 2, 3]
        mirror.record_proposal(committed, [7, 8, 9, 5])  # 5 was proposed, never fed
        committed.extend([7, 8, 9, 4])  # three accepted, then the target's own token
        sync = mirror.plan("s", committed)
        assert sync.append == expected_append
        assert sync.committed_position == len(committed) - len(expected_append)
