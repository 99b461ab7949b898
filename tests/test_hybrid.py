"""The hybrid drafter (engine/drafters/hybrid.py): each pass, the copying drafter's proposal or the model drafter's
chain, picked from what the run has measured.

* Specs: ``COPY/MODEL[:DEPTH]`` parsed and refused with messages that say what is wrong; ``--adaptive`` refused.
* The pick: the proposal where there is one and its side is at least as fast or not measured yet, else the model;
  the tree handed on is the picked drafter's own (point masses, or the model's q); the model's chain stops at DEPTH.
* A model pass teaches the copy side what its proposal would have committed (matched tokens plus the target's own).
* A bridge (copying pays, no match here): the model's tokens with its q, then the copying drafter's continuation
  with q = 1 on each token; the model keeps only its own slots. Sampled through the engine, forced bridges emit the
  target's law of the first two tokens by chi-square, and a bridge that hands on the model's q for the copied token
  (the negative control) is detected.
* On the real model, greedy: the output is the baseline's, both drafters draft, the step events record the pick.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from engine.drafters.base import DraftContext, TreeShape, Verified
from engine.drafters.hybrid import DEFAULT_DEPTH, HybridDrafter, parse_hybrid
from engine.tools.samples import next_token_distribution, sample_next_tokens


def test_specs_are_parsed_and_bad_ones_refused_with_what_is_wrong(tiny_engine):
    def parts(text):
        spec = parse_hybrid(text)
        return spec.copy.text, spec.model.text, spec.depth

    assert parts("suffix/q4") == ("suffix", "q4", DEFAULT_DEPTH)
    assert parts("ngram:3,1/int8:3") == ("ngram:3,1", "int8", 3)
    assert parts("suffix/model:HuggingFaceTB/SmolLM2-135M-Instruct:4") == (
        "suffix",
        "model:HuggingFaceTB/SmolLM2-135M-Instruct",
        4,
    )
    copying, model = r"ngram\[:MAX.*suffix\[:MAX\[,MIN\]\] before", "int8, q4, model:<id> after"
    for spec, words in (
        ("q4/suffix", copying),
        ("suffix/eagle", model),
        ("suffix/none", model),
        ("ngram/", model),
        ("suffix/q4:0", "between 1 and 32"),
        ("suffix/q4:x", model),
    ):
        with pytest.raises(ValueError, match=words):
            tiny_engine.drafter(spec)
    drafter = tiny_engine.drafter("ngram/int8:2")
    assert isinstance(drafter, HybridDrafter) and drafter.depth == 2
    assert drafter.copy.name == "ngram" and drafter.model.name == "int8"
    with pytest.raises(ValueError, match="adaptive drafting does not combine with the drafter"):
        tiny_engine.run("a b c a b", "ngram/int8", adaptive=True, chat=False, max_new_tokens=4)


def _hybrid(tiny_engine, depth=3):
    drafter = tiny_engine.drafter(f"ngram/int8:{depth}")
    drafter.start([1, 2], 64)
    return drafter


REPEATS = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # n-gram proposes 7, 8, 9, ... after the repeated (5, 6)
NOVEL = [11, 12, 13, 14, 15, 16]  # no repeat: nothing to propose


def _propose(drafter, tokens, k=6):
    return drafter.propose(DraftContext(list(tokens), TreeShape(k=k)))


def test_the_pick_follows_the_measured_speeds_and_hands_on_the_picked_drafters_own_tree(tiny_engine):
    drafter = _hybrid(tiny_engine)
    # nothing measured: the proposal where there is one, the model where there is none (at most DEPTH levels)
    copy = _propose(drafter, REPEATS)
    assert copy.facts["hybrid"] == {
        "picked": "ngram",
        "proposed": len(copy),
        "bridged": False,
        "continued": 0,
        "speeds": {"copy": None, "model": None},
    }
    assert copy.point_mass and copy.tokens[:3] == [7, 8, 9] and "model_passes" not in copy.facts
    drafter.accept(Verified(copy, [0, 1]))
    # the copying side starts from one token a pass: one lucky pass (3 tokens) moves it part of the way
    from engine.drafters.hybrid import COPY_PRIOR_TOKENS, HYBRID_RECENCY

    assert drafter._copy_side.tokens == pytest.approx(HYBRID_RECENCY * COPY_PRIOR_TOKENS + (1 - HYBRID_RECENCY) * 3)
    model = _propose(drafter, NOVEL)
    assert model.facts["hybrid"]["picked"] == "int8" and model.facts["hybrid"]["proposed"] == 0
    assert not model.point_mass and len(model) == 3 and model.facts["model_passes"] >= 1 and -1 in model.q_dists
    drafter.accept(Verified(model, [0]))
    assert drafter.speeds()["copy"] is not None and drafter.speeds()["model"] is not None
    # measured: the copy side is picked only while it is at least as fast
    drafter._copy_side.tokens, drafter._copy_side.ms = 1.0, 100.0  # 0.01 tokens per ms
    drafter._model_side.tokens, drafter._model_side.ms = 4.0, 10.0  # 0.4
    slow = _propose(drafter, REPEATS)
    assert slow.facts["hybrid"]["picked"] == "int8" and slow.facts["hybrid"]["proposed"] > 0
    assert slow.facts["hybrid"]["speeds"] == {"copy": 0.01, "model": 0.4}
    drafter.accept(Verified(slow, []))
    drafter._copy_side.tokens, drafter._copy_side.ms = 9.0, 10.0
    fast = _propose(drafter, REPEATS, k=8)
    assert fast.facts["hybrid"]["picked"] == "ngram" and len(fast) > 3  # a proposal may go past DEPTH, up to K
    drafter.close()


def test_a_model_pass_teaches_the_copy_side_what_its_proposal_would_have_committed(tiny_engine):
    from engine.drafters.hybrid import HYBRID_RECENCY as RECENCY

    def model_ahead():
        drafter = _hybrid(tiny_engine)
        drafter._model_side.tokens, drafter._model_side.ms = 100.0, 1.0  # the model far ahead: it drafts
        drafter._model_draft_ms = 0.5
        drafter._copy_side.tokens = 1.0  # one token a pass, no copy pass of its own yet
        return drafter

    drafter = model_ahead()
    # before a copy pass of its own, the copy side is priced at the model passes' ms less their drafting
    assert drafter.speeds() == {"copy": pytest.approx(1.0 / 0.5), "model": 100.0}
    tree = _propose(drafter, REPEATS)
    assert tree.facts["hybrid"]["picked"] == "int8" and drafter._unused[0][:2] == [7, 8]
    drafter.accept(Verified(tree, []))
    # the target committed 7 (the proposal's first), then 99 (not its second): 1 matched + the target's own = 2
    drafter.propose(DraftContext(REPEATS + [7, 99], TreeShape(k=6)))
    assert drafter._copy_side.tokens == pytest.approx(RECENCY * 1.0 + (1 - RECENCY) * 2)
    drafter.close()
    # every committed token matched (the committed run ended first): all of them count, 3 here
    drafter = model_ahead()
    drafter.accept(Verified(_propose(drafter, REPEATS), []))
    drafter.propose(DraftContext(REPEATS + [7, 8, 9], TreeShape(k=6)))
    assert drafter._copy_side.tokens == pytest.approx(RECENCY * 1.0 + (1 - RECENCY) * 3)
    drafter.close()


def _copy_pays(monkeypatch, drafter_cls=HybridDrafter):
    """Both sides measured, copying ahead: a pass without a match bridges."""
    monkeypatch.setattr(drafter_cls, "speeds", lambda self: {"copy": 1.0, "model": 0.5})


def test_a_bridge_is_the_models_tokens_then_the_copying_continuation(tiny_engine, monkeypatch):
    _copy_pays(monkeypatch)
    drafter = _hybrid(tiny_engine, depth=3)
    asked = []

    def copy_chain(self, tokens, room):  # the copying drafter matches again after the model's first token
        asked.append(len(tokens))
        return [21, 22, 23][:room] if len(tokens) > len(NOVEL) else []

    monkeypatch.setattr(HybridDrafter, "_copy_chain", copy_chain)
    alone = tiny_engine.drafter("int8")
    alone.start([1, 2], 64)
    expected = alone.propose(DraftContext(list(NOVEL), TreeShape(k=1)))
    tree = _propose(drafter, NOVEL, k=5)
    assert (
        tree.facts["hybrid"]["picked"] == "int8"
        and tree.facts["hybrid"]["continued"] == 3
        and tree.facts["hybrid"]["proposed"] == 0
    )
    assert tree.facts["hybrid"]["bridged"]
    assert tree.tokens == [expected.tokens[0], 21, 22, 23] and tree.parents == [-1, 0, 1, 2]
    assert not tree.point_mass and tree.facts["model_passes"] == 1 and asked == [len(NOVEL) + 1]
    assert torch.allclose(tree.q_dists[-1], expected.q_dists[-1])
    for node, token in enumerate([21, 22, 23]):
        point = tree.q_dists[node]
        assert float(point[token]) == 1.0 and float(point.sum()) == 1.0 and tree.q_token[node + 1] == 1.0
    drafter.accept(Verified(tree, [0, 1, 2]))  # the model keeps its own token's slot only
    assert drafter.model.cache.length == len(NOVEL)
    # no match within DEPTH levels: the bridge is the model's chain alone
    monkeypatch.setattr(HybridDrafter, "_copy_chain", lambda self, tokens, room: [])
    plain = _propose(drafter, NOVEL + [expected.tokens[0], 21, 22], k=5)
    assert (
        len(plain) == 3
        and plain.facts["hybrid"]["continued"] == 0
        and plain.facts["model_passes"] == 3
        and plain.facts["hybrid"]["bridged"]
    )
    drafter.close()
    alone.close()


class _BridgeHandsOnTheModelsQ(HybridDrafter):
    """The negative control: the copied token handed on with the model's q at its position, not a point mass."""

    def _bridge(self, context, depth):
        tree = super()._bridge(context, depth)
        if self._continued:
            model_q = self.model.propose(
                DraftContext(context.tokens + tree.tokens[:1], TreeShape(k=1), context.params, context.gen)
            )
            tree.q_dists[0] = model_q.q_dists[-1]
            tree.q_token[1] = float(model_q.q_dists[-1][tree.tokens[1]])
        return tree


