"""torch.compile for the draft's forward, kept only where it measures faster.

On CPU most of a small draft's step is per-op overhead, not weight reads: the committed
2-layer draft (float32, 47 MB) spends about 1.7 ms of its 4.2 ms one-token step in
matrix products (torch profiler); Python, module calls and ~40 small ops take the rest.
Inductor fuses those ops into a few C++ kernels: interleaved on one 2-core host, a step
took 0.72-0.76 of its eager time (docs/benchmarks.md section 4m).

Only the draft is compiled. Its kernels change how fast it proposes and which tokens it
proposes, never the output law: the probabilities it reports come from the same logits
it samples from. The target keeps its row-invariant kernels (specdec/attention.py,
specdec/kernels.py), on which greedy equality in bfloat16 rests; inductor's generated
kernels are not checked for that.

Compiling is lazy, so `compile_draft` warms the shapes decoding runs (a prompt, the
catch-up of a round's committed tokens, one-token steps at growing lengths) before the
model serves: dynamic shapes give one graph for one-row and one for several-row
forwards, whatever the context length. The first start on a machine compiles for about
a minute on 2 cores; inductor caches the result on disk (TORCHINDUCTOR_CACHE_DIR), and a
later start takes 10-15 s.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specdec.runner import ModelRunner
from specdec.timing import extend_timer, round_robin

log = logging.getLogger(__name__)

AUTO, ON, OFF = "auto", "on", "off"
SETTINGS = (AUTO, ON, OFF)
TIMED_ROUNDS = 9
WARM_PROMPT_TOKENS = 24
# A catch-up of several tokens, then one-token steps: the second length after a shape's
# first call is what turns the cache length into a dynamic size.
WARM_EXTENDS = (3, 1, 1, 2, 1, 1)


class DraftCompileError(RuntimeError):
    """--draft-compile on, and compiling the draft failed."""


@dataclass(frozen=True)
class CompileOutcome:
    compiled: bool
    detail: str  # for logs and Describe: what was decided and why


def should_try(setting: str, device: torch.device) -> bool:
    """auto compiles on CPU only: nowhere else has it been measured (no GPU was lent)."""
    if setting not in SETTINGS:
        raise ValueError(f"draft compile setting must be one of {SETTINGS}, got {setting!r}")
    return setting == ON or (setting == AUTO and device.type == "cpu")


def warm_up(runner: ModelRunner) -> None:
    """Run every shape decoding will, in a scratch session (compiles them all now)."""
    session = f"compile-warm-up-{time.monotonic_ns()}"
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(runner.vocab.target_vocab_size, 4096),
                           (WARM_PROMPT_TOKENS + sum(WARM_EXTENDS),),
                           generator=generator).tolist()
    try:
        committed = WARM_PROMPT_TOKENS
        runner.extend(session, 0, 0, tokens[:committed],
                      target_hidden=runner.placeholder_hidden(committed))
        for width in WARM_EXTENDS:
            runner.append(session, tokens[committed:committed + width],
                          target_hidden=runner.placeholder_hidden(width))
            committed += width
    finally:
        runner.release(session)


def contiguous_cache(eager: Callable[..., Any], compiled: Callable[..., Any]
                     ) -> Callable[..., Any]:
    """compiled, called with every cached key and value tensor made contiguous first.

    A crop (the rollback after a rejection) leaves a slice with the strides of the
    longer tensor, and a session's first forward stores its keys in the layout attention
    made them in. Compiled code guards on strides, so each layout compiled another graph
    (8 for 3 prompts of decoding, and 8 is dynamo's limit) and a recompile stalled a
    round for 8-14 s. The copy is the draft's small cache (2 layers here)."""
    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache")
        for layer in getattr(cache, "layers", ()):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
                    setattr(layer, name, tensor.contiguous())
        return compiled(*args, **kwargs)
    return forward


def compile_draft(model: Any, new_runner: Callable[[], ModelRunner], setting: str,
                  device: torch.device, rounds: int = TIMED_ROUNDS) -> CompileOutcome:
    """Compile model.forward in place if the setting asks for it.

    auto: compile, warm up, time the one-token step compiled and eager round-robin, keep
    the faster; a compile that fails leaves the eager forward and logs why. on: compile
    and warm up, raise DraftCompileError if that fails.
    """
    if not should_try(setting, device):
        return CompileOutcome(False, f"eager (--draft-compile {setting})")
    eager = model.forward
    compiled = contiguous_cache(eager, torch.compile(eager, dynamic=True))
    started = time.perf_counter()
    log.info("compiling the draft's forward (torch.compile; about a minute the first time "
             "on 2 cores, cached in TORCHINDUCTOR_CACHE_DIR)")
    model.forward = compiled
    try:
        warm_up(new_runner())
    except Exception as error:  # inductor raises many types: no C++ compiler, codegen...
        model.forward = eager
        message = f"compiling the draft failed: {type(error).__name__}: {error}"
        if setting == ON:
            raise DraftCompileError(
                f"{message}; install a C++ compiler for inductor or set "
                "SPECDEC_DRAFT_COMPILE=off") from error
        log.warning("%s; the draft runs eager", message)
        return CompileOutcome(False, f"eager ({message.splitlines()[0][:200]})")
    compile_s = time.perf_counter() - started
    if setting == ON:
        return CompileOutcome(True, f"compiled in {compile_s:.0f} s (--draft-compile on)")
    step_ms = _step_ms(model, new_runner, {"eager": eager, "compiled": compiled}, rounds)
    keep = min(step_ms, key=lambda name: step_ms[name])
    model.forward = compiled if keep == "compiled" else eager
    times = ", ".join(f"{name} {ms:.1f} ms" for name, ms in step_ms.items())
    return CompileOutcome(keep == "compiled",
                          f"{keep}, the faster one-token step of {times} "
                          f"(compiled in {compile_s:.0f} s)")


def _step_ms(model: Any, new_runner: Callable[[], ModelRunner],
             forwards: dict[str, Callable[..., Any]], rounds: int) -> dict[str, float]:
    """The fastest one-token step with each forward, interleaved (other work only adds
    time, so the minimum is the least disturbed)."""
    runner = new_runner()
    vocab = min(runner.vocab.target_vocab_size, 4096)
    context = torch.randint(0, vocab, (65,), generator=torch.Generator().manual_seed(1)).tolist()
    step, release = extend_timer(runner, context[:-1], context[-1:])

    def with_forward(forward: Callable[..., Any]) -> Callable[[], float]:
        def call() -> float:
            model.forward = forward
            return step()
        return call

    try:
        samples = round_robin({name: with_forward(forward)
                               for name, forward in forwards.items()}, rounds)
    finally:
        release()
    return {name: min(values) * 1000 for name, values in samples.items()}
