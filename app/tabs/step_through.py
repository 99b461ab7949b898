"""The Step-through tab: a run walked one target pass at a time, its tree, p vs q and a narration.

The trace comes from the session's last Playground run, a recorded real run, or an uploaded file
(validated by engine.trace); it is kept in the tab's own gr.State, so the walk does not change
when the Playground runs again until the user comes back to the tab.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gradio as gr

from engine.trace import step_events
from visuals import pq_figure

from .. import render
from ..figure_guard import guarded
from ..inputs import as_int
from ..narration import narrate_step
from ..pass_view import PQ_TITLE, pass_figures, pass_slider, pass_slider_label
from ..traces import DEFAULT_TRACE, load_recorded, load_upload, recorded_name, recorded_traces, upload_path
from ..wiring import PRIVATE, pack

__all__ = ["SOURCES", "STEP_KEYS", "initial_values", "layout", "load_step_source", "step_view", "wire"]

SOURCES = ("Last run", "Recorded trace", "Upload")
STEP_KEYS = ["st_trace", "st_step", "st_tree", "st_pq", "st_narration", "st_info", "st_pos"]
PROMPT_SHOWN = 160  # characters of the prompt quoted in the trace's description


# -------------------------------------------------------------------------------------- one pass
def position_choices(step: dict) -> tuple[list[tuple[str, int]], int | None]:
    """The positions of a pass whose p and q were recorded, as dropdown choices, and the default one."""
    nodes = {n.get("id"): n for n in step.get("nodes") or []}
    rejected_parents = {n.get("parent") for n in nodes.values() if n.get("decision") == "rejected"}
    extra = (step.get("emitted") or [{}])[-1] if step.get("emitted") else {}
    choices, default = [], None
    for i, dist in enumerate(step.get("dists") or []):
        node = dist.get("node", -1)
        if node == -1:
            label = "position +1: right after the context"
        else:
            info = nodes.get(node, {})
            label = f"position +{(info.get('depth') or 0) + 1}: after {render.md_token(info.get('text')).strip('`')}"
        if node in rejected_parents:
            label += " · rejection here"
            default = i if default is None else default
        if extra.get("kind") in ("bonus", "resampled") and extra.get("from_node", -1) == node:
            label += f" · {extra['kind']} token drawn here"
        choices.append((label, i))
    if choices and default is None:
        default = 0
    return choices, default


def _position_dropdown(step: dict | None):
    choices, default = position_choices(step or {})
    if not choices:
        return gr.Dropdown(choices=[], value=None, interactive=False, label="p vs q at position (none recorded)")
    return gr.Dropdown(choices=choices, value=default, interactive=len(choices) > 1, label="p vs q at position")


def step_view(trace: list[dict], index: int) -> dict:
    """The tab's outputs for pass `index` (0-based, clamped to the trace)."""
    steps = step_events(trace)
    if not steps:
        empty = "This trace has no target passes"
        tree, pq = pass_figures(trace, 0, empty=empty)
        return {
            "st_step": pass_slider(1, 1, interactive=False),
            "st_tree": tree,
            "st_pq": pq,
            "st_narration": "This trace has no target passes yet.",
            "st_pos": _position_dropdown(None),
        }
    index = max(0, min(index, len(steps) - 1))
    tree, pq = pass_figures(trace, index)
    return {
        "st_step": pass_slider(len(steps), index + 1),
        "st_tree": tree,
        "st_pq": pq,
        "st_narration": narrate_step(trace, index),
        "st_pos": _position_dropdown(steps[index]),
    }


def _trace_info(trace: list[dict], origin: str) -> str:
    start = trace[0]
    prompt = (start.get("prompt") or "(token ids)").strip().replace("\n", " ")
    if len(prompt) > PROMPT_SHOWN:
        prompt = prompt[: PROMPT_SHOWN - 3] + "…"
    done = "finished" if trace[-1].get("type") == "finish" else "partial (stopped early)"
    return (
        f"**{origin}** · {render.trace_title(trace)} · {len(step_events(trace))} target passes, {done}.  \n"
        f"Prompt: *{render.md_token(prompt)[1:-1] if prompt else ''}*"
    )


def _show(trace: list[dict], origin: str) -> dict:
    """Every output for a newly chosen trace, at its first pass."""
    values = step_view(trace, 0)
    values["st_trace"] = trace
    values["st_info"] = _trace_info(trace, origin)
    return values


