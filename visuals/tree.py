"""The draft-tree figure of one target pass: its layout, its traces and its hover texts.

x is the depth after the context (0 = the last committed token), siblings spread vertically, colour, mark
and symbol give the target's decision, thick green edges are the accepted path, and the token the target
added itself (resampled or bonus) hangs off the node it follows. Each trace carries a `meta` dict
({"role": "nodes", "decision": ...}, "edges", "root", "extra") so that tests and the app find the data
without relying on trace order.
"""

from __future__ import annotations

import itertools
import textwrap
from collections import Counter
from dataclasses import dataclass

import plotly.graph_objects as go

from .steps import CONTEXT, Pass, absent_note, accept_rule, mode_words, read_pass, tried
from .style import LABELS, MARKS, PALETTE, SERIES, SYMBOLS, apply_layout, fmt_prob, fmt_uniform, show_token

__all__ = ["tree_figure"]

ROOT = CONTEXT  # layout key of the root marker
EXTRA = "extra"  # layout key of the target's own token
ROOT_LABEL = "⟨context⟩"
DECISION_ORDER = ("accepted", "rejected", "not_reached")


@dataclass(frozen=True)
class _Sizes:
    marker: int  # draft node marker size (root and extra are HALO larger)
    label_len: int  # token label cut to this many characters
    text: int  # label font size
    per_leaf: int  # figure height per leaf row, pixels


BIG_TREE = 24  # more draft nodes than this: the compact sizes, so that the tree still fits
# per_leaf: labels sit above the markers at odd depths and below at even ones (_label_side), so a row's label
# below and the next row's label above face each other across the gap between the rows: each takes about half a
# marker, a few pixels and a line of text, so a row needs at least twice that. 48 px let them touch on a phone,
# where the legend and the wrapped title leave the plot less of the figure's height.
NORMAL = _Sizes(marker=18, label_len=16, text=13, per_leaf=66)
COMPACT = _Sizes(marker=12, label_len=10, text=11, per_leaf=42)
HALO = 4
SHORT_CONTEXT_DEPTH = 5  # deeper trees name the context's tick "ctx" (ten ticks in a phone's chart)
HOVER_CHARS = 44  # a hover line's characters at most: a phone's chart is about 330 px wide
MIN_HEIGHT = 420
BASE_HEIGHT = 260  # title, axis and legend
LEFT_ROOM = 0.9  # x room left of the root for its label (the label sits left of the marker)
RIGHT_ROOM = 0.6  # x room right of the deepest nodes for their labels
ROW_ROOM = 0.6  # y room below the last row
TOP_ROOM = 0.8  # y room above the first row for its labels (they sit above the markers)

EDGE_STYLE = {
    "untried": {"color": PALETTE["not_reached"], "width": 1.5, "dash": "dot"},
    "rejected": {"color": PALETTE["rejected"], "width": 2, "dash": "dash"},
    "kept": {"color": PALETTE["accepted"], "width": 6, "dash": "solid"},
    "extra": {"width": 4, "dash": "solid"},  # coloured as the extra token's kind
}
EDGE_NAMES = {
    "untried": "edge to a token never tried",
    "rejected": "edge to a rejected token",
    "kept": "kept path (accepted tokens)",
    "extra": "edge to the target's own token",
}


@dataclass(frozen=True)
class _Layout:
    depth: dict  # key (ROOT, node id or EXTRA) -> x
    y: dict  # key -> y (0 at the top, leaves one unit apart going down)
    parent_of: dict  # key -> parent key
    n_leaves: int


def _links(nodes: list[dict], extra: dict | None) -> tuple[dict, dict, dict]:
    """depth, parent_of and children of every key; a parent that is not in the tree becomes the root."""
    known = {n["id"] for n in nodes}
    children: dict = {ROOT: []}
    parent_of: dict = {}
    depth: dict = {ROOT: 0}
    edges = [(n["id"], n.get("parent", ROOT)) for n in nodes]
    if extra is not None:
        edges.append((EXTRA, extra.get("from_node", ROOT)))
    for key, parent in edges:
        if parent not in known:
            parent = ROOT
        parent_of[key] = parent
        children.setdefault(parent, []).append(key)
        children.setdefault(key, [])
        depth[key] = depth.get(parent, 0) + 1
    return depth, parent_of, children


