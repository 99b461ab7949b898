"""SpecLens visuals: pure functions from a trace (list of event dicts, see docs/events.md) to plotly figures.

Only plotly, the standard library and the engine's plain-Python trace model (engine.trace, engine.metrics):
no model code, no UI code. The trace names below are the engine's own functions, re-exported.

One palette, marks and layout for every figure live in style; docs/architecture.md names each module.
"""

from __future__ import annotations

from engine.metrics import expected_tokens_per_pass, run_summary, wall_clock_speedup
from engine.trace import TraceError, finish_event, start_event, step_events
from engine.trace import load as load_trace
from engine.trace import validate as validate_events

from .distributions import pq_figure
from .lab_figures import fmt_pvalue, lossless_figure, race_figure, toy_figure
from .report import all_figures
from .run_charts import acceptance_figure, draft_depth_figure, timeline_figure, tokens_per_pass_figure
from .speedup import batch_figure, speedup_figure
from .steps import extra_token, interesting_step_index
from .style import LABELS, MARKS, PALETTE, SYMBOLS, message_figure, show_token
from .tree import tree_figure

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
    "interesting_step_index",
    "expected_tokens_per_pass",
    "wall_clock_speedup",
    "show_token",
    "tree_figure",
    "pq_figure",
    "timeline_figure",
    "tokens_per_pass_figure",
    "acceptance_figure",
    "draft_depth_figure",
    "speedup_figure",
    "batch_figure",
    "all_figures",
    "message_figure",
    "race_figure",
    "toy_figure",
    "lossless_figure",
    "fmt_pvalue",
]
