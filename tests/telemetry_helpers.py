"""In-process speculative runs over tiny models, for the telemetry tests."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.core.loop import GenerateConfig, GenerationResult, generate
from specdec.core.prompt_lookup import PromptLookup
from specdec.core.sampling import SamplingParams
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.telemetry.file_exporter import JsonLinesSpanExporter
from specdec.telemetry.service import Telemetry
from specdec.telemetry.tracing import build_tracer_provider
from tests.tiny_models import tiny_llama

torch.set_num_threads(1)

PROMPT = [1, 5, 3, 7, 2]


def file_telemetry(trace_file: Path, *, step_spans: bool = True,
                   record_tokens: bool = True) -> Telemetry:
    """A coordinator Telemetry writing synchronously to a JSON-lines file."""
    provider = build_tracer_provider("coordinator",
                                     exporters=[JsonLinesSpanExporter(trace_file)],
                                     synchronous=True)
    return Telemetry("coordinator", provider, step_spans=step_spans,
                     record_tokens=record_tokens)


def run_request(telemetry: Telemetry, *, max_new_tokens: int = 12, num_draft_tokens: int = 3,
                temperature: float = 1.0, seed: int = 7, num_alternatives: int = 0,
                prompt_lookup: PromptLookup | None = None,
                request_id: str = "req-1") -> tuple[GenerationResult, str]:
    """One generate() through the telemetry observer; (result, trace id)."""
    drafter = LocalDrafter(ModelRunner(tiny_llama(seed=1, layers=1)))
    verifier = LocalVerifier(ModelRunner(tiny_llama(seed=2)))
    config = GenerateConfig(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
                            sampling=SamplingParams(temperature=temperature, seed=seed),
                            num_alternatives=num_alternatives, prompt_lookup=prompt_lookup)
    with telemetry.request(request_id, len(PROMPT), config) as observed:
        result = generate(observed.drafter(drafter), observed.verifier(verifier), PROMPT,
                          config, on_round=observed.on_round)
        observed.finish(result)
    return result, observed.trace_id
