"""Analytic one-step exactness of the speculative rule, for random and edge-case p, q."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from specdec.core.rejection import residual, verify_greedy
from specdec.core.sampling import SamplingParams
from specdec.core.tree_acceptance import verify


def one_step_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q(x)min(1,p/q) + (1 - sum_y q(y)min(1,p(y)/q(y))) * norm(max(0,p-q))(x)."""
    accept = torch.where(q > 0, torch.minimum(q, p), torch.zeros_like(p))
    return accept + (1 - accept.sum()) * residual(p, q)


def random_dist(vocab: int, generator: torch.Generator, zeros: int = 0) -> torch.Tensor:
    weights = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 3
    if zeros:
        weights[torch.randperm(vocab, generator=generator)[:zeros]] = 0
    return weights / weights.sum()


CASES = {
    "random": lambda g: (random_dist(50, g), random_dist(50, g)),
    "zeros_in_q": lambda g: (random_dist(50, g), random_dist(50, g, zeros=20)),
    "zeros_in_p": lambda g: (random_dist(50, g, zeros=20), random_dist(50, g)),
    "zeros_in_both": lambda g: (random_dist(50, g, zeros=15), random_dist(50, g, zeros=15)),
    "disjoint": lambda g: (torch.cat([random_dist(25, g), torch.zeros(25, dtype=torch.float64)]),
                           torch.cat([torch.zeros(25, dtype=torch.float64), random_dist(25, g)])),
    "equal": lambda g: (lambda d: (d, d.clone()))(random_dist(50, g)),
    "one_hot_p": lambda g: (torch.nn.functional.one_hot(torch.tensor(7), 50).double(),
                            random_dist(50, g)),
    "one_hot_q": lambda g: (random_dist(50, g),
                            torch.nn.functional.one_hot(torch.tensor(3), 50).double()),
    "one_hot_both_differ": lambda g: (torch.nn.functional.one_hot(torch.tensor(1), 50).double(),
                                      torch.nn.functional.one_hot(torch.tensor(2), 50).double()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_step_law_equals_target(case: str) -> None:
    generator = torch.Generator().manual_seed(1234)
    for _ in range(20):
        p, q = CASES[case](generator)
        law = one_step_law(p, q)
        assert torch.allclose(law, p, atol=1e-12), case
        assert float(law.sum()) == pytest.approx(1.0)


def test_one_step_law_detects_a_wrong_residual() -> None:
    """The check above can fail: resampling from p instead of max(0, p-q) is caught."""
    generator = torch.Generator().manual_seed(0)
    p, q = random_dist(50, generator), random_dist(50, generator)
    accept = torch.minimum(q, p)
    wrong = accept + (1 - accept.sum()) * p
    assert not torch.allclose(wrong, p, atol=1e-6)


def test_verify_empirical_one_step_matches_p() -> None:
    """The implementation (not just the formula) draws from p: 10k seeded trials, 6 tokens,
    a chi-square test of the counts against p (a cell 0.02 off alone gives a statistic
    near 20 on 4 degrees of freedom, p-value about 1e-3)."""
    generator = torch.Generator().manual_seed(7)
    p = random_dist(6, generator, zeros=1).float()
    q = random_dist(6, generator, zeros=1).float()
    counts = torch.zeros(6)
    draft_gen = torch.Generator().manual_seed(99)
    trials = 10_000
    for trial in range(trials):
        token = torch.multinomial(q, 1, generator=draft_gen)
        seeded = SamplingParams(temperature=1.0, seed=trial)
        verdict = verify(token, q.unsqueeze(0), torch.stack([p, p]), seeded, first_position=0)
        out = int(token[0]) if verdict.accepted_len == 1 else verdict.next_token
        counts[out] += 1
    assert counts[p == 0].sum() == 0
    held = p > 0
    pvalue = stats.chisquare(counts[held].double().numpy(),
                             (p[held].double() * trials).numpy()).pvalue
    assert pvalue > 1e-3, (counts / trials, p)


def test_greedy_keeps_matching_prefix_then_corrects() -> None:
    target = torch.nn.functional.one_hot(torch.tensor([4, 5, 6, 7]), 10).float()
    verdict = verify_greedy(torch.tensor([4, 5, 9]), target)
    assert (verdict.accepted_len, verdict.next_token) == (2, 6)
    verdict = verify_greedy(torch.tensor([4, 5, 6]), target)
    assert (verdict.accepted_len, verdict.next_token) == (3, 7)  # bonus token
    verdict = verify_greedy(torch.tensor([1, 5, 6]), target)
    assert (verdict.accepted_len, verdict.next_token) == (0, 4)
