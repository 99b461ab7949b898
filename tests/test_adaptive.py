"""Drafting that adapts (engine/drafters/adaptive.py): the K policy, exactness with it on (greedy parity on a tiny
random target and on the real model, chi-square of sampled pairs with a negative control), the step
events' draft record, the switches (settings, CLI, app) and the K-per-pass chart."""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine.decode import GenerationSettings
from engine.drafters.adaptive import PROBE_EVERY, STALE_AFTER, STOP_REASONS, AdaptiveDepth, verified_outcomes
from engine.drafters.base import DraftTree, TreeShape
from engine.tools.exactness import TEST_LEVEL, chi_square_test, pair_distribution, verify_children_ignoring_q
from engine.tools.samples import next_token_distribution, sample_next_tokens
from engine.trace import dumps, loads, step_events

# the exact rule, or the lossy negative control passed to the tree walk in its place
VERIFIERS = {"exact": None, "drop_q": verify_children_ignoring_q}

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a haiku about autumn leaves."
# A prompt whose last words repeat: the n-gram lookup drafts " two two …", which the flat tiny target
# below (it favours repeating its last token) accepts often but not always, so K both grows and shrinks.
REPEAT_PROMPT = "one two two two two two two two two"


@pytest.fixture(autouse=True)
def no_plain_passes(request, monkeypatch):
    """Plain passes (K = 0) are chosen from this host's timings, and on tiny random models drafting seldom
    pays for its Python: every test here but those about plain passes (they ask for `plain_passes`, and set
    the pass costs they need) keeps drafting, so that none depends on the host's speed."""
    if "plain_passes" not in request.fixturenames:
        monkeypatch.setattr(AdaptiveDepth, "plain_speed", lambda self: 0.0)


@pytest.fixture
def plain_passes(monkeypatch):
    """The tiny engines' pass costs with every pass wider than one token made 100 times dearer, as the policy
    sees them: the calibrated ones and what the run's own verifications of wider passes took (the policy prices
    a width the run ran by those: AdaptiveDepth.pass_cost). Drafting can never pay, so the cost-aware policy
    makes plain passes, and probes. Call it with an engine's costs (``SpeculativeEngine.costs``); a replay in
    the same test sees the same prices."""

    def dearer(costs):
        real = costs.weighed_pass_ms
        seen = AdaptiveDepth._seen_pass

        def weighed(*args, **kwargs):
            ms = real(*args, **kwargs)
            return None if ms is None else [ms[0]] + [100.0 * ms[0]] * (len(ms) - 1)

        def seen_dearer(policy, width, verify_ms):
            seen(policy, width, verify_ms if width == 1 else 100.0 * max(verify_ms, policy.pass_ms[0]))

        monkeypatch.setattr(costs, "weighed_pass_ms", weighed)
        monkeypatch.setattr(AdaptiveDepth, "_seen_pass", seen_dearer)

    return dearer


def drafts(run_or_events) -> list[dict]:
    events = run_or_events["events"] if isinstance(run_or_events, dict) else run_or_events
    return [s["draft"] for s in step_events(events)]


def assert_k_follows_the_policy(events: list[dict], engine=None) -> None:
    """Each pass's K is the policy's choice replayed from the trace alone: the run's shape and the
    pass costs its start event recorded, and the outcomes and times of the passes before."""
    start = events[0]
    recorded = start["settings"]
    settings = GenerationSettings(
        k=recorded["k"], topk=recorded["topk"], num_draft_tokens=recorded["num_draft_tokens"], adaptive=True
    )
    _, shape = settings.validate()
    policy = settings.adaptive_depth(shape, start["adaptive"]["pass_ms"], start["adaptive"]["level_nodes"])
    steps = step_events(events)
    assert steps[0]["draft"]["k"] == shape.k  # the first pass drafts at the maximum
    for step in steps:
        assert step["draft"]["k"] == policy.k, (step["step"], drafts(events))
        assert step["draft_depth"] <= step["draft"]["k"]
        policy.update(
            step["accepted_len"], step["draft_depth"], (), step["draft_ms"], step["verify_ms"], step["drafted"]
        )


# ------------------------------------------------------------------------------------- the policy
def test_k_grows_by_two_after_a_fully_accepted_draft_and_shrinks_by_one_after_a_rejection():
    policy = AdaptiveDepth(k_max=8, k_start=4)
    policy.update(accepted_len=4, drafted_depth=4)
    assert policy.k == 6
    policy.update(accepted_len=1, drafted_depth=6)
    assert policy.k == 5
    policy.update(accepted_len=2, drafted_depth=2)  # stopped early by confidence, all kept: still a success
    assert policy.k == 7