# -------------------------------------------------------------------------------------- handlers
def _last_run(recorded: str, last_trace: list[dict] | None) -> tuple[list[dict], str]:
    shown = recorded_name(last_trace)
    if last_trace and shown:
        gr.Info("No run yet in this session, so this is the recorded run the Playground shows.")
        return last_trace, f"Recorded trace `{shown}` (no run yet in this session)"
    if not last_trace:
        gr.Warning("No run yet in this session: run something in the Playground first. Showing a recorded trace.")
        name = recorded or DEFAULT_TRACE
        return load_recorded(name), f"Recorded trace `{name}`"
    return last_trace, "Your last Playground run"


def load_step_source(
    source: str, recorded: str, upload, last_trace: list[dict] | None, current: list[dict] | None = None
):
    """Source radio / dropdown / upload -> the trace to step through, shown at its first pass."""
    if source == "Last run":
        trace, origin = _last_run(recorded, last_trace)
    elif source == "Upload":
        if not upload:
            return pack(
                STEP_KEYS, {"st_info": "Upload a `.json` trace (from the Playground's download button or the CLI)."}
            )
        path = upload_path(upload)
        try:
            trace, origin = load_upload(path), f"Uploaded `{Path(path).name}`"
        except gr.Error as exc:
            # Said where the trace's description goes; the trace on screen stays (an error raised here would
            # mark every output of the tab as failed).
            gr.Warning(exc.message)
            return pack(STEP_KEYS, {"st_info": f"⚠ {exc.message} The trace shown is unchanged."})
    else:
        trace, origin = load_recorded(recorded or DEFAULT_TRACE), f"Recorded trace `{recorded or DEFAULT_TRACE}`"
    return pack(STEP_KEYS, _show(trace, origin))


def refresh_last_run(source: str, recorded: str, upload, last_trace, current):
    """Entering the Step-through tab: if it follows the last run and that run changed, reload it."""
    if source != "Last run" or not last_trace:
        return pack(STEP_KEYS, {})
    if current and current[0].get("started_at") == last_trace[0].get("started_at") and len(current) == len(last_trace):
        return pack(STEP_KEYS, {})
    return load_step_source(source, recorded, upload, last_trace)


def goto_step(trace: list[dict] | None, step_number, delta: int = 0):
    """Prev / Next / slider -> that pass (1-based in the UI)."""
    if not trace:
        return pack(STEP_KEYS, {})
    try:
        number = as_int(step_number or 1, "step")
    except gr.Error:
        number = 1
    return pack(STEP_KEYS, step_view(trace, number - 1 + delta))


def show_position(trace: list[dict] | None, step_number, position):
    """Position dropdown -> p vs q at that position of the current pass."""
    steps = step_events(trace or [])
    if not steps or position is None:
        return gr.skip()
    index = max(0, min(as_int(step_number or 1, "step"), len(steps)) - 1)
    return guarded(PQ_TITLE, pq_figure, trace, index, position=int(position))


def initial_step_through(name: str = DEFAULT_TRACE) -> dict:
    return _show(load_recorded(name), f"Recorded trace `{name}`")


# ---------------------------------------------------------------------------------------- layout
def _source_row(c: dict, default: str | None) -> None:
    with gr.Row():
        c["st_source"] = gr.Radio(
            list(SOURCES),
            value="Recorded trace",
            label="Trace to explore",
            info="Your last Playground run, a recorded real run, or a trace file you upload.",
            elem_id="st-source",
        )
        c["st_recorded"] = gr.Dropdown(recorded_traces(), value=default, label="Recorded trace", elem_id="st-recorded")
        c["st_upload"] = gr.File(
            label="Upload a trace (.json)", file_types=[".json"], type="filepath", elem_id="st-upload", height=110
        )


def _stepper_row(c: dict, n_steps: int) -> None:
    with gr.Row(equal_height=True, elem_classes=["sl-stepper"]):
        c["prev_btn"] = gr.Button("◀ Prev", scale=0, min_width=110, elem_id="st-prev")
        c["st_step"] = gr.Slider(
            1, max(n_steps, 2), value=1, step=1, label=pass_slider_label(n_steps), elem_id="st-step", scale=1
        )
        c["next_btn"] = gr.Button("Next ▶", scale=0, min_width=110, elem_id="st-next")


