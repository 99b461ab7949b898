"""One colour, symbol and label scheme for every SpecLens figure, plus small formatting helpers.

Colours are Okabe-Ito (colour-blind safe). Colour is never the only cue: every decision also has a
text mark (✓ ✗ ↻ + ·) and a marker symbol, and legends spell the decision out.
"""

from __future__ import annotations

import html
import math
import unicodedata

import plotly.graph_objects as go

__all__ = [
    "PALETTE",
    "MARKS",
    "SYMBOLS",
    "LABELS",
    "SERIES",
    "show_token",
    "fmt_prob",
    "fmt_speedup",
    "apply_layout",
    "message_figure",
    "TEXT_ON",
    "visible_len",
    "paper_note",
    "text_on",
    "value_bars",
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

# Text colour that reads on a filled box of each decision colour (the bonus blue is dark, the rest light).
TEXT_ON: dict[str, str] = {
    "accepted": "#000000",
    "rejected": "#000000",
    "resampled": "#000000",
    "bonus": "#FFFFFF",
    "not_reached": "#000000",
    "drafted": "#000000",
}

# The card every figure sits on: light and opaque, so that it reads inside light and dark pages alike.
LIGHT = {"paper": "#FFFFFF", "plot": "#FFFFFF", "font": "#222222", "grid": "#E6E6E6", "line": "#BBBBBB"}
HOVER_LABEL = {"bgcolor": "#FFFFFF", "bordercolor": "#444444", "font": {"color": "#111111", "size": 12}}
LABEL_BG = "rgba(255,255,255,0.85)"  # boxed labels over lines
FONT_FAMILY = "Inter, 'Segoe UI', 'DejaVu Sans', Arial, sans-serif"
FONT_SIZE = 13
TITLE_SIZE = 16
SUBTITLE_SIZE = 12
NOTE_SIZE = 12  # annotations and labels inside the plot
MESSAGE_SIZE = 14  # the one line of a message figure

# Figure heights and margins, in pixels.
DEFAULT_HEIGHT = 450
MESSAGE_HEIGHT = 320
TOP_MARGIN = 60  # room for a one-line title
# Titles and subtitles are wrapped so that every line fits a figure on a 390 px phone screen (about
# 330 px of figure): plotly does not wrap text, and a longer line runs out of the figure. In the app the page
# re-wraps them to the figure's real width (assets/titles.js, from the raw texts and these sizes kept in the
# layout's `meta["wrap"]`), so that a desktop's wide figure does not squeeze its title into a third of it.
TITLE_CHARS = 38  # characters per title line at TITLE_SIZE
SUBTITLE_CHARS = 52  # characters per subtitle line at SUBTITLE_SIZE
TITLE_FIGURE_PX = 330  # the figure width TITLE_CHARS and SUBTITLE_CHARS are for
LEGEND_CHARS = 36  # characters per legend entry line (a 390 px phone's figure holds about that many)
MESSAGE_CHARS = 40  # characters per line of a message figure's note
TITLE_PAD = 12  # from the figure's top edge to its title
TITLE_LINE = 21  # pixels per title line
SUBTITLE_LINE = 16  # pixels per subtitle line
SUBTITLE_GAP = 6  # between the title and its subtitle
TITLE_TO_PLOT = 22  # from the last title or subtitle line to the plot area
SIDE_MARGINS = {"l": 70, "r": 30}
BOTTOM_MARGIN = 60  # room for the x-axis title
BOTTOM_MARGIN_LEGEND = 130  # x-axis title plus a legend below it
LEGEND_BELOW_AXIS = 62  # the legend's top edge this far under the plot area (below the x-axis title)
MIN_PLOT_HEIGHT = 120


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
    """Probabilities with 3 significant digits, so that a ratio beside them can be checked by eye (0.00213 /
    0.00238 = 0.896, never 0.002 / 0.002): 3 decimals from 0.1 up, scientific notation below 0.001; None as '—'."""
    if x is None:
        return "—"
    x = float(x)
    if x == 0:
        return "0"
    if abs(x) < 0.001:
        return f"{x:.2e}"
    if abs(x) < 0.1:
        return f"{x:.3g}"
    return f"{x:.3f}"


def fmt_uniform(u: float | None) -> str:
    """A uniform u in [0, 1) to 4 decimals, cut rather than rounded, so it never reads 1.000; None as '—'."""
    if u is None:
        return "—"
    return f"{math.floor(float(u) * 10_000) / 10_000:.4f}"


def fmt_speedup(x: float | None) -> str:
    return "—" if x is None else f"{float(x):.2f}×"


def visible_len(text: str | None) -> int:
    """How many characters `show_token(text)` puts on screen (its HTML escapes count as one)."""
    return len(html.unescape(show_token(text)))


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


def wrap_text(text: str, width: int) -> tuple[str, int]:
    """(text with <br> so that no line exceeds `width` characters, number of lines). Breaks at the
    figures' " · " separators first, then between words; explicit <br> are kept."""
    lines: list[str] = []
    for paragraph in (text or "").split("<br>"):
        line = ""
        for piece in paragraph.split(" · "):
            for index, word in enumerate(piece.split(" ")):
                joint = " · " if index == 0 else " "
                if line and len(line) + len(joint) + len(word) > width:
                    lines.append(line)
                    line = word
                else:
                    line = f"{line}{joint}{word}" if line else word
        lines.append(line)
    return "<br>".join(lines), len(lines)


def title_block(title: str, subtitle: str) -> tuple[str, str, int]:
    """(wrapped title, wrapped subtitle, the top margin they need)."""
    title, title_lines = wrap_text(title, TITLE_CHARS)
    subtitle, subtitle_lines = wrap_text(subtitle, SUBTITLE_CHARS) if subtitle else ("", 0)
    top = TITLE_PAD + title_lines * TITLE_LINE + TITLE_TO_PLOT
    if subtitle_lines:
        top += SUBTITLE_GAP + subtitle_lines * SUBTITLE_LINE
    return title, subtitle, max(top, TOP_MARGIN)


def _wrap_meta(title: str, subtitle: str, top: int, height: int) -> dict:
    """What the page needs to re-wrap a figure's title block to its real width (assets/titles.js): the raw
    texts, the line sizes above, and the top margin and height they were laid out with."""
    return {
        "title": title,
        "subtitle": subtitle,
        "top": top,
        "height": height,
        "figure_px": TITLE_FIGURE_PX,
        "title_chars": TITLE_CHARS,
        "subtitle_chars": SUBTITLE_CHARS,
        "pad": TITLE_PAD,
        "title_line": TITLE_LINE,
        "subtitle_line": SUBTITLE_LINE,
        "subtitle_gap": SUBTITLE_GAP,
        "to_plot": TITLE_TO_PLOT,
        "min_top": TOP_MARGIN,
    }


def raw_subtitle(fig: go.Figure) -> str:
    """A laid-out figure's subtitle as it was given, before wrapping."""
    wrap = (fig.layout.meta or {}).get("wrap") if isinstance(fig.layout.meta, dict) else None
    return wrap["subtitle"] if wrap else (fig.layout.title.subtitle.text or "")


def set_subtitle(fig: go.Figure, subtitle: str) -> go.Figure:
    """Replace a laid-out figure's subtitle, wrapped, with the top margin it needs (the plot area keeps its
    height)."""
    meta = fig.layout.meta if isinstance(fig.layout.meta, dict) else {}
    wrap = meta.get("wrap")
    raw_title = wrap["title"] if wrap else (fig.layout.title.text or "").replace("<br>", " ")
    _, wrapped, top = title_block(raw_title, subtitle)
    height = fig.layout.height + top - (fig.layout.margin.t or TOP_MARGIN)
    fig.update_layout(
        title_subtitle_text=wrapped,
        margin={"t": top},
        height=height,
        title_y=1.0 - TITLE_PAD / height,
        meta={**meta, "wrap": _wrap_meta(raw_title, subtitle, top, height)},
    )
    return fig


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
    height = int(height) if height is not None else DEFAULT_HEIGHT
    raw_title, raw_sub = title, subtitle
    title, subtitle, top = title_block(title, subtitle)
    height += top - TOP_MARGIN  # the plot area keeps its size however many lines the titles take
    bottom = BOTTOM_MARGIN_LEGEND if legend_bottom else BOTTOM_MARGIN
    layout = {
        "template": _LIGHT_TEMPLATE,
        "title": {
            "text": title,
            "subtitle": {"text": subtitle, "font": {"size": SUBTITLE_SIZE, "color": c["font"]}},
            "x": 0.01,
            "xanchor": "left",
            "yref": "container",
            "y": 1.0 - TITLE_PAD / height,  # the title block starts at the top; the margin below is sized for it
            "yanchor": "top",
            "font": {"size": TITLE_SIZE, "color": c["font"]},
        },
        "font": {"family": FONT_FAMILY, "size": FONT_SIZE, "color": c["font"]},
        "paper_bgcolor": c["paper"],
        "plot_bgcolor": c["plot"],
        "height": height,
        "margin": {**SIDE_MARGINS, "t": top, "b": bottom},
        "hoverlabel": HOVER_LABEL,
        "legend": {"font": {"color": c["font"]}, "bgcolor": "rgba(0,0,0,0)"},
        "meta": {"wrap": _wrap_meta(raw_title, raw_sub, top, height)},
        # plotly's tool bar (shown on hover) stands down the right edge instead of across the top right, where
        # it took a third of a half-width figure's title line
        "modebar": {"orientation": "v"},
    }
    if legend_bottom:
        # Legend y is in plot-area fractions; convert the fixed pixel offset under the plot into one.
        plot_h = max(MIN_PLOT_HEIGHT, height - top - bottom)
        layout["legend"].update(
            {"orientation": "h", "yanchor": "top", "y": -LEGEND_BELOW_AXIS / plot_h, "xanchor": "left", "x": 0}
        )
    fig.update_layout(layout)
    if legend_bottom:
        # A legend entry longer than a phone's figure is cut off at its right edge: long names wrap instead.
        for trace in fig.data:
            if trace.name and len(trace.name) > LEGEND_CHARS and "<br>" not in trace.name:
                trace.name = wrap_text(trace.name, LEGEND_CHARS)[0]
    return fig


def value_bars(x: list, y: list, name: str, colour: str, values: list[str], **more) -> go.Bar:
    """Vertical bars with each bar's value written above it (`more` may place it elsewhere: textposition); `more`
    are further go.Bar settings."""
    return go.Bar(x=x, y=y, name=name, marker={"color": colour}, text=values, **{"textposition": "outside", **more})


def text_on(kind: str) -> dict:
    """The font for text written on a box filled with `kind`'s decision colour."""
    return {"color": TEXT_ON.get(kind, "#000000"), "size": NOTE_SIZE}


def paper_note(fig: go.Figure, text: str, x: float, y: float, size: int, **anchors) -> None:
    """A plain text note at (x, y) in paper coordinates (0..1 of the plot area), no arrow;
    `anchors` are plotly's xanchor / yanchor."""
    fig.add_annotation(text=text, xref="paper", yref="paper", x=x, y=y, showarrow=False, font={"size": size}, **anchors)


def message_figure(title: str, message: str) -> go.Figure:
    """An empty figure that says why there is nothing to draw (e.g. no target pass yet)."""
    fig = go.Figure()
    paper_note(fig, wrap_text(message, MESSAGE_CHARS)[0], 0.5, 0.5, MESSAGE_SIZE)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return apply_layout(fig, title, height=MESSAGE_HEIGHT)
