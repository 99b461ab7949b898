"""One definition each: c, the speedup aggregations and the decisions read from them live in engine.metrics.

The functions are tested on real inputs (the recorded traces in assets/traces, the results of
engine.metrics' own comparisons, real chi-square tests), the bench's and the vLLM batch report's numbers
are checked to be engine.metrics' (no server, no model: their aggregation steps on recorded runs), and a
scan of engine/, app/, visuals/ and scripts/ finds no c or speedup defined anywhere else.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

from engine.metrics import (
    DRAFT_COST_RATIO_MEANS,
    DRAFT_TOKEN_COST_MEANS,
    compare_speedups,
    draft_cost_ratio,
    draft_ms_per_position,
    draft_token_cost,
    draft_token_cost_of,
    fastest,
    median,
    median_of_ratios,
    paired_ratios,
    ratio_bounds,
    ratio_of_medians,
    run_summary,
    summarize_steps,
    top_speedups,
    trace_k,
    wide_pass_cost,
)
from engine.trace import finish_event, load, start_event, step_events

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "assets" / "traces"


@pytest.fixture(scope="module")
def recorded():
    """The recorded code-edit pair: the baseline and n-gram runs of one prompt."""
    return {name: load(TRACES / f"code-edit-{name}-greedy.json") for name in ("baseline", "ngram")}


# ---------------------------------------------------------------------------------------------- c
def test_the_run_alone_c_is_the_finish_metric_recorded_traces_keep(recorded):
    """draft_cost_ratio: mean drafting time per drafting pass ÷ (K × mean target pass); the recorded finish
    metric is that, recomputed from the trace's own steps, and run_summary reads it under the same key."""
    trace = recorded["ngram"]
    steps, k = step_events(trace), trace_k(start_event(trace))
    drafting = [s for s in steps if s.get("drafted")]
    mean_draft = sum(s["draft_ms"] for s in drafting) / len(drafting)
    mean_verify = sum(s["verify_ms"] for s in drafting) / len(drafting)
    assert draft_cost_ratio(mean_draft, mean_verify, k) == pytest.approx(mean_draft / (k * mean_verify))
    recorded_c = finish_event(trace)["metrics"]["draft_cost_ratio"]
    assert run_summary(trace)["draft_cost_ratio"] == recorded_c
    assert summarize_steps(steps, k, 1.0)["draft_cost_ratio"] == pytest.approx(recorded_c)
    # K·c + 1 is the run's own (drafting + verification) ÷ verification per pass.
    assert k * recorded_c + 1 == pytest.approx((mean_draft + mean_verify) / mean_verify)
    assert draft_cost_ratio(None, mean_verify, k) is None and draft_cost_ratio(mean_draft, mean_verify, 0) is None
    # The per-position draft time the Batch lab takes is the same numerator.
    summary = run_summary(trace)
    assert draft_ms_per_position(summary) == pytest.approx(summary["mean_draft_ms"] / k)
    assert draft_ms_per_position(summary) / summary["mean_verify_ms"] == pytest.approx(recorded_c)


def test_the_baseline_c_is_one_formula_from_steps_or_from_totals(recorded):
    """draft_token_cost (steps) and draft_token_cost_of (totals, the bench's) give the same c."""
    steps, base_steps = step_events(recorded["ngram"]), step_events(recorded["baseline"])
    total_draft = sum(s["draft_ms"] for s in steps)
    drafted = sum(s["drafted"] for s in steps)
    base_pass = sum(s["verify_ms"] for s in base_steps) / len(base_steps)
    c = draft_token_cost(steps, base_steps)
    assert c == draft_token_cost_of(total_draft, drafted, base_pass)
    assert c == pytest.approx(total_draft / drafted / base_pass)
    assert draft_token_cost(base_steps, base_steps) is None  # nothing drafted
    assert draft_token_cost_of(total_draft, drafted, None) is None
    # The two meanings differ in their unit (the run's own wide pass against the baseline's one-token pass).
    assert "baseline" in DRAFT_TOKEN_COST_MEANS and "baseline" not in DRAFT_COST_RATIO_MEANS
    assert "K ×" in DRAFT_COST_RATIO_MEANS


