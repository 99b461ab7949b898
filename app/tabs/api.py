"""The API endpoints for programs (gradio_client): /generate (speculative decoding on the default model)
and /race (a drafter against the baseline, measured in alternating pairs, with a verdict only when the
spread allows).

Its name, inputs and outputs are a public contract (README, tests): change them only compatibly.
"""

from __future__ import annotations

from collections.abc import Iterator

import gradio as gr

from engine.metrics import MIN_PAIRS

from ..config import MAX_CONCURRENT_RUNS
from ..engine_access import get_engine, make_settings, start_generation, use_drafter
from ..inputs import as_int, random_seed
from ..wiring import MODEL_RUNS

__all__ = ["api_generate", "api_race", "register"]


def api_generate(
    prompt: str,
    drafter: str = "ngram",
    k: int = 4,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    max_new_tokens: int = 64,
    adaptive: bool = False,
) -> Iterator[dict]:
    """Generate text with speculative decoding on the default model (streamed, one update per target pass).

    Args:
        prompt: the user message (the chat template is applied).
        drafter: none, ngram, suffix, int8, eagle or model:<id>.
        k: draft depth K (tokens drafted per target pass).
        temperature: 0 = greedy.
        top_p: nucleus sampling threshold in (0, 1].
        top_k: keep the top-k tokens (0 = off).
        seed: random seed; -1 = random (the seed used is returned).
        max_new_tokens: number of tokens to generate at most.
        adaptive: drafting that adapts: each pass drafts the depth between 1 and k that pays most on this
            machine (measured pass costs and recent acceptance), and a model drafter stops drafting deeper
            when unsure (the output's distribution is unchanged).

    Returns:
        While running, {"partial": true, "text" so far, "tokens", "target_passes"} after each target pass;
        at the end {"partial": false, "text", "metrics", "drafter", "seed", "stop_reason", "target"}
        (gradio_client's predict returns this last one). A dropped connection stops the run within a pass.
    """
    settings = make_settings(k, 1, None, temperature, top_p, top_k, seed, max_new_tokens, adaptive)
    engine = get_engine("default", "auto")
    use_drafter(engine, drafter)
    trace: list[dict] = []
    token_ids: list[int] = []
    # Closing the events also happens when Gradio closes this generator (the client went away).
    with start_generation(engine, prompt, drafter, settings) as events:
        for event in events:
            trace.append(event)
            if event["type"] == "step":
                token_ids.extend(item["token_id"] for item in event["emitted"])
                yield {
                    "partial": True,
                    "text": engine.tokenizer.decode(token_ids, skip_special_tokens=True),
                    "tokens": len(token_ids),
                    "target_passes": event["target_passes"],
                }
    start, finish = trace[0], trace[-1]
    yield {
        "partial": False,
        "text": finish.get("text", ""),
        "metrics": finish.get("metrics", {}),
        "drafter": start.get("drafter"),
        "seed": (start.get("settings") or {}).get("seed"),
        "stop_reason": finish.get("stop_reason"),
        "target": start.get("target"),
    }


