"""Block verification (engine/acceptance.py ``block_verify_chain``, engine/verification.py ``verify_chain_block``).

(a) With one draft it is the token rule. (b) The joint law of the first three emitted tokens is the target's,
by chi-square over every sequence, for drafts with q and point masses, on a tiny model whose p and q depend on
the prefix; two plausible mistakes are negative controls the same statistic must flag. (c) On the same drafts
it keeps at least as many tokens per pass as the token rule. (d) In the engine: the step records the rule and
every number its decision was made from, so the kept prefix is recomputable from the trace.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from engine.acceptance import block_verify_chain, verify_chain
from engine.sampling import draw

V = 4
K = 3
N = 12000


def _table(seed: int, sharp: float):
    """prefix (tuple) -> [V] distribution, deterministic in the prefix."""

    def dist(prefix: tuple) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1000 + hash(prefix) % 997)
        return torch.softmax(sharp * torch.randn(V, generator=gen, dtype=torch.float64), -1).float()

    return dist


P = _table(1, 1.0)
Q = _table(2, 3.0)  # a drafter far from the target: the controls' mistakes show


def _step(gen, point_mass: bool, mistake: str | None = None) -> list[int]:
    """One block-verified pass from the empty prefix; the emitted tokens."""
    drafts: list[int] = []
    q_rows = []
    for _ in range(K):
        q = Q(tuple(drafts))
        if point_mass:  # a deterministic proposal: the drafter's mode (q is then its point mass)
            x = int(q.argmax())
            q = torch.nn.functional.one_hot(torch.tensor(x), V).float()
        else:
            x = int(draw(q, gen))
        q_rows.append(q)
        drafts.append(x)
    p = torch.stack([P(tuple(drafts[:i])) for i in range(K + 1)])  # [K+1, V]
    q = torch.stack(q_rows)  # [K, V]
    ids = torch.tensor(drafts)
    u = torch.rand(K, generator=gen, dtype=torch.float64)
    tau, h, joint, dist, _ = block_verify_chain(p, q, ids, u)
    tau = int(tau)
    if mistake == "token_residual" and tau < K:  # the token rule's residual instead of the weighted one
        dist = torch.clamp(p[tau] - q[tau], min=0.0)
        if float(dist.sum()) == 0:
            dist = p[tau]
    if mistake == "joint_test":  # test each prefix by its joint ratio alone (h_i = p_i)
        passed = u < joint.double()
        tau = max([i + 1 for i in range(K) if passed[i]], default=0)
        dist = p[K] if tau == K else torch.clamp(p[tau] - q[tau], min=0.0)
    return drafts[:tau] + [int(draw(dist, gen))]


def _first_three(emitted: list[int], gen) -> tuple[int, ...]:
    """Complete a pass's tokens to three with the target itself (exact continuation)."""
    out = list(emitted[:3])
    while len(out) < 3:
        out.append(int(draw(P(tuple(out)), gen)))
    return tuple(out)


def _p_value(point_mass: bool, mistake: str | None, seed: int, n: int = N) -> float:
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple, int] = {}
    for _ in range(n):
        key = _first_three(_step(gen, point_mass, mistake), gen)
        counts[key] = counts.get(key, 0) + 1
    cells = list(itertools.product(range(V), repeat=3))
    expected = []
    for a, b, c in cells:
        expected.append(float(P(())[a]) * float(P((a,))[b]) * float(P((a, b))[c]))
    total = sum(expected)
    observed = [counts.get(cell, 0) for cell in cells]
    return float(chisquare(observed, [e / total * n for e in expected]).pvalue)


