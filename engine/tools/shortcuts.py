"""Verification shortcuts next to the exact rules: what each buys (tokens per target pass) and what it costs
(its distance from the target's p), measured on real samples.

Serving stacks and papers relax the acceptance rule to keep more drafts. Each relaxation is a test of one
tree node's children with the signature of ``acceptance.verify_children`` (``walk_tree(verify_node=...)``
takes any of them), so the same real drafts and target passes run under every rule; the Shortcuts lab
(app/labs/shortcuts.py) and tests/test_shortcuts.py sample the first tokens of a prompt with each and test
the histograms against p (``engine.tools.exactness.chi_square_test``).

Glossary (p the target's distribution at a node, q the drafter's, c a drafted child, u its uniform):

=================  ==================================================================  =========
rule               keeps c when u < ...                     a rejection draws from    exact?
=================  ==================================================================  =========
exact              min(1, p(c)/q(c))                        norm(max(0, p − q))        yes
block              a prefix's joint test (acceptance.block_verify_chain)               yes
q_dropped          min(1, p(c))                             p                          no
untempered_q       min(1, p(c)/q₁(c)), q₁ = norm(q^T)       norm(max(0, p − q₁))       no (T ≠ 1)
ensemble (w)       min(1, 1 − w + w·p(c)/q(c))              norm(max(0, p − q))        no (w < 1)
threshold (t)      min(1, p(c)/(t·q(c)))                    norm(max(0, p − q))        no (t < 1)
greedy_match       1 if c = argmax p, else 0                p                          no (T > 0)
=================  ==================================================================  =========

What each outputs, for one draft x ~ q (the argument of ``engine.acceptance`` with another keep rule):

* ``ensemble``: exact speculative sampling of v = w·p + (1 − w)·q, since v/q = 1 − w + w·p/q and
  max(0, v − q) = w·max(0, p − q). The output is v, at total variation (1 − w)·TV(p, q) from p: a small
  bias where q is close to p, at most 1 − w anywhere (transformers' ``assistant_ensemble_weight``, a proposed
  pull request, from Wang, Kasa et al., AISTATS 2026).
* ``threshold``: keeps min(q, p/t) of each token, more than p where q > p: tokens the drafter over-proposes are
  emitted too often (SGLang's ``--speculative-accept-threshold-acc``; its drafts are point masses, q = 1).
* ``untempered_q``: drafts are drawn at the run's temperature T but tested as if drawn at T = 1 (q₁ has q's
  support: the drafter's logits without the temperature, after the same top-k): the q term is the wrong one.
* ``q_dropped``: the q term left out (``exactness.verify_children_ignoring_q``, the Lossless lab's control).
* ``greedy_match``: the greedy test (keep only the target's argmax) at T > 0, the extra token sampled from p:
  the argmax is emitted too often whenever the drafter proposes it.

Under greedy decoding (T = 0) every rule here is the exact greedy rule (``verify_children``'s own branch).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.acceptance import Q_FLOOR, verify_children
from engine.tools.exactness import chi_square_test, exactness_verdict, verify_children_ignoring_q
from engine.tools.samples import sample_next_tokens

__all__ = [
    "DEFAULT_THRESHOLD",
    "DEFAULT_WEIGHT",
    "ROWS",
    "RULES",
    "Rule",
    "greedy_match",
    "row_id",
    "rule_verdict",
    "run_rule",
    "static_ensemble",
    "threshold_rule",
    "tokens_gain",
    "untempered_q",
]

DEFAULT_WEIGHT = 0.5  # the static ensemble's w: v = w·p + (1 − w)·q
DEFAULT_THRESHOLD = 0.5  # the accept threshold t


def static_ensemble(weight: float) -> Callable:
    """The static ensemble's test with weight w in (0, 1]: keep with min(1, 1 − w + w·p/q) (w = 1: the exact
    rule). Its output law is v = w·p + (1 − w)·q (module docstring)."""
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"the ensemble weight w must be in (0, 1], got {weight!r}")

    return functools.partial(verify_children, keep=lambda p_c, q_c: 1.0 - weight + weight * p_c / q_c)


def threshold_rule(threshold: float) -> Callable:
    """An accept threshold t in (0, 1]: keep with min(1, p/(t·q)) (t = 1: the exact rule)."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"the accept threshold t must be in (0, 1], got {threshold!r}")

    return functools.partial(verify_children, keep=lambda p_c, q_c: p_c / (threshold * q_c))


