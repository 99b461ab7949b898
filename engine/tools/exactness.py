"""Checking exactness by sampling: the statistics and the toy sampler behind the app's labs.

Speculative sampling claims that every emitted token is distributed exactly as the target's p
(p is the target, q the drafter; the argument is in ``engine.acceptance``). The labs test that
claim empirically, and this module holds the parts that are mathematics rather than display:

* ``toy_sampling``: exact speculative sampling of one token from a small hand-made p and q,
  n times, with the engine's own acceptance rule (``verify_children``), split into accepted
  drafts and tokens resampled from the residual.
* ``overlap``: Σ min(p, q), the probability that a single draft x ~ q is accepted.
* ``as_distribution``: a [V] probability tensor as {token: probability} over its support.
* ``pair_distribution``: the exact joint law of the first two tokens, p(x1, x2) = p(x1) p(x2 | x1);
  ``first_tokens_law``: the law of the first token or pair for a real target and prompt.
* ``chi_square_test``: goodness of fit of sampled counts against an exact p, with the total
  variation distance; ``chi_square_sf`` its p-value; ``TEST_LEVEL`` is the one significance level the
  labs use.
* ``tv_interval``: the spread of a measured total-variation distance from p (a bias-shifted bootstrap);
  ``tv_noise_floor``: the distance an exact sampler of n samples stays below (simulated from p).
* ``exactness_verdict``: what a test's p-value says about a sampler, in words (the Lossless lab shows it).
* ``verify_children_ignoring_q``: the NEGATIVE CONTROL, a deliberately lossy verifier that the
  Lossless lab and the tests pass to the tree walk in place of ``acceptance.verify_children``.
"""

from __future__ import annotations

import math

import torch

from engine.acceptance import verify_children
from engine.sampling import sample

__all__ = [
    "MIN_EXPECTED",
    "TEST_LEVEL",
    "as_distribution",
    "chi_square_test",
    "exactness_verdict",
    "overlap",
    "pair_distribution",
    "toy_sampling",
    "tv_interval",
    "tv_noise_floor",
    "verify_children_ignoring_q",
]

# Below this p-value a histogram is called different from p. 1e-3 keeps false alarms of the
# exact samplers to one run in a thousand while the lossy shortcut still shows at a few hundred samples.
TEST_LEVEL = 1e-3
# The chi-square approximation needs about this many expected samples per cell; smaller cells are pooled.
MIN_EXPECTED = 5


def overlap(p: list[float], q: list[float]) -> float:
    """Σ min(p, q): the acceptance probability of one draft x ~ q under the exact rule."""
    return sum(min(a, b) for a, b in zip(p, q))


def toy_sampling(p: list[float], q: list[float], n: int = 1000, seed: int = 0) -> dict:
    """Exact speculative sampling of one token, n times, with the engine's acceptance rule.

    Returns {"accepted": [count per token], "resampled": [count per token], "n": n}: draw x ~ q, verify it
    with `verify_children` (accept with min(1, p/q)), and on rejection draw from the distribution it returns
    (the residual norm(max(0, p − q))).
    """
    pt = torch.tensor(p, dtype=torch.float32)
    qt = torch.tensor(q, dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(seed))
    accepted = [0] * len(p)
    resampled = [0] * len(p)
    for _ in range(int(n)):
        x = sample(qt, gen)
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        chosen, dist, _ = verify_children(pt, qt, [x], [u], greedy=False)
        if chosen is not None:
            accepted[x] += 1
        else:
            resampled[sample(dist, gen)] += 1
    return {"accepted": accepted, "resampled": resampled, "n": int(n)}


def as_distribution(probs: torch.Tensor) -> dict[int, float]:
    """A [V] probability tensor as {token id: probability} over the tokens with p > 0, renormalised
    (the float32 softmax sums to 1 only up to rounding; the test compares against exact proportions)."""
    support = [int(t) for t in (probs > 0).nonzero().flatten().tolist()]
    p = {t: float(probs[t]) for t in support}
    total = sum(p.values())
    return {t: v / total for t, v in p.items()}


