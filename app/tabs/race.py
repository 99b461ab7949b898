"""The Race tab: plain decoding against speculative decoding, the same prompt and seed, both measured.

The baseline runs first, then the speculative decoder, one after the other on the same machine;
the speedup shown is measured (each run's tokens per second, from its wall-clock time). With greedy decoding both texts should be identical:
when they are not, the parity check (engine.tools.parity) says whether a numerical near-tie or a real
mismatch caused it.
"""

from __future__ import annotations

import logging
import time

import gradio as gr

from engine.metrics import MIN_PAIRS, measured_speedup, run_summary
from engine.tools.race import alternating_pairs, compare_pairs
from engine.trace import step_events
from visuals.lab_figures import race_figure

from .. import render
from ..config import MAX_NEW_TOKENS
from ..drafter_help import drafter_choices, drafter_info
from ..engine_access import builds_on_first_use, get_engine, is_loaded, make_settings, start_generation, use_drafter
from ..examples import example_dropdown, example_values, load_examples
from ..inputs import random_seed
from ..stopping import stop_requested
from ..traces import load_recorded
from ..wiring import PRIVATE, end_run, pack, run_stop_buttons, wire_run_and_stop
from ..zerogpu import measured_on

__all__ = [
    "RACE_KEYS",
    "initial_race",
    "layout",
    "parity_note",
    "RACE_CLEARED",
    "cleared_race",
    "pick_race_example",
    "race_outcome",
    "run_race",
    "wire",
]

log = logging.getLogger("speclens.app")

RACE_KEYS = ["race_status", "race_base", "race_spec", "race_plot", "race_results", "race_note", "race_btn"]
RACE_INPUTS = [
    "race_prompt",
    "race_drafter",
    "race_k",
    "race_topk",
    "race_budget",
    "race_temp",
    "race_seed",
    "race_max",
]
RACE_TEXT_INTERVAL_S = 0.5  # race updates are time-based, so their overhead slows both runs alike
RACE_FIGURE_INTERVAL_S = 1.5
RECORDED_RACE = ("code-edit-baseline-greedy.json", "code-edit-ngram-greedy.json")
NOT_RUN = "Not run yet."
BASELINE_LABEL = "1/2 Baseline (no drafter)"


# --------------------------------------------------------------------------------------- results
VERDICT_WORDS = {
    "faster": "faster than plain decoding",
    "slower": "slower than plain decoding",
    "no clear difference": "no clear difference: the spread includes 1×, or the difference is under 5%",
    "too few pairs": "too few pairs for a verdict",
}


def _verdict_words(c: dict) -> str:
    """The verdict in words; "no clear difference" names the reason that applies (the spread reaching 1×, or a
    difference under the 5% that counts), not both."""
    if c["verdict"] != "no clear difference" or c.get("low") is None:
        return VERDICT_WORDS[c["verdict"]]
    if c["low"] <= 1.0 <= c["high"]:
        return f"no clear difference: the spread, {c['low']:.2f}× – {c['high']:.2f}×, includes 1×"
    return "no clear difference: the difference is under 5%"


def _verdict_lines(comparison: dict | None, one_pair: float) -> list[str]:
    """The headline: the verdict of the alternating pairs (engine.metrics.compare_speedups), never of one pair."""
    if comparison is None or comparison.get("speedup") is None:
        return [
            f"### Measured speedup of this pair: **{one_pair:.2f}×**",
            "One baseline run and one speculative run measure the machine as much as the method: no verdict "
            "from a single pair (a live race runs alternating pairs and gives one only when their spread allows).",
        ]
    c = comparison
    lines = [
        f"### Measured speedup: **{c['speedup']:.2f}×** ({_verdict_words(c)})",
    ]
    if c["low"] is not None:
        lines.append(
            f"Median of {c['pairs']} alternating pairs ({', '.join(f'{r:.2f}' for r in c['ratios'])}); with "
            f"probability ≥ {1 - c['level']:.0%} this machine's median ratio lies in "
            f"**{c['low']:.2f}× – {c['high']:.2f}×**."
        )
    if c.get("note"):
        lines.append(f"No verdict: {c['note']}.")
    if c.get("implied_speedup") is not None:
        lines.append(
            f"What the measured pass costs and tokens per pass imply: **{c['implied_speedup']:.2f}×** "
            "(target passes and drafting only; wall-clock also counts the prompt and the loop)."
        )
    if c.get("ceiling") is not None:
        lines.append(
            f"The ceiling: {c['ceiling']:.2f} tokens per pass against the baseline's 1 — a speculative pass "
            "costs at least a plain one, so no measurement above that is speculation's doing."
        )
    busy = c.get("busy") or {}
    if busy.get("busy"):
        lines.append(
            f"⚠ **This machine was busy during the race**: {busy['reason']}. Other work (other visitors) "
            "shares its cores; the spread above already counts that, so trust the interval, not one pair."
        )
    return lines


