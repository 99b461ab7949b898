"""The labs tabs (app/labs/): the calculator and toy sampler without a model, each lab's handler end to end
on the real default model with small settings, and bad input answered with a clear message."""

from __future__ import annotations

import math
import re
from pathlib import Path

import gradio as gr
import pytest


def plain(text: str | None) -> str:
    """A figure's title or subtitle as one line (titles are wrapped with <br> to fit phone screens)."""
    return (text or "").replace("<br>", " ")


def _last(generator):
    """Run a streaming handler to the end; return its last output tuple and every output seen."""
    outputs = list(generator)
    assert outputs, "the handler yielded nothing"
    return outputs[-1], outputs


def _is_skip(value) -> bool:
    return isinstance(value, dict) and value.get("__type__") == "update" and len(value) == 1


# ------------------------------------------------------------------------------- no model needed
@pytest.mark.parametrize("alpha, k, c", [(0.7, 4, 0.1), (0.95, 12, 0.0), (0.0, 1, 1.0), (0.5, 3, 0.3)])
def test_calculator_figure_shows_the_formula(alpha, k, c):
    from app.labs import explain

    fig, note = explain.calculator(alpha, k, c, None)
    chosen = [t for t in fig.data if (t.meta or {}).get("role") == "chosen_k"]
    assert chosen, "no chosen-K marker in the calculator figure"
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert chosen[0].meta["k"] == k
    assert math.isclose(chosen[0].meta["value"], expected, rel_tol=1e-3)
    assert math.isclose(chosen[1].meta["value"], expected / (k * c + 1), rel_tol=1e-3)
    assert f"{expected:.3f}" in note and "No Playground run" in note


def test_calculator_uses_the_last_playground_run_but_not_a_recorded_one():
    from app.labs import batch, explain
    from app.traces import DEFAULT_TRACE, load_recorded

    recorded = load_recorded(DEFAULT_TRACE)
    fig, note = explain.calculator(0.7, 4, 0.1, recorded)
    assert not [t for t in fig.data if (t.meta or {}).get("role") == "measured"]
    assert "No Playground run" in note
    mine = [dict(e) for e in recorded]
    mine[0] = {**mine[0], "started_at": 1.0, "run_id": "mine"}
    fig, note = explain.calculator(0.7, 4, 0.1, mine)
    measured = [t for t in fig.data if (t.meta or {}).get("role") == "measured"]
    assert measured and "measured" in note
    alpha, k, c, fig2, note2, seen = explain.explain_refresh(mine, "", 0.5, 2, 0.0)
    assert seen == "mine" and 1 <= k <= 12 and 0 <= alpha <= 0.99
    assert all(_is_skip(v) for v in explain.explain_refresh(mine, "mine", 0.5, 2, 0.0))
    chain = [dict(e) for e in load_recorded("code-edit-ngram-greedy.json")]  # the Batch lab takes a chain's numbers
    chain[0] = {**chain[0], "started_at": 1.0, "run_id": "mine"}
    k, alpha, draft_ms, note, seen, source = batch.batch_refresh(chain, "", 4, 0.7, 0)
    assert seen == "mine" and draft_ms >= 0 and "last Playground run" in note
    # n-gram matches shorter than K: the note says why this lab's E exceeds the run's measured tokens per pass
    assert f"assumes K = {k} drafts on every pass" in note and "drafted 7.43 on average" in note
    assert source.startswith("your Playground run (") and f"K = {k}" in source
    again = batch.batch_refresh(chain, "mine", 4, 0.7, 0, source)  # the same run: nothing changes
    assert again[4] == "mine" and all(_is_skip(v) for i, v in enumerate(again) if i != 4)
    # a tree run (the Workshop's step 7 before step 10): a chain model takes neither its α nor its time per depth
    tree = [dict(e) for e in mine]
    tree[0] = {**tree[0], "run_id": "tree"}
    k, alpha, draft_ms, note, seen, source = batch.batch_refresh(tree, "mine", 6, 0.9, 40.0, source)
    assert (k, alpha, draft_ms, seen, source) == (4, 0.7, 0, "tree", batch.TREE_SOURCE) and "drafted a tree" in note


