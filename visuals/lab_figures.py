"""Figures of the app's Race tab and labs: the race chart, the toy example, the lossless histograms.

Plotly only, like the rest of visuals: each function takes plain numbers or a trace and returns a
figure in the common style (style.apply_layout). The numbers themselves (sample counts, test
results, pass times) are computed elsewhere (engine.tools.exactness, engine.model.pass_timing) and only
drawn here.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.trace import step_events

from .style import PALETTE, SERIES, TITLE_PAD, apply_layout, message_figure, show_token

__all__ = [
    "fmt_pvalue",
    "measured_batch_figure",
    "lossless_figure",
    "message_figure",
    "race_figure",
    "shortcuts_figure",
    "toy_figure",
]

RACE_HEIGHT = 380
TOY_HEIGHT = 440
LOSSLESS_HEIGHT = 500
SUBPLOT_TITLE_ROOM = 52  # the samplers' names above their panels (three lines)
TICK_ROOM_PX = 80  # under the axis: a token label of LOSSLESS_LABEL_LEN characters, upright
LEGEND_ROOM_PX = 110  # under the labels: the legend's rows (three on a phone's 760 px)
TOY_LABEL_LEN = 14  # characters of a toy token shown on the axis
LOSSLESS_LABEL_LEN = 10  # characters of a sampled token shown on the axis
PANEL_PX = 140  # a histogram panel's width at its narrowest: four panels in a phone's 760 px figure
MIN_DASH_PX, MAX_DASH_PX = 4, 26  # the exact p's dash, about a bar's width
DASH_SHARE = 0.55  # of a cell's width: with its 3 px line the dash stays apart from its neighbours
# y axes: probabilities, so at most a little above 1, and room above the highest bar for the labels on it.
TOY_Y_CEILING, TOY_HEADROOM = 1.08, 1.18
LOSSLESS_Y_CEILING, LOSSLESS_HEADROOM = 1.05, 1.12
SMALL_PVALUE = 1e-3  # below this a p-value is written in scientific notation

# The lossless lab's samplers, by the kind the lab gives them: the reference, the exact rule, the lossy shortcut.
SAMPLER_COLOURS = {
    "plain": SERIES["baseline"],
    "exact": PALETTE["accepted"],
    "block": PALETTE["bonus"],
    "broken": PALETTE["rejected"],
}


def fmt_pvalue(value: float | None) -> str:
    """A p-value as the labs print it: 3 significant digits, scientific notation when tiny, — for none."""
    if value is None:
        return "—"
    if value == 0:
        return "0"
    return f"{value:.3g}" if value >= SMALL_PVALUE else f"{value:.2e}"


# ------------------------------------------------------------------------------------------ race
def _tokens_over_time(trace: list[dict]) -> tuple[list[float], list[int]]:
    xs, ys = [0.0], [0]
    for step in step_events(trace):
        xs.append(float(step.get("elapsed_s") or 0.0))
        ys.append(int(step.get("tokens_total") or 0))
    return xs, ys


def race_figure(
    baseline: list[dict] | None, speculative: list[dict] | None, drafter: str = "", recorded: str = ""
) -> go.Figure:
    """Tokens produced vs measured time for both runs, on one time axis (a step plot: one step per target pass).
    recorded: where and when a recorded race ran ("recorded <date> on <CPU>"), in its title; "" for a
    race run now."""
    fig = go.Figure()
    runs = [
        ("Baseline (no drafter)", baseline, SERIES["baseline"], "circle"),
        (f"Speculative ({drafter or 'drafter'})", speculative, PALETTE["accepted"], "diamond"),
    ]
    for name, trace, colour, symbol in runs:
        if not trace:
            continue
        xs, ys = _tokens_over_time(trace)
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines+markers",
                line={"shape": "hv", "color": colour, "width": 2.5},
                marker={"size": 5, "symbol": symbol, "color": colour},
                name=name,
                hovertemplate="%{y} tokens after %{x:.2f} s<extra>" + name + "</extra>",
            )
        )
    subtitle = "each marker is one target pass; steeper = faster. Both runs are real, one after the other."
    title = f"Tokens over time, {recorded}" if recorded else "Tokens over measured time"
    apply_layout(fig, title, subtitle, height=RACE_HEIGHT)
    fig.update_xaxes(title_text="elapsed time (s)", rangemode="tozero")
    fig.update_yaxes(title_text="tokens generated", rangemode="tozero")
    if not fig.data:
        fig.add_annotation(text="Press Race to run both", x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)
    return fig


# ------------------------------------------------------------------------------------- toy example
def _bars(xs: list[int], ys: list[float], name: str, marker: dict, group: str, hover: str, **more) -> go.Bar:
    """One series of the toy figure: bars in their offset group (p, q or the sampled output)."""
    return go.Bar(x=xs, y=ys, name=name, marker=marker, offsetgroup=group, hovertemplate=hover, **more)


def _toy_output_bars(fig: go.Figure, xs: list[int], labels: list[str], counts: dict) -> list[float]:
    """The sampled output as accepted + resampled stacked bars; returns the output frequencies."""
    n = max(1, counts["n"])
    acc = [a / n for a in counts["accepted"]]
    res = [r / n for r in counts["resampled"]]
    freq = [(a + r) / n for a, r in zip(counts["accepted"], counts["resampled"])]
    hover = "%{customdata[0]}: %{customdata[1]} {kind} = %{y:.3f}<extra></extra>"
    accepted = _bars(
        xs,
        acc,
        "✓ accepted drafts (sampled)",
        {"color": PALETTE["accepted"]},
        "out",
        hover.replace("{kind}", "accepted"),
        customdata=[list(c) for c in zip(labels, counts["accepted"])],
    )
    resampled_marker = {"color": PALETTE["resampled"], "pattern": {"shape": "/"}}
    resampled = _bars(
        xs,
        res,
        "↻ resampled from the residual (sampled)",
        resampled_marker,
        "out",
        hover.replace("{kind}", "resampled"),
        customdata=[list(c) for c in zip(labels, counts["resampled"])],
        base=acc,
        text=[f"{a + r:.3f}" for a, r in zip(acc, res)],
        textposition="outside",
    )
    fig.add_trace(accepted)
    fig.add_trace(resampled)
    return freq


def toy_figure(tokens: list[str], p: list[float], q: list[float], counts: dict | None) -> go.Figure:
    """The toy p and q as bars, and when sampled (counts from engine.tools.exactness.toy_sampling) what came out."""
    labels = [show_token(t, TOY_LABEL_LEN) for t in tokens]
    xs = list(range(len(tokens)))
    fig = go.Figure()
    p_hover = "%{customdata}: p = %{y:.3f}<extra>target p</extra>"
    fig.add_trace(
        _bars(
            xs,
            p,
            "p, target (exact)",
            {"color": SERIES["target"]},
            "p",
            p_hover,
            text=[f"{v:.3f}" for v in p],
            textposition="outside",
            customdata=labels,
        )
    )
    output = _toy_output_bars(fig, xs, labels, counts) if counts else []
    q_hover = "%{customdata}: q = %{y:.3f}<extra>drafter q</extra>"
    q_marker = {"color": SERIES["drafter"], "opacity": 0.55}
    fig.add_trace(_bars(xs, q, "q, drafter (what is proposed)", q_marker, "q", q_hover, customdata=labels))
    subtitle = (
        f"{counts['n']} samples: output frequency = accepted + resampled (stacked), next to the exact p"
        if counts
        else "press Sample 1000 times to draw real samples"
    )
    apply_layout(fig, "Toy example: p, q and what speculative sampling emits", subtitle, height=TOY_HEIGHT)
    top = max(p + q + output)
    fig.update_layout(barmode="group", bargap=0.25, bargroupgap=0.05)
    fig.update_xaxes(tickmode="array", tickvals=xs, ticktext=labels, title_text="token")
    fig.update_yaxes(title_text="probability / frequency", range=[0, min(TOY_Y_CEILING, top * TOY_HEADROOM + 0.02)])
    return fig


# ------------------------------------------------------------------------------------ lossless lab
def _lossless_titles(samplers: dict[str, str], results: dict) -> list[str]:
    titles = []
    for kind, name in samplers.items():
        res = results.get(kind)
        # the name's parenthesis on its own line: four panels side by side on a phone's 760 px had their titles
        # run into each other
        name = name.replace(" (", "<br>(", 1)
        if res is None:
            titles.append(f"{name}<br><i>not run</i>")
        else:
            test = res["test"]
            titles.append(f"{name}<br>p-value {fmt_pvalue(test['pvalue'])} · TV {test['tv']:.3f}")
    return titles


def _exact_p_marks(order: list[int], p: dict[int, float], ticks: list[str], first: bool) -> go.Scatter:
    # A dash about a bar's width on the narrowest panel (a phone's): 26 px dashes over two dozen bars of 6 px ran
    # into each other, and no dash could be told to its bar.
    dash = max(MIN_DASH_PX, min(MAX_DASH_PX, PANEL_PX * DASH_SHARE / max(1, len(order))))
    return go.Scatter(
        x=list(range(len(order))),
        y=[p[t] for t in order],
        mode="markers",
        name="exact p (computed from the target's logits)",
        marker={"symbol": "line-ew", "size": dash, "line": {"width": 3, "color": SERIES["target"]}},
        legendgroup="p",
        showlegend=first,
        customdata=ticks,
        hovertemplate="%{customdata}: exact p = %{y:.3f}<extra></extra>",
        meta={"role": "p"},
    )


def lossless_figure(
    p: dict,
    labels: dict,
    results: dict,
    n: int,
    samplers: dict[str, str],
    cells: str = "Next-token",
    pooled_key=None,
) -> go.Figure:
    """One histogram per sampler (samplers: kind -> name, in panel order) against the exact p.

    results: kind -> {"counts": {token: count}, "test": engine.tools.exactness.chi_square_test(...)}, for
    the samplers that ran; labels: token id -> text. pooled_key: the cell that pools the least likely ones
    (drawn last, whatever its mass), if any.
    """
    order = sorted(p, key=lambda t: (t == pooled_key, -p[t]))
    xs = list(range(len(order)))
    # the pooled cell's name is words, not a token: no visible-space marks, not cut
    ticks = [labels[t] if t == pooled_key else show_token(labels.get(t, str(t)), LOSSLESS_LABEL_LEN) for t in order]
    titles = _lossless_titles(samplers, results)
    fig = make_subplots(rows=1, cols=len(samplers), shared_yaxes=True, subplot_titles=titles, horizontal_spacing=0.04)
    top = max(p.values()) if p else 1.0
    for col, kind in enumerate(samplers, start=1):
        res = results.get(kind)
        if res is not None:
            freq = [res["counts"].get(t, 0) / n for t in order]
            top = max(top, *freq)
            fig.add_trace(
                go.Bar(
                    x=xs,
                    y=freq,
                    name=samplers[kind] + " (sampled)",
                    marker={"color": SAMPLER_COLOURS[kind]},
                    customdata=[[tick, res["counts"].get(t, 0), p[t]] for tick, t in zip(ticks, order)],
                    hovertemplate="%{customdata[0]}: %{customdata[1]} of " + str(n) + " = %{y:.3f}"
                    "<br>exact p = %{customdata[2]:.3f}<extra></extra>",
                    meta={"role": kind},
                ),
                row=1,
                col=col,
            )
        fig.add_trace(_exact_p_marks(order, p, ticks, col == 1), row=1, col=col)
        # upright labels: at -45° a dozen tokens in a panel of ~150 px (four panels on a phone) ran into each other
        fig.update_xaxes(
            tickmode="array", tickvals=xs, ticktext=ticks, tickangle=-90, tickfont={"size": 10}, row=1, col=col
        )
    subtitle = f"bars: frequencies of {n} real samples each · dashes: the exact p"
    apply_layout(fig, f"{cells} histograms against the target's exact p", subtitle, height=LOSSLESS_HEIGHT)
    # The upright token labels take TICK_ROOM_PX under the axis; the legend starts below them (at a fixed
    # share of the plot's height it sat on their ends).
    bottom = TICK_ROOM_PX + LEGEND_ROOM_PX
    height = fig.layout.height + SUBPLOT_TITLE_ROOM + bottom - fig.layout.margin.b
    top = fig.layout.margin.t + SUBPLOT_TITLE_ROOM
    fig.update_layout(
        margin={"t": top, "b": bottom},
        height=height,
        legend={"y": -TICK_ROOM_PX / (height - top - bottom), "yanchor": "top"},
        title_y=1.0 - TITLE_PAD / height,  # the title block stays at the top of the taller figure
    )
    fig.update_yaxes(title_text="probability / frequency", row=1, col=1)
    fig.update_yaxes(range=[0, min(LOSSLESS_Y_CEILING, top * LOSSLESS_HEADROOM + 0.01)])
    for ann in fig.layout.annotations or ():
        ann.font.size = 12
    return fig


# ------------------------------------------------------------------------------------- shortcuts lab
SHORTCUTS_HEIGHT = 460
NUMBER_OFFSET_PX = 16  # a row number's invisible marker: its text starts half of this off the point
NEAR_X, NEAR_Y = 0.06, 0.1  # shares of the axes' spans within which a neighbouring point would meet a label


def _number_side(row: dict, rows: list[dict]) -> str:
    """Where a row's number goes: right of its point, unless a neighbour sits there (then left, then above), so
    that a number is never drawn over another point's marker."""
    span_x = (max(r["tokens_per_pass"] for r in rows) - min(r["tokens_per_pass"] for r in rows)) or 1.0
    span_y = max(r["tv_high"] for r in rows) or 1.0

    def near(side: int) -> bool:
        def on_side(other: dict) -> bool:  # a point at the same x counts as right of the lower-numbered row
            dx = side * (other["tokens_per_pass"] - row["tokens_per_pass"]) / span_x
            return 0 < dx < NEAR_X or (dx == 0 and side * (other["number"] - row["number"]) > 0)

        return any(
            other is not row and on_side(other) and abs(other["tv"] - row["tv"]) / span_y < NEAR_Y for other in rows
        )

    if not near(+1):
        return "middle right"
    # left of the leftmost points a number sits on the y axis, among its ticks: above instead
    at_axis = (row["tokens_per_pass"] - min(r["tokens_per_pass"] for r in rows)) / span_x < NEAR_X
    return "middle left" if not near(-1) and not at_axis else "top center"


