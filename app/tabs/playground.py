"""The Playground tab: one real generation streamed pass by pass, with its draft trees, p vs q and summary.

Data flows one way: the engine yields events, `run_playground` appends them to the session's trace
(a plain list of dicts kept in gr.State) and every output is recomputed from that trace by
`render` (text) and `visuals` (figures). Before anyone runs anything the tab shows a recorded
real run (assets/traces), so the page needs no model until Run is pressed.
"""

from __future__ import annotations

import time

import gradio as gr

from engine.metrics import run_summary
from engine.model.loading import DEFAULT_MODEL, PRESETS
from engine.settings import MAX_HISTORY_DOCS
from engine.trace import step_events
from visuals import acceptance_figure, interesting_step_index, tokens_per_pass_figure
from visuals.lab_figures import message_figure
from visuals.run_charts import (
    ACCEPTED_PER_PASS_TITLE,
    DEPTH_TITLE,
    KV_TITLE,
    accepted_per_pass_figure,
    draft_depth_figure,
    is_adaptive,
    kv_cache_figure,
)

from .. import config, render
from ..config import MAX_NEW_TOKENS
from ..drafter_help import ADAPTIVE_INFO, drafter_choices, drafter_info
from ..engine_access import (
    VLLM_DRAFTER,
    builds_on_first_use,
    get_engine,
    is_loaded,
    make_settings,
    start_generation,
    start_vllm_generation,
    use_drafter,
)
from ..examples import EXAMPLE_SETTINGS, example_dropdown, example_note, example_values
from ..figure_guard import guarded
from ..inputs import as_int
from ..pass_view import pass_figures, pass_slider, pass_slider_label
from ..stopping import stop_requested
from ..traces import DEFAULT_TRACE, load_recorded, recorded_traces, session_id, write_trace_file
from ..wiring import PRIVATE, end_run, pack, run_stop_buttons, wire_run_and_stop
from . import run_panels

__all__ = [
    "PLAY_KEYS",
    "finished_outputs",
    "initial_playground",
    "initial_values",
    "layout",
    "loaded_outputs",
    "pick_example",
    "run_playground",
    "show_play_step",
    "suggest_drafter",
    "wire",
]

# Live figures cost ~0.1-0.3 s of CPU each refresh, taken from the run being measured; refresh them at
# most every FIGURE_INTERVAL_S and at most FIGURE_SHARE of the time (text and counters update every pass).
FIGURE_INTERVAL_S = 1.0
FIGURE_SHARE = 0.2
ACCEPTANCE_TITLE = "Acceptance by draft position"
TPP_TITLE = "Tokens per target pass"
DOWNLOAD_LABEL = "⬇ Download this trace (JSON)"

# What a run updates, in this order (the Step-through's source follows the last run).
PLAY_KEYS = [
    "status",
    "text",
    "stats",
    "tree",
    "pq",
    "tpp",
    "step",
    "card",
    "acceptance",
    "hist",
    "kv",
    "depth",
    "download",
    "trace",
    "st_source",
    "run_btn",
    "answers",
    "drafter",
]
# The inputs of a run, in the order run_playground takes them.
PLAY_INPUTS = [
    "prompt",
    "target",
    "drafter",
    "k",
    "topk",
    "budget",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_new",
    "dtype",
    "adaptive",
    "verify",
    "answers",
]


# --------------------------------------------------------------------------------------- outputs
def _text_html(trace: list[dict], running: bool = False) -> str:
    baseline = bool(trace) and trace[0].get("mode") == "baseline"
    return render.token_html(trace, running=running) + render.legend_html(baseline)


def _acceptance(trace: list[dict]):
    if trace and trace[0].get("mode") == "baseline":
        return message_figure(ACCEPTANCE_TITLE, "A baseline run drafts nothing")
    return guarded(ACCEPTANCE_TITLE, acceptance_figure, trace)


def _accepted_per_pass(trace: list[dict]):
    if trace and trace[0].get("mode") == "baseline":
        return message_figure(ACCEPTED_PER_PASS_TITLE, "A baseline run drafts nothing")
    return guarded(ACCEPTED_PER_PASS_TITLE, accepted_per_pass_figure, trace)


