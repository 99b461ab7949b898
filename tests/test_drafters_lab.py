"""The Drafters lab: its figures and rows on recorded traces (no model), bad input answered with a warning,
and the lab end to end on the real default model with a few new tokens."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from engine.metrics import draft_token_cost, run_summary, wall_clock_speedup
from engine.trace import load, step_events

TRACES = Path(__file__).resolve().parent.parent / "assets" / "traces"


def recorded(name: str) -> list[dict]:
    return load(TRACES / f"{name}.json")


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    """A baseline and two drafters (n-gram on the same prompt; an int8 tree run on another one)."""
    return [
        recorded("code-edit-baseline-greedy"),
        recorded("code-edit-ngram-greedy"),
        recorded("chat-int8-tree-sampling"),
    ]


def by_role(fig, role: str) -> list:
    return [t for t in fig.data if (t.meta or {}).get("role") == role]


# ------------------------------------------------------------------------------- no model needed
def test_draft_cost_is_draft_time_per_drafted_token_over_a_baseline_pass(runs):
    base, ngram = step_events(runs[0]), step_events(runs[1])
    per_token = sum(s["draft_ms"] for s in ngram) / sum(s["drafted"] for s in ngram)
    pass_ms = sum(s["verify_ms"] for s in base) / len(base)
    assert math.isclose(draft_token_cost(ngram, base), per_token / pass_ms)
    assert draft_token_cost(base, base) is None  # nothing drafted
    untimed = [{**s, "draft_ms": None} for s in ngram]  # a vLLM trace has no drafting time
    assert draft_token_cost(untimed, base) is None


def test_rows_measure_each_drafter_against_the_baseline(runs):
    from visuals.drafter_families import comparison_rows

    rows = comparison_rows(runs)
    assert [r["label"] for r in rows] == ["none", "ngram", "int8"]
    base = run_summary(runs[0])
    assert rows[0]["speedup"] == 1.0 and rows[0]["cost"] is None and rows[0]["baseline"]
    for row, trace in zip(rows[1:], runs[1:]):
        s = run_summary(trace)
        assert math.isclose(row["speedup"], s["tokens_per_s"] / base["tokens_per_s"])
        assert row["alpha"] == s["position_acceptance"] and row["tokens_per_pass"] == s["tokens_per_pass"]
        assert row["cost"] == draft_token_cost(step_events(trace), step_events(runs[0]))
        assert math.isclose(row["surface"], wall_clock_speedup(row["alpha"], row["k"], row["cost"]))
        infos = [st["draft"] for st in step_events(trace) if "draft" in st]  # (older traces have none)
        if not infos:
            assert row["k_used"] is None and row["stops"] == {}
        else:
            assert row["k_used"] == pytest.approx(sum(i["k"] for i in infos) / len(infos))
            assert sum(row["stops"].values()) == len(infos)
    assert rows[1]["cost"] < 0.01 < rows[2]["cost"]  # a lookup against a network pass
    with pytest.raises(ValueError, match="baseline"):
        comparison_rows(runs[1:])


def test_adaptive_runs_are_named_and_their_depth_record_is_read(runs):
    """A step's optional `draft` dict ({"k", "stop"}) and the setting `adaptive` in the start event."""
    from visuals.drafter_families import comparison_rows

    adaptive = copy.deepcopy(runs[1])
    adaptive[0]["settings"]["adaptive"] = True
    for i, step in enumerate(step_events(adaptive)):
        step["draft"] = {"k": 2 if i % 2 else 4, "stop": "low confidence" if i % 2 else "K reached"}
    row = comparison_rows([runs[0], adaptive])[1]
    n = len(step_events(adaptive))
    assert row["label"] == "ngram + adaptive" and row["adaptive"]
    assert math.isclose(row["k_used"], (2 * (n // 2) + 4 * (n - n // 2)) / n)
    assert row["stops"] == {"low confidence": n // 2, "K reached": n - n // 2}


def test_acceptance_curves_are_the_measured_shares_against_alpha_to_the_i(runs):
    from visuals.drafter_families import acceptance_curves_figure

    fig = acceptance_curves_figure(runs)
    measured, theory = by_role(fig, "measured"), by_role(fig, "theory")
    assert [t.meta["label"] for t in measured] == ["ngram", "int8"] == [t.meta["label"] for t in theory]
    for line, curve, trace in zip(measured, theory, runs[1:]):
        s = run_summary(trace)
        assert list(line.y) == [r for r in s["acceptance_by_position"] if r is not None]
        assert all(math.isclose(y, s["position_acceptance"] ** x) for x, y in zip(curve.x, curve.y))
    only_baseline = acceptance_curves_figure(runs[:1])
    assert not only_baseline.data and "only the baseline" in only_baseline.layout.annotations[0].text.replace(
        "<br>", " "
    )


def test_surface_marks_each_drafter_at_its_measured_c_and_alpha(runs):
    from visuals.drafter_families import comparison_rows, speedup_surface_figure

    fig = speedup_surface_figure(runs)
    surface = by_role(fig, "surface")[0]
    k = surface.meta["k"]
    assert k == max(r["k"] for r in comparison_rows(runs)[1:])
    j, i = len(surface.y) // 2, len(surface.x) // 3  # any grid point: the surface is the formula's
    assert math.isclose(surface.z[j][i], wall_clock_speedup(surface.y[j], k, surface.x[i]))
    assert by_role(fig, "break_even")
    points = {t.meta["label"]: t for t in by_role(fig, "drafter")}
    for row in comparison_rows(runs)[1:]:
        point = points[row["label"]]
        assert (point.x[0], point.y[0]) == (row["cost"], row["alpha"])
        assert f"{row['speedup']:.2f}× measured" in point.text[0]
    assert not speedup_surface_figure(runs[:1]).data


@pytest.mark.parametrize(
    "args, message",
    [
        (("  ", ["none", "ngram"], 4, 64, True), "Type a prompt"),
        (("Hi", ["none"], 4, 64, True), "at least one drafter"),
        (("Hi", ["medusa"], 4, 64, True), "Unknown drafter"),
        (("Hi", ["ngram"], 0, 64, True), "K"),
        (("Hi", ["ngram"], 4, 10**6, True), "Max new tokens"),
    ],
)
def test_bad_input_warns_and_runs_nothing(args, message):
    from app.labs import drafters

    with pytest.warns(UserWarning, match=message):
        outputs = list(drafters.run_drafters(*args))
    assert len(outputs) == 1 and outputs[0][0].startswith("⚠") and message in outputs[0][0]


def test_example_fills_the_prompt():
    from app.examples import load_examples
    from app.labs import drafters

    example = load_examples()[0]
    assert drafters.pick_example(example["name"]) == example["prompt"]


# ------------------------------------------------------------------------------ the real model
PROMPT = "Add a docstring to this Python function. Reply with the full function.\n\ndef add(a, b):\n    return a + b\n"


@pytest.mark.slow
def test_lab_runs_every_drafter_for_real_and_measures_against_the_baseline():
    from app.engine_access import get_engine
    from app.labs import drafters

    outputs = list(drafters.run_drafters(PROMPT, list(drafters.DRAFTERS), 3, 16, True))
    status, table, curves, surface, families = outputs[-1]
    plan, notes = drafters.plan_runs(get_engine(), [d for d in drafters.DRAFTERS if d != drafters.BASELINE])
    assert [row[0] for row in table] == [label for label, _, _ in plan]
    rows = {row[0]: row for row in table}
    assert rows["none"][4] == "1.00×"
    for label in ("ngram", "suffix", "int8", "q4"):
        tokens_per_pass, alpha, cost, speedup, _, tok_s = rows[label][1:7]
        values = [float(tokens_per_pass), float(alpha), float(cost), float(speedup.rstrip("×")), float(tok_s)]
        assert all(math.isfinite(v) for v in values) and values[0] >= 1.0 and 0 <= values[1] <= 1, rows[label]
    # One run each is no verdict: the two fastest were raced against the baseline in alternating pairs, and a
    # "fastest" is named only when its interval clears the runner-up's.
    assert "Done" in status and "alternating pairs" in status and "one run each" in status
    assert ("Fastest on this prompt" in status) != ("No clear fastest" in status), status
    if "eagle" not in rows:  # the engine does not offer it (yet): its own message says why
        assert "**eagle** is not run:" in status
    assert {t.meta["label"] for t in by_role(surface, "drafter")} >= {"ngram", "int8"}
    assert {t.meta["label"] for t in by_role(curves, "measured")} >= {"ngram", "int8"}
    assert "n-gram" in families and "int8" in families and "q4 self-drafting" in families


@pytest.mark.slow
def test_a_failing_drafter_reports_its_message_and_stop_ends_the_comparison():
    from app.engine_access import get_engine
    from app.labs import drafters
    from app.stopping import new_run_id, request_stop

    engine = get_engine()
    settings = drafters._settings(drafters._checked(PROMPT, ["ngram"], 2, 8, True))
    plan = [("none", "none", {}), ("broken", "ngram:99", {}), ("ngram", "ngram", {})]
    *_, (status, traces, failures) = drafters.compare(engine, PROMPT, plan, settings)
    assert status is None and "n-gram sizes" in failures["broken"]
    assert list(traces) == ["none", "ngram"] and run_summary(traces["ngram"])["drafter"] == "ngram"
    table = drafters._table(traces, failures, plan)
    assert table[1][0] == "broken" and table[1][-1].startswith("✗") and table[2][4].endswith("×")

    run_id = new_run_id()
    request_stop(run_id)
    *_, (status, traces, _) = drafters.compare(engine, PROMPT, plan, settings, run_id)
    assert status.startswith("■ Stopped") and traces == {}


def test_labels_of_nearby_points_are_stacked_not_overlapped():
    """A drafter and its adaptive variant land almost on each other: their labels go one above
    the other (the higher α on top; below the axis' top edge), a lone point keeps the middle."""
    from visuals.drafter_families import label_positions

    rows = [
        dict(cost=0.01, alpha=0.60),  # ngram
        dict(cost=0.012, alpha=0.62),  # ngram adaptive
        dict(cost=0.65, alpha=0.97),  # int8, near the top
        dict(cost=0.66, alpha=0.96),  # int8 adaptive
        dict(cost=0.10, alpha=0.20),  # eagle, alone
    ]
    assert label_positions(rows, c_max=0.8) == [
        "bottom right",
        "top right",
        "middle left",
        "bottom left",
        "middle right",
    ]


def test_the_lab_opens_on_its_recorded_real_run():
    """Before anyone presses Run all the lab shows the recorded comparison of its defaults on the first
    example (scripts/record_traces.py): the baseline first, then every default drafter and its adaptive
    variant, each row measured against that baseline, and both figures drawn from those traces."""
    from app.examples import load_examples
    from app.labs.drafters import BASELINE, DEFAULTS, initial_outputs, recorded_run

    traces, plan = recorded_run()
    expected = [BASELINE] + [
        f"{d}{suffix}" for d in DEFAULTS["drafters"] if d != BASELINE for suffix in ("", " + adaptive")
    ]
    assert list(traces) == expected and [label for label, _, _ in plan] == expected
    prompt = load_examples()[0]["prompt"]
    for trace in traces.values():
        start = trace[0]
        assert start["prompt"] == prompt and start["settings"]["k"] == DEFAULTS["k"]
        assert start["settings"]["max_new_tokens"] == DEFAULTS["max_new"] and start["settings"]["temperature"] == 0.0
    status, table, curves, surface, families = initial_outputs()
    assert status.startswith("**Recorded run**") and "Run all" in status
    assert [row[0] for row in table] == expected and all(row[-1] != "not run" for row in table)
    assert len(by_role(surface, "drafter")) == len(expected) - 1
    assert "EAGLE head" in families and "n-gram" in families


def test_a_crowd_of_points_gets_one_label_listing_them_all():
    """n-gram and suffix, with and without adaptive depth, land on one (c, α): one label names the four,
    where stacked single labels ran into each other."""
    from visuals.drafter_families import label_positions, point_labels

    rows = [
        dict(label=name, cost=0.001, alpha=1.0, speedup=s)
        for name, s in zip(["a", "b", "c", "d"], [2.5, 2.4, 2.6, 2.5])
    ]
    rows.append(dict(label="int8", cost=0.6, alpha=1.0, speedup=1.2))
    texts = point_labels(rows, c_max=0.8)
    assert sum(bool(t) for t in texts[:4]) == 1 and all(name in "".join(texts) for name in "abcd")
    assert texts[4] == "int8: 1.20× measured"
    assert label_positions(rows, c_max=0.8)[0] == "bottom right"