def test_with_measured_pass_costs_k_is_the_depth_that_pays():
    """K = argmax (1 + alpha + ... + alpha^k) / (k draft_ms + pass_ms[k]): deep while guesses survive,
    short once they fail where wide passes cost more; dearer drafting shortens it further."""
    costs = [10.0, 10.5, 11.0, 11.5, 12.0, 14.0, 16.0, 18.0, 20.0]  # memory bound, then compute bound
    policy = AdaptiveDepth(k_max=8, pass_ms=costs)
    assert policy.k == 8  # starts at the maximum
    for _ in range(3):
        policy.update(accepted_len=policy.k, drafted_depth=policy.k, draft_ms=0.0)
    assert policy.k == 8 and policy.alpha > 0.99
    for _ in range(30):
        policy.update(accepted_len=0, drafted_depth=policy.k, draft_ms=0.0)
    assert policy.alpha < 0.3 and policy.k <= 2, (policy.alpha, policy.k)  # failing guesses: a short draft
    assert all(policy.expected_speed(policy.k) >= policy.expected_speed(k) for k in range(1, 9))
    # The same record with drafting that costs half a target pass per level: shorter still.
    cheap, dear = AdaptiveDepth(k_max=8, pass_ms=costs), AdaptiveDepth(k_max=8, pass_ms=costs)
    cheap.update(8, 8, draft_ms=0.0)
    dear.update(8, 8, draft_ms=500.0)  # the first draft also caught the drafter up on the prompt: not counted
    assert dear.draft_ms(8) == 0.0
    for accepted in (3, 8, 2, 5):
        cheap.update(accepted, 8, draft_ms=0.0)
        dear.update(accepted, 8, draft_ms=8 * 5.0)
    assert dear.draft_ms(1) == pytest.approx(5.0) and dear.k < cheap.k, (dear.k, cheap.k)  # one depth: per level
    # Noise in the measured costs never makes a wider pass look cheaper.
    assert AdaptiveDepth(k_max=2, pass_ms=[10.0, 9.0, 12.0]).pass_ms == [10.0, 10.0, 12.0]
    with pytest.raises(ValueError, match="pass_ms"):
        AdaptiveDepth(k_max=4, pass_ms=[10.0, 11.0])  # no cost for a 5-token pass
    # A tree's pass width counts its branches (budget-bounded): depth 2 of topk 3 is 1 + 6 rows.
    tree = AdaptiveDepth(k_max=3, pass_ms=[float(w) for w in range(1, 11)], branching=3, budget=8)
    assert tree._width(2) == 7 and tree._width(3) == 9


def test_drafting_cost_is_a_first_level_plus_cheaper_deeper_ones():
    """A model drafter's first level also feeds it what the last pass committed: draft_ms(k) =
    first + (k - 1) * deeper, fitted over the depths drafted. With it a policy that tries K = 1
    (proportional costs made it look cheap) sees the truth and goes back to the K that pays."""
    policy = AdaptiveDepth(k_max=5, pass_ms=[10.0] * 6)
    policy.update(3, 3, draft_ms=99.0)  # the first draft (prompt catch-up): not a level's cost
    for depth, ms in [(3, 14.0), (1, 8.0), (3, 14.0), (1, 8.0)]:
        policy.update(depth, depth, draft_ms=ms)
    assert policy.draft_ms(1) == pytest.approx(8.0) and policy.draft_ms(5) == pytest.approx(20.0)
    # An int8-like drafter: alpha ~0.96, first level 8 ms (catch-up + one token), deeper 3 ms, passes
    # of 1 .. 4 tokens 8, 8.5, 9.5, 11 ms. K = 3 pays; proportional costs from K = 3 alone (14 / 3
    # per level) priced K = 1 at 4.7 ms instead of 8.
    costs = [8.0, 8.5, 9.5, 11.0]
    policy = AdaptiveDepth(k_max=3, pass_ms=costs)
    policy.update(3, 3, draft_ms=200.0)
    seen = []
    for i in range(40):
        k = policy.k
        seen.append(k)
        accepted = k if i % 3 else k - 1  # alpha ~0.88
        policy.update(accepted, k, draft_ms=8.0 + 3.0 * (k - 1), verify_ms=costs[k], drafted=k)
    # Tried K = 1 once, measured it, went back; and tried it once more each time its record had gone unrenewed
    # for STALE_AFTER passes (a slow moment's record would otherwise price a depth for the rest of the run).
    ones = [i for i, k in enumerate(seen) if k == 1]
    assert ones and ones[0] < 3 and set(seen) == {1, 3}, seen
    assert all(b - a > STALE_AFTER for a, b in zip(ones, ones[1:])) and len(ones) <= 1 + 40 // STALE_AFTER, seen
    assert policy.draft_ms(1) == pytest.approx(8.0) and policy.draft_ms(3) == pytest.approx(14.0)


