"""What speculation buys: the speedup calculator (theory, with a run's measured point) and the batch figure.

The formulas are engine.metrics': E = (1 − α^(K+1)) / (1 − α) tokens per target pass for K drafts kept
independently with probability α, and the wall-clock speedup E / (K·c + 1), c being the cost of one draft
token relative to one target pass.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.metrics import (
    batch_throughputs,
    expected_tokens_per_pass,
    measured_speedup,
    run_summary,
    wall_clock_speedup,
)
from engine.trace import events_of, step_events

from .style import LABEL_BG, NOTE_SIZE, PALETTE, SERIES, apply_layout, fmt_speedup, raw_subtitle, set_subtitle

__all__ = ["speedup_figure", "run_speedup_figure", "batch_figure", "pass_width_figure"]

K_SHOWN = 12  # the curves run over K = 1..12 at least
COMPARISON_ALPHAS = (0.5, 0.7, 0.9)
COMPARISON_DASHES = ("dot", "dashdot", "longdash")
COMPARISON_COLOUR = "#AAAAAA"
SAME_ALPHA = 0.04  # a comparison curve this close to the chosen α would hide behind it: left out
POINT_SIZE = 16
LABEL_RISE = 32  # pixels from a point to its label, up or down
LABEL_RUN = 28  # pixels sideways
FAR_RIGHT = 0.7  # a label for a K past this share of the axis points left, so that it stays inside
FINE_TICKS_UP_TO = 16  # one tick per K up to this K, every other K beyond
SPEEDUP_HEIGHT = 560
BATCH_HEIGHT = 540
LOG_SPAN = 4  # batch sizes spanning at least this ratio get a log axis
X_PAD = 0.12  # room left and right of the batch sizes, a share of their span (in log10 units on a log axis)
E_PANEL, SPEEDUP_PANEL = 1, 2  # subplot columns
MS_PER_S = 1000.0


# ----------------------------------------------------------------------------------------- speedup


def _check(alpha: float, k: int, c: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if c < 0:
        raise ValueError(f"c must be non-negative, got {c}")


def _add_theory(fig: go.Figure, ks: list[int], alpha: float, c: float, dash: str | None = None) -> list[float]:
    """E(K) and the speedup over ks at one α: the chosen α (dash None) bold, a comparison α thin and dashed.
    Returns the speedups."""
    e = [expected_tokens_per_pass(alpha, kk) for kk in ks]
    sp = [wall_clock_speedup(alpha, kk, c) for kk in ks]
    chosen = dash is None
    if chosen:
        style = {
            "mode": "lines+markers",
            "line": {"color": SERIES["theory"], "width": 3},
            "marker": {"size": 6},
            "name": f"theory at α = {alpha:.3f}",
            "legendgroup": "chosen",
            "hovertemplate": "K = %{x}: %{y:.2f}<extra>theory</extra>",
        }
    else:
        style = {
            "mode": "lines",
            "line": {"color": COMPARISON_COLOUR, "width": 1.5, "dash": dash},
            "name": f"α = {alpha:.1f} (for comparison)",
            "legendgroup": f"a{alpha}",
            "hovertemplate": f"α = {alpha:.1f}, K = %{{x}}: %{{y:.2f}}<extra>theory</extra>",
        }
    for col, ys, role in ((E_PANEL, e, "E"), (SPEEDUP_PANEL, sp, "speedup")):
        meta = {"role": role, "alpha": alpha, "chosen": chosen}
        fig.add_trace(go.Scatter(x=ks, y=ys, showlegend=col == E_PANEL, meta=meta, **style), row=1, col=col)
    return sp


def _label(fig: go.Figure, x, y, text: str, colour: str, col: int, above: bool, left: bool) -> None:
    """A boxed label with a short arrow, readable over crossing lines."""
    fig.add_annotation(
        x=x,
        y=y,
        text=text,
        showarrow=True,
        arrowhead=0,
        arrowcolor=colour,
        ax=-LABEL_RUN if left else LABEL_RUN,
        ay=-LABEL_RISE if above else LABEL_RISE,
        xanchor="right" if left else "left",
        bgcolor=LABEL_BG,
        bordercolor=colour,
        borderpad=3,
        font={"size": NOTE_SIZE},
        row=1,
        col=col,
    )


def _panel_values(alpha: float, k: int, c: float, measured: dict | None) -> dict:
    """{column: (theory at K, measured or None)} for the two panels."""
    measured = measured or {}
    tpp, speed = measured.get("tokens_per_pass"), measured.get("speedup")
    return {
        E_PANEL: (expected_tokens_per_pass(alpha, k), None if tpp is None else float(tpp)),
        SPEEDUP_PANEL: (wall_clock_speedup(alpha, k, c), None if speed is None else float(speed)),
    }


def _add_point(fig: go.Figure, col: int, x, y, marker: dict, name: str, legend: tuple, hover: str, meta: dict) -> None:
    """One large marker in a panel; legend = (legendgroup, showlegend)."""
    fig.add_trace(
        go.Scatter(
            x=[x],
            y=[y],
            mode="markers",
            marker={"size": POINT_SIZE, **marker},
            name=name,
            legendgroup=legend[0],
            showlegend=legend[1],
            hovertemplate=hover,
            meta=meta,
        ),
        row=1,
        col=col,
    )


def _add_chosen_k(fig: go.Figure, k: int, panels: dict, left: bool) -> None:
    """The theory at the chosen K, ringed and labelled; the label steps aside from a measured point above."""
    ring = {"color": SERIES["theory"], "symbol": "circle-open", "line": {"width": 3}}
    for col, (val, other) in panels.items():
        label = f"K = {k}: E = {val:.2f}" if col == E_PANEL else f"K = {k}: {fmt_speedup(val)}"
        meta = {"role": "chosen_k", "k": k, "value": val}
        legend = ("k", col == E_PANEL)
        _add_point(fig, col, k, val, ring, f"chosen K = {k}", legend, f"{label}<extra>theory</extra>", meta)
        _label(fig, k, val, label, SERIES["theory"], col, above=not (other is not None and other > val), left=left)


def _add_measured(fig: go.Figure, measured: dict, k: int, panels: dict, k_max: int) -> None:
    """The run's measured tokens per pass and wall-clock speedup as stars, labelled away from the theory."""
    mk = int(measured.get("k") or k)
    alpha = measured.get("alpha")
    star = {"color": SERIES["measured"], "symbol": "star", "line": {"width": 1}}
    for col, (theory, value) in panels.items():
        if value is None:
            continue
        if col == E_PANEL:
            text = f"your run (measured): {value:.2f}"
            hover = f"your run (measured): K = {mk}, {value:.2f} tokens per pass" + (
                f", α = {float(alpha):.3f}" if alpha is not None else ""
            )
        else:
            text = f"your run (measured): {fmt_speedup(value)}"
            hover = f"your run (measured): {fmt_speedup(value)} wall-clock"
        # One legend entry for both stars: the E panel's, or the speedup panel's when it is alone.
        legend = ("measured", col == E_PANEL or panels[E_PANEL][1] is None)
        meta = {"role": "measured", "panel": "E" if col == E_PANEL else "speedup"}
        _add_point(fig, col, mk, value, star, "your run (measured)", legend, f"{hover}<extra></extra>", meta)
        _label(fig, mk, value, text, SERIES["measured"], col, above=value >= theory, left=mk > FAR_RIGHT * k_max)


