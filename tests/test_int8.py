"""--dtype int8: the int8 weight format, its CPU operator, and the model it serves.

The operator is built once per machine (tests share the on-disk build). Exactness of the
served int8 target (verification rows and token trees equal decoded rows bit for bit,
greedy speculation equal to target-only decoding) is in test_row_invariance.py."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama
from torch import nn

from specdec.engine import int8
from specdec.engine.attention import apply_attention_kernel
from specdec.engine.backends import select_backend
from specdec.engine.kernels import apply_linear_kernel, resolve_kernel, row_invariant_rows
from specdec.engine.models import parse_dtype
from specdec.engine.runner import ModelRunner
from specdec.settings import INT8_IF_AVAILABLE, linear_kernel_for

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def operator() -> None:
    int8.load_operator()


def _layer(in_features: int, out_features: int, bias: bool = False, seed: int = 0
           ) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def test_a_q4_1_block_is_held_exactly() -> None:
    """A weight made like a GGUF Q4_1 block (a scale d and minimum m per 32 weights,
    w = d * q + m with q in 0..15) comes back as itself: the embedded target keeps its
    own weights."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (8, 4, 32), generator=generator).float()
    q[..., 0], q[..., 1] = 0, 15  # every block spans all 16 levels
    d = torch.rand(8, 4, 1, generator=generator) * 0.01 + 1e-3
    m = -torch.rand(8, 4, 1, generator=generator) * 0.05
    weight = (d * q + m).reshape(8, 128)
    restored = int8.dequantize(*int8.quantize(weight))
    torch.testing.assert_close(restored, weight, rtol=0, atol=1e-7)


