"""Event handlers: engine events -> trace -> figures and text -> Gradio updates.

Data flows one way: the engine yields events, a handler appends them to the session's trace
(plain list of dicts, kept in gr.State), and everything shown is recomputed from that trace by
`render` (text) and `visuals` (figures). Handlers never touch another session's data; the only
shared objects are the loaded models in `state.REGISTRY`.

Output groups are declared as key lists (PLAY_KEYS, ...); handlers return dicts keyed by those
names and `_pack` turns them into tuples in the right order, with gr.skip() for anything left
unchanged.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import gradio as gr

from . import render
from .figures import figure, message, race_figure
from .state import REGISTRY

log = logging.getLogger("speclens.app")

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets"
TRACES_DIR = ASSETS / "traces"
DEFAULT_TRACE = "chat-int8-tree-sampling.json"
from engine.decode import OutOfMemory  # noqa: E402

from .limits import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, check_model_allowed  # noqa: E402

# Live figures cost ~0.1-0.3 s of CPU each refresh, taken from the run being measured; refresh them at
# most every FIGURE_INTERVAL_S and at most FIGURE_SHARE of the time (text and counters update every pass).
FIGURE_INTERVAL_S = 1.0
FIGURE_SHARE = 0.2
SOURCES = ("Last run", "Recorded trace", "Upload")

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
    "download",
    "trace",
    "st_source",
    "run_btn",
]
STEP_KEYS = ["st_trace", "st_step", "st_tree", "st_pq", "st_narration", "st_info", "st_pos"]
RACE_KEYS = ["race_status", "race_base", "race_spec", "race_plot", "race_results", "race_note", "race_btn"]


def _pack(keys: list[str], values: dict) -> tuple:
    return tuple(values.get(k, gr.skip()) for k in keys)


# --------------------------------------------------------------------------- examples & traces
def load_examples() -> list[dict]:
    try:
        data = json.loads((ASSETS / "examples.json").read_text(encoding="utf-8"))
        return [e for e in data if isinstance(e, dict) and e.get("prompt")]
    except (OSError, ValueError):
        log.exception("cannot read assets/examples.json")
        return []


def recorded_traces() -> list[str]:
    return sorted(p.name for p in TRACES_DIR.glob("*.json"))


def load_recorded(name: str) -> list[dict]:
    """A recorded trace from assets/traces (name only; no path tricks). Cached: treat it as read-only."""
    if not name or Path(name).name != name or name not in recorded_traces():
        raise gr.Error(f"Unknown recorded trace {name!r}; choose one of {', '.join(recorded_traces())}.")
    return _load_recorded(name)


@functools.lru_cache(maxsize=32)
def _load_recorded(name: str) -> list[dict]:
    from engine.trace import load

    return load(TRACES_DIR / name)


def _recorded_name(trace: list[dict] | None) -> str | None:
    """The file name if `trace` is one of the recorded traces (e.g. the Playground's initial one)."""
    if not trace:
        return None
    stamp = trace[0].get("started_at")
    for name in recorded_traces():
        try:
            if load_recorded(name)[0].get("started_at") == stamp:
                return name
        except gr.Error:
            continue
    return None


def _steps(trace) -> list[dict]:
    return [e for e in trace or [] if e.get("type") == "step"]


# ---------------------------------------------------------------------------------- settings
def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise gr.Error(f"{name} must be an integer, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise gr.Error(f"{name} must be an integer, got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise gr.Error(f"{name} must be an integer, got {value!r}")
    return int(number)


def make_settings(k, topk, budget, temperature, top_p, top_k, seed, max_new_tokens):
    """UI / API values -> a validated GenerationSettings (raises gr.Error with the engine's message)."""
    from engine import GenerationSettings

    if seed is None or (isinstance(seed, str) and not seed.strip()):
        seed_value = None
    else:
        seed_value = _as_int(seed, "seed")
        if seed_value < 0:
            seed_value = None  # -1 = random; the seed actually used is in the trace
    max_new = _as_int(max_new_tokens, "max_new_tokens")
    if not 1 <= max_new <= MAX_NEW_TOKENS:
        raise gr.Error(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS} in this app, got {max_new}")
    budget_value = None if budget in (None, "") else _as_int(budget, "tree budget")
    try:
        settings = GenerationSettings(
            max_new_tokens=max_new,
            k=_as_int(k, "K"),
            topk=_as_int(topk, "tree topk"),
            num_draft_tokens=budget_value or None,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed_value,
            max_prompt_tokens=MAX_PROMPT_TOKENS,
        )
        settings.validate()
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    return settings


def _get_engine(target: str, dtype: str, progress=None):
    def report(message: str) -> None:
        if progress is not None:
            try:
                progress(None, desc=message)
            except Exception:  # progress display is best effort
                pass

    try:
        check_model_allowed(target or "default")
        return REGISTRY.get(target or "default", dtype or "auto", progress=report)
    except ValueError as exc:  # ModelLoadError is a ValueError
        raise gr.Error(str(exc)) from None


def _run_engine(engine, drafter: str):
    try:
        if isinstance(drafter, str) and drafter.strip().startswith("model:"):
            check_model_allowed(drafter.strip()[len("model:") :])
        return REGISTRY.engine_for_run(engine, drafter)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None


def _start_generation(engine, prompt, drafter, settings):
    try:
        return engine.generate(prompt, drafter, settings)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None


# ------------------------------------------------------------------------------ downloads
_DOWNLOAD_ROOT = Path(tempfile.gettempdir()) / "speclens-traces"


def write_trace_file(trace: list[dict], session: str | None = None) -> str:
    """Write the trace as JSON to a per-session temp folder (older files of the session are removed)."""
    from engine.trace import dumps

    folder = _DOWNLOAD_ROOT / re.sub(r"[^A-Za-z0-9_-]", "", session or "shared")[:64]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    start = trace[0] if trace else {}
    drafter = re.sub(r"[^A-Za-z0-9_.-]", "-", str(start.get("drafter", "run")))[:40]
    partial = "" if trace and trace[-1].get("type") == "finish" else "-partial"
    path = folder / f"speclens-{drafter}-{time.strftime('%Y%m%d-%H%M%S')}{partial}.json"
    path.write_text(dumps(trace), encoding="utf-8")
    return str(path)


def _session(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "anon"


# ---------------------------------------------------------------------------- playground
def _step_slider(n: int, value: int | None = None, interactive: bool = True):
    n = max(1, n)
    return gr.Slider(
        minimum=1,
        maximum=max(n, 2),  # gradio needs minimum < maximum; a 1-pass run keeps the slider locked
        value=min(value or n, n),
        step=1,
        interactive=interactive and n > 1,
        label=f"Inspect target pass (1–{n})" if n > 1 else "Inspect target pass (only 1)",
    )


def _step_figures(trace, index: int) -> tuple:
    if not _steps(trace):
        return (
            message("Draft tree", "No target pass yet"),
            message("p (target) vs q (drafter)", "No target pass yet"),
        )
    return figure("tree_figure", trace, index), figure("pq_figure", trace, index)


def _interesting_step(trace) -> int:
    try:
        from visuals import interesting_step_index

        return interesting_step_index(trace)
    except Exception:
        return max(0, len(_steps(trace)) - 1)


def _has_rejection(trace, index: int) -> bool:
    steps = _steps(trace)
    return 0 <= index < len(steps) and any(n.get("decision") == "rejected" for n in steps[index].get("nodes") or [])


def finished_outputs(
    trace: list[dict], status: str, download: str | None = None, step_index: int | None = None
) -> dict:
    """Every Playground output for a finished, stopped or recorded trace."""
    steps = _steps(trace)
    n = len(steps)
    index = n - 1 if step_index is None else step_index
    tree, pq = _step_figures(trace, max(0, index))
    baseline = bool(trace) and trace[0].get("mode") == "baseline"
    values = {
        "status": status,
        "text": render.token_html(trace) + render.legend_html(baseline),
        "stats": render.stats_line(trace),
        "tree": tree,
        "pq": pq,
        "tpp": figure("tokens_per_pass_figure", trace),
        "step": _step_slider(n, index + 1),
        "card": render.run_card(trace),
        "acceptance": figure("acceptance_figure", trace)
        if not baseline
        else message("Acceptance by draft position", "A baseline run drafts nothing"),
        "trace": trace,
    }
    if download is not None:
        values["download"] = gr.DownloadButton(value=download, interactive=True, label="⬇ Download this trace (JSON)")
    return values


def initial_playground(trace: list[dict] | None = None, name: str = DEFAULT_TRACE) -> dict:
    """Initial Playground values from a recorded real trace (no model needed); also used by tests."""
    if trace is None:
        trace = load_recorded(name)
    index = _interesting_step(trace)
    values = finished_outputs(
        trace,
        status=(
            f"Showing a **recorded real run** (`{name}`): {render.trace_title(trace)}. "
            "Press **Run** to generate live with the real model (it loads on first use)."
        ),
        step_index=index,
    )
    values["download"] = write_trace_file(trace, "recorded")
    values["step"] = index + 1  # a plain value: this dict also serves as initial component values
    return values


# ------------------------------------------------------------------------------- stopping
# Stop is cooperative: the Run click first gets a fresh run id (a fast, unqueued call), the run
# receives it, and Stop marks that id. The run checks the mark after every target pass, closes
# the engine generator and finalises what it produced itself, so the last update the page gets
# is always the stopped state. (Cancelling the event with `cancels=` instead can let a streamed
# update that was already in flight arrive after the Stop handler's output, leaving the page
# showing "running" for a run that no longer exists.) Marking an id of a run still waiting in
# the queue stops it as soon as it starts; a stale mark never affects a later run (new id).
_STOPS: dict[str, float] = {}
_STOPS_LOCK = threading.Lock()
_STOP_TTL_S = 6 * 3600


def new_run_id() -> str:
    return uuid.uuid4().hex


def begin_run():
    """Run clicked: a fresh run id, and the button is locked until the run ends (`end_run`)."""
    return new_run_id(), gr.Button(interactive=False)


def end_run():
    return gr.Button(interactive=True)


def wire_run_and_stop(run_btn, stop_btn, run_id, fn, inputs, outputs, max_runs: int, private: dict, **progress):
    """Run click: a fresh run id (instant), then `fn(*inputs, run_id)` streamed into `outputs` in the
    shared `model-runs` queue, then the button unlocks; Stop marks the id. `progress`: show_progress..."""
    run_btn.click(begin_run, None, [run_id, run_btn], queue=False, show_progress="hidden", **private).then(
        fn,
        [*inputs, run_id],
        outputs,
        concurrency_limit=max_runs,
        concurrency_id="model-runs",
        **progress,
        **private,
    ).then(end_run, None, run_btn, queue=False, show_progress="hidden", **private)
    stop_btn.click(request_stop, [run_id], None, queue=False, show_progress="hidden", **private)


def request_stop(run_id: str | None) -> None:
    if not run_id:
        return
    now = time.time()
    with _STOPS_LOCK:
        for key in [k for k, t in _STOPS.items() if now - t > _STOP_TTL_S]:
            del _STOPS[key]
        _STOPS[run_id] = now


def stop_requested(run_id: str | None) -> bool:
    return bool(run_id) and run_id in _STOPS


def _stopped_status(trace: list[dict]) -> str:
    steps = _steps(trace)
    if not steps:
        return "■ Stopped before the first target pass."
    n = len(steps)
    return (
        f"■ Stopped after {n} target pass{'es' if n != 1 else ''}; kept the {steps[-1].get('tokens_total', 0)} "
        "tokens produced so far (a partial trace: the summary, charts and download cover them)."
    )


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
    run_id: str = "",
    request: gr.Request = None,
    progress=gr.Progress(),  # noqa: B008 (gradio injects the tracker)
):
    """Generator: stream one real generation into the Playground outputs, one update per target pass."""
    settings = make_settings(k, topk, budget, temperature, top_p, top_k, seed, max_new_tokens)
    if not REGISTRY.is_loaded(target, dtype):
        yield _pack(PLAY_KEYS, {"status": f"Loading **{target}** ({dtype}); this happens once per server…"})
    engine = _get_engine(target, dtype, progress)
    if isinstance(drafter, str) and (drafter.strip() == "int8" or drafter.strip().startswith("model:")):
        yield _pack(PLAY_KEYS, {"status": f"Preparing drafter **{drafter}** (first use builds it)…"})
    run_engine = _run_engine(engine, drafter)
    if stop_requested(run_id):
        yield _pack(PLAY_KEYS, {"status": _stopped_status([]), "run_btn": end_run()})
        return
    events = _start_generation(run_engine, prompt, drafter, settings)
    trace: list[dict] = []
    # The first tokens go out without figures (they cost a few hundred ms to build and draw):
    # the draft tree and p/q follow within FIGURE_INTERVAL_S, or with the final update.
    next_figures = time.perf_counter() + FIGURE_INTERVAL_S
    stopped = False
    try:
        for event in events:
            trace.append(event)
            kind = event.get("type")
            if kind != "finish" and stop_requested(run_id):
                stopped = True
                break
            if kind == "start":
                yield _pack(
                    PLAY_KEYS,
                    {
                        "status": f"Running: {render.trace_title(trace)}",
                        "text": render.token_html(trace, running=True)
                        + render.legend_html(event.get("mode") == "baseline"),
                        "stats": render.stats_line(trace, running=True),
                        "card": "*The run summary appears here when the run ends (or when you press Stop).*",
                        "acceptance": message("Acceptance by draft position", "Shown when the run ends"),
                        "download": gr.DownloadButton(
                            value=None, interactive=False, label="⬇ Trace download (after the run)"
                        ),
                        "step": _step_slider(1, 1, interactive=False),
                        "trace": list(trace),
                    },
                )
            elif kind == "step":
                n = len(_steps(trace))
                values = {
                    "status": f"Running: pass {n}…",
                    "text": render.token_html(trace, running=True)
                    + render.legend_html(trace[0].get("mode") == "baseline"),
                    "stats": render.stats_line(trace, running=True),
                    "trace": list(trace),
                }
                began = time.perf_counter()
                if began >= next_figures:
                    values["tree"], values["pq"] = _step_figures(trace, n - 1)
                    values["tpp"] = figure("tokens_per_pass_figure", trace)
                    values["step"] = _step_slider(n, n, interactive=False)
                    cost = time.perf_counter() - began
                    next_figures = began + max(FIGURE_INTERVAL_S, cost / FIGURE_SHARE)
                yield _pack(PLAY_KEYS, values)
    except OutOfMemory as exc:  # the engine suggests smaller settings; the app keeps serving
        raise gr.Error(str(exc)) from None
    finally:
        events.close()  # stops the engine (also when Gradio closes this generator)
    index = _interesting_step(trace)
    if stopped:
        status = _stopped_status(trace)
    else:
        metrics = (trace[-1].get("metrics") if trace and trace[-1].get("type") == "finish" else None) or {}
        status = (
            f"Done: {metrics.get('new_tokens', '?')} tokens in {metrics.get('target_passes', '?')} target passes "
            f"({metrics.get('tokens_per_pass', 0):.2f} tokens/pass). The tree shows pass {index + 1}"
            f"{' (the first with a rejected draft)' if _has_rejection(trace, index) else ''}; use the slider for any "
            "other pass, or open **Step-through** for a narrated walk."
        )
    values = finished_outputs(trace, status, download=write_trace_file(trace, _session(request)), step_index=index)
    values["st_source"] = "Last run"
    values["run_btn"] = end_run()
    yield _pack(PLAY_KEYS, values)


def show_play_step(trace: list[dict] | None, step_number):
    """Slider -> tree and p/q figures of that pass."""
    n = len(_steps(trace))
    if not n:
        return gr.skip(), gr.skip()
    index = max(0, min(_as_int(step_number or 1, "step"), n) - 1)
    return _step_figures(trace, index)


EXAMPLE_SETTINGS = ["k", "topk", "num_draft_tokens", "temperature", "top_p", "top_k", "seed", "max_new_tokens"]


def _recorded_settings(prompt: str, drafter: str | None) -> dict | None:
    """Settings of the recorded trace made from this example prompt (and drafter), if there is one."""
    for name in recorded_traces():
        try:
            start = load_recorded(name)[0]
        except gr.Error:
            continue
        if start.get("prompt") == prompt and (drafter is None or start.get("drafter") == drafter):
            settings = dict(start.get("settings") or {})
            if (settings.get("topk") or 1) == 1:
                settings["num_draft_tokens"] = 0  # a chain: the budget slider's "0 = K × top-k"
            return settings
    return None


def pick_example(name: str):
    """Example dropdown -> prompt, its suggested drafter and, when the example was recorded (assets/traces),
    the settings of that recording (so Run reproduces it); otherwise the other settings stay as they are."""
    for example in load_examples():
        if example.get("name") == name:
            drafter = example.get("drafter") or None
            settings = _recorded_settings(example["prompt"], drafter) or {}
            values = [settings.get(key, gr.skip()) for key in EXAMPLE_SETTINGS]
            return (example["prompt"], drafter or gr.skip(), *values)
    return (gr.skip(),) * (2 + len(EXAMPLE_SETTINGS))


def pick_race_example(name: str):
    """Race example dropdown -> prompt, drafter, K, temperature, seed, max new tokens."""
    prompt, drafter, k, _topk, _budget, temperature, _top_p, _top_k, seed, max_new = pick_example(name)
    return prompt, drafter, k, temperature, seed, max_new


def suggest_drafter(target: str):
    """A preset target -> its suggested model drafter (others keep the current drafter)."""
    from engine.models import DEFAULT_MODEL, PRESETS

    suggestion = PRESETS.get(target, {}).get("drafter")
    if target != DEFAULT_MODEL and suggestion:
        return gr.Dropdown(value=f"model:{suggestion}")
    return gr.skip()


# --------------------------------------------------------------------------- step-through
def _trace_info(trace: list[dict], origin: str) -> str:
    start = trace[0]
    prompt = (start.get("prompt") or "(token ids)").strip().replace("\n", " ")
    if len(prompt) > 160:
        prompt = prompt[:157] + "…"
    done = "finished" if trace[-1].get("type") == "finish" else "partial (stopped early)"
    return (
        f"**{origin}** · {render.trace_title(trace)} · {len(_steps(trace))} target passes, {done}.  \n"
        f"Prompt: *{render.md_token(prompt)[1:-1] if prompt else ''}*"
    )


def position_choices(step: dict) -> tuple[list[tuple[str, int]], int | None]:
    """The positions of a pass whose p and q were recorded, as dropdown choices, and the default one."""
    nodes = {n.get("id"): n for n in step.get("nodes") or []}
    rejected_parents = {n.get("parent") for n in nodes.values() if n.get("decision") == "rejected"}
    extra = (step.get("emitted") or [{}])[-1] if step.get("emitted") else {}
    choices, default = [], None
    for i, dist in enumerate(step.get("dists") or []):
        node = dist.get("node", -1)
        if node == -1:
            label = "position 1: right after the committed text"
        else:
            info = nodes.get(node, {})
            label = f"position {(info.get('depth') or 0) + 1}: after {render.md_token(info.get('text')).strip('`')}"
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
    steps = _steps(trace)
    if not steps:
        return {
            "st_step": _step_slider(1, 1, interactive=False),
            "st_tree": message("Draft tree", "This trace has no target passes"),
            "st_pq": message("p (target) vs q (drafter)", "This trace has no target passes"),
            "st_narration": "This trace has no target passes yet.",
            "st_pos": _position_dropdown(None),
        }
    index = max(0, min(index, len(steps) - 1))
    tree, pq = _step_figures(trace, index)
    return {
        "st_step": _step_slider(len(steps), index + 1),
        "st_tree": tree,
        "st_pq": pq,
        "st_narration": render.narrate_step(trace, index),
        "st_pos": _position_dropdown(steps[index]),
    }


def show_position(trace: list[dict] | None, step_number, position):
    """Position dropdown -> p vs q at that position of the current pass."""
    steps = _steps(trace)
    if not steps or position is None:
        return gr.skip()
    index = max(0, min(_as_int(step_number or 1, "step"), len(steps)) - 1)
    return figure("pq_figure", trace, index, position=int(position))


def _validated_upload(path: str) -> list[dict]:
    from engine.trace import TraceError, load

    try:
        trace = load(path)
    except TraceError as exc:
        raise gr.Error(f"This file is not a usable SpecLens trace: {exc}") from None
    except OSError as exc:
        raise gr.Error(f"Cannot read the uploaded file: {exc.strerror or exc}") from None
    try:  # the figures need well-formed nodes too
        from visuals import validate_events
    except ImportError:
        return trace
    try:
        return validate_events(trace)
    except ValueError as exc:
        raise gr.Error(f"This file is not a usable SpecLens trace: {exc}") from None


def load_step_source(
    source: str, recorded: str, upload, last_trace: list[dict] | None, current: list[dict] | None = None
):
    """Source radio / dropdown / upload -> the trace to step through, shown at its first pass."""
    if source == "Last run":
        if last_trace and _recorded_name(last_trace):
            gr.Info("No run yet in this session, so this is the recorded run the Playground shows.")
            trace, origin = last_trace, f"Recorded trace `{_recorded_name(last_trace)}` (no run yet in this session)"
        elif not last_trace:
            gr.Warning("No run yet in this session: run something in the Playground first. Showing a recorded trace.")
            trace, origin = load_recorded(recorded or DEFAULT_TRACE), f"Recorded trace `{recorded}`"
        else:
            trace, origin = last_trace, "Your last Playground run"
    elif source == "Upload":
        if not upload:
            return _pack(
                STEP_KEYS, {"st_info": "Upload a `.json` trace (from the Playground's download button or the CLI)."}
            )
        path = upload if isinstance(upload, str) else getattr(upload, "name", None) or getattr(upload, "path", "")
        trace, origin = _validated_upload(path), f"Uploaded `{Path(path).name}`"
    else:
        trace, origin = load_recorded(recorded or DEFAULT_TRACE), f"Recorded trace `{recorded or DEFAULT_TRACE}`"
    values = step_view(trace, 0)
    values["st_trace"] = trace
    values["st_info"] = _trace_info(trace, origin)
    return _pack(STEP_KEYS, values)


def refresh_last_run(source: str, recorded: str, upload, last_trace, current):
    """Entering the Step-through tab: if it follows the last run and that run changed, reload it."""
    if source != "Last run" or not last_trace:
        return _pack(STEP_KEYS, {})
    if current and current[0].get("started_at") == last_trace[0].get("started_at") and len(current) == len(last_trace):
        return _pack(STEP_KEYS, {})
    return load_step_source(source, recorded, upload, last_trace)


def goto_step(trace: list[dict] | None, step_number, delta: int = 0):
    """Prev / Next / slider -> that pass (1-based in the UI)."""
    if not trace:
        return _pack(STEP_KEYS, {})
    try:
        number = _as_int(step_number or 1, "step")
    except gr.Error:
        number = 1
    values = step_view(trace, number - 1 + delta)
    return _pack(STEP_KEYS, values)


def initial_step_through(name: str = DEFAULT_TRACE) -> dict:
    trace = load_recorded(name)
    values = step_view(trace, 0)
    values["st_trace"] = trace
    values["st_info"] = _trace_info(trace, f"Recorded trace `{name}`")
    return values


# ------------------------------------------------------------------------------------ race
def _race_results(base: list[dict], spec: list[dict]) -> str:
    bm = base[-1].get("metrics") or {}
    sm = spec[-1].get("metrics") or {}
    b_wall, s_wall = bm.get("wall_s") or 0.0, sm.get("wall_s") or 0.0
    speedup = b_wall / s_wall if s_wall else float("nan")
    verdict = "faster" if speedup > 1.0 else "slower"
    lines = [
        f"### Measured speedup: **{speedup:.2f}×** ({verdict} than plain decoding)",
        f"baseline wall time {b_wall:.2f} s ÷ speculative wall time {s_wall:.2f} s, both measured, same machine.",
        "",
        f"| | Baseline (no drafter) | Speculative ({spec[0].get('drafter')}) |",
        "|---|---|---|",
        f"| tokens | {bm.get('new_tokens', '?')} | {sm.get('new_tokens', '?')} |",
        f"| target passes | {bm.get('target_passes', '?')} | {sm.get('target_passes', '?')} |",
        f"| tokens per pass | {bm.get('tokens_per_pass', 0):.2f} | **{sm.get('tokens_per_pass', 0):.2f}** |",
        f"| acceptance α | — | {sm.get('acceptance_rate', 0):.2f} |",
        f"| wall time | {b_wall:.2f} s | {s_wall:.2f} s |",
        f"| tokens / s | {bm.get('tokens_per_s', 0):.1f} | {sm.get('tokens_per_s', 0):.1f} |",
        f"| time drafting | — | {sm.get('draft_s', 0):.2f} s |",
    ]
    if speedup <= 1.0:
        lines.append(
            "\nFewer target passes only pay off when a pass costs much more than drafting. On a small model on a "
            "CPU, drafting and the larger verification pass can eat the gain; n-gram drafting on text that repeats "
            "the prompt (code edits, summaries) usually wins."
        )
    return "\n".join(lines)


RACE_TEXT_INTERVAL_S = 0.5  # race updates are time-based, so their overhead slows both runs alike
RACE_FIGURE_INTERVAL_S = 1.5


def run_race(
    prompt,
    drafter,
    k,
    temperature,
    seed,
    max_new_tokens,
    run_id: str = "",
    progress=gr.Progress(),  # noqa: B008 (gradio injects the tracker)
):
    """Generator: baseline then speculative decoding of the same prompt and seed, both measured for real."""
    settings = make_settings(k, 1, None, temperature, 1.0, 0, seed, max_new_tokens)
    if settings.seed is None:
        settings.seed = random.SystemRandom().randrange(2**31)  # both runs share one seed
    if drafter in (None, "", "none", "baseline"):
        raise gr.Error(
            "Choose a drafter for the speculative run (ngram, int8 or model:<id>); the baseline runs anyway."
        )
    if not REGISTRY.is_loaded("default", "auto"):
        yield _pack(RACE_KEYS, {"race_status": "Loading the model (once per server)…"})
    engine = _get_engine("default", "auto", progress)
    if isinstance(drafter, str) and (drafter.strip() == "int8" or drafter.strip().startswith("model:")):
        yield _pack(RACE_KEYS, {"race_status": f"Preparing drafter **{drafter}** (first use builds it)…"})
    spec_engine = _run_engine(engine, drafter)
    # Validate the prompt and drafter before anything runs, so a bad input fails fast.
    _start_generation(spec_engine, prompt, drafter, settings).close()
    runs: dict[str, list[dict]] = {"base": [], "spec": []}
    yield _pack(
        RACE_KEYS,
        {
            "race_status": "1/2 Baseline (no drafter)…",
            "race_base": render.token_html([], running=True),
            "race_spec": render.token_html([], empty_message="Waits for the baseline to finish…"),
            "race_plot": race_figure(None, None, drafter),
            "race_results": "*Results appear when both runs are done.*",
            "race_note": "",
        },
    )
    for phase, run_engine, spec_name in (("base", engine, "none"), ("spec", spec_engine, drafter)):
        trace = runs[phase]
        events = _start_generation(run_engine, prompt, spec_name, settings)
        next_text = next_figure = 0.0
        try:
            for event in events:
                trace.append(event)
                if stop_requested(run_id):
                    yield _pack(
                        RACE_KEYS,
                        {
                            "race_status": "■ Stopped. Nothing is measured for an unfinished race.",
                            "race_base": render.token_html(runs["base"]),
                            "race_spec": render.token_html(runs["spec"], empty_message="Not run."),
                            "race_btn": end_run(),
                        },
                    )
                    return
                now = time.perf_counter()
                if event["type"] != "step" or now < next_text:
                    continue
                next_text = now + RACE_TEXT_INTERVAL_S
                label = "1/2 Baseline (no drafter)" if phase == "base" else f"2/2 Speculative ({drafter})"
                values = {
                    "race_status": f"{label}: pass {len(_steps(trace))}…",
                    f"race_{phase}": render.token_html(trace, running=True),
                }
                if now >= next_figure:
                    values["race_plot"] = race_figure(runs["base"], runs["spec"] or None, drafter)
                    next_figure = time.perf_counter() + RACE_FIGURE_INTERVAL_S
                yield _pack(RACE_KEYS, values)
        finally:
            events.close()
    base, spec = runs["base"], runs["spec"]
    values, needs_parity = race_outcome(base, spec, drafter)
    values["race_status"] = f"Both runs done (seed {settings.seed})."
    if not needs_parity:
        values["race_btn"] = end_run()
        yield _pack(RACE_KEYS, values)
        return
    values["race_note"] = "Greedy outputs differ. Running the parity check to find out why…"
    yield _pack(RACE_KEYS, values)
    yield _pack(RACE_KEYS, {"race_note": _parity_note(engine, prompt, drafter, settings), "race_btn": end_run()})


def race_outcome(base: list[dict], spec: list[dict], drafter: str) -> tuple[dict, bool]:
    """Race outputs for two finished runs, and whether a greedy mismatch calls for the parity check."""
    same = base[-1].get("token_ids") == spec[-1].get("token_ids")
    greedy = bool(base[0].get("greedy"))
    values = {
        "race_base": render.token_html(base),
        "race_spec": render.token_html(spec) + render.legend_html(),
        "race_plot": race_figure(base, spec, drafter),
        "race_results": _race_results(base, spec),
    }
    if same:
        values["race_note"] = (
            "**Identical outputs**, token for token: speculative decoding changed the speed, not the text."
            if greedy
            else "Identical outputs (same seed)."
        )
        return values, False
    if not greedy:
        values["race_note"] = (
            "**The texts differ, as expected with temperature > 0.** Both follow the target's distribution "
            "exactly, but they consume random numbers differently (the speculative run also draws u for each "
            "draft), so the same seed leads to different samples. Set temperature to 0 for a token-for-token "
            "comparison."
        )
        return values, False
    return values, True


RECORDED_RACE = ("code-edit-baseline-greedy.json", "code-edit-ngram-greedy.json")


def initial_race() -> dict:
    """The Race tab before anyone races: a recorded real race (baseline and n-gram, same prompt and seed)."""
    try:
        base, spec = (load_recorded(name) for name in RECORDED_RACE)
    except gr.Error:
        return {}
    values, _ = race_outcome(base, spec, spec[0].get("drafter", "ngram"))
    values["race_status"] = (
        "Showing a **recorded real race** (the first example, n-gram drafter, K = 4, greedy, seed 0). "
        "Press **Race** to run it live on this machine."
    )
    values["prompt"] = base[0].get("prompt") or ""
    return values


def _parity_note(engine, prompt, drafter, settings) -> str:
    from engine.parity import parity_check

    try:
        result = next(
            parity_check(engine, [prompt], drafter=drafter, max_new_tokens=settings.max_new_tokens, k=settings.k)
        )
    except Exception as exc:  # the check itself failed: say so, keep the page alive
        log.exception("parity check failed")
        return f"Greedy outputs differ and the parity check could not run: {exc}"
    if result.get("identical"):
        return (
            "Greedy outputs differed in this race, but the parity check reproduced identical outputs; "
            "the difference came from run-to-run numerical noise."
        )
    verdict = result.get("verdict")
    top2 = ", ".join(f"{render.md_token(t[1])} ({t[2]})" for t in result.get("top2") or [])
    explanation = (
        "the two best tokens were almost tied, so rounding differences between a one-token pass and a "
        "multi-token pass flipped the choice. This is numerics, not a bug."
        if verdict == "numerical near-tie"
        else "the target clearly preferred one token; this would be a bug, please report it with the trace."
    )
    return (
        f"Greedy outputs differ from token {result.get('position')} on "
        f"(baseline {render.md_token(result.get('baseline_token'))}, speculative "
        f"{render.md_token(result.get('speculative_token'))}). **Parity check verdict: {verdict}**: top-2 logits "
        f"there were {top2}, margin {result.get('margin', 0):.4f} (tolerance {result.get('tolerance')}), so {explanation}"
    )


# ------------------------------------------------------------------------------------- API
def api_generate(
    prompt: str,
    drafter: str = "ngram",
    k: int = 4,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    max_new_tokens: int = 64,
) -> Iterator[dict]:
    """Generate text with speculative decoding on the default model (streamed, one update per target pass).

    Args:
        prompt: the user message (the chat template is applied).
        drafter: none, ngram, int8 or model:<id>.
        k: draft depth K (tokens drafted per target pass).
        temperature: 0 = greedy.
        top_p: nucleus sampling threshold in (0, 1].
        top_k: keep the top-k tokens (0 = off).
        seed: random seed; -1 = random (the seed used is returned).
        max_new_tokens: number of tokens to generate at most.

    Returns:
        While running, {"partial": true, "text" so far, "tokens", "target_passes"} after each target pass;
        at the end {"partial": false, "text", "metrics", "drafter", "seed", "stop_reason", "target"}
        (gradio_client's predict returns this last one). A dropped connection stops the run within a pass.
    """
    settings = make_settings(k, 1, None, temperature, top_p, top_k, seed, max_new_tokens)
    engine = _get_engine("default", "auto")
    run_engine = _run_engine(engine, drafter)
    events = _start_generation(run_engine, prompt, drafter, settings)
    trace: list[dict] = []
    token_ids: list[int] = []
    try:
        for event in events:
            trace.append(event)
            if event["type"] == "step":
                token_ids.extend(item["token_id"] for item in event["emitted"])
                yield {
                    "partial": True,
                    "text": engine.tokenizer.decode(token_ids, skip_special_tokens=True),
                    "tokens": len(token_ids),
                    "target_passes": event["target_passes"],
                }
    except OutOfMemory as exc:
        raise gr.Error(str(exc)) from None
    finally:
        events.close()  # also when Gradio closes this generator (client gone)
    finish = trace[-1]
    yield {
        "partial": False,
        "text": finish.get("text", ""),
        "metrics": finish.get("metrics", {}),
        "drafter": trace[0].get("drafter"),
        "seed": (trace[0].get("settings") or {}).get("seed"),
        "stop_reason": finish.get("stop_reason"),
        "target": trace[0].get("target"),
    }