def _pass_panels(c: dict, init: dict) -> None:
    with gr.Row(equal_height=False):
        with gr.Column(min_width=480):
            c["st_tree"] = gr.Plot(init.get("st_tree"), label="Draft tree", show_label=False, elem_id="st-tree")
            c["st_narration"] = gr.Markdown(
                init.get("st_narration", ""), elem_id="st-narration", elem_classes=["sl-narration"]
            )
        with gr.Column(min_width=480):
            c["st_pos"] = gr.Dropdown(
                choices=init["st_pos"].choices if init.get("st_pos") else [],
                value=init["st_pos"].value if init.get("st_pos") else None,
                label="p vs q at position",
                info="A pass checks the drafts position by position; pick the one to chart.",
                elem_id="st-pos",
            )
            c["st_pq"] = gr.Plot(init.get("st_pq"), label="p vs q", show_label=False, elem_id="st-pq")


def initial_values() -> dict:
    """The tab's first values: the default recorded trace (computed before the page is laid out, since
    the slider and dropdown updates in it would otherwise become components of the page)."""
    recorded = recorded_traces()
    default = DEFAULT_TRACE if DEFAULT_TRACE in recorded else (recorded[0] if recorded else None)
    return {**initial_step_through(default), "name": default} if default else {}


def layout(init: dict) -> dict:
    """The Step-through tab showing `init` (initial_values); returns its components by name."""
    c: dict = {}
    with gr.Tab("Step-through", id="step-through") as c["tab"]:
        c["st_trace"] = gr.State(init.get("st_trace") or [])  # the trace being walked (inside the Tab, see playground)
        gr.Markdown(
            "Walk through a run **one target pass at a time**: which tokens the drafter proposed (the tree), "
            "how the target's probabilities **p** compare with the drafter's **q**, and, in plain words, "
            "why each draft was accepted or rejected."
        )
        _source_row(c, init.get("name"))
        c["st_info"] = gr.Markdown(init.get("st_info", ""), elem_id="st-info")
        _stepper_row(c, len(step_events(init.get("st_trace") or [])) or 1)
        _pass_panels(c, init)
    return c


def _switch_to(source: str):
    """A handler that sets the source radio to `source` and loads the trace from there (the dropdown
    and the upload box work without first choosing their source)."""

    def handler(_source, *args):
        return (gr.Radio(value=source), *load_step_source(source, *args))

    return handler


def _wire_sources(c: dict, last_trace: gr.State, outputs: list) -> None:
    """The source radio, the recorded-trace dropdown, the upload box and entering the tab."""
    inputs = [c["st_source"], c["st_recorded"], c["st_upload"], last_trace, c["st_trace"]]
    c["st_source"].input(load_step_source, inputs, outputs, concurrency_limit=None, **PRIVATE)
    switched = [c["st_source"], *outputs]
    c["st_recorded"].input(_switch_to("Recorded trace"), inputs, switched, concurrency_limit=None, **PRIVATE)
    c["st_upload"].upload(_switch_to("Upload"), inputs, switched, concurrency_limit=None, **PRIVATE)
    c["tab"].select(refresh_last_run, inputs, outputs, show_progress="hidden", concurrency_limit=None, **PRIVATE)


def wire(c: dict, last_trace: gr.State) -> None:
    """Sources, Prev / Next / slider and the position dropdown; `last_trace` is the Playground's trace."""
    outputs = [c[key] for key in STEP_KEYS]
    _wire_sources(c, last_trace, outputs)
    at_step = [c["st_trace"], c["st_step"]]
    for button, delta in ((c["prev_btn"], -1), (c["next_btn"], +1)):
        button.click(functools.partial(goto_step, delta=delta), at_step, outputs, concurrency_limit=None, **PRIVATE)
    c["st_step"].input(
        goto_step,
        at_step,
        outputs,
        trigger_mode="always_last",
        show_progress="hidden",
        concurrency_limit=None,
        **PRIVATE,
    )
    c["st_pos"].input(
        show_position,
        [*at_step, c["st_pos"]],
        [c["st_pq"]],
        show_progress="hidden",
        concurrency_limit=None,
        **PRIVATE,
    )
