"""Run every configuration on the same prompts, interleaved, and collect RunRecords.

For each repeat, prompt and sampling mode, every configuration runs back to back, so
slow phases of a shared machine hit all of them alike. The gRPC configurations talk to
three `specdec serve` processes started for the run (the deployment shape); the others
run in this process on the same weights.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from specdec.bench import baselines, systems
from specdec.bench.configs import (
    GRPC,
    HF_ASSISTED,
    HF_GENERATE,
    LENGTHS,
    LLAMA_CPP_SYSTEMS,
    LOCAL_TOKEN_DRAFT,
    MODES,
    SYSTEMS,
    BenchConfig,
    RunRecord,
    build_configs,
)
from specdec.bench.costs import CostCurve, measure_costs
from specdec.bench.prompts import BenchPrompt, chat_encoder, prompt_encoder, select
from specdec.bench.workloads import workload_prompts
from specdec.core.cost_model import CostModel
from specdec.engine.attention import resolve_attention
from specdec.engine.feature_draft import is_feature_draft
from specdec.engine.kernels import resolve_kernel
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.models import DEFAULT_DRAFT, parse_dtype
from specdec.engine.runner import ModelRunner
from specdec.settings import default, linear_kernel_for

WARMUP_PROMPT = "Say hello and introduce yourself in two sentences."


@dataclass
class BenchSettings:
    target_model: str = "smollm2-135m-instruct"
    draft_model: str = "specdec-draft"
    # transformers' assisted generation cannot run a feature draft (it reads the target's
    # hidden states): hf-assisted then uses this token-only draft ("" = the draft model,
    # or specdec-draft when that is a feature draft).
    assistant_model: str = ""
    dtype: str = "float32"
    torch_threads: int = 0
    linear_kernel: str = "auto"
    attention_kernel: str = "auto"
    # The draft's (and hf-assisted's assistant's) own precision (specdec.engine.draft_precision):
    # "auto" measures, "same" = dtype; an empty kernel = linear_kernel.
    draft_dtype: str = "auto"
    draft_linear_kernel: str = ""
    # torch.compile of the draft's forward (specdec.engine.draft_compile). hf-assisted runs a
    # copy of its own, eager, for a draft with a reduced vocabulary (the default draft).
    draft_compile: str = "auto"
    fused_step: str = "auto"  # the target's and draft's (specdec.engine.fused_step)
    # Threads of each service process (0 = torch default, as `specdec up`); with forwards
    # on one compute thread and a short OpenMP spin, 2 beat 1 here (specdec/serving/stack.py).
    grpc_torch_threads: int = 0
    modes: tuple[str, ...] = tuple(MODES)
    systems: tuple[str, ...] = SYSTEMS
    lengths: tuple[str, ...] = LENGTHS
    per_category: int | None = None  # None: every prompt
    # Sampled modes (T > 0) cost as much as greedy; these trim them (None: same as greedy).
    sampled_lengths: tuple[str, ...] | None = None
    sampled_per_category: int | None = None
    repeats: int = 2
    max_new_tokens: int = 96
    max_length: int = default("max-adaptive-length")  # adaptive's longest draft
    calibration_repeats: int = 7
    compare_dtypes: tuple[str, ...] = ()
    warmup_tokens: int = 40
    progress: bool = True
    workload: str = default("workload")  # specdec.bench.workloads: prompts, repetition, all
    startup_timeout_s: float = 300.0

    @property
    def draft_precision(self) -> tuple[str, str]:
        """The draft's dtype setting and linear kernel (its own, else the target's)."""
        from specdec.config import draft_precision

        return draft_precision(self)


@dataclass
class BenchModels:
    """The pair, loaded once; tests pass tiny random models instead."""

    target: Any  # transformers PreTrainedModel
    draft: Any
    token_map: torch.Tensor | None
    tokenizer: Any | None
    eos: tuple[int, ...]
    draft_source: str = ""  # a directory FullVocabDraft can load (reduced-vocab drafts)
    # hf-assisted's draft when it is not `draft` (see BenchSettings.assistant_model)
    assistant: Any | None = None
    assistant_token_map: torch.Tensor | None = None
    assistant_source: str = ""
    # What the draft runs in (specdec.engine.draft_precision): the short label for tables, the
    # chooser's account with its timings for the report header, and the kernel
    # hf-assisted's assistant then uses too.
    draft_precision: str = ""
    draft_precision_detail: str = ""
    draft_linear_kernel: str = "auto"
    # The model transformers' rows (hf-generate, hf-assisted) run: transformers' own
    # kernels, as a user without specdec runs it; None: `target`.
    stock_target: Any | None = None


class GrpcEndpoint(Protocol):
    stub: Any

    def close(self) -> None: ...


def described_draft_precision(endpoint: str) -> str:
    """What a draft service runs in (Draft.Describe): it chooses for itself with
    --draft-dtype auto, and may choose otherwise than the bench process did. An endpoint
    that has it offers `draft_precision()`; the bench records the answer."""
    import grpc

    from specdec.proto.specdec.v1 import draft_pb2, draft_pb2_grpc

    with grpc.insecure_channel(endpoint) as channel:
        described = draft_pb2_grpc.DraftStub(channel).Describe(draft_pb2.DescribeRequest(),
                                                               timeout=10)
    return str(described.precision)


@dataclass
class BenchResult:
    settings: BenchSettings
    costs: CostCurve
    records: list[RunRecord]
    dtype_costs: list[CostCurve] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"settings": asdict(self.settings), "meta": self.meta,
                "costs": self.costs.to_dict(),
                "dtype_costs": [curve.to_dict() for curve in self.dtype_costs],
                "records": [record.to_dict() for record in self.records]}


def stable_seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def load_models(settings: BenchSettings) -> BenchModels:
    from specdec.engine.backends.cpu import CpuTunedBackend, load_causal_lm
    from specdec.engine.models import model_info, parse_dtype, resolve

    dtype = parse_dtype(settings.dtype)
    linear_kernel = linear_kernel_for(settings.dtype, settings.linear_kernel)
    cpu = torch.device("cpu")
    target = load_causal_lm(settings.target_model, cpu, dtype, progress=settings.progress,
                            linear_kernel=linear_kernel,
                            attention_kernel=settings.attention_kernel,
                            fused_step=settings.fused_step)
    info = model_info(settings.target_model)
    draft_dtype, draft_linear_kernel = settings.draft_precision
    backend = CpuTunedBackend(cpu, dtype, linear_kernel=linear_kernel,
                              attention_kernel=settings.attention_kernel, draft_dtype=draft_dtype,
                              draft_linear_kernel=draft_linear_kernel,
                              draft_compile=settings.draft_compile,
                              fused_step=settings.fused_step)
    choice = backend.load_draft(settings.draft_model, target_vocab_size=info.vocab_size,
                                progress=settings.progress,
                                target_model=settings.target_model)
    draft, precision = choice.loaded, choice.precision
    models = BenchModels(target.model, draft.model, draft.token_map, target.tokenizer,
                         info.eos_token_ids, str(resolve(settings.draft_model)),
                         draft_precision=precision.label,
                         draft_precision_detail=choice.describe(),
                         draft_linear_kernel=precision.linear_kernel)
    if {HF_GENERATE, HF_ASSISTED} & set(settings.systems):
        from specdec.engine.models import load_pretrained

        models.stock_target = load_pretrained(settings.target_model, cpu, dtype,
                                              progress=False).model
    assistant_name = assistant_model(settings, draft.model)
    if assistant_name != settings.draft_model:
        assistant = load_causal_lm(assistant_name, cpu, precision.dtype,
                                   progress=settings.progress,
                                   linear_kernel=precision.linear_kernel,
                                   attention_kernel=settings.attention_kernel)
        models.assistant, models.assistant_token_map = assistant.model, assistant.token_map
        models.assistant_source = str(resolve(assistant_name))
    return models


def assistant_model(settings: BenchSettings, draft: Any) -> str:
    """The draft transformers' assisted generation runs (see BenchSettings)."""
    if settings.assistant_model:
        return settings.assistant_model
    return DEFAULT_DRAFT if is_feature_draft(draft) else settings.draft_model


