"""SpecLens Gradio app: `build_demo()` returns the Blocks (Playground, Step-through, Race, labs, /generate API).

Launch with `python app.py` (its environment settings: app/config.py).

Layout: `ui` composes the page from one module per tab (`tabs.playground`, `tabs.step_through`,
`tabs.race`, `tabs.api`) and per lab (`labs.explain`, `labs.lossless`, `labs.parity`, `labs.batch`).
They share `config` (environment), `engine_access` (loading, drafters, settings, generation),
`model_registry` (engines shared between sessions), `wiring` and `stopping` (Run / Stop),
`traces` and `examples` (files in assets/), `render` and `narration` (text), `pass_view` and
`figure_guard` (figures).
"""

from __future__ import annotations

__all__ = ["build_demo"]


def build_demo():
    from .ui import build_demo as _build

    return _build()
