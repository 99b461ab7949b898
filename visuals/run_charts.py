"""Charts of a whole run: the output timeline, tokens per target pass, acceptance by draft position,
and the draft depth K of each pass (drafting that adapts, engine/drafters/adaptive.py).

Their numbers come from engine.metrics.run_summary (the finish metrics of a finished run, the same
aggregation over the steps so far for a partial one), so a chart and the engine's report never disagree.
"""

from __future__ import annotations

import plotly.graph_objects as go

from engine.metrics import measured_speedup, run_summary
from engine.trace import events_of, start_event, step_events

from .steps import mode_words
from .style import (
    LABELS,
    MARKS,
    NOTE_SIZE,
    PALETTE,
    SERIES,
    apply_layout,
    fmt_prob,
    fmt_speedup,
    message_figure,
    paper_note,
    show_token,
    text_on,
    value_bars,
    visible_len,
)

__all__ = [
    "timeline_figure",
    "tokens_per_pass_figure",
    "acceptance_figure",
    "accepted_per_pass_figure",
    "draft_depth_figure",
    "is_adaptive",
    "kv_cache_figure",
]

NO_PASS = "No target pass yet."

# Timeline: one row per pass, token boxes in output order, widths in characters of text.
TOKEN_KINDS = ("accepted", "resampled", "bonus")
TOKEN_NAMES = {
    "accepted": f"{LABELS['accepted']} (drafted, kept)",
    "resampled": f"{LABELS['resampled']} (target's pick after a rejection)",
    "bonus": f"{LABELS['bonus']} (target's extra token)",
}
MIN_BOX = 2.0  # characters
MARK_ROOM = 2.0  # extra width of a box that carries a mark (↻, +)
PAD = 1.0  # extra width of a plain box
BOX_GAP = 0.5
BOX_THICKNESS = 0.78  # of a row
BOX_TEXT_LEN = 24
MIN_ROW_CHARS = 40.0  # the x axis is at least this wide, so that short runs do not stretch
EDGE_ROOM = 0.3  # characters of room at either end of the rows
TIMELINE_MIN_HEIGHT = 340
TIMELINE_BASE_HEIGHT = 250
ROW_HEIGHT = 26
TIMELINE_LEFT_MARGIN = 120  # room for "pass N: K tok"

TPP_HEIGHT = 540
ACCEPTANCE_HEIGHT = 520
RATE_AXIS_TOP = 1.12  # room above a share of 1 for its text label


# ---------------------------------------------------------------------------------------- timeline


def _token_hover(tok: dict, pass_no: int, out_pos: int) -> str:
    kind = tok.get("kind")
    lines = [
        f"<b>{LABELS.get(kind, kind)}</b> '{show_token(tok.get('text'))}' (token id {tok.get('token_id')})",
        f"pass {pass_no} (step {pass_no}) · output token #{out_pos}",
    ]
    if tok.get("p") is not None:
        lines.append(f"p (target) = {fmt_prob(tok['p'])}")
    return "<br>".join(lines)


def _token_boxes(steps: list[dict]) -> tuple[dict, list[float]]:
    """The boxes of every emitted token, grouped by kind ("other" for unknown kinds), and each row's end.
    A box is as wide as its visible text (plus its mark), so a row's length shows how much text a pass made."""
    boxes = {
        kind: {"x": [], "base": [], "y": [], "text": [], "hover": [], "pos": []} for kind in (*TOKEN_KINDS, "other")
    }
    row_ends = []
    out_pos = 0
    for i, step in enumerate(steps):
        x = 0.0
        for tok in step.get("emitted") or []:
            out_pos += 1
            kind = tok.get("kind")
            box = boxes[kind if kind in TOKEN_KINDS else "other"]
            width = max(MIN_BOX, visible_len(tok.get("text")) + (PAD if kind == "accepted" else MARK_ROOM))
            mark = "" if kind == "accepted" else f"{MARKS.get(kind, '')} "
            box["x"].append(width)
            box["base"].append(x)
            box["y"].append(i)
            box["text"].append(mark + show_token(tok.get("text"), BOX_TEXT_LEN))
            box["hover"].append(_token_hover(tok, step.get("step", i + 1), out_pos))
            box["pos"].append(out_pos)
            x += width + BOX_GAP
        row_ends.append(x)
    return boxes, row_ends


