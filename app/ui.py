"""The SpecLens page: composes the tabs (app/tabs), the labs (app/labs) and the /generate API endpoint.

Each tab and lab is its own module holding its layout and handlers; this module only puts them in
order on one page, with the shared theme and stylesheet. Initial values come from recorded real
traces (assets/traces), so the page is never empty and needs no model until someone presses Run.
"""

from __future__ import annotations

import gradio as gr

from .config import CHARTS_JS, CSS_PATH, LABELS_JS, TAP_JS, TITLES_JS
from .engine_access import missing_model_banner
from .labs import batch, deployment, drafters, explain, lossless, parity, shortcuts
from .tabs import api, playground, race, step_through, workshop

__all__ = ["SpecLensBlocks", "build_demo", "theme"]

INTRO = """
# SpecLens: speculative decoding, made visible
A big **target** model normally produces one token per forward pass. With **speculative decoding** a cheap
**drafter** guesses the next few tokens and the target checks all the guesses in **one** pass, keeping the ones it
agrees with. New here? The **Workshop** tab is a guided class in ten one-click steps.
"""
# The rest of the introduction: hidden on a phone (assets/style.css), where the Playground's Run must show on the
# first screen; the Explain tab says it at length.
INTRO_MORE = """
Every kept token follows the target's own distribution exactly, so the text is what the target would have written
anyway; it just needs fewer target passes. Everything below runs a real model on this machine
(SmolLM2-135M-Instruct); nothing is simulated.
"""


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
        kwargs.setdefault("js", page_js())
        kwargs.setdefault("footer_links", ["api", "gradio"])
        kwargs.setdefault("max_file_size", "20mb")  # uploads are traces; engine.trace refuses > 20 MiB too
        block = not kwargs.pop("prevent_thread_lock", False)
        result = super().launch(*args, prevent_thread_lock=True, **kwargs)
        add_metrics_route(self.app)
        if block:
            self.block_thread()
        return result


def page_js() -> str | None:
    """The page's scripts (gradio runs one function on load): each asset file is one arrow function."""
    parts = [
        path.read_text(encoding="utf-8").strip() for path in (TAP_JS, CHARTS_JS, TITLES_JS, LABELS_JS) if path.is_file()
    ]
    if not parts:
        return None
    return "() => {\n" + "\n".join(f"({part})();" for part in parts) + "\n}"


def add_metrics_route(app) -> None:
    """GET /metrics on the app's own server: the speculation counters in Prometheus' text format
    (app/metrics_export.py). First in the route list, ahead of gradio's own catch-all routes."""
    from starlette.responses import Response
    from starlette.routing import Route

    from .metrics_export import CONTENT_TYPE_LATEST, metrics_text

    async def metrics(_request):
        return Response(metrics_text(), media_type=CONTENT_TYPE_LATEST)

    app.router.routes.insert(0, Route("/metrics", metrics, methods=["GET"]))


def build_demo() -> gr.Blocks:
    # First values from recorded traces, computed before the Blocks exist: the component updates
    # among them (a slider's range, a dropdown's choices) would otherwise be laid out as components.
    first = {"play": playground.initial_values(), "steps": step_through.initial_values(), "race": race.initial_race()}
    with SpecLensBlocks(title="SpecLens: speculative decoding, made visible") as demo:
        gr.Markdown(INTRO, elem_classes=["sl-intro"])
        gr.Markdown(INTRO_MORE, elem_classes=["sl-intro", "sl-intro-more"])
        missing = gr.Markdown("", visible=False, elem_id="sl-missing-model", elem_classes=["sl-status"])
        with gr.Tabs(overflow_behavior="wrap", elem_id="sl-tabs") as tabs:  # every tab one tap away, a phone too
            play = playground.layout(first["play"])
            class_steps = workshop.layout()
            steps = step_through.layout(first["steps"])
            races = race.layout(first["race"])
            explain.build_tab(play["trace"])
            lossless.build_tab()
            shortcuts.build_tab()
            drafters.build_tab()
            parity.build_tab()
            batch.build_tab(play["trace"])
            deployment.build_tab()
        # Events once every tab exists: a Playground run also points the Step-through at itself.
        playground.wire(play, steps["st_source"])
        step_through.wire(steps, play["trace"])
        race.wire(races)
        workshop.wire(class_steps, tabs, play, steps, races)
        api.register()
        demo.load(missing_model_banner, None, [missing], show_progress="hidden", queue=False)
    _only_the_api_public(demo)
    return demo


def _only_the_api_public(demo: gr.Blocks) -> None:
    """The page's own events serve the page: private, so that the API page, gradio_client and the MCP tool list
    show the API of tabs/api.py alone, whatever a tab forgot to mark."""
    for fn in demo.fns.values():
        if fn.api_visibility == "public" and fn.api_name not in api.ENDPOINTS:
            fn.api_visibility = "private"