def _depth_plot(trace: list[dict], figure=None) -> gr.Plot:
    """The K-per-pass chart, shown for runs whose drafting adapted (a fixed K is a flat line)."""
    figure = figure if figure is not None else guarded(DEPTH_TITLE, draft_depth_figure, trace)
    return gr.Plot(value=figure, visible=is_adaptive(trace))


def finished_outputs(
    trace: list[dict], status: str, download: str | None = None, step_index: int | None = None
) -> dict:
    """Every Playground output for a finished, stopped or recorded trace."""
    n = len(step_events(trace))
    index = n - 1 if step_index is None else step_index
    tree, pq = pass_figures(trace, max(0, index))
    values = {
        "status": status,
        "text": _text_html(trace),
        "stats": render.stats_line(trace),
        "tree": tree,
        "pq": pq,
        "tpp": guarded(TPP_TITLE, tokens_per_pass_figure, trace),
        "step": pass_slider(n, index + 1),
        "card": render.run_card(trace),
        "acceptance": _acceptance(trace),
        "hist": _accepted_per_pass(trace),
        "kv": guarded(KV_TITLE, kv_cache_figure, trace),
        "depth": _depth_plot(trace),
        "trace": trace,
    }
    if download is not None:
        values["download"] = gr.DownloadButton(value=download, interactive=True, label=DOWNLOAD_LABEL)
    return values


def initial_playground(name: str = DEFAULT_TRACE) -> dict:
    """Initial Playground values from a recorded real trace (no model needed); also used by tests."""
    trace = load_recorded(name)
    index = interesting_step_index(trace)
    values = finished_outputs(
        trace,
        status=(
            f"Showing a **recorded real run** (`{name}`): {render.recorded_where(trace)}. "
            "Press **Run** to generate live with the real model (it loads on first use); live numbers on "
            "another machine, or a busy one, differ."
        ),
        step_index=index,
    )
    values["download"] = write_trace_file(trace, "recorded")
    values["step"] = index + 1  # a plain value: this dict also serves as initial component values
    values["depth"] = guarded(DEPTH_TITLE, draft_depth_figure, trace)  # its visibility is set in the layout
    return values


# ------------------------------------------------------------------------------------------- run
def _stopped_status(trace: list[dict]) -> str:
    steps = step_events(trace)
    if not steps:
        return "■ Stopped before the first target pass."
    n = len(steps)
    return (
        f"■ Stopped after {n} target pass{'es' if n != 1 else ''}; kept the {steps[-1].get('tokens_total', 0)} "
        "tokens produced so far (a partial trace: the summary, charts and download cover them)."
    )


def _server_stopped(trace: list[dict], finish: dict, request) -> dict:
    """The outputs when the vLLM server stopped answering mid-run: what it said, the text it had streamed, and
    the incomplete trace to download (no pass to draw: vLLM sends its per-pass counts only with its last chunk)."""
    streamed = finish.get("text") or ""
    return {
        "status": f"⚠ **{finish.get('error')}.** Kept the {len(finish.get('token_ids') or [])} tokens it had "
        "streamed (below, and in the trace download, marked incomplete); no target pass can be drawn, because vLLM "
        "sends its per-pass counts only at the end of a run. Run again once the server is back.",
        "text": render.token_html([], empty_message=streamed or "(nothing streamed)"),
        "stats": "",
        "download": gr.DownloadButton(
            value=write_trace_file(trace, session_id(request)), interactive=True, label="⬇ Incomplete trace"
        ),
        "trace": list(trace),
        "run_btn": end_run(),
    }


def _has_rejection(trace: list[dict], index: int) -> bool:
    steps = step_events(trace)
    return 0 <= index < len(steps) and any(n.get("decision") == "rejected" for n in steps[index].get("nodes") or [])


def _done_status(trace: list[dict], index: int) -> str:
    s = run_summary(trace)
    rejected = _has_rejection(trace, index)
    return (
        f"Done: {s['new_tokens']} tokens in {s['target_passes']} target passes "
        f"({s['tokens_per_pass']:.2f} tokens/pass). The tree shows pass {index + 1}"
        f"{' (the first with a rejected draft)' if rejected else ''}; use the slider for any "
        "other pass, or open **Step-through** for a narrated walk."
    )


