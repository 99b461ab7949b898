"""The layout every long-running lab shares: its text on top, controls on the left, results on the right.

A lab's results are a status line (where progress and the final verdict appear) and a table of
what was measured and computed, often with a figure between them. The sampling labs (Lossless, Shortcuts)
also share their first controls (the prompt, Run / Stop, the number of samples), their draft-shape controls,
and a status that says, before a run, how long one will take (``WaitingStatus``).
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from engine.tools.exactness import first_tokens_law
from visuals.lab_figures import message_figure

from ..config import LAB_SAMPLES_FLOOR, MAX_LAB_SAMPLES
from ..wiring import run_stop_buttons, wire_run_and_stop
from . import durations

__all__ = [
    "MIN_SAMPLES",
    "SAMPLES_STEP",
    "TOKENS_TESTED",
    "WaitingStatus",
    "draft_shape_controls",
    "exact_law",
    "lab_tab",
    "results_plot",
    "results_table",
    "sampling_controls",
    "sampling_results",
    "status_box",
    "wire_lab_run",
    "wire_sampling_lab",
]

SAMPLES_STEP = 50  # the sample-count slider's step
MIN_SAMPLES = 10  # fewer samples than this test nothing
TOKENS_TESTED = {1: "the first token", 2: "the first two tokens, jointly (pairs)"}  # what a sampling lab tests


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


def sampling_controls(lab_id: str, prompts: list[str], defaults: dict, prompt_info: str, n_label: str, n_info: str):
    """A sampling lab's first controls: the prompt (pick or type), ▶ Sample / ■ Stop, and the number of samples N
    (elements #<lab_id>-prompt, -run, -stop, -n)."""
    c = {
        "prompt": gr.Dropdown(
            prompts,
            value=defaults["prompt"],
            allow_custom_value=True,
            label="Prompt (pick or type)",
            info=prompt_info,
            elem_id=f"{lab_id}-prompt",
        )
    }
    c["run_btn"], c["stop_btn"] = run_stop_buttons("▶ Sample", f"{lab_id}-run", f"{lab_id}-stop")
    c["n"] = gr.Slider(
        LAB_SAMPLES_FLOOR,
        MAX_LAB_SAMPLES,
        min(defaults["n"], MAX_LAB_SAMPLES),
        step=SAMPLES_STEP,
        label=n_label,
        info=n_info,
        elem_id=f"{lab_id}-n",
    )
    return c


def draft_shape_controls(c: dict, defaults: dict, max_k: int, max_topk: int, topk_info=None, tokens_info=None):
    """A sampling lab's draft shape (K, tree top-k), what it tests (one token or pairs) and its seed, into `c`."""
    with gr.Row():
        c["k"] = gr.Slider(1, max_k, defaults["k"], step=1, label="K (draft depth)", min_width=140)
        c["topk"] = gr.Slider(1, max_topk, defaults["topk"], step=1, label="Tree top-k", info=topk_info, min_width=140)
    c["tokens"] = gr.Radio(
        [(label, n) for n, label in TOKENS_TESTED.items()], value=defaults["tokens"], label="Test", info=tokens_info
    )
    c["seed"] = gr.Number(0, precision=0, label="Seed", info="-1 = random")


class WaitingStatus:
    """A sampling lab's status before a run: what a run with the defaults will take, from this server's own runs
    (durations.promise) or else the recorded time with its machine and date; shown again on entering the tab,
    unless a run's results are on it."""

    TEXT = "*Press **Sample** to draw real samples{}. With the defaults: {}.*"

    def __init__(self, lab: str, samples: int, recorded_time: str, under: str = ""):
        self.lab, self.samples, self.recorded_time, self.under = lab, samples, recorded_time, under

    def __call__(self) -> str:
        return self.TEXT.format(self.under, durations.promise(self.lab, self.samples, self.recorded_time))

    def refresh(self, status: str):
        """Entering the tab: the promise again from this server's latest runs, unless a run's results are shown."""
        return self() if (status or "").startswith(self.TEXT.split("{")[0]) else gr.skip()


def sampling_results(lab_id: str, waiting: WaitingStatus, plot_title: str, table: gr.Dataframe) -> dict:
    """A sampling lab's results: its status (#<lab_id>-status), its figure (#<lab_id>-plot) and `table`."""
    status = status_box(waiting(), f"{lab_id}-status")
    plot = results_plot(plot_title, "Press Sample to draw real samples", f"{lab_id}-plot")
    return {"status": status, "plot": plot, "table": table}


def wire_sampling_lab(c: dict, out: dict, fn, inputs: list[str], outputs: list[str], waiting: WaitingStatus) -> None:
    """Run / Stop of a sampling lab, and its waiting status refreshed on entering the tab."""
    wire_lab_run(c, out, fn, inputs, outputs)
    c["tab"].select(
        waiting.refresh, [out["status"]], [out["status"]], show_progress="hidden", queue=False, api_visibility="private"
    )


def exact_law(engine, prompt: str, tokens: int, seed: int, settings: dict) -> dict:
    """The target's exact law of the first token (tokens = 1) or pair (2) after the prompt with the lab's sampling
    settings (engine.tools.exactness.first_tokens_law), or a gr.Error saying why not."""
    try:
        return first_tokens_law(engine, prompt, tokens, seed=seed, **settings)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
