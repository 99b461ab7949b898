"""Entry point: `python app.py` serves SpecLens (also what a Hugging Face Space runs)."""

import os

from app import build_demo

if __name__ == "__main__":
    build_demo().queue(default_concurrency_limit=int(os.environ.get("SPECLENS_MAX_CONCURRENT_RUNS", "2"))).launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", 7860)),
    )
