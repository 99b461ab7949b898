"""One colour, symbol and label scheme for every SpecLens figure, plus small formatting helpers.

Colours are Okabe-Ito (colour-blind safe). Colour is never the only cue: every decision also has a
text mark (✓ ✗ ↻ + ·) and a marker symbol, and legends spell the decision out.
"""

from __future__ import annotations

import unicodedata

import plotly.graph_objects as go

__all__ = [
    "PALETTE",
    "MARKS",
    "SYMBOLS",
    "LABELS",
    "SERIES",
    "decision_label",
    "show_token",
    "fmt_prob",
    "fmt_speedup",
    "apply_layout",
    "message_figure",
    "use_dark_theme",
]

PALETTE: dict[str, str] = {
    "accepted": "#009E73",  # bluish green
    "rejected": "#D55E00",  # vermillion
    "resampled": "#E69F00",  # orange
    "bonus": "#0072B2",  # blue
    "not_reached": "#999999",  # grey
    "drafted": "#56B4E9",  # sky blue (a drafted token before verification)
}

MARKS: dict[str, str] = {
    "accepted": "✓",
    "rejected": "✗",
    "resampled": "↻",
    "bonus": "+",
    "not_reached": "·",
    "drafted": "?",
}

# plotly marker symbols: a second cue next to colour.
SYMBOLS: dict[str, str] = {
    "accepted": "circle",
    "rejected": "x",
    "resampled": "diamond",
    "bonus": "star",
    "not_reached": "circle-open",
    "drafted": "square",
}

LABELS: dict[str, str] = {
    "accepted": "✓ accepted",
    "rejected": "✗ rejected",
    "resampled": "↻ resampled",
    "bonus": "+ bonus",
    "not_reached": "· not reached",
    "drafted": "? drafted",
}

# Colours of series that are not decisions (kept apart from PALETTE's meanings).
SERIES: dict[str, str] = {
    "target": "#CC79A7",  # p, the target model (reddish purple)
    "drafter": "#56B4E9",  # q, the drafter (sky blue)
    "residual": PALETTE["resampled"],  # the residual the resampled token is drawn from
    "measured": "#CC79A7",
    "theory": "#0072B2",
    "baseline": "#7F7F7F",
    "context": "#7F7F7F",
}

LIGHT = {"paper": "#FFFFFF", "plot": "#FFFFFF", "font": "#222222", "grid": "#E6E6E6", "line": "#BBBBBB"}
DARK = {"paper": "#111418", "plot": "#111418", "font": "#E8E8E8", "grid": "#30343A", "line": "#5A5F66"}

LABEL_BG = "rgba(255,255,255,0.85)"  # boxed labels over lines
FONT_FAMILY = "Inter, 'Segoe UI', 'DejaVu Sans', Arial, sans-serif"


def decision_label(decision: str) -> str:
    """'✓ accepted' etc.; unknown decisions are shown as they are."""
    return LABELS.get(decision, str(decision))


_CONTROL_NAMES = {"\n": "⏎", "\r": "␍", "\t": "⇥", " ": "␣"}


def show_token(text: str | None, max_len: int | None = None) -> str:
    """A token's text made visible and safe for plotly's HTML-ish labels.

    Spaces become ␣, newlines ⏎, tabs ⇥, other invisible characters ⟨U+XXXX⟩; '<', '>' and '&' are
    escaped so that tokens like '<|im_end|>' are shown instead of being parsed as tags.
    """
    if text is None:
        return "?"
    if text == "":
        return "∅"
    out = []
    for ch in text:
        if ch in _CONTROL_NAMES:
            out.append(_CONTROL_NAMES[ch])
            continue
        cat = unicodedata.category(ch)
        if cat == "Zs":
            out.append("␣")
        elif cat in ("Cc", "Cf", "Cs", "Co", "Cn") or (cat == "Mn" and len(text) == 1):
            out.append(f"⟨U+{ord(ch):04X}⟩")
        else:
            out.append(ch)
    visible = "".join(out)
    if max_len is not None and len(visible) > max_len:
        visible = visible[: max(1, max_len - 1)] + "…"
    return visible.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def fmt_prob(x: float | None) -> str:
    """Probabilities with 3 decimals; tiny non-zero ones in scientific notation; None as '—'."""
    if x is None:
        return "—"
    x = float(x)
    if x == 0:
        return "0"
    if abs(x) < 0.001:
        return f"{x:.1e}"
    return f"{x:.3f}"


