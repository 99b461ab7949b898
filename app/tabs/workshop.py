"""The Workshop tab: a guided 30-minute class in eight steps, one click each.

Each step loads its settings into the Playground (or opens the tab or lab it needs) with one click,
says what to do, and asks one question whose answer the screen then shows; the answer is behind a
fold, for checking. A teacher can run a class from it without preparing anything: every step uses
the default model and the examples in assets/examples.json (whose measured claims the tests check).
"""

from __future__ import annotations

import gradio as gr

from ..examples import EXAMPLE_DEFAULTS, EXAMPLE_SETTINGS, example_values, load_examples
from ..wiring import PRIVATE

__all__ = ["STEPS", "layout", "load_step", "wire"]

# The Playground controls a step fills, in the order load_step returns them.
PLAYGROUND_KEYS = ["prompt", "drafter", "k", "topk", "budget", "temperature", "top_p", "top_k", "seed", "max_new"]
# Playground control -> the GenerationSettings name it shows (EXAMPLE_SETTINGS' order).
CONTROL_OF = {"num_draft_tokens": "budget", "max_new_tokens": "max_new"}


def _example_named(lesson: str) -> str | None:
    return next((e["name"] for e in load_examples() if e.get("lesson") == lesson), None)


STEPS = [
    {
        "title": "1. One target pass checks many guesses",
        "tab": "playground",
        "example": "copy",
        "do": "Press **▶ Run**. Watch the coloured text: each underline run is one target pass.",
        "question": "How many tokens per target pass did this answer get, and why can the n-gram drafter guess "
        "so well here?",
        "answer": "The stats line and the run card show it (several tokens per pass, against 1.00 for plain "
        "decoding). The answer repeats code from the prompt, so prompt lookup proposes long runs the target "
        "accepts: one pass verifies them all.",
    },
    {
        "title": "2. Accept or reject: the random test u",
        "tab": "playground",
        "settings": {"drafter": "int8", "k": 4, "topk": 1, "temperature": 0.8, "seed": 7, "max_new_tokens": 48},
        "do": "Sampling at temperature 0.8 with the int8 drafter. Press **▶ Run**, then drag the pass slider to a "
        "pass with a ✗ rejected node and hover it in the tree.",
        "question": "For a rejected draft: what were p, q, min(1, p/q) and u? Why was it rejected?",
        "answer": "The hover and the p vs q chart show them: a draft is kept when u < min(1, p/q). A rejected one "
        "had u ≥ min(1, p/q), which happens most where the drafter was more confident than the target (q > p).",
    },
    {
        "title": "3. After a rejection: the residual",
        "tab": "step-through",
        "do": "The Step-through shows a recorded sampled run with a tree of drafts. Press **Next ▶** until the "
        "narration says **Resampled**.",
        "question": "Which distribution is the replacement token drawn from, and which tokens can it never be?",
        "answer": "From the residual norm(max(0, p − q)) (the purple bars in p vs q). Tokens where q ≥ p have no "
        "residual mass: they were already offered often enough as drafts. That is what makes the output exactly p.",
    },
    {
        "title": "4. Lossless: test it, do not trust it",
        "tab": "lossless",
        "do": "Press **▶ Sample** (about 3 minutes on 2 CPU cores).",
        "question": "Does speculative sampling's histogram of the first two tokens differ from the target's exact "
        "p? And the broken verifier's?",
        "answer": "The table's verdicts: the exact rule is consistent with p (its p-value is like plain "
        "sampling's); the verifier that ignores q differs from p. Speed never changes what is sampled, "
        "a shortcut in the maths does.",
    },
    {
        "title": "5. When does n-gram drafting win?",
        "tab": "playground",
        "example": "no-gain",
        "do": "Press **▶ Run** for this creative chat with the n-gram drafter, then compare with step 1.",
        "question": "Tokens per pass here vs in step 1: why so different with the same drafter?",
        "answer": "Close to 1 here: creative text repeats nothing from the prompt, so prompt lookup rarely finds "
        "anything to propose. n-gram drafting is free, but it only pays where the output copies its input "
        "(code edits, summaries that reuse wording, structured output).",
    },
    {
        "title": "6. Trees: several candidates per position",
        "tab": "playground",
        "example": "tree",
        "do": "Press **▶ Run**: the int8 drafter proposes 2 candidates per position (a tree).",
        "question": "In a pass where the first candidate at a depth was rejected, what was the second one "
        "compared against?",
        "answer": "Against the residual p′ = norm(max(0, p − q)) and q′ = q without the rejected sibling, "
        "renormalised (the hover says min(1, p_eff/q_eff)). Each sibling's test is an ordinary speculative step "
        "on what is left, so the tree stays exact while giving the target more chances per pass.",
    },
    {
        "title": "7. Tokens per pass is not speed",
        "tab": "playground",
        "example": "does-not-pay",
        "do": "Press **▶ Run**, then read the run card's time line, and try the **Race** tab with the same example.",
        "question": "This run gets several tokens per target pass. Is it faster than plain decoding? Why not?",
        "answer": "No: the example was measured slower than the baseline. Each depth of the tree costs the int8 "
        "drafter a pass of its own, and the target verifies 13 tokens at once: the speedup is E ÷ (K·c + 1), "
        "and a large draft cost c eats E. The Explain tab's calculator shows the same with its sliders.",
    },
    {
        "title": "8. Batch size, and greedy parity",
        "tab": "batch",
        "do": "Press **▶ Measure**, then open the **Parity lab** and press its button too.",
        "question": "At which batch size does speculation stop paying on this machine? Are greedy outputs with "
        "and without speculation identical?",
        "answer": "The Batch lab's title gives the batch size (a pass over K + 1 tokens per row stops being almost "
        "free once many rows share it). The Parity lab shows identical greedy outputs; where they differ, it "
        "names a numerical near-tie between the two best tokens, not a bug.",
    },
]


