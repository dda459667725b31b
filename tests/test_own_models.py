"""Own models: a draft with another tokenizer is refused at the coordinator's start, and
an unknown model id is a one-line error naming it and the caches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_pair, tiny_llama

from specdec.config import serve_parser
from specdec.serving.stack import free_port

SPECDEC = [sys.executable, "-m", "specdec.cli"]
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "SPECDEC_TRACING": "off",
           "SPECDEC_METRICS_PORT": "-1"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny pair on SmolLM2's tokenizer, and a draft with a BPE tokenizer of its own
    trained on a few strings (both built offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("models")
    target, draft = save_tiny_pair(root)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(["speculative decoding drafts tokens", "the target verifies",
                             "hello world"] * 10,
                            trainers.BpeTrainer(vocab_size=64, special_tokens=["<unk>", "</s>"]))
    other = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>")
    mismatched = root / "other-draft"
    tiny_llama(len(other), seed=3, layers=1).save_pretrained(mismatched)
    other.save_pretrained(mismatched)
    return {"target": target, "draft": draft, "other": mismatched}


def coordinator_args(target: Path, draft: Path | str) -> list[str]:
    return ["coordinator", "--target-model", str(target), "--draft-model", str(draft),
            "--port", str(free_port()), "--draft-endpoint", f"127.0.0.1:{free_port()}",
            "--target-endpoint", f"127.0.0.1:{free_port()}", "--metrics-port", "-1",
            "--tracing", "off"]


def test_coordinator_refuses_a_draft_with_another_tokenizer(models: dict[str, Path]) -> None:
    from coordinator import server

    args = serve_parser().parse_args(coordinator_args(models["target"], models["other"]))
    with pytest.raises(RuntimeError) as error:
        server.create(args)
    message = str(error.value)
    assert "does not share the target" in message and "token strings differ" in message
    assert str(models["other"]) in message


def test_coordinator_accepts_a_pair_sharing_the_tokenizer(models: dict[str, Path]) -> None:
    from coordinator import server

    args = serve_parser().parse_args(coordinator_args(models["target"], models["draft"]))
    handle = server.create(args)
    handle.stop(0)


def test_the_embedded_draft_maps_into_the_target_vocabulary() -> None:
    from specdec.engine.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.engine.tokenizer_check import check_pair, token_map_mismatch

    check_pair(DEFAULT_TARGET, DEFAULT_DRAFT, None, 49152)
    assert "beyond the target's vocabulary of 100" in (token_map_mismatch([1, 200], 100) or "")
    with pytest.raises(RuntimeError, match="beyond the target's vocabulary of 1000"):
        check_pair(DEFAULT_TARGET, DEFAULT_DRAFT, None, 1000)


def test_the_served_coordinator_exits_with_one_line(models: dict[str, Path]) -> None:
    result = subprocess.run([*SPECDEC, "serve",
                             *coordinator_args(models["target"], models["other"])],
                            capture_output=True, text=True, timeout=180, env=OFFLINE)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors[-1].startswith("specdec serve: error: draft") and "Traceback" not in \
        result.stderr


@pytest.mark.parametrize("name", ["no-such-org/no-such-model", "./no/such/model/dir"])
def test_an_unknown_model_is_one_line_naming_it_and_the_cache(name: str) -> None:
    result = subprocess.run([*SPECDEC, "serve", "target", "--target-model", name,
                             "--port", str(free_port())],
                            capture_output=True, text=True, timeout=180, env=OFFLINE)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("specdec")]
    assert repr(name) in line
    if not name.startswith("."):
        # The caches the child searched, computed as the child computes them: both follow
        # the environment it inherits from this process (HF_HOME, HF_HUB_CACHE,
        # XDG_CACHE_HOME, SPECDEC_MODEL_CACHE), so no fixed path holds on every machine.
        from huggingface_hub import constants

        from specdec.engine.models import model_cache_dir

        assert f"cache {constants.HF_HUB_CACHE} " in line
        assert f"(converted into {model_cache_dir()})" in line
