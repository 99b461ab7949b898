"""A figure can never take the page down: drawing errors become a figure that says what went wrong.

Uploaded traces are validated (engine.trace), but a figure may read more of a trace than the
validator checks, and a bug in a figure must not break a run's other outputs. The failure is
logged with its traceback and the user sees the figure's title with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import plotly.graph_objects as go

from visuals.lab_figures import message_figure

__all__ = ["guarded"]

log = logging.getLogger("speclens.app")
REASON_CHARS = 300  # an exception's message is cut here (a trace's content can make it long)


def guarded(title: str, draw: Callable[..., go.Figure], *args, **kwargs) -> go.Figure:
    """draw(*args, **kwargs), or a figure titled `title` saying why it cannot be drawn."""
    try:
        return draw(*args, **kwargs)
    except Exception as exc:  # never let a figure take the page down
        log.exception("%s failed", getattr(draw, "__name__", title))
        return message_figure(title, f"Cannot draw this figure: {type(exc).__name__}: {exc}"[:REASON_CHARS])
