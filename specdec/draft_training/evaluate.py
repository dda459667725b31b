"""Measure a draft against the target on held-out prompts: alpha, accepted length, costs.

The held-out sets, in the report's order: the hand-written everyday conversations
(heldout.handwritten_held_out), then the held-out split of the templated and the wide
prompt sets.

Figures follow docs/design.md ("Choosing the draft length"): alpha is the per-token acceptance
probability (MLE under the geometric model: accepted / (accepted + rejections)); costs
are medians of warm-cache forwards; the bound S(gamma) uses the measured T_target(k).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from specdec.core.history import TokenHistory
from specdec.core.loop import GenerateConfig, RoundEvent, generate
from specdec.core.sampling import SamplingParams
from specdec.draft_training.datagen import PROMPT_SETS, interleave_by_category
from specdec.draft_training.heldout import HANDWRITTEN, handwritten_held_out
from specdec.draft_training.prompts import split
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner


@dataclass
class AcceptanceResult:
    temperature: float
    gamma: int
    prompts: int
    draft_tokens: int
    accepted_tokens: int
    rejections: int
    acceptance_rate: float  # accepted / drafted (vLLM)
    alpha: float  # accepted / (accepted + rejections)
    mean_accepted_length: float  # tokens per drafting round, bonus included
    greedy_matches_target: bool | None = None
    prompt_set: str = "templated"


@dataclass
class CostResult:
    t_draft_1_ms: float
    t_target_ms: dict[int, float] = field(default_factory=dict)  # k -> ms

    @property
    def c(self) -> float:
        return self.t_draft_1_ms / self.t_target_ms[1]


def expected_tokens(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup_bound(alpha: float, gamma: int, costs: CostResult) -> float:
    """S(gamma) = E[tokens] * T_target(1) / (gamma * T_draft(1) + T_target(gamma + 1))."""
    verify_ms = costs.t_target_ms[gamma + 1]
    return expected_tokens(alpha, gamma) * costs.t_target_ms[1] / (
        gamma * costs.t_draft_1_ms + verify_ms)


def held_out_prompt_ids(tokenizer, count: int,
                        prompt_set: str = "templated") -> list[tuple[str, list[int]]]:
    """(category, chat-template ids) of the first `count` prompts of a held-out set:
    HANDWRITTEN or a prompt set's held-out split, categories in turn."""
    if prompt_set == HANDWRITTEN:
        chosen = [(p.kind, p.messages) for p in handwritten_held_out()[:count]]
    else:
        _, held_out = split(PROMPT_SETS[prompt_set][1]())
        chosen = [(p.category, [{"role": "user", "content": p.text}])
                  for p in interleave_by_category(held_out)[:count]]
    result = []
    for category, messages in chosen:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        result.append((category, list(ids)))
    return result


def measure_acceptance(draft_runner: ModelRunner, target_runner: ModelRunner,
                       prompts: list[tuple[str, list[int]]], temperature: float, gamma: int,
                       max_new_tokens: int, eos_id: int,
                       check_greedy: bool = False) -> AcceptanceResult:
    drafter, verifier = LocalDrafter(draft_runner), LocalVerifier(target_runner)
    drafted = accepted = rejections = drafts = 0
    matches = True
    for index, (_, ids) in enumerate(prompts):
        params = SamplingParams(temperature=temperature, seed=index)
        config = GenerateConfig(max_new_tokens=max_new_tokens, sampling=params,
                                num_draft_tokens=gamma, eos_token_ids=[eos_id])

        def count_round(event: RoundEvent) -> None:
            nonlocal rejections
            if event.proposal and event.accepted_len < len(event.proposal.tokens):
                rejections += 1

        result = generate(drafter, verifier, ids, config, on_round=count_round)
        drafted += result.stats.draft_tokens
        accepted += result.stats.accepted_tokens
        drafts += result.stats.num_drafts
        if check_greedy:
            reference = generate(None, verifier, ids, GenerateConfig(
                max_new_tokens=max_new_tokens, num_draft_tokens=0, eos_token_ids=[eos_id]))
            matches = matches and reference.token_ids == result.token_ids
    return AcceptanceResult(
        temperature, gamma, len(prompts), drafted, accepted, rejections,
        accepted / max(1, drafted), accepted / max(1, accepted + rejections),
        1 + accepted / max(1, drafts), matches if check_greedy else None)


def _median_forward_ms(runner: ModelRunner, context: list[int], new_tokens: int,
                       repeats: int) -> float:
    runner.extend("cost", 0, 0, context, target_hidden=runner.placeholder_hidden(len(context)))
    fingerprint = TokenHistory(context).fingerprint()
    block = context[:new_tokens]
    hidden = runner.placeholder_hidden(new_tokens)
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        runner.extend("cost", len(context), fingerprint, block, num_logits=new_tokens,
                      target_hidden=hidden)
        times.append((time.perf_counter() - started) * 1000)
    runner.release("cost")
    return statistics.median(times[2:])


def measure_costs(draft_runner: ModelRunner, target_runner: ModelRunner, context: list[int],
                  max_k: int = 9, repeats: int = 15) -> CostResult:
    costs = CostResult(_median_forward_ms(draft_runner, context, 1, repeats))
    for k in range(1, max_k + 1):
        costs.t_target_ms[k] = _median_forward_ms(target_runner, context, k, repeats)
    return costs


def evaluation_report(acceptance: list[AcceptanceResult], costs: CostResult) -> dict:
    greedy = next(a for a in acceptance if a.temperature == 0.0)
    bounds = {gamma: speedup_bound(greedy.alpha, gamma, costs)
              for gamma in range(1, max(costs.t_target_ms))}
    best_gamma = max(bounds, key=bounds.__getitem__)
    return {"acceptance": [asdict(a) for a in acceptance],
            "t_draft_1_ms": costs.t_draft_1_ms, "t_target_ms": costs.t_target_ms,
            "c": costs.c, "bound_by_gamma_greedy": bounds, "best_gamma": best_gamma,
            "best_bound": bounds[best_gamma]}


def evaluate(draft_runner: ModelRunner, target_runner: ModelRunner, tokenizer, *,
             num_prompts: int = 24, max_new_tokens: int = 64, gamma: int = 4) -> dict:
    """Acceptance on `num_prompts` prompts of each held-out set (the hand-written set
    first, greedy and T=1; the templated set greedy and T=1; the wide set greedy), with
    the greedy output checked against target-only decoding, and the costs."""
    torch.manual_seed(0)
    eos_id = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    acceptance = []
    for prompt_set, temperatures in ((HANDWRITTEN, (0.0, 1.0)), ("templated", (0.0, 1.0)),
                                     ("wide", (0.0,))):
        prompts = held_out_prompt_ids(tokenizer, num_prompts, prompt_set)
        for temperature in temperatures:
            result = measure_acceptance(draft_runner, target_runner, prompts, temperature,
                                        gamma, max_new_tokens, eos_id,
                                        check_greedy=temperature == 0.0)
            result.prompt_set = prompt_set
            acceptance.append(result)
    context = held_out_prompt_ids(tokenizer, 1)[0][1] * 3  # a templated prompt's, thrice
    costs = measure_costs(draft_runner, target_runner, context)
    report = evaluation_report(acceptance, costs)
    report.update({"num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
                   "threads": torch.get_num_threads()})
    return report
