"""Feature drafts (specdec.engine.feature_draft): the target's hidden states reach the draft at
the right positions, in process and over gRPC, and speculative decoding stays exact."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from exact_law import chi_square_pvalue, seeded_samples, target_law
from service_harness import Services
from tiny_models import assert_speculative_greedy_equals_hf, tiny_feature_draft, tiny_llama

from specdec.core.history import HiddenStateLog, TokenHistory
from specdec.core.loop import GenerateConfig, RoundEvent, generate
from specdec.core.prompt_lookup import PromptLookup
from specdec.core.sampling import SamplingParams
from specdec.engine.feature_draft import final_norm
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.errors import InvalidRequest
from specdec.proto.specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, draft_pb2_grpc
from specdec.serving import wire

VOCAB = 32
PROMPT = [1, 5, 7, 3]


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(1)
    return tiny_llama(VOCAB, seed=1), tiny_feature_draft(VOCAB, 32, seed=2)


def test_hidden_state_log_rows_before_each_appended_token() -> None:
    log = HiddenStateLog()
    assert log.before(0, 1) is None  # nothing known yet
    log.record(0, torch.arange(12.0).reshape(4, 3))  # positions 0..3
    rows = log.before(0, 3)
    assert rows is not None and rows.tolist() == [[0, 0, 0], [0, 1, 2], [3, 4, 5]]
    rows = log.before(2, 3)  # tokens at 2, 3, 4 read the states at 1, 2, 3
    assert rows is not None and rows[:, 0].tolist() == [3, 6, 9]
    assert log.before(3, 3) is None  # would need position 4
    log.record(2, torch.full((3, 3), -1.0))  # a later call rewrites from position 2
    assert len(log) == 5 and log.before(3, 1).tolist() == [[-1, -1, -1]]  # type: ignore[union-attr]
    log.record(9, torch.zeros(1, 3))  # past a gap: cannot be placed, ignored
    assert len(log) == 5
    history = TokenHistory([1, 2, 3, 4, 5])
    history.target_hidden = log
    history.truncate(2)
    assert len(log) == 2


def test_greedy_equals_transformers_generate(models) -> None:
    target, draft = models
    assert_speculative_greedy_equals_hf(target, target, draft, lengths=(1, 3, 6))


def _target_states(target: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    captured: list[torch.Tensor] = []
    hook = final_norm(target).register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        target(input_ids=torch.tensor([tokens]))
    hook.remove()
    return captured[0][0]


def _draft_last(draft: torch.nn.Module, tokens: list[int], states: torch.Tensor
                ) -> tuple[int, torch.Tensor]:
    captured: list[torch.Tensor] = []
    hook = final_norm(draft).register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        logits = draft(input_ids=torch.tensor([tokens]), target_hidden=states.unsqueeze(0)).logits
    hook.remove()
    return int(logits[0, -1].argmax()), captured[0][0, -1]


@pytest.mark.parametrize("k", [1, 3])
def test_each_proposal_equals_a_full_recompute_from_the_target_states(models, k: int) -> None:
    """Every round's proposal is what the draft gives with no cache at all: each committed
    token paired with the target's state one position before it, each drafted token with
    the draft's own previous state. A row off by one position changes the proposals."""
    target, draft = models
    rounds: list[RoundEvent] = []
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT, GenerateConfig(max_new_tokens=30, num_draft_tokens=k),
                      on_round=rounds.append)
    drafted = [event for event in rounds if event.proposal is not None]
    assert rounds[0].proposal is None  # the first round gives the target's states
    assert len(drafted) >= 8
    sequence = PROMPT + result.token_ids
    for event in drafted:
        tokens = sequence[: event.position_before]
        target_states = _target_states(target, tokens)
        states = torch.cat([torch.zeros(1, target_states.shape[1]), target_states[:-1]])
        expected = []
        for _ in event.proposal.tokens:  # type: ignore[union-attr]
            token, own_state = _draft_last(draft, tokens, states)
            expected.append(token)
            tokens, states = tokens + [token], torch.cat([states, own_state[None]])
        assert event.proposal.tokens == expected, event.index  # type: ignore[union-attr]