class ProcessStack:
    """The three services as separate `specdec serve` processes on free ports."""

    def __init__(self, settings: BenchSettings) -> None:
        import grpc

        from specdec.proto.specdec.v1 import coordinator_pb2_grpc
        from specdec.serving.stack import start_stack

        args = ["--target-model", settings.target_model, "--draft-model", settings.draft_model,
                "--dtype", settings.dtype, "--torch-threads", str(settings.grpc_torch_threads),
                "--linear-kernel", settings.linear_kernel,
                "--attention-kernel", settings.attention_kernel,
                "--draft-dtype", settings.draft_dtype,
                "--draft-linear-kernel", settings.draft_linear_kernel,
                "--draft-compile", settings.draft_compile, "--fused-step", settings.fused_step,
                "--max-draft-tokens", str(max(default("max-draft-tokens"), settings.max_length))]
        self.log_dir = Path(tempfile.mkdtemp(prefix="specdec-bench-"))
        self.startup_timeout_s = settings.startup_timeout_s
        self.stack = start_stack("127.0.0.1", {}, args, log_dir=self.log_dir,
                                 draft_after_target_s=settings.startup_timeout_s)
        self.channel = grpc.insecure_channel(self.stack.endpoint("coordinator"))
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def wait(self) -> None:
        """Block until all three report healthy."""
        self.stack.wait_healthy(self.startup_timeout_s)

    def draft_precision(self) -> str:
        return described_draft_precision(self.stack.endpoint("draft"))

    def close(self) -> None:
        self.channel.close()
        self.stack.stop()


