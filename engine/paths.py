"""Where SpecLens keeps things: the repository's folders and the per-user cache.

A leaf module (it imports only ``engine.config``): the kernels, the model loader and the vLLM
server all need the cache folder, and taking it from here keeps them from importing each other.
"""

from __future__ import annotations

from pathlib import Path

from engine import config

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "assets"
HEADS = ASSETS / "heads"
VLLM_VENV = REPO / ".venv-vllm"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the offline default target (engine.model.loading builds its cache)


def cache_dir() -> Path:
    """Per-user cache (models, compiled kernels, vLLM's model folder); override with SPECLENS_CACHE."""
    return config.cache_root()


def model_cache(name: str = DEFAULT_MODEL) -> Path:
    """The folder a model's prepared weights are cached in (``python -m engine prepare`` fills the default's)."""
    return cache_dir() / "models" / name
