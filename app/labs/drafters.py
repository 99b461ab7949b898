"""The Drafters lab: one prompt, every available drafter run for real, compared against a baseline run with them.

The baseline (drafter none) always runs first; then each chosen drafter (and its adaptive-depth variant when
the engine's GenerationSettings has `adaptive`), one after the other on the loaded default model, each after
a short untimed warm-up. visuals.drafter_families reads the traces through engine.metrics: tokens per pass,
α, the cost c of a draft token measured against the baseline's passes, the measured speedup and the point
each drafter lands on the E / (K·c + 1) surface of the Explain lab. A drafter that fails (or that this
engine does not offer, like EAGLE before it exists) is reported in its row; the others still run.
"""

from __future__ import annotations

import functools
import logging
import time

import gradio as gr

from engine.drafters.spec import family as drafter_family
from engine.metrics import (
    DRAFT_TOKEN_COST_MEANS,
    MIN_PAIRS,
    fastest,
    run_summary,
    top_speedups,
)
from engine.tools.race import alternating_pairs, compare_pairs
from engine.trace import TraceError, load, start_event, step_events
from visuals.drafter_families import acceptance_curves_figure, comparison_rows, run_label, speedup_surface_figure

from .. import config
from ..drafter_help import single_drafters
from ..engine_access import get_engine, is_loaded, make_settings, start_generation, use_drafter
from ..examples import example_values, load_examples
from ..figure_guard import guarded
from ..inputs import number
from ..stopping import ProgressReporter, Stopped, stop_requested
from ..wiring import PRIVATE, run_stop_buttons
from .panels import lab_tab, results_plot, results_table, status_box, wire_lab_run

__all__ = [
    "DRAFTERS",
    "build_tab",
    "compare",
    "initial_outputs",
    "pick_example",
    "plan_runs",
    "recorded_run",
    "run_drafters",
]

log = logging.getLogger("speclens.app")

INPUTS = ["prompt", "drafters", "k", "max_new", "greedy"]
OUTPUTS = ["status", "table", "curves", "surface", "families"]

BASELINE = "none"
DRAFTERS = single_drafters(baseline=True)  # {spec: label}, the baseline first
ADAPTIVE_FIELD = "adaptive"  # GenerationSettings' switch for drafting depth that adapts
MAX_K = 8
MIN_NEW, MAX_NEW = 8, min(256, config.MAX_NEW_TOKENS)
DEFAULTS = {"drafters": list(DRAFTERS), "k": 4, "max_new": 64, "greedy": True}
SAMPLING_TEMPERATURE, SEED = 1.0, 0  # unticked greedy: every run samples at T = 1 from the same seed
FEW_PASSES = 8  # a baseline with fewer target passes than this gives noisy timings: the status says so
WARMUP_TOKENS = 2  # an untimed run per drafter first: caches, allocator and kernels warm for every timed run
HEADERS = [
    "drafter",
    "tokens per target pass",
    "α (accepted ÷ depths tried)",
    "c (measured: draft ms per drafted token ÷ baseline pass ms)",
    "speedup (measured: tok/s ÷ baseline tok/s)",
    "E / (K·c + 1) at these α, c (theory)",
    "tok/s",
    "note",
]

LAB_TEXT = """
**Drafters side by side: which drafter when, and why?** One prompt, the baseline and every drafter you pick,
each **run for real** on the default model, one after the other. For each drafter the lab **measures** tokens per
target pass, α (accepted drafts ÷ depths tried), the cost **c** of one draft token as a fraction of one plain
target pass (its drafting time per drafted token ÷ the baseline's mean pass time, both from the step events of
this lab run) and its **speedup** (its tokens per second ÷ the baseline's, same lab run). The first figure shows how
deep drafts survive against α^i, the curve of a drafter that keeps each draft with the same probability α; the
second puts each drafter at its measured (c, α) on the surface E / (K·c + 1) of the **Explain** lab, labelled with
what it really measured. Where the label is below the surface, the formula left something out: a pass over K + 1
tokens costs more than a pass over one.
"""

ADAPTIVE_TEXT = (
    "**+ adaptive** is the same drafter with a drafting depth that adapts: each pass stops drafting before K "
    "when the drafter judges further drafts unlikely to survive, so fewer doomed drafts are paid for; the note "
    "column gives the mean depth used and why drafting stopped."
)


def _family_texts() -> dict[str, str]:
    """{family: its paragraph} for the families the lab runs, then the adaptive variants'."""
    texts = {name: drafter_family(name).about for name in DRAFTERS if drafter_family(name).about}
    return {**texts, "adaptive": ADAPTIVE_TEXT}