def untempered_q(temperature: float) -> Callable:
    """The drafter's temperature left out of the test: drafts drawn from q (at temperature T), tested with
    q₁ = norm(q^T) on q's support, the drafter's distribution at T = 1 after the same filters.

    (q ∝ exp(l / T) on its support, so q^T ∝ exp(l): the untempered logits l, renormalised.) Point-mass drafts
    carry no temperature: for them this is the exact rule."""
    if not temperature > 0:
        raise ValueError(f"the untempered-q shortcut needs a temperature above 0, got {temperature!r}")

    def verify(p, q, child_ids, u, greedy, point_mass=False):
        if greedy or point_mass:
            return verify_children(p, q, child_ids, u, greedy, point_mass)
        q1 = torch.where(q > 0, q.double().clamp_min(Q_FLOOR).pow(temperature), 0.0)  # [V]
        return verify_children(p, (q1 / q1.sum()).float(), child_ids, u, greedy, point_mass)

    return verify


def greedy_match(
    p: torch.Tensor, q: torch.Tensor, child_ids: list[int], u: list[float], greedy: bool, point_mass: bool = False
) -> tuple[int | None, torch.Tensor, list[dict]]:
    """The greedy test at T > 0: a child is kept iff it is the target's argmax; after the rejections the extra
    token is drawn from p. (Under greedy decoding this is the exact greedy rule.)"""
    if greedy:
        return verify_children(p, q, child_ids, u, greedy, point_mass)
    best = int(p.argmax())
    records: list[dict] = []
    for j, c in enumerate(child_ids):
        keep = float(c == best)
        q_c = 1.0 if point_mass else float(q[c])
        records.append({"p_eff": float(p[c]), "q_eff": q_c, "accept_prob": keep, "u": float(u[j]), "adjusted": False})
        if keep:
            return j, p, records
    return None, p, records


@dataclass(frozen=True)
class Rule:
    """One row of the Shortcuts lab.

    key:     the rule's name in code, events and the lab (RULES' key)
    name:    its name on screen
    exact:   whether the rule is lossless (its output law is p): a difference from p is then unexpected
    where:   where a user meets it, in one line
    make:    (temperature, weight, threshold) -> the verify_node for ``walk_tree`` (None: the decode loop's
             own exact verifier)
    verify:  the decode loop's rule for a chain ("token" or "block")
    chain:   the rule verifies one draft sequence (K drafts, tree top-k 1)
    """

    key: str
    name: str
    exact: bool
    where: str
    make: Callable[[float, float, float], Callable | None]
    verify: str = "token"
    chain: bool = False


RULES: dict[str, Rule] = {
    r.key: r
    for r in (
        Rule(
            "exact",
            "Exact rule: min(1, p/q), residual",
            True,
            "Every lossless stack: vLLM, SGLang, llama.cpp, transformers, this engine.",
            lambda t, w, th: None,
        ),
        Rule(
            "block",
            "Block verification (a chain's prefix by its joint ratio)",
            True,
            'vLLM\'s rejection_sample_method "block" (Sun et al., ICLR 2025); --verify block here.',
            lambda t, w, th: None,
            verify="block",
            chain=True,
        ),
        Rule(
            "q_dropped",
            "q dropped: keep with min(1, p)",
            False,
            "Hand-written verifiers; stacks that treat a sampled draft as a point mass.",
            lambda t, w, th: verify_children_ignoring_q,
        ),
        Rule(
            "untempered_q",
            "Drafter's temperature dropped: q at T = 1 in the test",
            False,
            "Temperature applied to the target's logits but not to the draft probabilities kept for the test.",
            lambda t, w, th: untempered_q(t),
        ),
        Rule(
            "ensemble",
            "Static ensemble: keep with min(1, 1 − w + w·p/q)",
            False,
            "transformers' proposed assistant_ensemble_weight (DIVERSED, AISTATS 2026): outputs w·p + (1 − w)·q.",
            lambda t, w, th: static_ensemble(w),
        ),
        Rule(
            "threshold",
            "Accept threshold t < 1: keep with min(1, p/(t·q))",
            False,
            "SGLang's --speculative-accept-threshold-acc below its default 1.0.",
            lambda t, w, th: threshold_rule(th),
        ),
        Rule(
            "greedy_match",
            "Greedy matching at T > 0: keep only the target's argmax",
            False,
            "Verifiers that compare drafts with argmax p whatever the temperature.",
            lambda t, w, th: greedy_match,
        ),
    )
}