def _add_break_even(fig: go.Figure, k_max: int) -> None:
    fig.add_hline(y=1.0, line={"color": SERIES["baseline"], "dash": "dot", "width": 1.5}, row=1, col=SPEEDUP_PANEL)
    fig.add_annotation(
        text="break-even (no speedup)",
        x=k_max,
        y=1.0,
        xanchor="right",
        yanchor="top",
        showarrow=False,
        font={"size": 11},
        row=1,
        col=SPEEDUP_PANEL,
    )


def speedup_figure(alpha: float, k: int, c: float, measured: dict | None = None) -> go.Figure:
    """Speculation calculator (theory): E(K) = (1 − α^(K+1))/(1 − α) and speedup = E / (K·c + 1), K = 1..12.

    c = cost of one draft token ÷ cost of one target pass. `measured` = {"alpha", "k", "tokens_per_pass",
    "speedup" (optional)} is drawn as a point labelled "your run (measured)".
    """
    alpha, k, c = float(alpha), int(k), float(c)
    _check(alpha, k, c)
    k_max = max(K_SHOWN, k, int((measured or {}).get("k") or 0))
    ks = list(range(1, k_max + 1))
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("tokens per target pass E", "wall-clock speedup E / (K·c + 1)"),
        horizontal_spacing=0.1,
    )
    others = [a for a in COMPARISON_ALPHAS if abs(a - alpha) > SAME_ALPHA]
    for a, dash in zip(others, COMPARISON_DASHES):
        _add_theory(fig, ks, a, c, dash)
    sp = _add_theory(fig, ks, alpha, c)
    panels = _panel_values(alpha, k, c, measured)
    _add_chosen_k(fig, k, panels, left=k > FAR_RIGHT * k_max)
    _add_break_even(fig, k_max)
    if measured:
        _add_measured(fig, measured, k, panels, k_max)
    best_k = ks[max(range(len(ks)), key=lambda i: sp[i])]
    e_k, s_k = panels[E_PANEL][0], panels[SPEEDUP_PANEL][0]
    title = (
        f"Speedup calculator (theory): α = {alpha:.3f}, c = {c:.2f}, K = {k} → "
        f"{e_k:.2f} tokens per pass, {fmt_speedup(s_k)} (best K here: {best_k})"
    )
    subtitle = (
        "theory: E = (1 − α^(K+1)) / (1 − α) tokens per target pass; speedup = E / (K·c + 1), "
        "c = cost of one draft token ÷ cost of one target pass"
    )
    fig.update_xaxes(
        title_text="K (draft tokens per pass)", tickmode="linear", dtick=1 if k_max <= FINE_TICKS_UP_TO else 2
    )
    fig.update_yaxes(title_text="tokens per target pass", rangemode="tozero", row=1, col=E_PANEL)
    fig.update_yaxes(title_text="× faster than no speculation", rangemode="tozero", row=1, col=SPEEDUP_PANEL)
    apply_layout(fig, title, subtitle, height=SPEEDUP_HEIGHT)
    return fig


