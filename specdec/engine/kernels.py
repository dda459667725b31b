"""The linear-layer kernel for decoding-sized batches, chosen by measurement.

Decoding multiplies a few rows (1 token, or the k + 1 of a verification) by every weight
matrix, so it is bound by reading the weights. On the CPUs measured (AMD EPYC, MKL,
float32), `F.linear` does that badly for small row counts: one row goes through a slow
GEMV, and a few rows through a GEMM path that is slower still. Computing the transposed
product W @ x^T instead reads the weights about twice as fast, provided x is row-major
(with x^T contiguous the same call is several times slower), and padding an odd row
count to an even one avoids a slow edge case (docs/performance.md has the numbers;
`specdec bench --costs-only --compare-dtypes float32@torch,float32@skinny` reproduces
them).

The product is the same matrix product; only the floating-point summation order differs,
exactly as it already differs between a 1-row and a (k+1)-row forward. It changes
nothing else: bfloat16, float16, CUDA and prefills (more than SKINNY_MAX_ROWS rows) keep
`F.linear`, which is as fast or faster there.

Kernels: "torch" (F.linear everywhere), "skinny" (the above), "onednn" (below), "int8"
(int8 weights with bfloat16 activations, specdec.engine.int8; what `--dtype int8`
selects), "auto" (on CPU skinny for float32 and onednn for bfloat16 where the CPU has
oneDNN's bfloat16 support, AVX-512 or AVX-NE-CONVERT; torch otherwise).

"onednn" hands the product to oneDNN with the weight reordered once, at load, into its
blocked layout (the path torch.compile's CPU backend takes for linear layers). Its cost
is nearly flat in the row count, which is what a verification needs: k + 1 rows cost
about what one does. From 2 rows up to some count each output row comes from the same
blocked reduction whatever the row count; 1 row takes another path, so 1-3 rows are
padded to 4 (also the fastest count): a row's logits do not depend on how many rows
share the forward, which exact verification in bfloat16 needs
(tests/test_row_invariance.py), and so does batching several sessions' rows into one
forward. The count up to which that holds differs by CPU and by weight shape, so
`row_invariant_rows` measures it for every shape when a model is loaded. Float32 keeps
the skinny kernel under "auto": its one-row forward measured faster there. The
reordered copy is held beside the weight (the weight stays: tied embeddings and
state_dict read it), so linear weights take twice their memory. Autograd goes through
`F.linear`: the reordered copy serves inference only, and is rebuilt if the weight
changes.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from specdec.settings import INT8_IF_AVAILABLE

log = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "skinny", "onednn", "int8")
INT8 = "int8"
SKINNY_MAX_ROWS = 16  # beyond this (a prefill) the regular GEMM path is efficient


class SkinnyLinear(nn.Linear):
    """nn.Linear computing small-row products as (W @ x^T)^T."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        features = input.shape[-1]
        rows = input.numel() // features if features else 0
        if not 0 < rows <= SKINNY_MAX_ROWS or input.dtype != torch.float32 \
                or input.device.type != "cpu":
            return F.linear(input, self.weight, self.bias)
        flat = input.reshape(rows, features)
        if rows % 2:
            flat = torch.cat([flat, flat[:1]])  # the odd-row path is the slow one
        # Row-major x only: with x^T contiguous MKL takes a path ~5x slower. The output is
        # made row-major too, or the next layer's input would be the slow layout.
        out = torch.mm(self.weight, flat.contiguous().t()).t()[:rows].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*input.shape[:-1], self.out_features)


