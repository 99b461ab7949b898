"""The labs: hands-on tabs that run the real engine on the real default model and say what was measured.

* **Explain**: the algorithm with rendered formulas, a live speedup calculator (theory, with the last
  Playground run as a measured point) and a toy worked example sampled 1000 times with the engine's own
  sampling functions.
* **Lossless lab**: thousands of real next-token samples from plain sampling, speculative sampling and a
  deliberately broken verifier, tested against the target's exact p (chi-square, total variation).
* **Parity lab**: greedy speculative output against the greedy baseline, prompt by prompt, with the
  divergence diagnosis of `engine.parity`.
* **Batch lab**: target pass times measured now for several batch sizes; throughputs computed from them.

Each tab is built by a `build_*_tab` function called from `ui.build_demo` inside its `gr.Tabs()`; the
handlers are plain functions (generators for the long runs) so tests can call them directly. Long runs
share the `model-runs` concurrency group with the Playground and Race, and stop cooperatively like them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections import Counter
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go

from . import handlers as h
from .figures import message
from .state import REGISTRY

log = logging.getLogger("speclens.app")

__all__ = [
    "build_explain_tab",
    "build_lossless_tab",
    "build_parity_tab",
    "build_batch_tab",
    "calculator",
    "toy_sampling",
    "run_toy",
    "run_lossless",
    "run_parity",
    "run_batch",
    "chi_square_test",
]

ASSETS = Path(__file__).resolve().parent.parent / "assets"
MAX_RUNS = int(os.environ.get("SPECLENS_MAX_CONCURRENT_RUNS", "2"))
MAX_LAB_SAMPLES = max(100, int(os.environ.get("SPECLENS_MAX_LAB_SAMPLES", "2000")))
MAX_PARITY_PROMPTS = 20
TEST_LEVEL = 1e-3  # one threshold for every chi-square verdict in the labs
PRIVATE = {"api_visibility": "private"}
LATEX = [
    {"left": "$$", "right": "$$", "display": True},
    {"left": "$", "right": "$", "display": False},
]


class _Stopped(Exception):
    """Raised from a progress callback when the user pressed Stop."""


def _engine(dtype: str = "auto", progress=None):
    """The shared default engine for `dtype` (loaded once per server), errors as gr.Error."""
    return h._get_engine("default", dtype, progress)


def _with_drafter(engine, drafter: str):
    """Validate the drafter (allowlist included) and build its shared weights, errors as gr.Error."""
    return h._run_engine(engine, drafter)


def _number(value, name: str, lo: float, hi: float, integer: bool = False) -> float:
    """A finite number in [lo, hi] from a UI value, else gr.Error naming the field."""
    if isinstance(value, bool) or value is None or (isinstance(value, str) and not value.strip()):
        raise gr.Error(f"{name} is missing: enter a number between {lo:g} and {hi:g}.")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise gr.Error(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(number) or not lo <= number <= hi:
        raise gr.Error(f"{name} must be between {lo:g} and {hi:g}, got {value!r}.")
    if integer:
        if number != int(number):
            raise gr.Error(f"{name} must be a whole number, got {value!r}.")
        return int(number)
    return number


def _seed(value) -> int:
    if value is None or (isinstance(value, str) and not value.strip()):
        return random.SystemRandom().randrange(2**31)
    seed = _number(value, "Seed", -1, 2**31 - 1, integer=True)
    return random.SystemRandom().randrange(2**31) if seed < 0 else seed


class _Throttle:
    """Calls progress(i/n) at most every `interval` s; raises _Stopped when the run id was stopped."""

    def __init__(self, progress, desc: str, run_id: str, offset: float = 0.0, share: float = 1.0, interval=0.25):
        self.progress, self.desc, self.run_id = progress, desc, run_id
        self.offset, self.share, self.interval = offset, share, interval
        self.next = 0.0

    def __call__(self, done: int, total: int) -> None:
        if h.stop_requested(self.run_id):
            raise _Stopped
        now = time.perf_counter()
        if self.progress is None or (now < self.next and done < total):
            return
        self.next = now + self.interval
        try:
            self.progress(self.offset + self.share * done / max(total, 1), desc=f"{self.desc}: {done}/{total}")
        except Exception:
            pass


def _style():
    from visuals.style import PALETTE, SERIES, apply_layout, show_token

    return PALETTE, SERIES, apply_layout, show_token


# --------------------------------------------------------------------------- the last Playground run
def _is_recorded(trace) -> bool:
    """True for one of the recorded traces (what the Playground shows before anyone runs anything)."""
    if not trace:
        return False
    stamp = trace[0].get("started_at")
    for name in h.recorded_traces():
        try:
            if h.load_recorded(name)[0].get("started_at") == stamp:
                return True
        except (gr.Error, IndexError, OSError, ValueError):
            continue
    return False


def last_run(trace) -> tuple[dict | None, str]:
    """(run_summary of the session's last real speculative Playground run or None, a sentence saying which)."""
    if not trace or _is_recorded(trace):
        return None, "No Playground run in this session yet: run one and come back to see it here."
    try:
        from visuals import run_summary

        s = run_summary(trace)
    except Exception as exc:  # a malformed trace never breaks the tab
        log.exception("run_summary failed")
        return None, f"Your last Playground run cannot be summarised ({type(exc).__name__})."
    if s.get("mode") == "baseline" or not s.get("drafted"):
        return (
            None,
            "Your last Playground run drafted nothing (a baseline run, or nothing to copy), so it has no α to show.",
        )
    s["run_id"] = str(trace[0].get("run_id") or trace[0].get("started_at"))
    return s, (
        f"Your last Playground run ({s.get('drafter')}, K = {s['k']}"
        + (f", tree top-k {s['tree_topk']}" if s.get("tree_topk", 1) > 1 else "")
        + f"): α = {s['acceptance_rate']:.3f}, {s['tokens_per_pass']:.2f} tokens per target pass (measured)."
    )


# ---------------------------------------------------------------------------------------- Explain
EXPLAIN_TEXT = r"""
### The algorithm in three steps
A cheap **drafter** proposes a token $x$ drawn from its distribution $q$. The **target** computes its own
distribution $p$ at the same position, in the same pass that checks the draft. Then:

1. **Accept** the draft with probability $\min\left(1, \dfrac{p(x)}{q(x)}\right)$.
2. **Otherwise** reject it and draw a replacement from the **residual**
   $r = \operatorname{norm}\big(\max(0,\ p - q)\big)$, that is
   $r(y) = \dfrac{\max(0,\ p(y) - q(y))}{\sum_z \max(0,\ p(z) - q(z))}$.
3. After the last accepted draft the pass adds one more token drawn from $p$ (the **bonus**), so a pass
   always emits at least one token.

### Why the output follows $p$ exactly
A token $x$ comes out either as an accepted draft or as a resampled token:

$$P(\text{emit } x) \;=\; \underbrace{q(x)\,\min\!\left(1, \tfrac{p(x)}{q(x)}\right)}_{=\ \min(p(x),\ q(x))} \;+\; P(\text{reject})\; r(x),
\qquad P(\text{reject}) = 1 - \sum_y \min(p(y), q(y)) = \sum_y \max(0,\ p(y) - q(y)).$$

The normaliser of $r$ is exactly $P(\text{reject})$, so they cancel:

$$P(\text{emit } x) \;=\; \min(p(x), q(x)) + \max(0,\ p(x) - q(x)) \;=\; p(x).$$

Nothing is approximated: however bad the drafter, every emitted token is distributed as the target's own
sample. A bad drafter only costs speed (more rejections).

### How many tokens per target pass
If each of the $K$ drafts in a chain is accepted with probability $\alpha$ (independently), a pass emits the
accepted prefix plus one more token:

$$E[\text{tokens per pass}] \;=\; 1 + \alpha + \alpha^2 + \dots + \alpha^K \;=\; \frac{1 - \alpha^{K+1}}{1 - \alpha}.$$

If one draft token costs $c$ target passes, a pass with $K$ drafts costs $K c + 1$, so the wall-clock speedup
is $E / (K c + 1)$. This assumes a target pass over $K + 1$ tokens costs as much as a pass over one token;
the **Batch lab** measures when that stops being true.
"""

CALC_TEXT = (
    "### Speedup calculator\n"
    "Move the sliders: the curves are **computed** from the formulas above (theory). The star is **measured**: "
    "your last Playground run in this session (its α, K and tokens per target pass)."
)

TOY_TEXT = (
    "### A toy example, sampled for real\n"
    "Five made-up tokens with a target distribution **p** and a drafter distribution **q** (edit them: any "
    "non-negative numbers; each column is normalised to sum to 1). **Sample 1000 times** runs exact speculative "
    "sampling with the engine's own functions (`engine.sampling`): draw x from q, accept with min(1, p/q) "
    "(`verify_children`), otherwise draw from the residual. The bars split what came out into accepted drafts "
    "and resampled tokens: together they land on p, even where q is far from p."
)

TOY_DEFAULT = [
    ["cat", 0.40, 0.15],
    ["dog", 0.25, 0.45],
    ["fish", 0.20, 0.10],
    ["bird", 0.10, 0.25],
    ["frog", 0.05, 0.05],
]


def calculator(alpha, k, c, trace=None) -> tuple[go.Figure, str]:
    """(speedup_figure for the sliders with the session's last run as the measured point, a note)."""
    try:
        alpha = _number(alpha, "α", 0.0, 0.99)
        k = _number(k, "K", 1, 12, integer=True)
        c = _number(c, "c", 0.0, 1.0)
    except gr.Error as exc:
        gr.Warning(str(exc))
        return gr.skip(), gr.skip()
    summary, note = last_run(trace)
    measured = None
    if summary is not None:
        measured = {
            "alpha": summary["acceptance_rate"],
            "k": max(1, int(summary["k"])),
            "tokens_per_pass": summary["tokens_per_pass"],
        }
    from .figures import figure

    fig = figure("speedup_figure", alpha, k, c, measured)
    e = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    text = (
        f"**Computed** for α = {alpha:.2f}, K = {k}, c = {c:.2f}: E = (1 − α^(K+1)) / (1 − α) = **{e:.3f}** tokens "
        f"per target pass, speedup E / (K·c + 1) = **{e / (k * c + 1):.2f}×**.  \n**Measured:** {note}"
    )
    if summary is not None and summary.get("tree_topk", 1) > 1:
        text += " (A tree run: its tokens per pass can beat the chain formula, which counts one branch.)"
    return fig, text


def explain_refresh(trace, seen: str, alpha, k, c):
    """Entering the Explain tab: when a new Playground run exists, set the sliders to its α, K and c."""
    summary, _ = last_run(trace)
    if summary is None or summary["run_id"] == seen:
        return (gr.skip(),) * 6  # nothing new: keep what the user set
    alpha = round(min(0.99, max(0.0, summary["acceptance_rate"])), 2)
    k = int(min(12, max(1, summary["k"])))
    if summary.get("draft_cost_ratio") is not None:
        c = round(min(1.0, max(0.0, summary["draft_cost_ratio"])), 2)
    gr.Info("Calculator set to your last Playground run: its α, K and c (c estimated from its timings).")
    fig, text = calculator(alpha, k, c, trace)
    return alpha, k, c, fig, text, summary["run_id"]


def _toy_table(table) -> tuple[list[str], list[float], list[float]]:
    """Parse and validate the toy table (rows: token, p, q); raises ValueError with a plain message."""
    rows = table.values.tolist() if hasattr(table, "values") and not isinstance(table, dict) else table
    if isinstance(table, dict):
        rows = table.get("data") or []
    if not rows or len(rows) < 2:
        raise ValueError("The table needs at least two tokens.")
    if len(rows) > 12:
        raise ValueError("Keep the toy example small: at most 12 tokens.")
    tokens, ps, qs = [], [], []
    for i, row in enumerate(rows):
        row = list(row) + [None] * (3 - len(row))
        name = str(row[0]).strip() if row[0] is not None and str(row[0]).strip() not in ("", "nan") else f"t{i + 1}"
        values = []
        for column, value in (("p", row[1]), ("q", row[2])):
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"Row {i + 1} ({name}): {column} must be a number, got {value!r}.") from None
            if not math.isfinite(number):
                raise ValueError(f"Row {i + 1} ({name}): {column} must be a finite number, got {value!r}.")
            if number < 0:
                raise ValueError(f"Row {i + 1} ({name}): {column} must not be negative, got {number:g}.")
            values.append(number)
        tokens.append(name)
        ps.append(values[0])
        qs.append(values[1])
    if len(set(tokens)) != len(tokens):
        raise ValueError("Token names must be different from each other.")
    for column, values in (("p", ps), ("q", qs)):
        if sum(values) <= 0:
            raise ValueError(f"Column {column} is all zero: give at least one token a positive value.")
    return tokens, [v / sum(ps) for v in ps], [v / sum(qs) for v in qs]


