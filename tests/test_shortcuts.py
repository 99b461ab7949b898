"""Verification shortcuts (engine/tools/shortcuts.py) and the Shortcuts lab (app/labs/shortcuts.py).

(a) Each rule's test, on hand-made p and q: the shortcuts at their lossless settings (w = 1, t = 1, T = 1) make the
    exact rule's decisions; the static ensemble's output law is w·p + (1 − w)·q, as its docstring derives (chi-square
    against that law, and against p as the control); greedy decoding is the exact greedy rule under every shortcut.
(b) The lab at its defaults, on the real default model: the exact rules stay consistent with p and every shortcut
    is detected (the issue's acceptance test), with tokens per pass and intervals on screen.
"""

from __future__ import annotations

from collections import Counter

import gradio as gr
import pytest
import torch

from engine.acceptance import verify_children
from engine.sampling import sample
from engine.tools.exactness import TEST_LEVEL, chi_square_test, tv_interval, tv_noise_floor
from engine.tools.shortcuts import (
    ROWS,
    RULES,
    greedy_match,
    row_id,
    static_ensemble,
    threshold_rule,
    tokens_gain,
    untempered_q,
)

P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])  # [V]
Q = torch.tensor([0.2, 0.4, 0.05, 0.3, 0.05])  # [V]


def _one_token_law(verify, n: int, seed: int) -> Counter:
    """n single-token outputs of one node with one child x ~ Q tested by `verify` (a rejection draws from what
    it returns)."""
    gen = torch.Generator().manual_seed(seed)
    out = Counter()
    for _ in range(n):
        x = sample(Q, gen)
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        chosen, dist, _ = verify(P, Q, [x], [u], False)
        out[x if chosen is not None else sample(dist, gen)] += 1
    return out


@pytest.mark.parametrize(
    "verify", [static_ensemble(1.0), threshold_rule(1.0), untempered_q(1.0)], ids=["w=1", "t=1", "T=1"]
)
def test_shortcuts_at_their_lossless_settings_are_the_exact_rule(verify):
    """Same children, same uniforms: the same decision, the same records and the same residual as verify_children,
    over random nodes of two children (siblings included)."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        p = torch.softmax(torch.randn(6, generator=gen) * 2, dim=-1)
        q = torch.softmax(torch.randn(6, generator=gen) * 2, dim=-1)
        children = torch.multinomial(q, 2, replacement=False, generator=gen).tolist()
        u = torch.rand(2, generator=gen, dtype=torch.float64).tolist()
        got, want = verify(p, q, children, u, False), verify_children(p, q, children, u, False)
        assert got[0] == want[0]
        assert torch.allclose(got[1], want[1], atol=1e-6)
        for a, b in zip(got[2], want[2]):
            assert a["accept_prob"] == pytest.approx(b["accept_prob"], abs=1e-6)


def test_the_static_ensemble_outputs_its_mixture_not_p():
    """The docstring's claim, sampled: with w = 0.5 the outputs follow v = w·p + (1 − w)·q (consistent), and not p."""
    w, n = 0.5, 4000
    counts = _one_token_law(static_ensemble(w), n, seed=1)
    v = {t: float(w * P[t] + (1 - w) * Q[t]) for t in range(len(P))}
    assert chi_square_test(counts, v, n)["pvalue"] > TEST_LEVEL
    assert chi_square_test(counts, {t: float(P[t]) for t in range(len(P))}, n)["pvalue"] < TEST_LEVEL


@pytest.mark.parametrize(
    "verify", [threshold_rule(0.5), untempered_q(0.5), greedy_match], ids=["threshold", "untempered", "greedy"]
)
def test_each_shortcut_differs_from_p_where_q_differs(verify):
    n = 4000
    counts = _one_token_law(verify, n, seed=2)
    assert chi_square_test(counts, {t: float(P[t]) for t in range(len(P))}, n)["pvalue"] < TEST_LEVEL


def test_every_shortcut_is_the_exact_greedy_rule_at_temperature_0():
    for verify in (static_ensemble(0.3), threshold_rule(0.3), untempered_q(0.5), greedy_match):
        assert verify(P, Q, [1, 0], [], True)[0] == verify_children(P, Q, [1, 0], [], True)[0] == 1