def api_race(
    prompt: str,
    drafter: str = "ngram",
    k: int = 4,
    temperature: float = 0.0,
    seed: int = 0,
    max_new_tokens: int = 64,
    pairs: int = MIN_PAIRS,
    topk: int = 1,
    num_draft_tokens: int = 0,
) -> dict:
    """Race a drafter against the plain baseline on the default model, measured so that noise gives no verdict.

    Args:
        prompt: the user message (the chat template is applied).
        drafter: ngram, suffix, int8, eagle or model:<id>.
        k: draft depth K.
        temperature: 0 = greedy.
        seed: random seed shared by every run; -1 = random (the seed used is returned).
        max_new_tokens: number of tokens each run generates at most.
        pairs: baseline / speculative pairs to run back to back, alternating which goes first (5 to 20;
            fewer give no interval).
        topk: candidates per draft position (1 = a chain; more = a tree).
        num_draft_tokens: the tree's draft-token budget (0 = K × topk).

    Returns:
        {"speedup": median ratio of the pairs' tokens per second, "low", "high": an interval that holds the
        median with probability >= 1 - "level", "verdict": "faster", "slower" or "no clear difference"
        (only a spread that excludes 1 by 5% or more gives a direction, and "faster" only where tokens per
        pass allow it), "note": why there is no verdict despite the spread (or null), "ceiling": tokens per
        pass ÷ the baseline's (no measured speedup above it is speculation's), "busy": {"busy", "spread",
        "slowdown", "cpu_share", "reason"} (whether other work slowed the baseline passes), "implied_speedup": what the
        measured pass costs and tokens per pass imply, "ratios", "pairs", "baseline_tokens_per_s", "speculative_tokens_per_s",
        "speculative_tokens_per_pass", "new_tokens", "baseline_metrics" and "speculative_metrics" (the last
        pair's two run summaries, as a trace's finish event holds them), "drafter", "seed"}.
    """
    from engine.tools.race import MAX_PAIRS, race

    pairs = as_int(pairs, "pairs")
    if not MIN_PAIRS <= pairs <= MAX_PAIRS:
        raise gr.Error(f"pairs must be between {MIN_PAIRS} and {MAX_PAIRS}, got {pairs}")
    settings = make_settings(k, topk, num_draft_tokens, temperature, 1.0, 0, seed, max_new_tokens)
    if settings.seed is None:
        settings.seed = random_seed()  # every run shares one seed
    engine = get_engine("default", "auto")
    use_drafter(engine, drafter)
    # Checked here; on ZeroGPU the pairs run on this CPU engine too (engine.tools.race), all on one device.
    start_generation(engine, prompt, drafter, settings, worker=False).close()  # a bad prompt fails before any run
    try:
        result = race(engine, prompt, drafter, settings, pairs)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    return {**result, "seed": settings.seed}


def api_launch_command(
    engine: str = "vllm",
    drafter: str = "ngram",
    k: int = 4,
    topk: int = 1,
    num_draft_tokens: int = 0,
    temperature: float = 0.0,
    adaptive: bool = False,
    verify: str = "token",
) -> dict:
    """The command that turns this drafting on in a production engine (no model runs).

    Args:
        engine: vllm, sglang, llama.cpp or transformers.
        drafter: none, ngram, suffix, int8, eagle or model:<id>.
        k: draft depth K.
        topk: candidates per draft position (1 = a chain).
        num_draft_tokens: the tree's draft-token budget (0 = K × topk).
        temperature: 0 = greedy.
        adaptive: drafting depth that adapts (where the engine has it).
        verify: sampled chains' acceptance rule, token or block (vLLM's rejection_sample_method).

    Returns:
        {"engine", "drafter", "command": the exact command (or Python for transformers; null where the engine
        has no equivalent), "equivalent", "notes": what differs, or why there is no equivalent}.
    """
    from engine.paths import DEFAULT_MODEL
    from engine.tools.launch import launch_command

    try:
        return launch_command(
            engine,
            drafter,
            as_int(k, "k"),
            as_int(topk, "topk"),
            as_int(num_draft_tokens, "num_draft_tokens") or None,
            DEFAULT_MODEL,
            float(temperature),
            bool(adaptive),
            verify or "token",
        )
    except (TypeError, ValueError) as exc:
        raise gr.Error(str(exc)) from None


def register() -> None:
    """The endpoints, in the queue every model run shares."""
    gr.api(api_generate, api_name="generate", concurrency_limit=MAX_CONCURRENT_RUNS, concurrency_id=MODEL_RUNS)
    gr.api(api_race, api_name="race", concurrency_limit=MAX_CONCURRENT_RUNS, concurrency_id=MODEL_RUNS)
    gr.api(api_launch_command, api_name="launch_command", concurrency_limit=None)
