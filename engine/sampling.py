"""Sampling as small pure tensor functions: the filters that turn logits into p and q, and draws.

Temperature / top-k / top-p are applied identically to the target's logits (p)
and the drafter's (q), so both live on the same support before verification.
Draws take an explicit ``torch.Generator`` so that a run replays exactly, on the
device the distribution lives on (a run's generator is made on its model's device),
and are exponential races: the winner of argmax(w / E) with E ~ Exp(1) per entry
is drawn from w / sum(w) (``engine.kernels.batched_verifier``'s docstring has the
proof), so a draw needs no host synchronisation, no normalisation and no
summation order, and the top n of the same race are n draws without replacement.
The acceptance rule itself lives in ``engine.acceptance``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "SamplingParams",
    "apply_filters",
    "draw",
    "exponentials",
    "probs_from_logits",
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
    """Exp(1) draws, float32, one per entry of `like` and on its device (the generator's)."""
    return torch.empty(like.shape, dtype=torch.float32, device=like.device).exponential_(generator=generator)


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[..., V] weights >= 0 -> [..., V] race scores: w / E where w > 0, else -1 (never wins)."""
    w = weights.float()
    return torch.where(w > 0, w / exponentials(w, generator), -1.0)


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from [V] (or per row of [..., V]) non-negative weights, normalised or not: an exponential
    race on their device, returned there as int64 ([] or [...]); no host synchronisation."""
    return _race(weights, generator).argmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [V] distribution (``draw``), as a Python int."""
    return int(draw(probs, generator))


def sample_without_replacement(probs: torch.Tensor, n: int, generator: torch.Generator | None) -> list[int]:
    """n distinct tokens from [V] probs, in the order successive draws without replacement would give them
    (each from probs renormalised over the tokens not drawn yet, what the tree verifier assumes): the top n of
    one exponential race, whose order is distributed exactly so (the race is memoryless). At most as many as
    the support holds."""
    score = _race(probs, generator)  # [V]
    top = torch.topk(score, min(n, score.shape[-1]))
    return [int(i) for v, i in zip(top.values.tolist(), top.indices.tolist()) if v >= 0]