def _add_row_numbers(fig: go.Figure, rows: list[dict]) -> None:
    """The table's row numbers beside the points, as one trace drawn after every marker (a number drawn with its
    own trace sat under the next trace's markers)."""
    if not rows:
        return
    fig.add_trace(
        go.Scatter(
            x=[r["tokens_per_pass"] for r in rows],
            y=[r["tv"] for r in rows],
            # invisible markers the size of the visible ones: the numbers keep a marker's radius off their point
            # (a text-only trace put them on it)
            mode="markers+text",
            marker={"size": NUMBER_OFFSET_PX, "opacity": 0},
            text=[str(r["number"]) for r in rows],
            textposition=[_number_side(r, rows) for r in rows],
            textfont={"size": 12},
            cliponaxis=False,
            showlegend=False,
            hoverinfo="skip",
            meta={"role": "row numbers"},
        )
    )


def shortcuts_figure(rows: list[dict], n: int, floor: float | None = None) -> go.Figure:
    """What each verification rule buys and costs: tokens per target pass (x) against the total-variation
    distance of its samples from the exact p (y, with its bootstrap interval), one point per row.

    rows: {"number" (the row's number in the lab's table, written beside its point: names would overlap where
    rules land close together), "label" (the rule and its drafter), "exact" (a lossless rule), "tokens_per_pass", "tv", "tv_low",
    "tv_high", "verdict"}, as app/labs/shortcuts.py builds them from engine.tools.shortcuts.run_rule. The exact
    rows' TV is the noise of n samples: a shortcut's cost is its distance above theirs. floor: the TV an exact
    sampler of n samples stays below in 95% of runs (engine.tools.exactness.tv_noise_floor), drawn as a line."""
    fig = go.Figure()
    for exact in (True, False):
        group = [r for r in rows if r["exact"] == exact]
        if not group:
            continue
        colour = PALETTE["accepted"] if exact else PALETTE["rejected"]
        fig.add_trace(
            go.Scatter(
                x=[r["tokens_per_pass"] for r in group],
                y=[r["tv"] for r in group],
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": [max(0.0, r["tv_high"] - r["tv"]) for r in group],
                    "arrayminus": [max(0.0, r["tv"] - r["tv_low"]) for r in group],
                    "color": colour,
                },
                mode="markers",
                cliponaxis=False,
                marker={"color": colour, "size": 11, "symbol": "circle" if exact else "x"},
                name="exact rules (their distance is sampling noise)" if exact else "shortcuts",
                customdata=[[f"{r['number']}. {r['label']}", r["tv_low"], r["tv_high"], r["verdict"]] for r in group],
                hovertemplate="%{customdata[0]}<br>%{x:.2f} tokens per pass<br>TV from p %{y:.3f} "
                "[%{customdata[1]:.3f}–%{customdata[2]:.3f}]<br>%{customdata[3]}<extra></extra>",
            )
        )
    xs = [r["tokens_per_pass"] for r in rows] or [1.0]
    _add_row_numbers(fig, rows)
    if floor is not None:  # a line across the plot, named in the legend (a label on it would cover points)
        fig.add_trace(
            go.Scatter(
                x=[min(xs) - 0.1, max(xs) + 0.2],
                y=[floor, floor],
                mode="lines",
                line={"dash": "dash", "color": SERIES["baseline"], "width": 1},
                name=f"noise floor: N samples of p itself stay below {floor:.3f} in 95% of runs",
                hoverinfo="skip",
            )
        )
    fig.update_xaxes(title_text="tokens per target pass", range=[min(xs) - 0.1, max(xs) + 0.2])
    fig.update_yaxes(title_text="distance from p (TV)", rangemode="tozero")
    apply_layout(
        fig,
        "What each rule buys and what it costs",
        f"{n} samples per row · right: buys tokens · up: costs exactness · numbers: the table's rows",
        height=SHORTCUTS_HEIGHT,
    )
    return fig