def _token_bar(box: dict, kind: str) -> go.Bar:
    colour = kind if kind in TOKEN_KINDS else "drafted"
    return go.Bar(
        x=box["x"],
        base=box["base"],
        y=box["y"],
        orientation="h",
        marker={"color": PALETTE[colour], "line": {"color": "#FFFFFF", "width": 1}},
        text=box["text"],
        textposition="inside",
        insidetextanchor="middle",
        textfont=text_on(colour),
        constraintext="none",
        hovertext=box["hover"],
        hovertemplate="%{hovertext}<extra></extra>",
        name=TOKEN_NAMES.get(kind, "other"),
        width=BOX_THICKNESS,
        meta={"role": "tokens", "kind": kind, "output_positions": box["pos"]},
    )


def _row_label(i: int, step: dict) -> str:
    cut = " ✂" if step.get("truncated") else ""
    return f"pass {step.get('step', i + 1)}: {len(step.get('emitted') or [])} tok{cut}"


def timeline_figure(trace) -> go.Figure:
    """The generated text, one row per target pass, each token a box coloured by kind."""
    events = events_of(trace)
    steps = step_events(events)
    if not steps:
        return message_figure("Output by target pass", NO_PASS)
    boxes, row_ends = _token_boxes(steps)
    fig = go.Figure()
    for kind, box in boxes.items():
        if box["x"]:
            fig.add_trace(_token_bar(box, kind))
    s = run_summary(events)
    partial = "" if s["finished"] else " (run not finished)"
    title = (
        f"Output by target pass: {s['new_tokens']} tokens in {s['target_passes']} passes "
        f"= {s['tokens_per_pass']:.2f} per pass{partial}"
    )
    subtitle = (
        f"{mode_words(start_event(events))} · one row per target pass, longer row = more tokens from that pass · "
        "↻ and + are tokens the target picked itself; hover or tap for details"
    )
    fig.update_layout(barmode="overlay")
    fig.update_xaxes(
        showticklabels=False,
        showgrid=False,
        zeroline=False,
        range=[-EDGE_ROOM, max(row_ends + [MIN_ROW_CHARS]) + EDGE_ROOM],
        title_text="tokens in output order (box width follows the text length)",
    )
    fig.update_yaxes(
        tickmode="array",
        tickvals=list(range(len(steps))),
        ticktext=[_row_label(i, step) for i, step in enumerate(steps)],
        autorange="reversed",
        showgrid=False,
        zeroline=False,
    )
    apply_layout(fig, title, subtitle, height=max(TIMELINE_MIN_HEIGHT, TIMELINE_BASE_HEIGHT + ROW_HEIGHT * len(steps)))
    fig.update_layout(margin={"l": TIMELINE_LEFT_MARGIN})
    return fig


# -------------------------------------------------------------------------------- tokens per pass


def _running_mean(values: list[int]) -> list[float]:
    out, total = [], 0
    for i, n in enumerate(values, start=1):
        total += n
        out.append(total / i)
    return out


def _level(passes: list, value: float, name: str, colour: str, dash: str, hover: str, meta: dict) -> go.Scatter:
    """A horizontal reference line across every pass."""
    return go.Scatter(
        x=[passes[0], passes[-1]],
        y=[value, value],
        mode="lines",
        name=name,
        line={"color": colour, "width": 2, "dash": dash},
        hovertemplate=f"{hover}<extra></extra>",
        meta=meta,
    )


