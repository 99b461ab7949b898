"""Runs on a Hugging Face ZeroGPU Space: the GPU exists only inside a call decorated with ``@spaces.GPU``.

On ZeroGPU hardware the platform sets SPACES_ZERO_GPU and installs the ``spaces`` package. There, CUDA
is not available when the app starts, only inside a decorated call, which runs in a GPU worker process:
its arguments and what it returns cross that boundary by pickling (a CUDA tensor returned from the call
hangs it), and nothing warmed up at module level carries over to a request. Importing ``spaces`` also
makes ``torch.cuda.is_available()`` return True in the app process, where any real CUDA initialisation
fails ("CUDA must not be initialized in the main process"). So:

- the app process never touches CUDA: its engines (``model_registry``) load on the device ``app_device()``
  gives, "cpu" here, not "auto" (which would follow the patched ``is_available()`` to CUDA). Every run's
  prompt, drafter and settings are checked on that CPU engine before anything runs
  (``engine_access.start_generation``);
- the Playground's runs and ``/generate`` then go through ``gpu_events``, decorated with
  ``@spaces.GPU(duration=gpu_seconds)``: inside, the target loads on the GPU (once per worker process,
  ``_gpu_engine``) and the engine's events are yielded back as they come. They are plain JSON already, so
  nothing of the GPU leaves the call;
- what compares runs with each other (the Race, ``/race``, the Drafters, Lossless, Batch and Parity labs) stays on
  the CPU engine (``start_generation(..., worker=False)``, or the engine's tools called directly), every
  run of a comparison on one device; ``measured_on`` is the phrase that says which device measured a
  figure;
- the duration asked for follows the requested tokens (``gpu_seconds``): ZeroGPU schedules shorter
  calls first and counts them against the visitor's daily quota.

Elsewhere (no ``spaces`` package, or a Space on other hardware) ``active()`` is False and nothing changes:
``app_device()`` is "auto" and ``spaces.GPU`` itself returns the function undecorated off ZeroGPU.
tests/test_zerogpu_process.py serves the app in a process set up as ZeroGPU's main process and checks that
nothing in it initialises CUDA.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

from . import config

try:  # must come before anything initialises CUDA (app.py imports this module first)
    import spaces
except ImportError:  # not on a Space: the CPU path
    spaces = None

__all__ = [
    "GPU_LOAD_S",
    "GPU_SECONDS_PER_TOKEN",
    "MAX_GPU_S",
    "active",
    "app_device",
    "gpu_events",
    "gpu_seconds",
    "measured_on",
]

# What one call is allowed: loading the target from the safetensors cache and recording the pass graphs
# (GPU_LOAD_S), then at most one pass per requested token, with room for a slower slice and the drafter's own
# passes. Chosen from the eager target pass the H200 check measured (docs/bench/2026-12-07-notes-from-app.md).
GPU_LOAD_S = 20
GPU_SECONDS_PER_TOKEN = 0.05
MAX_GPU_S = 120


def active() -> bool:
    """Whether runs go to the GPU worker: the ``spaces`` package is present and the Space runs on ZeroGPU."""
    return spaces is not None and config.zero_gpu()


def app_device() -> str:
    """Where this process's engines load: "cpu" on ZeroGPU (there ``torch.cuda.is_available()`` says True in
    a process that must never initialise CUDA), "auto" everywhere else (CUDA when a GPU is visible)."""
    return "cpu" if active() else "auto"


def measured_on(device) -> str:
    """The phrase beside a measured speed or time: "measured on the GPU" for a CUDA device, else "measured on
    the CPU". `device`: a torch.device or its name ("cpu", "cuda:0"), e.g. a trace's start event's "device"."""
    kind = getattr(device, "type", None) or str(device or "cpu").split(":", 1)[0]
    return "measured on the GPU" if kind == "cuda" else "measured on the CPU"


def gpu_seconds(target: str, prompt, drafter: str, settings, allow_remote_code: bool = False) -> int:
    """The GPU time one run asks ZeroGPU for (the decorator calls it with the run's own arguments)."""
    tokens = max(1, int(getattr(settings, "max_new_tokens", 1) or 1))
    return min(MAX_GPU_S, GPU_LOAD_S + math.ceil(tokens * GPU_SECONDS_PER_TOKEN))


_ENGINES: dict[str, object] = {}
_ENGINES_LOCK = threading.Lock()


def _gpu_engine(target: str, allow_remote_code: bool):
    """The target on this worker's device (CUDA on ZeroGPU), loaded once per worker process."""
    from engine import SpeculativeEngine

    with _ENGINES_LOCK:
        engine = _ENGINES.get(target)
        if engine is None:
            engine = SpeculativeEngine.load(target, "auto", device="auto", allow_remote_code=allow_remote_code)
            _ENGINES[target] = engine
    return engine


def _run_on_gpu(target: str, prompt, drafter: str, settings, allow_remote_code: bool = False) -> Iterator[dict]:
    """One run on the GPU worker, its events yielded back (plain JSON: nothing of CUDA leaves the call)."""
    engine = _gpu_engine(target, allow_remote_code)
    yield from engine.generate(prompt, drafter, settings)


# Off ZeroGPU spaces.GPU returns the function itself, so this is the same generator either way.
gpu_events = spaces.GPU(duration=gpu_seconds)(_run_on_gpu) if spaces is not None else _run_on_gpu