# ----------------------------------------------------------------------------------------- input
def _checked(prompt, drafters, k, max_new, greedy) -> dict:
    """The lab's inputs, checked (gr.Error naming the field otherwise)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise gr.Error("Type a prompt (or pick an example): every drafter runs on it.")
    chosen = list(drafters or [])
    unknown = [d for d in chosen if d not in DRAFTERS]
    if unknown:
        raise gr.Error(f"Unknown drafter {unknown[0]!r}: choose among {', '.join(DRAFTERS)}.")
    if not [d for d in chosen if d != BASELINE]:
        raise gr.Error("Pick at least one drafter besides the baseline (ngram, suffix, int8 or eagle).")
    return {
        "prompt": prompt,
        "drafters": [d for d in DRAFTERS if d in chosen and d != BASELINE],
        "k": number(k, "K", 1, MAX_K, integer=True),
        "max_new": number(max_new, "Max new tokens", MIN_NEW, MAX_NEW, integer=True),
        "greedy": bool(greedy),
    }


def _unavailable(engine, spec: str) -> str | None:
    """Why the engine cannot give this drafter (its own message), or None when it can."""
    try:
        engine.drafter(spec).close()
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # a drafter still being built elsewhere must not take the lab down
        log.exception("building drafter %s failed", spec)
        return f"{type(exc).__name__}: {exc}"
    return None


def plan_runs(engine, drafters: list[str]) -> tuple[list[tuple[str, str, dict]], list[str]]:
    """(label, drafter spec, settings overrides) of every run, the baseline first, each drafter followed by
    its adaptive variant; and one note per thing left out, saying why."""
    plan, notes = [(BASELINE, BASELINE, {})], []
    for spec in drafters:
        missing = _unavailable(engine, spec) if spec == "eagle" else None
        if missing:
            notes.append(f"**eagle** is not run: {missing}")
            continue
        plan.append((spec, spec, {}))
        plan.append((f"{spec} + adaptive", spec, {ADAPTIVE_FIELD: True}))
    return plan, notes


def pick_example(name):
    """Example dropdown -> its prompt (every drafter runs on it, so nothing else is filled)."""
    values = example_values(name) if name else None
    return values["prompt"] if values else gr.skip()


# ------------------------------------------------------------------------------------------- run
def _timed_run(engine, prompt: str, spec: str, settings, tracker) -> list[dict]:
    """One run's events; `tracker(tokens, max)` after each pass (it raises Stopped on Stop)."""
    trace: list[dict] = []
    with start_generation(engine, prompt, spec, settings, worker=False) as events:  # every run on one device
        for event in events:
            trace.append(event)
            if event["type"] == "step":
                tracker(event["tokens_total"], settings.max_new_tokens)
    return trace


def _one_run(engine, prompt: str, spec: str, settings, tracker) -> list[dict]:
    """Build the drafter (int8 on first use), warm it up untimed, then the timed run."""
    use_drafter(engine, spec)
    warm = settings.merged({"max_new_tokens": WARMUP_TOKENS, "payload": "off"})
    with start_generation(engine, prompt, spec, warm, worker=False) as events:
        for _ in events:
            pass
    return _timed_run(engine, prompt, spec, settings, tracker)


def compare(engine, prompt: str, plan, settings, run_id: str = "", progress=None):
    """Generator: run the plan in order; yields (status, {label: trace} so far, {label: failure message})
    after each run. A drafter that fails gets its message; a failed or stopped baseline ends the comparison."""
    traces: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    for index, (label, spec, overrides) in enumerate(plan):
        yield (
            f"{index + 1}/{len(plan)} **{label}**: warming up, then {settings.max_new_tokens} tokens…",
            traces,
            failures,
        )
        tracker = ProgressReporter(progress, label, run_id, offset=index / len(plan), share=1 / len(plan))
        try:
            traces[label] = _one_run(engine, prompt, spec, settings.merged(overrides), tracker)
        except Stopped:
            yield "■ Stopped. The rows are the runs that finished.", traces, failures
            return
        except Exception as exc:  # gr.Error, ValueError, a drafter's bug: reported in its row
            if not isinstance(exc, (gr.Error, ValueError)):
                log.exception("drafters lab: %s failed", label)
            failures[label] = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            if spec == BASELINE:
                yield f"⚠ The baseline failed ({failures[label]}): nothing can be compared.", traces, failures
                return
    yield None, traces, failures


# ---------------------------------------------------------------------------------------- output
def _fmt(value, pattern: str = "{:.2f}") -> str:
    return "—" if value is None else pattern.format(value)


