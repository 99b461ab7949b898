"""A speed comparison that survives a busy machine: the baseline and a drafter, run in alternating pairs.

One baseline run against one speculative run measures the machine as much as the method: on a shared
2-core host (a public Space with several visitors) one run can take twice as long as the next for
reasons that have nothing to do with speculation. So the comparison runs ``pairs`` pairs, the two runs
of a pair back to back and the order swapped every pair (drift in the machine's speed falls on both
sides alike), and ``engine.metrics.compare_speedups`` turns them into a median ratio with a
distribution-free interval, and a verdict only when the interval excludes 1.

Both runs of every pair use the same settings, seed included, with payload "off" (start and finish
events only: the event stream's cost is the same small amount on both sides).

A comparison records what its verdict was computed from (``compare_pairs``): every pair's two finish
metrics and the host figures it read (``MeasuredCosts.snapshot``: the quickest baseline pass this process
had measured), so ``recompute_verdict`` gives the same result from the record alone, whatever the process
measured since.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from engine.decode import SpeculativeEngine
from engine.metrics import COMPARE_LEVEL, MIN_PAIRS, compare_speedups, median
from engine.settings import GenerationSettings

__all__ = ["MAX_PAIRS", "alternating_pairs", "compare_pairs", "race", "recompute_verdict"]

MAX_PAIRS = 20


def alternating_pairs(
    engine: SpeculativeEngine, prompt, drafter: str, settings: GenerationSettings, pairs: int = MIN_PAIRS
) -> Iterator[tuple[dict, dict]]:
    """Yield (baseline metrics, speculative metrics) for each of `pairs` pairs (the finish events'
    ``metrics``), the baseline first in even pairs and the speculative run first in odd ones."""
    if isinstance(pairs, bool) or not isinstance(pairs, int) or not 1 <= pairs <= MAX_PAIRS:
        raise ValueError(f"pairs must be between 1 and {MAX_PAIRS}, got {pairs!r}")
    quiet = settings.merged({"payload": "off"})
    for index in range(pairs):
        order = ("none", drafter) if index % 2 == 0 else (drafter, "none")
        metrics = {name: engine.run(prompt, name, quiet)["metrics"] for name in order}
        yield metrics["none"], metrics[drafter]


def compare_pairs(engine: SpeculativeEngine, measured: list[tuple[dict, dict]]) -> dict:
    """``compare_speedups`` of the measured pairs against this engine's measured host figures, with both
    inputs recorded in the result: "measured" ([[baseline metrics, speculative metrics], ...]) and
    "measured_costs" (the snapshot it read)."""
    costs = engine.costs.snapshot()
    result = compare_speedups(measured, quickest_pass_ms=costs["quickest_pass_ms"])
    result.update(measured=[[base, spec] for base, spec in measured], measured_costs=costs)
    return result


def recompute_verdict(record: dict) -> dict:
    """The comparison of a recorded race (``compare_pairs``' result, or a saved copy of it), computed again
    from its recorded inputs alone."""
    pairs = [(base, spec) for base, spec in record["measured"]]
    quickest = (record.get("measured_costs") or {}).get("quickest_pass_ms")
    return compare_speedups(pairs, level=record.get("level", COMPARE_LEVEL), quickest_pass_ms=quickest)


def race(
    engine: SpeculativeEngine,
    prompt,
    drafter: str,
    settings: GenerationSettings | None = None,
    pairs: int = MIN_PAIRS,
    progress: Callable[[int, int], None] | None = None,
    **overrides,
) -> dict:
    """Run the alternating pairs and compare them: ``compare_speedups``' result (speedup, low, high,
    verdict, implied_speedup, ratios, ceiling, note, busy) plus each side's median tokens per second and
    tokens per pass, and the last pair's two finish metrics (baseline_metrics, speculative_metrics)."""
    settings = (settings or GenerationSettings()).merged(overrides)
    if drafter in ("none", "baseline", ""):
        raise ValueError(
            "a race compares a drafter with the baseline: choose a drafter (ngram, suffix, int8, eagle...)"
        )
    # A short warm-up of both sides, not counted: a process's first runs pay one-time costs (a drafter's
    # first build, the first passes of each width) that would land on whichever side runs first.
    warm = settings.merged({"payload": "off", "max_new_tokens": min(4, settings.max_new_tokens)})
    for name in ("none", drafter):
        engine.run(prompt, name, warm)
    measured: list[tuple[dict, dict]] = []
    for base, spec in alternating_pairs(engine, prompt, drafter, settings, pairs):
        measured.append((base, spec))
        if progress is not None:
            progress(len(measured), pairs)
    result = compare_pairs(engine, measured)

    result.update(
        drafter=drafter,
        baseline_tokens_per_s=median([base["tokens_per_s"] for base, _ in measured]),
        speculative_tokens_per_s=median([spec["tokens_per_s"] for _, spec in measured]),
        speculative_tokens_per_pass=median([spec["tokens_per_pass"] for _, spec in measured]),
        new_tokens=[pair[1]["new_tokens"] for pair in measured],
        # Both runs' whole summaries (finish metrics) of the last pair: what a trace's finish event holds.
        baseline_metrics=measured[-1][0],
        speculative_metrics=measured[-1][1],
    )
    return result