def _race_results(base: list[dict], spec: list[dict], comparison: dict | None = None, recorded: str = "") -> str:
    b, s = run_summary(base), run_summary(spec)
    speedup = measured_speedup(b, s) or float("nan")
    lines = [
        *(
            [f"**A recorded race ({recorded})**, not measured on this machine: press **Race** to measure it here."]
            if recorded
            else []
        ),
        *_verdict_lines(comparison, speedup),
        "",
        f"| | Baseline (no drafter) | Speculative ({s['drafter']}) |",
        "|---|---|---|",
        f"| tokens | {b['new_tokens']} | {s['new_tokens']} |",
        f"| target passes | {b['target_passes']} | {s['target_passes']} |",
        f"| tokens per pass | {b['tokens_per_pass']:.2f} | **{s['tokens_per_pass']:.2f}** |",
        f"| α (accepted ÷ depths tried) | — | {s['position_acceptance']:.2f} |",
        f"| wall time | {b['wall_s']:.2f} s | {s['wall_s']:.2f} s |",
        f"| tokens / s | {b['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} |",
        f"| time drafting | — | {s['draft_s']:.2f} s |",
        "",
        "*The table is the streamed pair: the two runs drawn above, one after the other, "
        + (f"{recorded}" if recorded else measured_on(base[0].get("device") if base else None))
        + ". One pair, not a verdict"
        + (
            f": its tokens/s ratio, {speedup:.2f}×, is one more pair, run before the alternating pairs and not "
            "counted in them; the verdict is their median above.*"
            if comparison and comparison.get("speedup") is not None
            else ".*"
        ),
    ]
    verdict = (comparison or {}).get("verdict")
    if verdict in ("slower", "no clear difference"):  # the pairs' verdict, never one pair's ratio
        lines.append(
            "\nFewer target passes only pay off when a pass costs much more than drafting. On a small model on a "
            "CPU, drafting and the larger verification pass can eat the gain; n-gram drafting on text that repeats "
            "the prompt (code edits, summaries) usually wins."
        )
    return "\n".join(lines)


