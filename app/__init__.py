"""SpecLens Gradio app: `build_demo()` returns the Blocks (Playground, Step-through, Race, labs, /generate API).

Launch with `python app.py` (its environment settings: app/config.py). `ui` composes the page from one module per
tab (`tabs/`) and per lab (`labs/`); the modules at this level are the parts they share (configuration, engine
access, the model registry, Run / Stop wiring, traces and examples, text and figure helpers).
"""

from __future__ import annotations

__all__ = ["build_demo"]


def build_demo():
    from .ui import build_demo as _build

    return _build()