def run_speedup_figure(trace, baseline_trace=None) -> go.Figure:
    """The calculator at a run's own α and K, c estimated from its timings, with its measured point
    (and its measured wall-clock speedup when a baseline run is given)."""
    events = events_of(trace)
    s = run_summary(events)
    k = max(1, s["k"])
    c = s["draft_cost_ratio"] if s["draft_cost_ratio"] is not None else 0.0
    measured = None
    if s["mode"] != "baseline" and step_events(events):
        measured = {"alpha": s["position_acceptance"], "k": k, "tokens_per_pass": s["tokens_per_pass"]}
        if baseline_trace is not None:
            speed = measured_speedup(run_summary(baseline_trace), s)
            if speed is not None:
                measured["speedup"] = speed
    fig = speedup_figure(min(1.0, max(0.0, s["position_acceptance"])), k, c, measured)
    if s["mode"] == "baseline":  # no drafter: K is 0 and there is no draft cost to estimate
        note = "baseline run: nothing drafted, so α = 0 and c is not estimated (taken as 0)"
    elif s["draft_cost_ratio"] is not None:
        note = (
            f"c = {c:.2f} estimated from this run: mean draft time {s['mean_draft_ms']:.1f} ms "
            f"÷ (K × mean target pass {s['mean_verify_ms']:.1f} ms)"
        )
    else:
        note = "c unknown (no timings yet): taken as 0"
    set_subtitle(fig, f"{raw_subtitle(fig)}<br>{note}")
    return fig


# ------------------------------------------------------------------------------------------- batch


