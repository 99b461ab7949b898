"""Figures for the app: thin, crash-proof wrappers around `visuals`, plus the race chart.

Every wrapper returns a plotly figure; if `visuals` raises (a malformed uploaded trace, a bug),
the failure is logged and a figure saying so is shown instead of breaking the page.
"""

from __future__ import annotations

import logging

import plotly.graph_objects as go

__all__ = ["figure", "message", "race_figure"]

log = logging.getLogger("speclens.app")


def message(title: str, text: str) -> go.Figure:
    """An empty figure carrying a short explanation."""
    try:
        from visuals.style import message_figure

        return message_figure(title, text)
    except Exception:
        fig = go.Figure()
        fig.add_annotation(text=text, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        fig.update_layout(title=title, height=320, template="plotly_white")
        return fig


_TITLES = {
    "tree_figure": "Draft tree",
    "pq_figure": "p (target) vs q (drafter)",
    "timeline_figure": "Timeline",
    "tokens_per_pass_figure": "Tokens per target pass",
    "acceptance_figure": "Acceptance by draft position",
    "speedup_figure": "Expected speedup",
    "batch_figure": "Batch measurements",
}


def figure(name: str, *args, **kwargs) -> go.Figure:
    """visuals.<name>(*args, **kwargs), or an explanatory figure if that fails."""
    title = _TITLES.get(name, name)
    try:
        import visuals

        return getattr(visuals, name)(*args, **kwargs)
    except Exception as exc:  # never let a figure take the page down
        log.exception("visuals.%s failed", name)
        return message(title, f"Cannot draw this figure: {type(exc).__name__}: {exc}"[:300])


def _series(trace: list[dict]) -> tuple[list[float], list[int]]:
    xs, ys = [0.0], [0]
    for event in trace or []:
        if event.get("type") == "step":
            xs.append(float(event.get("elapsed_s") or 0.0))
            ys.append(int(event.get("tokens_total") or 0))
    return xs, ys


def race_figure(baseline: list[dict] | None, speculative: list[dict] | None, drafter: str = "") -> go.Figure:
    """Tokens produced vs measured time for both runs, on one time axis (a step plot: one step per target pass)."""
    try:
        from visuals.style import PALETTE, SERIES, apply_layout
    except Exception:  # pragma: no cover - visuals missing
        PALETTE, SERIES, apply_layout = {"accepted": "#009E73"}, {"baseline": "#7F7F7F"}, None
    fig = go.Figure()
    runs = [
        ("Baseline (no drafter)", baseline, SERIES.get("baseline", "#7F7F7F"), "circle"),
        (f"Speculative ({drafter or 'drafter'})", speculative, PALETTE.get("accepted", "#009E73"), "diamond"),
    ]
    for name, trace, colour, symbol in runs:
        if not trace:
            continue
        xs, ys = _series(trace)
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
    title = "Tokens over measured time"
    subtitle = "each marker is one target pass; steeper = faster. Both runs are real, one after the other."
    if apply_layout is not None:
        apply_layout(fig, title, subtitle, height=380)
    else:
        fig.update_layout(title=title, height=380)
    fig.update_xaxes(title_text="elapsed time (s)", rangemode="tozero")
    fig.update_yaxes(title_text="tokens generated", rangemode="tozero")
    if not fig.data:
        fig.add_annotation(text="Press Race to run both", x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)
    return fig