# The Shortcuts lab's rows: (rule, drafter), each shortcut with the drafter where it shows. The q-term shortcuts
# (q_dropped, untempered_q) and greedy matching change what happens to drafts q proposes often, so they show with
# int8, whose q is close to p; the ensemble and the threshold change only what happens where q and p differ, so
# they show with eagle, whose q is far from p (with int8 their bias is (1 − w)·TV(p, q), a few hundredths). Each
# drafter's rows include the exact rule, the reference for what a shortcut buys.
ROWS: tuple[tuple[str, str], ...] = (
    ("exact", "int8"),
    ("block", "int8"),
    ("q_dropped", "int8"),
    ("untempered_q", "int8"),
    ("greedy_match", "int8"),
    ("exact", "eagle"),
    ("ensemble", "eagle"),
    ("threshold", "eagle"),
)


def row_id(key: str, drafter: str) -> str:
    """A row's one name, in the lab's choices and results: "rule@drafter"."""
    return f"{key}@{drafter}"


def tokens_gain(results: dict, key: str, drafter: str) -> float | None:
    """What a rule buys: its tokens per pass over the exact rule's with the same drafter, minus 1 (None for the
    exact rule itself, or when either row did not run). results: row_id -> ``run_rule``'s result."""
    row, exact = results.get(row_id(key, drafter)), results.get(row_id("exact", drafter))
    if key == "exact" or row is None or exact is None or not exact["tokens_per_pass"]:
        return None
    return row["tokens_per_pass"] / exact["tokens_per_pass"] - 1.0


def rule_verdict(key: str, test: dict | None) -> str:
    """The engine's verdict on one rule's histogram (``exactness.exactness_verdict``; a shortcut is the lossy
    side: its difference from p is the expected finding)."""
    return exactness_verdict(test, lossy=not RULES[key].exact)


def run_rule(
    engine,
    prompt: str,
    key: str,
    p: dict,
    *,
    drafter: str,
    n: int,
    n_tokens: int,
    k: int,
    topk: int,
    temperature: float,
    top_k: int,
    seed: int,
    weight: float = DEFAULT_WEIGHT,
    threshold: float = DEFAULT_THRESHOLD,
    progress=None,
) -> dict:
    """N real samples of the first n_tokens tokens after `prompt` under one rule, and what they show.

    p: the exact law of those tokens ({token or (token, token): probability}, ``exactness.pair_distribution``).
    The drafts, the target passes and the uniforms are the decode loop's (``samples.sample_next_tokens``); only
    the test of each node's children is the rule's. Returns {"counts", "test" (chi_square_test), "verdict",
    "tokens_per_pass", "passes", "tokens", "accepted", "drafted", "seconds", "drafter", "k", "topk"}.
    """
    rule = RULES[key]
    verify_node = rule.make(temperature, weight, threshold)
    shape_topk = 1 if rule.chain else topk
    tally: dict[str, int] = {}
    t0 = time.perf_counter()
    samples = sample_next_tokens(
        engine,
        prompt,
        drafter,
        n_samples=n,
        n_tokens=n_tokens,
        verify_node=verify_node,
        progress=progress,
        tally=tally,
        seed=seed,
        temperature=temperature,
        top_k=top_k,
        k=k,
        topk=shape_topk,
        verify=rule.verify,
    )
    counts = Counter(int(s[0]) if n_tokens == 1 else tuple(int(t) for t in s[:2]) for s in samples)
    test = chi_square_test(counts, p, n)
    return {
        "counts": dict(counts),
        "test": test,
        "verdict": rule_verdict(key, test),
        "tokens_per_pass": tally["tokens"] / max(1, tally["passes"]),
        **tally,
        "seconds": time.perf_counter() - t0,
        "drafter": drafter,
        "k": k,
        "topk": shape_topk,
    }
