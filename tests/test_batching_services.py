"""Continuous batching in the draft and target services, through real gRPC servers on
loopback: output under concurrency equals serial output (greedy token for token, seeded
sampling draw for draw, the sampled law by chi-square), calls of different sessions share
forwards (BatchInfo), a cancelled call leaves the batch and frees its cache, a bad call
fails alone.

Where a test needs calls to be queued together it holds the service's model thread with
a blocking task on the executor it gave the servicer, sends the calls, waits until they
are all queued and lets the thread go: the next forward then takes them all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from cpu_features import ROW_INVARIANT_BF16_LINEAR
from exact_law import chi_square_pvalue, target_law
from service_harness import Services
from tiny_models import tiny_llama

from coordinator.servicer import CoordinatorSettings
from draft_service.servicer import DraftServicer
from specdec.core.history import TokenHistory
from specdec.core.loop import GenerateConfig, generate
from specdec.core.sampling import SamplingParams
from specdec.core.tree_acceptance import NO_ALTERNATIVES, Alternatives
from specdec.engine.local import LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.engine.steps import SyncPoint, draft_step, verify_step
from specdec.proto.specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specdec.serving import wire
from specdec.serving.grpc_server import ServerHandle, build_server
from specdec.serving.model_service import BatchLimits
from target_service.servicer import TargetServicer

VOCAB = 32
FAST = CoordinatorSettings(draft_backoff_initial_s=0.01, draft_backoff_max_s=0.05)
PROMPTS = [[1, 5, 7, 3], [9], [4, 4, 4, 4, 4, 4, 2], [2, 8, 16, 30, 11], [7, 7],
           [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [12, 13], [20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(1)
    return tiny_llama(VOCAB, seed=1), tiny_llama(VOCAB, seed=2, layers=1)


@pytest.fixture(scope="module")
def services(models) -> Iterator[Services]:
    target, draft = models
    stack = Services(draft, target, settings=FAST)
    yield stack
    stack.close()


def request(prompt: list[int], max_new_tokens: int, *, k: int = 3, temperature: float = 0.0,
            top_k: int = 0, seed: int | None = None,
            alternatives: int | None = None) -> coordinator_pb2.GenerateRequest:
    message = coordinator_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=max_new_tokens,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k))
    if seed is not None:
        message.sampling.seed = seed
    message.speculation.num_draft_tokens = k
    if alternatives is not None:
        message.speculation.num_alternatives = alternatives
    return message


def target_only(target: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    config = GenerateConfig(max_new_tokens=max_new_tokens, num_draft_tokens=0)
    return generate(None, LocalVerifier(ModelRunner(target)), prompt, config).token_ids


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


# -- through the coordinator --------------------------------------------------------------
def test_concurrent_greedy_requests_equal_serial_target_only(services, models) -> None:
    """(a) Eight requests at once, different prompts and lengths, some with alternatives:
    each one's text is the target's own, and the services batched them."""
    target, _ = models
    messages = [request(prompt, 12 + 4 * index, k=1 + index % 4,
                        alternatives=(4 if index % 2 else 0))
                for index, prompt in enumerate(PROMPTS)]
    expected = [target_only(target, list(m.prompt_token_ids), m.max_new_tokens)
                for m in messages]
    before = batch_sessions_sum(services)
    with ThreadPoolExecutor(len(messages)) as pool:
        outputs = list(pool.map(
            lambda m: list(services.stub.Generate(m, timeout=120).token_ids), messages))
    assert outputs == expected
    assert batch_sessions_sum(services) > before


def batch_sessions_sum(services: Services) -> float:
    registry = services.target.telemetry.registry
    return float(registry.get_sample_value("specdec_batch_sessions_sum") or 0.0)


def test_seeded_sampling_is_the_same_alone_and_under_load(services) -> None:
    """(c) A seeded sampled request draws the same tokens with seven others in its forwards
    as alone."""
    messages = [request(PROMPTS[index], 20, k=3, temperature=1.0, top_k=10, seed=40 + index)
                for index in range(8)]
    alone = [list(services.stub.Generate(m, timeout=60).token_ids) for m in messages]
    with ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(
            lambda m: list(services.stub.Generate(m, timeout=120).token_ids), messages))
    assert loaded == alone
    assert len({tuple(tokens) for tokens in alone}) > 1


def test_sampled_law_under_concurrent_load_matches_the_target() -> None:
    """(b) The joint law of the first 3 tokens (8-token vocabulary) by chi-square, the
    samples drawn eight at a time through the services while greedy requests load them.
    It is also the law of requests run alone: a seeded request draws the same tokens alone
    and under load (c)."""
    torch.set_num_threads(1)
    target = tiny_llama(8, seed=11, logit_scale=0.5)
    draft = tiny_llama(8, seed=12, layers=1, logit_scale=0.5)
    temperature = float(np.float32(0.7))  # what the float proto field carries
    law = target_law(target, [1, 5, 2], SamplingParams(temperature=temperature, top_k=4), 3)
    stack = Services(draft, target, settings=FAST)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            stack.stub.Generate(request([3, 1, 4], 24, k=4), timeout=60)

    try:
        background = [threading.Thread(target=load) for _ in range(2)]
        for thread in background:
            thread.start()
        with ThreadPoolExecutor(8) as pool:
            samples = list(pool.map(
                lambda seed: tuple(stack.stub.Generate(
                    request([1, 5, 2], 3, k=2, temperature=0.7, top_k=4, seed=seed),
                    timeout=60).token_ids), range(2500)))
        stop.set()
        for thread in background:
            thread.join()
        shared = stack.target.telemetry.registry.get_sample_value(
            "specdec_batch_sessions_bucket", {"le": "1.0"})
        forwards = stack.target.telemetry.registry.get_sample_value(
            "specdec_batch_sessions_count")
    finally:
        stop.set()
        stack.close()
    assert forwards is not None and shared is not None and shared < forwards  # batched
    assert chi_square_pvalue(samples, law) > 1e-3


# -- at the services, with calls queued together ---------------------------------------
class HeldService:
    """A draft or target server whose model thread a test can hold and let go."""

    def __init__(self, make: Callable[[ThreadPoolExecutor], DraftServicer | TargetServicer]
                 ) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.servicer = make(self.executor)
        self.server: ServerHandle = build_server([self.servicer.service()])
        self.channel = grpc.insecure_channel(self.server.address)
        self._gate: threading.Event | None = None

    def hold(self) -> None:
        self._gate = threading.Event()
        started = threading.Event()

        def block(gate: threading.Event) -> None:
            started.set()
            gate.wait(30)

        self.executor.submit(block, self._gate)
        started.wait(10)

    def let_go(self) -> None:
        assert self._gate is not None
        self._gate.set()

    def wait_queued(self, count: int) -> None:
        scheduler = self.servicer.sessions.scheduler
        assert wait_until(lambda: scheduler.queued >= count), scheduler.queued

    def close(self) -> None:
        if self._gate is not None:
            self._gate.set()
        self.channel.close()
        self.server.stop(0)
        self.servicer.sessions.close()
        self.executor.shutdown(wait=True)


@pytest.fixture
def held_target(models) -> Iterator[HeldService]:
    target, _ = models
    service = HeldService(lambda executor: TargetServicer(ModelRunner(target),
                                                          executor=executor))
    yield service
    service.close()


@pytest.fixture
def held_draft(models) -> Iterator[HeldService]:
    _, draft = models
    service = HeldService(lambda executor: DraftServicer(
        ModelRunner(draft, target_vocab_size=VOCAB), executor=executor))
    yield service
    service.close()


def verify_message(session: str, history: TokenHistory, position: int, append: list[int],
                   draft_tokens: list[int], alternatives: Alternatives = NO_ALTERNATIVES
                   ) -> target_pb2.VerifyRequest:
    message = target_pb2.VerifyRequest(
        sync=common_pb2.SyncPoint(session_id=session, committed_position=position,
                                  fingerprint=history.fingerprint(position),
                                  append_tokens=append),
        draft_tokens=draft_tokens)
    if alternatives:
        message.alternatives.tokens.extend(alternatives.tokens)
        message.alternatives.parents.extend(alternatives.parents)
    return message


def test_verify_calls_queued_together_share_one_forward_and_equal_alone(
        held_target, models) -> None:
    """(f) Six sessions' Verify calls waiting together run in one forward (BatchInfo says
    so), and each verdict is the one verify_step computes alone."""
    target, _ = models
    stub = target_pb2_grpc.TargetStub(held_target.channel)
    cases = [(PROMPTS[index], [index % VOCAB, 3, 5][: 1 + index % 3]) for index in range(6)]
    held_target.hold()
    futures = [stub.Verify.future(verify_message(f"s{index}", TokenHistory(), 0, prompt,
                                                 drafts), timeout=30)
               for index, (prompt, drafts) in enumerate(cases)]
    held_target.wait_queued(len(cases))
    held_target.let_go()
    responses = [future.result() for future in futures]
    alone = ModelRunner(target)
    for index, ((prompt, drafts), response) in enumerate(zip(cases, responses, strict=True)):
        expected = verify_step(alone, SyncPoint(f"s{index}", 0, 0, prompt), drafts, None,
                               SamplingParams())
        assert (response.accepted_len, response.next_token) == \
            (expected.verdict.accepted_len, expected.verdict.next_token)
        assert response.kv_length == expected.kv_length
        assert response.batch.sessions == len(cases)
        assert response.batch.rows == sum(len(p) + len(d) for p, d in cases)
        assert response.batch.queue_wait_seconds > 0


def test_propose_calls_step_in_lockstep_and_equal_alone(held_draft, models) -> None:
    """(f) Proposals of different lengths, gates and alternatives step together; each
    leaves when it ends; tokens, q and alternatives equal draft_step's alone."""
    _, draft = models
    stub = draft_pb2_grpc.DraftStub(held_draft.channel)
    cases = [  # (prompt, num_tokens, sampling, min_confidence, alternatives)
        (PROMPTS[0], 5, SamplingParams(), 0.0, 2),
        (PROMPTS[1], 2, SamplingParams(), 0.0, 0),
        (PROMPTS[2], 6, SamplingParams(temperature=1.0, seed=7), 0.0, 0),
        (PROMPTS[3], 6, SamplingParams(), 0.3, 0),
        (PROMPTS[4], 4, SamplingParams(temperature=0.8, top_k=5, seed=9), 0.2, 0),
    ]
    held_draft.hold()
    futures = []
    for index, (prompt, num_tokens, params, gate, alternatives) in enumerate(cases):
        sampling = common_pb2.SamplingParams(temperature=params.temperature,
                                             top_k=params.top_k)
        if params.seed is not None:
            sampling.seed = params.seed
        futures.append(stub.Propose.future(draft_pb2.ProposeRequest(
            sync=common_pb2.SyncPoint(session_id=f"d{index}", append_tokens=prompt),
            num_tokens=num_tokens, sampling=sampling, min_confidence=gate,
            num_alternatives=alternatives), timeout=30))
    held_draft.wait_queued(len(cases))
    held_draft.let_go()
    responses = [future.result() for future in futures]
    lengths = set()
    for index, ((prompt, num_tokens, params, gate, alternatives), response) in enumerate(
            zip(cases, responses, strict=True)):
        alone = draft_step(ModelRunner(draft, target_vocab_size=VOCAB),
                           SyncPoint(f"d{index}", 0, 0, prompt), num_tokens,
                           SamplingParams(temperature=float(np.float32(params.temperature)),
                                          top_k=params.top_k, seed=params.seed),
                           float(np.float32(gate)), None, alternatives)
        assert list(response.tokens) == alone.tokens
        assert list(response.alternatives.tokens) == list(alone.alternatives.tokens)
        if alone.probs is not None:  # q, the exact rows the draft sampled from
            served = wire.decode_probs(response.probs, len(alone.tokens), VOCAB)
            assert torch.equal(served, wire.decode_probs(wire.encode_probs(alone.probs),
                                                         len(alone.tokens), VOCAB))
        assert response.batch.sessions == len(cases)
        lengths.add(len(alone.tokens))
    assert len(lengths) > 1  # sessions left the lockstep at different steps