def _batch_result(measurements: dict) -> dict:
    """The engine's batch result (engine.metrics.batch_throughputs: throughputs, speedups, verdict), computed
    from raw pass times + α when the caller passed only those."""
    try:
        sizes = [int(b) for b in measurements["batch_sizes"]]
        n_1, n_k1 = len(measurements["pass_ms_1"]), len(measurements["pass_ms_k1"])
        measurements["k"], measurements["alpha"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"batch measurements are incomplete: {exc}") from None
    if not sizes or n_1 != len(sizes) or n_k1 != len(sizes):
        raise ValueError("batch_sizes, pass_ms_1 and pass_ms_k1 must be non-empty lists of the same length")
    if "verdict" in measurements:
        return measurements
    draft_ms = float(measurements.get("draft_ms_per_token") or 0.0)
    return batch_throughputs(measurements, float(measurements["alpha"]), draft_ms)


def _throughput_line(bs, ys, role: str, name: str, colour: str, symbol: str, customdata, hover: str) -> go.Scatter:
    return go.Scatter(
        x=bs,
        y=ys,
        mode="lines+markers",
        name=name,
        line={"color": colour, "width": 3},
        marker={"size": 8, "symbol": symbol},
        customdata=customdata,
        hovertemplate=hover,
        meta={"role": role, "y": ys},
    )


def _add_batch_lines(fig: go.Figure, bs, t1, tk, without, with_spec, ratio, k: int, e: float) -> None:
    """Throughput without and with speculation; hovers give the measured pass times behind each point.
    The with-speculation points are labelled with their speedup over the without line."""
    hover = "batch %{x}: %{y:.1f} tok/s (computed)<br>pass time %{customdata[0]:.1f} ms (measured)"
    name = "without speculation: B ÷ pass time (1 token per row)"
    customdata = [[t] for t in t1]
    fig.add_trace(
        _throughput_line(
            bs,
            without,
            "without",
            name,
            SERIES["baseline"],
            "square",
            customdata,
            f"{hover}<extra>without speculation</extra>",
        )
    )
    hover = (
        "batch %{x}: %{y:.1f} tok/s (computed), %{customdata[1]:.2f}× vs without"
        f"<br>pass time with {k + 1} tokens per row %{{customdata[0]:.1f}} ms (measured)"
        "<extra>with speculation</extra>"
    )
    name = f"with speculation: B × E ÷ (pass time with K+1 tokens + K × draft time), E = {e:.2f}"
    customdata = [[t, r if r is not None else 0.0] for t, r in zip(tk, ratio)]
    line = _throughput_line(bs, with_spec, "with", name, SERIES["theory"], "circle", customdata, hover)
    line.update(
        mode="lines+markers+text",
        text=[fmt_speedup(r) if r is not None else "" for r in ratio],
        textposition="top center",
        cliponaxis=False,  # the first and last labels reach past the plot's edges on a phone
        meta={"role": "with", "y": with_spec, "ratio": ratio},
    )
    fig.add_trace(line)


def _mark_stop(fig: go.Figure, stop: int | None, first: int) -> None:
    """A dashed line where the engine's verdict says speculation stops paying."""
    if stop is None or stop == first:
        return
    fig.add_vline(x=stop, line={"color": PALETTE["rejected"], "dash": "dash", "width": 2})
    fig.add_annotation(
        x=stop,
        y=1,
        yref="paper",
        text=f"✗ stops paying at B = {stop}",
        showarrow=False,
        xanchor="left",
        yanchor="top",
        font={"color": PALETTE["rejected"]},
    )