@pytest.mark.parametrize("broken", [False, True], ids=["bridge", "control"])
def test_sampled_bridges_emit_the_targets_law(tiny_engine, monkeypatch, broken):
    """Every pass a bridge of one model token (DEPTH 1), the copying drafter continuing with the target's own
    most likely token there (a function of the tokens before it): the first two emitted tokens follow the
    target's p(x1) and sum over x1 of p(x1) p(x2 | x1), by chi-square; the control is detected."""
    cls = _BridgeHandsOnTheModelsQ if broken else HybridDrafter
    _copy_pays(monkeypatch, HybridDrafter)
    prompt = [101, 2202, 3303, 4404, 5505]
    settings = dict(temperature=1.0, top_k=4, chat=False)

    def copy_chain(self, tokens, room):
        return [int(torch.argmax(next_token_distribution(tiny_engine, tokens, **settings)))][:room]

    monkeypatch.setattr(HybridDrafter, "_copy_chain", copy_chain)
    build = tiny_engine.drafters.build
    monkeypatch.setattr(
        tiny_engine.drafters,
        "build",
        lambda spec, history=(): (
            cls(spec.text, build("ngram", history), build("int8"), 1) if spec.family == "hybrid" else build(spec)
        ),
    )
    n = 3000
    samples = sample_next_tokens(tiny_engine, prompt, "ngram/int8:1", n_samples=n, n_tokens=2, k=3, seed=5, **settings)
    p1 = next_token_distribution(tiny_engine, prompt, **settings)
    support = torch.nonzero(p1).flatten().tolist()
    first = Counter(s[0] for s in samples)
    expected1 = [float(p1[t]) / float(p1.sum()) * n for t in support]
    marginal: dict[int, float] = {}
    for x1 in support:
        p2 = next_token_distribution(tiny_engine, prompt + [x1], **settings)
        for t in torch.nonzero(p2).flatten().tolist():
            marginal[t] = marginal.get(t, 0.0) + float(p1[x1]) * float(p2[t])
    second = Counter(s[1] for s in samples)
    keys = sorted(marginal)
    total = sum(marginal[t] for t in keys)
    pvalues = (
        chisquare([first[t] for t in support], expected1).pvalue,
        chisquare([second[t] for t in keys], [marginal[t] / total * n for t in keys]).pvalue
        if set(second) <= set(marginal)
        else 0.0,
    )
    if broken:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues


