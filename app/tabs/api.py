"""The API for programs and agents: /generate (speculative decoding on the default model), /race (a drafter
against the baseline, measured in alternating pairs, with a verdict only when the spread allows),
/launch_command (the same drafting in a production engine) and /analyze_metrics (does speculation pay on a
server, from a window of its /metrics).

gradio_client calls them by these names; with the MCP server on (app.py) agents see the same functions as MCP
tools of the same names, their descriptions and parameters read from the docstrings and type hints below. Both
go through the queue and the limits the page uses. Names, inputs and outputs are a public contract (README,
docs/app.md, tests): change them only compatibly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import gradio as gr

from engine.metrics import MIN_PAIRS

from ..config import MAX_CONCURRENT_RUNS
from ..engine_access import get_engine, make_settings, start_generation, use_drafter
from ..inputs import as_int, number, random_seed
from ..wiring import MODEL_RUNS

__all__ = ["ENDPOINTS", "analyze_metrics", "generate", "launch_command", "race", "register"]

ENDPOINTS = ("generate", "race", "launch_command", "analyze_metrics")  # the public API, and the MCP tools


def generate(
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
    """Generate text with speculative decoding on the default model (SmolLM2-135M-Instruct): a drafter guesses
    k tokens, the target checks them in one pass, and exact rejection sampling keeps the output the target's own.
    Streamed to gradio_client, one update per target pass; an MCP call gets the final answer.

    Args:
        prompt: the user message (the chat template is applied).
        drafter: none (the plain baseline), ngram, suffix, int8, q4, q4+ngram, suffix/q4, eagle or model:<id>.
        k: draft depth K (tokens drafted per target pass).
        temperature: 0 = greedy.
        top_p: nucleus sampling threshold in (0, 1].
        top_k: keep the top-k tokens (0 = off).
        seed: random seed; -1 = random (the seed used is returned).
        max_new_tokens: number of tokens to generate at most (1 to the app's limit, 256 by default).
        adaptive: drafting that adapts: each pass drafts the depth between 1 and k that pays most on this machine (measured pass costs and recent acceptance), and a model drafter stops drafting deeper when unsure (the output's distribution is unchanged).

    Returns:
        While running, {"partial": true, "text" so far, "tokens", "target_passes"} after each target pass;
        at the end {"partial": false, "text", "metrics" (tokens_per_pass, acceptance_rate, mean_acceptance_length,
        target_passes, new_tokens, tokens_per_s, ...), "drafter", "seed", "stop_reason", "target"} (gradio_client's
        predict and an MCP call return this last one). A dropped connection stops the run within a pass.
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


def race(
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
        drafter: ngram, suffix, int8, q4, q4+ngram, suffix/q4, eagle or model:<id>.
        k: draft depth K.
        temperature: 0 = greedy.
        seed: random seed shared by every run; -1 = random (the seed used is returned).
        max_new_tokens: number of tokens each run generates at most.
        pairs: baseline / speculative pairs to run back to back, alternating which goes first (5 to 20; fewer give no interval).
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
    from engine.tools.race import MAX_PAIRS
    from engine.tools.race import race as run_race

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
        result = run_race(engine, prompt, drafter, settings, pairs)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    return {**result, "seed": settings.seed}


def launch_command(
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
        drafter: none, ngram, suffix, int8, q4, q4+ngram, suffix/q4, eagle or model:<id>.
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
    from engine.tools.launch import launch_command as build_launch_command

    try:
        return build_launch_command(
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


def analyze_metrics(source: str = "code-edit", interval_s: float = 10.0, pass_costs: str = "") -> dict:
    """Does speculation pay on a server? Read a window of its speculation counters (vLLM, llama.cpp or SpecLens
    /metrics) as the Your deployment tab does: acceptance rate, mean acceptance length, acceptance by position
    and the α that fits it, and with the server's pass costs the expected speedup by K and batch size (modelled)
    with a one-sentence recommendation.

    Args:
        source: "chat" or "code-edit" (windows recorded on a real vLLM CPU server with n-gram drafting, K = 8); or the JSON text of a saved window ({"before", "after", "interval_s"}: two /metrics scrapes, what `python -m engine analyze URL --save FILE` writes); or a server's /metrics URL, scraped twice interval_s apart where this app's operator allows it to fetch URLs (not on a public Space).
        interval_s: seconds between the two scrapes of a URL (1 to 300; unused for recorded or saved windows).
        pass_costs: the server's pass costs in ms by batch size, plain / drafting, e.g. "1:60.7/81.3, 4:77.2/128.5" (empty = the window's own recorded costs, or none: then only tokens per pass are compared).

    Returns:
        The analyzer's reading: {"source", "server", "model_name", "acceptance_rate", "mean_acceptance_length",
        "acceptance_by_position", "alpha_fit", "k" (the K the counters show), "drafts", "expected_tokens_per_pass"
        (by K), "expected_speedup" (by batch and K, with pass costs), "best_k_by_batch", "recommendation",
        "ticket" (the advice as one sentence with the line that turns it on, with pass costs), "recorded_on"
        (where a recorded window was measured), ...}.
    """
    from engine.tools.analyze import AnalyzeError, load_recording, parse_recording, record, ticket

    from ..config import scrape_allowed
    from ..labs.deployment import MAX_INTERVAL_S, RECORDED, pass_costs_text, window_result

    text = (source or "").strip()
    if not text:
        raise gr.Error('source is empty: give "chat", "code-edit", a saved window\'s JSON text or a /metrics URL')
    if len(text) > MAX_WINDOW_CHARS:
        raise gr.Error(f"source is longer than {MAX_WINDOW_CHARS} characters: a saved window is two scrapes")
    recorded = {path.stem.removeprefix("vllm-ngram-"): path for path in RECORDED.values()}
    try:
        if text in recorded:
            window = load_recording(str(recorded[text]))
            window["url"] = f"a window recorded on {window.get('url') or text}"
        elif text.startswith("{"):
            window = parse_recording(text, "source")
        elif text.startswith(("http://", "https://")):
            if not scrape_allowed():
                raise gr.Error(
                    "this app does not fetch URLs for its callers (a public Space): record a window where your "
                    "server runs (python -m engine analyze URL --interval 60 --save window.json) and pass its JSON"
                )
            seconds = number(interval_s, "interval_s", 1, MAX_INTERVAL_S)
            window = record(text, seconds)
        else:
            raise gr.Error(
                f"source {text[:80]!r} is none of {sorted(recorded)}, a saved window's JSON text or an http(s) URL"
            )
        costs_text = pass_costs if (pass_costs or "").strip() else pass_costs_text(window.get("pass_costs"))
        result = window_result(window, costs_text)
    except AnalyzeError as exc:
        raise gr.Error(f"cannot analyse this window: {exc}") from None
    if result.get("best_k_by_batch"):
        result["ticket"] = ticket(result)
    result["source"] = window.get("url", "a saved window")
    if window.get("cpu"):
        result["recorded_on"] = f"{window['cpu']}, {window.get('recorded', '')}".strip(", ")
    return json.loads(json.dumps(result, default=str, allow_nan=False))


MAX_WINDOW_CHARS = 20 * 2**20  # a saved window is two scrapes; the tab refuses larger files too


def register() -> None:
    """The endpoints, in the queue every model run shares (MCP tool calls come through the same queue)."""
    gr.api(generate, api_name="generate", concurrency_limit=MAX_CONCURRENT_RUNS, concurrency_id=MODEL_RUNS)
    gr.api(race, api_name="race", concurrency_limit=MAX_CONCURRENT_RUNS, concurrency_id=MODEL_RUNS)
    gr.api(launch_command, api_name="launch_command", concurrency_limit=None)
    gr.api(analyze_metrics, api_name="analyze_metrics", concurrency_limit=None)
