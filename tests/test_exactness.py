"""Empirical exactness: speculative sampling reproduces the target's joint law.

Tiny random Llama models over an 8-token vocabulary; the first 3 generated tokens
(512 outcomes, enumerated exactly) are compared with a chi-square test. Seeds are fixed,
so the verdicts are deterministic. A deliberately wrong sampler (q from unprocessed
logits) must be rejected by the same test, which shows the test has power.

Each sampling setting's chain law is checked once, in one of the ways a deployment runs
the models (bfloat16 through the CPU kernels: T0.7_topk4; a bfloat16 target with a
float32 draft: T1; a compiled draft: top-p 0.8), and each setting's token-tree law in
float32.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from cpu_features import BF16_AUTO_LINEAR
from exact_law import chi_square_pvalue, target_law
from tiny_models import tiny_llama

from specdec.core.history import TokenHistory
from specdec.core.interfaces import Proposal
from specdec.core.loop import GenerateConfig, RoundEvent, generate
from specdec.core.sampling import SamplingParams
from specdec.engine.attention import apply_attention_kernel
from specdec.engine.draft_compile import compile_draft
from specdec.engine.kernels import apply_linear_kernel
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner

VOCAB = 8
PROMPT = [1, 5, 2]
LENGTH = 3
SAMPLES = 2500

SETTINGS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7_topk4": SamplingParams(temperature=0.7, top_k=4),
    "topp0.8": SamplingParams(temperature=1.0, top_p=0.8),
}


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(1)
    return tiny_llama(VOCAB, seed=11, logit_scale=0.5), tiny_llama(VOCAB, seed=12, layers=1,
                                                                   logit_scale=0.5)


class RawLogitsDrafter(LocalDrafter):
    """The bug from public implementations: q reported from raw logits, not processed ones."""

    def propose(self, session_id: str, committed: TokenHistory, num_tokens: int,
                params: SamplingParams, min_confidence: float = 0.0,
                num_alternatives: int = 0, max_alternative_depth: int = 0) -> Proposal:
        proposal = super().propose(session_id, committed, num_tokens, params, min_confidence,
                                   num_alternatives, max_alternative_depth)
        ids = torch.tensor([committed.tokens + proposal.tokens])
        with torch.inference_mode():
            logits = self.runner.model(input_ids=ids).logits[0]
        start = len(committed)
        raw_q = torch.softmax(logits[start - 1: start - 1 + num_tokens].float(), dim=-1)
        return Proposal(proposal.tokens, raw_q, proposal.elapsed_s)


def sample_joint(drafter: LocalDrafter, verifier: LocalVerifier, params: SamplingParams,
                 num_draft_tokens: int, num_alternatives: int = 0,
                 on_round: Callable[[RoundEvent], None] | None = None
                 ) -> list[tuple[int, ...]]:
    samples = []
    for seed in range(SAMPLES):
        seeded = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p, seed)
        config = GenerateConfig(max_new_tokens=LENGTH, sampling=seeded,
                                num_draft_tokens=num_draft_tokens,
                                num_alternatives=num_alternatives, session_id=f"s{seed}")
        samples.append(tuple(generate(drafter, verifier, PROMPT, config,
                                      on_round=on_round).token_ids))
    return samples


def assert_law_matches(target: torch.nn.Module, draft: torch.nn.Module,
                       params: SamplingParams) -> None:
    """Speculative samples (k = 2) fit the target's enumerated joint law."""
    with torch.inference_mode():
        law = target_law(target, PROMPT, params, LENGTH)
    samples = sample_joint(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                           params, num_draft_tokens=2)
    assert chi_square_pvalue(samples, law) > 1e-3


