"""--draft-compile: torch.compile of the draft's forward, checked against eager.

The committed draft is compiled once for the module (about a minute on 2 cores without
inductor's disk cache). Exactness with a compiled draft is in test_exactness.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo.utils
from cpu_features import needs_onednn_bf16
from tiny_models import tiny_llama

from specdec.core.history import SyncPoint
from specdec.core.sampling import SamplingParams
from specdec.engine.backends.cpu import load_causal_lm
from specdec.engine.draft_compile import (
    ONEDNN_REASON,
    DraftCompileError,
    compile_draft,
    decode_steps_compiled,
    should_try,
)
from specdec.engine.kernels import apply_linear_kernel
from specdec.engine.models import DEFAULT_DRAFT
from specdec.engine.runner import ModelRunner
from specdec.engine.shapes import DECODE_ROWS
from specdec.engine.steps import draft_step

# One worker compiles the committed draft once here and again in
# test_services_cli.py::test_the_first_request_after_ready_compiles_nothing, which then
# finds inductor's cache warm.
pytestmark = pytest.mark.xdist_group("draft-compile")

CPU = torch.device("cpu")
TARGET_VOCAB = 49152


@pytest.fixture(scope="module")
def compiled_draft() -> tuple[Any, Any]:
    """The committed draft compiled ("on"), and its eager forward."""
    loaded = load_causal_lm(DEFAULT_DRAFT, CPU, torch.float32, progress=False,
                            linear_kernel="torch")
    eager = loaded.model.forward
    outcome = compile_draft(loaded.model, lambda: runner_for(loaded), "on", CPU)
    assert outcome.compiled and "compiled in" in outcome.detail
    return loaded, eager


def runner_for(loaded: Any) -> ModelRunner:
    return ModelRunner(loaded.model, target_vocab_size=TARGET_VOCAB, token_map=loaded.token_map)


def decode_like_a_draft(runner: ModelRunner, seed: int) -> list[torch.Tensor]:
    """Prompts, then rounds of a catch-up after a rollback and one-token steps: the
    extends a draft service runs. Returns every extend's logits."""
    rng = random.Random(seed)
    logits = []
    for prompt_length in (19, 1, 57):
        runner.extend("s", 0, 0, [rng.randrange(4096) for _ in range(prompt_length)])
        for round_index in range(12):
            held = runner.kv_length("s")
            committed = max(1, held - rng.randrange(0, 4))  # rejected draft tokens roll back
            fingerprint = runner._sessions["s"].history.fingerprint(committed)
            # Round 5 catches up after rounds of prompt-lookup hits: more tokens than a
            # decode-sized forward.
            width = DECODE_ROWS + 5 if round_index == 5 else rng.randrange(1, 4)
            catch_up = [rng.randrange(4096) for _ in range(width)]
            logits.append(runner.extend("s", committed, fingerprint, catch_up).logits)
            for _ in range(rng.randrange(0, 4)):
                logits.append(runner.append("s", [rng.randrange(4096)]).logits)
    runner.release("s")
    return logits


def propose_like_a_service(runner: ModelRunner, seed: int) -> list[list[int]]:
    """Rounds of the draft service's Propose (draft_step): chains and token trees of
    several sizes, greedy and sampled, each after a rollback to what the target accepted
    and a catch-up. Returns every proposal's tokens."""
    rng = random.Random(seed)
    proposals = []
    for temperature in (0.0, 0.7):
        params = SamplingParams(temperature=temperature, seed=seed)
        prompt = [rng.randrange(4096) for _ in range(41)]
        sync = SyncPoint("p", 0, 0, prompt, prefill_length=len(prompt))
        for _ in range(14):
            out = draft_step(runner, sync, rng.randrange(1, 9), params,
                             num_alternatives=rng.choice((0, 1, 2, 3, 6)))
            proposals.append(out.tokens)
            committed = min(sync.next_position + rng.randrange(0, 5), out.kv_length)
            fingerprint = runner._sessions["p"].history.fingerprint(committed)
            sync = SyncPoint("p", committed, fingerprint,
                             [rng.randrange(4096) for _ in range(rng.choice((1, 1, 2, 4)))])
        runner.release("p")
    return proposals