def _tree_layout(nodes: list[dict], extra: dict | None) -> _Layout:
    """Each leaf gets its own row, in depth-first order; a parent sits midway between its first and last child."""
    depth, parent_of, children = _links(nodes, extra)
    y: dict = {}
    rows = itertools.count()

    def visit(key) -> None:
        kids = children.get(key, [])
        for kid in kids:
            visit(kid)
        y[key] = (y[kids[0]] + y[kids[-1]]) / 2.0 if kids else float(next(rows))

    visit(ROOT)
    for key in depth:  # anything unreachable (malformed input) still gets a row
        if key not in y:
            y[key] = float(next(rows))
    return _Layout(depth, {k: -v for k, v in y.items()}, parent_of, max(next(rows), 1))


# ------------------------------------------------------------------------------------------ hovers


def _test_lines(node: dict) -> list[str]:
    """How the target tested a tried node: the engine's accept_prob, what it compared, u against it."""
    ap = node.get("accept_prob")
    if ap is None:
        return []
    u, p_eff, q_eff = node.get("u"), node.get("p_eff"), node.get("q_eff")
    lines = [f"accept prob = {accept_rule(node)} = {fmt_prob(ap)}"]
    if (p_eff is not None or q_eff is not None) and u is not None:
        note = " (after an earlier sibling's rejection)" if node.get("adjusted") else ""
        lines.append(f"compared: p_eff = {fmt_prob(p_eff)}, q_eff = {fmt_prob(q_eff)}{note}")
    if u is None:
        lines.append("greedy: kept if and only if it is the target's most likely token")
    else:
        sign = "<" if u < ap else "≥"
        lines.append(f"u = {fmt_uniform(u)} {sign} accept prob → {node.get('decision', '?').replace('_', ' ')}")
    return lines


def _untried_line(node: dict, nodes_by_id: dict) -> str:
    """Why the target never tested this node."""
    parent = node.get("parent", ROOT)
    parent_kept = parent == ROOT or nodes_by_id.get(parent, {}).get("decision") == "accepted"
    sibling_kept = any(
        n.get("parent") == parent and n.get("decision") == "accepted" and n.get("id") != node.get("id")
        for n in nodes_by_id.values()
    )
    if not parent_kept:
        return "not tried: the token before it was not kept"
    if sibling_kept:
        return "not tried: a sibling was accepted first"
    return "not tried by the target"


def _node_hover(node: dict, nodes_by_id: dict, point_mass: bool) -> str:
    d = node.get("decision", "?")
    parent = node.get("parent", ROOT)
    parent_word = ROOT_LABEL if parent == ROOT else f"'{show_token(nodes_by_id.get(parent, {}).get('text'))}'"
    q_note = " (n-gram: point mass on the draft)" if point_mass else ""
    lines = [
        f"<b>{LABELS.get(d, d)}</b>  '{show_token(node.get('text'))}'  (token id {node.get('token_id')})",
        f"node {node.get('id')} · depth {node.get('depth')} · after {parent_word}",
        f"p (target) = {fmt_prob(node.get('p'))}   q (drafter) = {fmt_prob(node.get('q'))}{q_note}",
    ]
    lines += _test_lines(node) if tried(node) else [_untried_line(node, nodes_by_id)]
    return _hover_text(lines)


def _extra_hover(extra: dict, baseline: bool, greedy: bool) -> str:
    kind = extra.get("kind", "?")
    lines = [f"<b>{LABELS.get(kind, kind)}</b>  '{show_token(extra.get('text'))}'  (token id {extra.get('token_id')})"]
    if kind == "resampled":
        if extra.get("residual_top"):
            lines.append("drawn from the residual norm(max(0, p − q)) after the draft(s) here were rejected")
        elif greedy:
            lines.append("greedy: the target's most likely token replaces the rejected draft")
        else:
            lines.append("drawn by the target after the draft(s) here were rejected")
    elif baseline:
        lines.append("the baseline's one token per target pass, drawn from p")
    else:
        lines.append("every draft on the path was accepted: one more token comes free from p")
    lines.append(f"p (target) = {fmt_prob(extra.get('p'))}")
    return _hover_text(lines)


def _root_hover(view: Pass) -> str:
    lines = [f"<b>{ROOT_LABEL}</b>", "the prompt and every token committed before this pass"]
    if view.previous is not None and view.previous.get("emitted"):
        lines.append(f"last committed token: '{show_token(view.previous['emitted'][-1].get('text'))}'")
    else:
        lines.append("(this is the first pass: the context ends with the prompt)")
    return _hover_text(lines)


def _hover_text(lines: list[str]) -> str:
    """Hover lines wrapped at HOVER_CHARS between words: a tap on a phone shows the box across a 330 px chart,
    and a longer line ran past both its edges."""
    wrapped = [part for line in lines for part in textwrap.wrap(line, HOVER_CHARS, break_long_words=False) or [""]]
    return "<br>".join(wrapped)


