"""Gradio plumbing shared by every tab and lab: output packing, the Run / Stop buttons and their wiring.

Handlers that update many components return a dict keyed by output names; `pack` turns it into
the tuple Gradio expects, in the order of the tab's key list, with gr.skip() for anything left
unchanged. Every long run goes through `wire_run_and_stop`, so all of them share one queue
(`MODEL_RUNS`, at most config.MAX_CONCURRENT_RUNS at once) and stop the same way (`stopping`).
"""

from __future__ import annotations

import gradio as gr

from .config import MAX_CONCURRENT_RUNS
from .stopping import new_run_id, request_stop

__all__ = ["MODEL_RUNS", "PRIVATE", "begin_run", "end_run", "pack", "run_stop_buttons", "wire_run_and_stop"]

# Every event is kept out of the public API page except /generate.
PRIVATE = {"api_visibility": "private"}
MODEL_RUNS = "model-runs"  # the concurrency group of everything that runs a model


def pack(keys: list[str], values: dict) -> tuple:
    return tuple(values.get(k, gr.skip()) for k in keys)


def begin_run():
    """Run clicked: a fresh run id, and the button is locked until the run ends (`end_run`)."""
    return new_run_id(), gr.Button(interactive=False)


def end_run():
    return gr.Button(interactive=True)


def run_stop_buttons(label: str, run_elem_id: str, stop_elem_id: str) -> tuple[gr.Button, gr.Button]:
    """The ▶ Run and ■ Stop buttons, side by side."""
    with gr.Row():
        run_btn = gr.Button(label, variant="primary", elem_id=run_elem_id)
        stop_btn = gr.Button("■ Stop", variant="stop", elem_id=stop_elem_id)
    return run_btn, stop_btn


def wire_run_and_stop(run_btn, stop_btn, fn, inputs, outputs, **progress) -> None:
    """Run click: a fresh run id (instant), then `fn(*inputs, run_id)` streamed into `outputs` in the
    shared MODEL_RUNS queue, then the button unlocks; Stop marks the id. `progress`: show_progress...

    Call it inside the tab: the run id's gr.State must not sit directly under gr.Tabs (it breaks
    gradio's tab bar)."""
    run_id = gr.State("")
    run_btn.click(begin_run, None, [run_id, run_btn], queue=False, show_progress="hidden", **PRIVATE).then(
        fn,
        [*inputs, run_id],
        outputs,
        concurrency_limit=MAX_CONCURRENT_RUNS,
        concurrency_id=MODEL_RUNS,
        **progress,
        **PRIVATE,
    ).then(end_run, None, run_btn, queue=False, show_progress="hidden", **PRIVATE)
    stop_btn.click(request_stop, [run_id], None, queue=False, show_progress="hidden", **PRIVATE)
