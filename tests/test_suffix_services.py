"""Suffix decoding through real services: every method's greedy output equals
target-only, the global cache fills per tenant, and the API's `method` field over gRPC
and HTTP (bad values refused with an actionable message)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from service_harness import Services, target_info
from tiny_models import tiny_llama

from coordinator.endpoints import StaticEndpoints
from coordinator.servicer import CoordinatorServicer, CoordinatorSettings
from coordinator.validation import validate
from specdec.proto.specdec.v1 import coordinator_pb2
from specdec.serving.http_api.parsing import ApiError, parse

VOCAB = 64
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6] * 2


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    torch.set_num_threads(1)
    stack = Services(tiny_llama(VOCAB, seed=4, layers=1), tiny_llama(VOCAB, seed=25),
                     settings=CoordinatorSettings(num_draft_tokens=3, suffix_max_tokens=16))
    yield stack
    stack.close()


def generate(services: Services, **speculation: object) -> coordinator_pb2.GenerateResponse:
    message = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24)
    for name, value in speculation.items():
        setattr(message.speculation, name, value)
    if not speculation:
        message.speculation.SetInParent()  # present and empty
    return services.stub.Generate(message, timeout=60)


def test_every_method_gives_the_target_only_output(services: Services) -> None:
    target_only = generate(services, method="none")
    assert target_only.stats.draft_tokens == 0
    assert generate(services, num_draft_tokens=0).token_ids == target_only.token_ids
    # The first requests fill the global tree; later ones propose from it.
    for method in ("suffix", "auto", "draft", "lookup", "suffix"):
        response = generate(services, method=method)
        assert list(response.token_ids) == list(target_only.token_ids), method
        stats = response.stats
        if method == "draft":
            assert stats.suffix_drafts == stats.lookup_drafts == 0 < stats.num_drafts
        if method == "lookup":
            assert stats.suffix_drafts == 0 and stats.num_drafts == stats.lookup_drafts
        if method == "suffix":
            assert stats.lookup_drafts == 0 and stats.num_drafts == stats.suffix_drafts
    # The last suffix request saw the same answer before: most of it came from the cache.
    assert stats.suffix_accepted_tokens >= 12, stats
    assert services.coordinator.suffix_cache.usage().requests >= 7  # every response


def test_an_empty_speculation_message_speculates(services: Services) -> None:
    response = generate(services)
    assert response.stats.draft_tokens > 0
    partial = generate(services, prompt_lookup_tokens=0)  # only one field set
    assert partial.stats.draft_tokens > 0 and partial.stats.lookup_drafts == 0


@pytest.mark.parametrize("fields, named", [
    (dict(method="fast"), "speculation.method must be one of auto, draft, suffix, lookup"),
    (dict(method="suffix", num_draft_tokens=0), "speculation.method 'suffix'"),
    (dict(method="none", num_alternatives=2), "speculation.num_alternatives"),
])
def test_bad_methods_are_invalid_argument(services: Services, fields: dict[str, object],
                                          named: str) -> None:
    with pytest.raises(grpc.RpcError) as error:
        generate(services, **fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (error.value.details() or "")


def test_suffix_off_refuses_the_suffix_method() -> None:
    stack = Services(None, tiny_llama(VOCAB, seed=25),
                     settings=CoordinatorSettings(suffix_max_tokens=0))
    try:
        with pytest.raises(grpc.RpcError) as error:
            generate(stack, method="suffix")
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "SPECDEC_SUFFIX_MAX_TOKENS" in (error.value.details() or "")
        assert generate(stack, method="auto").stats.suffix_drafts == 0
    finally:
        stack.close()


def test_the_running_requests_trees_are_counted_while_they_run(services: Services) -> None:
    coordinator = services.coordinator
    seen: list[int] = []
    request = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24)
    request.speculation.method = "suffix"
    coordinator.run(validate(request, coordinator.limits, None), "r", None, lambda: False,
                    on_event=lambda event: seen.append(coordinator.request_trees_bytes()))
    assert seen and all(size > 0 for size in seen)  # the request's own tree, in every round
    assert coordinator.request_trees_bytes() == 0  # and none once it ended


@pytest.mark.parametrize(("setting", "value", "names"), [
    ("suffix_prompt_tokens", -1, "suffix prompt tokens"),
    ("suffix_max_spec_factor", 0.0, "suffix max spec factor"),
    ("suffix_min_token_prob", 1.5, "suffix min token probability"),
])
def test_a_bad_suffix_setting_stops_the_coordinator_at_start(setting: str, value: object,
                                                             names: str) -> None:
    with pytest.raises(ValueError, match=names):
        CoordinatorServicer(target_info(tiny_llama(VOCAB, seed=25), ()),
                            StaticEndpoints("127.0.0.1:1", None),
                            settings=CoordinatorSettings(**{setting: value}))


class Metadata:
    """The part of a ServicerContext the tenant reads."""

    def __init__(self, *pairs: tuple[str, str]) -> None:
        self.pairs = pairs

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.pairs


def test_tenants_are_api_keys_unless_sharing_is_on(services: Services) -> None:
    tenant = services.coordinator.tenant
    alice = tenant(Metadata(("authorization", "Bearer alice-key")))  # type: ignore[arg-type]
    bob = tenant(Metadata(("authorization", "Bearer bob-key")))  # type: ignore[arg-type]
    assert alice != bob and "alice-key" not in alice
    assert tenant(Metadata()) == ""  # type: ignore[arg-type]
    settings = services.coordinator.settings
    try:
        object.__setattr__(settings, "suffix_share_tenants", True)
        assert tenant(Metadata(("authorization", "Bearer alice-key"))) == ""  # type: ignore[arg-type]
    finally:
        object.__setattr__(settings, "suffix_share_tenants", False)


def test_a_cache_salt_narrows_the_tenant_also_when_tenants_share(services: Services) -> None:
    tenant = services.coordinator.tenant
    alice = Metadata(("authorization", "Bearer alice-key"))
    salted = {tenant(alice, salt) for salt in ("", "a", "b")}  # type: ignore[arg-type]
    assert len(salted) == 3
    assert tenant(alice, "a") == tenant(alice, "a")  # type: ignore[arg-type]
    assert tenant(Metadata(), "a") != tenant(alice, "a")  # type: ignore[arg-type]
    settings = services.coordinator.settings
    try:
        object.__setattr__(settings, "suffix_share_tenants", True)
        assert tenant(alice, "a") == tenant(Metadata(), "a") != ""  # type: ignore[arg-type]
    finally:
        object.__setattr__(settings, "suffix_share_tenants", False)


def test_a_salted_response_speculates_only_for_its_own_salt(services: Services) -> None:
    """The second identical greedy request finds the first's answer under the same salt;
    under a new salt the suffix cache holds none of it."""
    def run(salt: str) -> coordinator_pb2.GenerateResponse:
        message = coordinator_pb2.GenerateRequest(
            prompt_token_ids=[5, 9, 2, 7], max_new_tokens=24, cache_salt=salt,
            speculation=coordinator_pb2.SpeculationParams(method="suffix"))
        return services.stub.Generate(message, timeout=60)

    first = run("salt-one")
    again = run("salt-one")
    fresh = run("salt-two")
    assert list(first.token_ids) == list(again.token_ids) == list(fresh.token_ids)
    assert again.stats.suffix_accepted_tokens >= len(first.token_ids) // 2
    assert fresh.stats.suffix_accepted_tokens < again.stats.suffix_accepted_tokens


# -- HTTP: OpenAI-style extra fields ----------------------------------------------------
def parsed(**body: object) -> coordinator_pb2.GenerateRequest:
    return parse({"prompt": "hi", **body}, chat=False, served_model="m",
                 default_max_tokens=8, request_id="r").generate


def test_http_fields_left_out_take_the_coordinators_defaults() -> None:
    assert not parsed().HasField("speculation")
    request = parsed(speculation_method="suffix")
    assert request.speculation.method == "suffix"
    assert not request.speculation.HasField("num_draft_tokens")
    assert not request.speculation.HasField("adaptive")
    adaptive = parsed(adaptive=True)  # the default length, adaptive
    assert adaptive.speculation.adaptive and not adaptive.speculation.HasField(
        "num_draft_tokens")
    target_only = parsed(num_draft_tokens=0)
    assert target_only.speculation.HasField("num_draft_tokens")


def test_http_cache_salt_reaches_the_request_and_must_be_a_string() -> None:
    assert parsed(cache_salt="tenant-7").cache_salt == "tenant-7"
    with pytest.raises(ApiError) as caught:
        parsed(cache_salt=7)
    assert caught.value.status == 400 and caught.value.param == "cache_salt"


@pytest.mark.parametrize("value", ["fast", 3, ["suffix"]])
def test_http_bad_methods_are_a_400_naming_the_choices(value: object) -> None:
    with pytest.raises(ApiError) as caught:
        parsed(speculation_method=value)
    error = caught.value
    assert error.status == 400 and error.param == "speculation_method"
    assert '"auto", "draft", "suffix", "lookup", "none"' in error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
