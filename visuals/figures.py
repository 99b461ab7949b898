"""Plotly figures of a SpecLens trace. Pure functions: trace (list of event dicts) in, go.Figure out.

Every figure works on a finished trace, a partial one (no finish event) and a baseline one (steps with no
draft nodes). Traces carry a `meta` dict describing their role (e.g. {"role": "nodes", "decision": ...}) so
that tests and the app can find the data without relying on trace order.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .data import (
    acceptance_stats,
    default_position,
    events_of,
    expected_tokens_per_pass,
    extra_token,
    get_step,
    interesting_step_index,
    run_summary,
    start_event,
    step_events,
    wall_clock_speedup,
)
from .style import (
    LABEL_BG,
    LABELS,
    MARKS,
    PALETTE,
    SERIES,
    SYMBOLS,
    apply_layout,
    fmt_prob,
    fmt_speedup,
    message_figure,
    show_token,
)

__all__ = [
    "tree_figure",
    "pq_figure",
    "timeline_figure",
    "tokens_per_pass_figure",
    "acceptance_figure",
    "speedup_figure",
    "batch_figure",
    "all_figures",
]

DECISION_ORDER = ("accepted", "rejected", "not_reached")
# Text colour that reads on a filled box of each decision colour.
TEXT_ON = {
    "accepted": "#000000",
    "rejected": "#000000",
    "resampled": "#000000",
    "bonus": "#FFFFFF",
    "not_reached": "#000000",
    "drafted": "#000000",
}
ROOT_LABEL = "⟨context⟩"


def _vis_len(text: str | None) -> int:
    return len(html.unescape(show_token(text)))


def _accept_prob(node: dict) -> float | None:
    if node.get("accept_prob") is not None:
        return float(node["accept_prob"])
    p, q = node.get("p"), node.get("q")
    if p is None or not q:
        return None
    return min(1.0, float(p) / float(q))


def _tried(node: dict) -> bool:
    return node.get("decision") in ("accepted", "rejected")


def _mode_words(start: dict) -> str:
    if start.get("mode") == "baseline":
        return "baseline (no drafter)"
    drafter = start.get("drafter") or "?"
    return f"{drafter} drafter"


# --------------------------------------------------------------------------------------------- tree


def _tree_layout(nodes: list[dict], extra: dict | None) -> tuple[dict, dict, dict, int]:
    """x (depth) and y (leaf slot, top to bottom) for root (-1), every node id and 'extra'."""
    known = {n["id"] for n in nodes}
    children: dict = {-1: []}
    parent_of: dict = {}
    depth: dict = {-1: 0}
    for n in nodes:
        parent = n.get("parent", -1)
        if parent not in known and parent != -1:
            parent = -1
        parent_of[n["id"]] = parent
        children.setdefault(parent, []).append(n["id"])
        children.setdefault(n["id"], [])
        depth[n["id"]] = depth.get(parent, 0) + 1
    if extra is not None:
        src = extra.get("from_node", -1)
        if src not in known:
            src = -1
        parent_of["extra"] = src
        children.setdefault(src, []).append("extra")
        depth["extra"] = depth.get(src, 0) + 1

    y: dict = {}
    slot = 0

    def visit(key) -> None:
        nonlocal slot
        kids = children.get(key, [])
        if not kids:
            y[key] = float(slot)
            slot += 1
            return
        for kid in kids:
            visit(kid)
        y[key] = (y[kids[0]] + y[kids[-1]]) / 2.0

    visit(-1)
    for key in depth:  # anything unreachable (malformed input) still gets a place
        if key not in y:
            y[key] = float(slot)
            slot += 1
    return depth, {k: -v for k, v in y.items()}, parent_of, max(slot, 1)


def _node_hover(node: dict, nodes_by_id: dict, greedy: bool, point_mass: bool) -> str:
    d = node.get("decision", "?")
    parent = node.get("parent", -1)
    parent_word = ROOT_LABEL if parent == -1 else f"'{show_token(nodes_by_id.get(parent, {}).get('text'))}'"
    q_note = " (n-gram: point mass on the draft)" if point_mass else ""
    lines = [
        f"<b>{LABELS.get(d, d)}</b>  '{show_token(node.get('text'))}'  (token id {node.get('token_id')})",
        f"node {node.get('id')} · depth {node.get('depth')} · after {parent_word}",
        f"p (target) = {fmt_prob(node.get('p'))}   q (drafter) = {fmt_prob(node.get('q'))}{q_note}",
    ]
    if _tried(node):
        ap = _accept_prob(node)
        p_eff, q_eff = node.get("p_eff"), node.get("q_eff")
        lines.append(f"accept prob = min(1, p/q) = {fmt_prob(ap)}")
        if (p_eff is not None or q_eff is not None) and node.get("u") is not None:
            adjusted = (p_eff is not None and node.get("p") is not None and abs(p_eff - node["p"]) > 1e-9) or (
                q_eff is not None and node.get("q") is not None and abs(q_eff - node["q"]) > 1e-9
            )
            note = " (after an earlier sibling's rejection)" if adjusted and not greedy else ""
            lines.append(f"compared: p_eff = {fmt_prob(p_eff)}, q_eff = {fmt_prob(q_eff)}{note}")
        u = node.get("u")
        if u is None:
            lines.append("greedy: kept if and only if it is the target's most likely token")
        elif ap is not None:
            sign = "<" if u < ap else "≥"
            lines.append(f"u = {fmt_prob(u)} {sign} accept prob → {d.replace('_', ' ')}")
    else:
        parent_kept = parent == -1 or nodes_by_id.get(parent, {}).get("decision") == "accepted"
        sibling_kept = any(
            n.get("parent") == parent and n.get("decision") == "accepted" and n.get("id") != node.get("id")
            for n in nodes_by_id.values()
        )
        if not parent_kept:
            lines.append("not tried: the token before it was not kept")
        elif sibling_kept:
            lines.append("not tried: a sibling was accepted first")
        else:
            lines.append("not tried by the target")
    return "<br>".join(lines)


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
    return "<br>".join(lines)


def tree_figure(trace, step_index: int) -> go.Figure:
    """The draft tree of one target pass (step_index is 0-based into the step events).

    x = depth (0 = the context, i.e. the last committed token), siblings spread vertically, colour and
    symbol = decision, thick green edges = the accepted path, plus the target's own extra token (resampled
    or bonus) hanging off `from_node`. Raises IndexError for a step that does not exist.
    """
    events = events_of(trace)
    start = start_event(events)
    steps = step_events(events)
    step = get_step(events, step_index)
    idx = step_index % len(steps)
    nodes = [n for n in (step.get("nodes") or []) if isinstance(n, dict) and "id" in n]
    nodes_by_id = {n["id"]: n for n in nodes}
    extra = extra_token(step)
    greedy = bool(start.get("greedy"))
    baseline = start.get("mode") == "baseline" or not nodes
    point_mass = bool(step.get("point_mass"))

    depth, ys, parent_of, n_leaves = _tree_layout(nodes, extra)
    big = len(nodes) > 24
    marker_size = 12 if big else 18
    label_len = 10 if big else 16
    text_size = 11 if big else 13

    fig = go.Figure()

    # Edges, drawn first (under the nodes).
    groups: dict[str, list] = {"untried": [], "rejected": [], "kept": [], "extra": []}
    for n in nodes:
        d = n.get("decision")
        kind = "kept" if d == "accepted" else "rejected" if d == "rejected" else "untried"
        groups[kind].append((parent_of[n["id"]], n["id"]))
    if extra is not None:
        groups["extra"].append((parent_of["extra"], "extra"))
    extra_kind = extra.get("kind") if extra else None
    edge_style = {
        "untried": {"color": PALETTE["not_reached"], "width": 1.5, "dash": "dot"},
        "rejected": {"color": PALETTE["rejected"], "width": 2, "dash": "dash"},
        "kept": {"color": PALETTE["accepted"], "width": 6, "dash": "solid"},
        "extra": {"color": PALETTE.get(extra_kind or "bonus", PALETTE["bonus"]), "width": 4, "dash": "solid"},
    }
    edge_names = {
        "untried": "edge to a token never tried",
        "rejected": "edge to a rejected token",
        "kept": "kept path (accepted tokens)",
        "extra": "edge to the target's own token",
    }
    for kind, pairs in groups.items():
        if not pairs:
            continue
        xs: list = []
        yv: list = []
        for a, b in pairs:
            xs += [depth[a], depth[b], None]
            yv += [ys[a], ys[b], None]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=yv,
                mode="lines",
                line=edge_style[kind],
                hoverinfo="skip",
                name=edge_names[kind],
                showlegend=kind == "kept",
                meta={"role": "edges", "kind": kind, "pairs": [[a, b] for a, b in pairs]},
            )
        )

    # Root (the context).
    root_hover = "<b>⟨context⟩</b><br>the prompt and every token committed before this pass"
    if idx > 0 and steps[idx - 1].get("emitted"):
        root_hover += f"<br>last committed token: '{show_token(steps[idx - 1]['emitted'][-1].get('text'))}'"
    else:
        root_hover += "<br>(this is the first pass: the context ends with the prompt)"
    fig.add_trace(
        go.Scatter(
            x=[0],
            y=[ys[-1]],
            mode="markers+text",
            marker={"size": marker_size + 4, "color": SERIES["context"], "symbol": "square"},
            text=[ROOT_LABEL],
            textposition="middle left",
            textfont={"size": text_size},
            hovertext=[root_hover],
            hovertemplate="%{hovertext}<extra></extra>",
            name="⟨context⟩ (already committed)",
            showlegend=False,
            meta={"role": "root"},
        )
    )

    # Draft nodes, one trace per decision (legend = the decision scheme).
    counts = {}
    for decision in DECISION_ORDER + tuple(sorted({n.get("decision") for n in nodes} - set(DECISION_ORDER), key=str)):
        members = [n for n in nodes if n.get("decision") == decision]
        if not members:
            continue
        counts[decision] = len(members)
        colour = PALETTE.get(decision, PALETTE["drafted"])
        fig.add_trace(
            go.Scatter(
                x=[depth[n["id"]] for n in members],
                y=[ys[n["id"]] for n in members],
                mode="markers+text",
                marker={
                    "size": marker_size,
                    "color": colour,
                    "symbol": SYMBOLS.get(decision, "circle"),
                    "line": {"width": 2 if decision == "not_reached" else 1, "color": colour},
                },
                text=[f"{MARKS.get(decision, '')} {show_token(n.get('text'), label_len)}" for n in members],
                textposition="top center",
                textfont={"size": text_size},
                hovertext=[_node_hover(n, nodes_by_id, greedy, point_mass) for n in members],
                hovertemplate="%{hovertext}<extra></extra>",
                name=f"{LABELS.get(decision, decision)} ({len(members)})",
                meta={"role": "nodes", "decision": decision, "node_ids": [n["id"] for n in members]},
            )
        )

    # The token the target produced itself.
    if extra is not None:
        kind = extra_kind if extra_kind in PALETTE else "bonus"
        fig.add_trace(
            go.Scatter(
                x=[depth["extra"]],
                y=[ys["extra"]],
                mode="markers+text",
                marker={
                    "size": marker_size + 4,
                    "color": PALETTE[kind],
                    "symbol": SYMBOLS[kind],
                    "line": {"width": 1, "color": "#333333"},
                },
                text=[f"{MARKS[kind]} {show_token(extra.get('text'), label_len)}"],
                textposition="top center",
                textfont={"size": text_size},
                hovertext=[_extra_hover(extra, baseline, greedy)],
                hovertemplate="%{hovertext}<extra></extra>",
                name=f"{LABELS[kind]} (the target's own token)",
                meta={"role": "extra", "decision": kind, "from_node": extra.get("from_node")},
            )
        )

    max_depth = max(depth.values()) if depth else 1
    n_out = len(step.get("emitted") or [])
    pass_no = step.get("step", idx + 1)
    if baseline and not nodes:
        title = f"Pass {pass_no}: no draft — the target makes one token itself"
        subtitle = f"{_mode_words(start)} · the + bonus token is drawn from the target's distribution p"
    else:
        acc = int(step.get("accepted_len") or 0)
        drafted = int(step.get("drafted") or len(nodes))
        title = f"Draft tree, pass {pass_no}: {acc} of {drafted} drafted tokens accepted → {n_out} tokens out"
        shape = "chain" if all(len(v) <= 1 for k, v in _children(nodes).items()) else "tree"
        subtitle = (
            f"{_mode_words(start)}, {shape} · left to right = position after the context · "
            "colour and mark = the target's decision · thick line = tokens kept · hover a token for p, q, u"
        )
    if step.get("truncated"):
        subtitle += " · output cut at end-of-text / max_new_tokens"
    per_leaf = 30 if big else 48
    fig.update_xaxes(
        title_text="tokens after the context (depth)",
        tickmode="array",
        tickvals=list(range(0, max_depth + 1)),
        ticktext=["context"] + [f"+{i}" for i in range(1, max_depth + 1)],
        range=[-0.9, max_depth + 0.6],
        showgrid=False,
        zeroline=False,
    )
    fig.update_yaxes(visible=False, range=[-(n_leaves - 1) - 0.6, 0.8])
    apply_layout(fig, title, subtitle, height=max(420, 260 + per_leaf * n_leaves))
    return fig


def _children(nodes: list[dict]) -> dict:
    out: dict = {}
    for n in nodes:
        out.setdefault(n.get("parent", -1), []).append(n["id"])
    return out


# ----------------------------------------------------------------------------------------------- pq


def pq_figure(trace, step_index: int, position: int | None = None) -> go.Figure:
    """Target p vs drafter q at one position of one pass.

    `position` indexes step["dists"] (default: the first position whose draft was rejected, else the first).
    Bars for the union of the top tokens of p and q (and of the residual after a rejection); the drafted
    tokens tried there are marked with their decision and acceptance probability min(1, p/q).
    """
    events = events_of(trace)
    start = start_event(events)
    steps = step_events(events)
    step = get_step(events, step_index)
    idx = step_index % len(steps)
    pass_no = step.get("step", idx + 1)
    dists = step.get("dists") or []
    if not dists:
        return message_figure(
            f"Target p vs drafter q, pass {pass_no}",
            "This trace has no probability distributions (recorded with a reduced payload).",
        )
    if position is None:
        position = default_position(step)
    if not -len(dists) <= position < len(dists):
        raise IndexError(f"position {position} out of range: pass {pass_no} has {len(dists)} positions")
    dist = dists[position]
    node_id = dist.get("node", -1)
    nodes = [n for n in (step.get("nodes") or []) if isinstance(n, dict)]
    by_id = {n.get("id"): n for n in nodes}
    children = [n for n in nodes if n.get("parent") == node_id]
    extra = extra_token(step)
    if extra is not None and extra.get("from_node", -1) != node_id:
        extra = None
    greedy = bool(start.get("greedy"))
    point_mass = bool(step.get("point_mass"))
    q_top = dist.get("q_top")
    residual_top = (extra or {}).get("residual_top") if extra and extra.get("kind") == "resampled" else None

    rows: dict = {}

    def row(tid, text) -> dict:
        if tid not in rows:
            rows[tid] = {"id": tid, "text": text, "p": None, "q": None, "r": None, "draft": None, "extra": None}
        return rows[tid]

    for tid, text, prob in dist.get("p_top") or []:
        row(tid, text)["p"] = prob
    for tid, text, prob in q_top or []:
        row(tid, text)["q"] = prob
    for tid, text, prob in residual_top or []:
        row(tid, text)["r"] = prob
    for ch in children:
        r = row(ch.get("token_id"), ch.get("text"))
        r["draft"] = ch
        if r["p"] is None:
            r["p"] = ch.get("p")
        if r["q"] is None:
            r["q"] = ch.get("q")
    if extra is not None:
        r = row(extra.get("token_id"), extra.get("text"))
        r["extra"] = extra
        if r["p"] is None:
            r["p"] = extra.get("p")
    has_q = q_top is not None or point_mass
    if point_mass:
        for r in rows.values():
            if r["q"] is None:
                r["q"] = 0.0
    if residual_top:
        for r in rows.values():
            if r["r"] is None and r["p"] is not None:
                r["r"] = None  # not in the residual's top list: unknown

    ordered = sorted(
        rows.values(),
        key=lambda r: (r["p"] is None, -(r["p"] or 0.0), -(r["q"] or 0.0)),
    )
    labels = []
    seen: set = set()
    for r in ordered:
        marks = []
        if r["draft"] is not None:
            marks.append(MARKS.get(r["draft"].get("decision"), ""))
        if r["extra"] is not None:
            marks.append(MARKS.get(r["extra"].get("kind"), ""))
        label = (" ".join(m for m in marks if m) + " " if marks else "") + show_token(r["text"], 18)
        if label in seen:
            label += f" #{r['id']}"
        seen.add(label)
        labels.append(label)
        r["label"] = label

    def hover(r) -> str:
        parts = [f"'{show_token(r['text'])}' (token id {r['id']})"]
        parts.append(f"p (target) = {fmt_prob(r['p'])}" + ("" if r["p"] is not None else " (not in p's top 10)"))
        if has_q:
            parts.append(f"q (drafter) = {fmt_prob(r['q'])}" + (" (point mass)" if point_mass else ""))
        if residual_top:
            parts.append(f"residual = {fmt_prob(r['r'])}")
        if r["draft"] is not None:
            parts.append(f"drafted here: {LABELS.get(r['draft'].get('decision'), '?')}")
        if r["extra"] is not None:
            parts.append(f"output token: {LABELS.get(r['extra'].get('kind'), '?')}")
        return "<br>".join(parts)

    hovers = [hover(r) for r in ordered]
    token_ids = [r["id"] for r in ordered]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            y=labels,
            x=[r["p"] for r in ordered],
            orientation="h",
            name="p: target model",
            marker={"color": SERIES["target"]},
            hovertext=hovers,
            hovertemplate="%{hovertext}<extra>p</extra>",
            meta={"role": "p", "token_ids": token_ids},
        )
    )
    if has_q:
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[r["q"] for r in ordered],
                orientation="h",
                name="q: drafter (point mass on the draft)" if point_mass else "q: drafter",
                marker={
                    "color": SERIES["drafter"],
                    "pattern": {"shape": ".", "fillmode": "overlay", "fgcolor": "#1B4F72", "size": 6},
                },
                hovertext=hovers,
                hovertemplate="%{hovertext}<extra>q</extra>",
                meta={"role": "q", "token_ids": token_ids},
            )
        )
    if residual_top:
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[r["r"] for r in ordered],
                orientation="h",
                name="residual norm(max(0, p − q)) — the ↻ token is drawn from this",
                marker={
                    "color": SERIES["residual"],
                    "pattern": {"shape": "/", "fillmode": "overlay", "fgcolor": "#5C3D00", "size": 6},
                },
                hovertext=hovers,
                hovertemplate="%{hovertext}<extra>residual</extra>",
                meta={"role": "residual", "token_ids": token_ids},
            )
        )

    xmax = max([v for r in ordered for v in (r["p"], r["q"], r["r"]) if v is not None] + [0.01])
    notes = 0
    for r in ordered:
        text = None
        kind = None
        if r["draft"] is not None:
            n = r["draft"]
            kind = n.get("decision", "not_reached")
            if _tried(n):
                ap = _accept_prob(n)
                if greedy and n.get("u") is None:
                    why = "target's top token" if kind == "accepted" else "not the target's top token"
                    text = f"{LABELS[kind]} · greedy: {why}"
                else:
                    p_eff, q_eff = n.get("p_eff"), n.get("q_eff")
                    adjusted = (
                        p_eff is not None
                        and q_eff is not None
                        and (abs(p_eff - (n.get("p") or 0)) > 1e-9 or abs(q_eff - (n.get("q") or 0)) > 1e-9)
                    )
                    rule = "min(1, p_eff/q_eff)" if adjusted else "min(1, p/q)"
                    text = f"{LABELS[kind]} · {rule} = {fmt_prob(ap)}"
                    if n.get("u") is not None:
                        text += f" · u = {fmt_prob(n['u'])}"
                    if adjusted:
                        text += " (after the sibling's rejection)"
            else:
                text = f"{LABELS.get(kind, kind)} (drafted, never tried)"
        if r["extra"] is not None:
            kind2 = r["extra"].get("kind", "bonus")
            extra_text = f"{LABELS.get(kind2, kind2)}: the output token"
            text = extra_text if text is None else f"{text}<br>{extra_text}"
            kind = kind if kind == "accepted" else kind2
        if text is None:
            continue
        notes += 1
        top = max(v for v in (r["p"], r["q"], r["r"], 0.0) if v is not None)
        fig.add_annotation(
            x=top + xmax * 0.02,
            y=r["label"],
            text=text,
            xanchor="left",
            showarrow=False,
            bgcolor=PALETTE.get(kind, PALETTE["drafted"]),
            font={"color": TEXT_ON.get(kind, "#000000"), "size": 12},
            borderpad=3,
            name=f"decision:{kind}",
        )

    if node_id == -1:
        where = "right after the context"
    else:
        where = f"after '{show_token((by_id.get(node_id) or {}).get('text'))}' (depth {(by_id.get(node_id) or {}).get('depth')})"
    title = f"Target p vs drafter q, pass {pass_no}, {where}"
    if point_mass:
        title += " — q is a point mass on the n-gram draft"
    if start.get("mode") == "baseline" or not nodes:
        subtitle = "baseline: no drafter; the + bonus token is drawn from the target's p"
    elif point_mass:
        subtitle = "n-gram drafter: q = 1 on the drafted token, 0 elsewhere, so a draft is kept with probability p"
    elif q_top is None:
        subtitle = "past the last draft the drafter has no distribution; the + bonus token is drawn from p"
    else:
        subtitle = (
            "a draft is kept with probability min(1, p/q); after a rejection the ↻ token is drawn "
            "from the residual norm(max(0, p − q))"
        )
    if greedy and nodes:
        subtitle += " · greedy run: a draft is kept if and only if it is the target's top token"
    fig.update_layout(barmode="group", bargap=0.25, bargroupgap=0.05)
    step_size = next((c for c in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.25) if xmax / c <= 6), 0.5)
    ticks = [round(i * step_size, 6) for i in range(int(xmax / step_size + 1e-9) + 1)]
    fig.update_xaxes(
        title_text="probability",
        range=[0, xmax * (1.9 if notes else 1.08)],
        tickmode="array",
        tickvals=ticks,
        ticktext=[f"{t:g}" for t in ticks],
    )
    fig.update_yaxes(
        title_text="token (top 10 of p and q)",
        autorange="reversed",
        type="category",
        tickmode="array",
        tickvals=labels,
        ticktext=labels,
    )
    n_series = 1 + int(has_q) + int(bool(residual_top))
    apply_layout(fig, title, subtitle, height=max(420, 240 + len(labels) * (14 + 9 * n_series)))
    fig.update_layout(margin={"l": 130})
    return fig


# ---------------------------------------------------------------------------------------- timeline


def timeline_figure(trace) -> go.Figure:
    """The generated text, one row per target pass, each token a box coloured by kind."""
    events = events_of(trace)
    start = start_event(events)
    steps = step_events(events)
    if not steps:
        return message_figure("Output by target pass", "No target pass yet.")
    kinds = ("accepted", "resampled", "bonus")
    series = {k: {"x": [], "base": [], "y": [], "text": [], "hover": [], "pos": []} for k in kinds}
    other: dict = {"x": [], "base": [], "y": [], "text": [], "hover": [], "pos": []}
    gap = 0.5
    row_ends = []
    out_pos = 0
    tickvals, ticktext = [], []
    for i, step in enumerate(steps):
        pass_no = step.get("step", i + 1)
        x = 0.0
        emitted = step.get("emitted") or []
        for tok in emitted:
            out_pos += 1
            kind = tok.get("kind")
            s = series.get(kind, other)
            width = max(2.0, _vis_len(tok.get("text")) + (2.0 if kind != "accepted" else 1.0))
            mark = "" if kind == "accepted" else f"{MARKS.get(kind, '')} "
            s["x"].append(width)
            s["base"].append(x)
            s["y"].append(i)
            s["text"].append(mark + show_token(tok.get("text"), 24))
            hv = [
                f"<b>{LABELS.get(kind, kind)}</b> '{show_token(tok.get('text'))}' (token id {tok.get('token_id')})",
                f"pass {pass_no} (step {pass_no}) · output token #{out_pos}",
            ]
            if tok.get("p") is not None:
                hv.append(f"p (target) = {fmt_prob(tok['p'])}")
            s["hover"].append("<br>".join(hv))
            s["pos"].append(out_pos)
            x += width + gap
        row_ends.append(x)
        tickvals.append(i)
        cut = " ✂" if step.get("truncated") else ""
        ticktext.append(f"pass {pass_no}: {len(emitted)} tok{cut}")

    fig = go.Figure()
    names = {
        "accepted": f"{LABELS['accepted']} (drafted, kept)",
        "resampled": f"{LABELS['resampled']} (target's pick after a rejection)",
        "bonus": f"{LABELS['bonus']} (target's extra token)",
    }
    for kind in kinds:
        s = series[kind]
        if not s["x"]:
            continue
        fig.add_trace(
            go.Bar(
                x=s["x"],
                base=s["base"],
                y=s["y"],
                orientation="h",
                marker={"color": PALETTE[kind], "line": {"color": "#FFFFFF", "width": 1}},
                text=s["text"],
                textposition="inside",
                insidetextanchor="middle",
                textfont={"color": TEXT_ON[kind], "size": 12},
                constraintext="none",
                hovertext=s["hover"],
                hovertemplate="%{hovertext}<extra></extra>",
                name=names[kind],
                width=0.78,
                meta={"role": "tokens", "kind": kind, "output_positions": s["pos"]},
            )
        )
    if other["x"]:
        fig.add_trace(
            go.Bar(
                x=other["x"],
                base=other["base"],
                y=other["y"],
                orientation="h",
                marker={"color": PALETTE["drafted"]},
                text=other["text"],
                textposition="inside",
                hovertext=other["hover"],
                hovertemplate="%{hovertext}<extra></extra>",
                name="other",
                width=0.78,
                meta={"role": "tokens", "kind": "other", "output_positions": other["pos"]},
            )
        )
    s = run_summary(events)
    partial = "" if s["finished"] else " (run not finished)"
    title = (
        f"Output by target pass: {s['tokens']} tokens in {s['passes']} passes "
        f"= {s['tokens_per_pass']:.2f} per pass{partial}"
    )
    subtitle = (
        f"{_mode_words(start)} · one row per target pass, longer row = more tokens from that pass · "
        "↻ and + are tokens the target picked itself; hover for details"
    )
    fig.update_layout(barmode="overlay")
    fig.update_xaxes(
        showticklabels=False,
        showgrid=False,
        zeroline=False,
        range=[-0.3, max(row_ends + [40.0]) + 0.3],
        title_text="tokens in output order (box width follows the text length)",
    )
    fig.update_yaxes(
        tickmode="array",
        tickvals=tickvals,
        ticktext=ticktext,
        autorange="reversed",
        showgrid=False,
        zeroline=False,
    )
    apply_layout(fig, title, subtitle, height=max(340, 250 + 26 * len(steps)))
    fig.update_layout(margin={"l": 120})
    return fig


# -------------------------------------------------------------------------------- tokens per pass


def tokens_per_pass_figure(trace, baseline_trace=None) -> go.Figure:
    """Running mean of tokens per target pass, vs the baseline's 1.0 and the theory (1 − α^(K+1))/(1 − α)."""
    events = events_of(trace)
    start = start_event(events)
    steps = step_events(events)
    s = run_summary(events)
    if not steps:
        return message_figure("Tokens per target pass", "No target pass yet.")
    passes = [st.get("step", i + 1) for i, st in enumerate(steps)]
    per_pass = [len(st.get("emitted") or []) for st in steps]
    running = []
    total = 0
    for i, n in enumerate(per_pass, start=1):
        total += n
        running.append(total / i)
    alpha, k = s["acceptance_rate"], s["k"]
    theory = expected_tokens_per_pass(alpha, k) if s["drafted"] else 1.0

    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=passes,
            y=per_pass,
            name="tokens from each pass (measured)",
            marker={"color": SERIES["baseline"], "opacity": 0.3},
            hovertemplate="pass %{x}: %{y} tokens<extra></extra>",
            meta={"role": "per_pass"},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=passes,
            y=running,
            mode="lines+markers",
            name=f"measured: running mean ({running[-1]:.2f} after {len(running)} passes)",
            line={"color": SERIES["measured"], "width": 3},
            marker={"size": 6},
            hovertemplate="after pass %{x}: %{y:.2f} tokens per pass<extra>measured</extra>",
            meta={"role": "measured"},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=[passes[0], passes[-1]],
            y=[1.0, 1.0],
            mode="lines",
            name="baseline: 1 token per pass",
            line={"color": SERIES["baseline"], "width": 2, "dash": "dot"},
            hovertemplate="baseline: 1 token per pass<extra></extra>",
            meta={"role": "baseline"},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=[passes[0], passes[-1]],
            y=[theory, theory],
            mode="lines",
            name=f"theory: (1 − α^(K+1)) / (1 − α) = {theory:.2f} (α = {alpha:.3f}, K = {k})",
            line={"color": SERIES["theory"], "width": 2, "dash": "dash"},
            hovertemplate=f"theory: {theory:.2f} tokens per pass<extra></extra>",
            meta={"role": "theory", "alpha": alpha, "k": k, "value": theory},
        )
    )

    title = f"Tokens per target pass: measured {running[-1]:.2f} vs theory {theory:.2f}"
    if start.get("mode") == "baseline":
        title = f"Tokens per target pass: baseline, measured {running[-1]:.2f}"
    if baseline_trace is not None:
        b = run_summary(baseline_trace)
        if s["wall_s"] and b["wall_s"]:
            speed = b["wall_s"] / s["wall_s"]
            title += f" · measured wall-clock speedup vs baseline {fmt_speedup(speed)}"
            caveats = []
            if b["prompt"] != s["prompt"]:
                caveats.append("different prompts")
            if b["tokens"] != s["tokens"]:
                caveats.append(f"{b['tokens']} vs {s['tokens']} tokens")
            if caveats:
                title += f" ({', '.join(caveats)})"
            fig.add_annotation(
                text=(f"measured: baseline {b['wall_s']:.2f} s ÷ this run {s['wall_s']:.2f} s = {fmt_speedup(speed)}"),
                xref="paper",
                yref="paper",
                x=1,
                y=1.02,
                xanchor="right",
                yanchor="bottom",
                showarrow=False,
                font={"size": 12},
            )
    subtitle = f"{_mode_words(start)} · more tokens per pass = fewer slow target passes for the same text"
    if s["tree_topk"] > 1 and s["drafted"]:
        subtitle += " · tree: α counts side branches too, so the chain theory underestimates"
    if not s["finished"]:
        subtitle += " · run not finished"
    fig.update_xaxes(title_text="target pass", rangemode="tozero")
    fig.update_yaxes(title_text="tokens per target pass", rangemode="tozero")
    apply_layout(fig, title, subtitle, height=540)
    fig.update_layout(bargap=0.4)
    return fig


