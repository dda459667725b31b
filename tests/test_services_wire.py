"""The wire format (q codec, sampling params), stream chunking, generated code, health."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.streaming import StreamChunker
from specdec.core.sampling import SamplingParams, process_logits
from specdec.errors import InvalidRequest
from specdec.proto.specdec.v1 import common_pb2
from specdec.serving import wire
from specdec.serving.grpc_server import Service, build_server, check_health

ROOT = Path(__file__).resolve().parent.parent


# -- q ------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9),
                                    SamplingParams(temperature=1.0, top_k=5),
                                    SamplingParams(temperature=0.8, top_p=0.5)])
def test_probs_round_trip_bit_exact(params: SamplingParams) -> None:
    torch.manual_seed(0)
    probs = process_logits(torch.randn(4, 300) * 3, params)
    message = wire.encode_probs(probs)
    decoded = wire.decode_probs(message, 4, 300)
    assert torch.equal(decoded, probs)  # bit for bit: acceptance uses these values
    expected = "dense" if bool((probs > 0).float().mean() >= 0.5) else "sparse"
    assert message.WhichOneof("layout") == expected


def test_sparse_is_chosen_when_smaller_and_much_smaller_on_the_wire() -> None:
    probs = process_logits(torch.randn(4, 49152), SamplingParams(temperature=1.0, top_k=20))
    message = wire.encode_probs(probs)
    assert message.WhichOneof("layout") == "sparse"
    assert message.ByteSize() < 4 * 20 * 8 + 64
    assert torch.equal(wire.decode_probs(message, 4, 49152), probs)


def test_reduced_vocabulary_columns_map_to_target_ids() -> None:
    columns = torch.tensor([7, 2, 9, 4])  # draft row j is target id columns[j]
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    for message in (wire.encode_probs(probs, columns),
                    wire.encode_probs(torch.tensor([[0.0, 0.0, 0.0, 1.0]] * 2), columns)):
        decoded = wire.decode_probs(message, 2, 12)
        assert decoded.shape == (2, 12)
        assert float(decoded.sum()) == pytest.approx(2.0)
    decoded = wire.decode_probs(wire.encode_probs(probs, columns), 2, 12)
    assert torch.equal(decoded[:, columns], probs)
    assert float(decoded[:, [0, 1, 3, 5, 6, 8, 10, 11]].abs().sum()) == 0.0


def test_decode_rejects_inconsistent_payloads() -> None:
    good = wire.encode_probs(torch.full((2, 8), 0.125))
    with pytest.raises(InvalidRequest, match="rows"):
        wire.decode_probs(good, 3, 8)
    with pytest.raises(InvalidRequest, match="exceed"):
        wire.decode_probs(good, 2, 4)
    with pytest.raises(InvalidRequest, match="required"):
        wire.decode_probs(common_pb2.DraftProbs(), 2, 8)


def test_sampling_params_round_trip_and_validation() -> None:
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.75, min_p=0.125, seed=2**64 - 1)
    assert wire.sampling_from_proto(wire.sampling_to_proto(params)) == params
    assert wire.sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()  # greedy
    with pytest.raises(InvalidRequest, match="sampling.top_k"):
        wire.sampling_from_proto(common_pb2.SamplingParams(top_k=-2))


# -- streaming ----------------------------------------------------------------------------
def char_decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def test_chunker_without_stop_strings_sends_everything() -> None:
    chunker = StreamChunker(char_decode, [])
    assert chunker.update([0, 1]) == ("ab", [0, 1])
    assert chunker.update([0, 1, 2]) == ("c", [2])
    assert chunker.finish("abcd", [0, 1, 2, 3]) == ("d", [3])


def test_chunker_holds_back_a_possible_stop_string() -> None:
    chunker = StreamChunker(char_decode, ["cde"])  # may start in the last 2 characters
    assert chunker.update([0, 1, 2, 3]) == ("ab", [0, 1])
    # The round that completes the stop string sends nothing; the final message cuts.
    assert chunker.update([0, 1, 2, 3, 4]) == ("", [])
    assert chunker.finish("ab", [0, 1, 2]) == ("", [2])


def test_chunker_holds_back_an_incomplete_character() -> None:
    def decode(ids: list[int]) -> str:
        return "".join("é" if i == 9 else ("\ufffd" if i == 8 else "x") for i in ids)

    chunker = StreamChunker(decode, [])
    assert chunker.update([1, 8]) == ("x", [1, 8])
    assert chunker.finish("xé", [1, 8, 9]) == ("é", [9])


def test_chunker_token_ids_only() -> None:
    chunker = StreamChunker(None, [])
    assert chunker.update([4, 5]) == ("", [4, 5])
    assert chunker.finish("", [4, 5, 6]) == ("", [6])


# -- generated code, lint, health and reflection ------------------------------------------
def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out",
                    str(tmp_path / "proto")], check=True, capture_output=True)
    committed = ROOT / "specdec" / "proto"
    fresh = sorted(p.relative_to(tmp_path / "proto") for p in (tmp_path / "proto").rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    existing = sorted(p.relative_to(committed) for p in committed.rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts)
    assert fresh == existing, "run `make protos` and commit specdec/proto"
    stale = [str(p) for p in fresh
             if not filecmp.cmp(tmp_path / "proto" / p, committed / p, shallow=False)]
    assert not stale, f"stale generated files {stale}: run `make protos`"


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed")
    return found


def test_buf_lint_passes() -> None:
    result = subprocess.run([_tool("buf"), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_health_and_reflection_with_grpcurl() -> None:
    from coordinator.servicer import SERVICE_NAME

    handle = build_server([Service(SERVICE_NAME, lambda server: None)])
    try:
        assert check_health(handle.address)
        assert check_health(handle.address, SERVICE_NAME)
        listing = subprocess.run([_tool("grpcurl"), "-plaintext", handle.address, "list"],
                                 capture_output=True, text=True, timeout=30)
        assert listing.returncode == 0, listing.stderr
        assert set(listing.stdout.split()) >= {
            "specdec.v1.Coordinator", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"}
        described = subprocess.run(
            [_tool("grpcurl"), "-plaintext", handle.address, "describe",
             "specdec.v1.GenerateRequest"], capture_output=True, text=True, timeout=30)
        assert "prompt_token_ids" in described.stdout
    finally:
        handle.stop(0)
    assert not check_health(handle.address)


def test_a_sync_point_carries_its_prefill_length_and_a_bad_one_is_rejected() -> None:
    from specdec.core.history import SyncPoint
    from specdec.serving.wire import sync_from_proto, sync_to_proto

    resent = SyncPoint("s", 0, 0, [1, 2, 3, 4], prefill_length=3)
    assert sync_from_proto(sync_to_proto(resent), 8) == resent
    # Past position 0 the cache already holds the prefill: the field means nothing there.
    later = sync_to_proto(SyncPoint("s", 4, 7, [5], prefill_length=1))
    assert sync_from_proto(later, 8).prefill_length == 0
    with pytest.raises(InvalidRequest, match="sync.prefill_length"):
        sync_from_proto(sync_to_proto(SyncPoint("s", 0, 0, [1], prefill_length=2)), 8)
