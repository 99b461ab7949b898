"""Everything the app takes from its environment, read here and nowhere else.

| variable | default | meaning |
|---|---|---|
| SPECLENS_MAX_PROMPT_TOKENS | 1024 | longer prompts are refused with a message (never silently cut) |
| SPECLENS_MAX_NEW_TOKENS | 256 | upper bound of "max new tokens" in the UI and the API |
| SPECLENS_MAX_LAB_SAMPLES | 2000 | upper bound of samples in the lossless lab (at least 100, its slider's start) |
| SPECLENS_MAX_CONCURRENT_RUNS | 2 | runs served at once; the rest wait in the queue (position shown) |
| SPECLENS_MODEL_ALLOWLIST | the presets | comma-separated model ids / preset names that may be loaded |
| SPECLENS_ALLOW_ANY_MODEL | 0 | 1 = any Hub id or local folder may be loaded |
| SPECLENS_TRUST_REMOTE_CODE | 0 | 1 = pass trust_remote_code=True to transformers (only with any-model) |
| SPECLENS_PRELOAD | 1 | `python app.py` loads the default model in the background at start (0 = on first Run) |
| SPECLENS_MCP_SERVER | 1 | `python app.py` also serves the API as MCP tools at /gradio_api/mcp/ (0 = off) |
| GRADIO_SERVER_NAME | 127.0.0.1 | address `python app.py` serves on |
| GRADIO_SERVER_PORT | 7860 | port `python app.py` serves on |
| SPECLENS_VLLM_URL | unset | a vLLM server with speculation: the Playground offers it as the drafter "vllm" |
| SPECLENS_ALLOW_SCRAPE | 1, or 0 on a Space | 1 = "Your deployment" may fetch URLs a visitor types (its /metrics, its API); 0 = saved windows only |
| SPECLENS_VLLM_BASELINE_URL | unset | the same model served without speculation: with both, the Batch lab measures real batches |

The numbers are read once, at import. The model permissions are read when a model is about to
load, so that an operator's change (or a test's) applies to the next load without a restart.
A malformed number falls back to its default rather than keeping the server from starting.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.model.loading import DEFAULT_MODEL, PRESETS

__all__ = [
    "ASSETS",
    "CSS_PATH",
    "TAP_JS",
    "CHARTS_JS",
    "TITLES_JS",
    "LABELS_JS",
    "LAB_SAMPLES_FLOOR",
    "MAX_CONCURRENT_RUNS",
    "MAX_LAB_SAMPLES",
    "MAX_NEW_TOKENS",
    "MAX_PROMPT_TOKENS",
    "MCP_SERVER",
    "PRELOAD",
    "SERVER_NAME",
    "SERVER_PORT",
    "TRACES_DIR",
    "VLLM_BASELINE_URL",
    "VLLM_URL",
    "allowed_models",
    "any_model_allowed",
    "check_model_allowed",
    "scrape_allowed",
    "trust_remote_code",
]

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TRACES_DIR = ASSETS / "traces"
CSS_PATH = ASSETS / "style.css"
TAP_JS = ASSETS / "tap.js"  # a tapped token's details on a touch screen (no hover there)
CHARTS_JS = ASSETS / "charts.js"  # runs the chart scripts below on every plotly chart, as the page changes
TITLES_JS = ASSETS / "titles.js"  # chart titles re-wrapped to their chart's real width
LABELS_JS = ASSETS / "labels.js"  # point labels that would meet shortened to their mark (the draft tree)

LAB_SAMPLES_FLOOR = 100  # the lossless lab's N slider starts here


def _int_env(name: str, default: int, low: int = 1) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw.strip() else default
    except ValueError:
        value = default
    return max(low, value)


def _flag_env(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default) == "1"


MAX_PROMPT_TOKENS = _int_env("SPECLENS_MAX_PROMPT_TOKENS", 1024)
MAX_NEW_TOKENS = _int_env("SPECLENS_MAX_NEW_TOKENS", 256)
MAX_LAB_SAMPLES = _int_env("SPECLENS_MAX_LAB_SAMPLES", 2000, low=LAB_SAMPLES_FLOOR)
MAX_CONCURRENT_RUNS = _int_env("SPECLENS_MAX_CONCURRENT_RUNS", 2)
PRELOAD = _flag_env("SPECLENS_PRELOAD", "1")
MCP_SERVER = _flag_env("SPECLENS_MCP_SERVER", "1")
SERVER_NAME = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
SERVER_PORT = _int_env("GRADIO_SERVER_PORT", 7860)
# A production engine driven through its API (engine.vllm.backend): unset = the vLLM views stay hidden.
VLLM_URL = os.environ.get("SPECLENS_VLLM_URL", "").strip() or None
VLLM_BASELINE_URL = os.environ.get("SPECLENS_VLLM_BASELINE_URL", "").strip() or None


def scrape_allowed() -> bool:
    """May "Your deployment" fetch a URL a visitor typed? Not by default on a public Space (SPACE_ID set):
    there the server would fetch addresses of the Space's own network for anyone (server-side request
    forgery); visitors upload a window saved with `python -m engine analyze URL --save FILE` instead."""
    return _flag_env("SPECLENS_ALLOW_SCRAPE", "0" if os.environ.get("SPACE_ID") else "1")


def zero_gpu() -> bool:
    """Is this a ZeroGPU Space? The platform sets SPACES_ZERO_GPU there (app/zerogpu.py sends runs to the GPU)."""
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")


def allowed_models() -> set[str]:
    raw = os.environ.get("SPECLENS_MODEL_ALLOWLIST", "")
    if raw.strip():
        return {item.strip() for item in raw.split(",") if item.strip()}
    names = {"default", DEFAULT_MODEL}
    for name, preset in PRESETS.items():
        names.add(name)
        names.add(preset["hub_id"])
    return names


def any_model_allowed() -> bool:
    return _flag_env("SPECLENS_ALLOW_ANY_MODEL")


def trust_remote_code() -> bool:
    return any_model_allowed() and _flag_env("SPECLENS_TRUST_REMOTE_CODE")


def check_model_allowed(name: str) -> None:
    """Raise ValueError when this deployment does not allow loading `name`."""
    name = (name or "default").strip()
    if any_model_allowed() or name in allowed_models():
        return
    raise ValueError(
        f"model {name!r} is not allowed here; allowed: {', '.join(sorted(allowed_models()))} "
        "(the operator can set SPECLENS_MODEL_ALLOWLIST or SPECLENS_ALLOW_ANY_MODEL=1)"
    )