# ------------------------------------------------------------------------------------- acceptance


def acceptance_figure(trace) -> go.Figure:
    """Measured share of passes whose accepted path reached draft position i (1..K) vs α^i."""
    events = events_of(trace)
    start = start_event(events)
    s = run_summary(events)
    st = acceptance_stats(events)
    title = "How deep do drafts survive?"
    if not st["positions"] or not any(st["drafted"]):
        if start.get("mode") == "baseline":
            msg = "Nothing was drafted (baseline run): every token comes from the target."
        elif step_events(events):
            msg = "Nothing drafted yet: every token so far came from the target."
        else:
            msg = "No target pass yet."
        return message_figure(title, msg)
    alpha = s["acceptance_rate"]
    pos = st["positions"]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=pos,
            y=st["rates"],
            name="measured: share of passes reaching position i",
            marker={"color": PALETTE["accepted"]},
            text=[fmt_prob(r) if r is not None else "" for r in st["rates"]],
            textposition="outside",
            customdata=[[r, d] for r, d in zip(st["reached"], st["drafted"])],
            hovertemplate=(
                "position %{x}: accepted path reached it in %{customdata[0]} of %{customdata[1]} passes "
                "that drafted this deep<br>share = %{y:.3f}<extra>measured</extra>"
            ),
            meta={"role": "measured", "source": st["source"]},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=pos,
            y=[alpha**i for i in pos],
            mode="lines+markers",
            name=f"theory: α^i with α = {alpha:.3f} (each draft kept independently)",
            line={"color": SERIES["theory"], "dash": "dash", "width": 2},
            marker={"symbol": "diamond", "size": 8},
            hovertemplate="α^%{x} = %{y:.3f}<extra>theory</extra>",
            meta={"role": "theory", "alpha": alpha},
        )
    )
    subtitle = f"{_mode_words(start)} · α = accepted ÷ drafted = {alpha:.3f} · source: {st['source']}"
    if s["tree_topk"] > 1:
        subtitle += " · tree: α counts side branches, so α^i understates how deep the best branch gets"
    fig.update_xaxes(title_text="draft position i (1 = first drafted token)", tickmode="array", tickvals=pos)
    fig.update_yaxes(title_text="share of passes (0 to 1)", range=[0, 1.12])
    apply_layout(fig, f"{title} Measured acceptance by draft position vs α^i", subtitle, height=520)
    fig.update_layout(bargap=0.45)
    return fig