def test_rules_refuse_settings_outside_their_range():
    for make, bad in ((static_ensemble, 0.0), (static_ensemble, 1.5), (threshold_rule, 0.0), (untempered_q, 0.0)):
        with pytest.raises(ValueError):
            make(bad)


def test_tv_interval_holds_the_measured_tv_and_the_floor_bounds_exact_samplers():
    """The spread is centred on the measured TV (not a point); of 40 exact runs of N samples, about 95% stay under
    the noise floor, and a shortcut's law (the ensemble's mixture) lands above it."""
    p = {t: float(P[t]) for t in range(len(P))}
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(P, 600, replacement=True, generator=gen).tolist()
    counts = Counter(draws)
    low, high = tv_interval(counts, p, 600)
    tv = chi_square_test(counts, p, 600)["tv"]
    assert 0 <= low < high < 0.2 and low <= tv <= high
    floor = tv_noise_floor(p, 600)
    under = 0
    for seed in range(40):
        gen = torch.Generator().manual_seed(100 + seed)
        exact = Counter(torch.multinomial(P, 600, replacement=True, generator=gen).tolist())
        under += chi_square_test(exact, p, 600)["tv"] <= floor
    assert under >= 34, under  # 95% expected (38 of 40); seeded, so the same 40 runs every time
    mixed = Counter(_one_token_law(static_ensemble(0.5), 600, seed=5))
    assert chi_square_test(mixed, p, 600)["tv"] > floor


def test_gain_is_read_against_the_exact_rule_with_the_same_drafter():
    results = {
        row_id("exact", "eagle"): {"tokens_per_pass": 2.0},
        row_id("ensemble", "eagle"): {"tokens_per_pass": 2.5},
    }
    assert tokens_gain(results, "ensemble", "eagle") == pytest.approx(0.25)
    assert tokens_gain(results, "exact", "eagle") is None
    assert tokens_gain(results, "threshold", "eagle") is None
    assert {d for k, d in ROWS if k == "exact"} == {d for _, d in ROWS}, "every drafter's rows have the exact rule"
    assert all(RULES[k].exact == (k in ("exact", "block")) for k, _ in ROWS)


@pytest.mark.parametrize(
    "args, message",
    [
        (("", 0.6, 8, 2, 2, 600, 0), "prompt"),
        (("Hi!", 0, 8, 2, 2, 600, 0), "Temperature"),
        (("Hi!", 0.6, 8, 2, 2, 10**6, 0), "Samples"),
        (("Hi!", 0.6, 8, 2, 2, 600, 0, 0.0), "weight"),
        (("Hi!", 0.6, 8, 2, 2, 600, 0, 0.5, 2.0), "threshold"),
        (("Hi!", 0.6, 8, 2, 2, 600, 0, 0.5, 0.5, []), "at least one rule"),
        (("Hi!", 0.6, 8, 2, 2, 600, 0, 0.5, 0.5, ["nonsense@int8"]), "at least one rule"),
    ],
)
def test_bad_shortcuts_input_fails_fast_with_a_clear_error(args, message):
    from app.labs import shortcuts

    with pytest.raises(gr.Error, match=message):
        next(iter(shortcuts.run_shortcuts(*args)))


