"""Drafters side by side: one prompt, several drafters, each run measured against the baseline run with it.

Input: a list of traces (the baseline "none" run among them, usually first). Every number is read through
engine.metrics: `run_summary` (tokens per pass, α = position_acceptance, acceptance by position, tok/s),
`draft_token_cost` (c, measured against the baseline's plain passes: DRAFT_TOKEN_COST_MEANS, shown with it),
`measured_speedup` and `wall_clock_speedup` (the E / (K·c + 1) surface of the Explain lab). Nothing is
recomputed here.
"""

from __future__ import annotations

import plotly.graph_objects as go

from engine.metrics import DRAFT_TOKEN_COST_MEANS, draft_token_cost, measured_speedup, run_summary, wall_clock_speedup
from engine.trace import events_of, start_event, step_events

from .style import LABEL_BG, NOTE_SIZE, PALETTE, SERIES, apply_layout, fmt_speedup, message_figure

__all__ = ["acceptance_curves_figure", "comparison_rows", "run_label", "speedup_surface_figure"]

# One Okabe-Ito colour per drafter family; an adaptive variant shares its family's colour (open markers).
FAMILY_COLOURS = {
    "ngram": PALETTE["resampled"],
    "suffix": "#56B4E9",  # sky blue: n-gram's cousin, told apart from it
    "int8": PALETTE["bonus"],
    "q4": "#CC79A7",  # reddish purple: int8's 4-bit sibling
    "eagle": PALETTE["accepted"],
    "model": SERIES["target"],
}
OTHER_COLOUR = PALETTE["rejected"]
ADAPTIVE = " + adaptive"
MAX_ALPHA = 0.99  # the surface's α axis stops short of 1 (E is K + 1 there)
MIN_C_AXIS = 0.3  # the c axis shows at least this much, so n-gram's c ≈ 0 does not squeeze the surface
C_MARGIN = 1.25  # room right of the costliest drafter
LABEL_SIDE = 0.5  # a point left of this share of the c axis is labelled on its right, else on its left
# Points closer than this (share of the c axis, α) are one cluster: their labels are stacked
# (a drafter and its adaptive variant usually land almost on each other).
NEAR_C, NEAR_ALPHA = 0.12, 0.12
LABEL_WIDTH = 0.3  # share of the c axis one point's label takes (a drafter's name and its measured speedup)
GRID = 41  # surface samples per axis
CURVES_HEIGHT = 480
SURFACE_HEIGHT = 560


# ----------------------------------------------------------------------------------------- rows
def run_label(trace) -> str:
    """The run's name in the lab: its drafter, plus " + adaptive" when its settings adapted the depth."""
    start = start_event(events_of(trace))
    adaptive = bool((start.get("settings") or {}).get("adaptive"))
    return f"{start.get('drafter') or 'none'}{ADAPTIVE if adaptive else ''}"


def _family(start: dict) -> str:
    """The drafter family the engine recorded in the start event (a trace from before it did: the spec's first
    word)."""
    return start.get("family") or (start.get("drafter") or "none").split(":", 1)[0]


def _depth_used(steps: list[dict]) -> tuple[float | None, dict]:
    """Mean K actually drafted and the count of each stop reason, from the optional `draft` dict of a step
    (adaptive drafting records {"k", "stop"}); (None, {}) when the steps do not carry it."""
    infos = [s["draft"] for s in steps if isinstance(s.get("draft"), dict)]
    ks = [float(i["k"]) for i in infos if isinstance(i.get("k"), (int, float))]
    stops: dict[str, int] = {}
    for info in infos:
        if info.get("stop"):
            stops[str(info["stop"])] = stops.get(str(info["stop"]), 0) + 1
    return (sum(ks) / len(ks) if ks else None), stops


def _baseline(traces: list) -> tuple[list[dict], dict]:
    for trace in traces:
        events = events_of(trace)
        if start_event(events).get("mode") == "baseline":
            return events, run_summary(events)
    raise ValueError("the comparison needs the baseline run (drafter none) among its traces")


