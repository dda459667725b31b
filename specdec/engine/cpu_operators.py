"""Small C++ operators of our own (csrc/), compiled on first use for this machine's CPU.

torch's cpp_extension builds each with the machine's C++ compiler (-O3 -march=native,
OpenMP through torch's own runtime) into a cache folder per torch version and CPU, so a
later start loads it in well under a second. specdec.engine.int8 (the int8 product),
specdec.engine.attention (the rowwise attention) and specdec.engine.fused_step (a Llama
decoder layer) each load theirs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"


def kernel_cache_dir() -> Path:
    """Where compiled operators are kept: TORCH_EXTENSIONS_DIR when set, else
    $XDG_CACHE_HOME/specdec/kernels, one folder per torch version and CPU (each is built
    for the CPU it runs on)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "specdec", "kernels")
    return Path(root) / f"torch-{torch.__version__}-{_cpu_key()}"


def _cpu_key() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    text = f"{platform.machine()} {platform.processor()} {flags}"
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def build(name: str, source: str, flags: tuple[str, ...] = ()) -> Path:
    """Compile (or load the cached build of) csrc/<source> as the extension `name`, which
    registers its operators under torch.ops.specdec, with `flags` after the usual ones;
    returns the build folder. Raises whatever the build raises (a missing compiler, a
    compile error)."""
    from torch.utils.cpp_extension import load

    build_dir = kernel_cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # -fopenmp: at::parallel_for splits the work over torch's threads (the process's one
    # OpenMP runtime, loaded with torch, serves it).
    load(name, [str(CSRC / source)], build_directory=str(build_dir),
         extra_cflags=["-O3", "-march=native", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False)
    return build_dir


def failure_summary(error: BaseException) -> str:
    """A failed build's cause in one line: its type and the last line of its message (a
    compiler's output ends with the error that stopped it)."""
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[-1][:300]}"


class OptionalOperators:
    """Operators of one extension that a faster path takes where they build: built or
    loaded on the first get(); None where the build fails here (logged once, with what
    runs instead), and the caller keeps its own path."""

    def __init__(self, extension: str, source: str, names: tuple[str, ...],
                 instead: str, flags: tuple[str, ...] = ()) -> None:
        self.extension, self.source, self.names, self.instead = extension, source, names, instead
        self.flags = flags
        self._state: list[tuple[Callable[..., Any], ...] | None] = []  # [] until first get
        self._lock = threading.Lock()

    def get(self) -> tuple[Callable[..., Any], ...] | None:
        if self._state:
            return self._state[0]
        with self._lock:
            if not self._state:
                operators: tuple[Callable[..., Any], ...] | None = None
                try:
                    build(self.extension, self.source, self.flags)
                    operators = tuple(getattr(torch.ops.specdec, name) for name in self.names)
                except Exception as error:  # a missing compiler raises several types
                    log.warning("%s: the C++ operator failed to build (%s); %s",
                                ", ".join(self.names), failure_summary(error), self.instead)
                self._state.append(operators)
        return self._state[0]