def test_calculator_bad_input_warns_and_changes_nothing():
    from app.labs import explain

    with pytest.warns(UserWarning, match="between"):
        out = explain.calculator(1.5, 4, 0.1, None)
    assert all(_is_skip(v) for v in out)


def test_toy_sampler_converges_to_p_and_counts_add_up():
    from app.labs import explain
    from engine.tools.exactness import toy_sampling

    tokens, p, q = explain.parse_toy_table(explain.TOY_DEFAULT)
    counts = toy_sampling(p, q, n=1000, seed=1)
    assert sum(counts["accepted"]) + sum(counts["resampled"]) == 1000
    for pv, a, r in zip(p, counts["accepted"], counts["resampled"]):
        assert abs((a + r) / 1000 - pv) < 0.05
    # Only tokens with p > q can come out of the residual.
    for pv, qv, r in zip(p, q, counts["resampled"]):
        if pv <= qv:
            assert r == 0
    assert abs(sum(counts["accepted"]) / 1000 - sum(min(a, b) for a, b in zip(p, q))) < 0.05
    fig, text = explain.run_toy(explain.TOY_DEFAULT, 1)
    names = [t.name for t in fig.data]
    assert any("accepted" in n for n in names) and any("resampled" in n for n in names)
    assert "1000 samples" in text and "= 1000" in text


@pytest.mark.parametrize(
    "table, message",
    [
        ([["a", 0, 0.5], ["b", 0, 0.5]], "all zero"),
        ([["a", -0.1, 0.5], ["b", 1, 0.5]], "negative"),
        ([["a", "x", 0.5], ["b", 1, 0.5]], "must be a number"),
        ([["a", 1, 0.5]], "at least two"),
    ],
)
def test_toy_sampler_rejects_bad_tables_with_a_warning(table, message):
    from app.labs import explain

    with pytest.warns(UserWarning, match=message):
        fig, text = explain.run_toy(table, 0)
    assert _is_skip(fig) and message in text


def test_chi_square_pools_small_cells_and_flags_samples_off_support():
    from engine.tools.exactness import chi_square_test

    p = {1: 0.5, 2: 0.3, 3: 0.15, 4: 0.03, 5: 0.02}
    exact = chi_square_test({1: 50, 2: 30, 3: 15, 4: 3, 5: 2}, p, 100)
    assert exact["pvalue"] > 0.99 and exact["tv"] < 1e-9 and exact["cells"] == 4  # 4 and 5 pooled (5 expected)
    off = chi_square_test({1: 50, 2: 30, 3: 15, 9: 5}, p, 100)
    assert off["pvalue"] == 0.0 and off["outside"] == 5
    single = chi_square_test({1: 10}, {1: 0.99, 2: 0.01}, 10)
    assert single["pvalue"] is None


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda L: L.lossless.run_lossless("", 1.0, 8, "int8", 1, 2, 300, 0), "prompt"),
        (lambda L: L.lossless.run_lossless("Hi!", 0, 8, "int8", 1, 2, 300, 0), "Temperature"),
        (lambda L: L.lossless.run_lossless("Hi!", 1.0, 8, "int8", 1, 2, 10**6, 0), "Samples"),
        (lambda L: L.lossless.run_lossless("Hi!", 1.0, 8, "model:x", 1, 2, 300, 0), "ngram, suffix, int8, q4 or eagle"),
        (lambda L: L.lossless.run_lossless("Hi!", 1.0, 8, "int8", 1, 2, 300, 0, []), "at least one sampler"),
        (lambda L: L.parity.run_parity("", "ngram", "float32", 8, 4, False), "at least one prompt"),
        (lambda L: L.parity.run_parity("a\n" * 30, "ngram", "float32", 8, 4, False), "At most"),
        (lambda L: L.parity.run_parity("Hi", "ngram", "float16", 8, 4, False), "dtype"),
        (lambda L: L.parity.run_parity("Hi", "none", "float32", 8, 4, False), "Choose a drafter"),
        (lambda L: L.batch.run_batch(4, 0.7, [], 0, 1), "at least one batch size"),
        (lambda L: L.batch.run_batch(4, 1.5, [1], 0, 1), "α"),
        (lambda L: L.batch.run_batch(4, 0.7, [1, 100], 0, 1), "between 1 and 64"),
    ],
)
def test_bad_lab_input_fails_fast_with_a_clear_error(call, message):
    import app.labs.batch
    import app.labs.lossless
    import app.labs.parity

    with pytest.raises(gr.Error, match=message):
        next(iter(call(app.labs)))


