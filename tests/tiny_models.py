"""Tiny randomly initialised causal LMs (Llama and GPT-2) built from a config, no hub."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int = 16, seed: int = 0, layers: int = 2, hidden: int = 32,
               logit_scale: float = 1.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits make distributions less uniform, tests stronger
        model.lm_head.weight.mul_(logit_scale / model.lm_head.weight.std() / hidden**0.5 * 2)
    return model


def tiny_gpt2(vocab_size: int = 16, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=256)
    return GPT2LMHeadModel(config).eval()


def assert_speculative_greedy_equals_hf(target: torch.nn.Module, reference: torch.nn.Module,
                                        draft: torch.nn.Module,
                                        lengths: tuple[int, ...] = (1, 3, 6)) -> None:
    """specdec's greedy output with `target` == transformers' generate with `reference`."""
    from specdec.core.loop import GenerateConfig, generate
    from specdec.engine.local import LocalDrafter, LocalVerifier
    from specdec.engine.runner import ModelRunner

    prompt = [3, 14, 15, 9, 2, 6]
    with torch.no_grad():
        expected = reference.generate(  # type: ignore[operator]
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pad_token_id=0)[0, len(prompt):].tolist()
    for k in lengths:
        result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                          prompt, GenerateConfig(max_new_tokens=40, num_draft_tokens=k))
        assert result.token_ids == expected, f"k={k}"


def tiny_feature_draft(vocab_size: int = 16, target_hidden: int = 32, seed: int = 0,
                       logit_scale: float = 1.0) -> torch.nn.Module:
    """A 1-layer draft that reads a target's hidden states (specdec.engine.feature_draft)."""
    from specdec.engine.feature_draft import TARGET_HIDDEN_SIZE_KEY, FeatureDraftForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    setattr(config, TARGET_HIDDEN_SIZE_KEY, target_hidden)
    model = FeatureDraftForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale / model.lm_head.weight.std() / 32**0.5 * 2)
        # Let the target's state dominate the input, as training makes it: the draft's
        # proposals then depend on it, so a misaligned row changes what it proposes.
        model.feature_fc.weight[:, 32:].mul_(4.0)
    return model


def save_tiny_pair(root: Path) -> tuple[Path, Path]:
    """Tiny random target and draft over SmolLM2's vocabulary, saved with its tokenizer
    (so text prompts, chat and stop strings work end to end)."""
    from transformers import AutoTokenizer

    from specdec.engine.models import DEFAULT_TARGET, resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_TARGET, progress=False))
    paths = []
    for name, seed, layers in (("target", 1, 2), ("draft", 2, 1)):
        model = tiny_llama(len(tokenizer), seed=seed, layers=layers, hidden=32)
        model.config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths.append(root / name)
    return paths[0], paths[1]