# ------------------------------------------------------------------------------------------ traces


def _edge_kind(node: dict) -> str:
    d = node.get("decision")
    return "kept" if d == "accepted" else "rejected" if d == "rejected" else "untried"


def _add_edges(fig: go.Figure, view: Pass, layout: _Layout) -> None:
    """One line trace per edge kind, drawn first so that the nodes sit on top."""
    groups: dict[str, list] = {kind: [] for kind in EDGE_STYLE}
    for n in view.nodes:
        groups[_edge_kind(n)].append((layout.parent_of[n["id"]], n["id"]))
    if view.extra is not None:
        groups["extra"].append((layout.parent_of[EXTRA], EXTRA))
    extra_colour = PALETTE.get(view.extra.get("kind") if view.extra else "bonus", PALETTE["bonus"])
    for kind, pairs in groups.items():
        if not pairs:
            continue
        xs: list = []
        ys: list = []
        for a, b in pairs:
            xs += [layout.depth[a], layout.depth[b], None]
            ys += [layout.y[a], layout.y[b], None]
        line = EDGE_STYLE[kind] if kind != "extra" else {"color": extra_colour, **EDGE_STYLE[kind]}
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                line=line,
                hoverinfo="skip",
                name=EDGE_NAMES[kind],
                showlegend=kind == "kept",
                meta={"role": "edges", "kind": kind, "pairs": [[a, b] for a, b in pairs]},
            )
        )


def _add_root(fig: go.Figure, view: Pass, layout: _Layout, sizes: _Sizes) -> None:
    fig.add_trace(
        go.Scatter(
            x=[0],
            y=[layout.y[ROOT]],
            mode="markers",  # the axis names it ("context" below it): a label left of it was cut on a phone
            marker={"size": sizes.marker + HALO, "color": SERIES["context"], "symbol": "square"},
            hovertext=[_root_hover(view)],
            hovertemplate="%{hovertext}<extra></extra>",
            name=f"{ROOT_LABEL} (already committed)",
            showlegend=False,
            meta={"role": "root"},
        )
    )


def _label_side(depth: float) -> str:
    """Where a token's label goes: above its marker at odd depths, below at even ones, so that the labels of
    neighbouring depths on one row never meet (on a phone a depth is a few characters wide)."""
    return "top center" if int(round(depth)) % 2 else "bottom center"


def _add_nodes(fig: go.Figure, view: Pass, layout: _Layout, sizes: _Sizes) -> None:
    """Draft nodes, one trace per decision, so that the legend is the decision scheme."""
    by_id = {n["id"]: n for n in view.nodes}
    others = sorted({n.get("decision") for n in view.nodes} - set(DECISION_ORDER), key=str)
    for decision in DECISION_ORDER + tuple(others):
        members = [n for n in view.nodes if n.get("decision") == decision]
        if not members:
            continue
        colour = PALETTE.get(decision, PALETTE["drafted"])
        fig.add_trace(
            go.Scatter(
                x=[layout.depth[n["id"]] for n in members],
                y=[layout.y[n["id"]] for n in members],
                mode="markers+text",
                marker={
                    "size": sizes.marker,
                    "color": colour,
                    "symbol": SYMBOLS.get(decision, "circle"),
                    # An open circle needs a thicker outline to read as a marker.
                    "line": {"width": 2 if decision == "not_reached" else 1, "color": colour},
                },
                text=[f"{MARKS.get(decision, '')} {show_token(n.get('text'), sizes.label_len)}" for n in members],
                textposition=[_label_side(layout.depth[n["id"]]) for n in members],
                textfont={"size": sizes.text},
                hovertext=[_node_hover(n, by_id, view.point_mass) for n in members],
                hovertemplate="%{hovertext}<extra></extra>",
                name=f"{LABELS.get(decision, decision)} ({len(members)})",
                meta={"role": "nodes", "decision": decision, "node_ids": [n["id"] for n in members]},
            )
        )


