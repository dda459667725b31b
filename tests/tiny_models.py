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


def tiny_eagle3_draft(target: torch.nn.Module, seed: int = 0,
                      aux_layer_ids: tuple[int, ...] = (0, 1, 1),
                      draft_vocab: int | None = None, norm_before_residual: bool = False,
                      logit_scale: float = 1.0) -> torch.nn.Module:
    """A random 1-layer EAGLE-3 draft (specdec.engine.eagle3) for `target`: with
    draft_vocab, its draft vocabulary is that many target tokens drawn at random."""
    from specdec.engine.eagle3 import Eagle3DraftForCausalLM, Eagle3Settings, eagle3_config

    torch.manual_seed(seed)
    vocab, hidden = int(target.config.vocab_size), int(target.config.hidden_size)
    draft_vocab = draft_vocab or vocab
    layer = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 256}
    settings = Eagle3Settings(draft_vocab, hidden, aux_layer_ids, norm_before_residual)
    model = Eagle3DraftForCausalLM(eagle3_config(layer, settings)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale / model.lm_head.weight.std() / 32**0.5 * 2)
        model.fc.weight.mul_(4.0)  # the target's states shape the proposals
        for module in model.modules():  # norms away from 1, so a misplaced one shows
            if type(module).__name__ == "LlamaRMSNorm":
                module.weight.uniform_(0.5, 1.5)
        if draft_vocab != vocab:
            order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
            targets = order[:draft_vocab].sort().values
            model.d2t.copy_(targets - torch.arange(draft_vocab))
        targets = model.draft_to_target()
        model.t2d.zero_()
        model.t2d[targets] = True
    return model