class OneDnnLinear(nn.Linear):
    """nn.Linear running inference through oneDNN on a weight reordered once."""

    _packed: tuple[torch.Tensor, int, int] | None = None  # (weight, its version, data_ptr)

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        packed = self._packed
        if packed is None or packed[1] != weight._version or packed[2] != weight.data_ptr():
            # The hint is the row count to optimise for; 16 measured best for 1-16 rows.
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
            packed = self._packed = (reordered, weight._version, weight.data_ptr())
        return packed[0]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and self.weight.requires_grad) \
                or input.device.type != "cpu" or input.dtype != self.weight.dtype \
                or input.dtype not in ONEDNN_DTYPES:
            return F.linear(input, self.weight, self.bias)
        features = input.shape[-1]
        rows = input.numel() // features if features else 0
        if rows >= ONEDNN_MIN_ROWS or rows == 0:
            return torch.ops.mkldnn._linear_pointwise(
                input, self._packed_weight(), self.bias, "none", [], "")
        # One row takes a GEMV path whose summation order differs from every other row
        # count's, and two rows a slow one. Padded to four rows, a row's result is the
        # same in a decode, a verification and a prefill, and faster.
        flat = F.pad(input.reshape(rows, features), (0, 0, 0, ONEDNN_MIN_ROWS - rows))
        out = torch.ops.mkldnn._linear_pointwise(
            flat, self._packed_weight(), self.bias, "none", [], "")[:rows]
        return out.reshape(*input.shape[:-1], self.out_features)


ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
ONEDNN_MIN_ROWS = 4
_KERNEL_CLASSES: dict[str, type[nn.Linear]] = {
    "torch": nn.Linear, "skinny": SkinnyLinear, "onednn": OneDnnLinear}


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN serves linear layers of dtype on this CPU: bfloat16 also needs the
    CPU's support (AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU has neither)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    if kernel == INT8_IF_AVAILABLE:
        return INT8 if int8_runs(device, dtype) else resolve_kernel("auto", device, dtype)
    if kernel not in KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    if kernel == "auto":
        if device.type != "cpu":
            return "torch"
        if dtype == torch.float32:
            return "skinny"
        return "onednn" if dtype == torch.bfloat16 and onednn_available(dtype) else "torch"
    if kernel == INT8 and (device.type != "cpu" or dtype != torch.bfloat16):
        raise ValueError(f"the int8 linear kernel runs on the CPU with bfloat16 activations, "
                         f"not {device.type} {str(dtype).removeprefix('torch.')}; "
                         "use --dtype bfloat16 there")
    if kernel == "onednn" and not onednn_available():
        raise ValueError("linear kernel 'onednn' needs a torch build with oneDNN (mkldnn); "
                         "choose skinny or torch")
    if kernel == "onednn" and device.type == "cpu" and not onednn_available(dtype):
        raise ValueError("linear kernel 'onednn' in bfloat16 needs a CPU with AVX-512 (or "
                         "AVX-NE-CONVERT), which this one lacks; use --dtype auto (int8 "
                         "weights), --dtype float32 or --linear-kernel torch")
    return kernel


def int8_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the int8 kernel serves here: a CPU, bfloat16 activations, and an operator
    that builds (a C++ compiler); a failed build is logged with its cause."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    from specdec.engine.int8 import Int8KernelError, load_operator

    try:
        load_operator()
    except Int8KernelError as error:
        log.warning("--dtype auto: bfloat16 weights, as %s", error)
        return False
    return True


def apply_linear_kernel(model: nn.Module, kernel: str) -> str:
    """Switch every nn.Linear of model (in place, weights and ties kept) to kernel; int8
    replaces the layers its format fits with Int8Linear (specdec.engine.int8).

    Returns the kernel in use ("auto" resolved from the model's device and dtype).
    """
    parameter = next(model.parameters())
    chosen = rest = resolve_kernel(kernel, parameter.device, parameter.dtype)
    if chosen == INT8:
        from specdec.engine.int8 import quantize_linears

        quantize_linears(model)
        # Layers the int8 format does not fit keep a row-invariant kernel.
        rest = resolve_kernel("auto", parameter.device, parameter.dtype)
    new_class = _KERNEL_CLASSES[rest]
    for module in model.modules():
        if type(module) in _KERNEL_CLASSES.values():
            module.__class__ = new_class
    return chosen


ROW_INVARIANCE_PROBE_CAP = 256  # the largest row count the load-time probe checks
_ROW_INVARIANT_ROWS_ATTR = "_specdec_row_invariant_rows"


