"""What an engine keeps between runs about its models and its host: the fixed-shape pass runners, and what
it has measured.

* ``RunnerPool``: up to ``size`` fixed-shape runners (``engine.model.static_pass.StaticPasses``) per set of
  weights (the target's, a drafter's) and run size, built at first need and kept. A runner's cache is sized
  to a *bucket*: the slots a run needs (prompt + new tokens + the passes' room) rounded up to a power of two
  from ``RUN_BUCKET_MIN``, at most the context window's; every pass attends over the bucket's slots, so a
  short run attends over a short span, and the few buckets keep the graphs reused. A run holds one runner
  of its bucket for its lifetime, so as many runs as the app serves at once (``SPECLENS_MAX_CONCURRENT_RUNS``,
  2 by default) each get their own: a seeded run gives the same bits alone or beside another (a run never
  takes a runner of another bucket, whose span would round differently). Only past ``size`` concurrent runs
  of one bucket does one take the eager path; an eager strict run sizes its cache to the same bucket.
* ``MeasuredCosts``: what this process has measured of its host — the target's pass time by width (what
  adaptive drafting weighs a deeper draft against), the quickest baseline pass (the host's quiet speed,
  against which a comparison tells a busy machine) and each drafter's c. A run or a comparison that reads
  them records the figures it read (``snapshot``), so its verdict can be recomputed from its trace alone.
"""

from __future__ import annotations

import math
import statistics
import threading
import time

import torch

from engine.model.pass_timing import pass_costs_ms
from engine.model.static_pass import StaticPasses, capture_available
from engine.model.transformer import Transformer

__all__ = ["PASS_GRAPHS", "RUN_BUCKET_MIN", "STATIC_MAX_WIDTH", "MeasuredCosts", "RunnerPool", "run_bucket"]

STATIC_MAX_WIDTH = 16  # the widest fixed-shape pass (a K = 15 chain or 15 tree nodes): one graph per width
RUN_BUCKET_MIN = 256  # the smallest runner (cache slots): a chat turn of the default model fits it


def run_bucket(needed: int, most: int) -> int:
    """The slots of the runner (and of an eager strict run's cache) for a run that needs `needed` slots: the
    smallest power of two >= needed from RUN_BUCKET_MIN, at most `most` (the context window's room)."""
    if needed < 1:
        raise ValueError(f"a run needs at least one slot, got {needed}")
    size = RUN_BUCKET_MIN
    while size < needed:
        size *= 2
    return min(size, most) if needed <= most else needed


# How strict (fixed-shape) target passes run (GenerationSettings.pass_graphs): "auto" = recorded once per width
# as CUDA graphs and replayed where the target runs on CUDA (every pass is then strict); "static" = the same
# fixed-shape function without capture (what the CPU tests compare with the eager pass); "off" = eager always.
PASS_GRAPHS = ("auto", "static", "off")


class RunnerPool:
    """The fixed-shape runners of one engine's weights, sized in buckets (``run_bucket``) up to every slot a run
    of the context window can use plus the widest pass twice; at most `size` per set of weights and bucket."""

    def __init__(self, context_window: int, size: int = 2):
        if size < 1:
            raise ValueError(f"a runner pool holds at least one runner per model, got {size}")
        self.size = size
        self.max_slots = context_window + 2 * STATIC_MAX_WIDTH + 2
        self._runners: dict[int, list[StaticPasses]] = {}  # id(weights) -> their runners (every bucket)
        self._lock = threading.Lock()

    def bucket(self, needed: int) -> int:
        """The slots of the runner a run that needs `needed` slots gets (``run_bucket``)."""
        return run_bucket(needed, self.max_slots)

    def acquire(self, model: Transformer, capture: bool, needed: int, width: int = 1) -> StaticPasses | None:
        """A runner of these weights and of the bucket of `needed` slots held for one run (release it with
        ``StaticPasses.release``): a free one, or a new one while fewer than `size` of that bucket exist; None
        when all are held or the run needs more slots or a wider pass than a runner has (that run takes the
        eager path)."""
        if needed > self.max_slots or width > STATIC_MAX_WIDTH:
            return None
        slots = self.bucket(needed)
        with self._lock:
            runners = self._runners.setdefault(id(model), [])
            runners[:] = [r for r in runners if r.model is model]  # (an id reused by other weights)
            # A runner whose capture failed stays in the pool, uncaptured for good: it still serves runs (and the
            # pool never builds more than `size` to try capturing again).
            kind = [r for r in runners if r.capacity == slots and (r.capture == capture or r.capture_error)]
            for runner in kind:
                if runner.acquire(needed) is not None:
                    return runner
            if len(kind) >= self.size:
                return None
            runner = StaticPasses(model, slots, STATIC_MAX_WIDTH, capture=capture)
            runners.append(runner)
            runner.acquire(needed)
            return runner

    def target_runner(self, model: Transformer, mode: str, strict: bool, needed: int, width: int):
        """(A runner of the target held for one run, or None for the eager path; why): a runner for every run
        where CUDA graphs record it ("auto" on CUDA), for strict runs under "static"."""
        if mode not in PASS_GRAPHS:
            raise ValueError(f"pass_graphs must be auto, static or off; got {mode!r}")
        graphs = mode == "auto" and capture_available(model.device)
        if mode == "off":
            return None, "the run's pass_graphs setting is off"
        if not (graphs or (mode == "static" and strict)):
            why = f"no CUDA graphs on {model.device}" if mode == "auto" else "static passes serve strict runs only"
            return None, why
        runner = self.acquire(model, graphs, needed, width)
        if runner is None:
            return None, (
                f"all {self.size} fixed-shape runners of its size were held by other runs, or the run needs more room"
            )
        return (
            runner,
            "CUDA graphs, recorded once per width and replayed" if graphs else "fixed-shape passes, uncaptured",
        )

    def held(self, model: Transformer) -> list[StaticPasses]:
        """The runners built for these weights so far (tests and the memory plan read them)."""
        with self._lock:
            return list(self._runners.get(id(model), ()))