# ------------------------------------------------------------------------------ the real model
@pytest.mark.slow
@pytest.mark.real_model
def test_the_lab_at_its_defaults_keeps_the_exact_rules_and_catches_every_shortcut():
    """The lab's own handler with its defaults (8 rows × 600 real samples of the first two tokens)."""
    from app.labs import shortcuts

    d = shortcuts.SHORTCUTS_DEFAULTS
    outputs = list(
        shortcuts.run_shortcuts(
            d["prompt"], d["temperature"], d["top_k"], d["k"], d["topk"], d["n"], 0, d["weight"], d["threshold"]
        )
    )
    status = outputs[-1][0]
    table = [o[2] for o in outputs if isinstance(o[2], list)][-1]
    figure = [o[1] for o in outputs if hasattr(o[1], "data")][-1]
    assert "Done in" in status and "Measured" in status, status
    assert len(table) == len(ROWS)
    col = {name: shortcuts.HEADERS.index(name) for name in shortcuts.HEADERS}
    assert col["verdict"] == 1  # beside the rule it judges (a phone shows the first columns)
    for (key, drafter), row in zip(ROWS, table):
        assert row[0].endswith(f"[{drafter}]"), row
        assert float(row[col["tokens per pass"]]) >= 1.0, row
        assert RULES[key].where == row[col["where you meet it"]]
        if RULES[key].exact:
            assert row[col["verdict"]] == "consistent with p", row
        else:
            assert row[col["verdict"]] == "differs from p: the shortcut is lossy", row
            assert row[col["vs exact rule"]].endswith("%"), row  # its gain against the exact rule, same drafter
    points = [  # the rows (the noise floor is a line; the numbers ride invisible markers)
        t for t in figure.data if "markers" in (t.mode or "") and (t.meta or {}).get("role") != "row numbers"
    ]
    assert sum(len(t.x) for t in points) == len(ROWS)


def test_a_summary_line_says_why_its_verdict_follows_from_its_numbers():
    """#40: "consistent with p" beside TV 0.088 over a 0.087 floor and a p-value of 0.0375 read as a contradiction
    in a class: the line names the level the p-value is read against, and why a TV above the floor is no verdict."""
    from app.labs.shortcuts import _above_floor, _pvalue_words
    from engine.tools.exactness import TEST_LEVEL

    consistent = {"test": {"tv": 0.088, "pvalue": 0.0375}}
    assert _pvalue_words(0.0375) == f"p-value 0.0375 ≥ {TEST_LEVEL:g}"
    assert _pvalue_words(1e-9).endswith(f"< {TEST_LEVEL:g}") and _pvalue_words(None) == "no p-value"
    assert "3 samples p gives no chance at all" in _pvalue_words(0.0, 3) and "below 1e-300" in _pvalue_words(0.0)
    assert "one exact run in twenty" in _above_floor(consistent, 0.087)
    assert _above_floor(consistent, 0.09) == ""  # below the floor: nothing to explain
    assert _above_floor({"test": {"tv": 0.2, "pvalue": 1e-6}}, 0.087) == ""  # the test called it different


def test_the_charts_row_numbers_sit_over_every_marker_and_beside_no_other_point():
    """#40: a row's number was drawn with its own trace, under the next trace's markers. The numbers are one
    trace after every marker; a number whose right side holds a neighbouring point goes left (or above)."""
    from visuals.lab_figures import shortcuts_figure

    def row(number, x, tv, exact):
        return {"number": number, "label": f"row {number}", "exact": exact, "tokens_per_pass": x, "tv": tv,
                "tv_low": tv * 0.8, "tv_high": tv * 1.2, "verdict": "v"}  # fmt: skip

    rows = [row(1, 2.0, 0.05, True), row(2, 2.05, 0.052, False), row(3, 3.0, 0.3, False), row(4, 1.0, 0.3, False)]
    fig = shortcuts_figure(rows, 600, 0.08)
    numbers = next(t for t in fig.data if (t.meta or {}).get("role") == "row numbers")
    markers = [i for i, t in enumerate(fig.data) if "markers" in (t.mode or "") and t is not numbers]
    assert fig.data.index(numbers) > max(markers) and numbers.marker.opacity == 0
    assert list(numbers.text) == ["1", "2", "3", "4"]
    assert list(numbers.textposition) == ["middle left", "middle right", "middle right", "middle right"]
    twins = [row(6, 2.0, 0.05, True), row(8, 2.0, 0.05, False), row(9, 1.0, 0.3, False)]  # the same place
    numbers = next(t for t in shortcuts_figure(twins, 600).data if (t.meta or {}).get("role") == "row numbers")
    assert list(numbers.textposition)[:2] == ["middle left", "middle right"]  # the lower number goes left
    leftmost = [row(6, 2.0, 0.05, True), row(8, 2.0, 0.05, False)]  # left of them is the y axis: above instead
    numbers = next(t for t in shortcuts_figure(leftmost, 600).data if (t.meta or {}).get("role") == "row numbers")
    assert list(numbers.textposition) == ["top center", "middle right"]
