"""The pass inspector that the Playground and the Step-through share: a slider over the run's target
passes, and the draft tree and p-vs-q figures of the chosen pass."""

from __future__ import annotations

import gradio as gr

from engine.trace import step_events
from visuals import pq_figure, tree_figure
from visuals.lab_figures import message_figure

from .figure_guard import guarded

__all__ = ["PQ_TITLE", "TREE_TITLE", "pass_figures", "pass_slider", "pass_slider_label"]

TREE_TITLE = "Draft tree"
PQ_TITLE = "p (target) vs q (drafter)"


def pass_slider_label(n: int) -> str:
    return f"Inspect target pass (1–{n})" if n > 1 else "Inspect target pass (only 1)"


def pass_slider(n: int, value: int | None = None, interactive: bool = True):
    """The slider's update for a run of n passes, set to pass `value` (1-based; default the last)."""
    n = max(1, n)
    return gr.Slider(
        minimum=1,
        maximum=max(n, 2),  # gradio needs minimum < maximum; a 1-pass run keeps the slider locked
        value=min(value or n, n),
        step=1,
        interactive=interactive and n > 1,
        label=pass_slider_label(n),
    )


def pass_figures(trace, index: int, empty: str = "No target pass yet") -> tuple:
    """(draft tree, p vs q) of pass `index` (0-based); figures saying `empty` for a trace without passes."""
    if not step_events(trace or []):
        return message_figure(TREE_TITLE, empty), message_figure(PQ_TITLE, empty)
    return guarded(TREE_TITLE, tree_figure, trace, index), guarded(PQ_TITLE, pq_figure, trace, index)