class Bench:
    def __init__(self, settings: BenchSettings, models: BenchModels,
                 grpc: GrpcEndpoint | None = None) -> None:
        self.settings = settings
        self.models = models
        self.llama_cpp: Any | None = None
        wanted = tuple(system for system in settings.systems if system in LLAMA_CPP_SYSTEMS)
        if wanted:
            from specdec.bench import llama_cpp

            reason = llama_cpp.unavailable_reason(settings.target_model)
            if reason is None:
                self.llama_cpp = llama_cpp.LlamaCppSystems(
                    wanted, settings.torch_threads or torch.get_num_threads())
            else:
                print(f"specdec bench: skipping {', '.join(wanted)}: {reason}", flush=True)
                settings = dataclasses.replace(settings, systems=tuple(
                    system for system in settings.systems if system not in wanted))
                self.settings = settings
        self.configs = build_configs(settings.systems, settings.lengths)
        sampled = build_configs(settings.systems, settings.sampled_lengths or settings.lengths)
        self.mode_configs = {mode: self.configs if MODES[mode].temperature == 0 else sampled
                             for mode in settings.modes}
        self.all_configs = list(dict.fromkeys(self.configs + sampled))
        vocab = int(models.target.config.vocab_size)
        self.target_runner = ModelRunner(models.target)
        self.draft_runner = ModelRunner(models.draft, target_vocab_size=vocab,
                                        token_map=models.token_map)
        self.drafter = LocalDrafter(self.draft_runner)
        self.verifier = LocalVerifier(self.target_runner)
        self.local_costs = CostModel()  # like the coordinator's: shared by every session
        self.token_drafter: LocalDrafter | None = None
        if any(c.system == LOCAL_TOKEN_DRAFT for c in self.all_configs):
            if models.assistant is None:
                raise ValueError(f"{LOCAL_TOKEN_DRAFT} needs a token-only draft beside a "
                                 "feature draft (--assistant-model)")
            self.token_drafter = LocalDrafter(ModelRunner(
                models.assistant, target_vocab_size=vocab, token_map=models.assistant_token_map))
            self.token_costs = CostModel()
        self.hf_draft: Any | None = None
        if any(c.system == HF_ASSISTED for c in self.all_configs):
            dtype = next(models.draft.parameters()).dtype
            draft_kernel = models.draft_linear_kernel
            if models.assistant is not None:
                self.hf_draft = baselines.hf_draft(
                    models.assistant, models.assistant_token_map, vocab, models.assistant_source,
                    dtype, draft_kernel, settings.attention_kernel)
            elif is_feature_draft(models.draft):
                raise ValueError("transformers' assisted generation cannot run a feature draft; "
                                 "set --assistant-model to a token-only draft")
            else:
                self.hf_draft = baselines.hf_draft(models.draft, models.token_map, vocab,
                                                   models.draft_source, dtype, draft_kernel,
                                                   settings.attention_kernel)
        self.grpc = grpc
        self.encode = chat_encoder(models.tokenizer)
        self.encode_prompt = prompt_encoder(models.tokenizer)

    def run_one(self, config: BenchConfig, mode_name: str, prompt_ids: list[int],
                max_new_tokens: int, seed: int, cache_salt: str = "") -> RunRecord:
        """cache_salt: the coordinator's suffix cache partition (gRPC systems)."""
        mode = MODES[mode_name]
        if config.system in LLAMA_CPP_SYSTEMS:
            assert self.llama_cpp is not None
            return self.llama_cpp.run(config, mode, prompt_ids, max_new_tokens,
                                      self.models.eos, seed)
        if config.system in (HF_GENERATE, HF_ASSISTED):
            target = self.models.stock_target or self.models.target
            return baselines.run_hf(config, mode, target, self.hf_draft,
                                    prompt_ids, max_new_tokens, self.models.eos, seed)
        if config.system == GRPC:
            assert self.grpc is not None
            return systems.run_grpc(config, mode, self.grpc.stub, prompt_ids,
                                    max_new_tokens, seed, max_length=self.settings.max_length,
                                    cache_salt=cache_salt)
        if config.system == LOCAL_TOKEN_DRAFT:
            assert self.token_drafter is not None
            return systems.run_local(config, mode, self.token_drafter, self.verifier,
                                     prompt_ids, max_new_tokens, self.models.eos, seed,
                                     self.token_costs, self.settings.max_length)
        return systems.run_local(config, mode, self.drafter, self.verifier, prompt_ids,
                                 max_new_tokens, self.models.eos, seed, self.local_costs,
                                 self.settings.max_length)

    def warmup(self, advance: Callable[[str], None]) -> None:
        """First calls pay for allocation, kernel choice and channels; adaptive sweeps."""
        ids = self.encode(WARMUP_PROMPT)
        for config in self.all_configs:
            advance(f"warm-up {config.name}")
            tokens = self.settings.warmup_tokens if config.policy == "adaptive" else 8
            for mode in self.settings.modes:
                if config in self.mode_configs[mode]:
                    self.run_one(config, mode, ids, tokens, stable_seed("warmup", mode),
                                 cache_salt="warm-up")

    def runs_for(self, prompt: BenchPrompt, prompts: list[BenchPrompt]) -> list[str]:
        """The modes this prompt runs in: sampled ones only for the first N per category."""
        limit = self.settings.sampled_per_category
        rank = [p.id for p in prompts if p.category == prompt.category].index(prompt.id)
        return [m for m in self.settings.modes
                if MODES[m].temperature == 0 or limit is None or rank < limit]

    def total_runs(self, prompts: list[BenchPrompt]) -> int:
        per_pass = sum(len(self.mode_configs[mode]) for prompt in prompts
                       for mode in self.runs_for(prompt, prompts))
        return per_pass * self.settings.repeats

    def run(self, prompts: list[BenchPrompt], advance: Callable[[str], None]) -> list[RunRecord]:
        records: list[RunRecord] = []
        for repeat in range(self.settings.repeats):
            for prompt in prompts:
                ids = self.encode_prompt(prompt)
                for mode in self.runs_for(prompt, prompts):
                    seed = stable_seed(prompt.id, repeat, mode)
                    for config in self.mode_configs[mode]:
                        advance(f"{mode} {prompt.id} {config.name}")
                        # Each pass, mode and configuration fills a suffix cache of its
                        # own, so no request meets its own prompt's earlier answer: the
                        # cache proposes only from the pass's other prompts.
                        record = self.run_one(config, mode, ids, self.settings.max_new_tokens,
                                              seed, cache_salt=f"{repeat}/{mode}/{config.name}")
                        record.prompt_id, record.category = prompt.id, prompt.category
                        record.repeat, record.workload = repeat, prompt.workload
                        records.append(record)
        return records