def _add_tpp_traces(fig: go.Figure, steps: list[dict], s: dict) -> list[float]:
    """Per-pass bars, the running mean, the baseline's 1 and the theory; returns the running mean."""
    passes = [st.get("step", i + 1) for i, st in enumerate(steps)]
    per_pass = [len(st.get("emitted") or []) for st in steps]
    running = _running_mean(per_pass)
    alpha, k, theory = s["position_acceptance"], s["k"], s["theoretical_tokens_per_pass"]
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
    base = "baseline: 1 token per pass"
    fig.add_trace(_level(passes, 1.0, base, SERIES["baseline"], "dot", base, {"role": "baseline"}))
    fig.add_trace(
        _level(
            passes,
            theory,
            f"theory: (1 − α^(K+1)) / (1 − α) at each pass's K = {theory:.2f} (α = {alpha:.3f}, "
            f"mean K {s.get('mean_depth_per_pass', k):.2f} over all {len(passes)} passes)",
            SERIES["theory"],
            "dash",
            f"theory: {theory:.2f} tokens per pass",
            {"role": "theory", "alpha": alpha, "k": k, "value": theory},
        )
    )
    return running


def _vs_baseline(fig: go.Figure, s: dict, b: dict) -> str:
    """The measured wall-clock speedup over a baseline run, as a title suffix and a note ('' without timings)."""
    speed = measured_speedup(b, s)
    if speed is None:
        return ""
    suffix = f" · measured speedup vs baseline {fmt_speedup(speed)}"
    caveats = []
    if b["prompt"] != s["prompt"]:
        caveats.append("different prompts")
    if b["new_tokens"] != s["new_tokens"]:
        caveats.append(f"{b['new_tokens']} vs {s['new_tokens']} tokens")
    if caveats:
        suffix += f" ({', '.join(caveats)})"
    note = f"measured: this run {s['tokens_per_s']:.1f} tok/s ÷ baseline {b['tokens_per_s']:.1f} tok/s = {fmt_speedup(speed)}"
    paper_note(fig, note, 1, 1.02, NOTE_SIZE, xanchor="right", yanchor="bottom")
    return suffix


def tokens_per_pass_figure(trace, baseline_trace=None) -> go.Figure:
    """Running mean of tokens per target pass, vs the baseline's 1.0 and the theory (1 − α^(K+1))/(1 − α)."""
    events = events_of(trace)
    start = start_event(events)
    steps = step_events(events)
    if not steps:
        return message_figure("Tokens per target pass", NO_PASS)
    s = run_summary(events)
    fig = go.Figure()
    running = _add_tpp_traces(fig, steps, s)
    if start.get("mode") == "baseline":
        title = f"Tokens per target pass: baseline, measured {running[-1]:.2f}"
    else:
        title = f"Tokens per target pass: measured {running[-1]:.2f} vs theory {s['theoretical_tokens_per_pass']:.2f}"
    if baseline_trace is not None:
        title += _vs_baseline(fig, s, run_summary(baseline_trace))
    subtitle = f"{mode_words(start)} · more tokens per pass = fewer slow target passes for the same text"
    if s["tree_topk"] > 1 and s["drafted"]:
        subtitle += " · tree: α = chance that some sibling at a tried depth is kept"
    if not s["finished"]:
        subtitle += " · run not finished"
    fig.update_xaxes(title_text="target pass", rangemode="tozero")
    fig.update_yaxes(title_text="tokens per target pass", rangemode="tozero")
    apply_layout(fig, title, subtitle, height=TPP_HEIGHT)
    fig.update_layout(bargap=0.4)
    return fig


# ------------------------------------------------------------------------------------- acceptance


def _nothing_drafted(events: list[dict]) -> str:
    if start_event(events).get("mode") == "baseline":
        return "Nothing was drafted (baseline run): every token comes from the target."
    if step_events(events):
        return "Nothing drafted yet: every token so far came from the target."
    return NO_PASS