# ------------------------------------------------------------------------------ the real model
def _column(name: str) -> int:
    from app.labs.lossless import LOSSLESS_HEADERS

    return LOSSLESS_HEADERS.index(name)


P_VALUE, VERDICT = _column("p-value"), _column("verdict")


def _final_table(outputs) -> dict:
    """The Lossless lab's last table, by sampler name (without the drafter tag)."""
    return {row[0].split(" [")[0]: row for row in [o[2] for o in outputs if not _is_skip(o[2])][-1]}


@pytest.mark.slow
def test_lossless_lab_passes_the_exact_sampler_and_catches_the_broken_one():
    """N = 300 real samples of the first two tokens per sampler with the tab's defaults (pairs, int8, K = 2,
    two drafts per guess). Plain sampling is left out to save time: it is the engine's baseline, tested in
    test_real_model.py."""
    from app.labs import lossless

    d = lossless.LOSSLESS_DEFAULTS
    run = lossless.run_lossless(
        d["prompt"], d["temperature"], d["top_k"], "int8", d["k"], d["topk"], 300, 0, ["exact", "broken"]
    )
    (status, fig, rows), outputs = _last(run)
    final_fig = [o[1] for o in outputs if not _is_skip(o[1])][-1]
    table = _final_table(outputs)
    exact, broken = table[lossless.SAMPLERS["exact"]], table[lossless.SAMPLERS["broken"]]
    assert float(exact[P_VALUE]) > 1e-3, table
    assert float(broken[P_VALUE]) < 1e-3, table
    assert exact[VERDICT] == "consistent with p" and "the shortcut is lossy" in broken[VERDICT]
    assert table[lossless.SAMPLERS["plain"]][VERDICT] == "not run"
    bars = [t for t in final_fig.data if (t.meta or {}).get("role") in lossless.SAMPLERS]
    assert len(bars) == 2 and all(abs(sum(b.y) - 1.0) < 1e-9 for b in bars)
    assert "Done" in status and "Measured" in status


@pytest.mark.slow
def test_lossless_lab_runs_block_verification_and_it_is_exact():
    """Block verification (ticked by choice, not in the default run) samples the same drafter's chain of K drafts
    kept by their joint ratio: consistent with p, as the exact rule; the first token only, to save time."""
    from app.labs import lossless

    d = lossless.LOSSLESS_DEFAULTS
    assert "block" not in lossless.DEFAULT_SAMPLERS
    run = lossless.run_lossless(
        d["prompt"], d["temperature"], d["top_k"], "int8", d["k"], d["topk"], 300, 0, ["block"], 1
    )
    (status, _, _), outputs = _last(run)
    table = _final_table(outputs)
    block = table[lossless.SAMPLERS["block"]]
    assert float(block[P_VALUE]) > 1e-3 and block[VERDICT] == "consistent with p", table
    assert table[lossless.SAMPLERS["exact"]][VERDICT] == "not run" and "Done" in status


@pytest.mark.slow
def test_lossless_lab_offers_the_eagle_head_and_it_is_exact():
    """The learned head is a drafter of the Lossless lab like the others (#29): its exact sampler's samples
    are consistent with p. The first token only (the two-token law with the head is test_eagle.py's)."""
    from app.labs import lossless

    d = lossless.LOSSLESS_DEFAULTS
    run = lossless.run_lossless(
        d["prompt"], d["temperature"], d["top_k"], "eagle", d["k"], d["topk"], 300, 0, ["exact"], 1
    )
    (status, _, _), outputs = _last(run)
    table = _final_table(outputs)
    exact = table[lossless.SAMPLERS["exact"]]
    assert float(exact[P_VALUE]) > 1e-3 and exact[VERDICT] == "consistent with p", table
    assert "Done" in status and "eagle" in status


