"""The p/q bar chart: the target's p against the drafter's q at one position of one target pass.

One row per token in the union of p's and q's recorded top lists (plus the drafted tokens and the
target's own token there), bars for p, q and, after a rejection, the residual the resampled token was
drawn from. Each drafted token tried there gets a note with the engine's recorded test: the rule it used
(min(1, p/q), or min(1, p_eff/q_eff) after earlier siblings were rejected), its accept_prob and u.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from .steps import CONTEXT, Pass, absent_note, accept_rule, default_position, mode_words, read_pass, tried
from .style import (
    LABELS,
    MARKS,
    PALETTE,
    SERIES,
    apply_layout,
    fmt_prob,
    fmt_uniform,
    message_figure,
    show_token,
    text_on,
)

__all__ = ["pq_figure"]

LABEL_LEN = 18  # token labels on the y axis are cut to this many characters
MIN_XMAX = 0.01  # the probability axis spans at least this much
NOTE_GAP = 0.02  # gap between a bar's end and its note, as a share of the largest probability
ROOM_FOR_NOTES = 1.9  # x range = largest probability times at least this when notes sit right of the bars
NOTE_PLOT_PX = 480  # the plot's width at the chart's narrowest (a phone: 640 px figure less its side margins)
NOTE_CHAR_PX = 6.6  # a note character's width at the notes' font (measured in Chromium: 6.2 on average)
NOTE_PAD_PX = 12  # the note's padding and its box's border
MAX_NOTE_SHARE = 0.6  # however long a note, the bars keep this much of the plot
ROOM_FOR_BARS = 1.08
TICK_STEPS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.25)  # the finest giving at most MAX_TICKS
LAST_TICK_STEP = 0.5
MAX_TICKS = 6
TICK_DIGITS = 6  # tick values rounded to this many decimals (no 0.30000000000000004)
MIN_HEIGHT = 420
BASE_HEIGHT = 240  # title, axis and legend
ROW_HEIGHT = 14  # per token row, plus BAR_HEIGHT per series in it
BAR_HEIGHT = 9
LEFT_MARGIN = 130  # room for the token labels
# Dot and hatch patterns: a second cue for q and the residual besides their colours.
Q_PATTERN = {"shape": ".", "fillmode": "overlay", "fgcolor": "#1B4F72", "size": 6}
RESIDUAL_PATTERN = {"shape": "/", "fillmode": "overlay", "fgcolor": "#5C3D00", "size": 6}


@dataclass
class _Row:
    """One token of the chart: its probabilities and what happened to it at this position."""

    id: int | None
    text: str | None
    p: float | None = None
    q: float | None = None
    r: float | None = None  # the residual, when a token was resampled here
    draft: dict | None = None  # the drafted node with this token, if any
    extra: dict | None = None  # the target's own token, if it is this one
    label: str = ""

    def top(self) -> float:
        return max(v for v in (self.p, self.q, self.r, 0.0) if v is not None)


def _rows(dist: dict, children: list[dict], extra: dict | None, residual_top, point_mass: bool) -> list[_Row]:
    """The union of the top lists and of the tokens drafted or emitted here, most likely under p first."""
    rows: dict = {}

    def row(tid, text) -> _Row:
        return rows.setdefault(tid, _Row(tid, text))

    for column, top in (("p", dist.get("p_top")), ("q", dist.get("q_top")), ("r", residual_top)):
        for tid, text, prob in top or []:
            setattr(row(tid, text), column, prob)
    for child in children:
        r = row(child.get("token_id"), child.get("text"))
        r.draft = child
        r.p = child.get("p") if r.p is None else r.p
        r.q = child.get("q") if r.q is None else r.q
    if extra is not None:
        r = row(extra.get("token_id"), extra.get("text"))
        r.extra = extra
        r.p = extra.get("p") if r.p is None else r.p
    if point_mass:  # q is 1 on the draft and 0 everywhere else
        for r in rows.values():
            r.q = 0.0 if r.q is None else r.q
    ordered = sorted(rows.values(), key=lambda r: (r.p is None, -(r.p or 0.0), -(r.q or 0.0)))
    _label(ordered)
    return ordered


def _label(rows: list[_Row]) -> None:
    """Axis labels: the decision marks, then the token; made unique with the token id when texts repeat."""
    seen: set = set()
    for r in rows:
        marks = [MARKS.get(r.draft.get("decision"), "") if r.draft is not None else ""]
        marks.append(MARKS.get(r.extra.get("kind"), "") if r.extra is not None else "")
        prefix = " ".join(m for m in marks if m)
        label = (prefix + " " if r.draft is not None or r.extra is not None else "") + show_token(r.text, LABEL_LEN)
        if label in seen:
            label += f" #{r.id}"
        seen.add(label)
        r.label = label


def _hover(r: _Row, has_q: bool, point_mass: bool, residual: bool) -> str:
    parts = [f"'{show_token(r.text)}' (token id {r.id})"]
    parts.append(f"p (target) = {fmt_prob(r.p)}" + ("" if r.p is not None else " (not in p's top 10)"))
    if has_q:
        parts.append(f"q (drafter) = {fmt_prob(r.q)}" + (" (point mass)" if point_mass else ""))
    if residual:
        parts.append(f"residual = {fmt_prob(r.r)}")
    if r.draft is not None:
        parts.append(f"drafted here: {LABELS.get(r.draft.get('decision'), '?')}")
    if r.extra is not None:
        parts.append(f"output token: {LABELS.get(r.extra.get('kind'), '?')}")
    return "<br>".join(parts)


def _bar(rows: list[_Row], column: str, name: str, hovers: list[str], colour: str, pattern=None) -> go.Bar:
    marker = {"color": colour} if pattern is None else {"color": colour, "pattern": pattern}
    return go.Bar(
        y=[r.label for r in rows],
        x=[getattr(r, column) for r in rows],
        orientation="h",
        name=name,
        marker=marker,
        hovertext=hovers,
        hovertemplate=f"%{{hovertext}}<extra>{'residual' if column == 'r' else column}</extra>",
        meta={"role": "residual" if column == "r" else column, "token_ids": [r.id for r in rows]},
    )


def _add_bars(fig: go.Figure, rows: list[_Row], has_q: bool, point_mass: bool, residual: bool) -> None:
    hovers = [_hover(r, has_q, point_mass, residual) for r in rows]
    fig.add_trace(_bar(rows, "p", "p: target model", hovers, SERIES["target"]))
    if has_q:
        name = "q: drafter (point mass on the draft)" if point_mass else "q: drafter"
        fig.add_trace(_bar(rows, "q", name, hovers, SERIES["drafter"], Q_PATTERN))
    if residual:
        name = "residual norm(max(0, p − q)) — the ↻ token is drawn from this"
        fig.add_trace(_bar(rows, "r", name, hovers, SERIES["residual"], RESIDUAL_PATTERN))


def _draft_note(node: dict, greedy: bool) -> str:
    """The target's decision on a drafted token and the test the engine recorded for it."""
    kind = node.get("decision", "not_reached")
    if not tried(node):
        return f"{LABELS.get(kind, kind)} (drafted, never tried)"
    u = node.get("u")
    if greedy and u is None:
        why = "target's top token" if kind == "accepted" else "not the target's top token"
        return f"{LABELS[kind]}<br>greedy: {why}"
    # Two short lines rather than one long one: on a phone the note beside a long bar left its figure.
    head = f"{LABELS[kind]} (after the sibling's rejection)" if node.get("adjusted") else LABELS[kind]
    test = f"{accept_rule(node)} = {fmt_prob(node.get('accept_prob'))}"
    if u is not None:
        test += f" · u = {fmt_uniform(u)}"
    return f"{head}<br>{test}"