@pytest.mark.real_model
def test_greedy_hybrid_keeps_the_baseline_output_and_records_both_picks(served_engine):
    """A code edit (the bench's first): q4 drafts the answer's opening, suffix decoding copies the code, long
    proposals past the model's DEPTH; the output is the baseline's, and each step records its pick."""
    import json
    from pathlib import Path

    prompt = json.loads((Path(__file__).parents[1] / "assets" / "workloads.json").read_text())["code-edit"][0]
    base = served_engine.run(prompt, "none", max_new_tokens=64)
    run = served_engine.run(prompt, "suffix/q4", k=15, max_new_tokens=64)
    assert run["token_ids"] == base["token_ids"]
    steps = [e for e in run["events"] if e["type"] == "step"]
    picks = [s["draft"]["hybrid"] for s in steps]
    assert {p["picked"] for p in picks} == {"suffix", "q4"}, picks
    for step, pick in zip(steps, picks):
        assert step["point_mass"] == (pick["picked"] == "suffix")
        assert ("model_passes" in step["draft"]) == (pick["picked"] == "q4")
        if pick["picked"] == "q4":
            assert len(step["nodes"]) - pick["continued"] <= DEFAULT_DEPTH
            assert pick["bridged"] or not pick["continued"]
        else:
            assert pick["proposed"] == len(step["nodes"]) and pick["continued"] == 0
        assert set(pick["speeds"]) == {"copy", "model"}
    assert max(len(s["nodes"]) for s, p in zip(steps, picks) if p["picked"] == "suffix") > DEFAULT_DEPTH
    from app.narration import narrate_step  # the Step-through says what was picked, from the event alone

    for index, pick in enumerate(picks):
        assert f"the hybrid drafter picked **{pick['picked']}**" in narrate_step(run["events"], index)