# ---------------------------------------------------------------------------------------- speedup


def speedup_figure(alpha: float, k: int, c: float, measured: dict | None = None) -> go.Figure:
    """Speculation calculator (theory): E(K) = (1 − α^(K+1))/(1 − α) and speedup = E / (K·c + 1), K = 1..12.

    c = cost of one draft token ÷ cost of one target pass. `measured` = {"alpha", "k", "tokens_per_pass",
    "speedup" (optional)} is drawn as a point labelled "your run (measured)".
    """
    alpha = float(alpha)
    k = int(k)
    c = float(c)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if c < 0:
        raise ValueError(f"c must be non-negative, got {c}")
    k_max = max(12, k, int((measured or {}).get("k") or 0))
    ks = list(range(1, k_max + 1))
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("tokens per target pass E", "wall-clock speedup E / (K·c + 1)"),
        horizontal_spacing=0.1,
    )
    others = [a for a in (0.5, 0.7, 0.9) if abs(a - alpha) > 0.04]
    dashes = ["dot", "dashdot", "longdash"]
    for a, dash in zip(others, dashes):
        e = [expected_tokens_per_pass(a, kk) for kk in ks]
        sp = [wall_clock_speedup(a, kk, c) for kk in ks]
        for col, ys, role in ((1, e, "E"), (2, sp, "speedup")):
            fig.add_trace(
                go.Scatter(
                    x=ks,
                    y=ys,
                    mode="lines",
                    line={"color": "#AAAAAA", "width": 1.5, "dash": dash},
                    name=f"α = {a:.1f} (for comparison)",
                    legendgroup=f"a{a}",
                    showlegend=col == 1,
                    hovertemplate=f"α = {a:.1f}, K = %{{x}}: %{{y:.2f}}<extra>theory</extra>",
                    meta={"role": role, "alpha": a, "chosen": False},
                ),
                row=1,
                col=col,
            )
    e = [expected_tokens_per_pass(alpha, kk) for kk in ks]
    sp = [wall_clock_speedup(alpha, kk, c) for kk in ks]
    for col, ys, role, fmt in ((1, e, "E", ".2f"), (2, sp, "speedup", ".2f")):
        fig.add_trace(
            go.Scatter(
                x=ks,
                y=ys,
                mode="lines+markers",
                line={"color": SERIES["theory"], "width": 3},
                marker={"size": 6},
                name=f"theory at α = {alpha:.3f}",
                legendgroup="chosen",
                showlegend=col == 1,
                hovertemplate=f"K = %{{x}}: %{{y:{fmt}}}<extra>theory</extra>",
                meta={"role": role, "alpha": alpha, "chosen": True},
            ),
            row=1,
            col=col,
        )
    e_k = expected_tokens_per_pass(alpha, k)
    s_k = wall_clock_speedup(alpha, k, c)
    for col, val, label in ((1, e_k, f"K = {k}: E = {e_k:.2f}"), (2, s_k, f"K = {k}: {fmt_speedup(s_k)}")):
        fig.add_trace(
            go.Scatter(
                x=[k],
                y=[val],
                mode="markers",
                marker={"size": 16, "color": SERIES["theory"], "symbol": "circle-open", "line": {"width": 3}},
                name=f"chosen K = {k}",
                legendgroup="k",
                showlegend=col == 1,
                hovertemplate=f"{label}<extra>theory</extra>",
                meta={"role": "chosen_k", "k": k, "value": val},
            ),
            row=1,
            col=col,
        )
        other = _measured_value(measured, col)
        below = other is not None and other > val
        _label(fig, k, val, label, SERIES["theory"], col, ay=32 if below else -32, left=k > 0.7 * k_max)
    best_k = ks[max(range(len(ks)), key=lambda i: sp[i])]
    fig.add_hline(y=1.0, line={"color": SERIES["baseline"], "dash": "dot", "width": 1.5}, row=1, col=2)
    fig.add_annotation(
        text="break-even (no speedup)",
        x=ks[-1],
        y=1.0,
        xanchor="right",
        yanchor="top",
        showarrow=False,
        font={"size": 11},
        row=1,
        col=2,
    )
    if measured:
        mk = int(measured.get("k") or k)
        tpp = measured.get("tokens_per_pass")
        if tpp is not None:
            fig.add_trace(
                go.Scatter(
                    x=[mk],
                    y=[float(tpp)],
                    mode="markers",
                    marker={"size": 16, "color": SERIES["measured"], "symbol": "star", "line": {"width": 1}},
                    name="your run (measured)",
                    legendgroup="measured",
                    hovertemplate=(
                        f"your run (measured): K = {mk}, {float(tpp):.2f} tokens per pass"
                        + (f", α = {float(measured['alpha']):.3f}" if measured.get("alpha") is not None else "")
                        + "<extra></extra>"
                    ),
                    meta={"role": "measured", "panel": "E"},
                ),
                row=1,
                col=1,
            )
            ay = -32 if float(tpp) >= e_k else 32
            _label(
                fig,
                mk,
                float(tpp),
                f"your run (measured): {float(tpp):.2f}",
                SERIES["measured"],
                1,
                ay,
                mk > 0.7 * k_max,
            )
        if measured.get("speedup") is not None:
            fig.add_trace(
                go.Scatter(
                    x=[mk],
                    y=[float(measured["speedup"])],
                    mode="markers",
                    marker={"size": 16, "color": SERIES["measured"], "symbol": "star", "line": {"width": 1}},
                    name="your run (measured)",
                    legendgroup="measured",
                    showlegend=tpp is None,
                    hovertemplate=(
                        f"your run (measured): {fmt_speedup(float(measured['speedup']))} wall-clock<extra></extra>"
                    ),
                    meta={"role": "measured", "panel": "speedup"},
                ),
                row=1,
                col=2,
            )
            sp_m = float(measured["speedup"])
            ay = -32 if sp_m >= s_k else 32
            _label(
                fig, mk, sp_m, f"your run (measured): {fmt_speedup(sp_m)}", SERIES["measured"], 2, ay, mk > 0.7 * k_max
            )
    title = (
        f"Speedup calculator (theory): α = {alpha:.3f}, c = {c:.2f}, K = {k} → "
        f"{e_k:.2f} tokens per pass, {fmt_speedup(s_k)} (best K here: {best_k})"
    )
    subtitle = (
        "theory: E = (1 − α^(K+1)) / (1 − α) tokens per target pass; speedup = E / (K·c + 1), "
        "c = cost of one draft token ÷ cost of one target pass"
    )
    fig.update_xaxes(title_text="K (draft tokens per pass)", tickmode="linear", dtick=1 if k_max <= 16 else 2)
    fig.update_yaxes(title_text="tokens per target pass", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="× faster than no speculation", rangemode="tozero", row=1, col=2)
    apply_layout(fig, title, subtitle, height=560)
    return fig