def toy_sampling(p: list[float], q: list[float], n: int = 1000, seed: int = 0) -> dict:
    """Exact speculative sampling of one token, n times, with the engine's sampling functions.

    Returns {"accepted": [count per token], "resampled": [count per token], "n": n}: draw x ~ q, verify it
    with `verify_children` (accept with min(1, p/q)), and on rejection draw from the distribution it returns
    (the residual norm(max(0, p − q))).
    """
    import torch

    from engine.sampling import sample, verify_children

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


def toy_figure(tokens: list[str], p: list[float], q: list[float], counts: dict | None) -> go.Figure:
    PALETTE, SERIES, apply_layout, show_token = _style()
    labels = [show_token(t, 14) for t in tokens]
    xs = list(range(len(tokens)))
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=xs,
            y=p,
            name="p, target (exact)",
            marker={"color": SERIES["target"]},
            offsetgroup="p",
            text=[f"{v:.3f}" for v in p],
            textposition="outside",
            hovertemplate="%{customdata}: p = %{y:.3f}<extra>target p</extra>",
            customdata=labels,
        )
    )
    if counts:
        n = max(1, counts["n"])
        acc = [a / n for a in counts["accepted"]]
        res = [r / n for r in counts["resampled"]]
        fig.add_trace(
            go.Bar(
                x=xs,
                y=acc,
                name="✓ accepted drafts (sampled)",
                marker={"color": PALETTE["accepted"]},
                offsetgroup="out",
                customdata=[[lab, a] for lab, a in zip(labels, counts["accepted"])],
                hovertemplate="%{customdata[0]}: %{customdata[1]} accepted = %{y:.3f}<extra></extra>",
            )
        )
        fig.add_trace(
            go.Bar(
                x=xs,
                y=res,
                base=acc,
                name="↻ resampled from the residual (sampled)",
                marker={"color": PALETTE["resampled"], "pattern": {"shape": "/"}},
                offsetgroup="out",
                text=[f"{a + r:.3f}" for a, r in zip(acc, res)],
                textposition="outside",
                customdata=[[lab, r] for lab, r in zip(labels, counts["resampled"])],
                hovertemplate="%{customdata[0]}: %{customdata[1]} resampled = %{y:.3f}<extra></extra>",
            )
        )
    fig.add_trace(
        go.Bar(
            x=xs,
            y=q,
            name="q, drafter (what is proposed)",
            marker={"color": SERIES["drafter"], "opacity": 0.55},
            offsetgroup="q",
            hovertemplate="%{customdata}: q = %{y:.3f}<extra>drafter q</extra>",
            customdata=labels,
        )
    )
    subtitle = (
        f"{counts['n']} samples: output frequency = accepted + resampled (stacked), next to the exact p"
        if counts
        else "press Sample 1000 times to draw real samples"
    )
    apply_layout(fig, "Toy example: p, q and what speculative sampling emits", subtitle, height=440)
    top = max(
        p
        + q
        + ([(a + r) / max(1, counts["n"]) for a, r in zip(counts["accepted"], counts["resampled"])] if counts else [])
    )
    fig.update_layout(barmode="group", bargap=0.25, bargroupgap=0.05)
    fig.update_xaxes(tickmode="array", tickvals=xs, ticktext=labels, title_text="token")
    fig.update_yaxes(title_text="probability / frequency", range=[0, min(1.08, top * 1.18 + 0.02)])
    return fig