def test_speculative_law_matches_target_in_bfloat16_with_the_cpu_kernels(models) -> None:
    """bfloat16 through the CPU's auto linear kernel (oneDNN's where the CPU has bfloat16
    support) and rowwise attention."""
    target, draft = (copy.deepcopy(model).to(torch.bfloat16) for model in models)
    for model in (target, draft):
        assert apply_linear_kernel(model, "auto") == BF16_AUTO_LINEAR
        assert apply_attention_kernel(model, "auto") == "rowwise"
    assert_law_matches(target, draft, SETTINGS["T0.7_topk4"])


def test_speculative_law_matches_a_bfloat16_target_with_a_float32_draft(models) -> None:
    """--draft-dtype: the draft's precision may differ from the target's as served."""
    target, draft = copy.deepcopy(models[0]).to(torch.bfloat16), copy.deepcopy(models[1])
    assert apply_linear_kernel(target, "auto") == BF16_AUTO_LINEAR
    assert apply_linear_kernel(draft, "torch") == "torch"
    assert_law_matches(target, draft, SETTINGS["T1"])


def test_speculative_law_matches_target_with_a_compiled_draft(models) -> None:
    """--draft-compile: the draft's forward through torch.compile (inductor)."""
    target, draft = models[0], copy.deepcopy(models[1])
    outcome = compile_draft(draft, lambda: ModelRunner(draft), "on", torch.device("cpu"))
    assert outcome.compiled
    assert_law_matches(target, draft, SETTINGS["topp0.8"])


def _tree_samples(models: tuple[torch.nn.Module, torch.nn.Module], params: SamplingParams
                  ) -> tuple[list[tuple[int, ...]], list[RoundEvent]]:
    """Samples of k = 2 token trees with up to 4 alternatives, and their rounds."""
    target, draft = models
    events: list[RoundEvent] = []
    samples = sample_joint(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                           params, num_draft_tokens=2, num_alternatives=4,
                           on_round=events.append)
    return samples, events


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_token_tree_law_matches_target(models, setting: str) -> None:
    """Siblings drawn without replacement and tested in rank order against the residual
    keep the target's law (specdec.core.tree_acceptance)."""
    params = SETTINGS[setting]
    with torch.inference_mode():
        law = target_law(models[0], PROMPT, params, LENGTH)
    samples, events = _tree_samples(models, params)
    kept = sum(len(event.kept_branches) for event in events)
    assert kept > SAMPLES // 20, f"only {kept} alternatives kept: the tree rule barely ran"
    assert chi_square_pvalue(samples, law) > 1e-3


def test_tree_without_the_residual_between_siblings_is_rejected(models, monkeypatch) -> None:
    """The same test has power against a subtly wrong tree rule: every sibling tested
    against the node's full target row instead of the residual the earlier ones leave."""
    import specdec.core.tree_acceptance as tree_acceptance

    monkeypatch.setattr(tree_acceptance, "residual", lambda p, q: p)
    params = SETTINGS["T1"]
    with torch.inference_mode():
        law = target_law(models[0], PROMPT, params, LENGTH)
    samples, _ = _tree_samples(models, params)
    assert chi_square_pvalue(samples, law) < 1e-6


def test_wrong_q_is_rejected_by_the_same_test(models) -> None:
    target, draft = models
    params = SETTINGS["T0.7_topk4"]
    law = target_law(target, PROMPT, params, LENGTH)
    samples = sample_joint(RawLogitsDrafter(ModelRunner(draft)),
                           LocalVerifier(ModelRunner(target)), params, num_draft_tokens=2)
    assert chi_square_pvalue(samples, law) < 1e-6


def test_draft_law_alone_is_rejected(models) -> None:
    """Sanity of power: the draft's own law differs from the target's under this test."""
    target, draft = models
    params = SETTINGS["T1"]
    law = target_law(target, PROMPT, params, LENGTH)
    samples = sample_joint(LocalDrafter(ModelRunner(target)), LocalVerifier(ModelRunner(draft)),
                           params, num_draft_tokens=0)
    assert chi_square_pvalue(samples, law) < 1e-6