@pytest.mark.slow
def test_parity_lab_streams_identical_rows_in_float32():
    from app.labs import parity

    prompts = parity.default_parity_prompts(2)
    (status, rows), outputs = _last(parity.run_parity(prompts, "ngram", "float32", 8, 4, False))
    assert len(rows) == 2
    assert all(row[-1] == "✓ identical" for row in rows), rows
    assert "2 identical" in status and "0 real mismatches" in status
    streamed = [o[1] for o in outputs if not _is_skip(o[1])]
    assert [len(r) for r in streamed][:2] == [1, 2]  # a row per prompt as soon as it finishes


@pytest.mark.slow
def test_batch_lab_measures_pass_times_and_computes_throughput():
    from app.labs import batch

    (status, fig, rows, measured), _ = _last(batch.run_batch(3, 0.7, [2, 1], 0.5, 1))
    assert [row[0] for row in rows] == [1, 2]
    assert rows[0][1].endswith("×")  # the speedup beside its batch size
    assert all(float(row[2].split()[0]) > 0 and float(row[3].split()[0]) > 0 for row in rows)
    assert len(fig.data) >= 2 and all(len(t.y) == 2 for t in fig.data)
    assert "measured on this machine" in status and "computed" in status
    assert f"come from {batch.TYPED_SOURCE}" in status  # where α and the draft time came from, named
    # One verdict: the status and the figure's title say the same thing.
    verdict = plain(fig.layout.title.text).split(": ", 1)[1]
    assert verdict in status
    # Moving α recomputes at once from the same pass times (nothing is measured again).
    status2, fig2, rows2 = batch.recompute(measured, 3, 0.05, 0.5, "your Playground run (q4, K = 3, run 12:00:00)")
    assert "come from your Playground run (q4, K = 3, run 12:00:00)" in status2
    assert [r[2] for r in rows2] == [r[2] for r in rows]  # the same measured pass times
    assert plain(fig2.layout.title.text).split(": ", 1)[1] in status2 and "α = 0.05" in status2
    assert "Measure" in batch.recompute(measured, 4, 0.7, 0.5)[0]  # a new K needs new pass times


def test_the_batch_lab_never_calls_a_wider_pass_cheaper_from_noise():
    """The issue's "a pass over K + 1 = 5 tokens per row costs 0.75x a pass over one token": the cost comes
    with the repeats' spread, and a spread across 1 is the same cost within noise (engine.metrics'
    wide_pass_cost finds it, batch_throughputs carries it, the lab words it)."""
    from app.labs.batch import _cost_words
    from engine.metrics import batch_throughputs, wide_pass_cost

    def words(times):
        return _cost_words({**times, **wide_pass_cost(times)}, 1, 4)

    noisy = {"pass_ms_1": [20.0], "pass_ms_k1": [15.0], "spread_ms_1": [[12.0, 30.0]], "spread_ms_k1": [[11.0, 25.0]]}
    said = words(noisy)
    assert "0.75×" in said and "0.37–2.08× across the repeats" in said and "same cost within" in said
    steady = {"pass_ms_1": [20.0], "pass_ms_k1": [12.0], "spread_ms_1": [[19.5, 21.0]], "spread_ms_k1": [[11.5, 12.5]]}
    assert "matrix library" in words(steady)
    wider = {"pass_ms_1": [10.0], "pass_ms_k1": [15.0], "spread_ms_1": [[9.0, 11.0]], "spread_ms_k1": [[14.0, 16.0]]}
    assert words(wider).endswith("across the repeats)")
    # What the lab's status reads is batch_throughputs' result: the same finding.
    result = batch_throughputs({**steady, "batch_sizes": [1], "k": 4}, 0.7, 0.0)
    assert result["pass_cost_finding"] == ["cheaper"] and "matrix library" in _cost_words(result, 1, 4)
    assert _cost_words(batch_throughputs({**steady, "spread_ms_1": None, "batch_sizes": [1], "k": 4}, 0.7), 1, 4)


