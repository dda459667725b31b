"""llama.cpp in `specdec bench`: the engine a CPU user would otherwise pick, on the same
weights, threads, prompts and token ids.

Systems (each one row of the report):
- llama-cpp-bf16, llama-cpp-q8_0: plain decoding of the embedded target's GGUF converted
  to bfloat16 and to Q8_0 (llama.cpp's 8-bit format);
- llama-cpp-q4_1: plain decoding of the shipped GGUF itself (Q4_1 layers, a Q8_0
  embedding), the bytes specdec's int8 format holds in 4-bit codes;
- llama-cpp-ngram: llama.cpp's n-gram (prompt lookup) speculation on the Q8_0 weights.

Runs through llama-cpp-python, an optional extra (`pip install -e .[llama-cpp]`, which
builds llama.cpp from source: about ten minutes on 2 cores). Without it, or for a
target that is not the embedded GGUF, these systems are skipped with one line. The
converted GGUFs are made once (llama.cpp's own quantizer, from the shipped Q4_1 file)
and kept beside the converted models.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from specdec.bench.configs import (
    LLAMA_CPP_BF16,
    LLAMA_CPP_NGRAM,
    LLAMA_CPP_Q4_1,
    LLAMA_CPP_Q8_0,
    BenchConfig,
    RunRecord,
    SamplingMode,
)

# The GGUF file type each system runs (llama.cpp's LLAMA_FTYPE names).
FILE_TYPES = {LLAMA_CPP_BF16: "BF16", LLAMA_CPP_Q8_0: "Q8_0", LLAMA_CPP_Q4_1: "Q4_1",
              LLAMA_CPP_NGRAM: "Q8_0"}
NGRAM_DRAFT_TOKENS = 10  # llama-cpp-python's LlamaPromptLookupDecoding default
CONTEXT_TOKENS = 4096


def unavailable_reason(target_model: str) -> str | None:
    """Why the llama.cpp systems cannot run here (None: they can)."""
    from specdec.engine.models import DEFAULT_TARGET

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return ("llama-cpp-python is not installed (pip install -e .[llama-cpp]; it builds "
                "llama.cpp from source)")
    if target_model != DEFAULT_TARGET:
        return f"llama.cpp runs the embedded target's GGUF, not {target_model}"
    return None


def gguf_path(file_type: str) -> Path:
    """The embedded target's GGUF in file_type, converted once by llama.cpp's quantizer."""
    import llama_cpp

    from specdec.engine.models import _smollm2_gguf_path, model_cache_dir

    source = _smollm2_gguf_path()
    if source.stem.rsplit(".", 1)[-1] == file_type:
        return source  # the shipped file itself
    out = model_cache_dir() / "gguf" / f"{source.stem.rsplit('.', 1)[0]}.{file_type}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = True
    partial = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not convert {source} to {file_type}")
    partial.rename(out)
    return out


class LlamaCppSystems:
    """One loaded llama.cpp model per file type, run like the bench's other systems."""

    def __init__(self, systems: tuple[str, ...], threads: int) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.threads = threads
        self.models: dict[str, Any] = {}
        for system in systems:
            draft = (LlamaPromptLookupDecoding(num_pred_tokens=NGRAM_DRAFT_TOKENS)
                     if system == LLAMA_CPP_NGRAM else None)
            self.models[system] = Llama(
                model_path=str(gguf_path(FILE_TYPES[system])), n_ctx=CONTEXT_TOKENS,
                n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False,
                draft_model=draft)

    def run(self, config: BenchConfig, mode: SamplingMode, prompt_ids: list[int],
            max_new_tokens: int, eos: tuple[int, ...], seed: int) -> RunRecord:
        """One generation from the same token ids the other systems get."""
        model = self.models[config.system]
        params = mode.params(seed)
        model.set_seed(seed)
        tokens: list[int] = []
        started = time.perf_counter()
        for token in model.generate(
                prompt_ids, temp=params.temperature, top_k=params.top_k,
                top_p=params.top_p or 1.0, min_p=params.min_p, repeat_penalty=1.0,
                reset=True):
            if token in eos:
                break
            tokens.append(int(token))
            if len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - started
        # Another engine's rounding: its greedy tokens are not compared with the target's.
        return RunRecord(config.name, config.system, config.length, mode.name, "", "", 0,
                         len(prompt_ids), len(tokens), seconds)