def test_the_bench_row_reads_c_and_its_speedups_from_engine_metrics(recorded):
    """The bench's aggregation over the recorded runs (as its _timed reads a finish event): its draft_cost is
    the Drafters lab's c on the same runs, and its speedup is the ratio of the repeats' median tok/s."""
    from engine.tools.bench import _aggregate

    def run(trace, wall_s):
        m = finish_event(trace)["metrics"]
        keys = ("new_tokens", "accepted", "drafted", "draft_s", "verify_s")
        return {**{key: m[key] for key in keys}, "wall_s": wall_s, "passes": m["target_passes"], "pass_path": None}

    base_walls, ngram_walls = [1.40, 1.52, 1.47], [0.44, 0.41, 0.60]
    samples = {
        ("engine-baseline", "code-edit"): [run(recorded["baseline"], w) for w in base_walls],
        ("engine-ngram", "code-edit"): [run(recorded["ngram"], w) for w in ngram_walls],
    }
    machine = {"roofline_passes_per_s": 100.0, "copy_bandwidth_gbs": 40.0}
    rows = {r["system"]: r for r in _aggregate(samples, machine, None)}
    tokens = finish_event(recorded["ngram"])["metrics"]["new_tokens"]
    base_tokens = finish_event(recorded["baseline"])["metrics"]["new_tokens"]
    want = median([tokens / w for w in ngram_walls]) / median([base_tokens / w for w in base_walls])
    assert rows["engine-ngram"]["speedup_vs_engine_baseline"] == pytest.approx(want)
    assert rows["engine-baseline"]["speedup_vs_engine_baseline"] == pytest.approx(1.0)
    assert rows["engine-ngram"]["speedup_vs_hf_generate"] is None  # no hf-generate row
    c = draft_token_cost(step_events(recorded["ngram"]), step_events(recorded["baseline"]))
    assert rows["engine-ngram"]["draft_cost"] == pytest.approx(c, rel=1e-6)
    assert "draft_cost" not in rows["engine-baseline"]


# ------------------------------------------------------------------------------------ aggregations
def test_ratio_of_medians_is_each_sides_median_first():
    assert ratio_of_medians([3.0, 1.0, 2.0], [1.0, 4.0]) == pytest.approx(2.0 / 2.5)
    assert ratio_of_medians([10.0, 12.0, 100.0], [5.0, 6.0, 1.0]) == pytest.approx(12.0 / 5.0)  # outliers ignored
    assert ratio_of_medians([], [1.0]) is None and ratio_of_medians([1.0], []) is None
    assert ratio_of_medians([1.0], [0.0]) is None
    assert ratio_of_medians([0.0], [2.0]) == 0.0


def test_ratio_bounds_pair_the_worst_and_the_best_repeats():
    assert ratio_bounds((8.0, 12.0), (9.0, 10.0)) == pytest.approx((0.8, 12.0 / 9.0))
    assert ratio_bounds((8.0, 12.0), (0.0, 10.0)) == (None, None)


def test_median_of_ratios_is_the_median_of_each_pairs_ratio():
    """compare_speedups' speedup is median_of_ratios over paired_ratios, not a ratio of medians: on pairs
    whose machine drifted between pairs the two differ, and the paired one follows each pair's ratio."""
    pairs = [
        ({"tokens_per_s": base, "tokens_per_pass": 1.0}, {"tokens_per_s": spec, "tokens_per_pass": 2.0})
        for base, spec in ((100, 150), (50, 80), (60, 90), (100, 140), (40, 70))
    ]
    ratios = paired_ratios(pairs)
    assert ratios == pytest.approx([1.5, 1.6, 1.5, 1.4, 1.75])
    assert median_of_ratios(ratios) == pytest.approx(1.5)
    assert compare_speedups(pairs)["speedup"] == median_of_ratios(ratios)
    assert ratio_of_medians([150, 80, 90, 140, 70], [100, 50, 60, 100, 40]) == pytest.approx(90 / 60)
    assert median_of_ratios([]) is None
    assert compare_speedups(pairs)["ceiling"] == pytest.approx(2.0)


