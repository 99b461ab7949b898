"""The Explain lab: the algorithm with rendered formulas, a speedup calculator and a toy example sampled for real.

The calculator's curves are computed from the formulas (engine.metrics); its measured point is the
session's last Playground run. The toy example runs exact speculative sampling on a hand-made p and q
with the engine's own acceptance rule (engine.tools.exactness.toy_sampling).
"""

from __future__ import annotations

import json
import math
import time

import gradio as gr

from engine.metrics import expected_tokens_per_pass, wall_clock_speedup
from engine.tools.exactness import overlap, toy_sampling
from visuals import speedup_figure
from visuals.lab_figures import toy_figure
from visuals.speedup import pass_width_figure

from ..config import ASSETS, MAX_CONCURRENT_RUNS
from ..engine_access import get_engine, is_loaded
from ..figure_guard import guarded
from ..inputs import number, seed_or_random
from ..wiring import MODEL_RUNS, PRIVATE
from .last_run import last_run

__all__ = [
    "GPU_RECORD",
    "TOY_DEFAULT",
    "build_tab",
    "calculator",
    "explain_refresh",
    "measure_pass_widths",
    "parse_toy_table",
    "run_toy",
]

LATEX = [
    {"left": "$$", "right": "$$", "display": True},
    {"left": "$", "right": "$", "display": False},
]
MAX_ALPHA = 0.99  # the calculator's α stops short of 1, where E is K + 1 and every draft is kept
MAX_K = 12
# c reaches past 1: a wide int8 tree measured 0.96-1.17 (a draft token's pass over a growing tree costs about
# a target pass of its own); the slider leaves room for that.
MAX_C = 2.0
MAX_TOY_TOKENS = 12
TOY_SAMPLES = 1000
CALCULATOR_START = (0.7, 4, 0.1)  # α, K, c shown before the session has a run of its own

