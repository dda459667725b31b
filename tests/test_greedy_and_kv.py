"""Greedy equivalence, KV rollback, LRU budget, vocab padding and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_gpt2, tiny_llama
from transformers import DynamicCache

from specdec.core.history import TokenHistory
from specdec.core.loop import GenerateConfig, generate
from specdec.core.sampling import SamplingParams
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.errors import CacheSyncError, KVBudgetExhausted

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 6])
def test_greedy_equals_target_greedy_with_random_draft(make_target, num_draft_tokens) -> None:
    target = make_target(64, seed=1)
    draft = tiny_llama(64, seed=2, layers=1)
    expected = hf_greedy(target, PROMPT, 40)
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT, GenerateConfig(max_new_tokens=40, num_draft_tokens=num_draft_tokens))
    assert result.token_ids == expected
    assert result.stats.draft_tokens > 0


def test_greedy_with_draft_equal_to_target_accepts_everything() -> None:
    target = tiny_llama(64, seed=1)
    result = generate(LocalDrafter(ModelRunner(target)), LocalVerifier(ModelRunner(target)),
                      PROMPT, GenerateConfig(max_new_tokens=30, num_draft_tokens=4))
    assert result.token_ids == hf_greedy(target, PROMPT, 30)
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.mean_accepted_length == 5.0


def test_draft_with_padding_rows_never_proposes_them() -> None:
    """A draft whose vocabulary has 16 extra padding rows (e.g. rounded to a multiple)."""
    target = tiny_llama(64, seed=1)
    draft = tiny_llama(80, seed=3)
    with torch.no_grad():  # make the padding rows the most likely ones
        draft.lm_head.weight[64:] = draft.lm_head.weight[:16] * 50
    drafter = LocalDrafter(ModelRunner(draft, target_vocab_size=64))
    params = SamplingParams(temperature=1.0, seed=1)
    proposal = drafter.propose("s", TokenHistory(PROMPT), 6, params)
    assert all(token < 64 for token in proposal.tokens)
    assert proposal.probs is not None and proposal.probs.shape[1] == 64
    result = generate(drafter, LocalVerifier(ModelRunner(target)), PROMPT,
                      GenerateConfig(max_new_tokens=20, num_draft_tokens=3))
    assert result.token_ids == hf_greedy(target, PROMPT, 20)


def test_kv_rollback_matches_fresh_forward() -> None:
    model = tiny_llama(64, seed=4)
    runner = ModelRunner(model)
    history = TokenHistory(PROMPT)
    runner.extend("s", 0, 0, PROMPT)
    runner.extend("s", len(PROMPT), history.fingerprint(), [7, 8, 9, 10])  # 4 speculative
    history.extend([7, 8])  # two kept, two rejected
    rolled = runner.extend("s", len(history), history.fingerprint(), [11, 12], num_logits=2)
    with torch.inference_mode():
        fresh = model(input_ids=torch.tensor([history.tokens + [11, 12]])).logits[0, -2:]
    assert torch.allclose(rolled.logits, fresh, atol=1e-5)
    assert rolled.kv_length == len(history) + 2


def test_sync_errors_name_the_problem() -> None:
    runner = ModelRunner(tiny_llama(64, seed=4))
    with pytest.raises(CacheSyncError, match="no KV cache"):
        runner.extend("missing", 3, 123, [1])
    runner.extend("s", 0, 0, PROMPT)
    with pytest.raises(CacheSyncError, match="fewer than the committed"):
        runner.extend("s", len(PROMPT) + 2, 0, [1])
    with pytest.raises(CacheSyncError, match="fingerprint"):
        runner.extend("s", 4, TokenHistory([9, 9, 9, 9]).fingerprint(), [1])
    assert runner.kv_length("s") == len(PROMPT)  # a refused call changes nothing


def test_kv_budget_evicts_least_recently_used_then_refuses() -> None:
    model = tiny_llama(64, seed=4)
    probe = ModelRunner(model)
    probe.extend("x", 0, 0, PROMPT)
    per_session = probe.session_bytes("x")
    runner = ModelRunner(model, kv_budget_bytes=int(per_session * 2.5))
    for name in ("a", "b", "c"):
        runner.extend(name, 0, 0, PROMPT)
    assert runner.kv_length("a") == 0 and runner.kv_length("c") == len(PROMPT)  # a evicted
    assert runner.total_kv_bytes() <= per_session * 2.5
    with pytest.raises(KVBudgetExhausted, match="SPECDEC_KV_BUDGET_MB"):
        runner.extend("huge", 0, 0, list(range(60)) * 2)
    assert runner.kv_length("c") == len(PROMPT)  # victims only when it can fit at all


def test_eviction_mid_generation_is_resynced_transparently() -> None:
    target, draft = tiny_llama(64, seed=1), tiny_llama(64, seed=2, layers=1)
    target_runner = ModelRunner(target)
    verifier = LocalVerifier(target_runner)

    class EvictingDrafter(LocalDrafter):
        def propose(self, session_id, committed, num_tokens, params,  # type: ignore[no-untyped-def]
                    min_confidence=0.0, num_alternatives=0, max_alternative_depth=0):
            self.runner.release(session_id)  # as if the LRU budget evicted it
            return super().propose(session_id, committed, num_tokens, params, min_confidence,
                                   num_alternatives, max_alternative_depth)

    result = generate(EvictingDrafter(ModelRunner(draft)), verifier, PROMPT,
                      GenerateConfig(max_new_tokens=20, num_draft_tokens=3))
    assert result.token_ids == hf_greedy(target, PROMPT, 20)
    assert result.stats.resyncs >= result.stats.num_drafts - 1  # every Propose after the first


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    target, draft = tiny_llama(64, seed=1), tiny_llama(64, seed=2, layers=1)

    def run(seed: int) -> list[int]:
        config = GenerateConfig(max_new_tokens=30, num_draft_tokens=3,
                                sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=seed))
        return generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                        PROMPT, config).token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_stops_on_eos_and_reports_stats() -> None:
    target, draft = tiny_llama(64, seed=1), tiny_llama(64, seed=2, layers=1)
    reference = hf_greedy(target, PROMPT, 30)
    eos = reference[10]
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT, GenerateConfig(max_new_tokens=30, num_draft_tokens=4,
                                             eos_token_ids=[eos]))
    assert result.finish_reason == "eos"
    assert result.token_ids == reference[: reference.index(eos) + 1]
    stats = result.stats
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert stats.acceptance_rate == stats.accepted_tokens / stats.draft_tokens


def test_dynamic_cache_crop_takes_negative_counts() -> None:
    """The transformers 5.x contract the runner's rollback relies on (pinned in pyproject)."""
    model = tiny_llama(64, seed=4)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True)
    cache.crop(-3)
    assert cache.get_seq_length() == len(PROMPT) - 3


def test_bf16_runner_reproduces_bf16_target_greedy() -> None:
    """Exactness is defined against the target as served: same dtype on both paths."""
    target = tiny_llama(64, seed=1).to(torch.bfloat16)
    draft = tiny_llama(64, seed=2, layers=1).to(torch.bfloat16)
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT, GenerateConfig(max_new_tokens=30, num_draft_tokens=3))
    assert result.token_ids == hf_greedy(target, PROMPT, 30)


def test_stop_string_cuts_text_and_reports_stop() -> None:
    target, draft = tiny_llama(64, seed=1), tiny_llama(64, seed=2, layers=1)
    reference = hf_greedy(target, PROMPT, 30)

    def decode(ids: list[int]) -> str:
        return "".join(f"<{token}>" for token in ids)

    stop = f"<{reference[6]}><{reference[7]}>"
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT, GenerateConfig(max_new_tokens=30, num_draft_tokens=4,
                                             stop=[stop]), decode=decode)
    assert result.finish_reason == "stop"
    assert result.text == decode(reference[:6])
    assert result.token_ids == reference[: len(result.token_ids)]
    assert len(result.token_ids) <= 8