def test_a_width_the_run_ran_is_priced_by_what_it_cost_there():
    """The calibration is one measurement per loaded model: one slow moment in it (recorded on the AVX2 proxy:
    a 7-token pass priced at 19.8 ms where the runs' took ~12) made the policy draft 3-4 levels where 6 paid.
    A width the run ran is priced by its own verifications; the others keep their calibrated price plus the
    step's overhead, bounded by the widths around them, so an overstated width does not move the rest."""
    calibrated = [6.7, 9.5, 10.0, 13.0, 19.3, 17.1, 19.8]
    true = [7.0, 8.0, 8.8, 9.6, 10.4, 11.2, 12.0]  # what a step's pass and verification of w tokens take
    policy = AdaptiveDepth(k_max=6, pass_ms=calibrated)
    chosen = []
    for i in range(30):
        k = policy.k
        chosen.append(k)
        accepted = k if i % 5 else k - 2  # alpha ~0.94
        policy.update(accepted, k, draft_ms=2.5 * k, verify_ms=true[k], drafted=k)
    assert chosen == [6] * 30, chosen
    assert policy.pass_cost(7) == pytest.approx(12.0)
    assert policy.pass_cost(4) == pytest.approx(12.0)  # calibrated 13.0, but never dearer than the 7 the run ran
    assert policy.pass_cost(1) == pytest.approx(6.7)  # not moved by what 7 tokens were overstated by
    # The control: priced by the calibration alone, the same record picks a shallower K.
    by_calibration = [sum(policy.alpha**i for i in range(k + 1)) / (2.5 * k + calibrated[k]) for k in range(1, 7)]
    assert 1 + by_calibration.index(max(by_calibration)) < 6
    # Widths the run ran bound the ones between them: 4 seen at 9.6, so 5 and 6 lie within [9.6, 12].
    policy.update(3, 3, draft_ms=7.5, verify_ms=9.6, drafted=3)
    assert policy.pass_cost(4) == pytest.approx(9.6)
    assert 9.6 <= policy.pass_cost(5) <= policy.pass_cost(6) <= 12.0


def test_a_slow_start_holds_a_run_to_plain_passes_until_its_first_probe_only(plain_passes):
    """Seen in the app: a busy machine made a run's first two drafts slow, the policy chose plain passes, and every
    probe's draft looked dear too (it also catches the drafter up on the plain passes' tokens): 38 plain passes of
    44. A probe starts the timing record afresh from the plain passes' and does not count its own draft time, so
    the run drafts again after its first probe and stays there while drafting pays. (It asks for `plain_passes`
    only to keep plain passes possible; the costs are this test's own.)"""
    calibrated = [8.1, 8.0, 8.1, 8.2, 9.1, 9.3, 9.4]  # a q4 tree of topk 2: widths 3 and 7
    policy = AdaptiveDepth(k_max=3, pass_ms=calibrated, branching=2, budget=6, level_nodes=4)
    chosen, plain_in_a_row = [], 0
    for i in range(40):
        k = policy.k
        chosen.append(k)
        slow = 20.0 if i < 2 else 1.0  # the first two passes on a busy machine
        if k == 0:
            plain_in_a_row += 1
            policy.update(0, 0, (), 0.0, 9.0 * min(slow, 3.0), 0)
            continue
        drafted = policy._width(k) - 1
        catch_up = 10.0 if plain_in_a_row else 0.0  # the drafter catching up on the plain passes' tokens
        plain_in_a_row = 0
        policy.update(k, k, (), 4.0 * k * slow + catch_up, (9.0 + 0.25 * drafted) * min(slow, 3.0), drafted)
    assert chosen[:2] == [3, 3] and chosen[2 : 2 + PROBE_EVERY] == [0] * PROBE_EVERY, chosen  # the slow start
    assert chosen[2 + PROBE_EVERY :] == [3] * (38 - PROBE_EVERY), chosen  # drafting again from the probe on
    assert policy.draft_ms(3) == pytest.approx(12.0)  # the record holds the machine's present costs


def test_the_engine_measures_pass_costs_once(tiny_engine):
    costs = tiny_engine.costs.pass_ms(5)
    assert len(costs) == 5 and all(c > 0 for c in costs)
    assert tiny_engine.costs.pass_ms(3) == costs[:3]  # cached: no second measurement
    assert tiny_engine.costs.pass_ms(5) == costs


def test_the_policy_weighs_the_passes_the_run_takes(tiny_engine):
    """A run whose passes run on the fixed-shape runner (graph replays on CUDA; here "static" strict passes)
    pads every pass to its full width: every depth is weighed at that runner's own pass, timed on a runner of
    the run's size (its bucket).
    An eager run weighs the eager pass of each width, an eager strict run the eager pass of the full width."""
    settings = dict(max_new_tokens=6, k=3, adaptive=True, chat=False)
    fixed = tiny_engine.run(PROMPT, "ngram", strict=True, pass_graphs="static", **settings)
    weighed = fixed["events"][0]["adaptive"]["pass_ms"]
    assert len(weighed) == 4 and len(set(weighed)) == 1 and weighed[0] > 0
    assert weighed[0] == tiny_engine.costs._fixed_ms[(False, 4, 256)]  # the run's bucket's runner, measured once
    assert fixed["metrics"]["pass_path"] == "static"
    eager = tiny_engine.run(PROMPT, "ngram", pass_graphs="off", **settings)["events"][0]["adaptive"]["pass_ms"]
    assert eager == tiny_engine.costs.pass_ms(4)
    strict = tiny_engine.run(PROMPT, "ngram", strict=True, pass_graphs="off", **settings)
    assert strict["events"][0]["adaptive"]["pass_ms"] == [tiny_engine.costs.pass_ms(4)[-1]] * 4


