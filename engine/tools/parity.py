"""Greedy parity check: speculative greedy output against the plain baseline.

A correct implementation emits the target's argmax at every position, so greedy
speculative decoding must reproduce the baseline token for token, *if* the
target's logits are computed identically. On real hardware a multi-token forward
can round differently from a one-token forward (bf16 on CPU by a fair part of a
logit), so a divergence is diagnosed: at the first differing position we
recompute the target's logits for the shared prefix and report the top-2 margin.
A divergence at a near-tie (margin below the dtype's tolerance) is numerics; at a
clear margin it is a bug. Strict mode pads every target pass to the same shape
(baseline included), which makes the two computations bitwise identical.
"""

from __future__ import annotations

import torch

from engine.decode import SpeculativeEngine
from engine.settings import GenerationSettings

__all__ = ["NEAR_TIE", "parity_check"]

# Top-2 logit margins below which a divergence is attributed to rounding.
NEAR_TIE = {torch.float32: 0.01, torch.bfloat16: 1.0, torch.float16: 0.5}


def _margin_at(engine: SpeculativeEngine, prefix: list[int]) -> tuple[float, list[list]]:
    model = engine.target.model
    cache = model.new_cache(len(prefix) + 1)
    logits = model.prefill(prefix, cache)
    top = torch.topk(logits, 2)
    tops = [[int(i), engine.token_text(int(i)), round(float(v), 4)] for v, i in zip(top.values, top.indices)]
    return float(top.values[0] - top.values[1]), tops


def parity_check(
    engine: SpeculativeEngine,
    prompts: list[str],
    drafter: str = "ngram",
    settings: GenerationSettings | None = None,
    baseline_cache: dict | None = None,
    **overrides,
):
    """Yield one result dict per prompt (a generator, so callers can show progress).

    settings (default: 32 new tokens, K = 4, a chain), with keyword overrides like
    ``SpeculativeEngine.run``'s: the draft shape, max_new_tokens, strict, chat and adaptive drafting
    are read from them; both runs are greedy (temperature 0, seed 0). baseline_cache: optional dict
    reused across calls so that checking several drafters on the same prompts runs each baseline
    once. The baseline drafts nothing, adaptive or not."""
    settings = (settings or GenerationSettings(max_new_tokens=32)).merged(overrides)
    greedy = settings.merged(dict(temperature=0.0, top_p=1.0, top_k=0, payload="reduced", seed=0))
    baseline = greedy.merged(dict(adaptive=False))
    strict = settings.strict
    tolerance = NEAR_TIE.get(engine.target.dtype, 0.01)
    # What a baseline run depends on besides its prompt (the cache's key; the draft shape sizes its passes).
    s = settings
    shape_key = (s.max_new_tokens, strict, s.chat, s.k * max(s.topk, 1), s.num_draft_tokens, str(engine.target.dtype))
    for index, prompt in enumerate(prompts):
        key = (prompt, *shape_key)
        if baseline_cache is not None and key in baseline_cache:
            base = baseline_cache[key]
        else:
            base = engine.run(prompt, "none", baseline)
            if baseline_cache is not None:
                baseline_cache[key] = base
        spec = engine.run(prompt, drafter, greedy)
        a, b = base["token_ids"], spec["token_ids"]
        result = {
            "index": index,
            "prompt": prompt,
            "drafter": drafter,
            "strict": strict,
            "dtype": str(engine.target.dtype).removeprefix("torch."),
            "baseline_tokens": len(a),
            "speculative_tokens": len(b),
            "tokens_per_pass": spec["metrics"]["tokens_per_pass"],
        }
        diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diverge is None and len(a) != len(b):
            diverge = min(len(a), len(b))
        if diverge is None:
            result.update(identical=True, verdict="identical")
        else:
            prompt_ids = base["events"][0]["prompt_ids"]
            margin, top2 = _margin_at(engine, prompt_ids + a[:diverge])
            result.update(
                identical=False,
                position=diverge,
                baseline_token=engine.token_text(a[diverge]) if diverge < len(a) else None,
                speculative_token=engine.token_text(b[diverge]) if diverge < len(b) else None,
                top2=top2,
                margin=margin,
                tolerance=tolerance,
                verdict="numerical near-tie" if margin < tolerance else "real mismatch",
            )
        yield result
