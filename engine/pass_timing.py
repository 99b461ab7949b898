"""Batch-size trade-off measurement: how long one target pass takes for B rows.

Speculation verifies K+1 tokens per row in one pass. At batch size 1 decoding is
memory-bound and the extra tokens ride almost for free; as B grows the pass
becomes compute-bound and the extra K tokens per row start to cost real time.
This module *measures* pass times for B rows x W tokens (W = 1 for plain
decoding, W = K+1 for verification) on the loaded target; the throughput with
and without speculation is then *computed* from those times and a measured α.

B independent sequences share one forward: their tokens are concatenated and a
block-diagonal mask keeps every row on its own prefix, so the matrix products
really run on B x W rows at once (what a batched server does).
"""

from __future__ import annotations

import time

import torch

from .metrics import expected_tokens_per_pass
from .transformer import Transformer

__all__ = ["measure_pass_ms", "batch_tradeoff"]


def measure_pass_ms(
    model: Transformer, batch: int, tokens_per_row: int, prefix_len: int = 64, repeats: int = 3
) -> float:
    """Median milliseconds of one target pass over `batch` rows of `tokens_per_row` new tokens,
    each row attending to its own cached prefix of `prefix_len` tokens."""
    if not 1 <= batch <= 64 or not 1 <= tokens_per_row <= 64:
        raise ValueError("batch and tokens_per_row must be between 1 and 64")
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(batch * 100 + tokens_per_row)
    prefix_total = batch * prefix_len
    cache = model.new_cache(prefix_total + batch * tokens_per_row)
    # Fill the cache with B independent prefixes (one causal block each).
    prefix_ids = torch.randint(0, vocab, (prefix_total,), generator=gen)
    prefix_pos = torch.arange(prefix_len).repeat(batch)
    mask = torch.zeros(prefix_total, prefix_total, dtype=torch.bool)
    for b in range(batch):
        s = b * prefix_len
        mask[s : s + prefix_len, s : s + prefix_len] = torch.tril(torch.ones(prefix_len, prefix_len, dtype=torch.bool))
    model.forward(prefix_ids, prefix_pos, cache, mask=mask, logits_rows=torch.tensor([0]))
    rows = batch * tokens_per_row
    new_ids = torch.randint(0, vocab, (rows,), generator=gen)
    new_pos = (prefix_len + torch.arange(tokens_per_row)).repeat(batch)
    step_mask = torch.zeros(rows, prefix_total + rows, dtype=torch.bool)
    for b in range(batch):
        r = b * tokens_per_row
        step_mask[r : r + tokens_per_row, b * prefix_len : (b + 1) * prefix_len] = True
        block = torch.tril(torch.ones(tokens_per_row, tokens_per_row, dtype=torch.bool))
        step_mask[r : r + tokens_per_row, prefix_total + r : prefix_total + r + tokens_per_row] = block
    times = []
    for _ in range(repeats + 1):
        cache.length = prefix_total
        t0 = time.perf_counter()
        model.forward(new_ids, new_pos, cache, mask=step_mask)
        times.append((time.perf_counter() - t0) * 1000.0)
    times = sorted(times[1:])  # first call warms up
    return times[len(times) // 2]


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
    """Measured pass times at each batch size for 1 and K+1 tokens per row, plus the
    computed throughputs (tokens/s) with and without speculation at acceptance α."""
    pass_1, pass_k1 = [], []
    for i, b in enumerate(batch_sizes):
        pass_1.append(measure_pass_ms(model, b, 1, prefix_len, repeats))
        pass_k1.append(measure_pass_ms(model, b, k + 1, prefix_len, repeats))
        if progress is not None:
            progress(i + 1, len(batch_sizes))
    expected = expected_tokens_per_pass(alpha, k)
    plain = [b * 1000.0 / ms for b, ms in zip(batch_sizes, pass_1)]
    spec = [b * expected * 1000.0 / (ms + k * draft_ms_per_token) for b, ms in zip(batch_sizes, pass_k1)]
    return {
        "batch_sizes": list(batch_sizes),
        "k": k,
        "alpha": alpha,
        "draft_ms_per_token": draft_ms_per_token,
        "pass_ms_1": pass_1,  # measured
        "pass_ms_k1": pass_k1,  # measured
        "expected_tokens_per_pass": expected,  # computed from alpha
        "throughput_plain": plain,  # computed
        "throughput_speculative": spec,  # computed
    }