# --------------------------------------------------------------------------------------- batch lab


# ------------------------------------------------------------------------------------- batch, measured
def measured_batch_figure(report: dict) -> go.Figure:
    """Throughput vs batch size as measured on real servers (engine.vllm.batch.measure_batches): one line per
    server with its spread over the repeats, the speedup of the speculative one labelled at each B."""
    sizes = report["batch_sizes"]
    fig = go.Figure()
    speedup = report.get("speedup") or [None] * len(sizes)
    for name, mode in report["modes"].items():
        spec = bool(mode.get("speculative"))
        label = f"with speculation (K = {mode.get('k')})" if spec else "without speculation"
        lows = [m - lo for m, lo in zip(mode["tok_per_s"], mode["tok_per_s_min"])]
        highs = [hi - m for m, hi in zip(mode["tok_per_s"], mode["tok_per_s_max"])]
        fig.add_trace(
            go.Scatter(
                x=sizes,
                y=mode["tok_per_s"],
                mode="lines+markers+text" if spec else "lines+markers",
                text=[f"{s:.2f}×" if s else "" for s in speedup] if spec else None,
                textposition="top center",
                name=f"{label}: {name} server (measured, median)",
                line={"color": SERIES["theory" if spec else "baseline"], "width": 3},
                error_y={"type": "data", "symmetric": False, "array": highs, "arrayminus": lows},
                hovertemplate="B = %{x}: %{y:.1f} tok/s (measured)<extra>" + name + "</extra>",
                meta={"role": name},
            )
        )
    verdict = report.get("verdict", "one server only: no speedup to compare")
    fig.update_xaxes(title_text="batch size B (concurrent requests)", type="log", tickvals=sizes, ticktext=sizes)
    fig.update_yaxes(title_text="tokens per second (measured)", rangemode="tozero")
    subtitle = (
        f"real batches on vLLM, median of {report['settings']['repeats']} repeats, bars = min–max · labels: "
        "speedup with ÷ without"
    )
    apply_layout(fig, f"Measured on vLLM: {verdict}", subtitle, height=LOSSLESS_HEIGHT)
    return fig