def _note(row: dict, base_pass_ms: float | None) -> str:
    if row["baseline"]:
        return f"what speedups are measured against; a target pass {_fmt(base_pass_ms, '{:.1f}')} ms"
    notes = []
    if row["k_used"] is not None:
        notes.append(f"mean depth used {row['k_used']:.1f} of K = {row['k']}")
    if row["stops"]:
        notes.append("stopped drafting: " + ", ".join(f"{why} ×{n}" for why, n in sorted(row["stops"].items())))
    if row["cost"] is None:
        notes.append("no draft timings: c unknown")
    return "; ".join(notes)


def _rows(traces: dict) -> dict:
    """{plan label: comparison row} (the rows of engine.metrics' numbers, in the order the runs ran)."""
    return dict(zip(traces, comparison_rows(list(traces.values())))) if traces else {}


def _table(traces: dict, failures: dict, plan) -> list[list]:
    """One row per planned run: measured numbers, or the failure message."""
    rows = _rows(traces)
    base_pass_ms = run_summary(traces[BASELINE])["mean_verify_ms"] if BASELINE in traces else None
    table = []
    for label, _spec, _overrides in plan:
        row = rows.get(label)
        if row is None:
            table.append([label, *["—"] * 6, f"✗ {failures[label]}" if label in failures else "not run"])
            continue
        table.append(
            [
                label,
                _fmt(row["tokens_per_pass"]),
                _fmt(None if row["baseline"] else row["alpha"], "{:.3f}"),
                _fmt(row["cost"], "{:.3f}"),
                _fmt(row["speedup"], "{:.2f}×"),
                _fmt(row["surface"], "{:.2f}×"),
                _fmt(row["tokens_per_s"], "{:.1f}"),
                _note(row, base_pass_ms),
            ]
        )
    return table


def _in_family(row: dict, family: str) -> bool:
    """Adaptive variants are described once, under "adaptive"; the others under their drafter's family."""
    return row["adaptive"] if family == "adaptive" else row["family"] == family and not row["adaptive"]


def _families(traces: dict) -> str:
    """Per family that ran: what its drafter reads and why it is cheap or not, with what it measured here."""
    rows = [r for r in _rows(traces).values() if not r["baseline"]]
    parts = [f"In the table, the charts and below, {DRAFT_TOKEN_COST_MEANS}, both from the run shown."] if rows else []
    texts = _family_texts()
    for name, text in texts.items():
        mine = [r for r in rows if _in_family(r, name)]
        if not mine:
            continue
        measured = "; ".join(
            f"{r['label']}: c = {_fmt(r['cost'], '{:.3f}')}, α = {r['alpha']:.2f}, "
            f"{r['tokens_per_pass']:.2f} tokens per pass, {_fmt(r['speedup'], '{:.2f}×')}"
            for r in mine
        )
        parts.append(f"{text} *Measured here*: {measured}.")
    return "\n\n".join(parts)


def _where(start: dict) -> str:
    """The machine a run's start event names: the GPU, else the CPU and its threads."""
    host = start.get("host") or {}
    return host.get("gpu") or f"{host.get('cpu', 'CPU')}, {host.get('threads', '?')} threads"


def _verdict(traces: dict, lab: dict, notes: list[str], spread: dict | None = None) -> str:
    """The lab's status after the runs: where and how they ran and, from the alternating pairs measured after
    them (``spread``: {label: engine.metrics.compare_speedups' result}), which drafter is fastest as
    engine.metrics.fastest decides it (named only when its interval clears the runner-up's; one run each is
    never a verdict)."""
    start = start_event(traces[BASELINE])
    where = _where(start)
    mode = "greedy" if lab["greedy"] else f"sampled at T = {SAMPLING_TEMPERATURE:g}, seed {SEED}"
    text = (
        f"**Done: measured now** on {start.get('target')} ({start.get('dtype')}, {where}), K = {lab['k']}, "
        f"{lab['max_new']} new tokens, {mode}; the runs one after another, each after an untimed warm-up. "
        "The table's speedups are one run each."
    )
    if spread:
        text += " " + _spread_verdict(spread)
    if len(step_events(traces[BASELINE])) < FEW_PASSES:
        text += " Few target passes: the timings are noisy, run more tokens for steadier numbers."
    return text + "".join(f"  \n{note}" for note in notes)