EXPLAIN_TEXT = r"""
### The algorithm in three steps
A cheap **drafter** proposes a token $x$ drawn from its distribution $q$. The **target** computes its own
distribution $p$ at the same position, in the same pass that checks the draft. Then:

1. **Accept** the draft with probability $\min\left(1, \dfrac{p(x)}{q(x)}\right)$ (in practice: draw
   $u$ uniform in $[0, 1)$ and accept when $u < p(x)/q(x)$), then check the next draft the same way.
2. At the **first rejection** stop checking: the rejected draft and every draft after it are dropped, and
   the pass emits a **replacement** drawn from the **residual**
   $r = \operatorname{norm}\big(\max(0,\ p - q)\big)$, that is
   $r(y) = \dfrac{\max(0,\ p(y) - q(y))}{\sum_z \max(0,\ p(z) - q(z))}$.
3. If **every** draft was accepted, the pass still has the target's $p$ at the position after the last
   draft, and emits one token drawn from it: the **bonus**.

So every pass emits its accepted drafts plus **exactly one** token of the target's own: a replacement
after a rejection, *or* a bonus after full acceptance, never both. That is why a pass always emits at
least one token. (Greedy decoding, temperature 0, is the limit case: a draft is accepted exactly when it
is the target's most likely token, and the replacement or bonus is that token; no $u$ is drawn.)

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
accepted prefix plus its one extra token (replacement or bonus). SpecLens measures $\alpha$ as accepted
drafts ÷ drafts tried (a draft after the first rejection is never tried):

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
    "sampling with the engine's own functions (`engine.acceptance`): draw x from q, accept with min(1, p/q) "
    "(`verify_children`), otherwise draw from the residual. The bars split what came out into accepted drafts "
    "and resampled tokens: together they land on p, even where q is far from p."
)

GPU_TEXT = (
    "### Why checking K + 1 tokens costs about as much as checking one\n"
    "A target pass reads every weight of the model once, however many tokens it verifies; for one sequence the "
    "arithmetic on a few more tokens hides behind that. **Measure** times passes of 1 to 16 tokens on this "
    "machine, now; beside them, passes recorded on a GPU. What limits a pass differs: on a CPU, **reading the "
    "weights** from memory; on a GPU with a model this small, **launching its kernels** (30 layers of small "
    "kernels issued from Python), since its memory reads the weights in a fraction of a millisecond. Either way a "
    "wider pass is almost free, until enough tokens share it that the arithmetic itself dominates (the Batch lab "
    "measures where)."
)
PASS_WIDTHS = 16  # the widest pass measured
READ_BOUND_SHARE = (
    0.5  # a one-token pass reading its weights at half the machine's read bandwidth or more is bound by it
)
GPU_RECORD = json.loads((ASSETS / "recorded" / "h200-pass-times.json").read_text())


def _gpu_words(gpu: dict) -> str:
    one, verify = gpu["one_token_pass_ms"], gpu["ngram_verify_pass_ms"]
    return (
        f"**Recorded on a GPU** ({gpu['device']}, {gpu['recorded']}; {gpu['source']}): a one-token pass took "
        f"{min(one):.1f}–{max(one):.1f} ms and n-gram's verify passes, up to K + 1 tokens each, "
        f"{min(verify):.1f}–{max(verify):.1f} ms. Its limit: {gpu['limit']}."
    )


def measure_pass_widths(progress=gr.Progress()):  # noqa: B008 (gradio injects the tracker)
    """Generator: (figure, text) — this machine's target passes of 1..PASS_WIDTHS tokens, timed now
    (engine.model.pass_timing.pass_costs_ms), beside the recorded GPU passes."""
    from engine.host import cpu_name
    from engine.model.pass_timing import pass_costs_ms
    from engine.tools.bench_machine import read_bandwidth_gbs

    if not is_loaded("default", "auto"):
        yield gr.skip(), "Loading the model (once per server)…"
    engine = get_engine("default", "auto", progress)
    yield gr.skip(), "Timing target passes of 1 to 16 tokens…"
    model = engine.target.model
    started = time.perf_counter()
    ms = pass_costs_ms(model, PASS_WIDTHS, repeats=3)
    dtype = str(model.dtype).removeprefix("torch.")
    where = f"{cpu_name()}, {dtype}, {time.strftime('%H:%M')}"
    cpu = {"widths": list(range(1, PASS_WIDTHS + 1)), "ms": ms, "measured_on": where}
    mb = model.weight_bytes / 1e6
    pace, reads = mb / ms[0], read_bandwidth_gbs(size_mb=128, repeats=5) if model.device.type == "cpu" else None
    if reads:
        share = pace / reads
        limit = (  # one reading on a shared machine: a cause is named only when the share is clearly high
            "reading the weights, not the arithmetic, sets the pace"
            if share >= READ_BOUND_SHARE
            else "the rest is other work on this machine or work outside reading the weights (attention, norms, "
            "Python): one reading cannot tell which, measure again"
        )
        bound = f" against the {reads:.1f} GB/s this machine reads (measured now): {share:.0%}, so {limit}"
    else:
        bound = ""
    text = (
        f"**Measured on this machine now** ({where}, {time.perf_counter() - started:.1f} s): a pass over 1 token "
        f"took {ms[0]:.1f} ms, over 4 tokens {ms[3]:.1f} ms ({ms[3] / ms[0]:.2f}×), over 16 tokens {ms[-1]:.1f} ms "
        f"({ms[-1] / ms[0]:.2f}×). Each pass reads the target's {mb:.0f} MB of weights: at 1 token that is "
        f"{pace:.1f} GB/s{bound}. Other work on this machine slows every width alike; compare the widths within "
        f"this run.\n\n{_gpu_words(GPU_RECORD)}"
    )
    yield guarded("Pass width", pass_width_figure, cpu, GPU_RECORD), text


TOY_DEFAULT = [
    ["cat", 0.40, 0.15],
    ["dog", 0.25, 0.45],
    ["fish", 0.20, 0.10],
    ["bird", 0.10, 0.25],
    ["frog", 0.05, 0.05],
]


# ------------------------------------------------------------------------------------ calculator
def _clamp(value: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, value))


def calculator(alpha, k, c, trace=None) -> tuple:
    """(speedup_figure for the sliders with the session's last run as the measured point, a note)."""
    try:
        alpha = number(alpha, "α", 0.0, MAX_ALPHA)
        k = number(k, "K", 1, MAX_K, integer=True)
        c = number(c, "c", 0.0, MAX_C)
    except gr.Error as exc:
        gr.Warning(str(exc))
        return gr.skip(), gr.skip()
    summary, note = last_run(trace)
    measured = None
    if summary is not None:
        measured = {
            "alpha": summary["position_acceptance"],
            "k": max(1, int(summary["k"])),
            "tokens_per_pass": summary["tokens_per_pass"],
        }
    fig = guarded("Expected speedup", speedup_figure, alpha, k, c, measured)
    e = expected_tokens_per_pass(alpha, k)
    text = (
        f"**Computed** for α = {alpha:.2f}, K = {k}, c = {c:.2f}: E = (1 − α^(K+1)) / (1 − α) = **{e:.3f}** tokens "
        f"per target pass, speedup E / (K·c + 1) = **{wall_clock_speedup(alpha, k, c):.2f}×**.  \n"
        f"**Measured:** {note}"
    )
    if summary is not None and summary.get("tree_topk", 1) > 1:
        text += " (A tree run: its tokens per pass can beat the chain formula, which counts one branch.)"
    return fig, text


def explain_refresh(trace, seen: str, alpha, k, c):
    """Entering the Explain tab: when a new Playground run exists, set the sliders to its α, K and c."""
    summary, _ = last_run(trace)
    if summary is None or summary["run_id"] == seen:
        return (gr.skip(),) * 6  # nothing new: keep what the user set
    alpha = round(_clamp(summary["position_acceptance"], 0.0, MAX_ALPHA), 2)
    k = int(_clamp(summary["k"], 1, MAX_K))
    if summary.get("draft_cost_ratio") is not None:
        c = round(_clamp(summary["draft_cost_ratio"], 0.0, MAX_C), 2)
    fig, text = calculator(alpha, k, c, trace)
    # Said in the tab itself, not in a toast (a toast stays on screen when the visitor moves to another tab).
    text = "*Calculator set to your last Playground run: its α, K and c (c estimated from its timings).*  \n" + text
    return alpha, k, c, fig, text, summary["run_id"]


# ------------------------------------------------------------------------------------------- toy
def _table_rows(table) -> list:
    """The rows of a gr.Dataframe value (a pandas frame, a {"data": rows} dict or a plain list)."""
    if isinstance(table, dict):
        return table.get("data") or []
    return table.values.tolist() if hasattr(table, "values") else table


def _toy_row(i: int, row) -> tuple[str, float, float]:
    row = list(row) + [None] * (3 - len(row))
    name = str(row[0]).strip() if row[0] is not None and str(row[0]).strip() not in ("", "nan") else f"t{i + 1}"
    values = []
    for column, value in (("p", row[1]), ("q", row[2])):
        try:
            number_ = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"Row {i + 1} ({name}): {column} must be a number, got {value!r}.") from None
        if not math.isfinite(number_):
            raise ValueError(f"Row {i + 1} ({name}): {column} must be a finite number, got {value!r}.")
        if number_ < 0:
            raise ValueError(f"Row {i + 1} ({name}): {column} must not be negative, got {number_:g}.")
        values.append(number_)
    return name, values[0], values[1]