def test_one_draft_is_the_token_rule():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        p = torch.softmax(torch.randn(2, 7, generator=gen), -1)
        q = torch.softmax(torch.randn(1, 7, generator=gen), -1)
        x = torch.tensor([int(draw(q[0], gen))])
        u = torch.rand(1, generator=gen, dtype=torch.float64)
        tau, h, _, dist, _ = block_verify_chain(p, q, x, u)
        assert float(h[0]) == pytest.approx(min(1.0, float(p[0, x]) / float(q[0, x])), rel=1e-6)
        n, token_dist = verify_chain(p, q, x, u.float(), greedy=False)
        assert int(tau) == n
        torch.testing.assert_close(dist / dist.sum(), token_dist, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("point_mass", [False, True], ids=["q", "point_mass"])
def test_block_verification_emits_the_targets_joint_law(point_mass):
    assert _p_value(point_mass, None, seed=3) > 1e-3


@pytest.mark.parametrize("mistake", ["token_residual", "joint_test"])
def test_negative_controls_are_flagged(mistake):
    assert _p_value(False, mistake, seed=4) < 1e-6


def test_block_keeps_at_least_the_token_rules_tokens_on_the_same_drafts():
    # E[tau] of both rules on the same draws of drafts (the paper's Theorem 2: block >= token), 20000 passes.
    gen = torch.Generator().manual_seed(9)
    block, token = [], []
    for _ in range(20000):
        drafts, q_rows = [], []
        for _ in range(K):
            q = Q(tuple(drafts))
            drafts.append(int(draw(q, gen)))
            q_rows.append(q)
        p = torch.stack([P(tuple(drafts[:i])) for i in range(K + 1)])
        q, ids = torch.stack(q_rows), torch.tensor(drafts)
        block.append(int(block_verify_chain(p, q, ids, torch.rand(K, generator=gen, dtype=torch.float64))[0]))
        token.append(verify_chain(p, q, ids, torch.rand(K, generator=gen), greedy=False)[0])
    mean_b, mean_t = sum(block) / len(block), sum(token) / len(token)
    se = (torch.tensor(block, dtype=torch.float64).var().item() / len(block)) ** 0.5 * 2**0.5
    assert mean_b >= mean_t - 3 * se, (mean_b, mean_t, se)
    assert mean_b > mean_t  # here strictly more (by ~0.1 tokens per pass)


@pytest.mark.parametrize("drafter", ["int8", "ngram"])
def test_a_block_run_records_the_rule_and_what_decided_each_pass(tiny_engine, drafter):
    run = tiny_engine.run(
        "a b c d a b c d a b", drafter, max_new_tokens=24, k=3, temperature=1.0, seed=2, chat=False, verify="block"
    )
    steps = [e for e in run["events"] if e["type"] == "step"]
    assert run["events"][0]["settings"]["verify"] == "block"
    for step in steps:
        nodes = step["nodes"]
        if not nodes:
            continue
        assert step["verify"] == "block"
        assert all("joint" in node and node["u"] is not None for node in nodes)  # every prefix was tested
        passing = [n["id"] + 1 for n in nodes if n["prefix_passed"]]
        assert all(n["prefix_passed"] == (n["u"] < n["accept_prob"]) for n in nodes)  # (away from rounding ties)
        assert step["accepted_len"] == max(passing, default=0)  # the longest passing prefix, from the trace alone
        assert [n["decision"] for n in nodes].count("accepted") == step["accepted_len"]
    greedy = tiny_engine.run("a b c d", drafter, max_new_tokens=8, k=3, verify="block", chat=False)
    assert {s["verify"] for s in greedy["events"] if s["type"] == "step"} == {"token"}  # greedy: the token rule
    with pytest.raises(ValueError, match="verify must be token or block"):
        tiny_engine.run("a", drafter, verify="blocky")


def test_the_step_through_narrates_a_block_pass(tiny_engine):
    from app.narration import narrate_step

    run = tiny_engine.run(
        "a b c d a b c d a b", "int8", max_new_tokens=12, k=3, temperature=1.0, seed=2, chat=False, verify="block"
    )
    text = narrate_step(run["events"], 0)
    assert "Block verification" in text and "longest" in text and "h = " in text and "joint ratio" in text
    token = tiny_engine.run("a b c d a b c d a b", "int8", max_new_tokens=12, k=3, temperature=1.0, seed=2, chat=False)
    assert "Block verification" not in narrate_step(token["events"], 0)
