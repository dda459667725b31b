"""Logits processing and the seeded, counter-based random streams."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.core.sampling import (
    TOP_P_CANDIDATES,
    Purpose,
    SamplingParams,
    _top_p,
    draw,
    process_logits,
    sample_with_uniforms,
    uniforms,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_greedy_is_one_hot_on_argmax() -> None:
    probs = process_logits(LOGITS, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[1.0, 0, 0, 0, 0, 0]]


def test_temperature_matches_softmax() -> None:
    probs = process_logits(LOGITS, SamplingParams(temperature=0.7))
    assert torch.allclose(probs, torch.softmax(LOGITS / 0.7, -1))


def test_top_k_keeps_k_and_renormalises() -> None:
    probs = process_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.softmax(LOGITS[:, :2], -1)
    assert torch.allclose(probs[:, :2], expected) and probs[:, 2:].sum() == 0


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    base = torch.softmax(LOGITS, -1)[0]
    top_p = float(base[:2].sum()) - 1e-4  # needs exactly the first two tokens
    probs = process_logits(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))[0]
    assert (probs > 0).tolist() == [True, True, False, False, False, False]
    assert torch.allclose(probs[:2], base[:2] / base[:2].sum())


def _top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort every row whole, keep the prefix whose mass reaches top_p."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    drop_sorted[..., 0] = False
    return probs.masked_fill(torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted), 0)


@pytest.mark.parametrize("scale", [8.0, 1.0, 0.05])  # peaked; wide; nucleus > candidates
@pytest.mark.parametrize("top_p", [0.1, 0.9, 0.999])
def test_top_p_on_candidates_equals_the_full_sort(scale: float, top_p: float) -> None:
    generator = torch.Generator().manual_seed(int(scale * 100) + int(top_p * 1000))
    logits = torch.randn(3, 49152, generator=generator) * scale
    probs = torch.softmax(logits, dim=-1)
    kept = _top_p(probs, top_p)
    assert torch.equal(kept, _top_p_by_full_sort(probs, top_p))
    if scale == 0.05 and top_p > 0.5:  # the fallback path: the nucleus is wider
        assert int((kept[0] > 0).sum()) > TOP_P_CANDIDATES


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    base = torch.softmax(LOGITS, -1)[0]
    probs = process_logits(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))[0]
    assert ((probs > 0) == (base >= 0.3 * base.max())).all()


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 1.5), ("top_k", -1),
                                         ("min_p", 2.0), ("temperature", math.nan)])
def test_validate_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()  # type: ignore[arg-type]


def test_uniform_streams_are_pure_functions_of_seed_position_purpose() -> None:
    a = uniforms(42, range(10, 20), Purpose.ACCEPT)
    assert torch.equal(a, uniforms(42, range(10, 20), Purpose.ACCEPT))
    assert torch.equal(a[3:], uniforms(42, range(13, 20), Purpose.ACCEPT))
    assert not torch.equal(a, uniforms(42, range(10, 20), Purpose.DRAFT))
    assert not torch.equal(a, uniforms(43, range(10, 20), Purpose.ACCEPT))


def test_inverse_cdf_never_draws_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(5, 1)
    u = torch.tensor([0.0, 0.25, 0.5, 0.999999, 1.0 - 1e-17], dtype=torch.float64)
    tokens = sample_with_uniforms(probs, u)
    assert tokens.tolist() == [1, 1, 3, 3, 3]


def test_draw_follows_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    params = SamplingParams(temperature=1.0, seed=5)
    tokens = draw(probs.expand(20_000, 4), params, 0, Purpose.EMIT)
    freq = torch.bincount(tokens, minlength=4).float() / 20_000
    assert torch.allclose(freq, probs, atol=0.015)


def test_with_seed_fixes_a_seed_once() -> None:
    params = SamplingParams(temperature=1.0).with_seed()
    assert params.seed is not None and params.with_seed() is params
