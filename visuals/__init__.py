"""SpecLens visuals: pure functions from a trace (list of event dicts, see docs/events.md) to plotly figures.

Only plotly and the standard library: no model code, no UI code.
"""

from __future__ import annotations

from .data import (
    TraceError,
    acceptance_stats,
    expected_tokens_per_pass,
    extra_token,
    finish_event,
    interesting_step_index,
    load_trace,
    run_summary,
    start_event,
    step_events,
    validate_events,
    wall_clock_speedup,
)
from .figures import (
    acceptance_figure,
    all_figures,
    batch_figure,
    pq_figure,
    speedup_figure,
    timeline_figure,
    tokens_per_pass_figure,
    tree_figure,
)
from .style import LABELS, MARKS, PALETTE, SYMBOLS, show_token

__all__ = [
    "PALETTE",
    "LABELS",
    "MARKS",
    "SYMBOLS",
    "TraceError",
    "load_trace",
    "validate_events",
    "start_event",
    "finish_event",
    "step_events",
    "extra_token",
    "run_summary",
    "acceptance_stats",
    "interesting_step_index",
    "expected_tokens_per_pass",
    "wall_clock_speedup",
    "show_token",
    "tree_figure",
    "pq_figure",
    "timeline_figure",
    "tokens_per_pass_figure",
    "acceptance_figure",
    "speedup_figure",
    "batch_figure",
    "all_figures",
]