# ----------------------------------------------------------------------------------------- decisions
def _pairs(base_tok_s: float, spec_tok_s: list[float]) -> list[tuple[dict, dict]]:
    base = {"tokens_per_s": base_tok_s, "tokens_per_pass": 1.0, "mean_verify_ms": 10.0}
    return [(base, {"tokens_per_s": s, "tokens_per_pass": 3.0}) for s in spec_tok_s]


def test_fastest_is_named_only_when_its_interval_clears_the_others():
    clear = {
        "int8": compare_speedups(_pairs(100, [120, 125, 118, 122, 121])),
        "ngram": compare_speedups(_pairs(100, [150, 160, 155, 158, 152])),
    }
    found = fastest(clear)
    assert found["ranked"] == ["ngram", "int8"]
    assert found["verdict"] == "fastest" and found["fastest"] == "ngram" and found["runner_up"] == "int8"
    assert found["busy"] is None
    overlap = {
        "int8": compare_speedups(_pairs(100, [120, 150, 118, 140, 121])),
        "ngram": compare_speedups(_pairs(100, [150, 160, 125, 158, 130])),
    }
    found = fastest(overlap)
    assert found["verdict"] == "no clear fastest" and found["fastest"] is None and found["runner_up"] == "int8"
    few = {"ngram": clear["ngram"], "int8": compare_speedups(_pairs(100, [120, 125]))}  # no interval for int8
    assert fastest(few)["verdict"] == "no clear fastest"
    alone = fastest({"ngram": clear["ngram"]})
    assert alone["verdict"] is None and alone["ranked"] == ["ngram"]
    busy = {**clear, "int8": {**clear["int8"], "busy": {"busy": True, "reason": "the runs got 50% of the cores"}}}
    assert fastest(busy)["busy"] == "the runs got 50% of the cores"


def test_top_speedups_picks_the_runs_to_measure_again():
    assert top_speedups({"ngram": 1.4, "int8": 1.1, "eagle": None, "suffix": 1.6}) == ["suffix", "ngram"]
    assert top_speedups({"ngram": 1.4, "int8": 1.1}, 1) == ["ngram"]
    assert top_speedups({"eagle": None}) == []


def test_the_wider_pass_is_called_cheaper_only_outside_the_noise():
    def cost(one, wide, spread_one=None, spread_wide=None):
        times = {"pass_ms_1": [one], "pass_ms_k1": [wide]}
        if spread_one:
            times.update(spread_ms_1=[spread_one], spread_ms_k1=[spread_wide])
        return wide_pass_cost(times)

    noisy = cost(20.0, 15.0, [12.0, 30.0], [11.0, 25.0])
    assert noisy["pass_cost"] == [0.75] and noisy["pass_cost_finding"] == ["same"]
    assert noisy["pass_cost_bounds"][0] == pytest.approx((11.0 / 30.0, 25.0 / 12.0))
    assert cost(20.0, 12.0, [19.5, 21.0], [11.5, 12.5])["pass_cost_finding"] == ["cheaper"]
    assert cost(10.0, 15.0, [9.0, 11.0], [14.0, 16.0])["pass_cost_finding"] == ["dearer"]
    plain = cost(10.0, 15.0)
    assert plain["pass_cost_bounds"] == [None] and plain["pass_cost_finding"] == [None]


def test_the_exactness_verdict_reads_a_real_chi_square_test():
    from engine.tools.exactness import TEST_LEVEL, chi_square_test, exactness_verdict

    p = {0: 0.5, 1: 0.3, 2: 0.2}
    fits = chi_square_test(Counter({0: 250, 1: 150, 2: 100}), p, 500)
    off = chi_square_test(Counter({0: 100, 1: 150, 2: 250}), p, 500)
    assert fits["pvalue"] >= TEST_LEVEL > off["pvalue"]
    assert exactness_verdict(fits) == "consistent with p"
    assert exactness_verdict(off).startswith("differs from p (unexpected")
    assert exactness_verdict(off, lossy=True) == "differs from p: the shortcut is lossy"
    assert "raise N" in exactness_verdict(fits, lossy=True)
    assert exactness_verdict(None) == "not run"
    assert "nothing to test" in exactness_verdict(chi_square_test(Counter({0: 10}), {0: 1.0}, 10))