def _note(r: _Row, greedy: bool) -> tuple[str | None, str | None]:
    """(text, decision colour key) of the note next to a row, or (None, None) for a token nobody drafted."""
    text = kind = None
    if r.draft is not None:
        kind = r.draft.get("decision", "not_reached")
        text = _draft_note(r.draft, greedy)
    if r.extra is not None:
        extra_kind = r.extra.get("kind", "bonus")
        extra_text = f"{LABELS.get(extra_kind, extra_kind)}: the output token"
        text = extra_text if text is None else f"{text}<br>{extra_text}"
        kind = kind if kind == "accepted" else extra_kind
    return text, kind


def _note_room(notes: list[str]) -> float:
    """The x range, as a multiple of the largest probability, that leaves the widest line of the notes room right
    of the longest bar on the narrowest plot the chart is drawn at (NOTE_PLOT_PX: a phone's, where the chart
    scrolls sideways at its minimum width); ROOM_FOR_BARS without notes, ROOM_FOR_NOTES at the least."""
    lines = [line for note in notes for line in note.split("<br>") if line]
    if not lines:
        return ROOM_FOR_BARS
    note_px = max(len(line) for line in lines) * NOTE_CHAR_PX + NOTE_PAD_PX
    share = min(MAX_NOTE_SHARE, note_px / NOTE_PLOT_PX)  # of the plot's width the note needs
    return max(ROOM_FOR_NOTES, (1 + NOTE_GAP) / (1 - share))


def _add_notes(fig: go.Figure, rows: list[_Row], greedy: bool, xmax: float) -> list[str]:
    """A note right of each drafted or emitted token, in its decision's colour; returns their texts."""
    notes = []
    for r in rows:
        text, kind = _note(r, greedy)
        if text is None:
            continue
        notes.append(text)
        fig.add_annotation(
            x=r.top() + xmax * NOTE_GAP,
            y=r.label,
            text=text,
            xanchor="left",
            showarrow=False,
            bgcolor=PALETTE.get(kind, PALETTE["drafted"]),
            font=text_on(kind),
            borderpad=3,
            name=f"decision:{kind}",
        )
    return notes


