"""Example prompts (assets/examples.json) and, for those that were recorded, the settings of the recording.

The Playground and the Race both offer the examples; picking one fills the prompt, its suggested
drafter and, when assets/traces holds a recording of it, that recording's settings, so that Run
reproduces it.
"""

from __future__ import annotations

import json
import logging

import gradio as gr

from engine.trace import TraceError

from .config import ASSETS
from .traces import load_recorded, recorded_traces

__all__ = ["EXAMPLE_SETTINGS", "example_values", "load_examples"]

log = logging.getLogger("speclens.app")

# The settings an example fills, in the order `example_values` returns them.
EXAMPLE_SETTINGS = ["k", "topk", "num_draft_tokens", "temperature", "top_p", "top_k", "seed", "max_new_tokens"]


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


def example_values(name: str) -> dict | None:
    """The example called `name` as {"prompt", "drafter" (or None), and each of EXAMPLE_SETTINGS that the
    recording fixes}; None for an unknown name."""
    for example in load_examples():
        if example.get("name") == name:
            drafter = example.get("drafter") or None
            settings = _recorded_settings(example["prompt"], drafter) or {}
            values = {key: settings[key] for key in EXAMPLE_SETTINGS if key in settings}
            return {"prompt": example["prompt"], "drafter": drafter, **values}
    return None
