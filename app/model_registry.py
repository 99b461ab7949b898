"""The process-wide model registry: each (target, dtype) engine is loaded once and shared read-only.

Everything per session (the run's trace, the step being inspected) lives in gr.State as plain
data; the only thing shared between sessions is what is loaded here.

Drafters that keep per-run state (the int8 self-drafter and model drafters own a KV cache)
must not be shared by two runs at once. The engine already gives every run a fresh drafter
around shared, read-only drafter weights, so a loaded engine is safe to use from concurrent
runs; ``prepare_drafter`` only builds those weights (int8 quantisation, loading a draft model)
ahead of the run, so that a bad drafter spec fails before anything runs.

The engines load on ``zerogpu.app_device()``: "auto" (CUDA when a GPU is visible), or "cpu" on a ZeroGPU
Space, whose app process must never initialise CUDA although ``torch.cuda.is_available()`` says True there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from . import zerogpu
from .config import trust_remote_code

__all__ = ["ModelRegistry", "REGISTRY", "preload", "prepare_drafter", "resolve_dtype_name"]


def _models():
    from engine.model import loading as models

    return models


def resolve_dtype_name(dtype: str) -> str:
    """'auto' -> the concrete dtype the engine would pick here, as a string (the registry key);
    q4_1 keeps its name (its layer matrices differ from bfloat16's)."""
    models = _models()
    if str(dtype).lower() == models.Q4_1:
        return models.Q4_1
    return str(models.resolve_dtype(dtype or "auto")).removeprefix("torch.")


class ModelRegistry:
    """Engines keyed by (target, dtype); each engine keeps the weights of the drafters built for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the lock tables only
        self._engines: dict[tuple[str, str], object] = {}
        self._load_locks: dict[tuple[str, str], threading.Lock] = {}

    def _key(self, target: str, dtype: str) -> tuple[str, str]:
        target = (target or "default").strip()
        if target in ("default", _models().PRESETS[_models().DEFAULT_MODEL]["hub_id"]):
            target = _models().DEFAULT_MODEL
        return target, resolve_dtype_name(dtype)

    def is_loaded(self, target: str, dtype: str = "auto") -> bool:
        try:
            key = self._key(target, dtype)
        except ValueError:
            return False
        return key in self._engines

    def get(self, target: str = "default", dtype: str = "auto", progress: Callable[[str], None] | None = None):
        """The shared engine for (target, dtype), loading it on first use (raises ModelLoadError/ValueError)."""
        from engine import SpeculativeEngine

        key = self._key(target, dtype)
        engine = self._engines.get(key)
        if engine is not None:
            return engine
        with self._lock:
            lock = self._load_locks.setdefault(key, threading.Lock())
        with lock:  # one load per key; loading one model never blocks using another
            engine = self._engines.get(key)
            if engine is None:
                engine = SpeculativeEngine.load(
                    key[0],
                    key[1],
                    progress=progress,
                    device=zerogpu.app_device(),
                    allow_remote_code=trust_remote_code(),
                )
                self._engines[key] = engine
        return engine


def prepare_drafter(engine, drafter: str) -> None:
    """Validate `drafter` and build its shared weights once (int8 copy, draft model).

    Raises ValueError / ModelLoadError for a bad drafter spec, before anything runs.
    """
    engine.drafter(drafter)


REGISTRY = ModelRegistry()


def preload(target: str = "default", dtype: str = "auto", drafters: tuple[str, ...] = ()) -> threading.Thread:
    """Load the target (and build the given drafters' weights) in a background thread, so the
    first Run after a server start does not wait for them. Failures are logged; the first Run
    then reports them as usual."""
    import logging

    def work() -> None:
        try:
            engine = REGISTRY.get(target, dtype)
            for spec in drafters:
                prepare_drafter(engine, spec)
        except Exception:  # the page still works; the first Run shows the error
            logging.getLogger("speclens.app").exception("preloading %s failed", target)

    thread = threading.Thread(target=work, name="speclens-preload", daemon=True)
    thread.start()
    return thread
