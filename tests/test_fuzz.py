"""Hostile input, property-based (hypothesis): the public GenerateRequest and the internal
Propose, Verify and Release messages with random field values, random bytes in
DraftProbs and HiddenStates, huge or negative positions, unknown sessions, and truncated
or garbage protobuf bytes sent raw. Real servers on loopback, tiny models.

Every call ends with a status code, never UNKNOWN or INTERNAL, the servers never crash,
and after each batch a well-formed generation still returns its reference output.

Examples per message type: SPECDEC_FUZZ_EXAMPLES (default 150 in CI); set it to
1700 for a run of over 10,000 messages. SPECDEC_FUZZ_REPORT=path writes the status
counts there as JSON.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_harness import Services
from tiny_models import tiny_feature_draft, tiny_llama

from coordinator.servicer import CoordinatorSettings
from draft_service.servicer import DraftServicer
from specdec.engine.runner import ModelRunner
from specdec.proto.specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    draft_pb2,
    target_pb2,
)
from specdec.serving.grpc_server import ServerHandle, build_server

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=list(HealthCheck))
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
CALL_TIMEOUT_S = 60.0
COUNTS: dict[str, Counter[str]] = {}

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOAT = st.floats(width=32, allow_nan=True, allow_infinity=True)
SESSION = st.one_of(st.sampled_from(["fz-a", "fz-b", "fz-c", ""]), st.text(max_size=64))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from specdec.engine.models import DEFAULT_TARGET, resolve

    return AutoTokenizer.from_pretrained(resolve(DEFAULT_TARGET, progress=False))


@pytest.fixture(scope="module")
def stack(tokenizer: Any) -> Iterator[tuple[Services, ServerHandle]]:
    """Draft, target and coordinator, plus a feature draft (reads HiddenStates)."""
    torch.set_num_threads(1)
    vocab = len(tokenizer)
    target, draft = tiny_llama(vocab, seed=1), tiny_llama(vocab, seed=2, layers=1)
    services = Services(draft, target, tokenizer=tokenizer,
                        settings=CoordinatorSettings(max_new_tokens_limit=8,
                                                     draft_backoff_initial_s=0.01,
                                                     draft_backoff_max_s=0.05))
    feature = DraftServicer(ModelRunner(tiny_feature_draft(vocab, target_hidden=32),
                                        target_vocab_size=vocab))
    feature_server = build_server([feature.service()])
    yield services, feature_server
    feature_server.stop(0)
    services.close()


def write_report() -> None:
    path = os.environ.get("SPECDEC_FUZZ_REPORT")
    if path:
        totals = {name: dict(counter) for name, counter in sorted(COUNTS.items())}
        with open(path, "w") as handle:
            json.dump({"examples_per_type": EXAMPLES, "counts": totals,
                       "messages": sum(sum(c.values()) for c in COUNTS.values())}, handle,
                      indent=1)


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    totals = {name: dict(counter) for name, counter in sorted(COUNTS.items())}
    print("\nfuzz status counts:", json.dumps(totals, indent=1))


GOOD = coordinator_pb2.GenerateRequest(prompt_token_ids=[1, 5, 7, 3], max_new_tokens=8)


@pytest.fixture(scope="module")
def good_output(stack: tuple[Services, ServerHandle]) -> list[int]:
    return list(stack[0].stub.Generate(GOOD, timeout=CALL_TIMEOUT_S).token_ids)


@pytest.fixture(autouse=True)
def still_served(stack: tuple[Services, ServerHandle], good_output: list[int]) -> Iterator[None]:
    """After each batch: servers alive, and a well-formed generation unchanged."""
    yield
    write_report()
    services, feature = stack
    assert list(services.stub.Generate(GOOD, timeout=CALL_TIMEOUT_S).token_ids) == good_output
    streamed = [t for piece in services.stub.GenerateStream(GOOD, timeout=CALL_TIMEOUT_S)
                for t in piece.token_ids]
    assert streamed == good_output


def call(name: str, channel: grpc.Channel, method: str, payload: Any,
         serializer: Callable[[Any], bytes] | None,
         stream: bool = False) -> None:
    """One call; record its status and fail on UNKNOWN / INTERNAL."""
    if stream:
        callable_: Any = channel.unary_stream(method, request_serializer=serializer,
                                              response_deserializer=None)
    else:
        callable_ = channel.unary_unary(method, request_serializer=serializer,
                                        response_deserializer=None)
    try:
        result = callable_(payload, timeout=CALL_TIMEOUT_S)
        if stream:
            list(result)
        code = grpc.StatusCode.OK
        details = ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    COUNTS.setdefault(name, Counter())[code.name] += 1
    assert code not in FORBIDDEN, f"{method}: {code.name}: {details}\npayload: {payload!r}"
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} hung on {payload!r}"


def serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


# -- strategies -----------------------------------------------------------------------

sampling = st.builds(
    lambda t, k, p, m, seed: common_pb2.SamplingParams(
        temperature=t, top_k=k, top_p=p, min_p=m, **({} if seed is None else {"seed": seed})),
    st.one_of(FLOAT, st.sampled_from([0.0, 0.7, 1.0])), INT32,
    st.one_of(FLOAT, st.just(1.0)), st.one_of(FLOAT, st.just(0.0)),
    st.one_of(st.none(), UINT64))

token_ids = st.lists(st.one_of(INT32, st.integers(0, 60)), max_size=24)


def sync_points(tokens: st.SearchStrategy[list[int]] = token_ids) -> st.SearchStrategy[Any]:
    return st.builds(
        lambda session, position, fingerprint, append: common_pb2.SyncPoint(
            session_id=session, committed_position=position, fingerprint=fingerprint,
            append_tokens=append),
        SESSION, st.one_of(UINT32, st.integers(0, 8)), UINT64, tokens)


def float_bytes(count: int) -> st.SearchStrategy[bytes]:
    return st.lists(FLOAT, max_size=count).map(lambda xs: struct.pack(f"<{len(xs)}f", *xs))


draft_probs = st.one_of(
    st.none(),
    st.builds(lambda rows, values, cols: common_pb2.DraftProbs(dense=common_pb2.DenseProbs(
        num_rows=rows, values=values, column_ids=cols)),
              st.one_of(UINT32, st.integers(0, 4)), st.one_of(st.binary(max_size=256),
                                                             float_bytes(64)),
              st.binary(max_size=64)),
    st.builds(lambda lengths, ids, values: common_pb2.DraftProbs(sparse=common_pb2.SparseProbs(
        row_lengths=lengths, ids=ids, values=values)),
              st.lists(st.one_of(UINT32, st.integers(0, 4)), max_size=6),
              st.binary(max_size=128), st.one_of(st.binary(max_size=128), float_bytes(32))))

hidden_states = st.one_of(
    st.none(),
    st.builds(lambda rows, size, values: common_pb2.HiddenStates(
        num_rows=rows, hidden_size=size, values=values),
              st.one_of(UINT32, st.integers(0, 6)), st.one_of(UINT32, st.just(32)),
              st.binary(max_size=512)))

alternatives = st.one_of(st.none(), st.builds(
    lambda tokens, parents: common_pb2.Alternatives(tokens=tokens, parents=parents),
    token_ids, st.lists(st.one_of(INT32, st.integers(-2, 5)), max_size=8)))


@st.composite
def generate_requests(draw: st.DrawFn) -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest(
        prompt=draw(st.one_of(st.just(""), st.text(max_size=80))),
        prompt_token_ids=draw(st.one_of(st.just([]), token_ids)),
        chat=draw(st.booleans()),
        max_new_tokens=draw(st.one_of(INT32, st.integers(-2, 10))),
        stop=draw(st.lists(st.text(max_size=6), max_size=3)),
        request_id=draw(st.text(max_size=20)))
    for role, content in draw(st.lists(st.tuples(st.sampled_from(["user", "system",
                                                                 "assistant", "", "x"]),
                                                 st.text(max_size=30)), max_size=3)):
        request.messages.add(role=role, content=content)
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling))
    if draw(st.booleans()):
        spec = request.speculation
        spec.num_draft_tokens = draw(st.one_of(INT32, st.integers(-1, 17)))
        spec.adaptive = draw(st.booleans())
        if draw(st.booleans()):
            spec.draft_confidence = draw(FLOAT)
        if draw(st.booleans()):
            spec.num_alternatives = draw(st.one_of(INT32, st.integers(-1, 9)))
        if draw(st.booleans()):
            spec.prompt_lookup_tokens = draw(st.one_of(INT32, st.integers(-1, 9)))
    return request


@st.composite
def propose_requests(draw: st.DrawFn) -> draft_pb2.ProposeRequest:
    request = draft_pb2.ProposeRequest(
        sync=draw(sync_points()), num_tokens=draw(st.one_of(INT32, st.integers(-1, 17))),
        min_confidence=draw(FLOAT), num_alternatives=draw(st.one_of(INT32, st.integers(-1, 9))))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling))
    hidden = draw(hidden_states)
    if hidden is not None:
        request.target_hidden_states.CopyFrom(hidden)
    return request


@st.composite
def verify_requests(draw: st.DrawFn) -> target_pb2.VerifyRequest:
    request = target_pb2.VerifyRequest(
        sync=draw(sync_points()), draft_tokens=draw(token_ids),
        return_hidden_states=draw(st.booleans()))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling))
    probs = draw(draft_probs)
    if probs is not None:
        request.draft_probs.CopyFrom(probs)
    alts = draw(alternatives)
    if alts is not None:
        request.alternatives.CopyFrom(alts)
    return request


# -- the properties -------------------------------------------------------------------

GENERATE = "/specdec.v1.Coordinator/Generate"
GENERATE_STREAM = "/specdec.v1.Coordinator/GenerateStream"
PROPOSE = "/specdec.v1.Draft/Propose"
VERIFY = "/specdec.v1.Target/Verify"
RAW_METHODS = [GENERATE, GENERATE_STREAM, PROPOSE, VERIFY, "/specdec.v1.Draft/Release",
               "/specdec.v1.Target/Release", "/specdec.v1.Draft/Describe"]


@FUZZ
@given(request=generate_requests(), stream=st.booleans())
def test_fuzz_generate(stack, request, stream) -> None:
    services, _ = stack
    call("GenerateRequest", services.channel, GENERATE_STREAM if stream else GENERATE,
         request, serialize, stream=stream)


@FUZZ
@given(request=propose_requests(), feature=st.booleans())
def test_fuzz_propose(stack, request, feature) -> None:
    services, feature_server = stack
    address = feature_server.address if feature else services.draft_endpoint
    with grpc.insecure_channel(address) as channel:
        call("ProposeRequest", channel, PROPOSE, request, serialize)


@FUZZ
@given(request=verify_requests())
def test_fuzz_verify(stack, request) -> None:
    services, _ = stack
    with grpc.insecure_channel(services.target_endpoint) as channel:
        call("VerifyRequest", channel, VERIFY, request, serialize)


@FUZZ
@given(session=SESSION, role=st.sampled_from(["Draft", "Target"]))
def test_fuzz_release(stack, session, role) -> None:
    services, _ = stack
    address = services.draft_endpoint if role == "Draft" else services.target_endpoint
    message = (draft_pb2.DraftReleaseRequest(session_id=session) if role == "Draft"
               else target_pb2.TargetReleaseRequest(session_id=session))
    with grpc.insecure_channel(address) as channel:
        call("ReleaseRequest", channel, f"/specdec.v1.{role}/Release", message, serialize)


@st.composite
def raw_payloads(draw: st.DrawFn) -> tuple[str, bytes]:
    """Garbage bytes, or a valid message's bytes truncated or with bytes flipped."""
    method = draw(st.sampled_from(RAW_METHODS))
    kind = draw(st.sampled_from(["garbage", "truncated", "flipped"]))
    if kind == "garbage":
        return method, draw(st.binary(max_size=300))
    base = {GENERATE: generate_requests(), GENERATE_STREAM: generate_requests(),
            PROPOSE: propose_requests(), VERIFY: verify_requests()}.get(method)
    payload = serialize(draw(base)) if base is not None else serialize(
        draft_pb2.DraftReleaseRequest(session_id=draw(SESSION)))
    if not payload:
        return method, payload
    if kind == "truncated":
        return method, payload[:draw(st.integers(0, len(payload) - 1))]
    index = draw(st.integers(0, len(payload) - 1))
    return method, payload[:index] + bytes([draw(st.integers(0, 255))]) + payload[index + 1:]


@FUZZ
@given(raw=raw_payloads())
def test_fuzz_raw_bytes(stack, raw) -> None:
    services, _ = stack
    method, payload = raw
    address = {"Coordinator": services.coordinator_server.address,
               "Draft": services.draft_endpoint, "Target": services.target_endpoint}[
        method.split("/")[1].split(".")[-1]]
    with grpc.insecure_channel(address) as channel:
        call("raw bytes", channel, method, payload, None,
             stream=method == GENERATE_STREAM)
