"""The EAGLE head's training curves (engine/training/train_head.py writes them as JSON): loss, and per
training-time-test step the cross-entropy to the target and the top-1 agreement with it."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import apply_layout

__all__ = ["training_curves_figure"]


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` batches: one batch's loss is noisy."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def training_curves_figure(curves: dict) -> go.Figure:
    """curves: {"step": [..], "loss": [..], "ce": [[per step s]..], "top1": [[..]..], ...}."""
    steps = curves["step"]
    window = max(1, len(steps) // 50)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("loss (smoothed)", "top-1 agreement with the target"))
    fig.add_trace(go.Scatter(x=steps, y=_smooth(curves["loss"], window), name="total loss"), row=1, col=1)
    depths = len(curves["ce"][0]) if curves.get("ce") else 0
    for s in range(depths):
        ce = _smooth([row[s] for row in curves["ce"]], window)
        top1 = _smooth([row[s] for row in curves["top1"]], window)
        fig.add_trace(
            go.Scatter(x=steps, y=ce, name=f"cross-entropy, step {s + 1}", line={"dash": "dot"}), row=1, col=1
        )
        fig.add_trace(go.Scatter(x=steps, y=top1, name=f"top-1, step {s + 1}"), row=1, col=2)
    fig.update_xaxes(title_text="batch")
    return apply_layout(fig, "EAGLE head training", "step s = drafting depth s (training-time test)", height=420)
