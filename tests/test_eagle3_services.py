"""EAGLE-3 drafts served over gRPC: a random checkpoint in each layout, loaded through the
--draft-model path (models.load_pretrained), gives the target's own greedy output, and
sampled output equal to the in-process loop's (whose law tests/test_eagle3_model.py
checks by chi-square); the target returns the layer inputs Describe names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from service_harness import Services
from test_eagle3_formats import target_model, write_specforge
from tiny_models import tiny_eagle3_draft

from specdec.core.loop import GenerateConfig, generate
from specdec.core.sampling import SamplingParams
from specdec.engine.eagle3_formats import WIRE_DTYPE_KEY, save_speculators
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.models import load_pretrained
from specdec.engine.runner import ModelRunner
from specdec.proto.specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specdec.serving import wire

VOCAB = 32
PROMPT = [3, 14, 15, 9, 2, 6]
LAYOUTS = ("speculators", "specforge")


@pytest.fixture(scope="module", params=LAYOUTS)
def stack(request: pytest.FixtureRequest, target_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Services]]:
    """Services over a draft saved in the layout and loaded as --draft-model loads it:
    speculators with float32 rows on the wire, SpecForge with the default bfloat16."""
    layout = request.param
    target = target_model(target_dir)
    draft = tiny_eagle3_draft(target, seed=2, aux_layer_ids=(2, 1, 0), draft_vocab=24)
    root = tmp_path_factory.mktemp(layout)
    if layout == "speculators":
        directory = save_speculators(draft, root / "draft", "tiny", ["LlamaForCausalLM"])
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config,
                                                           WIRE_DTYPE_KEY: "float32"}))
    else:
        directory = write_specforge(draft, root / "draft")
    loaded = load_pretrained(str(directory), torch.device("cpu"), torch.float32,
                             progress=False, target_model=str(target_dir)).model
    services = Services(loaded, target)
    yield layout, services
    services.close()


def _request(k: int, **sampling: float) -> coordinator_pb2.GenerateRequest:
    message = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=30)
    message.speculation.num_draft_tokens = k
    message.speculation.method = "draft"
    if sampling:
        message.sampling.CopyFrom(common_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]
    return message


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_the_target_alone(stack, k: int) -> None:
    _, services = stack
    with torch.no_grad():
        expected = services.target_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False,
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            pad_token_id=0)[0, len(PROMPT):].tolist()
    response = services.stub.Generate(_request(k), timeout=60)
    assert list(response.token_ids) == expected
    assert response.stats.draft_tokens > 0 and not response.stats.degraded


def test_sampled_equals_the_in_process_loop_with_float32_rows(stack) -> None:
    layout, services = stack
    if layout != "speculators":
        pytest.skip("bfloat16 rows round the states the in-process loop keeps in float32")
    for seed in (5, 6):
        response = services.stub.Generate(_request(3, temperature=1.0, seed=seed), timeout=60)
        local = generate(LocalDrafter(ModelRunner(services.draft_model, VOCAB)),
                         LocalVerifier(ModelRunner(services.target_model)), PROMPT,
                         GenerateConfig(max_new_tokens=30, num_draft_tokens=3,
                                        sampling=SamplingParams(temperature=1.0, seed=seed)))
        assert list(response.token_ids) == local.token_ids
        assert response.stats.draft_tokens == local.stats.draft_tokens > 0
        assert response.stats.accepted_tokens == local.stats.accepted_tokens


def test_describe_names_the_layers_and_the_target_returns_them(stack) -> None:
    layout, services = stack
    draft = draft_pb2_grpc.DraftStub(grpc.insecure_channel(services.draft_endpoint))
    described = draft.Describe(draft_pb2.DescribeRequest(), timeout=5)
    assert described.target_hidden_size == 96
    assert list(described.target_hidden_layers) == [2, 1, 0]
    assert described.hidden_dtype == ("float32" if layout == "speculators" else "bfloat16")
    target = target_pb2_grpc.TargetStub(
        grpc.insecure_channel(f"127.0.0.1:{services.target_port}"))
    sync = common_pb2.SyncPoint(session_id="d", committed_position=0, append_tokens=PROMPT)
    response = target.Verify(target_pb2.VerifyRequest(
        sync=sync, return_hidden_states=True, hidden_layers=[2, 1, 0],
        hidden_dtype=described.hidden_dtype), timeout=10)
    rows = wire.decode_hidden(response.hidden_states, len(PROMPT), 96, "h")
    with torch.no_grad():
        out = services.target_model(input_ids=torch.tensor([PROMPT]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][0] for i in (2, 1, 0)], dim=-1)
    dtype = getattr(torch, described.hidden_dtype)
    assert torch.allclose(rows, expected.to(dtype).float(), atol=1e-5)
    with pytest.raises(grpc.RpcError) as error:
        target.Verify(target_pb2.VerifyRequest(
            sync=common_pb2.SyncPoint(session_id="e", append_tokens=PROMPT),
            return_hidden_states=True, hidden_layers=[3]), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not among this target's 3 decoder layers" in error.value.details()
