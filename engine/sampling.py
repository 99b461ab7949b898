"""Sampling as small pure tensor functions: the filters that turn logits into p and q, and draws.

Temperature / top-k / top-p are applied identically to the target's logits (p)
and the drafter's (q), so both live on the same support before verification.
Draws take an explicit ``torch.Generator`` so that a run replays exactly, on the
device the distribution lives on (a run's generator is made on its model's device).
On an accelerator a draw is an exponential race: the winner of argmax(w / E) with
E ~ Exp(1) per entry is drawn from w / sum(w) (``engine.kernels.batched_verifier``'s
docstring has the proof), so it needs no host synchronisation, no normalisation and
no summation order, and the top n of one race are n draws without replacement. On
the CPU, where reading a number back costs nothing, a draw is the inverse CDF with
one float64 uniform: the same law, and cheaper there than a race over the vocabulary
(docs/bench/2026-12-07-notes-from-engine.md). The exponentials are computed from float64
uniforms (E = -log(1 - U)) and rounded to float32: an entry's E is never 0 unless U
is (2^-53), where float32 uniforms would give E = 0, an entry that always wins, to
one entry in 2^24.
The acceptance rule itself lives in ``engine.acceptance``.
"""

from __future__ import annotations

import math

import torch

from engine.acceptance import race_scores

__all__ = [
    "SamplingParams",
    "apply_filters",
    "draw",
    "exponentials",
    "probs_from_logits",
    "race_draw",
    "race_without_replacement",
    "sample",
    "sample_without_replacement",
]


class SamplingParams:
    """Temperature / top-k / top-p, validated. temperature == 0 means greedy."""

    __slots__ = ("temperature", "top_k", "top_p")

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
        temperature = _as_float(temperature, "temperature")
        top_p = _as_float(top_p, "top_p")
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        top_k = _as_int(top_k, "top_k")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def _as_float(value, name: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(value)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, on the last axis.

    logits: [..., V] (any float dtype) -> [..., V] float32 logits with filtered
    entries set to -inf. Applied identically to p and q so that both live on
    the same support before verification. Greedy (temperature 0) returns the
    raw logits as float32: decisions use argmax, the softmax is for display.
    """
    x = logits.float()
    if params.greedy:
        return x
    x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [..., V]
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the
        # mass strictly before it already reaches top_p (the first token is kept).
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after the filters."""
    return torch.softmax(apply_filters(logits, params), dim=-1)


def exponentials(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) draws, float32, one per entry of `like` and on its device (the generator's): -log(1 - U) of
    float64 uniforms U in [0, 1), rounded to float32."""
    u = torch.rand(like.shape, generator=generator, dtype=torch.float64, device=like.device)
    return u.neg_().log1p_().neg_().float()


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Race scores of [..., V] weights with fresh exponentials from `generator`."""
    return race_scores(weights, exponentials(weights, generator))


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from [V] non-negative weights on the CPU: the inverse CDF with one float64 uniform."""
    cdf = torch.cumsum(weights, dim=0, dtype=torch.float64)  # [V]
    return _search_cdf(weights, cdf, cdf[-1].item(), generator)


def _search_cdf(weights: torch.Tensor, cdf: torch.Tensor, total: float, generator: torch.Generator | None) -> int:
    """The inverse CDF's draw, given the [V] float64 running sums of the weights and their total."""
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    return index_at(weights, cdf, total, u)


def index_at(weights: torch.Tensor, cdf: torch.Tensor, total: float, u: float) -> int:
    """The inverse CDF at u in [0, 1): the first index whose running sum (cdf, float64) reaches u · total,
    among the entries with mass."""
    idx = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64)).item())
    # searchsorted lands on a zero-probability entry only at the very start (u = 0: the first entry with
    # mass) or past the end through rounding (the last entry with mass).
    if idx == 0 and weights[0] <= 0:
        return int((weights > 0).nonzero()[0])
    idx = min(idx, weights.shape[0] - 1)
    while weights[idx] <= 0 and idx > 0:
        idx -= 1
    return idx


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from [V] non-negative weights, normalised or not, as an int64 tensor [] on their device: an
    exponential race off the CPU (no host synchronisation), the inverse CDF on it."""
    if weights.device.type == "cpu":
        return torch.tensor(_inverse_cdf(weights, generator))
    return race_draw(weights, generator)


def race_draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of [..., V] non-negative weights by an exponential race, on their device ([...] int64):
    what ``draw`` does off the CPU (tested on the CPU too)."""
    return _race(weights, generator).argmax(dim=-1)


def race_without_replacement(probs: torch.Tensor, n: int, generator: torch.Generator | None) -> list[int]:
    """The top n of one exponential race over [V] probs: n draws without replacement, in draw order (what
    ``sample_without_replacement`` does off the CPU; tested on the CPU too)."""
    score = _race(probs, generator)  # [V]
    top = torch.topk(score, min(n, score.shape[-1]))
    return [int(i) for v, i in zip(top.values.tolist(), top.indices.tolist()) if v >= 0]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [V] distribution, as a Python int (``draw``'s, read back)."""
    if probs.device.type == "cpu":
        return _inverse_cdf(probs, generator)
    return int(race_draw(probs, generator))


def sample_without_replacement(probs: torch.Tensor, n: int, generator: torch.Generator | None) -> list[int]:
    """n distinct tokens from [V] probs, in the order successive draws without replacement give them (each from
    probs renormalised over the tokens not drawn yet, what the tree verifier assumes), at most as many as the
    support holds. On the CPU one draw after the other; elsewhere the top n of one exponential race, whose
    order is distributed exactly so (the race is memoryless)."""
    if probs.device.type == "cpu" and n == 1:
        # A chain's one draw: the inverse CDF on the weights as they are (it scales u by their total), without
        # the copy, the support count and the renormalisation of the loop below, which cost more than the draw
        # itself. Each draw differs from the loop's only where u · total lands within rounding of a CDF step
        # (figures for both: docs/bench/2026-12-07-notes-from-engine.md).
        cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)  # [V]
        total = cdf[-1].item()
        return [_search_cdf(probs, cdf, total, generator)] if total > 0 else []
    if probs.device.type == "cpu":
        remaining = probs.clone()
        out: list[int] = []
        support = int((probs > 0).sum().item())
        for _ in range(min(n, support)):
            idx = _inverse_cdf(remaining / remaining.sum(), generator)
            out.append(idx)
            remaining[idx] = 0.0
        return out
    return race_without_replacement(probs, n, generator)