def test_wide_shapes_get_interpolated_costs_and_adapt(tiny_engine):
    """Widths past the measured ones are interpolated / extrapolated (a 129-token pass is not timed
    four times at every width), and a wide model-drafter tree adapts without error, its start event
    recording what the policy weighs."""
    from engine.model.pass_timing import pass_costs_ms

    costs = pass_costs_ms(tiny_engine.target.model, 100, repeats=1)
    assert len(costs) == 100 and all(c > 0 for c in costs)
    run = tiny_engine.run(PROMPT, "int8", max_new_tokens=8, k=8, topk=16, adaptive=True)
    adaptive = run["events"][0]["adaptive"]
    assert adaptive["level_nodes"] == 256 and len(adaptive["pass_ms"]) == 129
    assert_k_follows_the_policy(run["events"])
    tree = AdaptiveDepth(k_max=3, pass_ms=[float(w) for w in range(1, 40)], branching=2, budget=5, level_nodes=4)
    assert [tree._width(k) for k in (1, 2, 3)] == [3, 6, 6]  # 2, then 2 + 4 nodes (budget 5)
    assert tiny_engine.run(PROMPT, "none", max_new_tokens=2, adaptive=True)["events"][0].get("adaptive") is None


def test_k_stays_between_one_and_the_maximum():
    policy = AdaptiveDepth(k_max=3)
    assert policy.k == 3  # starts at the maximum
    policy.update(3, 3)
    assert policy.k == 3
    for _ in range(5):
        policy.update(0, policy.k)
    assert policy.k == 1
    assert AdaptiveDepth(k_max=3, k_start=10).k == 3 and AdaptiveDepth(k_max=3, k_start=0).k == 1


def test_drafts_that_cannot_pay_make_plain_passes_and_a_probe_every_few(plain_passes):
    """With measured pass costs, K = 0 (a plain pass, nothing drafted) when the one-token pass is expected to
    give more tokens per ms than any depth; after PROBE_EVERY plain passes in a row one pass drafts again at
    the best K, and its record decides anew. Without pass costs (transformers' schedule) K never drops to 0."""
    policy = AdaptiveDepth(k_max=4, pass_ms=[5.0] + [50.0] * 4)  # any draft's pass costs 10 plain ones
    policy.update(accepted_len=1, drafted_depth=4, draft_ms=1.0, verify_ms=50.0, drafted=4)
    assert policy.k == 0 and not policy.drafts and "cost more than it saves" in policy.why()["because"]
    why = policy.why()
    assert why["plain"] == pytest.approx(1 / 5.0) and why["plain"] > max(why["speeds"])
    for i in range(1, PROBE_EVERY):
        policy.update(accepted_len=0, drafted_depth=0, draft_ms=0.0, verify_ms=5.5, drafted=0)
        assert policy.k == 0, i
    assert policy.pass_cost(1) == pytest.approx(5.5) and policy.plain_speed() == pytest.approx(1 / 5.5)
    policy.update(accepted_len=0, drafted_depth=0, draft_ms=0.0, verify_ms=5.5, drafted=0)
    assert policy.k >= 1 and "probe" in policy.why()["because"]  # the probe
    policy.update(accepted_len=4, drafted_depth=policy.k, draft_ms=4.0, verify_ms=50.0, drafted=policy.k)
    assert policy.k == 0  # still dearer than plain passes: back to them
    cheap = AdaptiveDepth(k_max=4, pass_ms=[5.0, 5.2, 5.4, 5.6, 5.8])  # passes that cost what one does
    cheap.update(accepted_len=4, drafted_depth=4, draft_ms=1.0, verify_ms=5.8, drafted=4)
    assert cheap.k == 4
    heuristic = AdaptiveDepth(k_max=3)
    for _ in range(10):
        heuristic.update(0, heuristic.k)
    assert heuristic.k == 1


@pytest.mark.parametrize("drafter", ["q4", "eagle", "q4+ngram", "ngram"])
def test_plain_passes_keep_the_output_and_the_drafter_resumes(tiny_with_eagle, plain_passes, drafter):
    """A run whose drafts cannot pay: plain passes (nothing drafted, K = 0, stop "none", why.k = 0) with a
    probe every PROBE_EVERY, the greedy output still the baseline's, the drafter picking up where the plain
    passes left it (EAGLE takes their target features), and every K replayed from the trace alone."""
    engine = tiny_with_eagle
    plain_passes(engine.costs)
    for prompt in (PROMPT, REPEAT_PROMPT):
        base = engine.run(prompt, "none", max_new_tokens=40, chat=False)
        run = engine.run(prompt, drafter, max_new_tokens=40, chat=False, k=4, adaptive=True)
        assert run["token_ids"] == base["token_ids"], (prompt, drafts(run))
        assert_k_follows_the_policy(run["events"], engine)
        steps = step_events(run["events"])
        plain = [s for s in steps if s["draft"]["k"] == 0]
        assert plain and all(s["drafted"] == 0 and s["draft"]["stop"] == "none" for s in plain)
        assert all(s["draft"]["why"]["k"] == 0 and "plain" in s["draft"]["why"] for s in plain)
        probes = [s for s in steps if "probe" in s["draft"]["why"]["because"]]
        assert probes or len(steps) <= PROBE_EVERY + 1, drafts(run)
        assert all(s["drafted"] for s in probes if drafter != "ngram")  # a model drafter drafts on a probe
    from app.narration import narrate_step
    from visuals.run_charts import _why_text

    first_plain = steps.index(plain[0])
    assert "chose a plain pass (K = 0)" in narrate_step(run["events"], first_plain)
    assert "a plain pass:" in _why_text(plain[0]["draft"]["why"])


