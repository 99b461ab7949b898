"""Example prompts (assets/examples.json): each with its drafter, its settings and what it was measured to show.

The Playground and the Race both offer the examples; picking one fills the prompt, its drafter and
every setting, so that Run reproduces what the example promises. scripts/record_traces.py measured
each example on the default model (tokens per pass, α, speedup against the baseline, on the CPU it
names) and recorded its trace; `example_note` says so next to the Run button.
"""

from __future__ import annotations

import json
import logging

import gradio as gr

from engine.metrics import DRAFT_COST_RATIO_MEANS
from engine.trace import TraceError

from .config import ASSETS
from .traces import load_recorded, recorded_traces

__all__ = ["EXAMPLE_SETTINGS", "example_dropdown", "example_note", "example_values", "load_examples"]

log = logging.getLogger("speclens.app")

# The settings an example fills, in the order `example_values` returns them, and their values when an
# example does not name them (so that a previous run's top-p or tree budget never leaks into it).
EXAMPLE_SETTINGS = [
    "k",
    "topk",
    "num_draft_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_new_tokens",
    "verify",
]
EXAMPLE_DEFAULTS = {"topk": 1, "num_draft_tokens": 0, "top_p": 1.0, "top_k": 0, "seed": 0, "verify": "token"}


def load_examples() -> list[dict]:
    try:
        data = json.loads((ASSETS / "examples.json").read_text(encoding="utf-8"))
        return [e for e in data if isinstance(e, dict) and e.get("prompt")]
    except (OSError, ValueError):
        log.exception("cannot read assets/examples.json")
        return []


def _recorded_settings(prompt: str, drafter: str | None) -> dict | None:
    """Settings of the recorded trace made from this example prompt (and drafter), if there is one."""
    for name in recorded_traces():
        try:
            start = load_recorded(name)[0]
        except (gr.Error, TraceError):
            continue
        if start.get("prompt") == prompt and (drafter is None or start.get("drafter") == drafter):
            settings = dict(start.get("settings") or {})
            if (settings.get("topk") or 1) == 1:
                settings["num_draft_tokens"] = 0  # a chain: the budget slider's "0 = K × top-k"
            return settings
    return None


def _example(name: str) -> dict | None:
    return next((e for e in load_examples() if e.get("name") == name), None)


def example_values(name: str) -> dict | None:
    """The example called `name` as {"prompt", "drafter" (or None), and each of EXAMPLE_SETTINGS}: its own
    settings, else those of a recorded trace of its prompt; None for an unknown name."""
    example = _example(name)
    if example is None:
        return None
    drafter = example.get("drafter") or None
    if isinstance(example.get("settings"), dict):
        settings = {**EXAMPLE_DEFAULTS, **example["settings"]}
    else:
        settings = _recorded_settings(example["prompt"], drafter) or {}
    values = {key: settings[key] for key in EXAMPLE_SETTINGS if key in settings}
    values.setdefault("verify", "token")  # (traces recorded before the rule was a setting ran per token)
    return {"prompt": example["prompt"], "drafter": drafter, **values}


def example_note(name: str) -> str:
    """Markdown: what the example shows and what it measured, where and when (live numbers differ by machine)."""
    example = _example(name)
    if example is None:
        return ""
    note = f"**{example['name']}.** {example.get('explain', '')}"
    m = example.get("measured")
    if isinstance(m, dict):
        second = ""
        if example.get("then_ask") and m.get("first_tokens_per_pass") is not None:
            second = f"the first answer {m['first_tokens_per_pass']} tokens per target pass; then the second: "
        note += (
            f" Measured on the default model ({m.get('dtype')}, {m.get('cpu')}, {m.get('threads')} threads, "
            f"{m.get('recorded')}): {second}**{m.get('tokens_per_pass')} tokens per target pass**, "
            f"α = {m.get('alpha')} (accepted ÷ depths tried), {m.get('tokens_per_s')} vs "
            f"{m.get('baseline_tokens_per_s')} tokens/s for the baseline = **{m.get('speedup')}×**, "
            f"median of {m.get('repeats')} runs."
        )
        if m.get("draft_cost_ratio") is not None:
            note += f" A draft token cost c = {m['draft_cost_ratio']} of a target pass ({DRAFT_COST_RATIO_MEANS})."
        other = m.get("compare")
        if isinstance(other, dict):
            note += (
                f" The {other.get('drafter')} drafter on the same prompt: {other.get('tokens_per_pass')} tokens "
                f"per pass, {other.get('speedup')}×"
                + (f", c = {other['draft_cost_ratio']}." if other.get("draft_cost_ratio") is not None else ".")
            )
        note += " On another machine, or while it is busy, live numbers differ."
    return note


def example_dropdown(elem_id: str) -> gr.Dropdown:
    """The examples' picker (the Playground's and the Race's)."""
    return gr.Dropdown(
        choices=[e["name"] for e in load_examples()],
        value=None,
        label="Example prompts",
        info="Fills the prompt, the drafter that suits it and the settings it was measured with.",
        elem_id=elem_id,
    )