# ----------------------------------------------------------------------------------- vLLM batches
def _batch_run(tok_per_s: float, tokens: list[list[int]]) -> dict:
    """One batch as engine.vllm.batch._run_batch returns it."""
    n = sum(len(t) for t in tokens)
    return {
        "wall_s": n / tok_per_s,
        "tokens": n,
        "tok_per_s": tok_per_s,
        "latencies_s": [n / tok_per_s] * len(tokens),
        "drafted": 8,
        "accepted": 6,
        "token_ids": tokens,
    }


def test_vllm_batch_speedups_are_ratios_of_medians_with_their_bounds():
    from engine.vllm.batch import _greedy_mismatches, _speedups

    same = [[1, 2, 3]]
    runs = {
        ("baseline", 1): [_batch_run(t, same) for t in (10.0, 11.0, 9.0)],
        ("speculative", 1): [_batch_run(t, same) for t in (20.0, 22.0, 19.0)],
        ("baseline", 2): [_batch_run(t, same * 2) for t in (20.0, 21.0, 19.0)],
        ("speculative", 2): [_batch_run(t, [[1, 2, 3], [1, 2, 4]]) for t in (20.0, 23.0, 18.0)],
    }
    result = _speedups(runs, [1, 2], "speculative", "baseline")
    assert result["speedup"] == pytest.approx([2.0, 1.0])
    assert result["speedup"][0] == ratio_of_medians([20.0, 22.0, 19.0], [10.0, 11.0, 9.0])
    assert result["speedup_bounds"][0] == pytest.approx((19.0 / 11.0, 22.0 / 9.0))
    assert result["speculation_pays_up_to"] == 1
    assert "pays up to" not in result["verdict"] and "B = 2" in result["verdict"] and "no verdict" in result["verdict"]
    mismatches = _greedy_mismatches(runs, [1, 2], "speculative", "baseline")
    assert {(m["batch"], m["request"], m["first_difference_at"]) for m in mismatches} == {(2, 1, 2)}
    assert len(mismatches) == 3  # one per repeat


def test_vllm_batch_verdicts():
    from engine.vllm.batch import _verdict

    assert _verdict([1, 2], [(1.2, 1.4), (1.1, 1.3)]) == (2, "speculation pays at every batch size measured")
    assert _verdict([1, 2], [(0.7, 0.9), (0.6, 0.8)]) == (None, "speculation does not pay at B = 1")
    pays, words = _verdict([1, 2, 4], [(1.2, 1.4), (0.9, 1.1), (0.7, 0.8)])
    assert pays == 1 and words.startswith("speculation pays up to B = 1, not from B = 4") and "B = 2" in words


def test_vllm_batch_arguments_are_checked_before_any_request():
    from engine.vllm.batch import measure_batches

    for kwargs, message in (
        ({"batch_sizes": (0,)}, "batch sizes"),
        ({"repeats": 0}, "repeats"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ):
        with pytest.raises(ValueError, match=message):
            measure_batches({"baseline": "http://127.0.0.1:9"}, ["Hi"], **kwargs)
    with pytest.raises(ValueError, match="no prompts"):
        measure_batches({"baseline": "http://127.0.0.1:9"}, [])
    with pytest.raises(ValueError, match="no servers"):
        measure_batches({}, ["Hi"])


# ------------------------------------------------------------------------ one definition, one place
# A definition of c or of a speedup: a value with a division bound to a name (a variable, a key, an
# attribute, a keyword, a function's return) that names a speedup, a cost ratio or their bounds; or a
# division of a throughput by a throughput, or of a drafting time by a pass time, wherever it stands.
DEFINED_NAME = re.compile(r"speedup|^c$|draft_cost|cost_ratio|token_cost|pass_cost|bounds", re.IGNORECASE)
THROUGHPUT = re.compile(r"tok(en)?s?_per_s\b|\btok_s\b|_tps\b|\btps\b")
DRAFT_TIME = re.compile(r"draft_ms|draft_s\b")
PASS_TIME = re.compile(r"pass_ms|verify_ms|verify_s\b")
SCANNED = ("engine", "app", "visuals", "scripts")
HOME = "engine/metrics.py"
# Definitions in files this change does not own, each with what is to become of it; an entry must be
# removed once its file no longer defines one (the test says so).
KNOWN_ELSEWHERE: dict[str, str] = {}


def _bound_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value if isinstance(node.slice.value, str) else None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _has_division(node) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) for n in ast.walk(node))