def test_a_pass_that_drafted_nothing_leaves_k_alone():
    policy = AdaptiveDepth(k_max=5, k_start=2)
    policy.update(accepted_len=0, drafted_depth=0)  # an n-gram lookup without a match: no evidence
    assert policy.k == 2


def test_the_step_shape_keeps_the_runs_branching_and_budget():
    policy = AdaptiveDepth(k_max=6, min_confidence=0.4, k_start=2)
    base = TreeShape(6, topk=2, num_draft_tokens=9)
    shape = policy.shape_for_step(base)
    assert (shape.k, shape.topk, shape.num_draft_tokens, shape.min_confidence) == (2, 2, 9, 0.4)
    assert shape.max_tokens <= base.max_tokens  # the pass never outgrows the caches sized from `base`
    assert TreeShape(4).min_confidence == 0.0  # off by default: drafting never stops early


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(adaptive_min_confidence=1.5), "between 0 and 1"),
        (dict(adaptive_min_confidence=-0.1), "between 0 and 1"),
        (dict(adaptive_min_confidence=math.nan), "number between 0 and 1"),
        (dict(adaptive_min_confidence="0.3"), "number between 0 and 1"),
        (dict(adaptive_min_confidence=True), "number between 0 and 1"),
        (dict(adaptive="yes"), "adaptive must be true or false"),
    ],
)
def test_bad_adaptive_settings_raise_clear_errors(tiny_engine, overrides, match):
    settings = {"adaptive": True, **overrides}
    with pytest.raises(ValueError, match=match):
        GenerationSettings(**settings).validate()
    with pytest.raises(ValueError, match=match):  # at the call, before any generator exists
        tiny_engine.generate(PROMPT, "int8", **settings)


# ------------------------------------------------------------------- tiny random targets
def layer0_head(engine):
    """An untrained EAGLE head for the tiny target: the target's own first layer (rebuilt from the
    same seed), a random fusion, the whole vocabulary. Poor drafts, which must still be exact."""
    from conftest import tiny_hf_model

    from engine.drafters.eagle import EagleHead

    hf = tiny_hf_model()
    E = hf.config.hidden_size
    state = {n: t.clone() for n, t in hf.state_dict().items() if n.startswith("model.layers.0.")}
    state["fuse.weight"] = torch.randn(E, 2 * E, generator=torch.Generator().manual_seed(0)) * 0.3
    state["feature_norm.weight"] = torch.ones(E)
    vocab = torch.arange(hf.config.vocab_size)
    return EagleHead(engine.target.model, state, vocab, {"target": engine.target.name})


@pytest.fixture(scope="module")
def tiny_with_eagle(tiny_engine):
    """The tiny target in an engine of its own (same weights), drafting `eagle` with layer0_head."""
    from engine.decode import SpeculativeEngine

    engine = SpeculativeEngine(tiny_engine.target)
    engine.use_eagle_head(layer0_head(engine))
    return engine


@pytest.fixture(scope="module")
def flat_engine(real_engine):
    """A tiny random target whose next-token distributions are flatter than tiny_engine's (embeddings
    sharpened ×2 instead of ×8: top-3 probabilities near 0.64 / 0.18 / 0.18), so that a sampled test
    sees rejections and a lossy verifier is visible in a few hundred samples."""
    from conftest import tiny_hf_model

    from engine.decode import SpeculativeEngine
    from engine.model.loading import LoadedModel
    from engine.model.transformer import ModelConfig, Transformer

    hf = tiny_hf_model()
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(2.0 / 8.0)
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.float32)
    return SpeculativeEngine(LoadedModel("tiny-flat", model, real_engine.tokenizer, torch.float32))


@pytest.mark.parametrize(
    "drafter, shape",
    [("ngram", dict(k=6)), ("int8", dict(k=6)), ("int8", dict(k=4, topk=2, num_draft_tokens=6)), ("eagle", dict(k=4))],
    ids=["ngram", "int8-chain", "int8-tree", "eagle"],
)
def test_greedy_adaptive_output_equals_the_baseline(tiny_with_eagle, drafter, shape):
    engine = tiny_with_eagle
    prompts = [PROMPT, REPEAT_PROMPT]
    for prompt in prompts:
        base = engine.run(prompt, "none", max_new_tokens=24)
        run = engine.run(prompt, drafter, max_new_tokens=24, adaptive=True, adaptive_min_confidence=0.5, **shape)
        assert run["token_ids"] == base["token_ids"], (prompt, drafts(run))
        assert_k_follows_the_policy(run["events"], engine)
    # The confidence is calibrated by the run's own record: a run starts trusting its drafter fully,
    # so a confidence stop can only follow a pass whose draft was (partly) rejected.
    steps = step_events(run["events"])
    for i, step in enumerate(steps):
        if step["draft"]["stop"] == "confidence":
            assert any(s["accepted_len"] < s["draft_depth"] for s in steps[:i]), drafts(run)