def test_misaligned_states_change_the_proposals(models) -> None:
    """The recompute above has power: shifting the states by one position changes them."""
    target, draft = models
    tokens = PROMPT + [9, 4, 11, 2, 30, 6]
    states = _target_states(target, tokens)
    aligned = torch.cat([torch.zeros(1, states.shape[1]), states[:-1]])
    changed = sum(_draft_last(draft, tokens[:n], aligned[:n])[0]
                  != _draft_last(draft, tokens[:n], states[:n])[0]
                  for n in range(2, len(tokens) + 1))
    assert changed >= 3


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=4)],
                         ids=["T0.7_topk4"])
def test_sampled_law_matches_target(params: SamplingParams) -> None:
    """Joint law of the first 3 tokens (8-token vocabulary, 2500 runs, chi-square). One
    setting: what is the feature draft's own (its input of the target's states) is the
    same under every setting, whose processing tests/test_exactness.py checks."""
    vocab, prompt, length = 8, [1, 5, 2], 3
    target = tiny_llama(vocab, seed=11, logit_scale=0.5)
    draft = tiny_feature_draft(vocab, 32, seed=13, logit_scale=0.5)
    law = target_law(target, prompt, params, length)
    drafter, verifier = LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target))
    samples, drafted = seeded_samples(drafter, verifier, prompt, params, length)
    assert drafted > 500  # the draft's tokens make up a good part of what was sampled
    assert chi_square_pvalue(samples, law) > 1e-3


def test_runner_refuses_missing_or_misshapen_states(models) -> None:
    _, draft = models
    runner = ModelRunner(draft)
    with pytest.raises(InvalidRequest, match="hidden states"):
        runner.extend("s", 0, 0, [1, 2])
    with pytest.raises(InvalidRequest, match=r"\[2, 32\]"):
        runner.extend("s", 0, 0, [1, 2], target_hidden=torch.zeros(3, 32))
    with pytest.raises(InvalidRequest, match="does not read them"):
        ModelRunner(tiny_llama(VOCAB)).extend("s", 0, 0, [1], target_hidden=torch.zeros(1, 32))


def test_hidden_states_wire_round_trip_and_checks() -> None:
    rows = torch.randn(3, 8)
    message = wire.encode_hidden(rows)
    decoded = wire.decode_hidden(message, 3, 8, "h")
    assert torch.allclose(decoded, rows.half().float())
    with pytest.raises(InvalidRequest, match="3 rows of 4"):
        wire.decode_hidden(message, 3, 4, "h")
    bad = common_pb2.HiddenStates(num_rows=1, hidden_size=2, values=b"\x00\x7e\x00\x00")  # NaN
    with pytest.raises(InvalidRequest, match="finite"):
        wire.decode_hidden(bad, 1, 2, "h")


# -- over gRPC ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def services(models) -> Iterator[Services]:
    target, draft = models
    stack = Services(draft, target)
    yield stack
    stack.close()


def _request(k: int, **sampling: float) -> coordinator_pb2.GenerateRequest:
    message = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=30)
    message.speculation.num_draft_tokens = k
    # The in-process loop below has prompt lookup and no suffix cache: the same sources.
    message.speculation.suffix_tokens = 0
    if sampling:
        message.sampling.CopyFrom(common_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]
    return message


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 5}],
                         ids=["greedy", "sampled"])
def test_over_grpc_equals_the_in_process_loop(services, models, sampling) -> None:
    target, draft = models
    response = services.stub.Generate(_request(3, **sampling), timeout=30)
    local = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                     PROMPT, GenerateConfig(max_new_tokens=30, num_draft_tokens=3,
                                            sampling=SamplingParams(**sampling),
                                            prompt_lookup=PromptLookup(VOCAB)))
    assert list(response.token_ids) == local.token_ids
    assert response.stats.draft_tokens == local.stats.draft_tokens > 0
    assert response.stats.accepted_tokens == local.stats.accepted_tokens
    assert not response.stats.degraded


