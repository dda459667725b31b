"""Logits processing and seeded sampling: pure functions on fp32 tensors.

The same :class:`SamplingParams` is applied to the draft's and the target's logits, so q
and p are the *processed* distributions the speculative rule needs (docs/design.md,
"The exactness contract").
All randomness comes from :func:`uniforms`, a counter-based stream keyed by
(seed, absolute position, purpose): the random numbers used for a position do not depend
on which process draws them, on earlier rounds, or on a service restart, which is what
makes seeded requests reproducible in-process and over gRPC alike.
Several draws at one (seed, position, purpose), the siblings of a token tree, take one
independent stream each by rank; rank 0 is the stream a single draw there uses.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass
from enum import IntEnum

import torch


class Purpose(IntEnum):
    """Independent random streams for the three draws the algorithm makes per position."""

    DRAFT = 1  # the draft's proposal at a position
    ACCEPT = 2  # the accept/reject coin for a proposal at a position
    EMIT = 3  # the target's own draw at a position: residual, bonus, or target-only


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 0 or 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"sampling.{name} must be a finite number, got {value}")
        if self.temperature < 0:
            raise ValueError(
                f"sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in [0, 1] (0 or 1 = off), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling.min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"sampling.seed must fit in uint64, got {self.seed}")

    def with_seed(self) -> SamplingParams:
        """A copy whose seed is fixed now, so every draw of one request shares one stream."""
        if self.seed is not None:
            return self
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p,
                              secrets.randbits(63))


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., V] into the distribution a token is drawn from, in fp32.

    Greedy gives a one-hot on the argmax (lowest index on ties, like torch.argmax).
    Otherwise: temperature, then top-k, top-p and min-p filters, then renormalise.
    """
    logits = logits.float()
    if params.greedy:
        one_hot = torch.zeros_like(logits)
        return one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if 0.0 < params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


# Candidates the top-p filter sorts first: a nucleus is usually far smaller, and sorting a
# whole vocabulary row is a sizeable share of a CPU decoding step.
TOP_P_CANDIDATES = 1024


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of the tokens by probability whose mass reaches top_p (the
    top token always stays). Sorts only the most likely candidates when their mass
    reaches top_p in every row: every token past them has at least that much mass before
    it, so a full sort would drop it too; otherwise sorts more (at worst the whole row)."""
    vocab = probs.shape[-1]
    candidates = min(TOP_P_CANDIDATES, vocab)
    while True:
        sorted_probs, order = torch.topk(probs, candidates, dim=-1)  # descending
        if candidates == vocab or bool((sorted_probs.sum(dim=-1) >= top_p).all()):
            break
        candidates = min(vocab, candidates * 8)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)
    return probs.masked_fill(~keep, 0.0)


def _stream_seed(seed: int, position: int, purpose: Purpose, rank: int = 0) -> int:
    key = f"{seed}:{position}:{int(purpose)}"
    if rank:
        key += f":{rank}"  # rank 0 keeps the key of a position's single draw
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def uniforms(seed: int, positions: range | list[int], purpose: Purpose, *,
             rank: int = 0) -> torch.Tensor:
    """One U[0,1) float64 per absolute position, a pure function of (seed, position, purpose,
    rank). Rank r > 0 is a stream independent of rank 0 at the same position and purpose:
    the r-th sibling drawn, or tested, at a node of a token tree."""
    if rank < 0:
        raise ValueError(f"uniforms: rank must be >= 0, got {rank}")
    generator = torch.Generator(device="cpu")
    values = []
    for position in positions:
        generator.manual_seed(_stream_seed(seed, position, purpose, rank))
        values.append(torch.rand((), dtype=torch.float64, generator=generator))
    return torch.stack(values) if values else torch.empty(0, dtype=torch.float64)


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: one token per row of probs [N, V] from uniforms u [N].

    Never returns a zero-probability token: ties in the CDF skip empty entries and a
    rounding overshoot is clamped to the last token with mass.
    """
    probs64 = probs.double()
    cdf = torch.cumsum(probs64, dim=-1)
    total = cdf[:, -1:]
    targets = u.to(probs64.device).unsqueeze(-1) * total
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    last_nonzero = (probs64 > 0).cumsum(-1).argmax(-1)
    return torch.minimum(tokens, last_nonzero)


def draw(probs: torch.Tensor, params: SamplingParams, first_position: int,
         purpose: Purpose) -> torch.Tensor:
    """Draw one token per row of processed probs [N, V]; row i sits at first_position + i."""
    if params.greedy:
        return probs.argmax(dim=-1)
    assert params.seed is not None, "call SamplingParams.with_seed() once per request"
    u = uniforms(params.seed, range(first_position, first_position + probs.shape[0]), purpose)
    return sample_with_uniforms(probs, u)
