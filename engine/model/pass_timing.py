"""Batch-size trade-off measurement: how long one target pass takes for B rows.

Speculation verifies K+1 tokens per row in one pass. At batch size 1 decoding is
memory-bound and the extra tokens ride almost for free; as B grows the pass
becomes compute-bound and the extra K tokens per row start to cost real time.
This module *measures* pass times for B rows x W tokens (W = 1 for plain
decoding, W = K+1 for verification) on the loaded target; the throughput with
and without speculation is then *computed* from those times and a measured α
(``engine.metrics.batch_throughputs``, torch-free, so a view can recompute it
for another α or draft cost without measuring again).

B independent sequences share one forward: their tokens are concatenated and a
block-diagonal mask keeps every row on its own prefix, so the matrix products
really run on B x W rows at once (what a batched server does).
"""

from __future__ import annotations

import time

import torch

from engine.metrics import batch_throughputs
from engine.model.transformer import Transformer

__all__ = ["batch_tradeoff", "measure_pass_ms", "measure_pass_times", "pass_costs_ms"]


class _PassBench:
    """One timed cell: a target pass over `batch` rows of `tokens_per_row` new tokens, each row
    attending to its own cached prefix of `prefix_len` tokens (set up once, timed many times)."""

    def __init__(self, model: Transformer, batch: int, tokens_per_row: int, prefix_len: int):
        if not 1 <= batch <= 64 or not 1 <= tokens_per_row <= 64:
            raise ValueError("batch and tokens_per_row must be between 1 and 64")
        self.model = model
        vocab = model.cfg.vocab_size
        gen = torch.Generator().manual_seed(batch * 100 + tokens_per_row)
        self.prefix_total = batch * prefix_len
        self.cache = model.new_cache(self.prefix_total + batch * tokens_per_row)
        # Fill the cache with B independent prefixes (one causal block each).
        prefix_ids = torch.randint(0, vocab, (self.prefix_total,), generator=gen)
        prefix_pos = torch.arange(prefix_len).repeat(batch)
        mask = torch.zeros(self.prefix_total, self.prefix_total, dtype=torch.bool)
        causal = torch.tril(torch.ones(prefix_len, prefix_len, dtype=torch.bool))
        for b in range(batch):
            s = b * prefix_len
            mask[s : s + prefix_len, s : s + prefix_len] = causal
        with torch.inference_mode():
            model.run_pass(prefix_ids, prefix_pos, self.cache, mask=mask, logits_rows=torch.tensor([0]))
        rows = batch * tokens_per_row
        self.ids = torch.randint(0, vocab, (rows,), generator=gen)
        self.pos = (prefix_len + torch.arange(tokens_per_row)).repeat(batch)
        self.mask = torch.zeros(rows, self.prefix_total + rows, dtype=torch.bool)
        block = torch.tril(torch.ones(tokens_per_row, tokens_per_row, dtype=torch.bool))
        for b in range(batch):
            r = b * tokens_per_row
            self.mask[r : r + tokens_per_row, b * prefix_len : (b + 1) * prefix_len] = True
            self.mask[r : r + tokens_per_row, self.prefix_total + r : self.prefix_total + r + tokens_per_row] = block
        self()  # the first call warms up

    def __call__(self) -> float:
        """Milliseconds of one pass."""
        self.cache.length = self.prefix_total
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.run_pass(self.ids, self.pos, self.cache, mask=self.mask)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)  # kernels run asynchronously: time them, not their launch
        return (time.perf_counter() - t0) * 1000.0