def test_every_step_records_its_k_and_why_drafting_stopped(tiny_with_eagle):
    engine = tiny_with_eagle
    fixed = engine.run(REPEAT_PROMPT, "ngram", max_new_tokens=12, k=5, chat=False)
    assert all(d["k"] == 5 and d["stop"] in ("depth", "no-match") for d in drafts(fixed))
    assert fixed["events"][0]["settings"]["adaptive"] is False
    base = engine.run(PROMPT, "none", max_new_tokens=4)
    assert all(d == {"k": 0, "stop": "none"} for d in drafts(base))
    first = engine.run([42], "eagle", max_new_tokens=4, k=2, chat=False)  # no target feature before pass 1
    assert drafts(first)[0] == {"k": 2, "stop": "none"}
    run = engine.run(PROMPT, "int8", max_new_tokens=16, k=4, adaptive=True, payload="reduced")
    assert run["events"][0]["settings"]["adaptive"] is True
    for step in step_events(run["events"]):
        assert set(step["draft"]) == {"k", "stop", "model_passes", "why"} and step["draft"]["stop"] in STOP_REASONS
        assert 1 <= step["draft"]["model_passes"] <= step["draft"]["k"]  # the catch-up, one per level expanded
        assert 1 <= step["draft"]["k"] <= 4
    assert drafts(loads(dumps(run["events"]))) == drafts(run)  # saved and loaded as recorded


def test_payload_off_runs_adapt_too(tiny_engine):
    """No step events are streamed, but the loop still builds them (for the metrics) and adapts."""
    a = tiny_engine.run(PROMPT, "int8", max_new_tokens=16, k=4, adaptive=True, payload="off")
    b = tiny_engine.run(PROMPT, "int8", max_new_tokens=16, k=4, adaptive=True, payload="reduced")
    assert a["token_ids"] == b["token_ids"]
    # K weighs measured times (draft ms per pass), so the two runs' passes may differ; both drafted.
    assert a["metrics"]["accepted"] > 0 and b["metrics"]["accepted"] > 0


# --------------------------------------------------------------------- sampling: exactly p
def _pair_test(engine, drafter: str, verifier: str, n: int, **settings) -> dict:
    """Chi-square of n sampled (x1, x2) against the target's p(x1)·p(x2 | x1)."""
    samples = sample_next_tokens(
        engine, REPEAT_PROMPT, drafter, n_samples=n, n_tokens=2, verify_node=VERIFIERS[verifier], **settings
    )
    filters = dict(temperature=1.0, top_k=settings["top_k"], chat=False)

    def dist(prefix):
        p = next_token_distribution(engine, REPEAT_PROMPT, prefix, **filters)
        return {int(t): float(p[t]) for t in torch.nonzero(p).flatten()}

    law = pair_distribution(dist([]), lambda x1: dist([x1]))
    index = {pair: i for i, pair in enumerate(law)}
    counts = Counter(index.get(s, -1) for s in samples)
    return chi_square_test(dict(counts), {index[pair]: p for pair, p in law.items()}, n)


@pytest.fixture(scope="module")
def flat_with_eagle(flat_engine):
    """The flat tiny target drafting `eagle` with its layer-0 head: a weak drafter, often rejected."""
    from engine.decode import SpeculativeEngine

    engine = SpeculativeEngine(flat_engine.target)
    engine.use_eagle_head(layer0_head(engine))
    return engine


@pytest.mark.parametrize("drafter", ["ngram", "int8", "eagle"])
def test_adaptive_sampling_is_exact_and_the_negative_control_is_caught(flat_engine, flat_with_eagle, drafter):
    """ngram: K shrinks after rejections and grows after full acceptances between passes and samples;
    int8: accepted almost always, it drafts to K; eagle: rejected often, its calibrated confidence
    stops drafts short. All must leave the pair law at p's; dropping q from the acceptance test
    (accept with min(1, p)) on the same drafts must be detected (ngram, int8)."""
    engine = flat_with_eagle if drafter == "eagle" else flat_engine
    settings = dict(temperature=1.0, top_k=3, k=4, seed=7, chat=False, adaptive=True, adaptive_min_confidence=0.3)
    # K weighs measured costs, and a tiny target's passes cost about the same at every width (Python
    # overhead), so K would sit at one value. Costs of other hosts exercise the policy: for eagle,
    # target passes that are dear against a head step (a large target) keep drafts deep enough to meet
    # the confidence stop; for the n-gram drafter, passes whose cost grows with width (a CPU's compute-
    # bound passes) make K follow acceptance up and down.
    saved = engine.costs._pass_ms
    engine.costs._pass_ms = [1000.0] * 16 if drafter == "eagle" else [10.0 * w for w in range(1, 17)]
    try:
        _adaptive_sampling_checks(engine, drafter, settings)
    finally:
        engine.costs._pass_ms = saved


def _adaptive_sampling_checks(engine, drafter: str, settings: dict) -> None:
    run = engine.run(REPEAT_PROMPT, drafter, max_new_tokens=24, **settings)
    if drafter == "ngram":
        assert len({d["k"] for d in drafts(run)}) > 1, drafts(run)
    if drafter == "eagle":
        assert any(d["stop"] == "confidence" for d in drafts(run)), drafts(run)
    assert_k_follows_the_policy(run["events"], engine)
    exact = _pair_test(engine, drafter, "exact", 600, **settings)
    assert exact["pvalue"] is not None and exact["pvalue"] > TEST_LEVEL, exact
    if drafter == "eagle":
        return  # the negative control below is the int8 / ngram params' (measured here: TV 0.04, unseen in 800)
    broken = _pair_test(engine, drafter, "drop_q", 800, **settings)  # q ≈ p for int8: a smaller TV
    assert broken["pvalue"] < TEST_LEVEL, broken