def test_cancelled_verify_leaves_the_batch_and_frees_its_cache(held_target, models) -> None:
    """(d) A Verify whose caller cancels while it waits never reaches the forward, its
    session's cache is released, and the calls batched with it are unaffected."""
    target, _ = models
    stub = target_pb2_grpc.TargetStub(held_target.channel)
    runner = held_target.servicer.runner
    histories = {}
    for index in range(4):  # every session holds a cache from a first round
        prompt = PROMPTS[index]
        stub.Verify(verify_message(f"c{index}", TokenHistory(), 0, prompt, []), timeout=30)
        histories[index] = TokenHistory(prompt)
    assert runner.active_sessions == 4
    held_target.hold()
    futures = {index: stub.Verify.future(
        verify_message(f"c{index}", histories[index], len(histories[index]), [5], [6, 7]),
        timeout=30) for index in range(4)}
    held_target.wait_queued(4)
    futures[2].cancel()
    time.sleep(0.2)  # the server sees the cancellation
    held_target.let_go()
    with pytest.raises(grpc.FutureCancelledError):
        futures[2].result()
    results = {index: futures[index].result() for index in (0, 1, 3)}
    assert wait_until(lambda: runner.active_sessions == 3)
    assert runner.kv_length("c2") == 0
    alone = ModelRunner(target)
    for index, response in results.items():
        history = histories[index]
        verify_step(alone, SyncPoint(f"c{index}", 0, 0, list(history.tokens)), [], None,
                    SamplingParams())
        expected = verify_step(alone, SyncPoint(f"c{index}", len(history),
                                                history.fingerprint(), [5]), [6, 7], None,
                               SamplingParams())
        assert (response.accepted_len, response.next_token) == \
            (expected.verdict.accepted_len, expected.verdict.next_token)
        assert response.batch.sessions == 3  # the cancelled call left before the forward


