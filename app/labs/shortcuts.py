"""The Shortcuts lab: lossy verification against lossless, each with what it buys and what it costs, measured.

Every row samples the first tokens after one prompt N times with real drafts and real target passes; only the
test of the drafts differs (engine.tools.shortcuts: the exact rule, block verification, and the shortcuts users
meet in serving stacks). Each row reports tokens per target pass (what the rule buys) and the distance of its
samples from the target's exact p (what it costs: total variation with a bootstrap interval, the chi-square
p-value, the engine's verdict). visuals.lab_figures.shortcuts_figure draws both.
"""

from __future__ import annotations

import time

import gradio as gr

from engine.tools.exactness import TEST_LEVEL, tv_interval, tv_noise_floor
from engine.tools.shortcuts import DEFAULT_THRESHOLD, DEFAULT_WEIGHT, ROWS, RULES, row_id, run_rule, tokens_gain
from visuals.lab_figures import fmt_pvalue, shortcuts_figure

from ..config import MAX_LAB_SAMPLES
from ..engine_access import get_engine, is_loaded, use_drafter
from ..inputs import number, seed_or_random
from ..stopping import ProgressReporter, Stopped
from . import durations, panels

__all__ = ["SHORTCUTS_DEFAULTS", "build_tab", "run_shortcuts"]

INPUTS = ["prompt", "temperature", "top_k", "k", "topk", "n", "seed", "weight", "threshold", "rows", "tokens"]
OUTPUTS = ["status", "plot", "table"]

SHORTCUTS_PROMPTS = ["Pick a number from 1 to 10.", "Name a planet.", "Name a fruit.", "Hi!"]
SHORTCUTS_DEFAULTS = {
    "prompt": "Pick a number from 1 to 10.",
    "temperature": 0.6,
    "top_k": 8,
    "k": 2,
    "topk": 2,
    "n": 600,
    "weight": DEFAULT_WEIGHT,
    "threshold": DEFAULT_THRESHOLD,
    "tokens": 2,
}
# The verdict beside the rule it judges: on a phone the table scrolls sideways and shows its first columns.
HEADERS = [
    "rule [drafter]",
    "verdict",
    "tokens per pass",
    "vs exact rule",
    "TV from p (95% spread)",
    "p-value",
    "where you meet it",
]
TEMPERATURE_RANGE = (0.05, 2.0)
TOP_K_RANGE = (2, 50)
MAX_K, MAX_TREE_TOPK = 4, 4

SHORTCUTS_TEXT = f"""
**Shortcuts: what a lossy verifier buys, and what it costs.** Serving stacks and papers relax the acceptance
rule to keep more drafts. Each row below samples the **first two tokens** of the answer N times, every sample
real drafts and one or more real target passes on this machine, exactly like the Lossless lab; only the test of
the drafts differs. For each row the lab measures **tokens per target pass** (what the rule buys) and the
**distance of its samples from the target's exact p** (what it costs: the total-variation distance with the
central 95% of its bootstrap redraws, and a chi-square test; below p-value {TEST_LEVEL:g} the samples are called
different from p). The exact rows' distance is not zero: N samples of p itself are that far from p by noise; the
dashed line in the chart is that noise floor, simulated from p.

* **Exact rule**: keep a draft with min(1, p/q), else draw from norm(max(0, p − q)). **Block verification**
  (vLLM's `block`): a chain's whole prefix by a joint ratio; exact too, and never fewer tokens *in expectation*
  (a few hundred samples can still show it a little below the exact rule: sampling noise, like the distances).
  A noise floor is a 95% line: one exact run in twenty lands above it, which is why the verdict is the chi-square
  test's, not the line's.
* **q dropped**: keep with min(1, p): the drafter's q left out of the ratio.
* **Drafter's temperature dropped**: drafts drawn at your temperature, tested with the drafter's q at T = 1.
* **Static ensemble (w)**: keep with min(1, 1 − w + w·p/q); its output is w·p + (1 − w)·q, not p
  (transformers' proposed `assistant_ensemble_weight`).
* **Accept threshold (t)**: keep with min(1, p/(t·q)) (SGLang's `--speculative-accept-threshold-acc` below 1).
* **Greedy matching at T > 0**: keep a draft only when it is the target's most likely token.

Which drafter each row uses is part of the lesson. The q-term shortcuts run with **int8**, whose q is close to
p (drafts accepted ~95% of the time): leaving q out, or using the wrong one, shows there. The ensemble and the
threshold run with **eagle**, whose q is far from p here (about half accepted): with int8 they neither buy nor
cost much, because they only change what happens where q and p differ. Each shortcut's gain is read against
the exact rule **with the same drafter**.
"""


