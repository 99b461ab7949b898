"""The Workshop tab: a guided 30-minute class in ten steps, one click each.

Each step's button opens the tab it needs and loads everything the step names there: the whole set of
Playground controls with the prompt (an example's, or the step's own), the recorded trace in the
Step-through, or the example in the Race, tree settings included. Nothing of an earlier step stays, so
the steps work when followed in order (tests/test_browser.py follows them). Each step asks one question
whose answer the screen then shows; the answer is behind a fold, for checking. A teacher can run a class
from it without preparing anything: every step uses the default model and the examples in
assets/examples.json (whose measured claims the tests check).
"""

from __future__ import annotations

import gradio as gr

from ..examples import EXAMPLE_DEFAULTS, EXAMPLE_SETTINGS, example_note, example_values, load_examples
from ..labs import lossless, shortcuts
from ..wiring import PRIVATE, pack
from .playground import PLAY_INPUTS, loaded_outputs
from .race import RACE_CLEARED, RACE_INPUTS, cleared_race, race_example_values
from .step_through import STEP_KEYS, load_step_source

__all__ = ["STEPS", "layout", "load_step", "step_values", "wire"]

# Steps 4 and 5 promise the labs' own recorded durations (with their machine and date), as the labs show them.
LOSSLESS_TIME = lossless.RECORDED_TIME
SHORTCUTS_TIME = shortcuts.RECORDED_TIME


def _recorded(lesson: str) -> str:
    """An example's recorded speedup with its machine and date, as the examples file has it."""
    m = next((e.get("measured") or {} for e in load_examples() if e.get("lesson") == lesson), {})
    if m.get("speedup") is None:
        return "no recorded figure"
    return (
        f"{m['speedup']:.2f}× recorded on a {m.get('threads', '?')}-core {m.get('cpu', '?')}, {m.get('recorded', '?')}"
    )