def machine_info() -> dict[str, Any]:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo").read().splitlines():  # noqa: SIM115
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "load_average": list(os.getloadavg()),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def run_bench(settings: BenchSettings, models: BenchModels | None = None,
              grpc_factory: Callable[[], GrpcEndpoint] | None = None,
              prompts: list[BenchPrompt] | None = None,
              dtype_models: Callable[[str], tuple[ModelRunner, ModelRunner]] | None = None
              ) -> BenchResult:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    started = time.perf_counter()
    start_machine = machine_info()
    prompts = select(prompts if prompts is not None else workload_prompts(settings.workload),
                     settings.per_category)
    draft_trained = None
    if models is None and settings.draft_model == DEFAULT_DRAFT:
        from specdec.engine.draft_fallback import default_draft_or_truncated

        path, draft_trained = default_draft_or_truncated()
        settings = dataclasses.replace(settings, draft_model=path)
    columns = (TextColumn("{task.description:<44}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    grpc: GrpcEndpoint | None = None
    grpc_draft_precision = ""
    with Progress(*columns, disable=not settings.progress) as bar:
        setup = bar.add_task("loading / starting services", total=None)
        try:
            if GRPC in settings.systems:
                grpc = (grpc_factory or (lambda: ProcessStack(settings)))()
                # Load here only once the services are up: `--draft-dtype auto` times the
                # draft's step as it loads, and while three processes start on few cores
                # every candidate times the start-up load, not itself.
                wait = getattr(grpc, "wait", None)
                if wait is not None:
                    wait()
                describe = getattr(grpc, "draft_precision", None)
                if describe is not None:
                    grpc_draft_precision = describe()
            models = models or load_models(settings)
            bench = Bench(settings, models, grpc)
            calibration = 10 + 10 * len(settings.compare_dtypes)
            total = calibration + len(bench.all_configs) + bench.total_runs(prompts)
            bar.update(setup, total=total, completed=0, description="calibrating costs")

            def advance(description: str) -> None:
                bar.update(setup, advance=1, description=description[:44])

            costs = measure_costs(bench.target_runner, bench.draft_runner,
                                  label=cost_label(settings, models),
                                  repeats=settings.calibration_repeats,
                                  progress=lambda: advance(f"calibrating {settings.dtype}"))
            dtype_costs = compare_dtypes(settings, dtype_models, advance)
            bench.warmup(advance)
            records = bench.run(prompts, advance)
        finally:
            if grpc is not None:
                grpc.close()
    meta = {"machine": machine_info(), "machine_at_start": start_machine,
            "draft_trained": draft_trained, "prompts": len(prompts),
            "workloads": sorted({p.workload for p in prompts}),
            "assistant_model": assistant_model(settings, models.draft),
            "draft_precision": models.draft_precision_detail or models.draft_precision,
            "grpc_draft_precision": grpc_draft_precision,
            "configs": [c.name for c in bench.all_configs], "wall_s": time.perf_counter() - started}
    return BenchResult(settings, costs, records, dtype_costs, meta)


def cost_label(settings: BenchSettings, models: BenchModels) -> str:
    """The target's FORMAT@KERNEL@ATTENTION as resolved on CPU, and the draft's."""
    dtype, cpu = parse_dtype(settings.dtype), torch.device("cpu")
    kernel = linear_kernel_for(settings.dtype, settings.linear_kernel)
    target = (f"{settings.dtype}@{resolve_kernel(kernel, cpu, dtype)}"
              f"@{resolve_attention(settings.attention_kernel, cpu, dtype)}")
    return f"{target}, draft {models.draft_precision}" if models.draft_precision else target


def compare_dtypes(settings: BenchSettings,
                   loader: Callable[[str], tuple[ModelRunner, ModelRunner]] | None,
                   advance: Callable[[str], None]) -> list[CostCurve]:
    from specdec.bench.dtypes import load_runners

    curves = []
    for name in settings.compare_dtypes:
        target, draft = loader(name) if loader is not None else load_runners(settings, name)
        step = functools.partial(advance, f"costs {name}")
        curves.append(measure_costs(target, draft, label=name,
                                    repeats=settings.calibration_repeats, progress=step))
    return curves


def run_costs(settings: BenchSettings) -> list[CostCurve]:
    """Only the cost curves, in each of settings.compare_dtypes (default: settings.dtype)."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    names = settings.compare_dtypes or (settings.dtype,)
    return compare_dtypes(dataclasses.replace(settings, compare_dtypes=names), None,
                          lambda description: None)
