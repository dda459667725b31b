"""Rounds without a proposal that decode several target tokens in one Verify
(`--decode-steps`): the same tokens as one-token rounds, fewer calls."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest
import torch
from service_harness import Services
from tiny_models import tiny_llama

from coordinator.servicer import CoordinatorSettings
from specdec.core.adaptive import AdaptiveLength
from specdec.core.history import TokenHistory
from specdec.core.interfaces import Proposal, Verification
from specdec.core.loop import GenerateConfig, generate
from specdec.core.sampling import SamplingParams
from specdec.engine.local import LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.engine.shapes import MAX_DECODE_STEPS
from specdec.engine.steps import SyncPoint, VerifyJob, run_jobs, verify_step
from specdec.errors import InvalidRequest
from specdec.proto.specdec.v1 import common_pb2, coordinator_pb2, target_pb2, target_pb2_grpc

VOCAB = 32
PROMPT = [1, 5, 7, 3, 9]
SEED = 11
SAMPLED = SamplingParams(temperature=1.0, top_k=12, seed=SEED)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    torch.set_num_threads(1)
    return tiny_llama(VOCAB, seed=1)


def one_token_rounds(target: torch.nn.Module, params: SamplingParams, rounds: int
                     ) -> tuple[list[int], int]:
    """The tokens `rounds` one-token verifications commit, and the last one's kv_length."""
    runner = ModelRunner(target)
    committed, append, drawn = 0, list(PROMPT), []
    history = TokenHistory(PROMPT)
    kv_length = 0
    for _ in range(rounds):
        sync = SyncPoint("s", committed, history.fingerprint(committed), append)
        out = verify_step(runner, sync, [], None, params)
        drawn.append(out.verdict.next_token)
        kv_length = out.kv_length
        committed = len(history)
        history.extend([out.verdict.next_token])
        append = [out.verdict.next_token]
    return drawn, kv_length


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_job_of_several_steps_draws_what_one_token_rounds_draw(target, params) -> None:
    expected, kv_length = one_token_rounds(target, params, 6)
    job = VerifyJob(SyncPoint("s", 0, 0, list(PROMPT)), [], None, params, decode_steps=6)
    assert run_jobs(ModelRunner(target), [job]) == [None]
    out = job.output()
    assert [out.verdict.next_token, *out.decoded] == expected
    assert out.verdict.accepted_len == 0
    assert out.kv_length == kv_length == len(PROMPT) + 5  # every drawn token but the last
    assert out.tokens_processed == len(PROMPT) + 5


def test_decoding_ends_after_a_stop_token(target) -> None:
    expected, _ = one_token_rounds(target, SAMPLED, 6)
    stop = expected[2]
    cut = expected.index(stop) + 1
    job = VerifyJob(SyncPoint("s", 0, 0, list(PROMPT)), [], None, SAMPLED, decode_steps=6,
                    stop_token_ids=(stop,))
    assert run_jobs(ModelRunner(target), [job]) == [None]
    out = job.output()
    assert [out.verdict.next_token, *out.decoded] == expected[:cut]


def test_decode_steps_take_no_draft_tokens_or_hidden_states() -> None:
    sync = SyncPoint("s", 0, 0, list(PROMPT))
    with pytest.raises(InvalidRequest, match="without draft tokens"):
        VerifyJob(sync, [4], None, SamplingParams(), decode_steps=2)
    with pytest.raises(InvalidRequest, match="without draft tokens"):
        VerifyJob(sync, [], None, SamplingParams(), return_hidden=True, decode_steps=2)


# -- through the services -------------------------------------------------------------------
@pytest.fixture(scope="module")
def stacks(target) -> Iterator[dict[int, Services]]:
    draft = tiny_llama(VOCAB, seed=2, layers=1)
    made = {steps: Services(draft, target, eos=(11,),
                            settings=CoordinatorSettings(decode_steps=steps))
            for steps in (1, 8)}
    yield made
    for stack in made.values():
        stack.close()


def target_only_request(params: common_pb2.SamplingParams,
                        max_new_tokens: int = 30) -> coordinator_pb2.GenerateRequest:
    message = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT,
                                              max_new_tokens=max_new_tokens, sampling=params)
    message.speculation.num_draft_tokens = 0
    return message


@pytest.mark.parametrize("sampling", [common_pb2.SamplingParams(),
                                      common_pb2.SamplingParams(temperature=1.0, top_k=12,
                                                                seed=SEED)],
                         ids=["greedy", "sampled"])