def parse_toy_table(table) -> tuple[list[str], list[float], list[float]]:
    """Parse and validate the toy table (rows: token, p, q), each column normalised; raises ValueError
    with a plain message."""
    rows = _table_rows(table)
    if not rows or len(rows) < 2:
        raise ValueError("The table needs at least two tokens.")
    if len(rows) > MAX_TOY_TOKENS:
        raise ValueError(f"Keep the toy example small: at most {MAX_TOY_TOKENS} tokens.")
    tokens, ps, qs = (list(column) for column in zip(*(_toy_row(i, row) for i, row in enumerate(rows))))
    if len(set(tokens)) != len(tokens):
        raise ValueError("Token names must be different from each other.")
    for column, values in (("p", ps), ("q", qs)):
        if sum(values) <= 0:
            raise ValueError(f"Column {column} is all zero: give at least one token a positive value.")
    return tokens, [v / sum(ps) for v in ps], [v / sum(qs) for v in qs]


def run_toy(table, seed=0, n: int = TOY_SAMPLES):
    """'Sample 1000 times' -> (figure, counts text). Bad tables get a gr.Warning and change nothing."""
    try:
        tokens, p, q = parse_toy_table(table)
        seed = seed_or_random(seed)
    except (ValueError, gr.Error) as exc:
        gr.Warning(str(exc))
        return gr.skip(), f"⚠ {exc}"
    counts = toy_sampling(p, q, n, seed)
    acc, res = sum(counts["accepted"]), sum(counts["resampled"])
    freq = [(a + r) / n for a, r in zip(counts["accepted"], counts["resampled"])]
    dev = max(abs(f - pv) for f, pv in zip(freq, p))
    rows = "\n".join(
        f"| {tok} | {pv:.3f} | {qv:.3f} | {a} | {r} | {a + r} | {f:.3f} |"
        for tok, pv, qv, a, r, f in zip(tokens, p, q, counts["accepted"], counts["resampled"], freq)
    )
    text = (
        f"**{n} samples (seed {seed}):** {acc} accepted drafts + {res} resampled tokens = {acc + res}. "
        f"Acceptance rate {acc / n:.3f} (theory Σ min(p, q) = {overlap(p, q):.3f}). Largest gap between output "
        f"frequency and p: {dev:.3f} (sampling noise shrinks like 1/√n).\n\n"
        "| token | p | q | accepted | resampled | total | frequency |\n|---|---|---|---|---|---|---|\n" + rows
    )
    return toy_figure(tokens, p, q, counts), text