def comparison_rows(traces: list) -> list[dict]:
    """One dict per trace: label, family, k, tokens_per_pass, alpha (position acceptance), cost (c,
    measured), speedup (tok/s ÷ the baseline's tok/s), tokens_per_s, surface (E / (K·c + 1) at the
    measured α and c: what the formula predicts), acceptance_by_position, k_used and stops (adaptive
    drafting's record, when steps carry it). The baseline's speedup is 1 by construction."""
    base_events, base = _baseline(traces)
    base_steps = step_events(base_events)
    rows = []
    for trace in traces:
        events = events_of(trace)
        s, steps = run_summary(events), step_events(events)
        baseline = s["mode"] == "baseline"
        cost = None if baseline else draft_token_cost(steps, base_steps)
        k_used, stops = _depth_used(steps)
        rows.append(
            {
                "label": run_label(events),
                "adaptive": run_label(events).endswith(ADAPTIVE),
                "family": _family(start_event(events)),
                "baseline": baseline,
                "k": s["k"],
                "tokens_per_pass": s["tokens_per_pass"],
                "alpha": s["position_acceptance"],
                "cost": cost,
                "tokens_per_s": s["tokens_per_s"],
                "speedup": measured_speedup(base, s),
                "surface": None if cost is None else wall_clock_speedup(s["position_acceptance"], s["k"], cost),
                "acceptance_by_position": s["acceptance_by_position"],
                "k_used": k_used,
                "stops": stops,
                "new_tokens": s["new_tokens"],
            }
        )
    return rows


def _colour(row: dict) -> str:
    return FAMILY_COLOURS.get(row["family"], OTHER_COLOUR)


def _symbol(row: dict) -> str:
    return "circle-open" if row["adaptive"] else "circle"


# ------------------------------------------------------------------------ acceptance by position
def _curve_pair(row: dict) -> list[go.Scatter]:
    """Measured acceptance by position (accepted ÷ drafted at depth i, engine.metrics) and α^i, the chain
    model with the run's own α: a measured curve below α^i means early rejections cluster (a drafter that
    is right on easy stretches and wrong on hard ones), above means depth is kept more often than α says."""
    rates = row["acceptance_by_position"]
    pos = [i + 1 for i, r in enumerate(rates) if r is not None]
    measured = [r for r in rates if r is not None]
    alpha, colour, group = row["alpha"], _colour(row), row["label"]
    return [
        go.Scatter(
            x=pos,
            y=measured,
            mode="lines+markers",
            name=f"{group}: measured",
            legendgroup=group,
            line={"color": colour, "width": 3},
            marker={"size": 9, "symbol": _symbol(row), "line": {"width": 2, "color": colour}},
            hovertemplate=f"{group}, position %{{x}}: %{{y:.3f}} measured<extra></extra>",
            meta={"role": "measured", "label": group},
        ),
        go.Scatter(
            x=pos,
            y=[alpha**i for i in pos],
            mode="lines",
            name=f"{group}: α^i, α = {alpha:.2f}",
            legendgroup=group,
            line={"color": colour, "width": 1.5, "dash": "dot"},
            hovertemplate=f"{group}: α^%{{x}} = %{{y:.3f}} (theory)<extra></extra>",
            meta={"role": "theory", "label": group, "alpha": alpha},
        ),
    ]


def acceptance_curves_figure(traces: list) -> go.Figure:
    """Per drafter: the share of passes drafting depth i whose accepted path reached it, against α^i."""
    title = "How deep do drafts survive, drafter by drafter"
    rows = [
        r
        for r in comparison_rows(traces)
        if not r["baseline"] and any(v is not None for v in r["acceptance_by_position"])
    ]
    if not rows:
        return message_figure(title, "No drafter has drafted yet: only the baseline ran.")
    fig = go.Figure()
    for row in rows:
        for trace in _curve_pair(row):
            fig.add_trace(trace)
    k_max = max(len(r["acceptance_by_position"]) for r in rows)
    subtitle = (
        "solid: measured share of passes that drafted position i whose accepted path reached it · "
        "dotted: α^i, a constant per-token α (accepted ÷ depths tried) · open markers: adaptive depth"
    )
    fig.update_xaxes(title_text="draft position i", tickmode="array", tickvals=list(range(1, k_max + 1)))
    fig.update_yaxes(title_text="share of passes (0 to 1)", range=[0, 1.05])
    return apply_layout(fig, title, subtitle, height=CURVES_HEIGHT)


