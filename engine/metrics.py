"""Run metrics computed from step events (plain Python: works on live and recorded traces)."""

from __future__ import annotations

__all__ = ["expected_tokens_per_pass", "summarize_steps"]


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """(1 - alpha^(K+1)) / (1 - alpha): expected tokens per target pass for a chain
    of K drafts each accepted independently with probability alpha (bonus included)."""
    if k <= 0 or alpha <= 0.0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def summarize_steps(steps: list[dict], k: int, wall_s: float, prefill_s: float = 0.0) -> dict:
    """Aggregate step events into the metrics every view shows.

    target_passes counts verification passes (the prefill is reported apart);
    tokens_per_pass includes the resampled or bonus token of each pass;
    acceptance_rate = accepted / drafted; acceptance_by_position[i] is the share of
    steps that drafted a token at depth i+1 whose accepted path reached depth i+1.
    """
    passes = len(steps)
    tokens = sum(len(s["emitted"]) for s in steps)
    drafted = sum(s["drafted"] for s in steps)
    accepted = sum(s["accepted_len"] for s in steps)
    max_depth = max([k] + [s.get("draft_depth", 0) for s in steps])
    drafted_at = [0] * max_depth
    accepted_at = [0] * max_depth
    for s in steps:
        for depth in range(s.get("draft_depth", 0)):
            drafted_at[depth] += 1
        for depth in range(s["accepted_len"]):
            accepted_at[depth] += 1
    alpha = accepted / drafted if drafted else 0.0
    draft_s = sum(s["draft_ms"] for s in steps) / 1000.0
    verify_s = sum(s["verify_ms"] for s in steps) / 1000.0
    return {
        "target_passes": passes,
        "new_tokens": tokens,
        "tokens_per_pass": tokens / passes if passes else 0.0,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": alpha,
        "accepted_per_position": accepted_at,
        "drafted_per_position": drafted_at,
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_at, drafted_at)],
        "theoretical_tokens_per_pass": expected_tokens_per_pass(alpha, k) if drafted else 1.0,
        "mean_tree_size": drafted / passes if passes else 0.0,
        "mean_accepted_depth": accepted / passes if passes else 0.0,
        "draft_s": draft_s,
        "verify_s": verify_s,
        "prefill_s": prefill_s,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
    }
