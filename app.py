"""Entry point: `python app.py` serves SpecLens (also what a Hugging Face Space runs)."""

import os

from app import build_demo

if __name__ == "__main__":
    if os.environ.get("SPECLENS_PRELOAD", "1") == "1":
        # Load the default model and the drafter of the page's initial settings while the page
        # loads (measured: cold start to first token 25 s -> see README), unless turned off.
        from app import handlers
        from app.state import preload

        initial = handlers.load_recorded(handlers.DEFAULT_TRACE)[0]
        preload("default", "auto", (initial.get("drafter") or "none",))
    build_demo().queue(default_concurrency_limit=int(os.environ.get("SPECLENS_MAX_CONCURRENT_RUNS", "2"))).launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", 7860)),
    )