# ------------------------------------------------------------------------------------- switches
def test_cli_rejects_a_bad_threshold_before_loading_a_model():
    for value in ("1.5", "-1", "nan"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "engine",
                "generate",
                "--prompt",
                "hi",
                "--adaptive",
                "--adaptive-min-confidence",
                value,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert proc.returncode == 2 and proc.stderr.startswith("error: --adaptive-min-confidence"), proc.stderr


@pytest.mark.real_model
def test_cli_adaptive_generates_and_records_the_depth(tmp_path):
    events = tmp_path / "events.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--prompt", "Count to five.", "--drafter", "ngram", "--k", "6"]
        + [
            "--max-new-tokens",
            "8",
            "--adaptive",
            "--adaptive-min-confidence",
            "0.4",
            "--json",
            "--events",
            str(events),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1])["new_tokens"] >= 1
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert lines[0]["settings"]["adaptive"] is True and lines[0]["settings"]["adaptive_min_confidence"] == 0.4
    assert all(1 <= d["k"] <= 6 for d in drafts(lines))


def test_app_and_api_pass_the_switch():
    from app.engine_access import make_settings
    from app.tabs import playground
    from app.tabs.api import generate as api_generate

    assert make_settings(4, 1, 0, 0.0, 1.0, 0, 0, 8, True).adaptive is True
    assert make_settings(4, 1, 0, 0.0, 1.0, 0, 0, 8).adaptive is False
    assert inspect.signature(api_generate).parameters["adaptive"].default is False
    assert "adaptive" in playground.PLAY_INPUTS
    assert "adaptive" in inspect.signature(playground.run_playground).parameters


def test_bench_skips_eagle_rows_without_a_head(tiny_engine):
    from engine.tools.bench import ENGINE_SYSTEMS, SYSTEMS, _drop_unavailable_drafters

    assert {"engine-eagle", "engine-ngram-adaptive", "engine-int8-adaptive", "engine-eagle-adaptive"} <= set(SYSTEMS)
    assert ENGINE_SYSTEMS["engine-int8-adaptive"][1]["adaptive"] is True
    systems, notes = list(SYSTEMS), []
    _drop_unavailable_drafters(tiny_engine, systems, notes)  # no head was trained for "tiny-random"
    assert "engine-eagle" not in systems and "engine-eagle-adaptive" not in systems
    assert "engine-int8-adaptive" in systems
    assert [n.split(":", 1)[0] for n in notes] == ["engine-eagle", "engine-eagle-adaptive"]
    assert all("train-head" in n for n in notes)


# ------------------------------------------------------------------------------------- visuals
def test_depth_chart_draws_the_recorded_k_and_stops(tiny_engine):
    from visuals.run_charts import draft_depth_figure

    run = tiny_engine.run(PROMPT, "int8", max_new_tokens=16, k=4, adaptive=True, adaptive_min_confidence=0.5)
    fig = draft_depth_figure(run["events"])
    k_line = [t for t in fig.data if (t.meta or {}).get("role") == "k"]
    assert len(k_line) == 1 and list(k_line[0].y) == [d["k"] for d in drafts(run)]
    stops = Counter(d["stop"] for d in drafts(run))
    marks = {t.meta["stop"]: len(t.x) for t in fig.data if (t.meta or {}).get("role") == "stop"}
    assert marks == dict(stops)
    json.loads(fig.to_json())
    recorded = [dict(e) for e in run["events"]]
    for event in step_events(recorded):
        event.pop("draft")  # a trace recorded before the field existed
    assert not [t for t in draft_depth_figure(recorded).data]


def test_playground_shows_the_depth_chart_for_adaptive_runs(tiny_engine):
    from app.tabs import playground

    adaptive = tiny_engine.run(PROMPT, "int8", max_new_tokens=8, k=3, adaptive=True)["events"]
    fixed = tiny_engine.run(PROMPT, "int8", max_new_tokens=8, k=3)["events"]
    shown = playground.finished_outputs(adaptive, "done")["depth"]
    hidden = playground.finished_outputs(fixed, "done")["depth"]
    assert shown.visible is True and hidden.visible is False


# ---------------------------------------------------------------------------------- real model
def test_greedy_adaptive_int8_equals_the_baseline_on_the_real_model(real_engine):
    prompt = "Give me three tips for learning to cook."
    base = real_engine.run(prompt, "none", max_new_tokens=24)
    run = real_engine.run(prompt, "int8", max_new_tokens=24, k=6, adaptive=True)
    assert run["token_ids"] == base["token_ids"], drafts(run)
    assert_k_follows_the_policy(run["events"], real_engine)