def race_outcome(
    base: list[dict], spec: list[dict], drafter: str, comparison: dict | None = None, recorded: str = ""
) -> tuple[dict, bool]:
    """Race outputs for two finished runs (and the alternating pairs measured after them, when there are),
    and whether a greedy mismatch calls for the parity check. recorded: where and when a recorded race ran
    (render.recorded_on), said in its chart's title and its results; "" for a race run now."""
    same = base[-1].get("token_ids") == spec[-1].get("token_ids")
    greedy = bool(base[0].get("greedy"))
    values = {
        "race_base": render.token_html(base),
        "race_spec": render.token_html(spec) + render.legend_html(),
        "race_plot": race_figure(base, spec, drafter, recorded),
        "race_results": _race_results(base, spec, comparison, recorded),
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


def initial_race() -> dict:
    """The Race tab before anyone races: a recorded real race (baseline and n-gram, same prompt and seed)."""
    try:
        base, spec = (load_recorded(name) for name in RECORDED_RACE)
    except gr.Error:
        return {}
    values, _ = race_outcome(base, spec, spec[0].get("drafter", "ngram"), recorded=render.recorded_on(spec))
    values["race_status"] = (
        f"Showing a **recorded real race**: {render.recorded_where(spec)}. "
        "Press **Race** to run it live on this machine; live numbers on another machine, or a busy one, differ."
    )
    values["prompt"] = base[0].get("prompt") or ""
    # The controls show the recorded race's own settings, so that pressing Race reruns what is on screen.
    recorded = spec[0].get("settings") or {}
    values["controls"] = {
        "race_drafter": spec[0].get("drafter", "ngram"),
        "race_k": recorded.get("k", 4),
        "race_topk": (spec[0].get("tree") or {}).get("topk", 1),
        "race_budget": 0,
        "race_temp": recorded.get("temperature", 0.0),
        "race_seed": recorded.get("seed", 0),
        "race_max": recorded.get("max_new_tokens", 64),
    }
    return values


def _explain_divergence(result: dict) -> str:
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


def parity_note(engine, prompt, drafter, settings) -> str:
    """Why two greedy outputs differed, from the parity check on the same prompt and settings."""
    from engine.tools.parity import parity_check

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
    return _explain_divergence(result)


# ------------------------------------------------------------------------------------------- run
def _stopped(runs: dict) -> dict:
    return {
        "race_status": "■ Stopped. Nothing is measured for an unfinished race.",
        "race_base": render.token_html(runs["base"]),
        "race_spec": render.token_html(runs["spec"], empty_message="Not run."),
        "race_btn": end_run(),
    }


def _run_phase(engine, phase: str, prompt, drafter: str, settings, runs: dict, run_id: str):
    """One of the two runs (phase "base" or "spec"), streamed; returns True when Stop ended the race."""
    trace = runs[phase]
    label = BASELINE_LABEL if phase == "base" else f"2/2 Speculative ({drafter})"
    next_text = next_figure = 0.0
    # worker=False: on ZeroGPU too, both streamed runs and the pairs after them run on this CPU engine.
    spec = drafter if phase == "spec" else "none"
    with start_generation(engine, prompt, spec, settings, worker=False) as events:
        for event in events:
            trace.append(event)
            if stop_requested(run_id):
                yield pack(RACE_KEYS, _stopped(runs))
                return True
            now = time.perf_counter()
            if event["type"] != "step" or now < next_text:
                continue
            next_text = now + RACE_TEXT_INTERVAL_S
            values = {
                "race_status": f"{label}: pass {len(step_events(trace))}…",
                f"race_{phase}": render.token_html(trace, running=True),
            }
            if now >= next_figure:
                values["race_plot"] = race_figure(runs["base"], runs["spec"] or None, drafter)
                next_figure = time.perf_counter() + RACE_FIGURE_INTERVAL_S
            yield pack(RACE_KEYS, values)
    return False


def _measure_pairs(engine, prompt, drafter: str, settings, runs: dict, run_id: str):
    """After the streamed pair: MIN_PAIRS more pairs, alternating which side runs first, measured quietly
    (engine.tools.race); returns their comparison, or None when Stop ended the race."""
    measured = []
    for base, spec in alternating_pairs(engine, prompt, drafter, settings, MIN_PAIRS):
        measured.append((base, spec))
        if stop_requested(run_id):
            yield pack(RACE_KEYS, _stopped(runs))
            return None
        yield pack(
            RACE_KEYS,
            {
                "race_status": f"Measuring the spread: pair {len(measured)} of {MIN_PAIRS} "
                "(baseline and speculative back to back, alternating which goes first)…"
            },
        )
    return compare_pairs(engine, measured)


def _prepare(drafter, prompt, settings, progress):
    """Load the model, build the drafter and check the prompt before anything runs; yields status updates,
    returns the engine."""
    if drafter in (None, "", "none", "baseline"):
        raise gr.Error(
            "Choose a drafter for the speculative run (ngram, suffix, int8, eagle or model:<id>); the baseline runs anyway."
        )
    if not is_loaded("default", "auto"):
        yield pack(RACE_KEYS, {"race_status": "Loading the model (once per server)…"})
    engine = get_engine("default", "auto", progress)
    if builds_on_first_use(drafter):
        yield pack(RACE_KEYS, {"race_status": f"Preparing drafter **{drafter}** (first use builds it)…"})
    use_drafter(engine, drafter)
    start_generation(engine, prompt, drafter, settings, worker=False).close()  # a bad prompt fails now
    return engine


def run_race(
    prompt,
    drafter,
    k,
    topk,
    budget,
    temperature,
    seed,
    max_new_tokens,
    run_id: str = "",
    progress=gr.Progress(),  # noqa: B008 (gradio injects the tracker)
):
    """Generator: baseline then speculative decoding of the same prompt and seed, both measured for real."""
    settings = make_settings(k, topk, budget, temperature, 1.0, 0, seed, max_new_tokens)
    if settings.seed is None:
        settings.seed = random_seed()  # both runs share one seed
    engine = yield from _prepare(drafter, prompt, settings, progress)
    runs: dict[str, list[dict]] = {"base": [], "spec": []}
    yield pack(
        RACE_KEYS,
        {
            "race_status": f"{BASELINE_LABEL}…",
            "race_base": render.token_html([], running=True),
            "race_spec": render.token_html([], empty_message="Waits for the baseline to finish…"),
            "race_plot": race_figure(None, None, drafter),
            "race_results": "*Results appear when both runs are done.*",
            "race_note": "",
        },
    )
    for phase in ("base", "spec"):
        if (yield from _run_phase(engine, phase, prompt, drafter, settings, runs, run_id)):
            return
    comparison = yield from _measure_pairs(engine, prompt, drafter, settings, runs, run_id)
    if comparison is None:
        return
    values, needs_parity = race_outcome(runs["base"], runs["spec"], drafter, comparison)
    values["race_status"] = f"Both runs done (seed {settings.seed})."
    if not needs_parity:
        values["race_btn"] = end_run()
        yield pack(RACE_KEYS, values)
        return
    values["race_note"] = "Greedy outputs differ. Running the parity check to find out why…"
    yield pack(RACE_KEYS, values)
    yield pack(RACE_KEYS, {"race_note": parity_note(engine, prompt, drafter, settings), "race_btn": end_run()})


# What loading an example clears: the race shown so far (a recorded one, or the last run) belongs to other
# settings, so none of it stays under the new prompt.
RACE_CLEARED = ["race_status", "race_base", "race_spec", "race_plot", "race_results", "race_note"]


def cleared_race(name: str) -> dict:
    """{output: value} that empties the race shown, saying what was loaded and to press Race."""
    return {
        "race_status": f"Loaded *{name}*: press **▶ Race** to run it on this machine.",
        "race_base": render.token_html([], empty_message=NOT_RUN),
        "race_spec": render.token_html([], empty_message=NOT_RUN),
        "race_plot": race_figure(None, None),
        "race_results": "*Press **Race** to run both and measure the speedup.*",
        "race_note": "",
    }


def pick_race_example(name: str):
    """Race example dropdown -> prompt, drafter, K, tree topk and budget, temperature, seed, max new tokens; the
    race shown so far cleared (RACE_CLEARED)."""
    values = race_example_values(name)
    if values is None:
        return (gr.skip(),) * (len(RACE_INPUTS) + len(RACE_CLEARED))
    values = {**values, **cleared_race(name)}
    return tuple(values.get(key, gr.skip()) for key in [*RACE_INPUTS, *RACE_CLEARED])


def race_example_values(name: str) -> dict | None:
    """An example's values for the Race controls ({control: value}; None for an unknown example)."""
    values = example_values(name)
    if values is None:
        return None
    keys = {"race_k": "k", "race_topk": "topk", "race_budget": "num_draft_tokens", "race_temp": "temperature"}
    keys |= {"race_seed": "seed", "race_max": "max_new_tokens"}
    out = {"race_prompt": values["prompt"], "race_drafter": values["drafter"] or gr.skip()}
    return out | {control: values[key] for control, key in keys.items() if key in values}


# ---------------------------------------------------------------------------------------- layout
def _controls(c: dict, init: dict, examples: list[dict]) -> None:
    c["race_prompt"] = gr.Textbox(
        value=init.get("prompt") or (examples[0]["prompt"] if examples else ""),
        label="Prompt",
        lines=4,
        max_lines=8,
        elem_id="race-prompt",
    )
    c["race_example"] = example_dropdown("race-example")
    start = init.get("controls") or {}
    c["race_btn"], c["race_stop"] = run_stop_buttons("▶ Race", "race-run", "race-stop")
    c["race_status"] = gr.Markdown(init.get("race_status", ""), elem_id="race-status", elem_classes=["sl-status"])
    with gr.Accordion("Settings", open=True, elem_classes=["sl-settings"]):
        c["race_drafter"] = gr.Dropdown(
            choices=drafter_choices(vllm=False, baseline=False),
            value=start.get("race_drafter") or (examples[0].get("drafter", "ngram") if examples else "ngram"),
            allow_custom_value=True,
            label="Drafter for the speculative run",
            info=drafter_info(),
            elem_id="race-drafter",
        )
        c["race_k"] = gr.Slider(
            1, 16, value=start.get("race_k", 4), step=1, label="K (draft depth)", info="Tokens guessed ahead per pass."
        )
        with gr.Row():
            c["race_topk"] = gr.Slider(
                1,
                8,
                value=start.get("race_topk", 1),
                step=1,
                label="Tree top-k",
                info="1 = a chain",
                min_width=140,
                elem_id="race-topk",
            )
            c["race_budget"] = gr.Slider(
                0,
                128,
                value=start.get("race_budget", 0),
                step=1,
                label="Tree budget",
                info="0 = K × top-k",
                min_width=140,
            )
        c["race_temp"] = gr.Slider(
            0,
            2,
            value=start.get("race_temp", 0.0),
            step=0.05,
            label="Temperature",
            info="0 = greedy: both outputs are then identical, up to rare numerical near-ties (see the Parity lab).",
        )
        c["race_seed"] = gr.Number(
            value=start.get("race_seed", 0), precision=0, label="Seed", info="Shared by both runs; -1 = random."
        )
        c["race_max"] = gr.Slider(
            1, MAX_NEW_TOKENS, value=start.get("race_max", 64), step=1, label="Max new tokens", elem_id="race-max"
        )


def _outputs(c: dict, init: dict) -> None:
    c["race_plot"] = gr.Plot(
        init.get("race_plot") or race_figure(None, None), label="Race", show_label=False, elem_id="race-plot"
    )
    with gr.Row(equal_height=False):
        with gr.Column(min_width=260):
            gr.Markdown("**Baseline** (no drafter: one token per target pass)")
            c["race_base"] = gr.HTML(
                init.get("race_base") or render.token_html([], empty_message=NOT_RUN), elem_id="race-base"
            )
        with gr.Column(min_width=260):
            gr.Markdown("**Speculative** (colours: how each token was produced)")
            c["race_spec"] = gr.HTML(
                init.get("race_spec") or render.token_html([], empty_message=NOT_RUN), elem_id="race-spec"
            )
    c["race_note"] = gr.Markdown(init.get("race_note", ""), elem_id="race-note")
    c["race_results"] = gr.Markdown(
        init.get("race_results", "*Press **Race** to run both and measure the speedup.*"), elem_id="race-results"
    )


def layout(init: dict) -> dict:
    """The Race tab showing `init` (initial_race: a recorded race); returns its components by name."""
    c: dict = {}
    with gr.Tab("Race", id="race"):
        gr.Markdown(
            "**Plain decoding vs speculative decoding, for real.** The same prompt and seed run twice on this "
            "machine, one after the other: first the baseline (one token per target pass), then with the "
            "drafter. Then five more pairs, measured quietly, alternating which side goes first: the speedup below "
            "is their median with its spread (tokens per second of each run), and it says faster or slower only "
            "when the spread excludes 1× by 5% or more."
        )
        with gr.Row(equal_height=False, elem_classes=["sl-results-first"]):
            with gr.Column(scale=3, min_width=300, elem_classes=["sl-controls"]):
                _controls(c, init, load_examples())
            with gr.Column(scale=9, min_width=420, elem_classes=["sl-outputs"]):
                _outputs(c, init)
    return c


def wire(c: dict) -> None:
    inputs = [c[key] for key in RACE_INPUTS]
    outputs = [c[key] for key in RACE_KEYS]
    wire_run_and_stop(c["race_btn"], c["race_stop"], run_race, inputs, outputs, show_progress="minimal")
    cleared = [c[key] for key in RACE_CLEARED]
    c["race_example"].input(
        pick_race_example, [c["race_example"]], inputs + cleared, show_progress="hidden", queue=False, **PRIVATE
    )
    # An edited prompt is no longer the example: the picker lets go of its name.
    c["race_prompt"].input(lambda: None, None, [c["race_example"]], show_progress="hidden", queue=False, **PRIVATE)