def test_bad_fingerprint_fails_alone_in_a_batch(held_target, models) -> None:
    """(e) A Verify naming a prefix its session does not hold gets FAILED_PRECONDITION;
    the good calls of the same forward get the verdicts they get alone."""
    target, _ = models
    stub = target_pb2_grpc.TargetStub(held_target.channel)
    for index in range(3):
        stub.Verify(verify_message(f"e{index}", TokenHistory(), 0, PROMPTS[index], []),
                    timeout=30)
    held_target.hold()
    histories = [TokenHistory(PROMPTS[index]) for index in range(3)]
    good = {index: stub.Verify.future(verify_message(
        f"e{index}", histories[index], len(histories[index]), [5], [6]), timeout=30)
        for index in (0, 2)}
    wrong = TokenHistory([31])  # e1 holds [9]: same length, another prefix
    bad = stub.Verify.future(verify_message("e1", wrong, len(wrong), [5], [6]), timeout=30)
    held_target.wait_queued(3)
    held_target.let_go()
    with pytest.raises(grpc.RpcError) as caught:
        bad.result()
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fingerprint" in str(caught.value.details())
    alone = ModelRunner(target)
    for index, future in good.items():
        response = future.result()
        history = histories[index]
        verify_step(alone, SyncPoint(f"e{index}", 0, 0, list(history.tokens)), [], None,
                    SamplingParams())
        expected = verify_step(alone, SyncPoint(f"e{index}", len(history),
                                                history.fingerprint(), [5]), [6], None,
                               SamplingParams())
        assert (response.accepted_len, response.next_token) == \
            (expected.verdict.accepted_len, expected.verdict.next_token)