def _bindings(node) -> list[tuple]:
    """(what is bound, its value) pairs of one syntax node."""
    if isinstance(node, ast.Assign):
        return [(t, node.value) for t in node.targets]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
        return [(node.target, node.value)]
    if isinstance(node, ast.Dict):
        return [(k, v) for k, v in zip(node.keys, node.values) if k is not None]
    if isinstance(node, ast.keyword) and node.arg:
        return [(ast.Name(id=node.arg), node.value)]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        returns = [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value is not None]
        return [(ast.Name(id=node.name), value) for value in returns]
    return []


def definitions(source: str) -> list[str]:
    """Every definition of c or of a speedup in `source`, as "line: what"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target, value in _bindings(node):
            name = _bound_name(target)
            if name and DEFINED_NAME.search(name) and _has_division(value):
                found.append(f"{value.lineno}: {name} = {ast.unparse(value)[:80]}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            left, right = ast.unparse(node.left), ast.unparse(node.right)
            if (THROUGHPUT.search(left) and THROUGHPUT.search(right)) or (
                DRAFT_TIME.search(left) and PASS_TIME.search(right)
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


# What this change took out of bench.py and vllm/batch.py, and the like: the scan must see each.
FORMER_DEFINITIONS = [
    'r["speedup_vs_engine_baseline"] = r["tok_per_s"] / base["tok_per_s"] if base else None',
    'r["draft_cost"] = r["draft_ms_per_token"] / base["pass_ms"]',
    'slowdown = round(tps["off"] / tps["reduced"] - 1.0, 4)',
    "speedup = [s / b if b else None for s, b in zip(spec_tps, base_tps)]",
    "bounds = [(s_lo / b_hi, s_hi / b_lo) for s_lo, s_hi, b_lo, b_hi in rows]",
    "c = draft_ms / drafted / pass_ms",
    'per_c = summary["mean_draft_ms"] / summary["mean_verify_ms"]',
    "def my_speedup(a, b):\n    return a / b",
]
NOT_DEFINITIONS = [
    "speedup = measured_speedup(base, run)",
    'passes_per_s = row["tok_per_s"] / row["tokens_per_pass"]',
    'ms = 1000.0 * sum(r["verify_s"] for r in runs) / passes',
    'text = f"{speedup:.2f}x"',
]


@pytest.mark.parametrize("source", FORMER_DEFINITIONS)
def test_the_scan_sees_a_definition(source):
    assert definitions(source), source


@pytest.mark.parametrize("source", NOT_DEFINITIONS)
def test_the_scan_leaves_reading_and_showing_alone(source):
    assert not definitions(source), source


def test_c_and_speedups_are_defined_in_engine_metrics_only():
    found = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            hits = definitions(path.read_text(encoding="utf-8"))
            if hits and rel != HOME:
                found[rel] = hits
    assert definitions((ROOT / HOME).read_text(encoding="utf-8"))  # the scan does see the definitions at home
    stray = {rel: hits for rel, hits in found.items() if rel not in KNOWN_ELSEWHERE}
    assert not stray, f"c or a speedup defined outside {HOME}: call engine.metrics instead: {stray}"
    fixed = set(KNOWN_ELSEWHERE) - set(found)
    assert not fixed, f"no longer defines c or a speedup: remove from KNOWN_ELSEWHERE: {sorted(fixed)}"