# ------------------------------------------------------------------------------- speedup surface
def _surface_traces(k: int, c_max: float) -> list[go.Contour]:
    """E / (K·c + 1) over (c, α) at one K (engine.metrics.wall_clock_speedup), and its break-even line."""
    cs = [c_max * i / (GRID - 1) for i in range(GRID)]
    alphas = [MAX_ALPHA * j / (GRID - 1) for j in range(GRID)]
    z = [[wall_clock_speedup(a, k, c) for c in cs] for a in alphas]
    hover = "c = %{x:.3f}, α = %{y:.2f}: %{z:.2f}× (theory)<extra></extra>"
    surface = go.Contour(
        x=cs,
        y=alphas,
        z=z,
        colorscale=[[0.0, "#FFFFFF"], [1.0, "#9ECAE1"]],
        contours={"showlabels": True, "labelfont": {"size": NOTE_SIZE, "color": "#333333"}},
        line={"color": "#6B8FB3", "width": 1},
        colorbar={"title": {"text": "theory ×"}, "thickness": 12},
        hovertemplate=hover,
        name=f"theory at K = {k}",
        meta={"role": "surface", "k": k},
    )
    even = go.Contour(
        x=cs,
        y=alphas,
        z=z,
        contours={"coloring": "lines", "start": 1.0, "end": 1.0, "size": 1.0},
        line={"color": PALETTE["rejected"], "width": 2, "dash": "dash"},
        colorscale=[[0, PALETTE["rejected"]], [1, PALETTE["rejected"]]],
        showscale=False,
        hoverinfo="skip",
        name="break-even (1×)",
        meta={"role": "break_even"},
    )
    return [surface, even]


def _near(a: dict, b: dict, c_max: float) -> bool:
    """Two points whose labels would run into each other: close in c and α, or at one α with the labels
    facing each other (the left one labelled on its right, the right one on its left) across less than two
    labels' width (int8 and q4 both at α ≈ 1 did)."""
    if abs(a["alpha"] - b["alpha"]) >= NEAR_ALPHA:
        return False
    if abs(a["cost"] - b["cost"]) < NEAR_C * c_max:
        return True
    left, right = sorted((a, b), key=lambda row: row["cost"])
    facing = left["cost"] < LABEL_SIDE * c_max <= right["cost"]
    return facing and right["cost"] - left["cost"] < 2 * LABEL_WIDTH * c_max


def _clusters(rows: list[dict], c_max: float) -> list[list[int]]:
    """Indices of rows whose labels would collide (``_near``, chained), in order of first appearance."""
    clusters: list[list[int]] = []
    for i, row in enumerate(rows):
        for cluster in clusters:
            if any(_near(row, rows[j], c_max) for j in cluster):
                cluster.append(i)
                break
        else:
            clusters.append([i])
    return clusters


def label_positions(rows: list[dict], c_max: float) -> list[str]:
    """Plotly textposition per row: the side with more room, and within a pair of nearby points the labels
    one above the other in order of α (the highest on top), so none overlap; a cluster of more than two
    carries one label (point_labels) on its highest point."""
    placed = ["middle"] * len(rows)
    for cluster in _clusters(rows, c_max):
        if len(cluster) < 2:
            continue
        order = sorted(cluster, key=lambda j: -rows[j]["alpha"])
        if len(order) > 2:  # one label for them all (point_labels), on the highest, below it near the top
            placed[order[0]] = "bottom" if rows[order[0]]["alpha"] > 0.9 else "middle"
            continue
        slots = ["top", "bottom"]
        if rows[order[0]]["alpha"] > 0.9:  # no room above the axis' top
            slots = ["middle", "bottom"]
        for j, slot in zip(order, slots):
            placed[j] = slot
    return [
        f"{vertical} {'right' if row['cost'] < LABEL_SIDE * c_max else 'left'}" for vertical, row in zip(placed, rows)
    ]


