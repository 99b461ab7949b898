"""Entry point: `python app.py` serves SpecLens (also what a Hugging Face Space runs); settings in app/config.py."""

try:  # a ZeroGPU Space: `spaces` before anything that could initialise CUDA (app/zerogpu.py)
    import spaces  # noqa: F401
except ImportError:
    pass

from app import build_demo  # noqa: E402
from app.config import MAX_CONCURRENT_RUNS, MCP_SERVER, PRELOAD, SERVER_NAME, SERVER_PORT

if __name__ == "__main__":
    if PRELOAD:
        # Load the default model and the drafter of the page's initial settings while the page
        # loads, unless turned off (docs/app.md has the cold start as measured).
        from app.model_registry import preload
        from app.traces import DEFAULT_TRACE, load_recorded

        initial = load_recorded(DEFAULT_TRACE)[0]
        preload("default", "auto", (initial.get("drafter") or "none",))
    build_demo().queue(default_concurrency_limit=MAX_CONCURRENT_RUNS).launch(
        server_name=SERVER_NAME, server_port=SERVER_PORT, mcp_server=MCP_SERVER
    )
