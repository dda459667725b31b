"""The fused step (specdec.engine.fused_step): the bits of transformers' forward, faster.

Every kind of forward the runner sends it (a short first forward, one-row decodes, a
chain verification, a token tree, several sessions packed) gives logits and a KV cache
equal bit for bit to the same forwards through transformers' LlamaForCausalLM, with and
without biases on the attention layers; it runs only where it fits.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.engine import fused_step, int8
from specdec.engine.attention import apply_attention_kernel
from specdec.engine.extend import FUSED_STEP_ATTRIBUTE, ExtendRequest
from specdec.engine.fused_step import FUSED, FusedStep, fits, install
from specdec.engine.kernels import apply_linear_kernel, int8_runs
from specdec.engine.runner import ModelRunner

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not int8_runs(CPU, torch.bfloat16),
                                reason="the int8 operator does not build here")


def _served(bias: bool = False) -> LlamaForCausalLM:
    """A small Llama as the cpu-tuned backend serves it under --dtype auto."""
    if bias:
        torch.manual_seed(1)
        config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, attention_bias=True,
                             tie_word_embeddings=False)
        model = LlamaForCausalLM(config).eval()
    else:
        model = tiny_llama(vocab_size=96, hidden=64, layers=3)
    model = model.to(torch.bfloat16)
    int8.load_operator()
    apply_linear_kernel(model, "int8")
    apply_attention_kernel(model, "rowwise")
    return model


def _forwards(runner: ModelRunner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of each kind of forward, and session a's KV cache after them."""
    def held(session: str) -> tuple[int, int]:
        history = runner._sessions[session].history
        return len(history), history.fingerprint(len(history))

    logits = [runner.extend("a", 0, 0, list(range(3, 43))).logits,  # prefill (transformers)
              runner.extend("b", 0, 0, [7, 8, 9, 10, 11]).logits]  # a first forward, 5 rows
    logits.append(runner.extend("a", *held("a"), [5, 6, 7, 8, 9], num_logits=5).logits)
    logits.append(runner.extend("a", 42, runner._sessions["a"].history.fingerprint(42), [11]
                                ).logits)  # a rollback, then one row
    position, fingerprint = held("a")
    logits.append(runner.extend("a", position, fingerprint, [12, 13, 14, 15], num_logits=4,
                                branch_parents=(position, position)).logits)  # a token tree
    results = runner.extend_batch([ExtendRequest("a", *held("a"), [21, 22, 23], 3),
                                   ExtendRequest("b", *held("b"), [31, 32], 2)])
    logits.extend(result.logits for result in results)  # type: ignore[union-attr]
    position, fingerprint = held("a")
    results = runner.extend_batch([  # packed again, a's rows a token tree
        ExtendRequest("a", position, fingerprint, [41, 42, 43], 3, branch_parents=(position,)),
        ExtendRequest("b", *held("b"), [51], 1)])
    logits.extend(result.logits for result in results)  # type: ignore[union-attr]
    cache = runner._sessions["a"].cache
    return logits, [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]


class _NoOperators:
    """LAYER_OPERATORS where the C++ layer operators do not build."""

    def get(self) -> None:
        return None


class _CountedOperators:
    """The C++ layer operators, counting whole-layer calls (one sequence or packed
    sessions over caches that hold keys) apart from the two-call layers (a first
    forward)."""

    def __init__(self) -> None:
        self.whole_layers = 0

    def get(self) -> tuple[Any, ...]:
        operators = self._inner.get()
        assert operators is not None

        def whole_layer(*args: Any) -> Any:
            self.whole_layers += 1
            return operators[2](*args)

        return (operators[0], operators[1], whole_layer, *operators[3:])

    _inner = fused_step.LAYER_OPERATORS  # the real ones, whatever the test patches in