def pair_distribution(first: dict[int, float], second_given) -> dict[tuple[int, int], float]:
    """The exact law of the first two tokens: p(x1, x2) = p(x1) · p(x2 | x1).

    first: {x1: p(x1)}; second_given(x1) -> {x2: p(x2 | x1)} (the target's p after the prompt plus x1,
    one forward pass each). Testing pairs checks what a first-token test cannot: that the token after
    an accepted (or resampled) first token is also distributed as the target's, i.e. that the KV caches
    and the second draft position are handled exactly.
    """
    return {(x1, x2): p1 * p2 for x1, p1 in first.items() for x2, p2 in second_given(x1).items()}


def first_tokens_law(engine, prompt: str | list[int], tokens: int = 2, **filters) -> dict:
    """The target's exact law of the first token (tokens = 1: {x1: p}) or the first two (tokens = 2:
    {(x1, x2): p}) after `prompt` under the sampling settings (temperature, top_k, top_p, seed): its p after
    the prompt, and for pairs ``pair_distribution`` with its p after the prompt plus each x1 (one forward pass
    each). What the Lossless and Shortcuts labs, ``selfcheck`` and the tour notebook test samples against."""
    from engine.tools.samples import next_token_distribution

    if tokens not in (1, 2):
        raise ValueError(f"tokens must be 1 or 2, got {tokens!r}")

    def after(prefix: list[int]) -> dict[int, float]:
        return as_distribution(next_token_distribution(engine, prompt, prefix, **filters))

    first = after([])
    return first if tokens == 1 else pair_distribution(first, lambda x1: after([x1]))


def _pooled_cells(counts: dict[int, int], p: dict[int, float], n: int) -> list[list[float]]:
    """[expected, observed] per cell, cells with fewer than MIN_EXPECTED expected samples pooled
    (the smallest together; a pooled cell still under MIN_EXPECTED joins the smallest big cell)."""
    cells = sorted(((pt * n, counts.get(t, 0)) for t, pt in p.items()), reverse=True)
    big = [[e, o] for e, o in cells if e >= MIN_EXPECTED]
    small = [(e, o) for e, o in cells if e < MIN_EXPECTED]
    if small:
        pooled = [sum(e for e, _ in small), sum(o for _, o in small)]
        if pooled[0] >= MIN_EXPECTED or not big:
            big.append(pooled)
        else:
            big[-1][0] += pooled[0]
            big[-1][1] += pooled[1]
    return big


