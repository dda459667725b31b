"""The skinny linear kernel: same products as F.linear, same greedy text, only where chosen;
and the warning where the served target's kernels are not row-invariant."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import assert_speculative_greedy_equals_hf, tiny_gpt2, tiny_llama
from torch import nn

from specdec.engine.kernels import (
    SKINNY_MAX_ROWS,
    SkinnyLinear,
    apply_linear_kernel,
    onednn_available,
    resolve_kernel,
)
from specdec.engine.models import row_invariance_caveat
from specdec.serving.model_service import load_runner


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (3, 64), (1, 5, 64), (2, 3, 64),
                                   (1, SKINNY_MAX_ROWS, 64), (1, SKINNY_MAX_ROWS + 1, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(64, 300, bias=bias)
    x = torch.randn(*shape)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.__class__ = SkinnyLinear
    out = layer(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_skinny_linear_keeps_gradients_off_and_other_dtypes_on_f_linear() -> None:
    layer = SkinnyLinear(8, 4).to(torch.bfloat16)
    x = torch.randn(1, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # bit-identical path


def test_auto_resolves_by_device_and_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kernel("auto", cpu, torch.float32) == "skinny"
    if onednn_available(torch.bfloat16):
        assert resolve_kernel("auto", cpu, torch.bfloat16) == "onednn"
    else:  # an AVX2-only CPU: oneDNN has no bfloat16 there, and naming it says why
        assert resolve_kernel("auto", cpu, torch.bfloat16) == "torch"
        with pytest.raises(ValueError, match="needs a CPU with AVX-512"):
            resolve_kernel("onednn", cpu, torch.bfloat16)
    assert resolve_kernel("auto", cpu, torch.float16) == "torch"
    assert resolve_kernel("auto", cuda, torch.float32) == "torch"
    assert resolve_kernel("torch", cpu, torch.float32) == "torch"
    with pytest.raises(ValueError, match="unknown linear kernel 'fast'"):
        resolve_kernel("fast", cpu, torch.float32)


def test_apply_switches_every_linear_and_keeps_tied_weights() -> None:
    model = tiny_llama(vocab_size=32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert apply_linear_kernel(model, "auto") == "skinny"
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is SkinnyLinear for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert apply_linear_kernel(model, "torch") == "torch"
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("make", [lambda: tiny_llama(vocab_size=64, seed=3, logit_scale=3.0),
                                  lambda: tiny_gpt2(vocab_size=64, seed=3)])
def test_greedy_with_skinny_kernel_equals_hf_generate_with_torch_kernel(make) -> None:  # type: ignore[no-untyped-def]
    """The kernel changes summation order only: greedy text is the target's own."""
    target = make()
    reference = copy.deepcopy(target)  # F.linear everywhere
    draft = tiny_llama(vocab_size=64, seed=4, layers=1)
    apply_linear_kernel(target, "skinny")
    apply_linear_kernel(draft, "skinny")
    assert any(type(m) is SkinnyLinear for m in target.modules())
    assert_speculative_greedy_equals_hf(target, reference, draft)


def test_the_caveat_names_kernels_that_are_not_row_invariant() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert row_invariance_caveat(cpu, torch.bfloat16, "onednn", "rowwise") is None
    assert row_invariance_caveat(cpu, torch.bfloat16, "int8", "rowwise") is None
    assert row_invariance_caveat(cpu, torch.bfloat16, "int8", "sdpa") is not None
    assert row_invariance_caveat(cpu, torch.float32, "skinny", "grouped") is None
    assert row_invariance_caveat(cuda, torch.float32, "torch", "sdpa") is None
    on_cpu = row_invariance_caveat(cpu, torch.bfloat16, "torch", "sdpa")
    assert on_cpu and "torch linear and sdpa attention" in on_cpu and "--dtype float32" in on_cpu
    on_cuda = row_invariance_caveat(cuda, torch.bfloat16, "torch", "sdpa")
    assert on_cuda and "cuBLAS" in on_cuda
    assert row_invariance_caveat(cpu, torch.float16, "torch", "rowwise") is not None


def test_the_target_service_loader_warns_only_off_the_row_invariant_kernels(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tiny_llama(vocab_size=16, seed=1).save_pretrained(tmp_path)
    caplog.set_level(logging.WARNING, logger="specdec.serving.model_service")
    load_runner(str(tmp_path), device=torch.device("cpu"), dtype=torch.bfloat16)
    warned = [record for record in caplog.records if "row-invariant" in record.message]
    # bfloat16's row-invariant linear is oneDNN's: on a CPU without its bfloat16 support the
    # defaults fall back to F.linear, and the loader says what that means.
    assert len(warned) == (0 if onednn_available(torch.bfloat16) else 1)
    caplog.clear()
    load_runner(str(tmp_path), device=torch.device("cpu"), dtype=torch.bfloat16,
                linear_kernel="torch", attention_kernel="sdpa")
    warned = [record for record in caplog.records if "row-invariant" in record.message]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
