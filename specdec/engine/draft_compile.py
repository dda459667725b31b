"""torch.compile for the draft's forward, kept only where it measures faster.

On CPU most of a small draft's step is per-op overhead, not weight reads: matrix
products take less than half of the committed 2-layer draft's one-token step; Python,
module calls and a few dozen small ops take the rest. Inductor fuses those ops into a
few C++ kernels, which makes the step faster where it is measured.

Only the draft is compiled. Its kernels change how fast it proposes and which tokens it
proposes, never the output law: the probabilities it reports come from the same logits
it samples from. The target keeps its row-invariant kernels (specdec/engine/attention.py,
specdec/engine/kernels.py), on which greedy equality in bfloat16 rests; inductor's generated
kernels are not checked for that.

Compiling is lazy, so `compile_draft` runs a session's decode-sized extends (a catch-up,
one-token steps at growing lengths) before the model serves; a session's first forward
and rare long catch-ups stay eager (`decode_steps_compiled`), so nothing compiles while
serving. The first start on a machine compiles for a while; inductor caches the result
on disk (TORCHINDUCTOR_CACHE_DIR), so later starts are faster.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specdec.engine.extend import FUSED_STEP_ATTRIBUTE
from specdec.engine.kernels import OneDnnLinear
from specdec.engine.runner import ModelRunner
from specdec.engine.shapes import DECODE_ROWS
from specdec.engine.timing import STEP_ROUNDS, fastest_step_s, random_tokens
from specdec.settings import COMPILE_CHOICES

log = logging.getLogger(__name__)

SETTINGS = COMPILE_CHOICES
AUTO, ON, OFF = COMPILE_CHOICES
WARM_PROMPT_TOKENS = 24
# Rounds of a live generation, as the draft service runs them: (draft tokens asked,
# alternatives asked, draft tokens the target accepted, committed tokens the next round
# appends). Chains and token trees (the default adaptive requests verify alternatives
# beside the chain), rollbacks after rejections, one-token and longer catch-ups (rounds
# of prompt-lookup hits the draft did not see). Each kind of forward runs twice, at
# growing cache lengths: a graph's second call at another length is what makes that
# length dynamic.
WARM_ROUNDS = ((4, 2, 1, 1), (3, 0, 3, 1), (6, 2, 0, 1), (2, 2, 2, 3), (5, 0, 0, 2),
               (1, 0, 1, 1), (4, 4, 4, DECODE_ROWS), (8, 2, 1, 1), (1, 2, 0, 1))
# Token trees of a chain token and this many branches (siblings and children of it).
WARM_TREE_BRANCHES = (2, 1, 3, 5, 2)
# The warm-up of a model with the onednn linear kernel fails with a LoweringException.
ONEDNN_REASON = ("inductor does not lower the onednn linear kernel's prepacked weights "
                 "(mkldnn._linear_pointwise)")


class DraftCompileError(RuntimeError):
    """--draft-compile on, and compiling the draft failed."""


@dataclass(frozen=True)
class CompileOutcome:
    compiled: bool
    detail: str  # for logs and Describe: what was decided and why


def should_try(setting: str, device: torch.device) -> bool:
    """auto compiles on CPU only, the one device where compiling is measured to pay."""
    if setting not in SETTINGS:
        raise ValueError(f"draft compile setting must be one of {SETTINGS}, got {setting!r}")
    return setting == ON or (setting == AUTO and device.type == "cpu")


def warm_up(runner: ModelRunner) -> None:
    """Run the proposals decoding runs, in a scratch session, greedy and sampled: their
    graphs compile at load, not while serving."""
    from specdec.core.history import SyncPoint
    from specdec.core.sampling import SamplingParams
    from specdec.engine.steps import draft_step

    session = f"compile-warm-up-{time.monotonic_ns()}"
    tokens = iter(random_tokens(runner.vocab.target_vocab_size,
                                WARM_PROMPT_TOKENS + 2 * sum(r[3] for r in WARM_ROUNDS)))
    prompt = [next(tokens) for _ in range(WARM_PROMPT_TOKENS)]
    sync = SyncPoint(session, 0, 0, prompt, prefill_length=len(prompt))
    try:
        for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=0)):
            for num_tokens, alternatives, accepted, catch_up in WARM_ROUNDS:
                hidden = runner.placeholder_hidden(len(sync.append))
                out = draft_step(runner, sync, num_tokens, params, target_hidden=hidden,
                                 num_alternatives=alternatives)
                committed = min(sync.next_position + accepted, out.kv_length)
                fingerprint = runner._sessions[session].history.fingerprint(committed)
                sync = SyncPoint(session, committed, fingerprint,
                                 [next(tokens) for _ in range(catch_up)])
        # A round branches only where the draft hesitates, which random text may never
        # make it do: token trees of several widths are run directly (a draft that reads
        # the target's states proposes chains only).
        for branches in () if runner.needs_target_hidden else WARM_TREE_BRANCHES:
            held = runner.kv_length(session)
            parents = tuple(held - 1 + (index % 2) for index in range(branches))
            runner.extend(session, held, runner._sessions[session].history.fingerprint(),
                          random_tokens(runner.vocab.target_vocab_size, 1 + branches,
                                        seed=branches),
                          num_logits=1 + branches, branch_parents=parents,
                          target_hidden=runner.placeholder_hidden(1 + branches))
    finally:
        runner.release(session)


def decode_steps_compiled(eager: Callable[..., Any], compiled: Callable[..., Any]
                          ) -> Callable[..., Any]:
    """The draft's forward: compiled for decode-sized extends of a live session, eager
    for the rest, with the cache in one memory layout.

    Compiled code guards on its inputs' shapes and strides, and a graph compiled while
    serving stalls a round for seconds. Three things make new graphs:
    - a session's first forward (no cache yet) is its own graph, again for 1, 2-16 and
      over 16 tokens; it runs once per request, so it stays eager, and so does the next
      one after a one-token prompt (dynamo specializes a cache length of 1);
    - over DECODE_ROWS tokens attention takes another path (a catch-up after rounds
      that verified prompt-lookup hits without the draft); rare, so eager too;
    - a crop (the rollback after a rejection) leaves a slice with the strides of the
      longer tensor, and a first forward stores keys in the layout attention made them
      in: each layout is a graph, up to dynamo's limit. The cache is copied to the
      canonical contiguous layout first (the draft's cache is small).
    What is left are the graphs of one-token steps and of 2-16-token extends."""
    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        layers = getattr(kwargs.get("cache"), "layers", None)
        input_ids = kwargs.get("input_ids")
        if (not layers or input_ids is None or input_ids.shape[-1] > DECODE_ROWS
                or not all(getattr(layer, "is_initialized", False) for layer in layers)
                or layers[0].keys.shape[-2] < 2):
            return eager(*args, **kwargs)
        for layer in layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor) and tensor.stride() != _canonical_strides(
                        tensor.shape):
                    setattr(layer, name, tensor.clone(memory_format=torch.contiguous_format))
        return compiled(*args, **kwargs)
    return forward


def _canonical_strides(shape: torch.Size) -> tuple[int, ...]:
    """Row-major strides, size-1 dimensions included (is_contiguous() ignores those, the
    compiled code's guards do not)."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def compile_draft(model: Any, new_runner: Callable[[], ModelRunner], setting: str,
                  device: torch.device, rounds: int = STEP_ROUNDS) -> CompileOutcome:
    """Compile model.forward in place if the setting asks for it.

    auto: compile, warm up, time the one-token step compiled and eager round-robin, keep
    the faster; a compile that fails leaves the eager forward and logs why. on: compile
    and warm up, raise DraftCompileError if that fails. A draft on the onednn kernel is
    not tried (auto: eager; on: DraftCompileError), as inductor cannot lower it.
    """
    if not should_try(setting, device):
        return CompileOutcome(False, f"eager (--draft-compile {setting})")
    if getattr(model, FUSED_STEP_ATTRIBUTE, None) is not None:
        return CompileOutcome(False, "eager, the fused step (--fused-step)")
    if any(isinstance(module, OneDnnLinear) for module in model.modules()):
        if setting == ON:
            raise DraftCompileError(
                f"--draft-compile on: {ONEDNN_REASON}; set SPECDEC_DRAFT_LINEAR_KERNEL=torch "
                "to compile, or SPECDEC_DRAFT_COMPILE=off")
        return CompileOutcome(False, f"eager ({ONEDNN_REASON})")
    eager = model.forward
    compiled = decode_steps_compiled(eager, torch.compile(eager, dynamic=True))
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
    runner = new_runner()

    def using(forward: Callable[..., Any]) -> tuple[ModelRunner, Callable[[], None]]:
        return runner, lambda: setattr(model, "forward", forward)

    step_ms = {name: seconds * 1000 for name, seconds in fastest_step_s(
        {"eager": using(eager), "compiled": using(compiled)}, rounds).items()}
    keep = min(step_ms, key=lambda name: step_ms[name])
    model.forward = compiled if keep == "compiled" else eager
    times = ", ".join(f"{name} {ms:.1f} ms" for name, ms in step_ms.items())
    return CompileOutcome(keep == "compiled",
                          f"{keep}, the faster one-token step of {times} "
                          f"(compiled in {compile_s:.0f} s)")

