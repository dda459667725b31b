"""Exact, enumerated law of the first n generated tokens, seeded samples of them, and a
chi-square comparison.

Used by the empirical exactness tests (in-process and through the services): the
speculative sampler's joint law of the first tokens must equal the target's own.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import torch
from scipy import stats

from specdec.core.interfaces import Drafter, Verifier
from specdec.core.loop import GenerateConfig, generate
from specdec.core.sampling import SamplingParams, process_logits


@torch.inference_mode()
def target_law(model: torch.nn.Module, prompt: Sequence[int], params: SamplingParams,
               length: int) -> dict[tuple[int, ...], float]:
    """P(x1..xn | prompt) under the processed target distribution, by enumeration.

    One forward per prefix: a batch would take other kernels (the rowwise attention
    runs one sequence at a time), whose last bits can move a top-k or top-p cut at a
    near-tie; one sequence alone gets the bits the served target computes."""
    vocab = int(model.config.vocab_size)
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        prefixes = [p for p, mass in law.items() if mass > 0]
        logits = torch.cat([model(input_ids=torch.tensor([list(prompt) + list(p)])).logits[:, -1]
                            for p in prefixes])
        probs = process_logits(logits, params).double()
        law = {prefix + (token,): law[prefix] * float(probs[row, token])
               for row, prefix in enumerate(prefixes) for token in range(vocab)}
    return law


def chi_square_pvalue(samples: Sequence[tuple[int, ...]],
                      law: dict[tuple[int, ...], float], min_expected: float = 5.0) -> float:
    """Goodness of fit; cells with expected count below min_expected are pooled."""
    counts = Counter(samples)
    n = len(samples)
    observed, expected = [], []
    pooled_obs = pooled_exp = 0.0
    for outcome, prob in law.items():
        if prob * n >= min_expected:
            observed.append(counts.get(outcome, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += prob * n
    outside = sum(c for o, c in counts.items() if law.get(o, 0.0) == 0.0)
    if outside:
        return 0.0  # an outcome the target can never produce
    if len(observed) < 10:
        raise ValueError(f"only {len(observed)} cells with expected >= {min_expected}: "
                         "the test would have no power; use more samples or flatter models")
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


def seeded_samples(drafter: Drafter, verifier: Verifier, prompt: Sequence[int],
                   params: SamplingParams, length: int, runs: int = 2500,
                   num_draft_tokens: int = 2) -> tuple[list[tuple[int, ...]], int]:
    """The first `length` tokens of `runs` generations seeded 0..runs-1, each its own
    session, and the draft tokens the target accepted over all of them."""
    samples: list[tuple[int, ...]] = []
    accepted = 0
    for seed in range(runs):
        seeded = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p,
                                seed)
        result = generate(drafter, verifier, prompt, GenerateConfig(
            max_new_tokens=length, sampling=seeded, num_draft_tokens=num_draft_tokens,
            session_id=f"s{seed}"))
        samples.append(tuple(result.token_ids))
        accepted += result.stats.accepted_tokens
    return samples, accepted


def all_sequences(vocab: int, length: int) -> list[tuple[int, ...]]:
    return list(itertools.product(range(vocab), repeat=length))