def row_invariant_rows(model: nn.Module, cap: int = ROW_INVARIANCE_PROBE_CAP) -> int | None:
    """The largest row count n <= cap for which the model's oneDNN and int8 linears give
    every row of an n-row product the bits a 4-row product gives that row; None when
    any of its linears is another kernel (no such guarantee is made for the others).

    oneDNN sums a row's products in an order that depends on the row count only beyond
    some count that differs by CPU and by the product's shape: the kernel it picks
    depends on the output width as well as the reduction length, and on some CPUs a wide
    output layer (the vocabulary projection) changes its order at far fewer rows than
    the narrow ones. So it is measured: one weight matrix per distinct shape of the
    model, on a seeded random probe, every n from ONEDNN_MIN_ROWS up to the smallest
    count found so far (the widest first). The int8 kernel is row-invariant by
    construction; the probe checks that too, at the counts that take its different
    paths (_int8_probe_counts). Measured once per model object and remembered on it.
    """
    from specdec.engine.int8 import Int8Linear

    known = getattr(model, _ROW_INVARIANT_ROWS_ATTR, False)
    if known is not False:
        return known  # type: ignore[no-any-return]
    layers: dict[tuple[int, int], nn.Module] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and not isinstance(module, OneDnnLinear):
            layers.clear()
            break
        if isinstance(module, OneDnnLinear | Int8Linear):
            layers.setdefault((module.in_features, module.out_features), module)
    result: int | None = None
    if layers and all(isinstance(layer, Int8Linear) or (
            layer.weight.device.type == "cpu" and layer.weight.dtype in ONEDNN_DTYPES)
            for layer in layers.values()):
        result = cap
        for shape in sorted(layers, key=lambda shape: shape[0] * shape[1], reverse=True):
            result = _invariant_rows(layers[shape], result)
        log.info("linear kernel row-invariant up to %d rows per forward (checked to %d); "
                 "larger batches are split", result, cap)
    setattr(model, _ROW_INVARIANT_ROWS_ATTR, result)
    return result


def _probe_counts(cap: int) -> list[int]:
    """Every row count up to 64 (thresholds such as 32 sit there), then every eighth."""
    return [*range(ONEDNN_MIN_ROWS + 1, min(cap, 64) + 1), *range(72, cap + 1, 8)]


def _int8_probe_counts(cap: int) -> list[int]:
    """The int8 operator sums each output in an order fixed by the layer's width; what a
    row count changes is how the rows are cut into passes of a few rows (and whether
    4-bit codes are expanded first), which every count to 16 exercises. Then a few larger
    counts, and the cap that the result claims."""
    counts = {*range(ONEDNN_MIN_ROWS + 1, 17), 24, 32, 64, 128, cap}
    return sorted(count for count in counts if count <= cap)


@torch.inference_mode()
def _invariant_rows(layer: nn.Module, cap: int) -> int:
    """The probe repeats one block of ONEDNN_MIN_ROWS rows, so one 4-row product is the
    reference for every row: a row whose bits depend on its place or on the row count
    shows up as a mismatch."""
    from specdec.engine.int8 import Int8Linear

    generator = torch.Generator().manual_seed(0)
    in_features: int = layer.in_features  # type: ignore[assignment]  # Linear or Int8Linear
    block = torch.randn(ONEDNN_MIN_ROWS, in_features, generator=generator)
    weight = getattr(layer, "weight", None)
    block = block.to(weight.dtype if isinstance(weight, torch.Tensor) else torch.bfloat16)
    reference = layer(block)
    probe = block.repeat(-(-cap // ONEDNN_MIN_ROWS), 1)
    expected = reference.repeat(-(-cap // ONEDNN_MIN_ROWS), 1)
    verified = ONEDNN_MIN_ROWS
    counts = _int8_probe_counts(cap) if isinstance(layer, Int8Linear) else _probe_counts(cap)
    for rows in counts:
        if not torch.equal(layer(probe[:rows]), expected[:rows]):
            return verified
        verified = rows
    return verified