def acceptance_figure(trace) -> go.Figure:
    """Measured share of passes whose accepted path reached draft position i (1..K) vs α^i."""
    events = events_of(trace)
    s = run_summary(events)
    title = "How deep do drafts survive?"
    rates = [None if r is None else float(r) for r in s["acceptance_by_position"]]
    reached, drafted = s["accepted_per_position"], s["drafted_per_position"]
    if not rates or not any(drafted):
        return message_figure(title, _nothing_drafted(events))
    source = "finish metrics" if s["finished"] else "step events"
    alpha = s["position_acceptance"]
    pos = list(range(1, len(rates) + 1))
    fig = go.Figure()
    fig.add_trace(
        value_bars(
            pos,
            rates,
            "measured: of the passes that drafted position i, the share whose accepted path reached it",
            PALETTE["accepted"],
            [f"{fmt_prob(r)}<br>{a}/{d}" if r is not None else "" for r, a, d in zip(rates, reached, drafted)],
            # inside the bar at its foot: above it, where α^i's diamond sits, plotly shrank "1.000 (12/12)" to a
            # bar's width (3 px tall on a phone) under the diamond; a bar too short for it shows it in its hover
            textposition="inside",
            insidetextanchor="start",
            textangle=0,
            customdata=[[r, d] for r, d in zip(reached, drafted)],
            hovertemplate=(
                "position %{x}: accepted path reached it in %{customdata[0]} of %{customdata[1]} passes "
                "that drafted this deep<br>share = %{y:.3f}<extra>measured</extra>"
            ),
            meta={"role": "measured", "source": source},
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
    subtitle = f"{mode_words(start_event(events))} · α = accepted ÷ depths tried = {alpha:.3f} · source: {source}"
    if s["tree_topk"] > 1:
        subtitle += " · tree: α = chance that some sibling at a tried depth is kept"
    fig.update_xaxes(title_text="draft position i (1 = first)", tickmode="array", tickvals=pos)
    fig.update_yaxes(title_text="share of the passes that drafted i", range=[0, RATE_AXIS_TOP])
    apply_layout(fig, f"{title} Measured acceptance by draft position vs α^i", subtitle, height=ACCEPTANCE_HEIGHT)
    # one font size for every bar's value, hidden where a bar cannot hold it legibly
    fig.update_layout(bargap=0.3, uniformtext={"minsize": 9, "mode": "hide"})
    return fig


# ------------------------------------------------------------------------------------ draft depth

DEPTH_TITLE = "Draft depth K of each pass"
DEPTH_HEIGHT = 380
# Why each pass stopped drafting (the step event's draft.stop): a colour, a symbol and words for each.
STOP_STYLE = {
    "depth": (PALETTE["accepted"], "circle", "drafted its K levels"),
    "confidence": (
        PALETTE["resampled"],
        "triangle-down",
        "stopped: drafter unsure (calibrated confidence below threshold)",
    ),
    "no-match": (PALETTE["not_reached"], "square", "stopped: n-gram lookup found no (longer) match"),
    "short-match": (PALETTE["drafted"], "diamond", "stopped: n-gram match too short to vouch for more"),
    "none": (SERIES["baseline"], "circle-open", "nothing drafted (a plain pass)"),
}


def is_adaptive(trace) -> bool:
    """The run drafted with adaptive depth (its start event's settings say so)."""
    return bool((start_event(events_of(trace)).get("settings") or {}).get("adaptive"))


def _draft_records(steps: list[dict]) -> list[tuple[int, dict, dict]]:
    """(pass number, the step's draft record, the step) for every step that carries one."""
    return [
        (st.get("step", i + 1), st["draft"], st)
        for i, st in enumerate(steps)
        if isinstance(st.get("draft"), dict) and isinstance(st["draft"].get("k"), int)
    ]


def _why_text(why: dict | None) -> str:
    """An adaptive pass's reason for its K, as the engine recorded it (draft.why), for a hover."""
    if not isinstance(why, dict):
        return "K fixed by the run's settings"
    text = f"why: {why.get('because', '?')}"
    speeds = why.get("speeds")
    if speeds:
        text += (
            f" (α = {why.get('alpha', 0):.2f}; expected tokens/ms by K: "
            + ", ".join(f"{k}: {v:.3f}" for k, v in enumerate(speeds, start=1))
            + (f"; a plain pass: {why['plain']:.3f}" if isinstance(why.get("plain"), (int, float)) else "")
            + ")"
        )
    return text


def _depth_markers(fig: go.Figure, records: list[tuple[int, dict, dict]]) -> dict[str, int]:
    """The depth each pass drafted, one marker series per stop reason; returns the count of each reason."""
    counts: dict[str, int] = {}
    unknown = sorted({str(d.get("stop")) for _, d, _ in records} - set(STOP_STYLE))
    for stop in [*STOP_STYLE, *unknown]:
        rows = [st for _, d, st in records if str(d.get("stop")) == stop]
        if not rows:
            continue
        counts[stop] = len(rows)
        colour, symbol, words = STOP_STYLE.get(stop, (SERIES["context"], "x", stop))
        fig.add_trace(
            go.Scatter(
                x=[n for n, d, _ in records if str(d.get("stop")) == stop],
                y=[st.get("draft_depth", 0) for st in rows],
                mode="markers",
                name=f"depth drafted, {words} ({len(rows)})",
                marker={"color": colour, "symbol": symbol, "size": 9, "line": {"width": 1, "color": colour}},
                customdata=[[st.get("accepted_len", 0)] for st in rows],
                hovertemplate=f"pass %{{x}}: drafted %{{y}} deep, accepted %{{customdata[0]}}<extra>{stop}</extra>",
                meta={"role": "stop", "stop": stop},
            )
        )
    return counts


def draft_depth_figure(trace) -> go.Figure:
    """K used by each pass (the engine's record, draft.k: constant unless drafting adapts) as a step
    line, and the depth each pass actually drafted, marked by why drafting stopped (draft.stop)."""
    events = events_of(trace)
    start, steps = start_event(events), step_events(events)
    if start.get("mode") == "baseline":
        return message_figure(DEPTH_TITLE, "A baseline run drafts nothing")
    if not steps:
        return message_figure(DEPTH_TITLE, NO_PASS)
    records = _draft_records(steps)
    if not records:
        return message_figure(DEPTH_TITLE, "This trace does not record each pass's K (recorded before it was)")
    ks = [d["k"] for _, d, _ in records]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=[n for n, _, _ in records],
            y=ks,
            mode="lines+markers",
            marker={"size": 4},
            line={"color": SERIES["theory"], "width": 2, "shape": "hv"},
            name="K this pass could draft",
            customdata=[[_why_text(d.get("why"))] for _, d, _ in records],
            hovertemplate="pass %{x}: K = %{y}<br>%{customdata[0]}<extra>K</extra>",
            meta={"role": "k"},
        )
    )
    counts = _depth_markers(fig, records)
    k_max = (start.get("settings") or {}).get("k") or max(ks)
    how = "adapts to measured costs and recent acceptance" if is_adaptive(events) else "fixed"
    title = f"{DEPTH_TITLE}: mean K {sum(ks) / len(ks):.2f} of at most {k_max}"
    subtitle = f"{mode_words(start)} · K {how} · " + ", ".join(f"{n} {stop}" for stop, n in counts.items())
    fig.update_xaxes(title_text="target pass", rangemode="tozero")
    fig.update_yaxes(title_text="draft depth (tokens)", range=[0, k_max + 0.5], dtick=1 if k_max <= 16 else None)
    return apply_layout(fig, title, subtitle, height=DEPTH_HEIGHT)