def _pq_titles(view: Pass, node_id, has_q_top: bool) -> tuple[str, str]:
    # The candidates' place as the tree's axis and the Step-through name it: position +1 right after the context,
    # +(d + 1) after a token at depth d.
    if node_id == CONTEXT:
        where = "right after the context (position +1)"
    else:
        parent = next((n for n in view.nodes if n.get("id") == node_id), {})
        where = f"after '{show_token(parent.get('text'))}' (position +{(parent.get('depth') or 0) + 1})"
    title = f"Target p vs drafter q, pass {view.number}, {where}"
    drafter = mode_words(view.start)  # the drafter that ran, named in every subtitle ("suffix drafter")
    if view.point_mass:
        title += f" — q is a point mass on the {view.drafted_by} draft"
    if view.baseline:
        subtitle = "baseline: no drafter; the + bonus token is drawn from the target's p"
    elif view.point_mass:
        subtitle = f"{drafter}: q = 1 on the drafted token, 0 elsewhere, so a draft is kept with probability p"
    elif not has_q_top:
        subtitle = f"{drafter} · past the last draft the drafter has no distribution; the + bonus token is drawn from p"
    else:
        subtitle = (
            f"{drafter} · a draft is kept with probability min(1, p/q); after a rejection the ↻ token is drawn "
            "from the residual norm(max(0, p − q))"
        )
    if view.greedy and view.nodes:
        subtitle += " · greedy run: a draft is kept if and only if it is the target's top token"
    absent = absent_note(view.start)
    if absent:
        subtitle = f"p from the engine's logprobs · {absent}"
    return title, subtitle


def _pq_axes(fig: go.Figure, labels: list[str], xmax: float, room: float) -> None:
    step = next((c for c in TICK_STEPS if xmax / c <= MAX_TICKS), LAST_TICK_STEP)
    ticks = [round(i * step, TICK_DIGITS) for i in range(int(xmax / step + 1e-9) + 1)]  # 1e-9: xmax a multiple of step
    fig.update_xaxes(
        title_text="probability",
        range=[0, xmax * room],
        tickmode="array",
        tickvals=ticks,
        ticktext=[f"{t:g}" for t in ticks],
    )
    fig.update_yaxes(
        title_text="token (the top 10 of p, and of q)",
        autorange="reversed",
        type="category",
        tickmode="array",
        tickvals=labels,
        ticktext=labels,
    )


def pq_figure(trace, step_index: int, position: int | None = None) -> go.Figure:
    """Target p vs drafter q at one position of one pass.

    `position` indexes step["dists"] (default: the first position whose draft was rejected, else the first).
    Bars for the union of the top tokens of p and q (and of the residual after a rejection); the drafted
    tokens tried there are marked with their decision and the acceptance probability the engine recorded.
    """
    view = read_pass(trace, step_index)
    dists = view.step.get("dists") or []
    if not dists:
        return message_figure(
            f"Target p vs drafter q, pass {view.number}",
            "This trace has no probability distributions (recorded with a reduced payload).",
        )
    position = default_position(view.step) if position is None else position
    if not -len(dists) <= position < len(dists):
        raise IndexError(f"position {position} out of range: pass {view.number} has {len(dists)} positions")
    dist = dists[position]
    node_id = dist.get("node", CONTEXT)
    children = [n for n in view.nodes if n.get("parent") == node_id]
    extra = view.extra if view.extra is not None and view.extra.get("from_node", CONTEXT) == node_id else None
    residual_top = extra.get("residual_top") if extra is not None and extra.get("kind") == "resampled" else None
    rows = _rows(dist, children, extra, residual_top, view.point_mass)
    has_q = dist.get("q_top") is not None or view.point_mass

    fig = go.Figure()
    _add_bars(fig, rows, has_q, view.point_mass, bool(residual_top))
    xmax = max([v for r in rows for v in (r.p, r.q, r.r) if v is not None] + [MIN_XMAX])
    notes = _add_notes(fig, rows, view.greedy, xmax)
    fig.update_layout(barmode="group", bargap=0.25, bargroupgap=0.05)
    labels = [r.label for r in rows]
    _pq_axes(fig, labels, xmax, _note_room(notes))
    title, subtitle = _pq_titles(view, node_id, dist.get("q_top") is not None)
    n_series = 1 + int(has_q) + int(bool(residual_top))
    apply_layout(
        fig, title, subtitle, height=max(MIN_HEIGHT, BASE_HEIGHT + len(labels) * (ROW_HEIGHT + BAR_HEIGHT * n_series))
    )
    fig.update_layout(margin={"l": LEFT_MARGIN})
    return fig