def _q4_1_layer(in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    """A layer whose every group of 32 weights is a Q4_1 block spanning its 16 levels."""
    generator = torch.Generator().manual_seed(in_features + out_features)
    q = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=generator).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(out_features, in_features // 32, 1, generator=generator) * 0.01 + 1e-3
    m = -torch.rand(out_features, in_features // 32, 1, generator=generator) * 0.05
    layer = _layer(in_features, out_features, bias)
    with torch.no_grad():
        layer.weight.copy_((d * q + m).reshape(out_features, in_features))
    return layer


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 192), (1536, 64), (96, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_16_level_codes_in_4_bits_give_the_same_bits(in_features: int, out_features: int,
                                                     bias: bool) -> None:
    """A layer of Q4_1 blocks keeps its codes in 4 bits, half the bytes, and every product
    equals the one from its 8-bit codes bit for bit, for any row count."""
    quantized = int8.Int8Linear(_q4_1_layer(in_features, out_features, bias))
    assert not quantized.nibbles and int8.nibbles_fit(quantized.codes)
    nibbles = torch.ops.specdec.int8_nibbles(quantized.codes)
    assert nibbles.numel() == out_features * in_features // 2
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 4, 5, 8, 9, 17):
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        assert torch.equal(quantized(x), int8.int8_product(x, nibbles, quantized.scales,
                                                           quantized.offsets, quantized.bias))


def test_other_weights_keep_8_bit_codes_and_4_bits_refuse_them() -> None:
    quantized = int8.Int8Linear(_layer(96, 8))
    assert not int8.nibbles_fit(quantized.codes)
    with pytest.raises(RuntimeError, match="not a multiple of 8"):
        torch.ops.specdec.int8_nibbles(quantized.codes)


@pytest.mark.parametrize("faster", [False, True])
def test_a_model_takes_4_bit_codes_where_they_fit_and_measure_faster(
        monkeypatch: pytest.MonkeyPatch, faster: bool) -> None:
    measured: list[int] = []

    def probe(layer: int8.Int8Linear) -> bool:
        measured.append(layer.out_features)
        return faster

    monkeypatch.setattr(int8, "nibbles_faster", probe)
    model = nn.Sequential(_q4_1_layer(64, 8), _q4_1_layer(64, 32), _layer(64, 8))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        before = [int8.Int8Linear(layer)(x) for layer in model]
    assert int8.quantize_linears(model) == 3
    assert measured == [32]  # the largest layer that fits, once
    assert [layer.nibbles for layer in model] == [faster, faster, False]
    with torch.no_grad():
        assert all(torch.equal(layer(x), out) for layer, out in zip(model, before, strict=True))



def test_any_weight_is_held_within_a_240th_of_its_group_range() -> None:
    weight = torch.randn(16, 96) * 0.05
    restored = int8.dequantize(*int8.quantize(weight))
    grouped = weight.reshape(16, 3, 32)
    bound = (grouped.amax(-1) - grouped.amin(-1)) / (2 * int8.LEVELS)
    error = (restored - weight).abs().reshape(16, 3, 32).amax(-1)
    assert bool((error <= bound * 1.001 + 1e-8).all())


@pytest.mark.parametrize(("in_features", "out_features"),
                         [(576, 192), (1536, 64), (96, 8), (32, 4), (544, 12)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_operator_computes_x_times_the_weight_it_holds(in_features: int,
                                                           out_features: int,
                                                           bias: bool) -> None:
    layer = _layer(in_features, out_features, bias)
    quantized = int8.Int8Linear(layer)
    # One scale and one offset per group of 32 weights: no more bytes than that to read.
    assert quantized.scales.shape == quantized.offsets.shape == (out_features, in_features // 32)
    x = torch.randn(7, in_features).bfloat16()
    weight = int8.dequantize(*int8.quantize(layer.weight))
    expected = x.float() @ weight.T + (layer.bias.detach() if bias else 0)
    got = quantized(x).float()
    # bfloat16 output: a relative rounding of 2^-8, on sums of products of that size.
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=2e-2 * expected.abs().max().item())


def test_rows_of_any_magnitude_and_outliers_keep_their_accuracy() -> None:
    """Each row is computed at its own scale (the AVX2 path's 16-bit inputs take a power of
    two per row): tiny, huge and all-zero rows, and a row whose largest input dwarfs the
    rest, stay as accurate as a row of ordinary inputs."""
    layer = _layer(576, 64, bias=True)
    quantized = int8.Int8Linear(layer)
    weight = int8.dequantize(*int8.quantize(layer.weight))
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(5, 576, generator=generator)
    x = torch.stack([base[0] * 1e-30, base[1] * 1e30, torch.zeros(576), base[3], base[4]])
    x[3, 7] = 3e3  # an outlier channel; the other inputs are about 2^-11 of it
    x = x.bfloat16()
    got = quantized(x).float()
    for row in range(5):
        expected = x[row].float() @ weight.T + layer.bias.detach()
        torch.testing.assert_close(got[row], expected, rtol=1e-2,
                                   atol=2e-2 * expected.abs().max().item(), msg=f"row {row}")


def test_a_row_holding_an_infinity_or_a_nan_gives_no_finite_output_and_leaves_the_others(
        ) -> None:
    quantized = int8.Int8Linear(_layer(96, 8))
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4)).bfloat16()
    clean = quantized(x)
    x[1, 5], x[2, 9] = float("inf"), float("nan")
    got = quantized(x)
    assert not bool(got[1:3].isfinite().any())
    assert torch.equal(got[0], clean[0]) and torch.equal(got[3], clean[3])


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 192), (1536, 64), (96, 8)])
def test_a_row_gets_the_same_bits_whatever_shares_its_forward(in_features: int,
                                                               out_features: int) -> None:
    """Every row of an n-row product equals that row alone, for every n up to 40 and any
    place of the row among the others (what verification and batching need)."""
    quantized = int8.Int8Linear(_layer(in_features, out_features))
    x = torch.randn(40, in_features).bfloat16()
    alone = torch.cat([quantized(x[row:row + 1]) for row in range(40)])
    for rows in range(1, 41):
        assert torch.equal(quantized(x[:rows]), alone[:rows]), rows
    shuffled = torch.randperm(40)
    assert torch.equal(quantized(x[shuffled]), alone[shuffled])
    assert torch.equal(quantized(x.reshape(2, 20, in_features)).reshape(40, -1), alone)