def test_compiled_draft_gives_eager_logits_and_compiles_nothing_more_while_decoding(
        compiled_draft: tuple[Any, Any]) -> None:
    loaded, eager = compiled_draft
    compiled = loaded.model.forward
    graphs_after_warm_up = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled_logits = decode_like_a_draft(runner_for(loaded), seed=0)
    compiled_proposals = propose_like_a_service(runner_for(loaded), seed=1)
    # A graph compiled while serving stalls a round for seconds. Rollbacks leave the cache
    # as strided slices (without contiguous_cache each layout compiled a graph of its
    # own), token trees pass a mask, and long catch-ups and one-token prompts take other
    # paths (the warm-up runs them).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_after_warm_up
    loaded.model.forward = eager
    try:
        eager_logits = decode_like_a_draft(runner_for(loaded), seed=0)
        eager_proposals = propose_like_a_service(runner_for(loaded), seed=1)
    finally:
        loaded.model.forward = compiled
    assert compiled_proposals[:14] == eager_proposals[:14]  # the greedy rounds
    assert len(compiled_logits) == len(eager_logits) > 36
    for got, expected in zip(compiled_logits, eager_logits, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_decode_steps_go_compiled_with_a_canonical_cache_the_rest_eager() -> None:
    calls: list[tuple[str, list[tuple[int, ...]]]] = []

    class Layer:
        is_initialized = True

        def __init__(self) -> None:
            self.keys = torch.zeros(1, 3, 10, 4)[:, :, :6]  # a crop's slice
            self.values = torch.zeros(1, 1, 3, 4).transpose(1, 2)  # one token, attention's
            # layout: is_contiguous() says yes, its strides are not the canonical ones

    class Cache:
        def __init__(self) -> None:
            self.layers = [Layer(), Layer()]

    def record(name: str) -> Any:
        def forward(**kwargs: Any) -> str:
            calls.append((name, [tensor.stride() for layer in kwargs["cache"].layers
                                 for tensor in (layer.keys, layer.values)]))
            return name
        return forward

    eager = record("eager")
    forward = decode_steps_compiled(eager, record("compiled"))
    cache = Cache()
    assert forward(input_ids=torch.zeros(1, 2, dtype=torch.long), cache=cache) == "compiled"
    assert calls[-1][1] == [(72, 24, 4, 1), (12, 4, 4, 1)] * 2
    assert cache.layers[0].keys.shape == (1, 3, 6, 4)
    long_catch_up = torch.zeros(1, DECODE_ROWS + 1, dtype=torch.long)
    assert forward(input_ids=long_catch_up, cache=cache) == "eager"
    one_token = Cache()
    one_token.layers[0].keys = torch.zeros(1, 3, 1, 4)  # after a one-token prompt
    assert forward(input_ids=torch.zeros(1, 1, dtype=torch.long), cache=one_token) == "eager"
    Layer.is_initialized = False  # a session's first forward
    assert forward(input_ids=torch.zeros(1, 2, dtype=torch.long), cache=Cache()) == "eager"
    assert forward.__wrapped__ is eager  # the runner reads the signature through it


def test_settings() -> None:
    assert should_try("auto", CPU) and should_try("on", CPU)
    assert not should_try("off", CPU)
    # auto compiles only where it was measured; on asks for it anywhere.
    assert not should_try("auto", torch.device("cuda"))
    assert should_try("on", torch.device("cuda"))
    with pytest.raises(ValueError, match="one of"):
        should_try("yes", CPU)


def test_off_leaves_the_forward_alone() -> None:
    model = tiny_llama(32, seed=5, layers=1)
    forward = model.forward
    outcome = compile_draft(model, lambda: ModelRunner(model), "off", CPU)
    assert not outcome.compiled and outcome.detail == "eager (--draft-compile off)"
    assert model.forward == forward


@pytest.fixture
def no_cpp_compiler() -> Iterator[None]:
    """Inductor as on a host without a C++ compiler (the slim container image)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    # No cached kernels either: a cache hit would never call the compiler.
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",), "fx_graph_cache": False}):
        yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("no_cpp_compiler")
def test_auto_falls_back_to_eager_when_compiling_fails_and_on_raises() -> None:
    model = tiny_llama(32, seed=6, layers=1)
    forward = model.forward
    outcome = compile_draft(model, lambda: ModelRunner(model), "auto", CPU)
    assert not outcome.compiled and outcome.detail.startswith("eager (compiling the draft failed")
    assert model.forward == forward
    runner = ModelRunner(model)
    assert runner.extend("s", 0, 0, [1, 2, 3]).logits.shape == (1, 32)  # still serves
    with pytest.raises(DraftCompileError, match="SPECDEC_DRAFT_COMPILE=off"):
        compile_draft(model, lambda: ModelRunner(model), "on", CPU)
    assert model.forward == forward


@needs_onednn_bf16
def test_a_draft_on_the_onednn_kernel_is_not_compiled() -> None:
    """Inductor fails on onednn's prepacked weights after ~10 s of tracing; auto says so
    in one line and stays eager, on refuses with the setting that would compile."""
    model = tiny_llama(32, seed=7, layers=1).to(torch.bfloat16)
    assert apply_linear_kernel(model, "onednn") == "onednn"
    forward = model.forward
    outcome = compile_draft(model, lambda: ModelRunner(model), "auto", CPU)
    assert not outcome.compiled and outcome.detail == f"eager ({ONEDNN_REASON})"
    assert model.forward == forward
    with pytest.raises(DraftCompileError, match="SPECDEC_DRAFT_LINEAR_KERNEL=torch"):
        compile_draft(model, lambda: ModelRunner(model), "on", CPU)
    assert model.forward == forward