def _settings_of(step: dict) -> tuple[str | None, dict] | None:
    """(prompt or None, {Playground control: value}) of a step that fills the Playground."""
    if "example" in step:
        name = _example_named(step["example"])
        values = example_values(name) if name else None
        if values is None:
            return None
        settings = {key: values[key] for key in EXAMPLE_SETTINGS if key in values}
        return values["prompt"], {"drafter": values["drafter"], **settings}
    if "settings" in step:
        return None, {**EXAMPLE_DEFAULTS, **step["settings"]}
    return None


def load_step(index: int):
    """A step's button: select its tab and fill the Playground controls it sets (the rest stay as they are)."""
    step = STEPS[index]
    skip = [gr.skip()] * len(PLAYGROUND_KEYS)
    loaded = _settings_of(step)
    if loaded is None:
        return gr.Tabs(selected=step["tab"]), *skip
    prompt, settings = loaded
    by_control = {CONTROL_OF.get(key, key): value for key, value in settings.items()}
    if prompt is not None:
        by_control["prompt"] = prompt
    if by_control.get("topk", 1) == 1:
        by_control.setdefault("budget", 0)  # a chain: the budget slider's "0 = K × top-k"
    values = [by_control.get(key, gr.skip()) for key in PLAYGROUND_KEYS]
    return gr.Tabs(selected=step["tab"]), *values


INTRO = """
**A 30-minute class in eight steps.** Each step loads its settings with one click and asks one question; the
screen it opens shows the answer (open *Answer* to check). Everything runs the real default model on this
machine, so the numbers you see are measured live and differ a little from machine to machine.
"""


def layout() -> dict:
    """The tab; returns its step buttons (index -> button)."""
    buttons = {}
    with gr.Tab("Workshop", id="workshop"):
        gr.Markdown(INTRO, elem_classes=["sl-lab-text"])
        for index, step in enumerate(STEPS):
            with gr.Group(elem_classes=["sl-workshop-step"]):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=8, min_width=300):
                        gr.Markdown(f"### {step['title']}\n{step['do']}\n\n**Question:** {step['question']}")
                    with gr.Column(scale=2, min_width=160):
                        buttons[index] = gr.Button(
                            f"Load step {index + 1}", variant="primary", elem_id=f"ws-step-{index + 1}"
                        )
                with gr.Accordion("Answer", open=False):
                    gr.Markdown(step["answer"])
    return buttons


def wire(buttons: dict, tabs: gr.Tabs, play: dict) -> None:
    outputs = [tabs] + [play[key] for key in PLAYGROUND_KEYS]
    for index, button in buttons.items():
        button.click(lambda i=index: load_step(i), None, outputs, show_progress="hidden", queue=False, **PRIVATE)
