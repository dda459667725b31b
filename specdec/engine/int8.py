"""int8 weights for CPU decoding: one byte per weight, bfloat16 activations.

Decoding reads every weight once per token, so on a CPU its speed is the weights' bytes
over the memory bandwidth. `--dtype int8` stores each linear layer's weights (the
vocabulary projection included) in one byte each, about half of bfloat16's traffic,
and keeps everything else (embeddings, norms, attention, the KV cache) in bfloat16.

The format: each weight row is cut into groups of GROUP inputs; a group keeps a float32
scale s and offset o, and each weight a code c in 0..120, w = s * (128 + c) + o. A
GGUF Q4_1 block (a scale and minimum per 32 weights, 16 levels) is represented exactly
(c = 8 * q) when quantized from its float32 weights; the loader quantizes the bfloat16
model it loads, so the served weights also carry bfloat16's rounding (docs/models.md).
Other weights get an error of at most a 240th of a group's range. The operator's source
describes how the product is laid out for the CPU's vector units.

A layer whose groups hold at most 16 levels each (every code a multiple of 8: a 4-bit
GGUF's blocks, which the embedded target's layers all are) may keep its codes in 4 bits,
two to a byte. They decode to the same weights, so the layer computes the same bits from
half the code bytes, at the cost of a few more instructions per weight: where decoding
is bound by memory that is faster, where it is bound by arithmetic slower. So the
model's largest such layer times one-row products in both layouts when it is loaded,
and every such layer takes the faster one; other layers keep a byte a code.

The product is a small C++ operator (csrc/int8_linear.cpp, `torch.ops.specdec.int8_linear`)
compiled on first use with the machine's C++ compiler for its own CPU (AVX-512 BF16 or AVX2
where present, portable C++ elsewhere) and cached on disk. The AVX2 path, lacking
bfloat16 dot products, multiplies integers: each row enters as 16-bit integers times a
power of two per row (every input within 2^7 of the row's largest held exactly, smaller
ones to half a step), and the codes' products are summed exactly in int32 per group
before the scales apply (docs/models.md has its quality). Each output element is a sum
in an order fixed by the layer's width alone, so a row's result never depends on the
other rows in the forward: exact verification and batching of sessions hold by
construction, and the load-time probe (specdec.engine.kernels.row_invariant_rows) checks
it like the bfloat16 kernel's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from specdec.engine.cpu_operators import build, failure_summary, kernel_cache_dir

log = logging.getLogger(__name__)
Layer = TypeVar("Layer", bound=nn.Module)

GROUP = 32  # inputs per scale and offset
BLOCK = 4  # outputs the operator computes together: a layer needs a multiple of them
# Codes 0..120 (128 + code is exact in bfloat16 up to code 127): 120 steps per group
# hold a 16-level block (a GGUF Q4_1 block) exactly, at 8 codes a level.
LEVELS = 120
SOURCE = "int8_linear.cpp"  # in csrc/
EXTENSION = "specdec_int8_linear"
_loaded = False
_lock = threading.Lock()


class Int8KernelError(RuntimeError):
    """The int8 operator could not be built or loaded here."""


def load_operator() -> None:
    """Build (first use on a machine, about ten seconds) or load the operator; raise
    Int8KernelError with what to do when that fails."""
    global _loaded
    with _lock:
        if _loaded:
            return
        started = time.perf_counter()
        try:
            build_dir = build(EXTENSION, SOURCE)
        except Exception as error:  # a missing compiler raises several types
            raise Int8KernelError(
                f"--dtype int8 needs its CPU operator, which failed to build in "
                f"{kernel_cache_dir() / EXTENSION}: {failure_summary(error)}; "
                "install a C++ compiler (g++), or use --dtype bfloat16") from error
        torch.library.register_fake("specdec::int8_linear")(_fake_int8_linear)
        _loaded = True
        log.info("int8 operator ready in %.1f s (%s)", time.perf_counter() - started, build_dir)


def _fake_int8_linear(input: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      offsets: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # int8_pack's codes: [out / BLOCK, in / GROUP, BLOCK, GROUP]
    return input.new_empty((*input.shape[:-1], codes.shape[0] * BLOCK))


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [out, in], scales and offsets float32 [out, in / GROUP]) of a weight,
    in input order: w = scale * (128 + code) + offset per group of GROUP inputs."""
    out_features, in_features = weight.shape
    grouped = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = (high - low) / LEVELS
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = ((grouped - low[..., None]) / scales[..., None]).round_().clamp_(0, LEVELS)
    return (codes.to(torch.uint8).reshape(out_features, in_features), scales.contiguous(),
            (low - 128 * scales).contiguous())


