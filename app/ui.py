"""The SpecLens page: Playground, Step-through, Race, the labs (app/labs.py) and the /generate API endpoint.

Layout only: every callback lives in `handlers` (the labs tabs: in `labs`). Initial values come from a recorded real trace
(assets/traces), so the page is never empty and needs no model until someone presses Run.
"""

from __future__ import annotations

import os
from pathlib import Path

import gradio as gr

from . import handlers as h
from . import labs, render

__all__ = ["SpecLensBlocks", "build_demo", "theme", "CSS_PATH"]

CSS_PATH = Path(__file__).resolve().parent.parent / "assets" / "style.css"
MAX_RUNS = int(os.environ.get("SPECLENS_MAX_CONCURRENT_RUNS", "2"))

INTRO = """
# SpecLens: speculative decoding, made visible
A big **target** model normally produces one token per forward pass. With **speculative decoding** a cheap
**drafter** guesses the next few tokens and the target checks all the guesses in **one** pass, keeping the ones it
agrees with. Every kept token follows the target's own distribution exactly, so the text is what the target
would have written anyway; it just needs fewer target passes. Everything below runs a real model on this
machine (SmolLM2-135M-Instruct); nothing is simulated.
"""

DRAFTER_CHOICES = [
    ("none (baseline: no drafting)", "none"),
    ("ngram (prompt lookup)", "ngram"),
    ("int8 (quantised target)", "int8"),
    ("model:SmolLM2-135M-Instruct", "model:SmolLM2-135M-Instruct"),
]
DRAFTER_INFO = (
    "Who guesses ahead. ngram copies from the prompt: free, shines when the answer repeats it. int8 is a cheaper "
    "copy of the target. model:<id> (type any Hub id) is a separate small model."
)


def theme() -> gr.themes.Base:
    """Default theme with system fonts: nothing is fetched from the internet."""
    return gr.themes.Default(
        primary_hue="blue",
        neutral_hue="slate",
        font=["ui-sans-serif", "system-ui", "Segoe UI", "Roboto", "Helvetica Neue", "Arial", "sans-serif"],
        font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "DejaVu Sans Mono", "monospace"],
    )


class SpecLensBlocks(gr.Blocks):
    """gr.Blocks whose launch() applies the SpecLens theme and stylesheet by default.

    Gradio 6 takes `theme` and `css_paths` in launch(), not in the constructor; this keeps
    `build_demo().queue(...).launch(...)` (app.py, tests, Spaces) styled without repeating them.
    """

    def launch(self, *args, **kwargs):
        kwargs.setdefault("theme", theme())
        kwargs.setdefault("css_paths", [CSS_PATH] if CSS_PATH.is_file() else None)
        kwargs.setdefault("footer_links", ["api", "gradio"])
        kwargs.setdefault("max_file_size", "20mb")  # uploads are traces; engine.trace refuses > 20 MiB too
        return super().launch(*args, **kwargs)


def _target_choices() -> list[str]:
    from engine.models import DEFAULT_MODEL, PRESETS

    return [DEFAULT_MODEL] + [name for name in PRESETS if name != DEFAULT_MODEL]