def _spread_verdict(spread: dict) -> str:
    """Words for the two fastest drafters' alternating pairs against the baseline."""
    parts = []
    for label, c in spread.items():
        if c.get("low") is None:
            parts.append(f"**{label}** {c['speedup']:.2f}× (too few pairs for an interval)")
            continue
        parts.append(f"**{label}** {c['speedup']:.2f}× [{c['low']:.2f}–{c['high']:.2f}]: {c['verdict']}")
    text = f"Measured again in {MIN_PAIRS} alternating pairs with the baseline each: " + "; ".join(parts) + "."
    found = fastest(spread)  # the engine's decision; the lab only words it
    if found["verdict"] == "fastest":
        text += f" Fastest on this prompt: **{found['fastest']}** (its interval clears {found['runner_up']}'s)."
    elif found["verdict"] == "no clear fastest":
        best, other = found["ranked"][0], found["runner_up"]
        text += f" No clear fastest: {best}'s and {other}'s intervals overlap on this machine."
    if found["busy"]:
        text += f" ⚠ The machine was busy ({found['busy']}): trust the intervals, not the table's single runs."
    return text


def measure_spread(engine, prompt: str, plan, traces: dict, settings, run_id: str = "") -> dict:
    """The two fastest drafters of the single runs (engine.metrics.top_speedups), each raced against the
    baseline in MIN_PAIRS alternating pairs (engine.tools.race's pairs, compared by
    engine.metrics.compare_speedups): {label: result}."""
    top = top_speedups({label: r["speedup"] for label, r in _rows(traces).items() if not r["baseline"]}, 2)
    by_label = {label: (spec, overrides) for label, spec, overrides in plan}
    quiet = settings.merged({"payload": "off"})
    results = {}
    for label in top:
        spec, overrides = by_label[label]
        pairs = []
        for base, run in alternating_pairs(engine, prompt, spec, quiet.merged(overrides), MIN_PAIRS):
            pairs.append((base, run))
            if stop_requested(run_id):
                return results
        results[label] = compare_pairs(engine, pairs)
    return results


def _outputs(status: str, traces: dict, failures: dict, plan) -> tuple:
    if not traces:
        return status, _table(traces, failures, plan), gr.skip(), gr.skip(), gr.skip()
    runs = list(traces.values())
    return (
        status,
        _table(traces, failures, plan),
        guarded("Acceptance by position", acceptance_curves_figure, runs),
        guarded("Speedup surface", speedup_surface_figure, runs),
        _families(traces),
    )


def _settings(lab: dict):
    temperature = 0.0 if lab["greedy"] else SAMPLING_TEMPERATURE
    settings = make_settings(lab["k"], 1, None, temperature, 1.0, 0, SEED, lab["max_new"])
    settings.payload = "reduced"  # every decision and timing, no top-10 lists: less time spent off the passes
    return settings


def run_drafters(prompt, drafters, k, max_new, greedy, run_id: str = "", progress=gr.Progress()):  # noqa: B008
    """Generator: the baseline then each chosen drafter on one prompt; yields (status, table rows, acceptance
    figure, surface figure, family notes) after each run. Bad input: a warning and the reason in the status."""
    skip = (gr.skip(),) * (len(OUTPUTS) - 1)
    try:
        lab = _checked(prompt, drafters, k, max_new, greedy)
        settings = _settings(lab)
    except gr.Error as exc:
        gr.Warning(exc.message)
        yield f"⚠ {exc.message}", *skip
        return
    if not is_loaded("default", "auto"):
        yield "Loading the model (once per server)…", *skip
    engine = get_engine("default", "auto", progress)
    try:
        start_generation(
            engine, lab["prompt"], BASELINE, settings, worker=False
        ).close()  # a prompt over the limit: say so now
    except gr.Error as exc:
        gr.Warning(exc.message)
        yield f"⚠ {exc.message}", *skip
        return
    plan, notes = plan_runs(engine, lab["drafters"])
    for status, traces, failures in compare(engine, lab["prompt"], plan, settings, run_id, progress):
        if status is None:
            yield _outputs(
                _verdict(traces, lab, notes) + f"  \nMeasuring the spread: the two fastest, {MIN_PAIRS} alternating "
                "pairs each with the baseline…",
                traces,
                failures,
                plan,
            )
            spread = measure_spread(engine, lab["prompt"], plan, traces, settings, run_id)
            status = _verdict(traces, lab, notes, spread)
        yield _outputs(status, traces, failures, plan)


# ------------------------------------------------------------------------------ the recorded run
# A lab run of the defaults on the first example, recorded by scripts/record_traces.py: the lab shows it
# until Run all measures one on this server (a folder, so the single-trace pickers do not list it).
RECORDED_DIR = config.TRACES_DIR / "drafters-lab"