def dequantize(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
               ) -> torch.Tensor:
    """The float32 weight that quantize's codes stand for (tests, quality checks)."""
    out_features, in_features = codes.shape
    grouped = codes.float().reshape(out_features, in_features // GROUP, GROUP)
    return (scales[..., None] * (128 + grouped) + offsets[..., None]).reshape(
        out_features, in_features)


def nibbles_fit(codes: torch.Tensor) -> bool:
    """Whether packed codes can be held in 4 bits: every one a multiple of 8."""
    return int(codes.shape[2]) == BLOCK and bool((codes % 8 == 0).all())


NIBBLE_PROBE_REPEATS = 15


@torch.inference_mode()
def nibbles_faster(layer: Int8Linear) -> bool:
    """Whether layer's one-row product is faster from 4-bit codes than from bytes on this
    CPU: medians of NIBBLE_PROBE_REPEATS products each, the layouts in turn."""
    nibbles = torch.ops.specdec.int8_nibbles(layer.codes)
    x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float32).to(torch.bfloat16)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(NIBBLE_PROBE_REPEATS):
        for use_nibbles, codes in ((False, layer.codes), (True, nibbles)):
            started = time.perf_counter()
            int8_product(x, codes, layer.scales, layer.offsets, layer.bias)
            times[use_nibbles].append(time.perf_counter() - started)
    byte_s, nibble_s = (sorted(times[key])[NIBBLE_PROBE_REPEATS // 2] for key in (False, True))
    log.info("int8: one-row product of a %d x %d layer %.0f us from 4-bit codes, %.0f us from "
             "bytes", layer.out_features, layer.in_features, nibble_s * 1e6, byte_s * 1e6)
    return nibble_s < byte_s


def supports(linear: nn.Linear) -> bool:
    return linear.in_features % GROUP == 0 and linear.out_features % BLOCK == 0


def int8_product(input: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """input @ w^T (+ bias) for int8_pack's operands, in bfloat16, returned in input's dtype."""
    out = torch.ops.specdec.int8_linear(input.to(torch.bfloat16), codes, scales, offsets, bias)
    return out if input.dtype == torch.bfloat16 else out.to(input.dtype)


class Int8Linear(nn.Module):
    """A linear layer on int8 weights (inference only; buffers, no parameters)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not supports(linear):
            raise ValueError(f"int8 linear needs in_features % {GROUP} == 0 and "
                             f"out_features % {BLOCK} == 0, got {linear.in_features} -> "
                             f"{linear.out_features}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The operator's layout (int8_pack): codes reordered so that each vector lane sums
        # one group's inputs; a scale and an offset per group.
        codes, scales, offsets = torch.ops.specdec.int8_pack(*quantize(linear.weight))
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return int8_product(input, self.codes, self.scales, self.offsets, self.bias)

    @property
    def nibbles(self) -> bool:
        """Whether the codes are held in 4 bits (int8_nibbles' layout)."""
        return int(self.codes.shape[2]) == BLOCK // 2

    def extra_repr(self) -> str:
        codes = "4-bit codes" if self.nibbles else "8-bit codes"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {codes}, groups of {GROUP}")


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], Layer]) -> list[Layer]:
    """Put make(layer) in place of every nn.Linear of model that the format fits (each
    module its own, a tied output projection included); returns the new modules."""
    replaced: list[Layer] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and supports(child):
                replaced.append(make(child))
                setattr(parent, name, replaced[-1])
    return replaced


def quantize_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of model that the format fits by an Int8Linear, in place
    (a tied output projection gets its own int8 copy; the embedding stays). Returns how
    many were replaced; the others keep their kernel."""
    load_operator()
    replaced = replace_linears(model, Int8Linear)
    fitting = [layer for layer in replaced if nibbles_fit(layer.codes)]
    if fitting and nibbles_faster(max(fitting, key=lambda layer: layer.codes.numel())):
        for layer in fitting:
            layer.codes = torch.ops.specdec.int8_nibbles(layer.codes)
    if getattr(model, "config", None) is not None and hasattr(model.config, "tie_word_embeddings"):
        # The output projection is its own module now; the embedding must not be re-tied
        # onto it (transformers re-ties on some calls when the flag is set).
        model.config.tie_word_embeddings = False
    return len(replaced)