def batch_figure(measurements: dict) -> go.Figure:
    """Throughput vs batch size with and without speculation, from measured pass times.

    measurements: engine.metrics.batch_throughputs' result (throughputs, speedups and the verdict, read
    as they are), or its input {"batch_sizes", "k", "alpha", "pass_ms_1", "pass_ms_k1",
    "draft_ms_per_token" (optional)}, which is passed through it first.
    """
    r = _batch_result(measurements)
    bs, k, alpha, e = r["batch_sizes"], int(r["k"]), float(r["alpha"]), r["expected_tokens_per_pass"]
    draft_ms = float(r.get("draft_ms_per_token") or 0.0)
    fig = go.Figure()
    _add_batch_lines(
        fig, bs, r["pass_ms_1"], r["pass_ms_k1"], r["throughput_plain"], r["throughput_speculative"], r["speedup"], k, e
    )
    _mark_stop(fig, r["stops_paying_at"], bs[0])
    title = f"Throughput vs batch size: {r['verdict']}"
    subtitle = (
        f"pass times measured, throughput computed · E(α = {alpha:.3f}, K = {k}) = {e:.2f} tokens per pass (theory)"
        + (f" · draft {draft_ms:.2f} ms per token (measured)" if draft_ms else " · drafting cost taken as 0")
        + " · labels: speedup with ÷ without"
    )
    log = len(bs) > 1 and max(bs) / max(min(bs), 1) >= LOG_SPAN
    # An explicit range: plotly pads an automatic one for the speedup labels by their pixel width, and a chart
    # drawn while its tab was hidden (no width yet) got a log range of 10^-6.5 to 10^83.5 on a phone.
    low, high = (math.log10(min(bs)), math.log10(max(bs))) if log else (min(bs), max(bs))
    pad = max(high - low, 1.0) * X_PAD
    fig.update_xaxes(
        title_text="batch size B",
        type="log" if log else "linear",
        range=[low - pad, high + pad],
        tickmode="array",
        tickvals=bs,
        ticktext=[str(b) for b in bs],
    )
    fig.update_yaxes(title_text="tokens per second (computed)", rangemode="tozero")
    apply_layout(fig, title, subtitle, height=BATCH_HEIGHT)
    return fig


PASS_WIDTH_HEIGHT = 460


def pass_width_figure(cpu: dict | None, gpu: dict) -> go.Figure:
    """What one target pass costs against the number of tokens it verifies: this CPU's passes measured live
    (cpu: {"widths", "ms", "measured_on"}, or None before a measurement) beside a GPU's recorded ones (gpu: the
    record in assets/recorded/, its one-token passes and its n-gram verify passes, whose widths were not recorded
    one by one: drawn as a band over the widths shown)."""
    fig = go.Figure()
    widths = (cpu or {}).get("widths") or list(range(1, 17))
    low, high = min(gpu["ngram_verify_pass_ms"]), max(gpu["ngram_verify_pass_ms"])
    fig.add_trace(
        go.Scatter(
            x=[widths[0], widths[-1], widths[-1], widths[0], widths[0]],
            y=[low, low, high, high, low],
            fill="toself",
            mode="lines",
            line={"width": 0},
            fillcolor="rgba(120, 120, 120, 0.18)",
            name=f"{gpu['device'].split(',')[0]}, n-gram verify passes (up to K + 1 tokens), recorded {gpu['recorded']}",
            hoverinfo="skip",
        )
    )
    one = gpu["one_token_pass_ms"]
    fig.add_trace(
        go.Scatter(
            x=[1],
            y=[sorted(one)[len(one) // 2]],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [max(one) - sorted(one)[len(one) // 2]],
                "arrayminus": [sorted(one)[len(one) // 2] - min(one)],
            },
            mode="markers",
            marker={"size": 11, "symbol": "diamond", "color": SERIES["baseline"]},
            name=f"{gpu['device'].split(',')[0]}, one-token pass, recorded {gpu['recorded']}",
            hovertemplate="%{y:.1f} ms (recorded)<extra></extra>",
        )
    )
    if cpu:
        fig.add_trace(
            go.Scatter(
                x=cpu["widths"],
                y=cpu["ms"],
                mode="lines+markers",
                line={"color": PALETTE["accepted"], "width": 2.5},
                marker={"size": 6},
                name=f"this CPU, measured now ({cpu['measured_on']})",
                hovertemplate="%{x} tokens: %{y:.1f} ms (measured)<extra></extra>",
            )
        )
    ticks = sorted({1, *range(4, widths[-1] + 1, 4)})  # few enough to read on a phone
    fig.update_xaxes(title_text="tokens verified in one target pass", tickvals=ticks)
    fig.update_yaxes(title_text="ms per target pass", rangemode="tozero")
    subtitle = (
        "measured here: press Measure" if not cpu else "one pass per width, median of 3 rounds, 64 tokens of context"
    )
    return apply_layout(fig, "What a wider target pass costs: this CPU and a GPU", subtitle, height=PASS_WIDTH_HEIGHT)