# ---------------------------------------------------------------------------------------- layout
def _calculator_controls(start_fig, start_note) -> dict:
    alpha0, k0, c0 = CALCULATOR_START
    with gr.Row():
        alpha = gr.Slider(0, MAX_ALPHA, alpha0, step=0.01, label="α (acceptance rate)", elem_id="ex-alpha")
        k = gr.Slider(1, MAX_K, k0, step=1, label="K (drafts per target pass)", elem_id="ex-k")
        c = gr.Slider(0, MAX_C, c0, step=0.01, label="c (cost of one draft token ÷ one target pass)", elem_id="ex-c")
    plot = gr.Plot(start_fig, show_label=False, elem_id="ex-calc")
    note = gr.Markdown(start_note, elem_id="ex-calc-note")
    return {"alpha": alpha, "k": k, "c": c, "plot": plot, "note": note}


def _toy_controls() -> dict:
    tokens, p, q = parse_toy_table(TOY_DEFAULT)
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=300):
            table = gr.Dataframe(
                value=TOY_DEFAULT,
                headers=["token", "p (target)", "q (drafter)"],
                datatype=["str", "number", "number"],
                interactive=True,
                label="Toy p and q (editable)",
                elem_id="ex-toy-table",
            )
            with gr.Row():
                seed = gr.Number(-1, precision=0, label="Seed", info="-1 = random", min_width=100)
                button = gr.Button("▶ Sample 1000 times", variant="primary", elem_id="ex-toy-run")
        with gr.Column(scale=3, min_width=420):
            plot = gr.Plot(toy_figure(tokens, p, q, None), show_label=False, elem_id="ex-toy-plot")
    text = gr.Markdown("", elem_id="ex-toy-text")
    return {"table": table, "seed": seed, "button": button, "plot": plot, "text": text}


def build_tab(trace_state: gr.State) -> gr.Tab:
    """The Explain tab; `trace_state` is the Playground's per-session trace (the measured point)."""
    with gr.Tab("Explain", id="explain") as tab:
        gr.Markdown(EXPLAIN_TEXT, latex_delimiters=LATEX, elem_id="ex-text", elem_classes=["sl-explain"])
        gr.Markdown(CALC_TEXT)
        calc = _calculator_controls(*calculator(*CALCULATOR_START, None))
        seen = gr.State("")
        gr.Markdown(TOY_TEXT)
        toy = _toy_controls()
        gr.Markdown(GPU_TEXT)
        widths_btn = gr.Button("▶ Measure passes of 1 to 16 tokens", variant="primary", elem_id="ex-widths-run")
        widths_plot = gr.Plot(pass_width_figure(None, GPU_RECORD), show_label=False, elem_id="ex-widths-plot")
        widths_text = gr.Markdown(_gpu_words(GPU_RECORD), elem_id="ex-widths-text")
    sliders = [calc["alpha"], calc["k"], calc["c"]]
    for slider in sliders:
        slider.input(
            calculator,
            [*sliders, trace_state],
            [calc["plot"], calc["note"]],
            trigger_mode="always_last",
            show_progress="hidden",
            concurrency_limit=None,
            **PRIVATE,
        )
    tab.select(
        explain_refresh,
        [trace_state, seen, *sliders],
        [*sliders, calc["plot"], calc["note"], seen],
        show_progress="hidden",
        concurrency_limit=None,
        **PRIVATE,
    )
    toy["button"].click(
        run_toy,
        [toy["table"], toy["seed"]],
        [toy["plot"], toy["text"]],
        concurrency_limit=MAX_CONCURRENT_RUNS,
        concurrency_id="toy",  # its own queue: sampling the toy needs no model
        **PRIVATE,
    )
    widths_btn.click(
        measure_pass_widths,
        None,
        [widths_plot, widths_text],
        concurrency_id=MODEL_RUNS,
        concurrency_limit=MAX_CONCURRENT_RUNS,
        show_progress_on=[widths_text],
        **PRIVATE,
    )
    return tab
