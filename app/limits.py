"""Limits that protect a public deployment, each set by an environment variable.

| variable | default | meaning |
|---|---|---|
| SPECLENS_MAX_PROMPT_TOKENS | 1024 | longer prompts are refused with a message (never silently cut) |
| SPECLENS_MAX_NEW_TOKENS | 256 | upper bound of "max new tokens" in the UI and the API |
| SPECLENS_MAX_LAB_SAMPLES | 2000 | upper bound of samples in the lossless lab |
| SPECLENS_MAX_CONCURRENT_RUNS | 2 | runs served at once; the rest wait in the queue (position shown) |
| SPECLENS_MODEL_ALLOWLIST | the presets | comma-separated model ids / preset names that may be loaded |
| SPECLENS_ALLOW_ANY_MODEL | 0 | 1 = any Hub id or local folder may be loaded |
| SPECLENS_TRUST_REMOTE_CODE | 0 | 1 = pass trust_remote_code=True to transformers (only with any-model) |
"""

from __future__ import annotations

import os

from engine.models import DEFAULT_MODEL, PRESETS

__all__ = [
    "MAX_PROMPT_TOKENS",
    "MAX_NEW_TOKENS",
    "MAX_LAB_SAMPLES",
    "MAX_CONCURRENT_RUNS",
    "allowed_models",
    "check_model_allowed",
]


def _int_env(name: str, default: int, low: int = 1) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw.strip() else default
    except ValueError:
        value = default
    return max(low, value)


MAX_PROMPT_TOKENS = _int_env("SPECLENS_MAX_PROMPT_TOKENS", 1024)
MAX_NEW_TOKENS = _int_env("SPECLENS_MAX_NEW_TOKENS", 256)
MAX_LAB_SAMPLES = _int_env("SPECLENS_MAX_LAB_SAMPLES", 2000)
MAX_CONCURRENT_RUNS = _int_env("SPECLENS_MAX_CONCURRENT_RUNS", 2)


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
    return os.environ.get("SPECLENS_ALLOW_ANY_MODEL", "0") == "1"


def trust_remote_code() -> bool:
    return any_model_allowed() and os.environ.get("SPECLENS_TRUST_REMOTE_CODE", "0") == "1"


def check_model_allowed(name: str) -> None:
    """Raise ValueError when this deployment does not allow loading `name`."""
    name = (name or "default").strip()
    if any_model_allowed() or name in allowed_models():
        return
    raise ValueError(
        f"model {name!r} is not allowed here; allowed: {', '.join(sorted(allowed_models()))} "
        "(the operator can set SPECLENS_MODEL_ALLOWLIST or SPECLENS_ALLOW_ANY_MODEL=1)"
    )