def test_confidence_is_calibrated_by_the_runs_own_acceptance_per_tenth_of_q():
    """Before any verification every tenth of q is trusted fully (the run drafts to K, as a fixed one
    does); then each tenth moves to the acceptance measured for drafts of that q, an empty tenth to
    the run's overall rate."""
    policy = AdaptiveDepth(k_max=4, min_confidence=0.3)
    assert policy.calibration == (1.0,) * 10
    policy.update(4, 4, [(0.25, True)] * 20)  # low q, always accepted (int8 under greedy)
    policy.update(1, 4, [(0.95, True), (0.85, False)] * 10)  # 0.8-0.9: always rejected
    cal = policy.calibration
    overall = (30 + 1) / (40 + 1)
    assert cal[2] == pytest.approx((20 + 2 * overall) / 22)
    assert cal[8] == pytest.approx((0 + 2 * overall) / 12) and cal[8] < 0.3
    assert cal[5] == pytest.approx(overall)  # nothing seen at q 0.5-0.6: the run's rate
    shape = policy.shape_for_step(TreeShape(4))
    assert shape.calibration == cal
    assert shape.confidence(0.25) == cal[2] and shape.confidence(1.0) == cal[9]
    assert TreeShape(4).confidence(0.25) == 0.25  # without calibration: q itself


def test_sure_levels_never_outrun_the_confidence_stop():
    """A greedy chain's one C call runs the levels the loop is sure to reach (TreeShape.sure_levels): for any
    drafted confidences, never a level the loop's stop would skip, and all K where nothing can stop it."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        cal = tuple(float(x) for x in torch.rand(10, generator=gen) * 0.6 + 0.4)
        shape = TreeShape(8, min_confidence=float(torch.rand((), generator=gen)) * 0.6, calibration=cal)
        qs = torch.rand(8, generator=gen).tolist()
        for depth in range(1, 9):
            path = 1.0
            for q in qs[: depth - 1]:
                path *= shape.confidence(q)
            # the loop: the pass for level d + 1 runs while the path through level d stays at the threshold or above
            reached, p = 1, path
            for q in qs[depth - 1 : 7]:
                p *= shape.confidence(q)
                if p < shape.min_confidence:
                    break
                reached += 1
            assert 1 <= shape.sure_levels(depth, path) <= min(reached, 8 - depth + 1)
    assert TreeShape(6).sure_levels(2, 0.01) == 5  # no threshold: every level left
    assert TreeShape(6, min_confidence=0.3).sure_levels(1, 1.0) == 1  # raw q can be anything above 0
    assert TreeShape(6, min_confidence=0.3, calibration=(0.9,) * 10).sure_levels(1, 1.0) == 6  # 0.9^5 >= 0.3
    assert TreeShape(6, min_confidence=0.5, calibration=(0.9,) * 10).sure_levels(1, 1.0) == 6  # 0.9^5 = 0.59
    assert TreeShape(6, min_confidence=0.6, calibration=(0.9,) * 10).sure_levels(1, 1.0) == 5


def test_verified_outcomes_are_the_accepted_path_and_the_rejected_children_after_it():
    chain = DraftTree(tokens=[5, 6, 7], parents=[-1, 0, 1], depths=[1, 2, 3], q_token=[0.9, 0.5, 0.2])
    assert verified_outcomes(chain, [0, 1]) == [(0.9, True), (0.5, True), (0.2, False)]
    assert verified_outcomes(chain, [0, 1, 2]) == [(0.9, True), (0.5, True), (0.2, True)]
    assert verified_outcomes(chain, []) == [(0.9, False)]
    tree = DraftTree(tokens=[5, 8, 6], parents=[-1, -1, 0], depths=[1, 1, 2], q_token=[0.6, 0.3, 0.4])
    assert verified_outcomes(tree, []) == [(0.6, False), (0.3, False)]  # both roots tried, both rejected
    assert verified_outcomes(tree, [0]) == [(0.6, True), (0.4, False)]  # the sibling's fate is left out
    ngram = DraftTree(tokens=[5], parents=[-1], depths=[1], q_token=[1.0], point_mass=True)
    assert verified_outcomes(ngram, [0]) == []  # a point mass has no q to calibrate


def test_each_adaptive_pass_records_why_its_k(tiny_engine):
    """The step's draft.why says why the policy chose that K (issue #29: 'pass 18: K = 1' needs its reason):
    the cost-aware rule's expected tokens per ms of every candidate K, the chosen one the largest."""
    run = tiny_engine.run("Hello there, how are you?", "int8", max_new_tokens=24, k=4, adaptive=True, seed=1)
    steps = [e for e in run["events"] if e["type"] == "step"]
    for s in steps:
        why = s["draft"]["why"]
        assert why["k"] == s["draft"]["k"] and why["because"]
        assert len(why["speeds"]) == 4 and 0 <= why["alpha"] <= 1
    later = [s["draft"]["why"] for s in steps[1:] if "expected tokens" in s["draft"]["why"]["because"]]
    assert later and all(w["speeds"][w["k"] - 1] == max(w["speeds"]) for w in later)
    from app.narration import narrate_step

    assert "adaptive depth chose K" in narrate_step(run["events"], 1)
    fixed = tiny_engine.run("Hello there, how are you?", "int8", max_new_tokens=8, k=4, seed=1)
    assert all("why" not in e["draft"] for e in fixed["events"] if e["type"] == "step")