# ------------------------------------------------------------------------------------------ text
def _row_label(key: str, drafter: str, lab: dict) -> str:
    name = RULES[key].name
    if key == "ensemble":
        name += f", w = {lab['weight']:g}"
    if key == "threshold":
        name += f", t = {lab['threshold']:g}"
    return f"{name} [{drafter}]"


def _table(lab: dict, results: dict) -> list[list]:
    rows = []
    for index, (key, drafter) in enumerate(lab["rows"], start=1):
        res = results.get(row_id(key, drafter))
        gain = tokens_gain(results, key, drafter)
        test = res["test"] if res else None
        rows.append(
            [
                f"{index}. {_row_label(key, drafter, lab)}",
                res["verdict"] if res else "not run",
                "—" if not res else f"{res['tokens_per_pass']:.2f}",
                "—" if gain is None else f"{gain:+.0%}",
                "—" if not res else f"{test['tv']:.3f} ({res['tv_low']:.3f}–{res['tv_high']:.3f})",
                "—" if not test else fmt_pvalue(test["pvalue"]),
                RULES[key].where,
            ]
        )
    return rows


def _points(lab: dict, results: dict) -> list[dict]:
    points = []
    for index, (key, drafter) in enumerate(lab["rows"], start=1):
        res = results.get(row_id(key, drafter))
        if res is None:
            continue
        points.append(
            {
                "number": index,
                "label": _row_label(key, drafter, lab),
                "exact": RULES[key].exact,
                "tokens_per_pass": res["tokens_per_pass"],
                "tv": res["test"]["tv"],
                "tv_low": res["tv_low"],
                "tv_high": res["tv_high"],
                "verdict": res["verdict"],
            }
        )
    return points


def _pvalue_words(pvalue: float | None, outside: int = 0) -> str:
    """The p-value against the level that decides ("p-value 0.0375 ≥ 0.001"): a class reading 0.0375 beside
    "consistent with p" sees why, without knowing the lab's level. A p-value of exactly 0 says why: `outside`
    samples that p gives no chance at all (then no sampler of p could have drawn them), or one below what a
    float holds."""
    if pvalue is None:
        return "no p-value"
    if pvalue == 0:
        why = (
            f"{outside} sample{'' if outside == 1 else 's'} p gives no chance at all"
            if outside
            else "below 1e-300, the smallest a float holds"
        )
        return f"p-value 0 < {TEST_LEVEL:g} ({why})"
    return f"p-value {fmt_pvalue(pvalue)} {'≥' if pvalue >= TEST_LEVEL else '<'} {TEST_LEVEL:g}"


def _above_floor(res: dict, floor: float) -> str:
    """Words for a row that the test finds consistent with p though its TV is above the 95% noise floor (one
    exact run in twenty is): the test decides, not the line."""
    test = res["test"]
    if test["pvalue"] is None or test["pvalue"] < TEST_LEVEL or test["tv"] <= floor:
        return ""
    return f", above the {floor:.3f} noise floor as one exact run in twenty is: the test decides"


