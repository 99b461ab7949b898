"""Figures of "Your deployment": a server's window of traffic, as engine/tools/analyze.py read it.

Pure functions of the analysis dict (plain JSON: numbers, lists, dicts keyed by K and by batch size, as
ints or, once through JSON, as strings). They draw what the analyzer decided and compute nothing new.
"""

from __future__ import annotations

import plotly.graph_objects as go

from .style import LABEL_BG, PALETTE, SERIES, apply_layout, message_figure

__all__ = ["acceptance_window_figure", "expected_speedup_figure", "requests_figure"]

REQUESTS_TITLE = "Which requests pay: mean acceptance length per request"


# what the expected speedups count (engine/tools/analyze.py model_note says it in full): whole requests where
# the server counts per-request times, else decode passes only
MODEL_WORDS = {True: "whole requests, time outside decode passes included", False: "decode passes only"}


def _keyed(table: dict) -> dict[int, object]:
    """{int key: value} of a dict keyed by ints or by their strings (after a JSON round trip)."""
    return {int(k): v for k, v in table.items()}


def acceptance_window_figure(result: dict) -> go.Figure:
    """Acceptance by draft position in the window (bars, measured) beside the fitted α^i (line), with the
    draft acceptance rate and the mean acceptance length side by side in the title."""
    rates = result.get("acceptance_by_position") or []
    rate = result.get("acceptance_rate")
    title = f"Acceptance rate {'—' if rate is None else f'{rate:.2f}'} · length {result['mean_acceptance_length']:.2f}"
    if not rates:
        return message_figure(title, "This server exports no per-position counters: only the rate and the length.")
    positions = list(range(1, len(rates) + 1))
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=positions,
            y=rates,
            name="measured: share of drafting passes that kept position i",
            marker={"color": PALETTE["accepted"]},
            text=[f"{r:.2f}" for r in rates],
            textposition="outside",
            hovertemplate="position %{x}: %{y:.3f} of drafting passes kept it (measured)<extra></extra>",
        )
    )
    alpha = result.get("alpha_fit")
    if alpha:
        fig.add_trace(
            go.Scatter(
                x=positions,
                y=[alpha**i for i in positions],
                mode="lines+markers",
                name=f"α^i with α = {alpha:.2f} (fitted)",
                line={"color": SERIES["theory"], "width": 3, "dash": "dash"},
                hovertemplate="α^%{x} = %{y:.3f} (fit)<extra></extra>",
            )
        )
    fig.update_xaxes(title_text="draft position i", tickvals=positions)
    fig.update_yaxes(title_text="share of drafting passes", range=[0, 1.1])
    subtitle = (
        f"mean acceptance length: tokens per drafting pass · {result['drafts']:.0f} drafting passes, "
        f"{result['draft_tokens']:.0f} draft tokens, {result['accepted']:.0f} accepted in the window (the server's "
        "counters)"
    )
    return apply_layout(fig, title, subtitle)