def run_toy(table, seed=0, n: int = 1000):
    """'Sample 1000 times' -> (figure, counts text). Bad tables get a gr.Warning and change nothing."""
    try:
        tokens, p, q = _toy_table(table)
        seed = _seed(seed)
    except (ValueError, gr.Error) as exc:
        gr.Warning(str(exc))
        return gr.skip(), f"⚠ {exc}"
    counts = toy_sampling(p, q, n, seed)
    acc, res = sum(counts["accepted"]), sum(counts["resampled"])
    freq = [(a + r) / n for a, r in zip(counts["accepted"], counts["resampled"])]
    dev = max(abs(f - pv) for f, pv in zip(freq, p))
    alpha = sum(min(a, b) for a, b in zip(p, q))
    rows = "\n".join(
        f"| {tok} | {pv:.3f} | {qv:.3f} | {a} | {r} | {a + r} | {f:.3f} |"
        for tok, pv, qv, a, r, f in zip(tokens, p, q, counts["accepted"], counts["resampled"], freq)
    )
    text = (
        f"**{n} samples (seed {seed}):** {acc} accepted drafts + {res} resampled tokens = {acc + res}. "
        f"Acceptance rate {acc / n:.3f} (theory Σ min(p, q) = {alpha:.3f}). Largest gap between output "
        f"frequency and p: {dev:.3f} (sampling noise shrinks like 1/√n).\n\n"
        "| token | p | q | accepted | resampled | total | frequency |\n|---|---|---|---|---|---|---|\n" + rows
    )
    return toy_figure(tokens, p, q, counts), text


def build_explain_tab(trace_state: gr.State, max_runs: int = MAX_RUNS) -> gr.Tab:
    """The Explain tab; `trace_state` is the Playground's per-session trace (the measured point)."""
    init_fig, init_note = calculator(0.7, 4, 0.1, None)
    tokens, p, q = _toy_table(TOY_DEFAULT)
    with gr.Tab("Explain", id="explain") as tab:
        gr.Markdown(EXPLAIN_TEXT, latex_delimiters=LATEX, elem_id="ex-text", elem_classes=["sl-explain"])
        gr.Markdown(CALC_TEXT)
        with gr.Row():
            alpha = gr.Slider(0, 0.99, 0.7, step=0.01, label="α (acceptance rate)", elem_id="ex-alpha")
            k = gr.Slider(1, 12, 4, step=1, label="K (drafts per target pass)", elem_id="ex-k")
            c = gr.Slider(0, 1, 0.1, step=0.01, label="c (cost of one draft token ÷ one target pass)", elem_id="ex-c")
        calc_plot = gr.Plot(init_fig, show_label=False, elem_id="ex-calc")
        calc_note = gr.Markdown(init_note, elem_id="ex-calc-note")
        seen = gr.State("")
        gr.Markdown(TOY_TEXT)
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=300):
                toy_table = gr.Dataframe(
                    value=TOY_DEFAULT,
                    headers=["token", "p (target)", "q (drafter)"],
                    datatype=["str", "number", "number"],
                    interactive=True,
                    label="Toy p and q (editable)",
                    elem_id="ex-toy-table",
                )
                with gr.Row():
                    toy_seed = gr.Number(-1, precision=0, label="Seed", info="-1 = random", min_width=100)
                    toy_btn = gr.Button("▶ Sample 1000 times", variant="primary", elem_id="ex-toy-run")
            with gr.Column(scale=3, min_width=420):
                toy_plot = gr.Plot(toy_figure(tokens, p, q, None), show_label=False, elem_id="ex-toy-plot")
        toy_text = gr.Markdown("", elem_id="ex-toy-text")

    calc_inputs = [alpha, k, c, trace_state]
    for slider in (alpha, k, c):
        slider.input(
            calculator,
            calc_inputs,
            [calc_plot, calc_note],
            trigger_mode="always_last",
            show_progress="hidden",
            concurrency_limit=None,
            **PRIVATE,
        )
    tab.select(
        explain_refresh,
        [trace_state, seen, alpha, k, c],
        [alpha, k, c, calc_plot, calc_note, seen],
        show_progress="hidden",
        concurrency_limit=None,
        **PRIVATE,
    )
    toy_btn.click(
        run_toy,
        [toy_table, toy_seed],
        [toy_plot, toy_text],
        concurrency_limit=max_runs,
        concurrency_id="toy",
        **PRIVATE,
    )
    return tab


