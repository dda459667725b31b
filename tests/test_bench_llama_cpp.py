"""llama.cpp in `specdec bench` (specdec/bench/llama_cpp.py): skipped in one line where it
cannot run; where llama-cpp-python is installed, it decodes the embedded target's token
ids on its own converted weights."""

from __future__ import annotations

import sys

import pytest

from specdec.bench import llama_cpp
from specdec.bench.configs import LLAMA_CPP_Q8_0, MODES, BenchConfig
from specdec.engine.models import DEFAULT_TARGET


def test_without_llama_cpp_python_the_systems_say_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    reason = llama_cpp.unavailable_reason(DEFAULT_TARGET)
    assert reason is not None and "pip install -e .[llama-cpp]" in reason


def test_a_target_without_the_embedded_gguf_is_named() -> None:
    pytest.importorskip("llama_cpp")
    reason = llama_cpp.unavailable_reason("acme/other-model")
    assert reason == "llama.cpp runs the embedded target's GGUF, not acme/other-model"


@pytest.mark.slow
def test_llama_cpp_decodes_the_prompt_ids_to_the_token_limit() -> None:
    pytest.importorskip("llama_cpp")
    systems = llama_cpp.LlamaCppSystems((LLAMA_CPP_Q8_0,), threads=1)
    assert llama_cpp.gguf_path("Q8_0").exists()
    from transformers import AutoTokenizer

    from specdec.engine.models import prepare_smollm2

    tokenizer = AutoTokenizer.from_pretrained(prepare_smollm2(progress=False))
    prompt = list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a color."}], add_generation_prompt=True,
        return_dict=True)["input_ids"])
    record = systems.run(BenchConfig(LLAMA_CPP_Q8_0), MODES["greedy"], prompt, 6,
                         eos=(), seed=0)
    assert (record.system, record.new_tokens, record.prompt_tokens) == (
        LLAMA_CPP_Q8_0, 6, len(prompt))
    assert record.seconds > 0
