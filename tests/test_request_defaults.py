"""What a request's `speculation` means: adaptive by default, target-only reachable,
meaningless combinations rejected (coordinator.validation, then over real gRPC)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from service_harness import Services
from tiny_models import tiny_llama

from coordinator.servicer import CoordinatorSettings
from coordinator.validation import Limits, validate
from specdec.errors import InvalidRequest
from specdec.proto.specdec.v1 import coordinator_pb2

LIMITS = Limits(64, 256, 100, 16, 5, default_draft_confidence=0.4,
                default_lookup_tokens=6)


def request(**speculation: object) -> coordinator_pb2.GenerateRequest:
    message = coordinator_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=4)
    for name, value in speculation.items():
        setattr(message.speculation, name, value)
    return message


def mode(**speculation: object) -> tuple[int, bool]:
    valid = validate(request(**speculation), LIMITS, None)
    return valid.num_draft_tokens, valid.adaptive


def test_no_speculation_is_adaptive_from_the_default_length() -> None:
    assert mode() == (5, True)


def test_adaptive_alone_starts_from_the_default_length() -> None:
    # The reported fault: {"adaptive": true} ran target-only (length 0).
    assert mode(adaptive=True) == (5, True)
    assert mode(adaptive=True, num_draft_tokens=3) == (3, True)


def test_an_empty_or_partial_speculation_takes_the_defaults() -> None:
    # The reported trap: a present `speculation` with num_draft_tokens unset ran
    # target-only; every unset field is the coordinator's default now.
    assert mode() == mode(draft_confidence=0.3) == mode(num_alternatives=2) == (5, True)
    assert mode(prompt_lookup_tokens=4) == mode(method="auto") == (5, True)
    assert mode(adaptive=False) == (5, False)  # a fixed length, the default one
    empty = coordinator_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=4)
    empty.speculation.SetInParent()
    valid = validate(empty, LIMITS, None)
    assert (valid.num_draft_tokens, valid.adaptive, valid.method) == (5, True, "auto")


def test_target_only_is_asked_for_explicitly() -> None:
    for fields in (dict(num_draft_tokens=0), dict(method="none")):
        valid = validate(request(**fields), LIMITS, None)
        assert (valid.num_draft_tokens, valid.adaptive, valid.method) == (0, False, "none")


@pytest.mark.parametrize("method", ["auto", "draft", "lookup"])
def test_each_method_is_speculative(method: str) -> None:
    valid = validate(request(method=method), LIMITS, None)
    assert (valid.num_draft_tokens, valid.adaptive, valid.method) == (5, True, method)


def test_a_length_without_adaptive_is_fixed_and_zero_is_target_only() -> None:
    assert mode(num_draft_tokens=3) == (3, False)
    assert mode(num_draft_tokens=0) == (0, False)
    assert mode(num_draft_tokens=0, num_alternatives=0) == (0, False)


@pytest.mark.parametrize("fields, named", [
    (dict(num_draft_tokens=-1), "speculation.num_draft_tokens"),
    (dict(num_draft_tokens=-1, adaptive=True), "speculation.num_draft_tokens"),
    (dict(num_draft_tokens=17, adaptive=True), "speculation.num_draft_tokens"),
    (dict(num_draft_tokens=0, draft_confidence=0.3), "speculation.draft_confidence"),
    (dict(num_draft_tokens=0, num_alternatives=2), "speculation.num_alternatives"),
    (dict(num_draft_tokens=0, max_alternative_depth=1), "speculation.max_alternative_depth"),
    (dict(num_draft_tokens=0, prompt_lookup_tokens=4), "speculation.prompt_lookup_tokens"),
    (dict(method="none", prompt_lookup_tokens=4), "speculation.prompt_lookup_tokens"),
    (dict(method="none", num_draft_tokens=3), "speculation.num_draft_tokens"),
    (dict(method="none", adaptive=True), "speculation.adaptive"),
    (dict(method="draft", num_draft_tokens=0), "speculation.method"),
    (dict(method="lookup", prompt_lookup_tokens=0), "speculation.method"),
    (dict(method="suffix"), "speculation.method"),  # off in LIMITS
    (dict(method="Suffix"), "speculation.method must be one of auto, draft"),
])
def test_meaningless_speculation_is_rejected_naming_the_field(
        fields: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidRequest, match=named):
        validate(request(**fields), LIMITS, None)


SUFFIX_LIMITS = Limits(64, 256, 100, 16, 5, default_suffix_tokens=12)


def test_suffix_tokens_default_to_the_coordinators_and_a_request_may_lower_them() -> None:
    assert validate(request(), SUFFIX_LIMITS, None).suffix_tokens == 12
    assert validate(request(suffix_tokens=4), SUFFIX_LIMITS, None).suffix_tokens == 4
    assert validate(request(suffix_tokens=0), SUFFIX_LIMITS, None).suffix_tokens == 0
    assert validate(request(), LIMITS, None).suffix_tokens == 0  # off on the coordinator


@pytest.mark.parametrize("fields, limits, named", [
    (dict(suffix_tokens=13), SUFFIX_LIMITS, r"suffix_tokens must be in \[0, 12\]"),
    (dict(suffix_tokens=-1), SUFFIX_LIMITS, "suffix_tokens must be in"),
    (dict(suffix_tokens=2), LIMITS, "suffix decoding is off"),
    (dict(method="suffix", suffix_tokens=0), SUFFIX_LIMITS, "needs suffix_tokens > 0"),
    (dict(num_draft_tokens=0, suffix_tokens=3), SUFFIX_LIMITS, "speculation.suffix_tokens"),
])
def test_bad_suffix_tokens_are_rejected_naming_the_field(
        fields: dict[str, object], limits: Limits, named: str) -> None:
    with pytest.raises(InvalidRequest, match=named):
        validate(request(**fields), limits, None)


def test_a_cache_salt_is_bounded() -> None:
    message = request()
    message.cache_salt = "s" * 256
    validate(message, LIMITS, None)
    message.cache_salt = "s" * 257
    with pytest.raises(InvalidRequest, match="cache_salt must be at most 256 bytes"):
        validate(message, LIMITS, None)


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    torch.set_num_threads(1)
    stack = Services(tiny_llama(16, seed=2, layers=1), tiny_llama(16, seed=1),
                     settings=CoordinatorSettings(num_draft_tokens=3))
    yield stack
    stack.close()


def test_over_grpc_the_default_drafts_and_target_only_does_not(services: Services) -> None:
    # Before the adaptive policy has measured each length it tries them, so the first
    # requests draft even where (as with these tiny models) drafting does not pay.
    adaptive = services.stub.Generate(request(adaptive=True), timeout=30)
    assert adaptive.stats.draft_tokens > 0
    default = services.stub.Generate(coordinator_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3], max_new_tokens=12), timeout=30)
    assert default.stats.draft_tokens > 0
    target_only = services.stub.Generate(request(num_draft_tokens=0), timeout=30)
    assert target_only.stats.draft_tokens == 0 and target_only.stats.rounds > 0
    with pytest.raises(grpc.RpcError) as error:
        services.stub.Generate(request(num_draft_tokens=0, num_alternatives=1), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "target-only" in (error.value.details() or "")