def _add_extra(fig: go.Figure, view: Pass, layout: _Layout, sizes: _Sizes) -> None:
    """The token the target produced itself, in its kind's colour."""
    extra = view.extra
    kind = extra.get("kind") if extra.get("kind") in PALETTE else "bonus"
    fig.add_trace(
        go.Scatter(
            x=[layout.depth[EXTRA]],
            y=[layout.y[EXTRA]],
            mode="markers+text",
            marker={
                "size": sizes.marker + HALO,
                "color": PALETTE[kind],
                "symbol": SYMBOLS[kind],
                "line": {"width": 1, "color": "#333333"},
            },
            text=[f"{MARKS[kind]} {show_token(extra.get('text'), sizes.label_len)}"],
            textposition=[_label_side(layout.depth[EXTRA])],
            textfont={"size": sizes.text},
            hovertext=[_extra_hover(extra, view.baseline, view.greedy)],
            hovertemplate="%{hovertext}<extra></extra>",
            name=f"{LABELS[kind]} (the target's own token)",
            meta={"role": "extra", "decision": kind, "from_node": extra.get("from_node")},
        )
    )


# ------------------------------------------------------------------------------------------ figure


def _is_chain(nodes: list[dict]) -> bool:
    return all(count <= 1 for count in Counter(n.get("parent", ROOT) for n in nodes).values())


def _tree_titles(view: Pass) -> tuple[str, str]:
    step, start = view.step, view.start
    absent = absent_note(start)
    if absent:  # a production engine's trace: counts, but no draft tokens, q or u
        acc, drafted = int(step.get("accepted_len") or 0), int(step.get("drafted") or 0)
        title = f"Pass {view.number}: {acc} of {drafted} drafted tokens accepted → {len(step.get('emitted') or [])} out"
        return title, f"{mode_words(start)} · only the emitted tokens are drawn · {absent}"
    if view.baseline and not view.nodes:
        title = f"Pass {view.number}: no draft — the target makes one token itself"
        subtitle = f"{mode_words(start)} · the + bonus token is drawn from the target's distribution p"
    else:
        acc = int(step.get("accepted_len") or 0)
        drafted = int(step.get("drafted") or len(view.nodes))
        n_out = len(step.get("emitted") or [])
        title = f"Draft tree, pass {view.number}: {acc} of {drafted} drafted tokens accepted → {n_out} token{'' if n_out == 1 else 's'} out"
        shape = "chain" if _is_chain(view.nodes) else "tree"
        subtitle = (
            f"{mode_words(start)}, {shape} · left to right = position after the context · "
            "colour and mark = the target's decision · thick line = tokens kept · hover or tap a token for p, q, u"
        )
    if step.get("truncated"):
        subtitle += " · output cut at end-of-text / max_new_tokens"
    return title, subtitle


def _tree_axes(fig: go.Figure, layout: _Layout) -> None:
    max_depth = max(layout.depth.values()) if layout.depth else 1
    # Upright ticks, "ctx" for a deep tree: with 9 depths on a phone plotly turned them vertical, into the axis
    # title and the legend.
    fig.update_xaxes(
        title_text="tokens after the context (depth)",
        tickmode="array",
        tickangle=0,
        tickvals=list(range(0, max_depth + 1)),
        ticktext=["context" if max_depth <= SHORT_CONTEXT_DEPTH else "ctx"]
        + [f"+{i}" for i in range(1, max_depth + 1)],
        range=[-LEFT_ROOM, max_depth + RIGHT_ROOM],
        showgrid=False,
        zeroline=False,
    )
    fig.update_yaxes(visible=False, range=[-(layout.n_leaves - 1) - ROW_ROOM, TOP_ROOM])


def tree_figure(trace, step_index: int) -> go.Figure:
    """The draft tree of one target pass (step_index is 0-based into the step events).

    x = depth (0 = the context, i.e. the last committed token), siblings spread vertically, colour and
    symbol = decision, thick green edges = the accepted path, plus the target's own extra token (resampled
    or bonus) hanging off `from_node`. Raises IndexError for a step that does not exist.
    """
    view = read_pass(trace, step_index)
    layout = _tree_layout(view.nodes, view.extra)
    sizes = COMPACT if len(view.nodes) > BIG_TREE else NORMAL
    fig = go.Figure()
    _add_edges(fig, view, layout)
    _add_root(fig, view, layout, sizes)
    _add_nodes(fig, view, layout, sizes)
    if view.extra is not None:
        _add_extra(fig, view, layout, sizes)
    _tree_axes(fig, layout)
    title, subtitle = _tree_titles(view)
    apply_layout(fig, title, subtitle, height=max(MIN_HEIGHT, BASE_HEIGHT + sizes.per_leaf * layout.n_leaves))
    # The page shortens labels that would meet or leave the plot to their mark (assets/labels.js): on a phone a
    # depth is a few characters wide, and the token stays one hover or tap away.
    fig.update_layout(meta={**fig.layout.meta, "declutter": True})
    return fig
