"""--draft-dtype auto: the draft's precision chosen by timing each candidate's step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cpu_features import BF16_AUTO_LINEAR
from tiny_models import tiny_llama

from specdec.engine.backends.cpu import load_causal_lm
from specdec.engine.draft_precision import Precision, candidates, load_draft
from specdec.engine.models import LoadedModel

CPU = torch.device("cpu")


def test_candidates_are_the_shared_precision_then_float32_with_each_cpu_kernel() -> None:
    labels = [option.label for option in candidates(CPU, Precision(torch.bfloat16, "auto"))]
    assert labels == [f"bfloat16/{BF16_AUTO_LINEAR}", "float32/torch", "float32/skinny"]
    # float32 with "auto" is float32/skinny already: no candidate twice.
    labels = [option.label for option in candidates(CPU, Precision(torch.float32, "auto"))]
    assert labels == ["float32/skinny", "float32/torch"]
    cuda = candidates(torch.device("cuda"), Precision(torch.bfloat16, "auto"))
    assert [option.label for option in cuda] == ["bfloat16/torch"]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("draft")
    tiny_llama(64, seed=3, layers=1).save_pretrained(path)
    return path


def loader(draft_dir: Path) -> Callable[[Precision], LoadedModel]:
    def load(option: Precision) -> LoadedModel:
        return load_causal_lm(str(draft_dir), CPU, option.dtype, progress=False,
                              linear_kernel=option.linear_kernel)
    return load


def test_auto_keeps_the_fastest_measured_candidate(draft_dir: Path) -> None:
    choice = load_draft(loader(draft_dir), CPU, "auto", "auto", shared_dtype=torch.bfloat16,
                        target_vocab_size=None)
    assert set(choice.step_s) == {f"bfloat16/{BF16_AUTO_LINEAR}", "float32/torch",
                                  "float32/skinny"}
    assert all(seconds > 0 for seconds in choice.step_s.values())
    assert choice.step_s[choice.precision.label] == min(choice.step_s.values())
    parameter = next(choice.loaded.model.parameters())
    assert parameter.dtype == choice.precision.dtype
    assert choice.loaded.precision.startswith(
        f"{str(choice.precision.dtype).removeprefix('torch.')}, "
        f"{choice.precision.linear_kernel} linear")
    assert "the fastest one-token step of" in choice.describe()


def test_a_set_precision_is_loaded_as_is_without_measuring(draft_dir: Path) -> None:
    choice = load_draft(loader(draft_dir), CPU, "float32", "torch",
                        shared_dtype=torch.bfloat16, target_vocab_size=None)
    assert choice.precision == Precision(torch.float32, "torch") and not choice.step_s
    assert choice.loaded.precision == "float32, torch linear, grouped attention"
    assert choice.describe() == "float32/torch (as set); forward eager (--draft-compile off)"