def test_batch_limits_bound_sessions_per_forward(models) -> None:
    """With at most 2 sessions per forward, 5 queued Verify calls run in 3 forwards."""
    target, _ = models
    service = HeldService(lambda executor: TargetServicer(
        ModelRunner(target), executor=executor, limits=BatchLimits(max_sessions=2)))
    try:
        stub = target_pb2_grpc.TargetStub(service.channel)
        service.hold()
        futures = [stub.Verify.future(verify_message(f"l{index}", TokenHistory(), 0,
                                                     PROMPTS[index], [1]), timeout=30)
                   for index in range(5)]
        service.wait_queued(5)
        service.let_go()
        sizes = sorted(future.result().batch.sessions for future in futures)
        assert sizes == [1, 2, 2, 2, 2]
        queued = sorted(future.result().batch.queued for future in futures)
        assert queued[-1] >= 3  # the first forward ran while three more waited
        registry = service.servicer.telemetry.registry
        assert registry.get_sample_value("specdec_batch_sessions_count") == 3
        assert registry.get_sample_value("specdec_batch_sessions_sum") == 5
        assert registry.get_sample_value("specdec_batch_rows_sum") == \
            sum(len(PROMPTS[index]) + 1 for index in range(5))
        assert registry.get_sample_value("specdec_queue_wait_seconds_count") == 5
        assert registry.get_sample_value("specdec_num_calls_waiting") == 0
    finally:
        service.close()


# -- the real pair, in the served default dtype -------------------------------------------
REAL_PROMPTS = ["What is the capital of France?", "Name three primary colours.",
                "Write a haiku about the sea.", "How many legs does a spider have?",
                "Translate 'good morning' into Spanish.", "What is 12 times 12?",
                "Give one tip for sleeping well.", "Who wrote Romeo and Juliet?"]


