"""Many samples of a prompt's first tokens, and the exact target distribution they must follow.

The exactness tools (``engine.tools.exactness``), the Lossless lab and the statistical tests compare
real speculative samples with the target's exact p. Sampling runs the real decode loop's steps
(``SpeculativeEngine.step``: drafts, one target pass, verification), but the prompt is prefilled once
and both KV caches are rolled back to it before each sample, so thousands of samples are affordable.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.decode import SpeculativeEngine
from engine.sampling import probs_from_logits
from engine.settings import GenerationSettings

__all__ = ["MAX_SAMPLES", "MAX_SAMPLE_TOKENS", "next_token_distribution", "sample_next_tokens"]

MAX_SAMPLES = 100_000
MAX_SAMPLE_TOKENS = 8


def sample_next_tokens(
    engine: SpeculativeEngine,
    prompt: str | list[int],
    drafter: str = "none",
    n_samples: int = 1000,
    n_tokens: int = 1,
    settings: GenerationSettings | None = None,
    verify_node: Callable | None = None,
    progress=None,
    tally: dict | None = None,
    **kw,
) -> list[tuple[int, ...]]:
    """Draw n_samples independent continuations of n_tokens tokens from one prompt.

    verify_node: None for the exact rule, or a replacement for ``acceptance.verify_children`` (the
    Lossless lab's negative control passes ``engine.tools.exactness.verify_children_ignoring_q``).
    tally: a dict to fill with what the passes did over all samples: "passes" (target passes), "tokens" (tokens
    they emitted, past n_tokens included), "accepted" and "drafted" (draft nodes accepted, drafted).
    Adaptive drafting keeps one policy for all samples: K follows the acceptance of the samples before,
    which changes how each sample is drafted but not its distribution (``engine.drafters.adaptive``).
    """
    settings = (settings or GenerationSettings()).merged(kw)
    params, shape = settings.validate()
    if verify_node is not None and not callable(verify_node):
        raise ValueError(f"verify_node must be None (the exact rule) or a function, got {verify_node!r}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or not 1 <= n_samples <= MAX_SAMPLES:
        raise ValueError(f"n_samples must be between 1 and {MAX_SAMPLES}, got {n_samples!r}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 1 <= n_tokens <= MAX_SAMPLE_TOKENS:
        raise ValueError(f"n_tokens must be between 1 and {MAX_SAMPLE_TOKENS}, got {n_tokens!r}")
    drafter_obj = engine.run_drafter(drafter, settings)
    prompt_ids = engine.prompts.ids(prompt, settings.chat)
    if len(prompt_ids) + n_tokens + shape.max_tokens + 2 >= engine.target.context_window:
        raise ValueError("prompt too long for the context window")
    seed = settings.seed if settings.seed is not None else 0
    settings = settings.merged({"strict": False})  # (samples need no shape-invariant passes)
    samples: list[tuple[int, ...]] = []
    counted = {"passes": 0, "tokens": 0, "accepted": 0, "drafted": 0}
    extra = n_tokens + shape.max_tokens + 1
    adaptive, _ = engine.adaptive_policy(
        settings, shape, drafter_obj, engine.run_slots(len(prompt_ids), extra, shape)[1]
    )
    with engine.running(prompt_ids, drafter_obj, settings, shape, params, seed, extra, adaptive) as state:
        base = state.cache.length
        for index in range(n_samples):
            state.context = list(prompt_ids)
            state.cache.length = base  # roll back to the prompt: no recomputation of it
            drafter_obj.rewind(len(prompt_ids) - 1)
            out: list[int] = []
            while len(out) < n_tokens:
                result = engine.step(state, verify_node)
                ids = [item["token_id"] for item in result.verdict.emitted(result.tree)]
                counted["passes"] += 1
                counted["tokens"] += len(ids)
                counted["accepted"] += len(result.verdict.path)
                counted["drafted"] += len(result.tree)
                out.extend(ids)
                state.context.extend(ids)
            samples.append(tuple(out[:n_tokens]))
            if progress is not None:
                progress(index + 1, n_samples)
    if tally is not None:
        tally.update(counted)
    return samples


def next_token_distribution(
    engine: SpeculativeEngine, prompt: str | list[int], prefix: list[int] | None = None, settings=None, **kw
):
    """The target's exact next-token distribution p after prompt (+ prefix), as a [V] float32 tensor,
    with the run's temperature / top-k / top-p applied."""
    settings = (settings or GenerationSettings()).merged(kw)
    params, _ = settings.validate()
    ids = engine.prompts.ids(prompt, settings.chat) + list(prefix or [])
    model = engine.target.model
    cache = model.new_cache(len(ids) + 1)
    return probs_from_logits(model.prefill(ids, cache), params)