def measure_pass_ms(
    model: Transformer, batch: int, tokens_per_row: int, prefix_len: int = 64, repeats: int = 3
) -> float:
    """Median milliseconds of one target pass over `batch` rows of `tokens_per_row` new tokens,
    each row attending to its own cached prefix of `prefix_len` tokens."""
    bench = _PassBench(model, batch, tokens_per_row, prefix_len)
    times = sorted(bench() for _ in range(repeats))
    return times[len(times) // 2]


SETTLE_S = 0.05  # after reporting progress, before the next timed pass: the reporter's work is not timed


def measure_pass_times(
    model: Transformer, k: int, batch_sizes=(1, 2, 4, 8, 16), prefix_len: int = 64, repeats: int = 5, progress=None
) -> dict:
    """Pass times at each batch size for 1 and K+1 tokens per row, measured `repeats` times each.

    The repeats run in rounds over every (B, width) cell, so a slow moment of a shared machine hits
    all cells alike instead of bending the curve at one B; each cell reports its median and its
    spread (min, max). Returns {"batch_sizes", "k", "prefix_len", "repeats", "pass_ms_1",
    "pass_ms_k1", "spread_ms_1", "spread_ms_k1"} (all measured).
    """
    sizes = list(batch_sizes)
    benches = {(b, w): _PassBench(model, b, w, prefix_len) for b in sizes for w in (1, k + 1)}
    samples: dict[tuple[int, int], list[float]] = {cell: [] for cell in benches}
    cells = list(benches)
    for done in range(repeats):
        # Each round starts at another cell: whatever follows a round (the app sending its progress, which
        # takes the interpreter for a moment) slows a different cell each time instead of always B = 1's one-token
        # pass (docs/bench/2026-12-07-notes-from-kernels-and-model.md).
        start = done % len(cells)
        for cell in cells[start:] + cells[:start]:
            samples[cell].append(benches[cell]())
        if progress is not None:
            progress(done + 1, repeats)
            time.sleep(SETTLE_S)

    def median(cell) -> float:
        values = sorted(samples[cell])
        return values[len(values) // 2]

    return {
        "batch_sizes": sizes,
        "k": k,
        "prefix_len": prefix_len,
        "repeats": repeats,
        "pass_ms_1": [median((b, 1)) for b in sizes],
        "pass_ms_k1": [median((b, k + 1)) for b in sizes],
        "spread_ms_1": [[min(samples[(b, 1)]), max(samples[(b, 1)])] for b in sizes],
        "spread_ms_k1": [[min(samples[(b, k + 1)]), max(samples[(b, k + 1)])] for b in sizes],
    }


def batch_tradeoff(
    model: Transformer,
    k: int,
    alpha: float,
    batch_sizes=(1, 2, 4, 8, 16),
    draft_ms_per_token: float = 0.0,
    prefix_len: int = 64,
    repeats: int = 3,
    progress=None,
) -> dict:
    """Measured pass times (``measure_pass_times``) plus the throughputs and verdict computed from
    them at acceptance α (``metrics.batch_throughputs``)."""
    measured = measure_pass_times(model, k, batch_sizes, prefix_len, repeats, progress)
    return batch_throughputs(measured, alpha, draft_ms_per_token)


MEASURED_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64)  # wider: extrapolated


@torch.inference_mode()
def pass_costs_ms(model: Transformer, max_width: int, prefix_len: int = 64, repeats: int = 3) -> list[float]:
    """Milliseconds of one causal target pass of w new tokens after a `prefix_len` prefix, for
    w = 1 .. max_width (index w - 1): what the adaptive K policy weighs a deeper draft against
    (engine.drafters.adaptive). The widths of MEASURED_WIDTHS up to max_width are measured (median of
    `repeats`, in rounds so that a slow moment of a shared machine hits them alike, one cache
    rolled back between passes); the widths between are interpolated linearly, and those past 64
    extrapolated from the last two measured. Rounded to 3 decimals (as a trace records them)."""
    if not 1 <= max_width <= 4096:
        raise ValueError(f"max_width must be between 1 and 4096, got {max_width}")
    widths = [w for w in MEASURED_WIDTHS if w <= max_width]
    if max_width <= MEASURED_WIDTHS[-1] and widths[-1] != max_width:
        widths.append(max_width)
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(max_width)
    cache = model.new_cache(prefix_len + widths[-1])
    model.run_pass(
        torch.randint(0, vocab, (prefix_len,), generator=gen),
        torch.arange(prefix_len),
        cache,
        logits_rows=torch.tensor([prefix_len - 1]),
    )
    ids = torch.randint(0, vocab, (widths[-1],), generator=gen)
    samples: dict[int, list[float]] = {w: [] for w in widths}
    for round_ in range(repeats + 1):  # round 0 warms every width up
        for w in widths:
            cache.length = prefix_len
            t0 = time.perf_counter()
            model.run_pass(ids[:w], prefix_len + torch.arange(w), cache)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            if round_:
                samples[w].append((time.perf_counter() - t0) * 1000.0)
    measured = [(w, sorted(t)[len(t) // 2]) for w, t in samples.items()]
    costs = []
    for w in range(1, max_width + 1):
        # the measured pair around w (or the last two, past the widest measured)
        hi = next((i for i, (mw, _) in enumerate(measured) if mw >= w), len(measured) - 1)
        lo = max(0, hi - 1)
        (w0, c0), (w1, c1) = measured[lo], measured[hi]
        cost = c1 if w1 == w0 else c0 + (c1 - c0) * (w - w0) / (w1 - w0)
        costs.append(round(max(cost, 1e-3), 3))
    return costs