STEPS = [
    {
        "title": "1. One target pass checks many guesses",
        "tab": "playground",
        "example": "copy",
        "do": "This loads the example *Code edit: n-gram copies the code* into the Playground. Press **▶ Run**. "
        "Watch the coloured text: each underlined run of tokens is one target pass. (Compare the answer with the "
        "prompt too: did the model do what it was asked?)",
        "question": "How many tokens per target pass did this answer get, and why can the n-gram drafter guess "
        "so well here?",
        "answer": "The stats line and the run card show it (several tokens per pass, against 1.00 for plain "
        "decoding). The answer repeats code from the prompt, so prompt lookup proposes long runs the target "
        "accepts: one pass verifies them all. Look closely: this small model (135M parameters) answers with the "
        "function copied unchanged and forgets the docstring, which is why nearly every draft is accepted. A larger "
        "model would add the docstring and copy the rest the same way: the unchanged lines of an edit are where "
        "prompt lookup pays, the new lines cost a pass each.",
    },
    {
        "title": "2. Accept or reject: the random test u",
        "tab": "playground",
        "prompt": "Tell me a short story about a lighthouse keeper and a storm.",
        "settings": {"drafter": "int8", "k": 4, "topk": 1, "temperature": 0.8, "seed": 7, "max_new_tokens": 48},
        "do": "This loads a story prompt, sampled at temperature 0.8 with the int8 drafter. Press **▶ Run**, then "
        "drag the pass slider to a pass whose tree has a ✗ rejected node and hover (or tap) that node.",
        "question": "For a rejected draft: what were p, q, min(1, p/q) and u? Why was it rejected?",
        "answer": "The hover and the p vs q chart show them: a draft is kept when u < min(1, p/q). A rejected one "
        "had u ≥ min(1, p/q), which happens most where the drafter was more confident than the target (q > p).",
    },
    {
        "title": "3. After a rejection: the residual",
        "tab": "step-through",
        "trace": "chat-int8-tree-sampling.json",
        "do": "This opens the recorded sampled chat with a tree of int8 drafts in the Step-through. Press "
        "**Next ▶** until the narration says **Resampled** (pass 7), then look at p vs q below it.",
        "question": "Which distribution is the replacement token drawn from, and which tokens can it never be?",
        "answer": "From the residual norm(max(0, p − q)): the orange hatched bars labelled *residual* in p vs q "
        "(p is pink, q blue dotted). Tokens where q ≥ p have no residual mass: they were already offered often "
        "enough as drafts. That is what makes the output exactly p.",
    },
    {
        "title": "4. Lossless: test it, do not trust it",
        "tab": "lossless",
        "do": f"Press **▶ Sample** with the lab's settings as they open (300 samples per sampler: {LOSSLESS_TIME}; "
        "the lab's status says how long its runs took on this server once one has run).",
        "question": "Does speculative sampling's histogram of the first two tokens differ from the target's exact "
        "p? And the broken verifier's?",
        "answer": "The table's verdicts: the exact rule is consistent with p (its p-value is like plain "
        "sampling's); the verifier that ignores q differs from p. Speed never changes what is sampled, "
        "a shortcut in the maths does.",
    },
    {
        "title": "5. Shortcuts: what a lossy verifier buys, and what it costs",
        "tab": "shortcuts",
        "do": f"Press **▶ Sample** with the lab's settings as they open (8 rules × 600 samples: {SHORTCUTS_TIME}; "
        "the lab's status says how long its runs took on this server once one has run).",
        "question": "Which rules keep more drafts per target pass than the exact rule with the same drafter, and "
        "which of them still sample the target's p?",
        "answer": "The table and the chart: the exact rule and block verification stay consistent with p (their "
        "distance from p is the noise of 600 samples). Every shortcut differs from p. The static ensemble buys the "
        "most tokens per pass with the eagle head, and pays for it with samples far from p (it outputs "
        "w·p + (1 − w)·q, even tokens p never gives); dropping q or matching greedily at T > 0 does not even buy "
        "tokens here, since they reject good drafts too. A shortcut's gain is never free, and only a test like "
        "this one sees its cost.",
    },
    {
        "title": "6. When does n-gram drafting win?",
        "tab": "playground",
        "example": "no-gain",
        "do": "This loads the example *Open chat with n-gram: nothing to copy, no gain*. Press **▶ Run**, then "
        "compare its tokens per pass with step 1's.",
        "question": "Tokens per pass here vs in step 1: why so different with the same drafter?",
        "answer": "Close to 1 here: creative text repeats nothing from the prompt, so prompt lookup rarely finds "
        "anything to propose. n-gram drafting is free, but it only pays where the output copies its input "
        "(code edits, summaries that reuse wording, structured output).",
    },
    {
        "title": "7. Trees: several candidates per position",
        "tab": "playground",
        "example": "tree",
        "do": "This loads the example *Sampled chat with a tree of int8 drafts*: the int8 drafter proposes 2 "
        "candidates per position. Press **▶ Run** and find a pass whose tree has two siblings at one depth.",
        "question": "In a pass where the first candidate at a depth was rejected, what was the second one "
        "compared against?",
        "answer": "Against the residual p′ = norm(max(0, p − q)) and q′ = q without the rejected sibling, "
        "renormalised (the hover says min(1, p_eff/q_eff)). Each sibling's test is an ordinary speculative step "
        "on what is left, so the tree stays exact while giving the target more chances per pass.",
    },
    {
        "title": "8. Tokens per pass is not speed",
        "tab": "race",
        "example": "does-not-pay",
        "do": "This loads the example *Wide int8 tree: more tokens per pass, yet slower* into the **Race**, tree "
        "settings included. Press **▶ Race**: the baseline and the tree run back to back, then five more "
        "pairs are measured.",
        "question": "The tree gets several tokens per target pass. Is it faster than plain decoding? Why not?",
        "answer": "The race's table shows about 7 tokens per pass, yet its verdict is *slower* "
        f"({_recorded('does-not-pay')}; on a busy machine, slower or no clear difference). Each depth of the tree costs the "
        "int8 drafter a pass of its own, and the target verifies 49 tokens at once: the speedup is "
        "E ÷ (K·c + 1) at best, and a large draft cost c eats E. The Explain tab's calculator shows the same.",
    },
    {
        "title": "9. Can a cheaper model drafter pay on open chat?",
        "tab": "race",
        "example": "model-drafter",
        "do": "This loads the example *Explain a fridge: q4 self-drafts guess new text that n-gram cannot* into the "
        "**Race**: the target's own weights in 4 bits draft 6 tokens a pass. Press **▶ Race**: the baseline and q4 "
        "run back to back, then five more pairs are measured.",
        "question": "Step 6's chat got no gain from n-gram. Does q4 pay on this chat prompt, and how sure is the "
        "race of it?",
        "answer": "The race's table shows about 6 tokens per pass, and its verdict gives the measured speedup with "
        f"its interval over the pairs ({_recorded('model-drafter')}; on a busy machine "
        "the interval widens and the verdict may be *no clear difference*). Unlike step 8's int8 tree, a q4 draft "
        "reads a little over a quarter of the target's bytes, so its cost c is small enough that E ÷ (K·c + 1) stays above 1.",
    },
    {
        "title": "10. Batch size, and greedy parity",
        "tab": "batch",
        "do": "Press **▶ Measure**, then open the **Parity lab** and press its button too. The Batch lab models "
        "a chain of K drafts: after step 7's tree it uses its starting values (K = 4, α = 0.7, free drafting), and "
        "its verdict says where they came from.",
        "question": "At which batch size does speculation stop paying on this machine? Are greedy outputs with "
        "and without speculation identical?",
        "answer": "The Batch lab's title gives the batch size from which speculation stops paying (a pass over "
        "K + 1 tokens per row stops being almost free once many rows share it), or says that it pays at every batch "
        "size measured, or that the repeats' spread allows no verdict at some (on a busy machine). The Parity lab shows identical greedy outputs; where they differ, it "
        "names a numerical near-tie between the two best tokens, not a bug.",
    },
]