def _started(trace: list[dict]) -> dict:
    """The outputs when the start event arrives: text and counters live, the rest waits for the end."""
    return {
        "status": f"Running: {render.trace_title(trace)}",
        "text": _text_html(trace, running=True),
        "stats": render.stats_line(trace, running=True),
        "card": "*The run summary appears here when the run ends (or when you press Stop).*",
        "acceptance": message_figure(ACCEPTANCE_TITLE, "Shown when the run ends"),
        "hist": message_figure(ACCEPTED_PER_PASS_TITLE, "Shown when the run ends"),
        "kv": message_figure(KV_TITLE, "Shown when the run ends"),
        "depth": _depth_plot(trace, message_figure(DEPTH_TITLE, "Drawn as the run goes")),
        "download": gr.DownloadButton(value=None, interactive=False, label="⬇ Trace download (after the run)"),
        "step": pass_slider(1, 1, interactive=False),
        "trace": list(trace),
    }


class _FigurePacer:
    """Decides when a live update also redraws the figures (see FIGURE_INTERVAL_S and FIGURE_SHARE).
    The first tokens go out without figures; the tree and p/q follow within FIGURE_INTERVAL_S."""

    def __init__(self) -> None:
        self.next = time.perf_counter() + FIGURE_INTERVAL_S

    def add_figures(self, values: dict, trace: list[dict], n: int) -> None:
        began = time.perf_counter()
        if began < self.next:
            return
        values["tree"], values["pq"] = pass_figures(trace, n - 1)
        values["tpp"] = guarded(TPP_TITLE, tokens_per_pass_figure, trace)
        if is_adaptive(trace):
            values["depth"] = guarded(DEPTH_TITLE, draft_depth_figure, trace)
        values["step"] = pass_slider(n, n, interactive=False)
        cost = time.perf_counter() - began
        self.next = began + max(FIGURE_INTERVAL_S, cost / FIGURE_SHARE)


def _stream(events, trace: list[dict], run_id: str):
    """Playground updates while the engine runs; fills `trace`. Returns True when Stop ended the run."""
    pacer = _FigurePacer()
    for event in events:
        trace.append(event)
        kind = event.get("type")
        if kind != "finish" and stop_requested(run_id):
            return True
        if kind == "start":
            yield pack(PLAY_KEYS, _started(trace))
        elif kind == "step":
            n = len(step_events(trace))
            values = {
                "status": f"Running: pass {n}…",
                "text": _text_html(trace, running=True),
                "stats": render.stats_line(trace, running=True),
                "trace": list(trace),
            }
            pacer.add_figures(values, trace, n)
            yield pack(PLAY_KEYS, values)
    return False


def _prepare(target, drafter, dtype, progress):
    """Load the target and build the drafter (status updates while that takes time); yields updates,
    returns the engine."""
    if not is_loaded(target, dtype):
        yield pack(PLAY_KEYS, {"status": f"Loading **{target}** ({dtype}); this happens once per server…"})
    engine = get_engine(target, dtype, progress)
    if builds_on_first_use(drafter):
        yield pack(PLAY_KEYS, {"status": f"Preparing drafter **{drafter}** (first use builds it)…"})
    use_drafter(engine, drafter)
    return engine