def point_labels(rows: list[dict], c_max: float) -> list[str]:
    """Each point's label: its measured speedup; where more than two points share a spot (n-gram and suffix
    with and without adaptive depth land on one c and α), one label lists them all, on the highest point,
    and the others carry none (stacked single labels would run into each other)."""
    texts = [f"{row['label']}: {fmt_speedup(row['speedup'])} measured" for row in rows]
    for cluster in _clusters(rows, c_max):
        if len(cluster) > 2:
            order = sorted(cluster, key=lambda j: -rows[j]["alpha"])
            combined = "<br>".join(f"{rows[j]['label']}: {fmt_speedup(rows[j]['speedup'])}" for j in cluster)
            for j in order:
                texts[j] = ""
            texts[order[0]] = combined + " measured"
    return texts


def _point(row: dict, c_max: float, position: str, text: str) -> go.Scatter:
    """A drafter at its measured (c, α), labelled by its measured speedup (`text`) at `position`."""
    colour = _colour(row)
    hover = (
        f"{row['label']}<br>c = {row['cost']:.3f}, α = {row['alpha']:.3f} (measured)<br>"
        f"surface: {fmt_speedup(row['surface'])} (theory at these c and α)<br>"
        f"measured: {fmt_speedup(row['speedup'])} (tok/s ÷ baseline tok/s)<extra></extra>"
    )
    return go.Scatter(
        x=[row["cost"]],
        y=[row["alpha"]],
        mode="markers+text",
        text=[text],
        textposition=position,
        textfont={"size": NOTE_SIZE, "color": "#111111"},
        cliponaxis=False,
        marker={"size": 16, "color": LABEL_BG if row["adaptive"] else colour, "line": {"width": 2, "color": colour}},
        name=f"{row['label']}: {fmt_speedup(row['speedup'])} measured",
        hovertemplate=hover,
        meta={"role": "drafter", **{key: row[key] for key in ("label", "cost", "alpha", "speedup", "surface")}},
    )


def speedup_surface_figure(traces: list) -> go.Figure:
    """The E / (K·c + 1) surface of the Explain lab over (c, α) at the runs' K, one marker per drafter at
    its measured c and α, labelled with the speedup it measured. The gap between the surface under a
    marker and its label is what the formula leaves out: a pass over K + 1 tokens costs more than a pass
    over one, and a run's bookkeeping."""
    title = "Where each drafter lands on the speedup surface"
    rows = [r for r in comparison_rows(traces) if not r["baseline"] and r["cost"] is not None]
    if not rows:
        return message_figure(title, "No drafter run with timings yet: only the baseline ran.")
    k = max(r["k"] for r in rows)
    c_max = max(MIN_C_AXIS, C_MARGIN * max(r["cost"] for r in rows))
    fig = go.Figure(_surface_traces(k, c_max))
    for row, position, text in zip(rows, label_positions(rows, c_max), point_labels(rows, c_max)):
        fig.add_trace(_point(row, c_max, position, text))
    subtitle = (
        f"surface: theory E / (K·c + 1) at K = {k}, E = (1 − α^(K+1)) / (1 − α) · points: α and c measured "
        f"in this lab run, {DRAFT_TOKEN_COST_MEANS} · labels: measured speedup "
        "(tok/s ÷ baseline tok/s) · dashed: break-even"
    )
    if any(r["k"] != k for r in rows):
        subtitle += f" · runs with another K are drawn on the K = {k} surface"
    fig.update_xaxes(title_text=f"{DRAFT_TOKEN_COST_MEANS} (measured)", range=[0, c_max])
    fig.update_yaxes(title_text="α: accepted ÷ depths tried (measured)", range=[0, 1.0])
    return apply_layout(fig, f"{title} (K = {k})", subtitle, height=SURFACE_HEIGHT)