def test_the_labs_show_the_engines_decisions():
    """The Drafters lab's fastest drafter and the Lossless lab's verdicts come from engine functions
    (engine.metrics.fastest, engine.tools.exactness.exactness_verdict): the labs only word them."""
    from app.labs import drafters, lossless
    from engine.metrics import compare_speedups, fastest
    from engine.tools.exactness import chi_square_test, exactness_verdict

    def pairs(spec_tok_s):
        base = {"tokens_per_s": 100.0, "tokens_per_pass": 1.0, "mean_verify_ms": 10.0}
        return [(base, {"tokens_per_s": s, "tokens_per_pass": 3.0}) for s in spec_tok_s]

    clear = {
        "int8": compare_speedups(pairs([120, 125, 118, 122, 121])),
        "ngram": compare_speedups(pairs([150, 160, 155, 158, 152])),
    }
    assert fastest(clear)["fastest"] == "ngram"
    assert "Fastest on this prompt: **ngram** (its interval clears int8's)." in drafters._spread_verdict(clear)
    overlap = {"int8": clear["int8"], "ngram": compare_speedups(pairs([150, 160, 110, 158, 130]))}
    assert fastest(overlap)["verdict"] == "no clear fastest"
    assert "No clear fastest: ngram's and int8's intervals overlap" in drafters._spread_verdict(overlap)
    busy = {**clear, "int8": {**clear["int8"], "busy": {"busy": True, "reason": "the runs got 50% of the cores"}}}
    assert "⚠ The machine was busy (the runs got 50% of the cores)" in drafters._spread_verdict(busy)
    p = {0: 0.5, 1: 0.3, 2: 0.2}
    off = chi_square_test({0: 100, 1: 150, 2: 250}, p, 500)
    for kind in lossless.SAMPLERS:
        assert lossless._verdict(kind, off) == exactness_verdict(off, lossy=kind == "broken")
    assert lossless._verdict("broken", off) == "differs from p: the shortcut is lossy"


def test_a_lab_promises_the_time_its_runs_took_on_this_server():
    """#40: promised times are measured here (the range of the last runs, scaled to the defaults' samples, with the
    load), and until a run has finished here the recorded time says it was recorded elsewhere."""
    from app.labs import durations, lossless, shortcuts

    durations.clear()
    try:
        assert "recorded elsewhere" in lossless.waiting_status() and "2026-12-02" in lossless.waiting_status()
        durations.record("lossless", 12.0, 300)  # 40 ms per sample
        durations.record("lossless", 24.0, 300)  # 80 ms per sample
        text = durations.promise("lossless", 900, "unused")
        assert text.startswith("36 s–72 s for 900 samples, measured on this server (its last 2 runs"), text
        assert "measured on this server" in lossless.waiting_status()
        # Entering the tab refreshes a waiting status, never a run's results.
        assert lossless.refresh_status(lossless.waiting_status()) == lossless.waiting_status()
        assert _is_skip(lossless.refresh_status("**Done in 40 s** (900 real samples…"))
        assert "recorded elsewhere" in shortcuts.waiting_status()  # each lab its own runs
    finally:
        durations.clear()


def test_the_recorded_gpu_passes_are_those_of_their_log():
    """The GPU picture in Explain quotes its record (assets/recorded/h200-pass-times.json): every figure in it is
    in the log it names, for the drafter it names."""
    from app.labs import explain

    gpu = explain.GPU_RECORD
    log = (Path(__file__).resolve().parent.parent / gpu["source"].split(" ")[0]).read_text()
    medians = {
        name: [float(m) for m in re.findall(rf"^{name}\s+run [123]:.*median\s+([\d.]+)", log, re.MULTILINE)]
        for name in ("none", "ngram")
    }
    assert sorted(gpu["one_token_pass_ms"]) == sorted(medians["none"])
    assert sorted(gpu["ngram_verify_pass_ms"]) == sorted(medians["ngram"])
    assert f"/ {gpu['copy_bandwidth_gb_s']} GB/s copy bandwidth" in log
    assert gpu["recorded"] in gpu["source"]


@pytest.mark.slow
def test_explain_measures_pass_widths_here_beside_the_recorded_gpu():
    from app.labs import explain

    outputs = list(explain.measure_pass_widths())
    fig, text = outputs[-1]
    cpu = fig.data[-1]
    assert list(cpu.x) == list(range(1, explain.PASS_WIDTHS + 1)) and all(ms > 0 for ms in cpu.y)
    assert text.startswith("**Measured on this machine now**") and "Recorded on a GPU" in text, text
    assert "GB/s this machine reads (measured now)" in text
    assert len(fig.data) == 3  # the GPU's band and one-token point, this CPU's line