def fmt_speedup(x: float | None) -> str:
    return "—" if x is None else f"{float(x):.2f}×"


def _template(c: dict) -> go.layout.Template:
    """A small template (plotly_white-like); the full plotly_white is slow to copy into every figure."""
    axis = {
        "gridcolor": c["grid"],
        "zerolinecolor": c["line"],
        "linecolor": c["line"],
        "showline": True,
        "ticks": "",
        "automargin": True,
        "color": c["font"],
        "title": {"standoff": 12},
    }
    return go.layout.Template(
        layout={
            "xaxis": axis,
            "yaxis": axis,
            "colorway": [PALETTE[k] for k in ("bonus", "resampled", "accepted", "rejected", "drafted")],
            "hovermode": "closest",
            "paper_bgcolor": c["paper"],
            "plot_bgcolor": c["plot"],
        }
    )


_LIGHT_TEMPLATE = _template(LIGHT)
_DARK_TEMPLATE = _template(DARK)


def apply_layout(
    fig: go.Figure,
    title: str,
    subtitle: str = "",
    *,
    height: int | None = None,
    legend_bottom: bool = True,
) -> go.Figure:
    """The common look: opaque light card (readable inside light and dark pages), explicit font colours."""
    c = LIGHT
    height = int(height) if height is not None else 450
    top = 95 if subtitle else 60
    bottom = 130 if legend_bottom else 60
    layout = {
        "template": _LIGHT_TEMPLATE,
        "title": {
            "text": title,
            "subtitle": {"text": subtitle, "font": {"size": 12, "color": c["font"]}},
            "x": 0.01,
            "xanchor": "left",
            "font": {"size": 16, "color": c["font"]},
        },
        "font": {"family": FONT_FAMILY, "size": 13, "color": c["font"]},
        "paper_bgcolor": c["paper"],
        "plot_bgcolor": c["plot"],
        "height": height,
        "margin": {"l": 70, "r": 30, "t": top, "b": bottom},
        "hoverlabel": {"bgcolor": "#FFFFFF", "bordercolor": "#444444", "font": {"color": "#111111", "size": 12}},
        "legend": {"font": {"color": c["font"]}, "bgcolor": "rgba(0,0,0,0)"},
    }
    if legend_bottom:
        # Below the x-axis title: a fixed number of pixels under the plot area.
        plot_h = max(120, height - top - bottom)
        layout["legend"].update({"orientation": "h", "yanchor": "top", "y": -62 / plot_h, "xanchor": "left", "x": 0})
    fig.update_layout(layout)
    return fig


def message_figure(title: str, message: str) -> go.Figure:
    """An empty figure that says why there is nothing to draw (e.g. no target pass yet)."""
    fig = go.Figure()
    fig.add_annotation(
        text=message,
        x=0.5,
        y=0.5,
        xref="paper",
        yref="paper",
        showarrow=False,
        font={"size": 14},
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return apply_layout(fig, title, height=320)


def use_dark_theme(fig: go.Figure) -> go.Figure:
    """Restyle a figure made here for a dark page (decision colours stay; neutral text and grids flip)."""
    c = DARK
    fig.update_layout(
        template=_DARK_TEMPLATE,
        paper_bgcolor=c["paper"],
        plot_bgcolor=c["plot"],
        font={"color": c["font"]},
        title={"font": {"color": c["font"]}, "subtitle": {"font": {"color": c["font"]}}},
        legend={"font": {"color": c["font"]}},
        hoverlabel={"bgcolor": "#1E2227", "bordercolor": "#AAAAAA", "font": {"color": "#F0F0F0"}},
    )
    fig.update_xaxes(gridcolor=c["grid"], zerolinecolor=c["line"], linecolor=c["line"], color=c["font"])
    fig.update_yaxes(gridcolor=c["grid"], zerolinecolor=c["line"], linecolor=c["line"], color=c["font"])
    for ann in fig.layout.annotations or ():
        if ann.font is None or ann.font.color in (None, LIGHT["font"]):
            ann.font.color = c["font"]
        if ann.bgcolor == LABEL_BG:
            ann.bgcolor = "rgba(17,20,24,0.85)"
    for trace in fig.data:
        tf = getattr(trace, "textfont", None)
        if tf is not None and tf.color == LIGHT["font"]:
            trace.textfont.color = c["font"]
    return fig