# ----------------------------------------------------------------------------------- Lossless lab
LOSSLESS_PROMPTS = ["Hi!", "What colour is the sky?", "Name a colour.", "Name a planet."]
LOSSLESS_DEFAULTS = {"prompt": "Hi!", "temperature": 1.0, "top_k": 8, "drafter": "int8", "k": 1, "topk": 2, "n": 300}
SAMPLERS = {
    "plain": "Plain sampling (no drafter)",
    "exact": "Speculative sampling (exact rule)",
    "broken": "Broken verifier (ignores q)",
}

LOSSLESS_TEXT = f"""
**Is speculative sampling really lossless? Sample it and test it.** Each run draws **N real samples of the next
token** after your prompt from three samplers, each sample a real target pass on this machine:
**plain sampling** (no drafter), **speculative sampling** with the exact rule (accept with min(1, p/q), else
resample from norm(max(0, p − q))), and a **deliberately broken verifier** that ignores q (accepts with
min(1, p), resamples from p itself, a tempting shortcut). The target's **exact p** is computed from one
forward pass (softmax of its logits with your temperature and top-k). A chi-square test (cells with fewer
than 5 expected samples pooled) and the total-variation distance compare each histogram with p; below
p-value {TEST_LEVEL:g} a histogram is called different from p.

The broken verifier always uses the **int8** drafter: an n-gram draft is a point mass (q = 1 on the copied
token), so accepting with min(1, p/q) or with min(1, p) is the same thing and dropping q changes nothing
for n-gram drafts. With the int8 drafter q is close to p, so the shortcut's error is small (a total-variation
distance around 0.1): the defaults (a peaked p, 2 alternative drafts per guess) make it show at N = 300;
with other prompts raise N. Only the first drafted position can decide the first token, so K = 1 is enough here.
"""


def chi_square_test(counts: dict[int, int], p: dict[int, float], n: int) -> dict:
    """Chi-square goodness of fit of `counts` (token -> count, n in total) against `p` (token -> prob > 0).

    Cells with expected count < 5 are pooled (the smallest together; a pooled cell still under 5 joins the
    smallest big cell). Samples outside the support of p make the p-value 0. Returns statistic, df, pvalue
    (None when fewer than two cells remain), tv (total variation distance) and outside (samples off support).
    """
    from scipy.stats import chisquare

    outside = sum(c for t, c in counts.items() if t not in p)
    tv = 0.5 * (sum(abs(counts.get(t, 0) / n - pt) for t, pt in p.items()) + outside / n)
    cells = sorted(((pt * n, counts.get(t, 0)) for t, pt in p.items()), reverse=True)
    big = [[e, o] for e, o in cells if e >= 5]
    small = [(e, o) for e, o in cells if e < 5]
    if small:
        pooled = [sum(e for e, _ in small), sum(o for _, o in small)]
        if pooled[0] >= 5 or not big:
            big.append(pooled)
        else:
            big[-1][0] += pooled[0]
            big[-1][1] += pooled[1]
    result = {"tv": tv, "outside": outside, "cells": len(big), "df": max(0, len(big) - 1)}
    if outside:
        return {**result, "statistic": math.inf, "pvalue": 0.0}
    if len(big) < 2:
        return {**result, "statistic": None, "pvalue": None}
    expected = [e for e, _ in big]
    observed = [o for _, o in big]
    scale = sum(observed) / sum(expected)  # equal totals up to float rounding, as scipy requires
    test = chisquare(observed, [e * scale for e in expected])
    return {**result, "statistic": float(test.statistic), "pvalue": float(test.pvalue)}


def _verdict(kind: str, test: dict | None) -> str:
    if test is None:
        return "not run"
    if test["pvalue"] is None:
        return "nothing to test: p puts (almost) all its mass on one token"
    if test["pvalue"] >= TEST_LEVEL:
        if kind == "broken":
            return "not detected at this N: its error is small here, raise N"
        return "consistent with p"
    if kind == "broken":
        return "differs from p: the shortcut is lossy"
    return "differs from p (unexpected: rerun with another seed; about 1 run in 1000 fails by chance)"


def _fmt_p(value) -> str:
    if value is None:
        return "—"
    if value == 0:
        return "0"
    return f"{value:.3g}" if value >= 1e-3 else f"{value:.2e}"


def lossless_figure(p: dict[int, float], labels: dict[int, str], results: dict, n: int, title_extra: str = ""):
    from plotly.subplots import make_subplots

    PALETTE, SERIES, apply_layout, show_token = _style()
    order = sorted(p, key=lambda t: -p[t])
    xs = list(range(len(order)))
    ticks = [show_token(labels.get(t, str(t)), 10) for t in order]
    colours = {"plain": SERIES["baseline"], "exact": PALETTE["accepted"], "broken": PALETTE["rejected"]}
    titles = []
    for kind, name in SAMPLERS.items():
        res = results.get(kind)
        if res is None:
            titles.append(f"{name}<br><i>not run</i>")
        else:
            test = res["test"]
            titles.append(f"{name}<br>p-value {_fmt_p(test['pvalue'])} · TV {test['tv']:.3f}")
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, subplot_titles=titles, horizontal_spacing=0.04)
    top = max(p.values()) if p else 1.0
    for col, kind in enumerate(SAMPLERS, start=1):
        res = results.get(kind)
        if res is not None:
            freq = [res["counts"].get(t, 0) / n for t in order]
            top = max(top, *freq)
            fig.add_trace(
                go.Bar(
                    x=xs,
                    y=freq,
                    name=SAMPLERS[kind] + " (sampled)",
                    marker={"color": colours[kind]},
                    customdata=[[tick, res["counts"].get(t, 0), p[t]] for tick, t in zip(ticks, order)],
                    hovertemplate="%{customdata[0]}: %{customdata[1]} of " + str(n) + " = %{y:.3f}"
                    "<br>exact p = %{customdata[2]:.3f}<extra></extra>",
                    meta={"role": kind},
                ),
                row=1,
                col=col,
            )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[p[t] for t in order],
                mode="markers",
                name="exact p (computed from the target's logits)",
                marker={"symbol": "line-ew", "size": 26, "line": {"width": 3, "color": SERIES["target"]}},
                legendgroup="p",
                showlegend=col == 1,
                customdata=ticks,
                hovertemplate="%{customdata}: exact p = %{y:.3f}<extra></extra>",
                meta={"role": "p"},
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(tickmode="array", tickvals=xs, ticktext=ticks, tickangle=-45, row=1, col=col)
    subtitle = f"bars: frequencies of {n} real samples each · dashes: the exact p" + title_extra
    apply_layout(fig, "Next-token histograms against the target's exact p", subtitle, height=500)
    fig.update_layout(margin={"t": 130})
    fig.update_yaxes(title_text="probability / frequency", row=1, col=1)
    fig.update_yaxes(range=[0, min(1.05, top * 1.12 + 0.01)])
    for ann in fig.layout.annotations or ():
        ann.font.size = 12
    return fig