def test_target_only_requests_decode_in_fewer_calls_to_the_same_tokens(
        stacks, target, sampling) -> None:
    one = stacks[1].stub.Generate(target_only_request(sampling), timeout=60)
    eight = stacks[8].stub.Generate(target_only_request(sampling), timeout=60)
    assert list(eight.token_ids) == list(one.token_ids)
    assert eight.finish_reason == one.finish_reason
    tokens = len(one.token_ids)
    assert tokens >= 12 and one.stats.rounds == tokens and one.stats.decoded_tokens == 0
    # The first round answers the prefill with one token; then up to 8 a call.
    assert eight.stats.rounds == 1 + math.ceil((tokens - 1) / 8)
    assert eight.stats.decoded_tokens == tokens - eight.stats.rounds
    if not sampling.temperature:  # and the target's own greedy text, in process
        config = GenerateConfig(max_new_tokens=30, num_draft_tokens=0, eos_token_ids=(11,))
        local = generate(None, LocalVerifier(ModelRunner(target)), PROMPT, config)
        assert list(eight.token_ids) == local.token_ids


def test_a_decoding_call_stops_at_max_new_tokens(stacks) -> None:
    response = stacks[8].stub.Generate(target_only_request(common_pb2.SamplingParams(), 5),
                                       timeout=60)
    expected = stacks[1].stub.Generate(target_only_request(common_pb2.SamplingParams(), 5),
                                       timeout=60)
    assert list(response.token_ids) == list(expected.token_ids)
    assert len(response.token_ids) <= 5


def test_verify_refuses_more_decode_steps_than_it_allows(stacks) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{stacks[8].target_port}")
    stub = target_pb2_grpc.TargetStub(channel)
    message = target_pb2.VerifyRequest(
        sync=common_pb2.SyncPoint(session_id="x", append_tokens=PROMPT),
        decode_steps=MAX_DECODE_STEPS + 1)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Verify(message, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"more than {MAX_DECODE_STEPS}" in raised.value.details()
    message.decode_steps, message.draft_tokens[:] = 2, [3]
    with pytest.raises(grpc.RpcError) as raised:
        stub.Verify(message, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_coordinator_settings_bound_decode_steps() -> None:
    with pytest.raises(ValueError, match="SPECDEC_DECODE_STEPS"):
        CoordinatorSettings(decode_steps=0)
    with pytest.raises(ValueError, match="SPECDEC_DECODE_STEPS"):
        CoordinatorSettings(decode_steps=MAX_DECODE_STEPS + 1)


# -- the adaptive policy ----------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


VERIFY_S = {0: 0.060, 1: 0.110, 2: 0.115, 3: 0.120, 4: 0.126}


def idle_policy() -> tuple[AdaptiveLength, FakeClock]:
    """A policy whose draft never pays: it has stopped drafting and probes now and again."""
    clock = FakeClock()
    policy = AdaptiveLength(2, 4, clock=clock)
    for _ in range(120):
        k = policy.next_length()
        proposal = Proposal(list(range(k)), None, 0.012 * k) if k else None
        clock.now += 0.012 * k + VERIFY_S[k] + 0.001
        policy.observe(k, 0, proposal, Verification(0, 0, VERIFY_S[k]))
    assert policy.chosen[-20:].count(0) >= 15
    return policy, clock


def probe_tokens(policy: AdaptiveLength, clock: FakeClock, tokens: int, decode: bool
                 ) -> tuple[list[int], int]:
    """The token counts at which the policy probes the draft, with one-token rounds or
    with rounds that decode undrafted_rounds() tokens; and the rounds it took."""
    probes, emitted, rounds = [], 0, 0
    while emitted < tokens:
        rounds += 1
        k = policy.next_length()
        if k:
            probes.append(emitted)
            clock.now += 0.012 * k + VERIFY_S[k] + 0.001
            policy.observe(k, 0, Proposal(list(range(k)), None, 0.012 * k),
                           Verification(0, 0, VERIFY_S[k]))
            emitted += 1
            continue
        steps = policy.undrafted_rounds() if decode else 1
        clock.now += steps * (VERIFY_S[0] + 0.001)
        policy.observe(0, 0, None, Verification(0, 0, steps * VERIFY_S[0],
                                                decoded=tuple(range(steps - 1))))
        emitted += steps
    return probes, rounds


def test_an_idle_policy_probes_at_the_same_tokens_when_rounds_decode_several() -> None:
    policy, clock = idle_policy()
    twin, twin_clock = idle_policy()  # the same, deterministic, history
    one, one_rounds = probe_tokens(policy, clock, 400, decode=False)
    several, several_rounds = probe_tokens(twin, twin_clock, 400, decode=True)
    assert several == one and len(one) >= 3
    assert one_rounds == 400 and several_rounds < 400 / 4
    # A round of n tokens is costed as n rounds of one: k = 0 keeps its price.
    assert twin.rates()[0] == pytest.approx(policy.rates()[0], rel=0.02)