def _summary(lab: dict, results: dict, seconds: float) -> str:
    lines = [
        f"**Done in {seconds:.0f} s** ({len(results)} rows × {lab['n']} real samples, seed {lab['seed']}; K = "
        f"{lab['k']}, tree top-k {lab['topk']}, temperature {lab['temperature']:g}, top-k {lab['top_k']}). "
        f"An exact sampler's TV from p at N = {lab['n']} stays below **{lab['floor']:.3f}** in 95% of runs "
        "(simulated from p): the noise floor.",
        "",
    ]
    for key, drafter in lab["rows"]:
        res = results.get(row_id(key, drafter))
        if res is None:
            continue
        gain = tokens_gain(results, key, drafter)
        bought = "" if gain is None else f", {gain:+.0%} tokens per pass against the exact rule with {drafter}"
        lines.append(
            f"* **{_row_label(key, drafter, lab)}: {res['verdict']}** (TV {res['test']['tv']:.3f}"
            f"{_above_floor(res, lab['floor'])}, {_pvalue_words(res['test']['pvalue'], res['test'].get('outside', 0))}"
            f"{bought})."
        )
    lines += [
        "",
        "*Measured:* the samples and their tokens per pass (real drafts and target passes, now). *Computed:* the "
        "exact p from the target's logits, the distances, their intervals and the chi-square p-values.",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- run
def _checked(prompt, temperature, top_k, k, topk, n, seed, weight, threshold, rows, tokens) -> dict:
    if not isinstance(prompt, str) or not prompt.strip():
        raise gr.Error("Type a prompt (or pick one): the lab samples the tokens that follow it.")
    chosen = [row for row in ROWS if row_id(*row) in rows] if rows is not None else list(ROWS)
    if not chosen or (rows is not None and set(rows) - {row_id(*row) for row in ROWS}):
        raise gr.Error("Pick at least one rule to run.")
    return {
        "prompt": prompt,
        "temperature": number(temperature, "Temperature", *TEMPERATURE_RANGE),
        "top_k": number(top_k, "Top-k", *TOP_K_RANGE, integer=True),
        "k": number(k, "K", 1, MAX_K, integer=True),
        "topk": number(topk, "Tree top-k", 1, MAX_TREE_TOPK, integer=True),
        "n": number(n, "Samples N", panels.MIN_SAMPLES, MAX_LAB_SAMPLES, integer=True),
        "seed": seed_or_random(seed),
        "weight": number(weight, "Ensemble weight w", 0.05, 1.0),
        "threshold": number(threshold, "Accept threshold t", 0.05, 1.0),
        "rows": chosen,
        "tokens": number(tokens, "Tokens tested", 1, max(panels.TOKENS_TESTED), integer=True),
    }


def run_shortcuts(
    prompt,
    temperature,
    top_k,
    k,
    topk,
    n,
    seed,
    weight=DEFAULT_WEIGHT,
    threshold=DEFAULT_THRESHOLD,
    rows=None,
    tokens=SHORTCUTS_DEFAULTS["tokens"],
    run_id: str = "",
    progress=gr.Progress(),  # noqa: B008 (gradio injects the tracker)
):
    """Generator: each chosen row's samples against the exact p. rows: row ids (``row_id``), None = all.
    Yields (status markdown, figure, table rows) after each row."""
    lab = _checked(prompt, temperature, top_k, k, topk, n, seed, weight, threshold, rows, tokens)
    if not is_loaded("default", "auto"):
        yield "Loading the model (once per server)…", gr.skip(), gr.skip()
    engine = get_engine("default", "auto", progress)
    yield "Preparing the drafters (built on first use)…", gr.skip(), gr.skip()
    for drafter in sorted({d for _, d in lab["rows"]}):
        use_drafter(engine, drafter)
    settings = {"temperature": lab["temperature"], "top_k": lab["top_k"]}
    p = panels.exact_law(engine, lab["prompt"], lab["tokens"], lab["seed"], settings)
    lab["floor"] = tv_noise_floor(p, lab["n"], seed=lab["seed"])
    results: dict[str, dict] = {}
    started = time.perf_counter()
    for index, (key, drafter) in enumerate(lab["rows"]):
        step = f"{index + 1}/{len(lab['rows'])} {_row_label(key, drafter, lab)}"
        yield f"{step}: sampling {lab['n']}…", gr.skip(), gr.skip()
        # The bar's percentage is the whole lab's; the count is this row's samples, and the words say so.
        row = f"row {index + 1} of {len(lab['rows'])}, samples of this row"
        tracker = ProgressReporter(progress, row, run_id, offset=index / len(lab["rows"]), share=1 / len(lab["rows"]))
        try:
            res = run_rule(
                engine,
                lab["prompt"],
                key,
                p,
                drafter=drafter,
                n=lab["n"],
                n_tokens=lab["tokens"],
                k=lab["k"],
                topk=lab["topk"],
                temperature=lab["temperature"],
                top_k=lab["top_k"],
                seed=lab["seed"],
                weight=lab["weight"],
                threshold=lab["threshold"],
                progress=tracker,
            )
        except Stopped:
            yield (
                f"■ Stopped during {_row_label(key, drafter, lab)}. The results cover the rows that finished.",
                shortcuts_figure(_points(lab, results), lab["n"], lab["floor"]),
                _table(lab, results),
            )
            return
        except ValueError as exc:
            raise gr.Error(str(exc)) from None
        res["tv_low"], res["tv_high"] = tv_interval(res["counts"], p, lab["n"], seed=lab["seed"])
        results[row_id(key, drafter)] = res
        yield (
            f"{step}: done in {res['seconds']:.1f} s.",
            shortcuts_figure(_points(lab, results), lab["n"], lab["floor"]),
            _table(lab, results),
        )
    seconds = time.perf_counter() - started
    durations.record("shortcuts", seconds, len(results) * lab["n"])
    yield _summary(lab, results, seconds), gr.skip(), gr.skip()


# ---------------------------------------------------------------------------------------- layout
def _controls() -> dict:
    d = SHORTCUTS_DEFAULTS
    c = panels.sampling_controls(
        "sc",
        SHORTCUTS_PROMPTS,
        d,
        "The lab samples the first tokens of the answer.",
        "Samples N (per rule)",
        "Each sample is one or more real target passes.",
    )
    c["rows"] = gr.CheckboxGroup(
        [(f"{RULES[key].name} [{drafter}]", row_id(key, drafter)) for key, drafter in ROWS],
        value=[row_id(*row) for row in ROWS],
        label="Rules to run",
        info="Each costs N samples.",
        elem_id="sc-rows",
    )
    with gr.Row():
        c["weight"] = gr.Slider(0.05, 1.0, d["weight"], step=0.05, label="Ensemble weight w", min_width=140)
        c["threshold"] = gr.Slider(0.05, 1.0, d["threshold"], step=0.05, label="Accept threshold t", min_width=140)
    c["temperature"] = gr.Slider(
        *TEMPERATURE_RANGE,
        d["temperature"],
        step=0.05,
        label="Temperature",
        info="At T = 1 the drafter's temperature cannot be dropped: the shortcut is then the exact rule.",
    )
    c["top_k"] = gr.Slider(*TOP_K_RANGE, d["top_k"], step=1, label="Top-k")
    panels.draft_shape_controls(c, d, MAX_K, MAX_TREE_TOPK)
    return c


# Before any run on this server, the defaults' duration as recorded (docs/bench/2026-12-07-notes-from-app.md).
RECORDED_TIME = "about 2 minutes measured 2026-12-04 on a 2-core AMD EPYC, longer when other work holds the cores"
waiting_status = panels.WaitingStatus(
    "shortcuts", len(ROWS) * SHORTCUTS_DEFAULTS["n"], RECORDED_TIME, " under every rule"
)
refresh_status = waiting_status.refresh


def _results() -> dict:
    empty = {"rows": list(ROWS), "weight": DEFAULT_WEIGHT, "threshold": DEFAULT_THRESHOLD}
    widths = ["24%", "16%", "8%", "8%", "12%", "8%", "24%"]
    table = panels.results_table(
        _table(empty, {}), HEADERS, "Each rule against the exact p", widths, "sc-table", rows=len(ROWS)
    )
    return panels.sampling_results("sc", waiting_status, "What each rule buys and what it costs", table)


def build_tab() -> gr.Tab:
    def wire(c: dict, out: dict) -> None:
        panels.wire_sampling_lab(c, out, run_shortcuts, INPUTS, OUTPUTS, waiting_status)

    return panels.lab_tab("Shortcuts lab", "shortcuts", SHORTCUTS_TEXT, _controls, _results, wire)
