"""The layout every long-running lab shares: its text on top, controls on the left, results on the right.

A lab's results are a status line (where progress and the final verdict appear) and a table of
what was measured and computed, often with a figure between them.
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from visuals.lab_figures import message_figure

from ..wiring import wire_run_and_stop

__all__ = ["lab_tab", "results_plot", "results_table", "status_box", "wire_lab_run"]


def lab_tab(
    title: str,
    tab_id: str,
    text: str,
    controls: Callable[[], dict],
    results: Callable[[], dict],
    wire: Callable[[dict, dict], None],
) -> gr.Tab:
    """A lab's tab: `text`, then controls() beside results(); wire(controls, results) attaches its events
    inside the tab (a gr.State directly under gr.Tabs breaks gradio's tab bar). The controls' dict also
    holds the tab itself, under "tab", for events on entering it."""
    with gr.Tab(title, id=tab_id) as tab:
        gr.Markdown(text, elem_classes=["sl-lab-text"])
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=300):
                c = controls()
            with gr.Column(scale=9, min_width=420):
                out = results()
        c["tab"] = tab
        wire(c, out)
    return tab


def status_box(text: str, elem_id: str) -> gr.Markdown:
    return gr.Markdown(text, elem_id=elem_id, elem_classes=["sl-status"])


TABLE_WIDTH_PX = 880  # the results column's width on a 1440 px desktop (898 px measured): the percentages refer to it
MIN_COLUMN_PX = 72


TABLE_ROW_PX = 130  # room for a row whose cells wrap to a few lines (the Shortcuts lab's "where you meet it")


def results_table(
    value: list[list], headers: list[str], label: str, widths: list[str], elem_id: str, rows: int = 0
) -> gr.Dataframe:
    """A results table; `widths` are shares of a desktop-wide table ("22%"), given to gradio in pixels so
    that on a narrow screen the table scrolls sideways instead of squeezing its columns into letters.
    rows: how many rows it will hold, for a table that should show them all without scrolling inside its box
    (0: gradio's default height)."""
    raw = [max(MIN_COLUMN_PX, float(w.rstrip("%")) * TABLE_WIDTH_PX / 100) for w in widths]
    # Narrow columns raised to the minimum: the room they took comes off the wider ones, so the table still
    # fits the results column.
    excess = sum(raw) - TABLE_WIDTH_PX
    spare = sum(px - MIN_COLUMN_PX for px in raw)
    if excess > 0 and spare > 0:
        raw = [px - excess * (px - MIN_COLUMN_PX) / spare for px in raw]
    pixels = [f"{int(px)}px" for px in raw]
    return gr.Dataframe(
        value=value,
        headers=headers,
        interactive=False,
        wrap=True,
        label=label,
        column_widths=pixels,
        elem_id=elem_id,
        elem_classes=["sl-wide"],  # on a phone it says it scrolls sideways (assets/style.css)
        **({"max_height": 80 + rows * TABLE_ROW_PX} if rows else {}),
    )


def results_plot(title: str, waiting: str, elem_id: str, figure=None) -> gr.Plot:
    """The lab's figure: `figure` (a recorded run's) or one saying `waiting` until the first run."""
    return gr.Plot(figure if figure is not None else message_figure(title, waiting), show_label=False, elem_id=elem_id)


def wire_lab_run(c: dict, out: dict, fn, inputs: list[str], outputs: list[str]) -> None:
    """Run / Stop of a lab: fn(*c[inputs]) streamed into out[outputs], progress shown over the status."""
    wire_run_and_stop(
        c["run_btn"],
        c["stop_btn"],
        fn,
        [c[key] for key in inputs],
        [out[key] for key in outputs],
        show_progress="full",
        show_progress_on=[out["status"]],
    )