def _assert_invalid(stub: draft_pb2_grpc.DraftStub, request: draft_pb2.ProposeRequest,
                    needle: str) -> None:
    with pytest.raises(grpc.RpcError) as error:
        stub.Propose(request, timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in error.value.details()


def test_draft_service_describes_itself_and_checks_the_states(services) -> None:
    stub = draft_pb2_grpc.DraftStub(grpc.insecure_channel(services.draft_endpoint))
    assert stub.Describe(draft_pb2.DescribeRequest(), timeout=5).target_hidden_size == 32
    sync = common_pb2.SyncPoint(session_id="x", committed_position=0, append_tokens=[1, 2])
    _assert_invalid(stub, draft_pb2.ProposeRequest(sync=sync, num_tokens=2),
                    "target_hidden_states")
    _assert_invalid(stub, draft_pb2.ProposeRequest(
        sync=sync, num_tokens=2, target_hidden_states=wire.encode_hidden(torch.zeros(1, 32))),
        "2 rows of 32")
    right = draft_pb2.ProposeRequest(sync=sync, num_tokens=2,
                                     target_hidden_states=wire.encode_hidden(torch.zeros(2, 32)))
    assert len(stub.Propose(right, timeout=5).tokens) == 2


def test_token_only_draft_refuses_states() -> None:
    torch.set_num_threads(1)
    stack = Services(tiny_llama(VOCAB, seed=3, layers=1), tiny_llama(VOCAB, seed=1))
    try:
        stub = draft_pb2_grpc.DraftStub(grpc.insecure_channel(stack.draft_endpoint))
        assert stub.Describe(draft_pb2.DescribeRequest(), timeout=5).target_hidden_size == 0
        sync = common_pb2.SyncPoint(session_id="x", committed_position=0, append_tokens=[1])
        _assert_invalid(stub, draft_pb2.ProposeRequest(
            sync=sync, num_tokens=1, target_hidden_states=wire.encode_hidden(torch.zeros(1, 32))),
            "does not read them")
    finally:
        stack.close()


def test_training_objective_learns_on_the_target_states() -> None:
    """A few optimiser steps on records shaped like the pipeline's lower the loss, and
    both its parts are finite; the frozen embeddings do not move."""
    from specdec.draft_training.feature_train import feature_draft_loss

    torch.manual_seed(0)
    target = tiny_llama(VOCAB, seed=1)
    draft = tiny_feature_draft(VOCAB, 32, seed=2)
    draft.model.embed_tokens.weight.requires_grad_(False)
    frozen = draft.model.embed_tokens.weight.clone()
    records = []
    for _ in range(6):
        sequence = torch.randint(3, VOCAB, (14,))
        states = _target_states(target, sequence.tolist())
        with torch.no_grad():
            probs = torch.softmax(target(input_ids=sequence[None]).logits[0], -1)
        top = probs[5:13].topk(4, dim=-1)  # continuation tokens 6..13, predicted at 5..12
        records.append({"prompt_ids": sequence[:6], "new_ids": sequence[6:],
                        "topk_ids": top.indices, "topk_probs": top.values.half(),
                        "hidden": states.half()})
    input_map = torch.arange(VOCAB + 1)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=3e-3)
    draft.train()
    first, cross_entropy, regression = feature_draft_loss(draft, records, input_map, VOCAB - 1)
    for _ in range(40):
        loss, cross_entropy, regression = feature_draft_loss(draft, records, input_map,
                                                             VOCAB - 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.7 * float(first.detach())
    assert cross_entropy > 0 and regression > 0
    assert torch.equal(draft.model.embed_tokens.weight, frozen)


def test_a_feature_draft_built_from_a_token_draft_starts_as_that_draft(tmp_path) -> None:
    """fc = [identity | 0]: whatever the target's states, the logits are the token draft's,
    so training starts from its acceptance and only adds what the states tell."""
    from specdec.draft_training.feature_train import feature_draft_from_token_draft
    from specdec.engine.feature_draft import TARGET_HIDDEN_SCALE_KEY

    token_draft = tiny_llama(VOCAB, seed=5, layers=2)
    token_draft.save_pretrained(tmp_path / "token")
    draft = feature_draft_from_token_draft(str(tmp_path / "token"), 48, target_hidden_rms=20.0)
    ids = torch.tensor([PROMPT + [9, 4, 11]])
    with torch.no_grad():
        expected = token_draft(input_ids=ids).logits
        got = draft(input_ids=ids, target_hidden=torch.randn(1, ids.shape[1], 48) * 20).logits
    assert torch.allclose(got, expected, atol=1e-5)
    embed_rms = float(token_draft.model.embed_tokens.weight.detach().pow(2).mean().sqrt())
    assert getattr(draft.config, TARGET_HIDDEN_SCALE_KEY) == pytest.approx(embed_rms / 20.0)
    assert not draft.model.embed_tokens.weight.requires_grad