@pytest.mark.parametrize("layers", ["operators", "python"])
@pytest.mark.parametrize("bias", [False, True])
def test_every_forward_equals_transformers_bit_for_bit(monkeypatch, bias: bool,  # type: ignore[no-untyped-def]
                                                        layers: str) -> None:
    """With each layer's work in the C++ operators, and in Python where they do not
    build."""
    counted = _CountedOperators()
    if layers == "operators":
        assert fused_step.LAYER_OPERATORS.get() is not None
        monkeypatch.setattr(fused_step, "LAYER_OPERATORS", counted)
    else:
        monkeypatch.setattr(fused_step, "LAYER_OPERATORS", _NoOperators())
    model = _served(bias)
    assert install(model, "auto") == FUSED
    fused = ModelRunner(model)
    assert fused._fused_step is getattr(model, FUSED_STEP_ATTRIBUTE)
    step: FusedStep = fused._fused_step  # type: ignore[assignment]
    assert all(step.native) if layers == "operators" else not any(step.native)
    stock = ModelRunner(model)
    stock._fused_step = None
    with torch.inference_mode():
        fused_logits, fused_cache = _forwards(fused)
        stock_logits, stock_cache = _forwards(stock)
    assert [tuple(t.shape) for t in fused_logits] == [
        (1, 96), (1, 96), (5, 96), (1, 96), (4, 96), (3, 96), (2, 96), (3, 96), (1, 96)]
    for ours, theirs in zip(fused_logits + fused_cache, stock_logits + stock_cache, strict=True):
        assert torch.equal(ours, theirs)
    # Session a's one-sequence forwards (a chain, one row, a tree) and the two packed
    # forwards of a and b ran whole layers; b's first forward did not.
    assert counted.whole_layers == (5 * len(step.layers) if layers == "operators" else 0)


@pytest.mark.parametrize("width", [64, 100, 576, 960, 4099])
def test_the_cpp_norm_has_the_bits_of_transformers_norm(width: int) -> None:
    """The one-pass RMSNorm adds the squares in at::sum's order, found on this CPU (on
    x86, whose ATen sums in vectors of 8 or 16 floats, an order is always found; other
    CPUs may take ATen's operations instead, with the same bits)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    operators = fused_step.LAYER_OPERATORS.get()
    assert operators is not None
    rms_norm, sum_lanes = operators[3], operators[4]
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert sum_lanes(width) > 0  # an order that gives at::sum's bits, not the fallback
    generator = torch.Generator().manual_seed(width)
    norm = LlamaRMSNorm(width, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = (1 + 0.5 * torch.randn(width, generator=generator)).to(torch.bfloat16)
    for rows in (1, 3, 9, 70):  # 70 rows: at::sum splits the rows over threads
        spread = torch.exp(3 * torch.randn(1, rows, 1, generator=generator))
        hidden = (torch.randn(1, rows, width, generator=generator) * spread).to(torch.bfloat16)
        assert torch.equal(rms_norm(hidden, norm.weight, 1e-5), norm(hidden))


def test_fused_layers_share_one_copy_of_the_weights() -> None:
    model = _served()
    attention = model.model.layers[0].self_attn
    codes = attention.k_proj.codes.clone()
    step = FusedStep(model)
    fused = step.layers[0].qkv
    assert len(fused) == 1
    assert attention.k_proj.codes.untyped_storage().data_ptr() == \
        fused[0].codes.untyped_storage().data_ptr()
    assert torch.equal(attention.k_proj.codes, codes)  # still its own weights
    assert len(step.layers[0].gate_up) == 1


def test_it_runs_only_where_it_fits(tmp_path: Path) -> None:
    model = tiny_llama(vocab_size=96, hidden=64).to(torch.bfloat16)
    apply_attention_kernel(model, "rowwise")
    assert "not int8" in str(fits(model))
    assert install(model, "auto").startswith("transformers forward (fused step:")
    assert ModelRunner(model)._fused_step is None
    model = _served()
    apply_attention_kernel(model, "sdpa")
    assert "not the rowwise kernel" in str(fits(model))
    model = _served()
    assert install(model, "off") == "transformers forward (--fused-step off)"
    assert ModelRunner(model)._fused_step is None
    with pytest.raises(ValueError, match="fused step setting"):
        install(model, "on")
    with pytest.raises(ValueError, match="does not fit"):
        FusedStep(tiny_llama())


def test_a_draft_on_the_fused_step_is_not_compiled() -> None:
    from specdec.engine.draft_compile import compile_draft

    model = _served()
    assert install(model, "auto") == FUSED
    outcome = compile_draft(model, lambda: ModelRunner(model), "auto", CPU)
    assert not outcome.compiled and "fused step" in outcome.detail