def run_playground(
    prompt,
    target,
    drafter,
    k,
    topk,
    budget,
    temperature,
    top_p,
    top_k,
    seed,
    max_new_tokens,
    dtype,
    adaptive: bool = False,
    verify: str = "token",
    answers: list[str] | None = None,
    run_id: str = "",
    request: gr.Request = None,
    progress=gr.Progress(),  # noqa: B008 (gradio injects the tracker)
):
    """Generator: stream one real generation into the Playground outputs, one update per target pass."""
    settings = make_settings(k, topk, budget, temperature, top_p, top_k, seed, max_new_tokens, adaptive, verify)
    answers = [a for a in (answers or []) if isinstance(a, str)][-MAX_HISTORY_DOCS:]
    settings.history = tuple(answers)  # only the suffix drafter reads them
    if drafter == VLLM_DRAFTER:  # the production engine: its own model and speculation, same events
        yield pack(PLAY_KEYS, {"status": "Sending the prompt to the vLLM server…"})
        generation = start_vllm_generation(prompt, settings)
    else:
        engine = yield from _prepare(target, drafter, dtype, progress)
        generation = start_generation(engine, prompt, drafter, settings)
    if stop_requested(run_id):
        generation.close()
        yield pack(PLAY_KEYS, {"status": _stopped_status([]), "run_btn": end_run()})
        return
    trace: list[dict] = []
    with generation as events:
        stopped = yield from _stream(events, trace, run_id)
    finish = trace[-1] if trace and trace[-1].get("type") == "finish" else None
    if finish is not None and finish.get("incomplete"):  # the vLLM server stopped answering mid-run
        yield pack(PLAY_KEYS, _server_stopped(trace, finish, request))
        return
    index = interesting_step_index(trace)
    status = _stopped_status(trace) if stopped else _done_status(trace, index)
    values = finished_outputs(trace, status, download=write_trace_file(trace, session_id(request)), step_index=index)
    values["st_source"] = "Last run"
    values["run_btn"] = end_run()
    finish = trace[-1] if trace and trace[-1].get("type") == "finish" else None
    if finish is not None and finish.get("text", "").strip():
        values["answers"] = (answers + [finish["text"]])[-MAX_HISTORY_DOCS:]
    if drafter != VLLM_DRAFTER:  # the drafters' c as this server has now measured them
        vllm_note = " vllm runs the prompt on the configured vLLM server: its model, its K." if config.VLLM_URL else ""
        values["drafter"] = gr.Dropdown(info=drafter_info(engine) + vllm_note)
    if drafter == "suffix" and not stopped:
        values["status"] += (
            f" The suffix drafter could draft from {render.plural(len(answers), 'earlier answer')} of this session."
        )
    yield pack(PLAY_KEYS, values)


def show_play_step(trace: list[dict] | None, step_number):
    """Slider -> tree and p/q figures of that pass."""
    n = len(step_events(trace or []))
    if not n:
        return gr.skip(), gr.skip()
    index = max(0, min(as_int(step_number or 1, "step"), n) - 1)
    return pass_figures(trace, index)


# -------------------------------------------------------------------------------- examples, model
def loaded_outputs(name: str) -> dict:
    """What Load leaves in the text and its stats line: not the last run's (other settings, another prompt),
    but where the new one will appear and that Run starts it."""
    return {
        "text": render.token_html(
            [],
            empty_message=f"Loaded “{name}”: press ▶ Run to generate it on this machine. The summary and charts "
            "below are the previous run's (greyed) until then.",
        ),
        "stats": "",
    }


def pick_example(name: str):
    """Example dropdown -> prompt, its drafter, its settings (so Run reproduces it), in the status line what the
    example shows and what it measured, and the last run's text and stats cleared (``loaded_outputs``)."""
    values = example_values(name)
    if values is None:
        return (gr.skip(),) * (5 + len(EXAMPLE_SETTINGS))
    settings = [values.get(key, gr.skip()) for key in EXAMPLE_SETTINGS]
    cleared = loaded_outputs(name)
    return (values["prompt"], values["drafter"] or gr.skip(), *settings, example_note(name), *cleared.values())


def suggest_drafter(target: str):
    """A preset target -> its suggested model drafter (others keep the current drafter)."""
    suggestion = PRESETS.get(target, {}).get("drafter")
    if target != DEFAULT_MODEL and suggestion:
        return gr.Dropdown(value=f"model:{suggestion}")
    return gr.skip()


# ---------------------------------------------------------------------------------------- layout
def _prompt_controls(c: dict, start: dict, init: dict) -> None:
    c["prompt"] = gr.Textbox(
        value=start.get("prompt") or "",
        label="Prompt",
        lines=4,
        max_lines=12,
        placeholder="Ask the model something…",
        elem_id="sl-prompt",
    )
    c["example"] = example_dropdown("sl-example")
    c["run_btn"], c["stop_btn"] = run_stop_buttons("▶ Run", "sl-run", "sl-stop")
    c["status"] = gr.Markdown(init.get("status", ""), elem_id="sl-status", elem_classes=["sl-status"])