def test_the_row_bits_do_not_depend_on_the_thread_count() -> None:
    quantized = int8.Int8Linear(_layer(576, 1536))
    x = torch.randn(5, 576).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quantized(x)
        torch.set_num_threads(2)
        two = quantized(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_a_model_on_int8_is_row_invariant_by_the_load_probe_and_in_its_forward() -> None:
    model = tiny_llama(vocab_size=64, hidden=64).to(torch.bfloat16)
    assert apply_linear_kernel(model, "int8") == "int8"
    apply_attention_kernel(model, "auto")  # rowwise in bfloat16, as the backend serves it
    assert sum(isinstance(m, int8.Int8Linear) for m in model.modules()) == 2 * 7 + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert row_invariant_rows(model) == 256
    runner = ModelRunner(model)
    prompt, block = list(range(3, 40)), [5, 9, 11, 2, 60, 7]
    runner.extend("v", 0, 0, prompt)
    verified = runner.extend("v", len(prompt), runner._sessions["v"].history.fingerprint(),
                             block, num_logits=len(block)).logits
    runner.extend("d", 0, 0, prompt)
    decoded = [runner.append("d", [token]).logits for token in block]
    assert torch.equal(verified, torch.cat(decoded))


class _PassesDifferAt(int8.Int8Linear):
    """An int8 layer whose rows take another order at exactly `count` rows (as a pass
    split gone wrong would): those outputs move by one step of their precision."""

    count = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = super().forward(input)
        return torch.nextafter(out, out + 1) if input.shape[0] == self.count else out


@pytest.mark.parametrize(("count", "found"), [(7, 6), (16, 15), (64, 32), (256, 128)])
def test_the_load_probe_finds_an_int8_layer_that_a_row_count_changes(count: int,
                                                                      found: int) -> None:
    layer = _PassesDifferAt(_layer(64, 32))
    layer.count = count
    assert row_invariant_rows(nn.Sequential(layer)) == found


def test_dtype_int8_names_the_int8_kernel_with_bfloat16_activations() -> None:
    assert parse_dtype("int8") == torch.bfloat16
    assert linear_kernel_for("int8", "auto") == "int8"
    assert linear_kernel_for("bfloat16", "auto") == "auto"
    assert linear_kernel_for("auto", "onednn") == "onednn"  # a named kernel wins
    backend = select_backend(type("Args", (), {"dtype": "int8"})())
    assert backend.dtype == torch.bfloat16 and "linear int8" in backend.describe()


@pytest.mark.parametrize(("device", "dtype"), [("cuda", torch.bfloat16),
                                               ("cpu", torch.float32)])
def test_int8_elsewhere_is_refused_with_the_setting_to_use(device: str,
                                                           dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="use --dtype bfloat16"):
        resolve_kernel("int8", torch.device(device), dtype)


def test_a_build_failure_names_the_compiler_and_the_way_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.cpp_extension

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension: g++: not found")

    monkeypatch.setattr(int8, "_loaded", False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with pytest.raises(int8.Int8KernelError, match=r"install a C\+\+ compiler .* --dtype "
                                                   r"bfloat16"):
        int8.load_operator()


def test_dtype_auto_serves_int8_on_a_cpu_where_the_operator_runs() -> None:
    assert parse_dtype("auto") == torch.bfloat16
    kernel = linear_kernel_for("auto", "auto")
    assert kernel == INT8_IF_AVAILABLE
    cpu = torch.device("cpu")
    assert resolve_kernel(kernel, cpu, torch.bfloat16) == "int8"
    # Where int8 cannot run, auto is the dtype's own kernel, not an error.
    assert resolve_kernel(kernel, torch.device("cuda"), torch.bfloat16) == "torch"
    assert resolve_kernel(kernel, cpu, torch.float32) == "skinny"
    model = tiny_llama(vocab_size=64, hidden=64).to(torch.bfloat16)
    assert apply_linear_kernel(model, kernel) == "int8"
    assert any(isinstance(m, int8.Int8Linear) for m in model.modules())


def test_dtype_auto_falls_back_to_bfloat16_and_says_why_when_the_build_fails(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import torch.utils.cpp_extension

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension: g++: not found")

    monkeypatch.setattr(int8, "_loaded", False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    model = tiny_llama(vocab_size=64, hidden=64).to(torch.bfloat16)
    with caplog.at_level("WARNING"):
        assert apply_linear_kernel(model, INT8_IF_AVAILABLE) == resolve_kernel(
            "auto", torch.device("cpu"), torch.bfloat16)
    assert "bfloat16 weights" in caplog.text and "g++: not found" in caplog.text
    assert not any(isinstance(m, int8.Int8Linear) for m in model.modules())
    with pytest.raises(int8.Int8KernelError):  # --dtype int8 asked for it: an error
        apply_linear_kernel(tiny_llama(vocab_size=64, hidden=64).to(torch.bfloat16), "int8")


def test_the_operator_compiles_into_a_torch_compile_graph() -> None:
    """torch.compile traces the operator through its registered shape function."""
    layer = int8.Int8Linear(_layer(96, 40))
    inputs = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)).bfloat16()

    def forward(x: torch.Tensor) -> torch.Tensor:  # the shape matters downstream
        return layer(x).reshape(3, 2, 20).sum(-1)

    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(inputs), forward(inputs))
