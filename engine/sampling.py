"""Sampling and verification as small pure tensor functions.

Notation used everywhere in SpecLens: ``p`` is the target model's distribution,
``q`` the drafter's. Every function here is deterministic given its inputs (the
random draws ``u`` are passed in or drawn from an explicit ``torch.Generator``),
so the decode loop, the tests and the labs can replay a decision exactly.

The exactness argument (Leviathan et al. 2023; Chen et al. 2023) in two lines:
a draft x ~ q is kept with probability min(1, p(x)/q(x)), so
P(keep x) = min(q(x), p(x)); on rejection we draw from the residual
r = norm(max(0, p - q)), and P(reject) = 1 - sum_x min(p, q) = sum_x max(0, p - q).
Hence P(emit x) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "SamplingParams",
    "apply_filters",
    "probs_from_logits",
    "residual",
    "sample",
    "sample_without_replacement",
    "verify_chain",
    "verify_children",
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


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) on the last axis.

    p, q: [..., V] float32. If p <= q everywhere (only possible when p == q, in
    which case a rejection has probability zero) the residual is undefined; we
    return p so that callers never divide by zero.
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [V] distribution (inverse CDF with one uniform)."""
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cdf = torch.cumsum(probs.double(), dim=0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=torch.float64)).item())
    # searchsorted can land on a zero-probability entry only at the very end due
    # to rounding; step back to the last token with positive mass.
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] <= 0 and idx > 0:
        idx -= 1
    return idx


def sample_without_replacement(probs: torch.Tensor, n: int, generator: torch.Generator | None) -> list[int]:
    """n distinct tokens drawn one after the other from [V] probs, each from q
    renormalised over the tokens not drawn yet (what the tree verifier assumes)."""
    remaining = probs.clone()
    out: list[int] = []
    support = int((probs > 0).sum().item())
    for _ in range(min(n, support)):
        idx = sample(remaining / remaining.sum(), generator)
        out.append(idx)
        remaining[idx] = 0.0
    return out


def verify_chain(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_ids: torch.Tensor,
    u: torch.Tensor,
    greedy: bool,
) -> tuple[int, torch.Tensor | None]:
    """Exact verification of one chain of drafts (vLLM's vocabulary).

    p:         [K+1, V] target probabilities at the K draft positions plus the bonus position
    q:         [K, V]   drafter probabilities the drafts were sampled from
                        (a one-hot row for a drafter without a distribution, e.g. n-gram)
    draft_ids: [K]      drafted token ids
    u:         [K]      uniforms in [0, 1), one per draft
    Returns (num_accepted, dist) where dist [V] is the distribution of the extra
    token: the residual norm(max(0, p_i - q_i)) at the first rejection i, or p_K
    (the bonus) when all K drafts were accepted. Greedy: accept while the draft
    equals argmax p, and dist is then a one-hot of argmax p at the stop.
    """
    k = draft_ids.shape[0]
    if greedy:
        target_argmax = p.argmax(dim=-1)  # [K+1]
        matches = (target_argmax[:k] == draft_ids).int()
        num_accepted = int(torch.cumprod(matches, dim=0).sum().item()) if k else 0
        dist = torch.zeros_like(p[num_accepted])
        dist[target_argmax[num_accepted]] = 1.0
        return num_accepted, dist
    idx = torch.arange(k)
    p_draft = p[idx, draft_ids]  # [K]
    q_draft = q[idx, draft_ids]  # [K]
    accept_prob = torch.clamp(p_draft / q_draft.clamp_min(1e-30), max=1.0)  # [K]
    rejected = u >= accept_prob  # [K]
    if not bool(rejected.any()):
        return k, p[k]
    first = int(rejected.int().argmax().item())
    return first, residual(p[first], q[first])


def verify_children(
    p: torch.Tensor,
    q: torch.Tensor,
    child_ids: list[int],
    u: list[float],
    greedy: bool,
    point_mass: bool = False,
    drop_q: bool = False,
) -> tuple[int | None, torch.Tensor, list[dict]]:
    """Multi-candidate verification at one tree node (recursive rejection sampling).

    p:         [V] target probabilities at the node
    q:         [V] drafter distribution the children were drawn from, *without
               replacement* and in the given order (ignored when point_mass)
    child_ids: the children, in the order they were drawn
    u:         one uniform per child
    point_mass: the children are deterministic proposals (n-gram): child j is
               its own point mass q_j = onehot(c_j), so it is kept with
               probability p_j(c_j) and a rejection removes c_j from p_j.
    drop_q:    NEGATIVE CONTROL ONLY (the labs and tests use it to show what a
               lossy shortcut looks like): accept with min(1, p(c)) and resample
               from p itself, ignoring q. The output is then NOT distributed as p.
    Returns (index of the accepted child or None, the distribution left after all
    rejections, one record per child tried with the numbers used).

    Child j is tried against p_j and q_j, where q_j is q with the earlier siblings
    removed and renormalised (the law of the j-th draw given the first j-1), and
    p_j = norm(max(0, p_{j-1} - q_{j-1})) is the residual after the rejections so
    far. Each round is an ordinary speculative-sampling step, whose output law is
    exactly p_j (see the module docstring); by induction the node emits exactly p.
    Greedy: accept the child equal to argmax p, if any.
    """
    records: list[dict] = []
    if greedy:
        best = int(p.argmax().item())
        for j, c in enumerate(child_ids):
            ok = c == best
            q_c = 1.0 if point_mass else float(q[c])
            records.append({"p_eff": float(p[c]), "q_eff": q_c, "accept_prob": 1.0 if ok else 0.0, "u": None})
            if ok:
                return j, p, records
        dist = torch.zeros_like(p)
        dist[best] = 1.0
        return None, dist, records
    p_j = p
    q_j = q
    for j, c in enumerate(child_ids):
        if point_mass:
            q_j = torch.zeros_like(p)
            q_j[c] = 1.0
        q_mass = float(q_j[c])
        if drop_q:
            accept_prob = min(1.0, float(p_j[c]))
        else:
            accept_prob = min(1.0, float(p_j[c]) / q_mass) if q_mass > 0 else 0.0
        records.append({"p_eff": float(p_j[c]), "q_eff": q_mass, "accept_prob": accept_prob, "u": float(u[j])})
        if u[j] < accept_prob:
            return j, p_j, records
        if drop_q:
            continue
        p_j = residual(p_j, q_j)
        if point_mass:
            continue
        q_next = q_j.clone()
        q_next[c] = 0.0
        total = float(q_next.sum())
        q_j = q_next / total if total > 0 else q_next
    return None, p_j, records
