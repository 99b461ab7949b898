"""SpecLens Gradio app: `build_demo()` returns the Blocks (Playground, Step-through, Race, /generate API).

Launch with `python app.py` (honours GRADIO_SERVER_NAME, GRADIO_SERVER_PORT and
SPECLENS_MAX_CONCURRENT_RUNS).
"""

from __future__ import annotations

__all__ = ["build_demo"]


def build_demo():
    from .ui import build_demo as _build

    return _build()