# ------------------------------------------------------------------------------ accepted per pass
HISTOGRAM_HEIGHT = 420
ACCEPTED_PER_PASS_TITLE = "How many drafts does a pass keep?"


def accepted_per_pass_figure(trace) -> go.Figure:
    """The histogram of accepted drafts per drafting pass (0, 1, ..., K), with the draft acceptance rate and
    the mean acceptance length side by side: a rate can fall (more drafts rejected) while the length stays
    (as many tokens per pass), so neither alone says whether drafting got worse."""
    events = events_of(trace)
    s = run_summary(events)
    counts = s.get("accepted_histogram") or []
    if not any(counts):
        return message_figure(ACCEPTED_PER_PASS_TITLE, _nothing_drafted(events))
    passes = sum(counts)
    kept = list(range(len(counts)))
    fig = go.Figure(
        value_bars(
            kept,
            counts,
            f"drafting passes ({passes} of {s['target_passes']})",
            PALETTE["accepted"],
            [str(c) if c else "" for c in counts],
            hovertemplate="%{y} of " + str(passes) + " drafting passes kept %{x} drafts<extra>measured</extra>",
            meta={"role": "histogram", "passes": passes},
        )
    )
    subtitle = (
        f"{mode_words(start_event(events))} · acceptance rate {s['acceptance_rate']:.2f} ({s['accepted']} of "
        f"{s['drafted']} drafts)<br>"
        f"mean acceptance length {s['mean_acceptance_length']:.2f} (tokens per drafting pass, "
        f"{s['passes_drafted']} of {s['target_passes']}; over every pass {s['tokens_per_pass']:.2f})"
    )
    if s.get("dropped_at_end"):
        n = s["dropped_at_end"]
        subtitle += f"<br>{n} token{'' if n == 1 else 's'} past the run's end (EOS or the token limit) counted as accepted, not output"
    fig.update_xaxes(title_text="drafts kept in the pass", tickmode="array", tickvals=kept)
    fig.update_yaxes(title_text="drafting passes", range=[0, max(counts) * 1.18])  # room for the top bar's label
    apply_layout(fig, f"{ACCEPTED_PER_PASS_TITLE} Accepted drafts per pass", subtitle, height=HISTOGRAM_HEIGHT)
    fig.update_layout(bargap=0.3, showlegend=False)
    return fig


