"""Bad input to each service: INVALID_ARGUMENT naming the field, never a crash."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator

import grpc
import pytest
import torch
from service_harness import Services
from tiny_models import tiny_llama

from coordinator.servicer import CoordinatorSettings
from specdec.core.history import TokenHistory
from specdec.proto.specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

VOCAB = 32
CONTEXT = 256  # tiny_llama's max_position_embeddings
LIMIT = 100


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    torch.set_num_threads(1)
    stack = Services(tiny_llama(VOCAB, seed=2, layers=1), tiny_llama(VOCAB, seed=1),
                     settings=CoordinatorSettings(max_new_tokens_limit=LIMIT))
    yield stack
    stack.close()


def generate_request(**fields: object) -> coordinator_pb2.GenerateRequest:
    message = coordinator_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8)
    for name, value in fields.items():
        if name.startswith("sampling_"):
            setattr(message.sampling, name.removeprefix("sampling_"), value)
        elif name in ("num_draft_tokens", "draft_confidence", "num_alternatives",
                      "prompt_lookup_tokens", "max_alternative_depth"):
            setattr(message.speculation, name, value)
        elif name in ("prompt_token_ids", "stop"):
            field = getattr(message, name)
            del field[:]
            field.extend(value)
        else:
            setattr(message, name, value)
    return message


INVALID = {
    "empty prompt": (dict(prompt_token_ids=[]), "prompt"),
    "both prompts": (dict(prompt="hello"), "not both"),
    "max_new_tokens 0": (dict(max_new_tokens=0), "max_new_tokens"),
    "max_new_tokens < 0": (dict(max_new_tokens=-5), "max_new_tokens"),
    "max_new_tokens over the limit": (dict(max_new_tokens=LIMIT + 1), "max_new_tokens"),
    "prompt longer than the context": (dict(prompt_token_ids=[1] * (CONTEXT + 1)),
                                       "prompt_token_ids"),
    "prompt + max_new_tokens over the context": (dict(prompt_token_ids=[1] * (CONTEXT - 4),
                                                      max_new_tokens=10), "max_new_tokens"),
    "temperature < 0": (dict(sampling_temperature=-0.5), "sampling.temperature"),
    "temperature NaN": (dict(sampling_temperature=math.nan), "sampling.temperature"),
    "temperature inf": (dict(sampling_temperature=math.inf), "sampling.temperature"),
    "top_p > 1": (dict(sampling_temperature=1.0, sampling_top_p=1.5), "sampling.top_p"),
    "top_p < 0": (dict(sampling_temperature=1.0, sampling_top_p=-0.1), "sampling.top_p"),
    "top_p NaN": (dict(sampling_temperature=1.0, sampling_top_p=math.nan), "sampling.top_p"),
    "top_k < 0": (dict(sampling_temperature=1.0, sampling_top_k=-1), "sampling.top_k"),
    "min_p NaN": (dict(sampling_temperature=1.0, sampling_min_p=math.nan), "sampling.min_p"),
    "token id >= vocab": (dict(prompt_token_ids=[1, VOCAB]), "prompt_token_ids[1]"),
    "token id < 0": (dict(prompt_token_ids=[-1, 2]), "prompt_token_ids[0]"),
    "num_draft_tokens < 0": (dict(num_draft_tokens=-1), "speculation.num_draft_tokens"),
    "num_draft_tokens too large": (dict(num_draft_tokens=1000), "speculation.num_draft_tokens"),
    "draft_confidence > 1": (dict(draft_confidence=1.5), "speculation.draft_confidence"),
    "draft_confidence < 0": (dict(draft_confidence=-0.1), "speculation.draft_confidence"),
    "draft_confidence NaN": (dict(draft_confidence=math.nan), "speculation.draft_confidence"),
    "num_alternatives < 0": (dict(num_alternatives=-1), "speculation.num_alternatives"),
    "num_alternatives too large": (dict(num_alternatives=1000),
                                   "speculation.num_alternatives"),
    "max_alternative_depth < 0": (dict(max_alternative_depth=-1),
                                  "speculation.max_alternative_depth"),
    "prompt_lookup_tokens < 0": (dict(prompt_lookup_tokens=-1),
                                 "speculation.prompt_lookup_tokens"),
    "prompt_lookup_tokens too large": (dict(prompt_lookup_tokens=17),
                                       "speculation.prompt_lookup_tokens must be in [0, 16]"),
    "chat with token ids": (dict(chat=True), "chat"),
    "text without a tokenizer": (dict(prompt_token_ids=[], prompt="hi"), "prompt"),
    "stop without a tokenizer": (dict(stop=["x"]), "stop"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_generate_requests(services, case: str) -> None:
    fields, named = INVALID[case]
    message = generate_request(**fields)
    for call in (services.stub.Generate, lambda m, timeout: list(
            services.stub.GenerateStream(m, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as caught:
            call(message, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert named in caught.value.details()


def test_services_still_work_after_bad_requests(services) -> None:
    response = services.stub.Generate(generate_request(), timeout=10)
    assert len(response.token_ids) == 8


# -- the model services, called directly ------------------------------------------------
def sync(tokens: list[int], session: str = "s", position: int = 0) -> common_pb2.SyncPoint:
    return common_pb2.SyncPoint(session_id=session, committed_position=position,
                                fingerprint=TokenHistory(tokens).fingerprint(position),
                                append_tokens=tokens[position:])


def sampled(seed: int | None = 1) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(temperature=1.0)
    if seed is not None:
        params.seed = seed
    return params


def dense(rows: list[list[float]]) -> common_pb2.DraftProbs:
    flat = [v for row in rows for v in row]
    return common_pb2.DraftProbs(dense=common_pb2.DenseProbs(
        num_rows=len(rows), values=struct.pack(f"<{len(flat)}f", *flat)))


def uniform(n: int) -> list[list[float]]:
    return [[1.0 / VOCAB] * VOCAB for _ in range(n)]


def propose_cases() -> dict[str, tuple[draft_pb2.ProposeRequest, str]]:
    return {
        "no session id": (draft_pb2.ProposeRequest(
            sync=common_pb2.SyncPoint(append_tokens=[1]), num_tokens=2), "session_id"),
        "num_tokens 0": (draft_pb2.ProposeRequest(sync=sync([1, 2]), num_tokens=0),
                         "num_tokens"),
        "num_tokens huge": (draft_pb2.ProposeRequest(sync=sync([1, 2]), num_tokens=10_000),
                            "num_tokens"),
        "token out of vocab": (draft_pb2.ProposeRequest(sync=sync([1, 99]), num_tokens=2),
                               "append_tokens[1]"),
        "min_confidence > 1": (draft_pb2.ProposeRequest(
            sync=sync([1, 2]), num_tokens=2, min_confidence=1.5), "min_confidence"),
        "min_confidence NaN": (draft_pb2.ProposeRequest(
            sync=sync([1, 2]), num_tokens=2, min_confidence=math.nan), "min_confidence"),
        "sampled without seed": (draft_pb2.ProposeRequest(
            sync=sync([1, 2]), num_tokens=2, sampling=sampled(None)), "seed"),
        "temperature NaN": (draft_pb2.ProposeRequest(
            sync=sync([1, 2]), num_tokens=2,
            sampling=common_pb2.SamplingParams(temperature=math.nan)), "temperature"),
        "num_alternatives huge": (draft_pb2.ProposeRequest(
            sync=sync([1, 2]), num_tokens=2, num_alternatives=1000), "num_alternatives"),
        "max_alternative_depth < 0": (draft_pb2.ProposeRequest(
            sync=sync([1, 2]), num_tokens=2, num_alternatives=2, max_alternative_depth=-1),
            "max_alternative_depth"),
    }


@pytest.mark.parametrize("case", sorted(propose_cases()))
def test_invalid_propose(services, case: str) -> None:
    message, named = propose_cases()[case]
    with grpc.insecure_channel(services.draft_endpoint) as channel, \
            pytest.raises(grpc.RpcError) as caught:
        draft_pb2_grpc.DraftStub(channel).Propose(message, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in caught.value.details()


def verify_cases() -> dict[str, tuple[target_pb2.VerifyRequest, str]]:
    def verify(probs: common_pb2.DraftProbs | None, tokens: list[int] = [3, 4],  # noqa: B006
               **kw: object) -> target_pb2.VerifyRequest:
        message = target_pb2.VerifyRequest(sync=sync([1, 2], session="v"), draft_tokens=tokens,
                                           sampling=sampled(), **kw)  # type: ignore[arg-type]
        if probs is not None:
            message.draft_probs.CopyFrom(probs)
        return message

    nan_rows = uniform(2)
    nan_rows[1][4] = math.nan
    zero_at_token = uniform(2)
    zero_at_token[0][3] = 0.0
    return {
        "q missing": (verify(None), "draft_probs"),
        "q NaN": (verify(dense(nan_rows)), "finite"),
        "q negative": (verify(dense([[-1.0] * VOCAB] * 2)), "non-negative"),
        "q wrong rows": (verify(dense(uniform(3))), "rows"),
        "q ragged bytes": (verify(common_pb2.DraftProbs(dense=common_pb2.DenseProbs(
            num_rows=2, values=b"\x00" * 7))), "float32"),
        "q zero at the draft token": (verify(dense(zero_at_token)), "probability 0"),
        "q sparse id out of vocab": (verify(common_pb2.DraftProbs(sparse=common_pb2.SparseProbs(
            row_lengths=[1, 1], ids=struct.pack("<2i", 3, VOCAB),
            values=struct.pack("<2f", 1.0, 1.0)))), "sparse.ids"),
        "draft token out of vocab": (verify(dense(uniform(2)), tokens=[3, VOCAB + 5]),
                                     "draft_tokens[1]"),
        "too many draft tokens": (verify(None, tokens=[3] * 1000), "draft_tokens"),
        "tree without q for a node with children": (verify(
            dense(uniform(2)), alternatives=alternatives([5, 6], [-1, 2])), "3 equal rows"),
        "alternatives without parents": (greedy_verify(alternatives([5, 6], [-1])), "parents"),
        "alternative parent below the prefix": (greedy_verify(alternatives([5], [-2])),
                                                "outside"),
        "alternative parent past the tree": (greedy_verify(alternatives([5], [2])), "outside"),
        "alternative out of vocab": (greedy_verify(alternatives([5, VOCAB], [-1, 0])),
                                     "alternatives.tokens[1]"),
        "too many alternatives": (greedy_verify(alternatives([5] * 17, [-1] * 17)),
                                  "alternatives"),
    }


def alternatives(tokens: list[int], parents: list[int]) -> common_pb2.Alternatives:
    return common_pb2.Alternatives(tokens=tokens, parents=parents)


def greedy_verify(alternatives: common_pb2.Alternatives) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(sync=sync([1, 2], session="v"), draft_tokens=[3, 4],
                                    alternatives=alternatives)


@pytest.mark.parametrize("case", sorted(verify_cases()))
def test_invalid_verify(services, case: str) -> None:
    message, named = verify_cases()[case]
    with grpc.insecure_channel(services.target_endpoint) as channel, \
            pytest.raises(grpc.RpcError) as caught:
        target_pb2_grpc.TargetStub(channel).Verify(message, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in caught.value.details()


def test_unknown_session_is_failed_precondition(services) -> None:
    with grpc.insecure_channel(services.target_endpoint) as channel, \
            pytest.raises(grpc.RpcError) as caught:
        target_pb2_grpc.TargetStub(channel).Verify(target_pb2.VerifyRequest(
            sync=sync([1, 2, 3], session="never-seen", position=2)), timeout=10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "position 0" in caught.value.details()


def test_direct_verify_and_release(services) -> None:
    with grpc.insecure_channel(services.target_endpoint) as channel:
        stub = target_pb2_grpc.TargetStub(channel)
        reply = stub.Verify(target_pb2.VerifyRequest(
            sync=sync([1, 2], session="ok"), draft_tokens=[3, 4], draft_probs=dense(uniform(2)),
            sampling=sampled()), timeout=10)
        assert 0 <= reply.accepted_len <= 2 and reply.kv_length == 4
        assert stub.Release(target_pb2.TargetReleaseRequest(session_id="ok")).released
        assert not stub.Release(target_pb2.TargetReleaseRequest(session_id="ok")).released