def _lossless_table(results: dict, n: int) -> list[list]:
    rows = []
    for kind, name in SAMPLERS.items():
        res = results.get(kind)
        test = res["test"] if res else None
        rows.append(
            [
                name + (f" [{res['drafter']}]" if res and res.get("drafter") not in (None, "none") else ""),
                n if res else "—",
                "—" if not test or test["statistic"] is None else f"{test['statistic']:.1f}",
                "—" if not test else test["df"],
                "—" if not test else _fmt_p(test["pvalue"]),
                "—" if not test else f"{test['tv']:.3f}",
                _verdict(kind, test),
            ]
        )
    return rows


LOSSLESS_HEADERS = ["sampler", "N", "chi-square", "df", "p-value", "TV distance", "verdict"]


def run_lossless(
    prompt,
    temperature,
    top_k,
    drafter,
    k,
    topk,
    n_samples,
    seed,
    samplers=None,
    run_id: str = "",
    progress=gr.Progress(),  # noqa: B008 (gradio injects the tracker)
):
    """Generator: plain, exact speculative and broken-verifier next-token samples vs the exact p.

    samplers: the subset of SAMPLERS' keys to run (None = all three).
    Yields (status markdown, figure, table rows) after each sampler.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise gr.Error("Type a prompt (or pick one): the lab samples the token that follows it.")
    temperature = _number(temperature, "Temperature", 0.05, 2.0)
    top_k = _number(top_k, "Top-k", 2, 50, integer=True)
    k = _number(k, "K", 1, 4, integer=True)
    topk = _number(topk, "Tree top-k", 1, 4, integer=True)
    n = _number(n_samples, "Samples N", 10, MAX_LAB_SAMPLES, integer=True)
    seed = _seed(seed)
    drafter = (drafter or "int8").strip()
    if drafter not in ("int8", "ngram"):
        raise gr.Error(f"Choose the int8 or the ngram drafter for this lab, got {drafter!r}.")
    chosen = list(SAMPLERS) if samplers is None else [kind for kind in SAMPLERS if kind in samplers]
    if not chosen or (samplers is not None and set(samplers) - set(SAMPLERS)):
        raise gr.Error(f"Pick at least one sampler to run ({', '.join(SAMPLERS)}).")
    settings = dict(temperature=temperature, top_k=top_k, seed=seed)
    if not REGISTRY.is_loaded("default", "auto"):
        yield "Loading the model (once per server)…", gr.skip(), gr.skip()
    engine = _engine("auto", progress)
    yield "Preparing the drafters (the int8 copy is built on first use)…", gr.skip(), gr.skip()
    _with_drafter(engine, "int8")
    try:
        p_full = engine.next_token_distribution(prompt, **settings)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    support = [int(t) for t in (p_full > 0).nonzero().flatten().tolist()]
    p = {t: float(p_full[t]) for t in support}
    total_p = sum(p.values())
    p = {t: v / total_p for t, v in p.items()}
    labels = {t: engine.token_text(t) for t in support}
    runs = [
        ("plain", "none", "exact", dict(k=1, topk=1)),
        ("exact", drafter, "exact", dict(k=k, topk=topk)),
        ("broken", "int8", "drop_q", dict(k=k, topk=topk)),
    ]
    runs = [run for run in runs if run[0] in chosen]
    results: dict[str, dict] = {}
    started = time.perf_counter()
    for index, (kind, spec, verifier, shape) in enumerate(runs):
        name = SAMPLERS[kind]
        step = f"{index + 1}/{len(runs)} {name}"
        status = step + (f" ({spec} drafter)" if spec != "none" else "") + f": sampling {n}…"
        yield status, gr.skip(), gr.skip()
        share = 1 / len(runs)
        tracker = _Throttle(progress, step, run_id, offset=index * share, share=share)
        t0 = time.perf_counter()
        try:
            samples = engine.sample_next_tokens(
                prompt, spec, n_samples=n, n_tokens=1, verifier=verifier, progress=tracker, **settings, **shape
            )
        except _Stopped:
            yield (
                f"■ Stopped during {name}. Results above cover the samplers that finished.",
                lossless_figure(p, labels, results, n),
                _lossless_table(results, n),
            )
            return
        except ValueError as exc:
            raise gr.Error(str(exc)) from None
        counts = Counter(int(s[0]) for s in samples)
        results[kind] = {
            "counts": dict(counts),
            "test": chi_square_test(counts, p, n),
            "drafter": spec,
            "seconds": time.perf_counter() - t0,
        }
        for t in counts:
            labels.setdefault(t, engine.token_text(t))
        yield (
            status.replace(f": sampling {n}…", f": done in {results[kind]['seconds']:.1f} s."),
            lossless_figure(p, labels, results, n),
            _lossless_table(results, n),
        )
    yield _lossless_summary(results, n, seed, drafter, k, topk, time.perf_counter() - started), gr.skip(), gr.skip()


def _lossless_summary(results: dict, n: int, seed: int, drafter: str, k: int, topk: int, seconds: float) -> str:
    what = {
        "exact": f"Speculative sampling ({drafter}, exact rule)",
        "plain": "Plain sampling",
        "broken": "Broken verifier (int8, ignores q)",
    }
    notes = {"plain": ": the reference, and the noise level to expect at this N"}
    lines = [
        f"**Done in {seconds:.0f} s** ({len(results) * n} real samples, seed {seed}; speculative: {drafter} drafter, "
        f"K = {k}, tree top-k {topk}).",
        "",
    ]
    for kind in ("exact", "plain", "broken"):
        if kind in results:
            test = results[kind]["test"]
            lines.append(
                f"* **{what[kind]}: {_verdict(kind, test)}** (p-value {_fmt_p(test['pvalue'])}, "
                f"TV {test['tv']:.3f}){notes.get(kind, '')}."
            )
    lines += [
        "",
        "*Measured:* the samples (real drafts and target passes, now). *Computed:* the exact p from the target's "
        "logits, the chi-square p-values and the total-variation distances.",
    ]
    if drafter == "ngram":
        lines.append(
            "\nWith the n-gram drafter q is a point mass: if the prompt offers nothing to copy, nothing is drafted "
            "and the speculative sampler is plain sampling."
        )
    return "\n".join(lines)


def build_lossless_tab(max_runs: int = MAX_RUNS) -> gr.Tab:
    d = LOSSLESS_DEFAULTS
    with gr.Tab("Lossless lab", id="lossless") as tab:
        gr.Markdown(LOSSLESS_TEXT, elem_classes=["sl-lab-text"])
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=300):
                prompt = gr.Dropdown(
                    LOSSLESS_PROMPTS,
                    value=d["prompt"],
                    allow_custom_value=True,
                    label="Prompt (pick or type)",
                    info="The lab samples the first token of the answer.",
                    elem_id="ll-prompt",
                )
                with gr.Row():
                    run_btn = gr.Button("▶ Sample", variant="primary", elem_id="ll-run")
                    stop_btn = gr.Button("■ Stop", variant="stop", elem_id="ll-stop")
                n = gr.Slider(
                    100,
                    MAX_LAB_SAMPLES,
                    min(d["n"], MAX_LAB_SAMPLES),
                    step=50,
                    label="Samples N (per sampler)",
                    info="Each sample is one real target pass; 300 take about a minute per sampler on 2 CPU cores.",
                    elem_id="ll-n",
                )
                drafter = gr.Radio(
                    [("int8 (quantised target)", "int8"), ("ngram (prompt lookup)", "ngram")],
                    value=d["drafter"],
                    label="Drafter of the speculative sampler",
                    info="The broken verifier always uses int8 (see above).",
                )
                temperature = gr.Slider(0.05, 2, d["temperature"], step=0.05, label="Temperature")
                top_k = gr.Slider(
                    2, 50, d["top_k"], step=1, label="Top-k", info="Tokens p may use; small keeps the chart readable."
                )
                with gr.Row():
                    k = gr.Slider(1, 4, d["k"], step=1, label="K (draft depth)", min_width=140)
                    topk = gr.Slider(
                        1, 4, d["topk"], step=1, label="Tree top-k", info="Alternative drafts per guess.", min_width=140
                    )
                seed = gr.Number(0, precision=0, label="Seed", info="-1 = random")
                samplers = gr.CheckboxGroup(
                    [(name, kind) for kind, name in SAMPLERS.items()],
                    value=list(SAMPLERS),
                    label="Samplers to run",
                    info="Each costs N target passes.",
                )
            with gr.Column(scale=9, min_width=420):
                status = gr.Markdown(
                    "*Press **Sample** to draw real samples (about 3 minutes on 2 CPU cores with the defaults).*",
                    elem_id="ll-status",
                    elem_classes=["sl-status"],
                )
                plot = gr.Plot(
                    message("Next-token histograms against the target's exact p", "Press Sample to draw real samples"),
                    show_label=False,
                    elem_id="ll-plot",
                )
                table = gr.Dataframe(
                    value=_lossless_table({}, 0),
                    headers=LOSSLESS_HEADERS,
                    interactive=False,
                    wrap=True,
                    label="Tests against the exact p",
                    column_widths=["22%", "6%", "10%", "5%", "10%", "12%", "35%"],
                    elem_id="ll-table",
                )
        run_id = gr.State("")  # inside the Tab: a State directly under gr.Tabs breaks gradio's tab bar
    h.wire_run_and_stop(
        run_btn,
        stop_btn,
        run_id,
        run_lossless,
        [prompt, temperature, top_k, drafter, k, topk, n, seed, samplers],
        [status, plot, table],
        max_runs,
        PRIVATE,
        show_progress="full",
        show_progress_on=[status],
    )
    return tab


# ------------------------------------------------------------------------------------- Parity lab
PARITY_HEADERS = [
    "#",
    "prompt",
    "result",
    "tokens per pass",
    "baseline token",
    "speculative token",
    "top-2 margin",
    "verdict",
]


def default_parity_prompts(n: int = 4) -> str:
    prompts = []
    try:
        for line in (ASSETS / "parity_prompts.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                prompts.append(json.loads(line)["prompt"])
            if len(prompts) >= n:
                break
    except (OSError, ValueError, KeyError, TypeError):
        log.exception("cannot read assets/parity_prompts.jsonl")
    return "\n".join(prompts) or "What is the capital of France?\nList three fruits that are red."


def _parity_row(result: dict) -> list:
    from visuals.style import show_token

    prompt = result["prompt"] if len(result["prompt"]) <= 60 else result["prompt"][:59] + "…"
    if result.get("identical"):
        return [
            result["index"] + 1,
            prompt,
            f"identical ({result['baseline_tokens']} tokens)",
            f"{result['tokens_per_pass']:.2f}",
            "—",
            "—",
            "—",
            "✓ identical",
        ]
    verdict = result.get("verdict", "?")
    return [
        result["index"] + 1,
        prompt,
        f"first differs at token {result.get('position')}",
        f"{result['tokens_per_pass']:.2f}",
        show_token(result.get("baseline_token")),
        show_token(result.get("speculative_token")),
        f"{result.get('margin', 0.0):.4f} (tolerance {result.get('tolerance')})",
        ("≈ numerical near-tie" if verdict == "numerical near-tie" else "✗ real mismatch"),
    ]


def run_parity(
    prompts_text,
    drafter,
    dtype,
    max_new_tokens,
    k,
    strict,
    run_id: str = "",
    progress=gr.Progress(),  # noqa: B008
):
    """Generator: greedy baseline vs greedy speculative decoding per prompt; yields (status, table rows)."""
    from engine.parity import parity_check

    prompts = [line.strip() for line in str(prompts_text or "").splitlines() if line.strip()]
    if not prompts:
        raise gr.Error("Enter at least one prompt (one per line).")
    if len(prompts) > MAX_PARITY_PROMPTS:
        raise gr.Error(f"At most {MAX_PARITY_PROMPTS} prompts per run (got {len(prompts)}).")
    if dtype not in ("float32", "bfloat16"):
        raise gr.Error(f"dtype must be float32 or bfloat16, got {dtype!r}.")
    max_new = _number(max_new_tokens, "Max new tokens", 1, 64, integer=True)
    k = _number(k, "K", 1, 16, integer=True)
    drafter = (drafter or "").strip()
    if drafter in ("", "none", "baseline"):
        raise gr.Error("Choose a drafter (ngram, int8 or model:<id>): the baseline runs anyway.")
    if not REGISTRY.is_loaded("default", dtype):
        yield f"Loading the model in {dtype} (once per server)…", gr.skip()
    engine = _engine(dtype, progress)
    if drafter == "int8" or drafter.startswith("model:"):
        yield f"Preparing drafter **{drafter}** (first use builds it)…", gr.skip()
    _with_drafter(engine, drafter)
    rows: list[list] = []
    results: list[dict] = []
    mode = "strict (every pass padded to one shape)" if strict else "normal"
    checks = parity_check(engine, prompts, drafter=drafter, max_new_tokens=max_new, k=k, strict=bool(strict))
    started = time.perf_counter()
    try:
        for i in range(len(prompts)):
            if h.stop_requested(run_id):
                yield f"■ Stopped after {len(results)} of {len(prompts)} prompts.", rows
                return
            try:
                progress(i / len(prompts), desc=f"prompt {i + 1}/{len(prompts)}: baseline, then {drafter}")
            except Exception:
                pass
            yield f"Prompt {i + 1}/{len(prompts)}: greedy baseline, then greedy with {drafter}…", gr.skip()
            try:
                result = next(checks)
            except ValueError as exc:
                raise gr.Error(f"Prompt {i + 1}: {exc}") from None
            results.append(result)
            rows = rows + [_parity_row(result)]
            yield f"Checked {len(results)}/{len(prompts)} prompts…", rows
    finally:
        checks.close()
    same = sum(r["identical"] for r in results)
    ties = sum(r.get("verdict") == "numerical near-tie" for r in results)
    bugs = sum(r.get("verdict") == "real mismatch" for r in results)
    summary = (
        f"**{len(results)} prompts: {same} identical, {ties} numerical near-tie{'s' if ties != 1 else ''}, "
        f"{bugs} real mismatch{'es' if bugs != 1 else ''}** ({dtype}, {drafter}, K = {k}, {max_new} new tokens, "
        f"{mode}; {time.perf_counter() - started:.0f} s)."
    )
    if bugs:
        summary += " A real mismatch means the target clearly preferred the baseline's token: that is a bug."
    elif ties:
        summary += (
            " Near-ties are rounding: a pass over several tokens can round differently from a one-token pass, "
            "which flips a choice between two almost equal logits. Strict mode removes it."
        )
    else:
        summary += " Speculative decoding changed how many target passes were needed, not the text."
    yield summary, rows


PARITY_TEXT = """
**Greedy parity, measured.** With temperature 0 the target always emits its top token, so speculative decoding
must reproduce plain decoding **token for token**. For each prompt this lab runs, now and on this machine, the
greedy **baseline** (no drafter) and greedy **speculative** decoding, and compares the tokens. At the first
difference it recomputes the target's logits for the shared prefix and reports the **top-2 margin**: below the
dtype's tolerance (0.01 in float32, 1.0 in bfloat16) the two best tokens were practically tied and rounding picked
one (a *numerical near-tie*); above it the target clearly preferred one token (a *real mismatch*, a bug).
**Strict** mode pads every target pass, the baseline's included, to one shape, so both compute bitwise the same
numbers in any dtype (slower; for checking only). On a CPU with AVX512-BF16, bfloat16 runs on SpecLens's own kernels,
which compute every token of a pass on its own: there bf16 is bitwise identical even without strict mode.
"""


def build_parity_tab(max_runs: int = MAX_RUNS) -> gr.Tab:
    with gr.Tab("Parity lab", id="parity") as tab:
        gr.Markdown(PARITY_TEXT, elem_classes=["sl-lab-text"])
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=300):
                prompts = gr.Textbox(
                    default_parity_prompts(4),
                    lines=6,
                    max_lines=20,
                    label=f"Prompts, one per line (at most {MAX_PARITY_PROMPTS})",
                    elem_id="pl-prompts",
                )
                with gr.Row():
                    run_btn = gr.Button("▶ Check parity", variant="primary", elem_id="pl-run")
                    stop_btn = gr.Button("■ Stop", variant="stop", elem_id="pl-stop")
                drafter = gr.Dropdown(
                    [("ngram (prompt lookup)", "ngram"), ("int8 (quantised target)", "int8")],
                    value="ngram",
                    allow_custom_value=True,
                    label="Drafter",
                    info="or type model:<id> for a separate draft model",
                )
                dtype = gr.Radio(["float32", "bfloat16"], value="float32", label="Precision (dtype)")
                max_new = gr.Slider(1, 64, 16, step=1, label="Max new tokens", elem_id="pl-max-new")
                k = gr.Slider(1, 16, 4, step=1, label="K (draft depth)")
                strict = gr.Checkbox(
                    False,
                    label="Strict: pad every target pass to one shape (bitwise identical, slower)",
                    elem_id="pl-strict",
                )
            with gr.Column(scale=9, min_width=420):
                status = gr.Markdown(
                    "*Press **Check parity** to run each prompt twice (baseline and speculative, greedy).*",
                    elem_id="pl-status",
                    elem_classes=["sl-status"],
                )
                table = gr.Dataframe(
                    value=[["—", "(press Check parity)", "—", "—", "—", "—", "—", "not run"]],
                    headers=PARITY_HEADERS,
                    interactive=False,
                    wrap=True,
                    label="Per prompt",
                    column_widths=["5%", "30%", "15%", "8%", "10%", "10%", "10%", "12%"],
                    elem_id="pl-table",
                )
        run_id = gr.State("")  # inside the Tab: a State directly under gr.Tabs breaks gradio's tab bar
    h.wire_run_and_stop(
        run_btn,
        stop_btn,
        run_id,
        run_parity,
        [prompts, drafter, dtype, max_new, k, strict],
        [status, table],
        max_runs,
        PRIVATE,
        show_progress="full",
        show_progress_on=[status],
    )
    return tab


# -------------------------------------------------------------------------------------- Batch lab
BATCH_HEADERS = [
    "batch B",
    "pass, 1 token per row (ms, measured)",
    "pass, K+1 tokens per row (ms, measured)",
    "without speculation (tok/s, computed)",
    "with speculation (tok/s, computed)",
    "speedup (computed)",
]

BATCH_TEXT = """
**When does speculation stop paying?** A speculative pass verifies K + 1 tokens per sequence. Decoding one
sequence on this machine, a pass over K + 1 tokens costs little more than a pass over one (the weights are read
once either way); when many sequences share a pass, the extra tokens cost real compute. This lab **measures**,
now and on this machine, how long one target pass takes for B sequences with 1 token each and with K + 1 tokens
each (B independent prefixes of 64 tokens in one forward, median of a few repeats), then **computes** throughput:
without speculation B ÷ pass time; with speculation B × E ÷ (pass time with K + 1 tokens + K × draft time), where
E = (1 − α^(K+1)) / (1 − α) comes from α. SpecLens decodes one sequence at a time, so batched speculative
decoding itself is **computed from these measurements, not run**. Other runs on the server at the same time slow
the measurement.
"""


def batch_refresh(trace, seen: str, k, alpha, draft_ms):
    """Entering the Batch lab: when a new Playground run exists, take its K, α and draft time per token."""
    summary, note = last_run(trace)
    if summary is None or summary["run_id"] == seen:
        note = f"{note} Until then α and the draft time are whatever you set here."
        return gr.skip(), gr.skip(), gr.skip(), note if summary is None else gr.skip(), seen
    k = int(min(8, max(1, summary["k"])))
    alpha = round(min(0.99, max(0.0, summary["acceptance_rate"])), 2)
    per_token = (summary.get("mean_draft_ms") or 0.0) / max(1, summary["k"])
    return (
        k,
        alpha,
        round(per_token, 2),
        f"K, α and the draft time are set from it. {note} Drafting took {per_token:.2f} ms per draft token "
        "(measured)."
        + (" This lab models a chain of K drafts; your run drafted a tree." if summary.get("tree_topk", 1) > 1 else ""),
        summary["run_id"],
    )


def _batch_table(result: dict) -> list[list]:
    rows = []
    for b, t1, tk, plain, spec in zip(
        result["batch_sizes"],
        result["pass_ms_1"],
        result["pass_ms_k1"],
        result["throughput_plain"],
        result["throughput_speculative"],
    ):
        rows.append([b, f"{t1:.1f}", f"{tk:.1f}", f"{plain:.1f}", f"{spec:.1f}", f"{spec / plain:.2f}×"])
    return rows


def run_batch(
    k,
    alpha,
    batch_sizes,
    draft_ms,
    repeats=3,
    run_id: str = "",
    progress=gr.Progress(),  # noqa: B008
):
    """Generator: measure pass times per batch size, then compute throughputs; yields (status, figure, rows)."""
    from engine.batching import batch_tradeoff

    k = _number(k, "K", 1, 8, integer=True)
    alpha = _number(alpha, "α", 0.0, 0.99)
    draft_ms = _number(0 if draft_ms in (None, "") else draft_ms, "Draft time per token (ms)", 0, 10_000)
    repeats = _number(repeats, "Repeats", 1, 10, integer=True)
    try:
        sizes = sorted({int(b) for b in (batch_sizes or [])})
    except (TypeError, ValueError):
        raise gr.Error(f"Batch sizes must be whole numbers, got {batch_sizes!r}.") from None
    if not sizes:
        raise gr.Error("Pick at least one batch size.")
    if any(not 1 <= b <= 64 for b in sizes):
        raise gr.Error("Batch sizes must be between 1 and 64.")
    if not REGISTRY.is_loaded("default", "auto"):
        yield "Loading the model (once per server)…", gr.skip(), gr.skip()
    engine = _engine("auto", progress)
    yield f"Measuring pass times for B = {', '.join(map(str, sizes))}…", gr.skip(), gr.skip()
    tracker = _Throttle(progress, "batch sizes measured", run_id, interval=0.0)
    started = time.perf_counter()
    try:
        result = batch_tradeoff(engine.target.model, k, alpha, sizes, draft_ms, repeats=repeats, progress=tracker)
    except _Stopped:
        yield "■ Stopped. Nothing is computed from an unfinished measurement.", gr.skip(), gr.skip()
        return
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    from .figures import figure

    fig = figure("batch_figure", result)
    subtitle = fig.layout.title.subtitle.text if fig.layout.title and fig.layout.title.subtitle else None
    if subtitle and " · labels:" in subtitle:  # two lines: one is too wide for a narrow page
        fig.update_layout(title_subtitle_text=subtitle.replace(" · labels:", "<br>labels:"), margin={"t": 115})
    rows = _batch_table(result)
    e = result["expected_tokens_per_pass"]
    ratio = [s / p for s, p in zip(result["throughput_speculative"], result["throughput_plain"])]
    pays = [b for b, r in zip(sizes, ratio) if r > 1.0]
    cost = result["pass_ms_k1"][0] / result["pass_ms_1"][0]
    status = (
        f"**Pass times are measured on this machine now ({time.perf_counter() - started:.0f} s, "
        f"{engine.target.name}, {str(engine.target.model.dtype).removeprefix('torch.')}); throughputs are computed "
        f"from them and α.** At B = {sizes[0]} a pass over K + 1 = {k + 1} tokens per row costs {cost:.2f}× a pass "
        f"over one token; with E = {e:.2f} tokens per pass (α = {alpha:.2f}, K = {k}) speculation "
        + (
            f"pays at B = {', '.join(map(str, pays))} and not beyond."
            if pays and len(pays) < len(sizes)
            else ("pays at every batch size measured." if pays else "does not pay at any batch size measured.")
        )
        + " The engine decodes one sequence at a time: batched speculative decoding is computed here, not run."
    )
    yield status, fig, rows


def build_batch_tab(trace_state: gr.State, max_runs: int = MAX_RUNS) -> gr.Tab:
    with gr.Tab("Batch lab", id="batch") as tab:
        gr.Markdown(BATCH_TEXT, elem_classes=["sl-lab-text"])
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=300):
                with gr.Row():
                    run_btn = gr.Button("▶ Measure", variant="primary", elem_id="bl-run")
                    stop_btn = gr.Button("■ Stop", variant="stop", elem_id="bl-stop")
                k = gr.Slider(1, 8, 4, step=1, label="K (draft depth)", elem_id="bl-k")
                alpha = gr.Slider(
                    0,
                    0.99,
                    0.7,
                    step=0.01,
                    label="α (acceptance rate)",
                    info="Taken from your last Playground run when there is one.",
                    elem_id="bl-alpha",
                )
                sizes = gr.CheckboxGroup(
                    [1, 2, 4, 8, 16], value=[1, 2, 4, 8, 16], label="Batch sizes B", elem_id="bl-sizes"
                )
                draft_ms = gr.Number(
                    0,
                    label="Draft time per draft token (ms)",
                    info="Measured by your last Playground run when there is one; 0 = free drafting (n-gram).",
                    minimum=0,
                    elem_id="bl-draft",
                )
                repeats = gr.Slider(1, 5, 3, step=1, label="Repeats per measurement (median)")
                note = gr.Markdown(
                    "No Playground run in this session yet: α = 0.7 and free drafting are assumed.",
                    elem_id="bl-note",
                )
            with gr.Column(scale=9, min_width=420):
                status = gr.Markdown(
                    "*Press **Measure** to time real target passes (about half a minute with all batch sizes).*",
                    elem_id="bl-status",
                    elem_classes=["sl-status"],
                )
                plot = gr.Plot(
                    message("Throughput vs batch size", "Press Measure to time real target passes"),
                    show_label=False,
                    elem_id="bl-plot",
                )
                table = gr.Dataframe(
                    value=[["—"] * 5 + ["not run"]],
                    headers=BATCH_HEADERS,
                    interactive=False,
                    wrap=True,
                    label="Measured and computed",
                    column_widths=["10%", "18%", "18%", "18%", "18%", "18%"],
                    elem_id="bl-table",
                )
        seen = gr.State("")  # inside the Tab: a State directly under gr.Tabs breaks gradio's tab bar
        run_id = gr.State("")
    tab.select(
        batch_refresh,
        [trace_state, seen, k, alpha, draft_ms],
        [k, alpha, draft_ms, note, seen],
        show_progress="hidden",
        concurrency_limit=None,
        **PRIVATE,
    )
    h.wire_run_and_stop(
        run_btn,
        stop_btn,
        run_id,
        run_batch,
        [k, alpha, sizes, draft_ms, repeats],
        [status, plot, table],
        max_runs,
        PRIVATE,
        show_progress="full",
        show_progress_on=[status],
    )
    return tab