@pytest.mark.slow
def test_real_pair_concurrent_greedy_equals_serial_target_only() -> None:
    """(a) The SmolLM2 pair in bfloat16 on this CPU's row-invariant linear kernel: eight
    chat requests at once, different lengths, half with alternatives, each equal to the
    same request served alone and to the target's own serial greedy output."""
    from specdec.engine import models as model_zoo
    from specdec.engine.backends.cpu import load_causal_lm
    from specdec.engine.models import model_info

    cpu = torch.device("cpu")
    target = load_causal_lm(model_zoo.DEFAULT_TARGET, cpu, torch.bfloat16, progress=False,
                            linear_kernel=ROW_INVARIANT_BF16_LINEAR)
    draft = load_causal_lm(model_zoo.DEFAULT_DRAFT, cpu, torch.bfloat16, progress=False,
                           linear_kernel=ROW_INVARIANT_BF16_LINEAR)
    assert target.tokenizer is not None
    eos = model_info(model_zoo.DEFAULT_TARGET).eos_token_ids
    prompts = [list(target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True,
        return_dict=True)["input_ids"]) for text in REAL_PROMPTS]
    messages = [request(prompt, 12 + 2 * index, k=4, alternatives=(2 if index % 2 else 0))
                for index, prompt in enumerate(prompts)]
    expected = []
    for message in messages:
        config = GenerateConfig(max_new_tokens=message.max_new_tokens, num_draft_tokens=0,
                                eos_token_ids=eos)
        expected.append(generate(None, LocalVerifier(ModelRunner(target.model)),
                                 list(message.prompt_token_ids), config).token_ids)
    stack = Services(draft.model, target.model, tokenizer=target.tokenizer, eos=eos,
                     draft_token_map=draft.token_map,
                     settings=CoordinatorSettings(draft_timeout_s=120))
    try:
        serial = [list(stack.stub.Generate(m, timeout=600).token_ids) for m in messages]
        with ThreadPoolExecutor(len(messages)) as pool:
            outputs = list(pool.map(
                lambda m: list(stack.stub.Generate(m, timeout=600).token_ids), messages))
        forwards = stack.target.telemetry.registry.get_sample_value(
            "specdec_batch_sessions_count") or 0.0
        batched = batch_sessions_sum(stack) > forwards
    finally:
        stack.close()
    assert batched  # some forward held more than one session
    assert outputs == serial  # batching changes nothing
    assert outputs == expected


class _OneRowJob:
    def __init__(self, session_id: str) -> None:
        self.session_id = session_id

    def request(self) -> object:
        return type("Request", (), {"tokens": [0]})()

    def take(self, result: object) -> bool:
        return True


def _share_of_shared_forwards(monkeypatch: pytest.MonkeyPatch, gather: float) -> float:
    """Two sessions calling back to back, each returning 5 ms after its call ends, on a
    scheduler whose forwards take 40 ms: the share of calls that shared a forward."""
    from specdec.serving import model_service

    def slow_forward(runner: object, jobs: list[object]) -> list[bool]:
        time.sleep(0.04)
        return [True] * len(jobs)

    monkeypatch.setattr(model_service, "step_jobs", slow_forward)
    monkeypatch.setattr(model_service, "GATHER_FRACTION", gather)
    executor = ThreadPoolExecutor(max_workers=1)
    scheduler = model_service.BatchScheduler(None, executor, BatchLimits(), lambda _: None)  # type: ignore[arg-type]
    sessions: list[int] = []

    def client(name: str) -> None:
        for _ in range(12):
            _, batch = scheduler.submit(name, lambda: _OneRowJob(name), lambda job: None)
            sessions.append(batch.sessions)
            time.sleep(0.005)

    threads = [threading.Thread(target=client, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
        time.sleep(0.01)  # out of step from the start
    for thread in threads:
        thread.join(timeout=30)
    executor.shutdown()
    later = sessions[4:]  # once the scheduler has seen each session's gap
    return sum(count == 2 for count in later) / len(later)


def test_sessions_due_back_soon_share_the_next_forward(monkeypatch) -> None:
    assert _share_of_shared_forwards(monkeypatch, 0.5) > 0.8
    # Without the wait the two fall out of step and take turns.
    assert _share_of_shared_forwards(monkeypatch, 0.0) < 0.5