def _measured_value(measured: dict | None, col: int) -> float | None:
    if not measured:
        return None
    value = measured.get("tokens_per_pass") if col == 1 else measured.get("speedup")
    return None if value is None else float(value)


def _label(fig: go.Figure, x, y, text: str, colour: str, col: int, ay: int, left: bool = False) -> None:
    """A boxed label with a short arrow, readable over crossing lines."""
    fig.add_annotation(
        x=x,
        y=y,
        text=text,
        showarrow=True,
        arrowhead=0,
        arrowcolor=colour,
        ax=-28 if left else 28,
        ay=ay,
        xanchor="right" if left else "left",
        bgcolor=LABEL_BG,
        bordercolor=colour,
        borderpad=3,
        font={"size": 12},
        row=1,
        col=col,
    )


# ------------------------------------------------------------------------------------------ batch


def batch_figure(measurements: dict) -> go.Figure:
    """Throughput vs batch size with and without speculation, from measured pass times.

    measurements = {"batch_sizes", "k", "alpha", "pass_ms_1", "pass_ms_k1", "draft_ms_per_token" (optional)}.
    Without: B / pass_ms_1 · 1000 tok/s. With: B · E(α, K) / (pass_ms_k1 + K · draft_ms) · 1000 tok/s.
    """
    try:
        bs = [int(b) for b in measurements["batch_sizes"]]
        k = int(measurements["k"])
        alpha = float(measurements["alpha"])
        t1 = [float(v) for v in measurements["pass_ms_1"]]
        tk = [float(v) for v in measurements["pass_ms_k1"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"batch measurements are incomplete: {exc}") from None
    draft_ms = float(measurements.get("draft_ms_per_token") or 0.0)
    if not bs or len(t1) != len(bs) or len(tk) != len(bs):
        raise ValueError("batch_sizes, pass_ms_1 and pass_ms_k1 must be non-empty lists of the same length")
    e = expected_tokens_per_pass(alpha, k)
    without = [b / t * 1000.0 if t > 0 else None for b, t in zip(bs, t1)]
    with_spec = [b * e / (t + k * draft_ms) * 1000.0 if (t + k * draft_ms) > 0 else None for b, t in zip(bs, tk)]
    ratio = [(w / o if w is not None and o else None) for w, o in zip(with_spec, without)]

    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=bs,
            y=without,
            mode="lines+markers",
            name="without speculation: B ÷ pass time (1 token per row)",
            line={"color": SERIES["baseline"], "width": 3},
            marker={"size": 8, "symbol": "square"},
            customdata=[[t] for t in t1],
            hovertemplate=(
                "batch %{x}: %{y:.1f} tok/s (computed)<br>pass time %{customdata[0]:.1f} ms (measured)"
                "<extra>without speculation</extra>"
            ),
            meta={"role": "without", "y": without},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=bs,
            y=with_spec,
            mode="lines+markers+text",
            name=f"with speculation: B × E ÷ (pass time with K+1 tokens + K × draft time), E = {e:.2f}",
            line={"color": SERIES["theory"], "width": 3},
            marker={"size": 8},
            text=[fmt_speedup(r) if r is not None else "" for r in ratio],
            textposition="top center",
            customdata=[[t, r if r is not None else 0.0] for t, r in zip(tk, ratio)],
            hovertemplate=(
                "batch %{x}: %{y:.1f} tok/s (computed), %{customdata[1]:.2f}× vs without"
                f"<br>pass time with {k + 1} tokens per row %{{customdata[0]:.1f}} ms (measured)"
                "<extra>with speculation</extra>"
            ),
            meta={"role": "with", "y": with_spec, "ratio": ratio},
        )
    )
    stop = next((b for b, r in zip(bs, ratio) if r is not None and r <= 1.0), None)
    if stop is None:
        verdict = "speculation pays at every batch size measured"
    elif stop == bs[0]:
        verdict = "speculation does not pay at any batch size measured"
    else:
        verdict = f"speculation stops paying at batch size {stop}"
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
    title = f"Throughput vs batch size: {verdict}"
    subtitle = (
        f"pass times measured, throughput computed · E(α = {alpha:.3f}, K = {k}) = {e:.2f} tokens per pass (theory)"
        + (f" · draft {draft_ms:.2f} ms per token (measured)" if draft_ms else " · drafting cost taken as 0")
        + " · labels: speedup with ÷ without"
    )
    log = all(b > 0 for b in bs) and len(bs) > 1 and max(bs) / max(min(bs), 1) >= 4
    fig.update_xaxes(
        title_text="batch size B (sequences decoded together)",
        type="log" if log else "linear",
        tickmode="array",
        tickvals=bs,
        ticktext=[str(b) for b in bs],
    )
    fig.update_yaxes(title_text="tokens per second (computed)", rangemode="tozero")
    apply_layout(fig, title, subtitle, height=540)
    return fig


