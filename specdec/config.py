"""Flags and SPECDEC_* environment variables: one name per setting, everywhere.

Every flag `--some-setting` defaults to the environment variable `SPECDEC_SOME_SETTING`,
so the CLI, the Kubernetes ConfigMap and the README all use the same names.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from specdec.draft_compile import AUTO as COMPILE_AUTO
from specdec.draft_compile import SETTINGS as COMPILE_SETTINGS
from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, parse_device, parse_dtype


def env_name(flag: str) -> str:
    return "SPECDEC_" + flag.lstrip("-").replace("-", "_").upper()


def add_setting(parser: argparse.ArgumentParser, flag: str, default: Any, help: str,
                type: Any = str, **kwargs: Any) -> None:
    """Add --flag whose default comes from SPECDEC_FLAG, then from `default`."""
    raw = os.environ.get(env_name(flag))
    value = type(raw) if raw not in (None, "") else default
    parser.add_argument(flag, default=value, type=type,
                        help=f"{help} (env {env_name(flag)}; default: {default})", **kwargs)


def add_model_settings(parser: argparse.ArgumentParser,
                       roles: tuple[str, ...] = ("target", "draft")) -> None:
    if "target" in roles:
        add_setting(parser, "--target-model", DEFAULT_TARGET,
                    "target model: the embedded SmolLM2-135M-Instruct, or any HF path or id")
    if "draft" in roles:
        add_setting(parser, "--draft-model", DEFAULT_DRAFT,
                    "draft model: the embedded trained draft, or any HF path or id")
    add_setting(parser, "--device", "cpu", "torch device: cpu, cuda, cuda:N or auto")
    add_setting(parser, "--dtype", "bfloat16",
                "model dtype: bfloat16, float32 or float16 (see docs/benchmarks.md section 2)")
    add_setting(parser, "--torch-threads", 0, "torch intra-op threads (0 = torch default)",
                type=int)
    add_kernel_settings(parser)
    if "draft" in roles:
        add_draft_precision_settings(parser)
    add_setting(parser, "--kv-budget-mb", 2048, "KV cache memory budget per model (MiB)", type=int)


# Continuous batching in the draft and target services (specdec.model_service).
DEFAULT_MAX_BATCH_SESSIONS = 32
DEFAULT_MAX_BATCH_ROWS = 256
DEFAULT_MAX_BATCH_PREFILLS = 1


def add_batching_settings(parser: argparse.ArgumentParser) -> None:
    add_setting(parser, "--max-batch-sessions", DEFAULT_MAX_BATCH_SESSIONS,
                "draft/target: most sessions whose calls share one forward", type=int)
    add_setting(parser, "--max-batch-rows", DEFAULT_MAX_BATCH_ROWS,
                "draft/target: most token rows of one batched forward (the runner also "
                "splits above its measured row-invariance cap)", type=int)
    add_setting(parser, "--max-batch-prefills", DEFAULT_MAX_BATCH_PREFILLS,
                "draft/target: long catch-ups (a new session's prompt) run on their own "
                "between decode batches, at most this many after each", type=int)


def add_kernel_settings(parser: argparse.ArgumentParser) -> None:
    from specdec.attention import ATTENTION_KERNELS
    from specdec.kernels import KERNELS

    add_setting(parser, "--linear-kernel", "auto",
                "matmul kernel of the linear layers: auto (on CPU skinny for float32, "
                "onednn for bfloat16), torch, skinny or onednn; see specdec/kernels.py",
                choices=KERNELS)
    add_setting(parser, "--attention-kernel", "auto",
                "attention of decode-sized forwards: auto (on CPU grouped for float32, "
                "rowwise for reduced precision), sdpa, grouped or rowwise; see "
                "specdec/attention.py", choices=ATTENTION_KERNELS)


def add_draft_precision_settings(parser: argparse.ArgumentParser) -> None:
    """The draft's own dtype and linear kernel: they change its speed and acceptance,
    never the output (exactness is defined against the target as served)."""
    from specdec.kernels import KERNELS

    add_setting(parser, "--draft-dtype", "auto",
                "draft model dtype: auto (at load, time the draft in --dtype against float32 "
                "with each CPU kernel and keep the fastest; see specdec/draft_precision.py), "
                "same (= --dtype), or a dtype")
    add_setting(parser, "--draft-linear-kernel", "",
                "matmul kernel of the draft's linear layers (empty = --linear-kernel)",
                choices=("", *KERNELS))
    add_setting(parser, "--draft-compile", COMPILE_AUTO,
                "torch.compile the draft's forward: auto (on CPU compile at load, time it "
                "against eager and keep the faster; see specdec/draft_compile.py), on, off",
                choices=COMPILE_SETTINGS)


def draft_compile(args: argparse.Namespace | Any) -> str:
    return getattr(args, "draft_compile", "") or COMPILE_AUTO


def draft_precision(args: argparse.Namespace | Any) -> tuple[str, str]:
    """The draft's dtype setting ("auto" or a dtype) and linear kernel: its own settings,
    else the shared ones (args: flags, or anything with the same attributes)."""
    setting = getattr(args, "draft_dtype", "") or "auto"
    return (args.dtype if setting == "same" else setting,
            getattr(args, "draft_linear_kernel", "") or args.linear_kernel)


def apply_torch_settings(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    if getattr(args, "torch_threads", 0):
        torch.set_num_threads(args.torch_threads)
    return parse_device(args.device), parse_dtype(args.dtype)