# ----------------------------------------------------------------------------------- KV cache
KV_HEIGHT = 420
KV_TITLE = "The target's KV cache, pass by pass"


def kv_cache_figure(trace) -> go.Figure:
    """Per pass, the target cache slots the pass wrote (the pending token and every draft node), split into
    kept (the pending token and the accepted path) and rolled back (rejected and untried drafts, overwritten
    by the next pass), from the step events' ``kv`` records; and the cache's length after each pass."""
    events = events_of(trace)
    steps = [st for st in step_events(events) if st.get("kv")]
    if not steps:
        message = (
            "This run's passes carry no KV record: recorded before SpecLens recorded it, or run by a "
            "production engine, which keeps its cache out of sight."
        )
        return message_figure(KV_TITLE, message if step_events(events) else NO_PASS)
    passes = [st["step"] for st in steps]
    kept = [st["kv"]["kept"] for st in steps]
    rolled = [st["kv"]["rolled_back"] for st in steps]
    fig = go.Figure()
    for role, values, name, colour, hover in (
        ("kept", kept, "slots kept (pending token + accepted drafts)", "accepted", "slots kept"),
        ("rolled_back", rolled, "slots rolled back (rejected or untried drafts)", "rejected", "slots rolled back"),
    ):
        fig.add_trace(
            go.Bar(
                x=passes,
                y=values,
                name=name,
                marker={"color": PALETTE[colour]},
                hovertemplate=f"pass %{{x}}: %{{y}} {hover}<extra></extra>",
                meta={"role": role},
            )
        )
    fig.add_trace(
        go.Scatter(
            x=passes,
            y=[st["kv"]["length"] for st in steps],
            mode="lines",
            name="cache length after the pass (tokens, right axis)",
            line={"color": SERIES["context"], "width": 2},
            yaxis="y2",
            hovertemplate="after pass %{x}: %{y} tokens cached<extra></extra>",
            meta={"role": "length"},
        )
    )
    written, back = sum(kept) + sum(rolled), sum(rolled)
    subtitle = (
        f"{mode_words(start_event(events))} · {written} slots written in {len(steps)} passes, {back} rolled back "
        f"({back / written:.0%})"
    )
    fig.update_layout(
        barmode="stack",
        yaxis2={"overlaying": "y", "side": "right", "title": {"text": "cached tokens"}, "showgrid": False},
    )
    fig.update_xaxes(title_text="target pass")
    fig.update_layout(yaxis={"title": {"text": "slots written this pass"}})
    apply_layout(fig, f"{KV_TITLE}: written, kept, rolled back", subtitle, height=KV_HEIGHT)
    return fig