class MeasuredCosts:
    """What this process measured of its host (see the module's docstring). Thread-safe."""

    def __init__(self, model: Transformer, runners: RunnerPool):
        self.model = model
        self.runners = runners
        self._pass_ms: list[float] = []  # target pass ms by width (index w - 1)
        self._fixed_ms: dict[tuple[bool, int, int], float] = {}  # (captured, width, bucket) -> ms of a fixed pass
        self.quickest_pass_ms: float | None = None  # the quickest mean baseline pass of any run
        self._c: dict[str, list[float]] = {}  # c (a draft token's cost in target passes) of each run, by drafter
        self._lock = threading.Lock()

    def pass_ms(self, max_width: int) -> list[float]:
        """Measured ms of a target pass of w tokens (index w - 1, w up to max_width): measured once and again
        only for a wider shape (how long that takes: docs/bench/2026-12-07-notes-from-kernels-and-model.md)."""
        with self._lock:
            if len(self._pass_ms) < max_width:
                self._pass_ms = pass_costs_ms(self.model, max_width)
            return self._pass_ms[:max_width]

    def weighed_pass_ms(self, width: int, pass_graphs: str, strict: bool, needed: int = 1) -> list[float]:
        """The pass ms by width (index w - 1, w up to `width`) that a run's adaptive K policy weighs, measured
        on the path its passes take: a run on the fixed-shape runner (graph replays on CUDA, "static" strict
        runs) pads every pass to `width`, so every depth costs that runner's pass of `width`, timed on a
        runner of the run's bucket (`needed` slots); an eager strict run every depth the eager pass of
        `width`; else the eager pass of each width."""
        graphs = pass_graphs == "auto" and capture_available(self.model.device)
        if graphs or (pass_graphs == "static" and strict):
            fixed = self._fixed_pass_ms(graphs, width, needed)
            if fixed is not None:
                return [fixed] * width
        # Eager passes (also where every runner was held: the run then takes the eager path too).
        costs = self.pass_ms(width)
        return [costs[-1]] * width if strict else costs

    def _fixed_pass_ms(self, graphs: bool, width: int, needed: int, prefix: int = 64, repeats: int = 3) -> float | None:
        """Median ms of a fixed-shape pass of `width` rows after a `prefix`, on a runner of the bucket of `needed`
        slots (recorded and replayed where graphs); None when every runner is held (the caller weighs the eager
        pass instead)."""
        needed = max(needed, prefix + width)
        key = (graphs, width, self.runners.bucket(needed))
        if key in self._fixed_ms:
            return self._fixed_ms[key]
        runner = self.runners.acquire(self.model, graphs, needed, width)
        if runner is None:
            return None
        try:
            mask = torch.zeros(width, runner.capacity, dtype=torch.bool)
            mask[:, :prefix] = True
            mask[:, prefix : prefix + width] = torch.tril(torch.ones(width, width, dtype=torch.bool))
            times = []
            for _ in range(repeats + 1):  # the first one warms up (and records the graph)
                runner.cache.length = prefix
                t0 = time.perf_counter()
                runner.run([0] * width, list(range(prefix, prefix + width)), mask, to_host=False)
                if self.model.device.type == "cuda":
                    torch.cuda.synchronize(self.model.device)
                times.append((time.perf_counter() - t0) * 1000.0)
        finally:
            runner.release()
        self._fixed_ms[key] = round(statistics.median(times[1:]), 3)
        return self._fixed_ms[key]

    def note_run(self, drafter: str, drafts: bool, metrics: dict) -> None:
        """Learn from a finished run's metrics: its c (speculative runs), its mean pass (baseline runs)."""
        with self._lock:
            if drafts and metrics.get("draft_cost_ratio") is not None:
                self._c.setdefault(drafter, []).append(metrics["draft_cost_ratio"])
            if not drafts and metrics.get("mean_verify_ms"):
                self.quickest_pass_ms = min(self.quickest_pass_ms or math.inf, metrics["mean_verify_ms"])

    def drafter_costs(self) -> dict[str, dict]:
        """{drafter: {"c": the median c of its runs, "runs"}}: a draft token's cost as this host measured it."""
        with self._lock:
            return {name: {"c": statistics.median(v), "runs": len(v)} for name, v in sorted(self._c.items())}

    def snapshot(self) -> dict:
        """The figures a verdict may read, as plain JSON, to record beside it: {"quickest_pass_ms"}."""
        with self._lock:
            return {"quickest_pass_ms": self.quickest_pass_ms}