# What a step's button fills, by component name: the Playground's controls (and its example picker and
# status line), the Step-through's source and trace, and the Race's controls and example picker.
# Every input of a Playground run but the model, its dtype, adaptive depth and the follow-up answers, which a step
# leaves as they are.
PLAYGROUND_KEYS = [key for key in PLAY_INPUTS if key not in ("target", "dtype", "adaptive", "answers")]
PLAYGROUND_OUT = [*PLAYGROUND_KEYS, "example", "status", "text", "stats"]
STEP_THROUGH_OUT = ["st_source", "st_recorded", *STEP_KEYS]
RACE_OUT = [*RACE_INPUTS, "race_example", *RACE_CLEARED]
OUT = ["tabs", *PLAYGROUND_OUT, *STEP_THROUGH_OUT, *RACE_OUT]
# Playground control -> the GenerationSettings name it shows (EXAMPLE_SETTINGS' order).
CONTROL_OF = {"num_draft_tokens": "budget", "max_new_tokens": "max_new"}


def _example_named(lesson: str) -> str | None:
    return next((e["name"] for e in load_examples() if e.get("lesson") == lesson), None)


def _playground_values(step: dict) -> dict:
    """{Playground component: value} for a step that fills the Playground: every control, so that nothing
    of an earlier step stays."""
    if "example" in step:
        name = _example_named(step["example"])
        values = example_values(name) if name else None
        if values is None:
            return {}
        settings = {key: values[key] for key in EXAMPLE_SETTINGS if key in values}
        loaded = {"prompt": values["prompt"], "drafter": values["drafter"], **settings}
        extra = {"example": name, "status": example_note(name), **loaded_outputs(name)}
    else:
        loaded = {"prompt": step["prompt"], **EXAMPLE_DEFAULTS, **step["settings"]}
        extra = {"example": None, "status": f"Workshop step {step['title']}: loaded. Press **▶ Run**."}
        extra |= loaded_outputs(f"Workshop step {step['title']}")
    by_control = {CONTROL_OF.get(key, key): value for key, value in loaded.items()}
    by_control.setdefault("budget", 0)  # "0 = K × top-k"
    return {**{key: by_control[key] for key in PLAYGROUND_KEYS if key in by_control}, **extra}


