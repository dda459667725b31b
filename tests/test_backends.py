"""The backend seam: chosen at load from the device, dtype and --backend; the cpu-tuned
backend applies the CPU kernels, the torch backend (CUDA's path) stock ones."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cpu_features import ONEDNN_BF16


def test_backend_follows_the_device() -> None:
    from specdec.engine.backends import backend_name

    assert backend_name("auto", torch.device("cpu")) == "cpu-tuned"
    assert backend_name("auto", torch.device("cuda")) == "torch"
    assert backend_name("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        backend_name("fast", torch.device("cpu"))


def test_select_backend_reads_the_settings() -> None:
    from specdec.engine.backends import CpuTunedBackend, TorchBackend, select_backend

    cpu = select_backend(SimpleNamespace(device="cpu", dtype="bfloat16", draft_dtype="same",
                                         linear_kernel="skinny"))
    assert isinstance(cpu, CpuTunedBackend)
    assert (cpu.dtype, cpu.draft_dtype, cpu.draft_linear_kernel) == (
        torch.bfloat16, "bfloat16", "skinny")
    stock = select_backend(SimpleNamespace(device="cpu", dtype="float32", backend="torch"))
    assert isinstance(stock, TorchBackend) and stock.dtype == torch.float32


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import tiny_llama

    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_llama(vocab_size=64, seed=3).save_pretrained(path)
    return path


def test_torch_backend_loads_stock_kernels(tiny_model_dir: Path) -> None:
    from specdec.engine.backends import TorchBackend
    from specdec.engine.runner import ModelRunner

    backend = TorchBackend(torch.device("cpu"), torch.float32)
    loaded = backend.load(str(tiny_model_dir))
    assert loaded.precision == "float32, torch linear, sdpa attention"
    assert loaded.row_invariant is False
    assert type(loaded.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert loaded.model.config._attn_implementation == "sdpa"
    assert ModelRunner(loaded.model)._row_invariant is loaded.row_invariant
    draft = backend.load_draft(str(tiny_model_dir), target_vocab_size=None)
    assert draft.precision.dtype == torch.float32 and not draft.compiled.compiled


def test_cpu_tuned_backend_applies_row_invariant_kernels(tiny_model_dir: Path) -> None:
    from specdec.engine.backends import CpuTunedBackend
    from specdec.engine.runner import ModelRunner

    loaded = CpuTunedBackend(torch.device("cpu"), torch.bfloat16).load(str(tiny_model_dir))
    assert loaded.precision.endswith("rowwise attention")
    assert loaded.row_invariant is True
    # oneDNN's bfloat16 product is measured row-invariant; F.linear (a CPU without oneDNN
    # bfloat16) makes no such claim, and the loader carries the caveat it logs.
    assert (loaded.max_invariant_rows is not None) is ONEDNN_BF16
    assert (loaded.row_invariance_caveat is None) is ONEDNN_BF16
    assert ModelRunner(loaded.model)._row_invariant is loaded.row_invariant
    stock = CpuTunedBackend(torch.device("cpu"), torch.float32, linear_kernel="torch",
                            attention_kernel="sdpa").load(str(tiny_model_dir))
    assert stock.row_invariant is False


def test_models_from_the_torch_backend_decode_exactly(tmp_path: Path) -> None:
    """The stock-kernel path (CUDA's) on CPU in float32: speculative greedy output equals
    transformers' own greedy decoding of the same target."""
    from tiny_models import assert_speculative_greedy_equals_hf, tiny_llama

    from specdec.engine.backends import TorchBackend

    tiny_llama(vocab_size=64, seed=5).save_pretrained(tmp_path / "target")
    tiny_llama(vocab_size=64, seed=6, layers=1).save_pretrained(tmp_path / "draft")
    backend = TorchBackend(torch.device("cpu"), torch.float32)
    target = backend.load(str(tmp_path / "target")).model
    draft = backend.load_draft(str(tmp_path / "draft"), target_vocab_size=None).loaded.model
    assert_speculative_greedy_equals_hf(target, target, draft, lengths=(1, 4))
