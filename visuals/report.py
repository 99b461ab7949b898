"""Every figure of one run at once: what `python -m visuals` writes, one HTML file each."""

from __future__ import annotations

import plotly.graph_objects as go

from engine.trace import events_of, step_events

from .distributions import pq_figure
from .run_charts import acceptance_figure, timeline_figure, tokens_per_pass_figure
from .speedup import run_speedup_figure
from .steps import interesting_step_index
from .style import message_figure
from .tree import tree_figure

__all__ = ["all_figures"]


def all_figures(trace, baseline_trace=None) -> dict[str, go.Figure]:
    """Every figure that needs only a trace: tree and pq (for the most interesting pass), timeline,
    tokens_per_pass, acceptance, speedup (α, K from the run; c estimated from its timings)."""
    events = events_of(trace)
    figs: dict[str, go.Figure] = {}
    if step_events(events):
        idx = interesting_step_index(events)
        figs["tree"] = tree_figure(events, idx)
        figs["pq"] = pq_figure(events, idx)
    else:
        figs["tree"] = message_figure("Draft tree", "No target pass yet.")
        figs["pq"] = message_figure("Target p vs drafter q", "No target pass yet.")
    figs["timeline"] = timeline_figure(events)
    figs["tokens_per_pass"] = tokens_per_pass_figure(events, baseline_trace)
    figs["acceptance"] = acceptance_figure(events)
    figs["speedup"] = run_speedup_figure(events, baseline_trace)
    return figs