def _race_values(step: dict) -> dict:
    name = _example_named(step["example"])
    values = race_example_values(name) if name else None
    return {**values, "race_example": name, **cleared_race(name)} if values else {}


def _step_through_values(step: dict) -> dict:
    shown = load_step_source("Recorded trace", step["trace"], None, None)
    return {"st_source": "Recorded trace", "st_recorded": step["trace"], **dict(zip(STEP_KEYS, shown))}


def step_values(index: int) -> dict:
    """{component name: value} that step `index`'s button sets: its tab, and the settings, prompt and view
    it names (components it does not name keep their values)."""
    step = STEPS[index]
    values: dict = {"tabs": gr.Tabs(selected=step["tab"])}
    if step["tab"] == "playground":
        values |= _playground_values(step)
    elif step["tab"] == "race":
        values |= _race_values(step)
    elif step["tab"] == "step-through":
        values |= _step_through_values(step)
    return values


def load_step(index: int) -> tuple:
    """A step's button: its values in OUT's order (gr.skip() for what it leaves alone)."""
    return pack(OUT, step_values(index))


INTRO = """
**A 30-minute class in ten steps.** Each step loads its settings with one click and asks one question; the
screen it opens shows the answer (open *Answer* to check). Follow them in order: each loads everything it needs,
the prompt included. Everything runs the real default model on this machine, so the numbers you see are
measured live and differ a little from machine to machine.
"""


# After a step has loaded, the page scrolls to the tab bar, so that the opened tab starts at the top of the screen
# (a button far down the Workshop would otherwise leave the new tab scrolled past its start), and further where the
# tab's Run button is still below the screen (a lab's introduction is longer than a phone's screen), until the
# button is at its bottom. A tab opened for the first time is drawn after the step's values arrive (until then the
# page is too short to scroll), however long that takes on a busy machine: the scroll repeats every SCROLL_EVERY_MS
# until SETTLE_MS after the button first has a size, for at most SCROLL_FOR_MS.
RUN_BUTTON = {
    "playground": "sl-run",
    "step-through": "st-next",
    "race": "race-run",
    "lossless": "ll-run",
    "shortcuts": "sc-run",
    "drafters": "dr-run",
    "parity": "pl-run",
    "batch": "bl-run",
}
SCROLL_EVERY_MS, SETTLE_MS, SCROLL_FOR_MS = 150, 1000, 8000
SCROLL_TO_TAB = """() => {
  const started = Date.now();
  let seen = null;  // when the button first had a size
  const show = () => {
    document.getElementById('sl-tabs')?.scrollIntoView({block: 'start'});
    const run = document.getElementById('RUN');
    const box = run ? run.getBoundingClientRect() : null;
    if (box && box.height > 0) {
      seen = seen ?? Date.now();
      if (box.bottom > window.innerHeight - 12) {
        run.scrollIntoView({block: 'end'});
        window.scrollBy(0, 12);  // a little room under it
      }
    }
    const now = Date.now();
    if ((seen === null || now - seen < SETTLE) && now - started < LIMIT) setTimeout(show, EVERY);
  };
  show();
}"""


def scroll_js(tab: str) -> str:
    """The page script a step's button runs after loading: the opened tab (and its Run button) on screen."""
    return (
        SCROLL_TO_TAB.replace("RUN", RUN_BUTTON.get(tab, ""))
        .replace("SETTLE", str(SETTLE_MS))
        .replace("LIMIT", str(SCROLL_FOR_MS))
        .replace("EVERY", str(SCROLL_EVERY_MS))
    )


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


def wire(buttons: dict, tabs: gr.Tabs, play: dict, steps: dict, races: dict) -> None:
    """Each step button -> its tab and everything it loads (OUT: Playground, Step-through, Race)."""
    components = {"tabs": tabs, **play, **steps, **races}
    outputs = [components[key] for key in OUT]
    for index, button in buttons.items():
        button.click(lambda i=index: load_step(i), None, outputs, show_progress="hidden", queue=False, **PRIVATE).then(
            None, None, None, js=scroll_js(STEPS[index]["tab"]), queue=False, show_progress="hidden", **PRIVATE
        )
