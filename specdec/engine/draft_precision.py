"""The draft's dtype and linear kernel, chosen by measuring its decode step at load time.

The draft's precision changes only its speed and how often the target accepts its
tokens, never the output (exactness is defined against the target as served), so it can
follow the hardware. Which of bfloat16/onednn, float32/torch and float32/skinny steps
fastest differs between CPUs (with and without AMX, for instance), so
`--draft-dtype auto` times each candidate's one-token step, interleaved, and keeps the
fastest. Off the CPU it keeps --dtype. It measures as the draft loads: beside other
processes starting on the same cores the choice can be off (it only costs speed); set a
dtype to pin it. The cpu-tuned backend (specdec.engine.backends) calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.engine.draft_compile import OFF, CompileOutcome, compile_draft
from specdec.engine.kernels import resolve_kernel
from specdec.engine.models import LoadedModel, parse_dtype
from specdec.engine.runner import ModelRunner
from specdec.engine.timing import STEP_ROUNDS, fastest_step_s
from specdec.settings import linear_kernel_for

AUTO = "auto"


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype
    linear_kernel: str

    @property
    def label(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}/{self.linear_kernel}"


def candidates(device: torch.device, shared: Precision) -> list[Precision]:
    """The shared precision first, then float32 with each CPU kernel ("auto" resolved)."""
    options = [shared]
    if device.type == "cpu":
        options += [Precision(torch.float32, "torch"), Precision(torch.float32, "skinny")]
    resolved = [Precision(option.dtype, resolve_kernel(option.linear_kernel, device,
                                                       option.dtype)) for option in options]
    return list(dict.fromkeys(resolved))


@dataclass
class Choice:
    loaded: LoadedModel
    precision: Precision
    step_s: dict[str, float]  # fastest one-token step per candidate label
    compiled: CompileOutcome = CompileOutcome(False, "eager")

    def describe(self) -> str:
        if not self.step_s:
            chosen = f"{self.precision.label} (as set)"
        else:
            times = ", ".join(f"{label} {seconds * 1000:.1f} ms"
                              for label, seconds in self.step_s.items())
            chosen = f"{self.precision.label}, the fastest one-token step of {times}"
        return f"{chosen}; forward {self.compiled.detail}"


def choose_fastest(options: list[Precision], load: Callable[[Precision], LoadedModel],
                   runner_for: Callable[[LoadedModel], ModelRunner],
                   rounds: int = STEP_ROUNDS) -> Choice:
    """Load each option, time its one-token step round-robin, keep the fastest."""
    loaded = {option: load(option) for option in options}
    if len(options) == 1:
        return Choice(loaded[options[0]], options[0], {})
    fastest = fastest_step_s({option: (runner_for(model), _nothing)
                              for option, model in loaded.items()}, rounds)
    best = min(options, key=lambda option: fastest[option])
    return Choice(loaded[best], best, {option.label: fastest[option] for option in options})


def _nothing() -> None:
    pass


def load_draft(load: Callable[[Precision], LoadedModel], device: torch.device,
               dtype_setting: str, linear_kernel: str, *, shared_dtype: torch.dtype,
               target_vocab_size: int | None, compile_setting: str = OFF) -> Choice:
    """The draft in dtype_setting: a dtype, or "auto" for the fastest of `candidates`
    around the shared (target's) dtype, measured here; then compiled or not as
    compile_setting says (specdec.engine.draft_compile). load: the backend's loader of
    the draft in one precision."""
    if dtype_setting == AUTO:
        options = candidates(device, Precision(shared_dtype, linear_kernel))
    else:
        dtype = parse_dtype(dtype_setting)
        kernel = linear_kernel_for(dtype_setting, linear_kernel)
        options = [Precision(dtype, resolve_kernel(kernel, device, dtype))]

    def runner_for(loaded: LoadedModel) -> ModelRunner:
        return ModelRunner(loaded.model, target_vocab_size=target_vocab_size,
                           token_map=loaded.token_map)

    choice = choose_fastest(options, load, runner_for)
    choice.compiled = compile_draft(choice.loaded.model, lambda: runner_for(choice.loaded),
                                    compile_setting, device)
    return choice