@functools.lru_cache(maxsize=1)
def recorded_run() -> tuple[dict, list]:
    """({label: trace} in the order the runs ran, plan) of the recorded lab run; ({}, []) without one."""
    traces: dict[str, list[dict]] = {}
    try:
        for path in sorted(RECORDED_DIR.glob("*.json")):
            trace = load(path)
            traces[run_label(trace)] = trace
    except (OSError, TraceError):
        log.exception("drafters lab: the recorded run in %s cannot be read", RECORDED_DIR)
        return {}, []
    if BASELINE not in traces:
        return {}, []
    plan = [(label, start_event(t).get("drafter") or BASELINE, {}) for label, t in traces.items()]
    return traces, plan


def initial_outputs() -> tuple:
    """(status, table, curves, surface, families) the lab opens with: the recorded run, or waiting for Run all."""
    traces, plan = recorded_run()
    if not traces:
        return (
            "*Press **Run all** to run the baseline and each drafter for real, one after another.*",
            [["—"] * 7 + ["not run"]],
            None,
            None,
            "",
        )
    start = start_event(traces[BASELINE])
    settings = start.get("settings") or {}
    where = _where(start)
    when = time.strftime("%Y-%m-%d", time.gmtime(start["started_at"])) if start.get("started_at") else ""
    mode = "greedy" if not settings.get("temperature") else f"sampled at T = {settings['temperature']:g}"
    status = (
        f"**Recorded run** ({start.get('target')}, {start.get('dtype')}, {where}{', ' + when if when else ''}): "
        f"the first example, K = {settings.get('k')}, {settings.get('max_new_tokens')} new tokens, {mode}, measured "
        "when it was recorded. Press **Run all** to measure it again on this server."
    )
    return _outputs(status, traces, {}, plan)


# ---------------------------------------------------------------------------------------- layout
def _controls() -> dict:
    examples = load_examples()
    c = {}
    c["example"] = gr.Dropdown(
        [e["name"] for e in examples],
        value=None,
        label="Example prompts",
        info="Fills the prompt; every drafter runs on it.",
        elem_id="dr-example",
    )
    c["prompt"] = gr.Textbox(
        examples[0]["prompt"] if examples else "",
        lines=4,
        max_lines=12,
        label="Prompt",
        elem_id="dr-prompt",
    )
    c["run_btn"], c["stop_btn"] = run_stop_buttons("▶ Run all", "dr-run", "dr-stop")
    c["drafters"] = gr.CheckboxGroup(
        [(label, key) for key, label in DRAFTERS.items()],
        value=DEFAULTS["drafters"],
        label="Drafters",
        info="The baseline runs anyway: every speedup is measured against it. With adaptive depth in the engine, "
        "each drafter also runs with it.",
        elem_id="dr-drafters",
    )
    c["k"] = gr.Slider(1, MAX_K, DEFAULTS["k"], step=1, label="K (draft depth)", elem_id="dr-k")
    c["max_new"] = gr.Slider(MIN_NEW, MAX_NEW, DEFAULTS["max_new"], step=8, label="Max new tokens", elem_id="dr-max")
    c["greedy"] = gr.Checkbox(
        DEFAULTS["greedy"], label="Greedy", info=f"Unticked: sampled at T = {SAMPLING_TEMPERATURE:g}, seed {SEED}."
    )
    return c


def _results() -> dict:
    first_status, first_table, first_curves, first_surface, first_families = initial_outputs()
    status = status_box(first_status, "dr-status")
    widths = ["14%", "11%", "11%", "12%", "12%", "12%", "8%", "20%"]
    table = results_table(
        first_table,
        HEADERS,
        "Measured in this lab run",
        widths,
        "dr-table",
        rows=max(len(first_table), 2 * len(DRAFTERS) + 1),
    )
    curves = results_plot("How deep do drafts survive, drafter by drafter", "Press Run all", "dr-curves", first_curves)
    surface = results_plot(
        "Where each drafter lands on the speedup surface", "Press Run all", "dr-surface", first_surface
    )
    families = gr.Markdown(first_families, elem_id="dr-families")
    return {"status": status, "table": table, "curves": curves, "surface": surface, "families": families}


def _wire(c: dict, out: dict) -> None:
    wire_lab_run(c, out, run_drafters, INPUTS, OUTPUTS)
    c["example"].change(pick_example, c["example"], c["prompt"], show_progress="hidden", **PRIVATE)


def build_tab() -> gr.Tab:
    return lab_tab("Drafters lab", "drafters", LAB_TEXT, _controls, _results, _wire)
