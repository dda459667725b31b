"""How models run on a device: one Backend chosen at load from the device and dtype.

The cpu-tuned backend owns what is specific to CPUs: the row-invariant linear and
attention kernels, the draft's precision and compile choice measured at load, and the
OpenMP thread count. The torch backend (CUDA and anything else) loads models with
transformers' stock kernels. The rest of the system reads what it needs as plain facts
on the loaded model (LoadedModel.row_invariance, from specdec.engine.backends.row_invariance),
so a new backend slots in here without touching the runner, the steps or the servicers.

`--backend auto` (SPECDEC_BACKEND) picks cpu-tuned on a CPU and torch elsewhere; the
fine knobs (--linear-kernel, --attention-kernel, --draft-dtype, --draft-linear-kernel,
--draft-compile, --fused-step, --torch-threads) are the cpu-tuned backend's advanced overrides.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from specdec.engine.backends.base import Backend, DraftChoice
from specdec.engine.backends.cpu import CpuTunedBackend, load_causal_lm
from specdec.engine.backends.stock import TorchBackend
from specdec.engine.models import parse_device, parse_dtype
from specdec.settings import BACKENDS, default, draft_dtype_for, linear_kernel_for

__all__ = ["Backend", "CpuTunedBackend", "DraftChoice", "TorchBackend", "backend_name",
           "load_causal_lm", "select_backend"]

log = logging.getLogger(__name__)

# Which fine knobs only the cpu-tuned backend reads, with their defaults.
CPU_KNOBS = ("linear_kernel", "attention_kernel", "draft_dtype", "draft_linear_kernel",
             "draft_compile", "torch_threads", "fused_step")


def backend_name(setting: str, device: torch.device) -> str:
    """The backend `setting` (auto, cpu-tuned or torch) names on `device`."""
    if setting not in BACKENDS:
        raise ValueError(f"unknown backend {setting!r}; choose one of {', '.join(BACKENDS)}")
    if setting == "auto":
        return "cpu-tuned" if device.type == "cpu" else "torch"
    return setting


def select_backend(args: Any) -> Backend:
    """The backend the settings name (args: parsed flags, or anything with the same
    attributes; missing ones take their defaults)."""
    def get(name: str) -> Any:
        value = getattr(args, name, None)
        return default(name.replace("_", "-")) if value is None else value

    device, dtype = parse_device(get("device")), parse_dtype(get("dtype"))
    name = backend_name(get("backend"), device)
    if name == "torch":
        changed = [f"--{knob.replace('_', '-')}" for knob in CPU_KNOBS
                   if get(knob) != default(knob.replace("_", "-"))]
        if changed:
            log.warning("the torch backend uses stock kernels and ignores %s",
                        ", ".join(changed))
        return TorchBackend(device, dtype)
    linear_kernel = linear_kernel_for(get("dtype"), get("linear_kernel"))
    return CpuTunedBackend(
        device, dtype, linear_kernel=linear_kernel,
        attention_kernel=get("attention_kernel"),
        draft_dtype=draft_dtype_for(get("draft_dtype"), get("dtype")),
        draft_linear_kernel=get("draft_linear_kernel") or linear_kernel,
        draft_compile=get("draft_compile") or "auto", torch_threads=get("torch_threads"),
        fused_step=get("fused_step"))