def expected_speedup_figure(result: dict) -> go.Figure:
    """Expected speedup by K (rows) and batch size (columns), from the window's α and the server's pass costs:
    green where it pays, red where it costs, each cell labelled; the recommended K per batch boxed by its
    label. An estimate from measured inputs, titled as one."""
    table = result.get("speedup_by_batch")
    if not table:
        return message_figure(
            "Expected speedup by K and batch size",
            "Give the server's pass costs (probe them or type them) to weigh tokens per pass against what a "
            "wider pass costs.",
        )
    by_batch = {b: _keyed(row) for b, row in _keyed(table).items()}
    batches = sorted(by_batch)
    ks = sorted(by_batch[batches[0]])
    best = _keyed(result.get("best_k_by_batch") or {})
    z = [[by_batch[b][k] for b in batches] for k in ks]
    text = [[f"{'▶ ' if best.get(b) == k else ''}{by_batch[b][k]:.2f}×" for b in batches] for k in ks]
    # The colour scale of a speedup starts at 0× and is white at 1× (no change): red below, green above, whatever
    # the range (a scale centred elsewhere, or reaching below 0, would colour a loss as a gain).
    top = max(2.0, max(max(row) for row in z))
    fig = go.Figure(
        go.Heatmap(
            x=[str(b) for b in batches],
            y=[str(k) for k in ks],
            z=z,
            text=text,
            texttemplate="%{text}",
            zmin=0.0,
            zmax=top,
            colorscale=[[0.0, PALETTE["rejected"]], [1.0 / top, "#FFFFFF"], [1.0, PALETTE["accepted"]]],
            colorbar={"title": {"text": "× vs off"}},
            hovertemplate="K = %{y}, batch %{x}: %{z:.2f}× expected<extra></extra>",
        )
    )
    fig.update_xaxes(title_text="concurrent requests (batch size)", type="category")
    fig.update_yaxes(title_text="draft tokens K", type="category")
    alpha = result.get("alpha_fit") or 0.0
    costs = result.get("pass_costs") or {}
    subtitle = (
        f"expected, not measured: tokens per pass at α = {alpha:.2f} with {result['drafting_share']:.0%} of passes "
        f"drafting, against {costs.get('against', 'plain passes')} (pass costs at K = {costs.get('k')}: "
        f"{costs.get('source') or 'given'}) · {MODEL_WORDS[result.get('model') == 'requests']} · ▶ = the best K at "
        "that load"
    )
    return apply_layout(fig, "Expected speedup by K and batch size", subtitle, height=460, legend_bottom=False)


def requests_figure(readings: list[dict], dist: dict) -> go.Figure:
    """Each request's mean acceptance length τ (engine/tools/per_request.py: from its own histogram), sorted, one
    bar per request; with a break-even τ, bars above it (the request pays) in the accepted colour, the others in
    the rejected colour, and the break-even as a dashed line. Draws what the reading decided."""
    if not readings:
        return message_figure(REQUESTS_TITLE, "Read a log of responses with per-request speculative metrics.")
    ordered = sorted(readings, key=lambda r: r["tau"])
    cut = dist.get("break_even")
    colours = [
        PALETTE["drafted"] if cut is None else PALETTE["accepted"] if r["tau"] > cut else PALETTE["rejected"]
        for r in ordered
    ]
    names = [f"{r.get('label') or 'request'} (line {r['line']})" for r in ordered]
    fig = go.Figure(
        go.Bar(
            x=list(range(1, len(ordered) + 1)),
            y=[r["tau"] for r in ordered],
            marker={"color": colours},
            customdata=[[n, r["steps"], r["accepted"]] for n, r in zip(names, ordered)],
            hovertemplate="%{customdata[0]}: τ = %{y:.2f} (%{customdata[2]} drafts kept in %{customdata[1]} "
            "verify steps)<extra>measured by the server</extra>",
            name="τ per request (measured)",
        )
    )
    if cut is not None:
        fig.add_hline(y=cut, line={"dash": "dash", "color": SERIES["theory"], "width": 2})
        fig.add_annotation(
            xref="paper",
            x=0.0,
            xanchor="left",
            y=cut,
            yanchor="bottom",
            showarrow=False,
            text=f"break-even τ = {cut:.2f}: {dist['paying']} of {dist['requests']} pay",
            bgcolor=LABEL_BG,
            yshift=3,
        )
    q = dist["tau_quantiles"]
    subtitle = (
        f"{dist['requests']} requests, sorted · median τ {q['median']:.2f} (p10 {q['p10']:.2f}, p90 {q['p90']:.2f}) · "
        f"mean over requests {dist['tau_request_mean']:.2f}, over verify steps {dist['tau_step_mean']:.2f} (what "
        "/metrics gives)"
        + (" · break-even from the window's pass costs" if cut is not None else " · no pass costs: no break-even")
    )
    fig.update_xaxes(
        title_text="requests, by τ", tickvals=list(range(1, len(ordered) + 1)) if len(ordered) <= 20 else None
    )
    fig.update_yaxes(title_text="τ: tokens per verify step", rangemode="tozero")
    return apply_layout(fig, REQUESTS_TITLE, subtitle, legend_bottom=False)