# -------------------------------------------------------------------------------------------- all


def all_figures(trace, baseline_trace=None) -> dict[str, go.Figure]:
    """Every figure that needs only a trace: tree, pq (for the most interesting pass), timeline,
    tokens_per_pass, acceptance, speedup (α, K from the run; c estimated from its timings)."""
    events = events_of(trace)
    steps = step_events(events)
    s = run_summary(events)
    figs: dict[str, go.Figure] = {}
    if steps:
        idx = interesting_step_index(events)
        figs["tree"] = tree_figure(events, idx)
        figs["pq"] = pq_figure(events, idx)
    else:
        figs["tree"] = message_figure("Draft tree", "No target pass yet.")
        figs["pq"] = message_figure("Target p vs drafter q", "No target pass yet.")
    figs["timeline"] = timeline_figure(events)
    figs["tokens_per_pass"] = tokens_per_pass_figure(events, baseline_trace)
    figs["acceptance"] = acceptance_figure(events)

    k = max(1, s["k"])
    c = s["draft_cost_ratio"] if s["draft_cost_ratio"] is not None else 0.0
    measured = None
    if s["mode"] != "baseline" and steps:
        measured = {"alpha": s["acceptance_rate"], "k": k, "tokens_per_pass": s["tokens_per_pass"]}
        if baseline_trace is not None:
            b = run_summary(baseline_trace)
            if b["wall_s"] and s["wall_s"]:
                measured["speedup"] = b["wall_s"] / s["wall_s"]
    fig = speedup_figure(min(1.0, max(0.0, s["acceptance_rate"])), k, c, measured)
    if s["draft_cost_ratio"] is not None:
        note = (
            f"c = {c:.2f} estimated from this run: mean draft time {s['mean_draft_ms']:.1f} ms "
            f"÷ (K × mean target pass {s['mean_verify_ms']:.1f} ms)"
        )
    else:
        note = "c unknown (no timings yet): taken as 0"
    if s["mode"] == "baseline":
        note += " · baseline run: nothing drafted, α = 0"
    fig.update_layout(title_subtitle_text=f"{fig.layout.title.subtitle.text}<br>{note}", margin={"t": 125})
    figs["speedup"] = fig
    return figs