# The run's sliders: key -> (minimum, maximum, step, the setting it shows in a recorded trace, default, label, info).
DRAFTING_SLIDERS = {
    "k": (1, 16, 1, "k", 4, "K (draft depth)", "Tokens guessed ahead per target pass."),
    "topk": (1, 8, 1, "topk", 1, "Tree top-k", "Alternatives per guess: 1 = a single chain, more = a tree."),
    "budget": (0, 128, 1, "num_draft_tokens", 0, "Tree budget", "Most draft tokens per pass; 0 = K × top-k."),
}
SAMPLING_SLIDERS = {
    "temperature": (0, 2, 0.05, "temperature", 0.0, "Temperature", "0 = greedy (the top token); higher = more random."),
    "top_p": (
        0.05,
        1,
        0.05,
        "top_p",
        1.0,
        "Top-p",
        "Only the likeliest tokens covering this much probability; 1 = off.",
    ),
    "top_k": (0, 200, 1, "top_k", 0, "Top-k", "Sample only from the k likeliest; 0 = off."),
}


def _sliders(c: dict, specs: dict, s: dict) -> None:
    """Sliders from their specs, each at the recorded trace's setting (`s`) or its default."""
    for key, (lo, hi, step, setting, default, label, info) in specs.items():
        c[key] = gr.Slider(lo, hi, s.get(setting, default), step=step, label=label, info=info)


def _drafting_controls(c: dict, start: dict, s: dict) -> None:
    with gr.Accordion("Drafting", open=True, elem_classes=["sl-settings"]):
        c["drafter"] = gr.Dropdown(
            choices=drafter_choices(),
            value=start.get("drafter") or "ngram",
            allow_custom_value=True,
            label="Drafter",
            info=drafter_info()
            + (" vllm runs the prompt on the configured vLLM server: its model, its K." if config.VLLM_URL else ""),
            elem_id="sl-drafter",
        )
        chain = (s.get("topk") or 1) == 1  # a chain's budget is the slider's "0 = K × top-k"
        _sliders(c, DRAFTING_SLIDERS, {**s, "num_draft_tokens": 0} if chain else s)
        c["adaptive"] = gr.Checkbox(
            value=bool(s.get("adaptive")), label="Adaptive draft depth", info=ADAPTIVE_INFO, elem_id="sl-adaptive"
        )


VERIFY_CHOICES = [("per token", "token"), ("block", "block")]
VERIFY_INFO = (
    "How a sampled chain's drafts are kept; both keep the output exactly the target's. Per token: each draft "
    "with probability min(1, p/q). Block: the longest drafted prefix by its joint ratio (never fewer tokens in "
    "expectation; one short run can show fewer). Greedy runs and trees are verified per token."
)


def _sampling_controls(c: dict, s: dict) -> None:
    with gr.Accordion("Sampling", open=True, elem_classes=["sl-settings"]):
        _sliders(c, SAMPLING_SLIDERS, s)
        c["verify"] = gr.Radio(
            VERIFY_CHOICES,
            value=s.get("verify") or "token",
            label="Acceptance rule",
            info=VERIFY_INFO,
            elem_id="sl-verify",
        )
        c["seed"] = gr.Number(
            value=s.get("seed", -1),
            precision=0,
            label="Seed",
            info="Blank or -1 = random; the seed used is shown in the run summary.",
        )
        c["max_new"] = gr.Slider(
            1,
            MAX_NEW_TOKENS,
            min(s.get("max_new_tokens", 64), MAX_NEW_TOKENS),
            step=1,
            label="Max new tokens",
            info="Stop after this many tokens (or at the end of the answer).",
            elem_id="sl-max-new",
        )