def build_demo() -> gr.Blocks:
    from engine.models import DEFAULT_MODEL

    examples = h.load_examples()
    example_names = [e["name"] for e in examples]
    recorded = h.recorded_traces()
    default_trace = h.DEFAULT_TRACE if h.DEFAULT_TRACE in recorded else (recorded[0] if recorded else None)
    init = h.initial_playground(name=default_trace) if default_trace else {}
    init_trace = init.get("trace") or []
    start = init_trace[0] if init_trace else {}
    s = start.get("settings") or {}
    init_steps = len([e for e in init_trace if e.get("type") == "step"]) or 1
    st_init = h.initial_step_through(default_trace) if default_trace else {}
    race_init = h.initial_race()

    c: dict[str, gr.components.Component] = {}
    with SpecLensBlocks(title="SpecLens: speculative decoding, made visible") as demo:
        gr.Markdown(INTRO, elem_classes=["sl-intro"])
        c["trace"] = gr.State(init_trace)
        c["st_trace"] = gr.State(st_init.get("st_trace") or [])

        with gr.Tabs():
            # ------------------------------------------------------------------ Playground
            with gr.Tab("Playground", id="playground"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=3, min_width=300, elem_classes=["sl-controls"]):
                        prompt = gr.Textbox(
                            value=start.get("prompt") or "",
                            label="Prompt",
                            lines=4,
                            max_lines=12,
                            placeholder="Ask the model something…",
                            elem_id="sl-prompt",
                        )
                        example = gr.Dropdown(
                            choices=example_names,
                            value=None,
                            label="Example prompts",
                            info="Fills the prompt and the drafter that suits it; recorded examples also restore the settings "
                            "they were recorded with.",
                            elem_id="sl-example",
                        )
                        with gr.Row():
                            run_btn = c["run_btn"] = gr.Button("▶ Run", variant="primary", elem_id="sl-run")
                            stop_btn = gr.Button("■ Stop", variant="stop", elem_id="sl-stop")
                        c["status"] = gr.Markdown(
                            init.get("status", ""), elem_id="sl-status", elem_classes=["sl-status"]
                        )
                        with gr.Accordion("Drafting", open=True):
                            drafter = gr.Dropdown(
                                choices=DRAFTER_CHOICES,
                                value=start.get("drafter") or "ngram",
                                allow_custom_value=True,
                                label="Drafter",
                                info=DRAFTER_INFO,
                                elem_id="sl-drafter",
                            )
                            k = gr.Slider(
                                1,
                                16,
                                s.get("k", 4),
                                step=1,
                                label="K (draft depth)",
                                info="Tokens guessed ahead per target pass.",
                            )
                            topk = gr.Slider(
                                1,
                                8,
                                s.get("topk", 1),
                                step=1,
                                label="Tree top-k",
                                info="Alternatives per guess: 1 = a single chain, more = a tree of candidates.",
                            )
                            budget = gr.Slider(
                                0,
                                128,
                                s.get("num_draft_tokens", 0) if s.get("topk", 1) > 1 else 0,
                                step=1,
                                label="Tree budget",
                                info="Most draft tokens per pass; 0 = K × top-k.",
                            )
                        with gr.Accordion("Sampling", open=True):
                            temperature = gr.Slider(
                                0,
                                2,
                                s.get("temperature", 0.0),
                                step=0.05,
                                label="Temperature",
                                info="0 = greedy (always the top token); higher = more random.",
                            )
                            top_p = gr.Slider(
                                0.05,
                                1,
                                s.get("top_p", 1.0),
                                step=0.05,
                                label="Top-p",
                                info="Sample only from the likeliest tokens covering this much probability; 1 = off.",
                            )
                            top_k = gr.Slider(
                                0,
                                200,
                                s.get("top_k", 0),
                                step=1,
                                label="Top-k",
                                info="Sample only from the k likeliest; 0 = off.",
                            )
                            seed = gr.Number(
                                value=s.get("seed", -1),
                                precision=0,
                                label="Seed",
                                info="Blank or -1 = random; the seed used is shown in the run summary.",
                            )
                            max_new = gr.Slider(
                                1,
                                h.MAX_NEW_TOKENS,
                                min(s.get("max_new_tokens", 64), h.MAX_NEW_TOKENS),
                                step=1,
                                label="Max new tokens",
                                info="Stop after this many tokens (or at the end of the answer).",
                                elem_id="sl-max-new",
                            )
                        with gr.Accordion("Model", open=False):
                            target = gr.Dropdown(
                                choices=_target_choices(),
                                value=DEFAULT_MODEL,
                                label="Target model",
                                info="The model whose output you get. Only the default runs offline; the "
                                "others download from the Hugging Face Hub.",
                            )
                            dtype = gr.Radio(
                                ["auto", "float32", "bfloat16"],
                                value="auto",
                                label="Precision (dtype)",
                                info="auto = bfloat16 where the hardware is fast at it, else float32.",
                            )
                    with gr.Column(scale=9, min_width=420):
                        c["stats"] = gr.HTML(init.get("stats", ""), elem_id="sl-stats")
                        c["text"] = gr.HTML(init.get("text", ""), elem_id="sl-output", min_height=90)
                        c["step"] = gr.Slider(
                            1,
                            max(init_steps, 2),
                            value=init.get("step") or init_steps,
                            step=1,
                            label=f"Inspect target pass (1–{init_steps})",
                            info="Pick any pass of the run to see its draft tree and its p vs q below.",
                            elem_id="sl-step",
                        )
                        with gr.Row(equal_height=True):  # side by side when there is room for both, else stacked
                            c["tree"] = gr.Plot(
                                init.get("tree"), label="Draft tree", show_label=False, elem_id="sl-tree", min_width=560
                            )
                            c["pq"] = gr.Plot(
                                init.get("pq"), label="p vs q", show_label=False, elem_id="sl-pq", min_width=560
                            )
                        c["tpp"] = gr.Plot(init.get("tpp"), label="Tokens per pass", show_label=False, elem_id="sl-tpp")
                        with gr.Row(equal_height=False):
                            with gr.Column(scale=1, min_width=440):
                                c["card"] = gr.Markdown(
                                    init.get("card", ""), elem_id="sl-card", elem_classes=["sl-card"]
                                )
                                c["download"] = gr.DownloadButton(
                                    "⬇ Download this trace (JSON)",
                                    value=init.get("download"),
                                    elem_id="sl-download",
                                    size="md",
                                )
                            with gr.Column(scale=1, min_width=560):
                                c["acceptance"] = gr.Plot(
                                    init.get("acceptance"), label="Acceptance", show_label=False, elem_id="sl-acc"
                                )

            # ---------------------------------------------------------------- Step-through
            with gr.Tab("Step-through", id="step-through") as step_tab:
                gr.Markdown(
                    "Walk through a run **one target pass at a time**: which tokens the drafter proposed (the tree), "
                    "how the target's probabilities **p** compare with the drafter's **q**, and, in plain words, "
                    "why each draft was accepted or rejected."
                )
                with gr.Row():
                    c["st_source"] = gr.Radio(
                        list(h.SOURCES),
                        value="Recorded trace",
                        label="Trace to explore",
                        info="Your last Playground run, a recorded real run, or a trace file you upload.",
                        elem_id="st-source",
                    )
                    st_recorded = gr.Dropdown(
                        recorded, value=default_trace, label="Recorded trace", elem_id="st-recorded"
                    )
                    st_upload = gr.File(
                        label="Upload a trace (.json)",
                        file_types=[".json"],
                        type="filepath",
                        elem_id="st-upload",
                        height=110,
                    )
                c["st_info"] = gr.Markdown(st_init.get("st_info", ""), elem_id="st-info")
                with gr.Row(equal_height=True, elem_classes=["sl-stepper"]):
                    prev_btn = gr.Button("◀ Prev", scale=0, min_width=110, elem_id="st-prev")
                    st_n = len([e for e in (st_init.get("st_trace") or []) if e.get("type") == "step"]) or 1
                    c["st_step"] = gr.Slider(
                        1,
                        max(st_n, 2),
                        value=1,
                        step=1,
                        label=f"Inspect target pass (1–{st_n})",
                        elem_id="st-step",
                        scale=1,
                    )
                    next_btn = gr.Button("Next ▶", scale=0, min_width=110, elem_id="st-next")
                with gr.Row(equal_height=False):
                    with gr.Column(min_width=480):
                        c["st_tree"] = gr.Plot(
                            st_init.get("st_tree"), label="Draft tree", show_label=False, elem_id="st-tree"
                        )
                        c["st_narration"] = gr.Markdown(
                            st_init.get("st_narration", ""), elem_id="st-narration", elem_classes=["sl-narration"]
                        )
                    with gr.Column(min_width=480):
                        c["st_pos"] = gr.Dropdown(
                            choices=st_init["st_pos"].choices if st_init.get("st_pos") else [],
                            value=st_init["st_pos"].value if st_init.get("st_pos") else None,
                            label="p vs q at position",
                            info="A pass checks the drafts position by position; pick the one to chart.",
                            elem_id="st-pos",
                        )
                        c["st_pq"] = gr.Plot(st_init.get("st_pq"), label="p vs q", show_label=False, elem_id="st-pq")

            # ------------------------------------------------------------------------ Race
            with gr.Tab("Race", id="race"):
                gr.Markdown(
                    "**Plain decoding vs speculative decoding, for real.** The same prompt and seed run twice on this "
                    "machine, one after the other: first the baseline (one token per target pass), then with the "
                    "drafter. The speedup below is measured wall-clock time, never an estimate."
                )
                with gr.Row(equal_height=False):
                    with gr.Column(scale=3, min_width=300):
                        race_prompt = gr.Textbox(
                            value=race_init.get("prompt") or (examples[0]["prompt"] if examples else ""),
                            label="Prompt",
                            lines=4,
                            max_lines=8,
                            elem_id="race-prompt",
                        )
                        race_example = gr.Dropdown(
                            choices=example_names,
                            value=None,
                            label="Example prompts",
                            info="Fills the prompt, its drafter and the settings it was recorded with.",
                            elem_id="race-example",
                        )
                        with gr.Row():
                            race_btn = c["race_btn"] = gr.Button("▶ Race", variant="primary", elem_id="race-run")
                            race_stop = gr.Button("■ Stop", variant="stop", elem_id="race-stop")
                        c["race_status"] = gr.Markdown(
                            race_init.get("race_status", ""), elem_id="race-status", elem_classes=["sl-status"]
                        )
                        with gr.Accordion("Settings", open=True):
                            race_drafter = gr.Dropdown(
                                choices=DRAFTER_CHOICES[1:],
                                value=examples[0].get("drafter", "ngram") if examples else "ngram",
                                allow_custom_value=True,
                                label="Drafter for the speculative run",
                                info=DRAFTER_INFO,
                            )
                            race_k = gr.Slider(
                                1, 16, value=4, step=1, label="K (draft depth)", info="Tokens guessed ahead per pass."
                            )
                            race_temp = gr.Slider(
                                0,
                                2,
                                value=0.0,
                                step=0.05,
                                label="Temperature",
                                info="0 = greedy: both outputs must then be identical.",
                            )
                            race_seed = gr.Number(
                                value=0, precision=0, label="Seed", info="Shared by both runs; -1 = random."
                            )
                            race_max = gr.Slider(
                                1, h.MAX_NEW_TOKENS, value=64, step=1, label="Max new tokens", elem_id="race-max"
                            )
                    with gr.Column(scale=9, min_width=420):
                        c["race_plot"] = gr.Plot(
                            race_init.get("race_plot") or h.race_figure(None, None),
                            label="Race",
                            show_label=False,
                            elem_id="race-plot",
                        )
                        with gr.Row(equal_height=False):
                            with gr.Column(min_width=260):
                                gr.Markdown("**Baseline** (no drafter: one token per target pass)")
                                c["race_base"] = gr.HTML(
                                    race_init.get("race_base") or render.token_html([], empty_message="Not run yet."),
                                    elem_id="race-base",
                                )
                            with gr.Column(min_width=260):
                                gr.Markdown("**Speculative** (colours: how each token was produced)")
                                c["race_spec"] = gr.HTML(
                                    race_init.get("race_spec") or render.token_html([], empty_message="Not run yet."),
                                    elem_id="race-spec",
                                )
                        c["race_note"] = gr.Markdown(race_init.get("race_note", ""), elem_id="race-note")
                        c["race_results"] = gr.Markdown(
                            race_init.get("race_results", "*Press **Race** to run both and measure the speedup.*"),
                            elem_id="race-results",
                        )

            # ------------------------------------------------------------------------ labs
            labs.build_explain_tab(c["trace"], MAX_RUNS)
            labs.build_lossless_tab(MAX_RUNS)
            labs.build_parity_tab(MAX_RUNS)
            labs.build_batch_tab(c["trace"], MAX_RUNS)

        # ---------------------------------------------------------------------- events
        play_inputs = [prompt, target, drafter, k, topk, budget, temperature, top_p, top_k, seed, max_new, dtype]
        play_outputs = [c[key] for key in h.PLAY_KEYS]
        step_outputs = [c[key] for key in h.STEP_KEYS]
        race_outputs = [c[key] for key in h.RACE_KEYS]
        private = {"api_visibility": "private"}

        # Run: a fresh run id first (instant), then the streamed run; Stop marks that id (see handlers).
        run_id = gr.State("")
        h.wire_run_and_stop(
            run_btn,
            stop_btn,
            run_id,
            h.run_playground,
            play_inputs,
            play_outputs,
            MAX_RUNS,
            private,
            show_progress="minimal",
        )
        c["step"].input(
            h.show_play_step,
            [c["trace"], c["step"]],
            [c["tree"], c["pq"]],
            trigger_mode="always_last",
            show_progress="hidden",
            concurrency_limit=None,
            **private,
        )
        example.input(
            h.pick_example,
            [example],
            [prompt, drafter, k, topk, budget, temperature, top_p, top_k, seed, max_new],
            show_progress="hidden",
            queue=False,
            **private,
        )
        target.input(h.suggest_drafter, [target], [drafter], show_progress="hidden", queue=False, **private)

        st_inputs = [c["st_source"], st_recorded, st_upload, c["trace"], c["st_trace"]]
        c["st_source"].input(h.load_step_source, st_inputs, step_outputs, concurrency_limit=None, **private)
        st_recorded.input(
            lambda *args: (gr.Radio(value="Recorded trace"), *h.load_step_source("Recorded trace", *args[1:])),
            st_inputs,
            [c["st_source"], *step_outputs],
            concurrency_limit=None,
            **private,
        )
        st_upload.upload(
            lambda *args: (gr.Radio(value="Upload"), *h.load_step_source("Upload", *args[1:])),
            st_inputs,
            [c["st_source"], *step_outputs],
            concurrency_limit=None,
            **private,
        )
        step_tab.select(
            h.refresh_last_run, st_inputs, step_outputs, show_progress="hidden", concurrency_limit=None, **private
        )
        prev_btn.click(
            lambda t, n: h.goto_step(t, n, -1),
            [c["st_trace"], c["st_step"]],
            step_outputs,
            concurrency_limit=None,
            **private,
        )
        next_btn.click(
            lambda t, n: h.goto_step(t, n, +1),
            [c["st_trace"], c["st_step"]],
            step_outputs,
            concurrency_limit=None,
            **private,
        )
        c["st_step"].input(
            h.goto_step,
            [c["st_trace"], c["st_step"]],
            step_outputs,
            trigger_mode="always_last",
            show_progress="hidden",
            concurrency_limit=None,
            **private,
        )

        c["st_pos"].input(
            h.show_position,
            [c["st_trace"], c["st_step"], c["st_pos"]],
            [c["st_pq"]],
            show_progress="hidden",
            concurrency_limit=None,
            **private,
        )

        race_id = gr.State("")
        h.wire_run_and_stop(
            race_btn,
            race_stop,
            race_id,
            h.run_race,
            [race_prompt, race_drafter, race_k, race_temp, race_seed, race_max],
            race_outputs,
            MAX_RUNS,
            private,
            show_progress="minimal",
        )
        race_example.input(
            h.pick_race_example,
            [race_example],
            [race_prompt, race_drafter, race_k, race_temp, race_seed, race_max],
            show_progress="hidden",
            queue=False,
            **private,
        )

        gr.api(h.api_generate, api_name="generate", concurrency_limit=MAX_RUNS, concurrency_id="model-runs")
    return demo