def chi_square_test(counts: dict[int, int], p: dict[int, float], n: int) -> dict:
    """Chi-square goodness of fit of `counts` (token -> count, n in total) against `p` (token -> prob > 0).

    Small cells are pooled (``_pooled_cells``). Samples outside the support of p make the p-value 0.
    Returns statistic, df, pvalue (None when fewer than two cells remain), tv (total variation
    distance), outside (samples off support) and cells (how many were tested).
    """
    outside = sum(c for t, c in counts.items() if t not in p)
    tv = 0.5 * (sum(abs(counts.get(t, 0) / n - pt) for t, pt in p.items()) + outside / n)
    cells = _pooled_cells(counts, p, n)
    result = {"tv": tv, "outside": outside, "cells": len(cells), "df": max(0, len(cells) - 1)}
    if outside:
        return {**result, "statistic": math.inf, "pvalue": 0.0}
    if len(cells) < 2:
        return {**result, "statistic": None, "pvalue": None}
    expected = torch.tensor([e for e, _ in cells], dtype=torch.float64)  # [cells]
    observed = torch.tensor([o for _, o in cells], dtype=torch.float64)  # [cells]
    expected = expected * (observed.sum() / expected.sum())  # equal totals up to float rounding
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return {**result, "statistic": statistic, "pvalue": chi_square_sf(statistic, len(cells) - 1)}


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square with df degrees of freedom: the regularised upper incomplete
    gamma function Q(df / 2, statistic / 2), in float64 with torch (no scipy at run time)."""
    half_df = torch.tensor(df / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(half_df, torch.tensor(statistic / 2.0, dtype=torch.float64)))


def _tv_draws(law: torch.Tensor, target: torch.Tensor, n: int, draws: int, seed: int) -> torch.Tensor:
    """[draws] total-variation distances from `target` [C] of `draws` histograms of n samples of `law` [C]."""
    gen = torch.Generator().manual_seed(int(seed))
    picked = torch.multinomial(law, n * draws, replacement=True, generator=gen)  # [draws * n]
    hist = torch.zeros(draws, law.shape[0], dtype=torch.float64)  # [draws, C]
    hist.scatter_add_(1, picked.view(draws, n), torch.ones(draws, n, dtype=torch.float64))
    return 0.5 * (hist / n - target).abs().sum(dim=1)


def tv_interval(
    counts: dict, p: dict, n: int, level: float = 0.95, draws: int = 400, seed: int = 0
) -> tuple[float, float]:
    """The spread of the measured total-variation distance from p: `draws` histograms of n samples redrawn from
    the observed one (a bootstrap), the TV of each from p, and the central `level` of them, shifted by the
    redraws' bias (their median minus the observed TV: redrawing adds noise of its own, so the raw percentiles sit
    above the observed TV) and clipped at 0. The interval is centred on the measured TV by construction."""
    keys = sorted(set(p) | set(counts), key=str)
    observed = torch.tensor([float(counts.get(t, 0)) for t in keys], dtype=torch.float64)  # [C]
    target = torch.tensor([float(p.get(t, 0.0)) for t in keys], dtype=torch.float64)  # [C]
    if n <= 0 or observed.sum() <= 0:
        return (math.nan, math.nan)
    tv = float(0.5 * (observed / observed.sum() - target).abs().sum())
    redrawn = _tv_draws(observed / observed.sum(), target, n, draws, seed)  # [draws]
    low, mid, high = torch.quantile(
        redrawn, torch.tensor([(1 - level) / 2, 0.5, (1 + level) / 2], dtype=torch.float64)
    ).tolist()
    bias = mid - tv
    return (max(0.0, low - bias), max(0.0, high - bias))


def tv_noise_floor(p: dict, n: int, level: float = 0.95, draws: int = 400, seed: int = 0) -> float:
    """The TV an exact sampler shows by noise alone: the `level` quantile of the TV from p of `draws` histograms of
    n samples drawn from p itself. A rule whose measured TV is well above it costs more than noise."""
    keys = sorted(p, key=str)
    target = torch.tensor([float(p[t]) for t in keys], dtype=torch.float64)  # [C]
    if n <= 0 or not keys:
        return math.nan
    return float(torch.quantile(_tv_draws(target / target.sum(), target, n, draws, seed), level))


def exactness_verdict(test: dict | None, lossy: bool = False) -> str:
    """The verdict on a sampler from its ``chi_square_test`` result (None: not run), at ``TEST_LEVEL``:
    p-value at or above it, consistent with p; below it, different from p; no p-value, nothing to test.
    lossy: the sampler is the negative control (``verify_children_ignoring_q``), whose difference is the
    expected finding and whose consistency only means this N is too small to see its error."""
    if test is None:
        return "not run"
    if test["pvalue"] is None:
        return "nothing to test: p puts (almost) all its mass on one token"
    if test["pvalue"] >= TEST_LEVEL:
        return "not detected at this N: its error is small here, raise N" if lossy else "consistent with p"
    if lossy:
        return "differs from p: the shortcut is lossy"
    return "differs from p (unexpected: rerun with another seed; about 1 run in 1000 fails by chance)"


def verify_children_ignoring_q(
    p: torch.Tensor, q: torch.Tensor, child_ids: list[int], u: list[float], greedy: bool, point_mass: bool = False
) -> tuple[int | None, torch.Tensor, list[dict]]:
    """NEGATIVE CONTROL ONLY: the shortcut of accepting a drafted token with min(1, p(c)) and
    drawing the extra token from p itself, ignoring q. Same arguments and result as
    ``acceptance.verify_children``, so the tree walk takes either (``walk_tree(verify_node=...)``).

    Tokens the drafter favours are proposed often and accepted as often as p allows, and a
    rejection falls back to p, not to the residual: the output is NOT distributed as p (the
    chi-square tests of the Lossless lab and the test suite see it in a few hundred samples).
    Greedy verification ignores q anyway, so it is the exact rule's."""
    if greedy:
        return verify_children(p, q, child_ids, u, greedy, point_mass)
    records: list[dict] = []
    for j, c in enumerate(child_ids):
        p_c = float(p[c])
        q_c = 1.0 if point_mass else float(q[c])
        accept_prob = min(1.0, p_c)
        records.append({"p_eff": p_c, "q_eff": q_c, "accept_prob": accept_prob, "u": float(u[j]), "adjusted": False})
        if u[j] < accept_prob:
            return j, p, records
    return None, p, records