def _outputs(c: dict, init: dict, n_steps: int) -> None:
    c["stats"] = gr.HTML(init.get("stats", ""), elem_id="sl-stats")
    c["text"] = gr.HTML(init.get("text", ""), elem_id="sl-output", min_height=90)
    c["step"] = gr.Slider(
        1,
        max(n_steps, 2),
        value=init.get("step") or n_steps,
        step=1,
        label=pass_slider_label(n_steps),
        info="Pick any pass of the run to see its draft tree and its p vs q below.",
        elem_id="sl-step",
    )
    with gr.Row(equal_height=True):  # side by side when there is room for both, else stacked
        c["tree"] = gr.Plot(init.get("tree"), label="Draft tree", show_label=False, elem_id="sl-tree", min_width=560)
        c["pq"] = gr.Plot(init.get("pq"), label="p vs q", show_label=False, elem_id="sl-pq", min_width=560)
    c["tpp"] = gr.Plot(init.get("tpp"), label="Tokens per pass", show_label=False, elem_id="sl-tpp")
    adaptive = is_adaptive(init.get("trace") or [])  # K per pass: shown when drafting adapted
    c["depth"] = gr.Plot(init.get("depth"), label="Draft depth", show_label=False, elem_id="sl-depth", visible=adaptive)
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=440):
            c["card"] = gr.Markdown(init.get("card", ""), elem_id="sl-card", elem_classes=["sl-card"])
            c["download"] = gr.DownloadButton(
                DOWNLOAD_LABEL, value=init.get("download"), elem_id="sl-download", size="md"
            )
        with gr.Column(scale=1, min_width=560):
            c["acceptance"] = gr.Plot(init.get("acceptance"), label="Acceptance", show_label=False, elem_id="sl-acc")
            c["hist"] = gr.Plot(init.get("hist"), label="Accepted per pass", show_label=False, elem_id="sl-hist")
    c["kv"] = gr.Plot(init.get("kv"), label="KV cache", show_label=False, elem_id="sl-kv")


def initial_values() -> dict:
    """The tab's first values: the default recorded trace (computed before the page is laid out, since
    the slider and button updates in it would otherwise become components of the page)."""
    recorded = recorded_traces()
    name = DEFAULT_TRACE if DEFAULT_TRACE in recorded else (recorded[0] if recorded else None)
    return initial_playground(name) if name else {}


def layout(init: dict) -> dict:
    """The Playground tab showing `init` (initial_values); returns its components by name."""
    trace = init.get("trace") or []
    start = trace[0] if trace else {}
    s = start.get("settings") or {}
    c: dict = {}
    with gr.Tab("Playground", id="playground"):
        # The session's last run (a recorded one until the user runs): the Step-through and labs read it too.
        c["trace"] = gr.State(trace)  # inside the Tab: a State directly under gr.Tabs breaks gradio's tab bar
        # This session's finished answers, newest last: what the suffix drafter may draft from (never shared).
        c["answers"] = gr.State([])
        with gr.Row(equal_height=False, elem_classes=["sl-results-first"]):
            with gr.Column(scale=3, min_width=300, elem_classes=["sl-controls"]):
                _prompt_controls(c, start, init)
                _drafting_controls(c, start, s)
                _sampling_controls(c, s)
                run_panels.model_controls(c)
                run_panels.launch_controls(c, start, s)
            with gr.Column(scale=9, min_width=420, elem_classes=["sl-outputs"]):
                _outputs(c, init, len(step_events(trace)) or 1)
    return c


def wire(c: dict, st_source: gr.Radio) -> None:
    """Run / Stop, the pass slider, the examples and the target's suggested drafter. A run also sets the
    Step-through's source (`st_source`) to the last run."""
    outputs = [st_source if key == "st_source" else c[key] for key in PLAY_KEYS]
    wire_run_and_stop(
        c["run_btn"], c["stop_btn"], run_playground, [c[key] for key in PLAY_INPUTS], outputs, show_progress="minimal"
    )
    c["step"].input(
        show_play_step,
        [c["trace"], c["step"]],
        [c["tree"], c["pq"]],
        trigger_mode="always_last",
        show_progress="hidden",
        concurrency_limit=None,
        **PRIVATE,
    )
    example_outputs = [c[key] for key in ("prompt", "drafter", "k", "topk", "budget", "temperature", "top_p")]
    example_outputs += [c[key] for key in ("top_k", "seed", "max_new", "verify", "status", "text", "stats")]
    c["example"].input(pick_example, [c["example"]], example_outputs, show_progress="hidden", queue=False, **PRIVATE)
    # An edited prompt or setting is no longer the example: the picker lets go of its name (its note stays, as
    # measured).
    edits = ("prompt", "drafter", "k", "topk", "budget", "temperature", "top_p", "top_k", "seed", "max_new", "verify")
    gr.on(
        [c[key].input for key in edits],
        lambda: None,
        None,
        [c["example"]],
        show_progress="hidden",
        queue=False,
        **PRIVATE,
    )
    c["target"].input(suggest_drafter, [c["target"]], [c["drafter"]], show_progress="hidden", queue=False, **PRIVATE)
    run_panels.wire(c)
