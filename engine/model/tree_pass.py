"""The target's verify pass over a draft tree: the pending token and every draft node in one forward.

Row 0 is the pending token (the last committed one, not yet in the cache), row 1 + i is draft node i at
position base + depth(i). A chain's mask is plain causal attention (the model's causal path); a tree's
mask lets each node see the committed prefix and its own ancestors. A strict run (``GenerationSettings.strict``,
and every pass on the fixed-shape runner) pads every pass to the run's widest, attending over the whole
cache: shape-invariant passes, the same bits whatever the draft.

The pass takes the draft as plain lists (tokens, depths, parents) and what the run decided (strict width,
features, lazy chain logits), and returns what it measured (``TreePass``): it knows neither the drafters
nor the decode loop, whose state (and counts, ``note_walk``) stays the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.static_pass import StaticPasses
from engine.model.transformer import KVCache, Transformer

__all__ = ["CHAIN_LOGITS_FIRST", "TreePass", "lazy_logits_pay", "note_walk", "target_pass", "tree_mask"]


# A chain's verification reads the target's logits row by row and stops at the first rejection:
# rows past it are never used. On the CPU the lm_head product (49152 x 576 for the default model)
# is a large share of a wide pass, and up to a few rows it costs what one row costs (reading its
# weights once). So a chain's pass computes the logits of its first
# CHAIN_LOGITS_FIRST rows and keeps the rest as last-layer rows; the walk projects them, all in one
# product, only if it gets that far (row-invariant kernels: the same bits as an eager pass).
CHAIN_LOGITS_FIRST = 5  # chosen by measurement: docs/bench/2026-12-07-notes-from-kernels-and-model.md
# That pays only while most walks stop before those rows: a walk that reads past them pays for a second
# read of the projection's weights. Drafters whose drafts are nearly always accepted (q4, int8) read past
# them in most passes, so each run counts its long chains and projects every row at once while more than
# LAZY_READ_PAST_SHARE of them were read past (the choice changes no bit: row-invariant kernels).
LAZY_READ_PAST_SHARE = 0.25


def lazy_logits_pay(long_chains: int, read_past: int) -> bool:
    """Whether a long chain's pass should leave rows past CHAIN_LOGITS_FIRST unprojected, from this run's
    counts so far: its long chains and how many of them the walk read past those rows (a first pass: yes)."""
    return read_past <= LAZY_READ_PAST_SHARE * long_chains


def note_walk(long_chains: int, read_past: int, long_chain: bool, accepted: int) -> tuple[int, int]:
    """A run's counts (its long chains, how many of them the walk read past CHAIN_LOGITS_FIRST rows) after one
    more verified pass: counted when the pass was a long chain (``TreePass.long_chain``), read past when the walk
    kept `accepted` >= CHAIN_LOGITS_FIRST drafts (it then read that row), lazy or not."""
    if not long_chain:
        return long_chains, read_past
    return long_chains + 1, read_past + (accepted >= CHAIN_LOGITS_FIRST)


class _ChainLogits:
    """The logits [1 + n, V] of a chain's pass (see CHAIN_LOGITS_FIRST): the first rows computed
    with the pass, the others from their last-layer rows [rest, E] in one product the first time
    the walk reads one of them. Read row by row like a tensor: chain[i] -> [V] float32."""

    def __init__(self, model: Transformer, first: torch.Tensor, rest_hidden: torch.Tensor):
        self.model = model
        self.first = first  # [CHAIN_LOGITS_FIRST, V]
        self.rest_hidden = rest_hidden  # [1 + n - CHAIN_LOGITS_FIRST, E]
        self.rest: torch.Tensor | None = None  # [1 + n - CHAIN_LOGITS_FIRST, V] once projected

    def __len__(self) -> int:
        return self.first.shape[0] + self.rest_hidden.shape[0]

    def __getitem__(self, row: int) -> torch.Tensor:
        if row < self.first.shape[0]:
            return self.first[row]
        if self.rest is None:
            self.rest = self.model.logits_of(self.rest_hidden)
        return self.rest[row - self.first.shape[0]]


@dataclass(frozen=True)
class TreePass:
    """What one verify pass measured over the pending token and n draft nodes.

    logits:     [1 + n, V] float32, row 0 = the pending token, row 1 + i = node i (a lazy pass's as _ChainLogits)
    hidden:     [1 + n, E] (F E for a feature-layer mix) the same rows' features when asked, else None
    long_chain: the draft was a chain of more than CHAIN_LOGITS_FIRST rows (what ``note_walk`` counts)
    lazy:       its rows past CHAIN_LOGITS_FIRST stay unprojected until the walk reads one
    """

    logits: torch.Tensor | _ChainLogits
    hidden: torch.Tensor | None
    long_chain: bool
    lazy: bool


def tree_mask(parents: list[int], base: int, rows: int, span: int) -> torch.Tensor:
    """[rows, span] bool: the pending token (row 0) and node i (row 1 + i, its parent parents[i], -1: the root)
    see the committed prefix (slots < base + 1) and their own ancestors (slot base + 1 + ancestor); padding rows
    see slot 0."""
    n = len(parents)
    mask = torch.zeros(rows, span, dtype=torch.bool)
    mask[: 1 + n, : base + 1] = True
    for i in range(n):
        node = i
        while node != -1:  # node i and its ancestors
            mask[1 + i, base + 1 + node] = True
            node = parents[node]
    mask[1 + n :, 0] = True
    return mask


def target_pass(
    model: Transformer,
    cache: KVCache,
    static: StaticPasses | None,
    pending: int,
    tokens: list[int],
    depths: list[int],
    parents: list[int],
    *,
    width: int | None = None,
    features: bool = False,
    feature_layers: tuple[int, ...] | None = None,
    to_host: bool = True,
    lazy_ok: bool = True,
) -> TreePass:
    """One pass over the pending token and the draft (node i: tokens[i] at depth depths[i] under parents[i]).

    cache: the target's, its length the pending token's position; static: the run's fixed-shape runner (its
    passes are strict), or None. width: a strict pass's rows (padded to it, attending over the whole cache),
    None: 1 + n rows. features: return the rows' features too (of feature_layers, else the last layer's).
    to_host: the logits on the host (else on the model's device). lazy_ok: a long chain's pass may leave its
    last rows unprojected (on our row-invariant lm_head, to the host, without a mask: CHAIN_LOGITS_FIRST)."""
    base, n = cache.length, len(tokens)
    chain = all(parent == i - 1 for i, parent in enumerate(parents))
    long_chain = chain and n + 1 > CHAIN_LOGITS_FIRST
    tokens = [pending, *tokens]
    positions = [base] + [base + d for d in depths]
    mask = attend_len = None
    # A chain's tree mask is plain causal attention: leave it to the model's causal path.
    if (n and not chain) or width is not None:
        rows = 1 + n if width is None else width
        attend_len = base + 1 + n if width is None else cache.capacity
        mask = tree_mask(parents, base, rows, attend_len)
        tokens += [0] * (rows - 1 - n)  # strict: padding rows
        positions += [base] * (rows - 1 - n)
    layers = feature_layers if features else None
    if static is not None:  # the same strict pass, in fixed buffers (replayed as a CUDA graph there)
        out = static.run(tokens, positions, mask, layers, features=features, to_host=to_host)
        return TreePass(out.logits[: 1 + n], out.hidden[: 1 + n] if features else None, long_chain, False)
    # (only where the lm_head runs on our row-invariant kernel: torch's BLAS may round a row
    # differently in products of another height)
    lazy = long_chain and lazy_ok and mask is None and to_host and model.lm_head_on_kernel
    out = model.run_pass(
        torch.tensor(tokens),
        torch.tensor(positions),
        cache,
        mask=mask,
        attend_len=attend_len,
        to_host=to_host,
        features=features or lazy,
        logits_rows=torch.arange(CHAIN_LOGITS_FIRST) if lazy else None,
        feature_layers=layers,
    )
    hidden = out.hidden[: 1 + n] if features else None
    if lazy:  # (the last layer's rows: the last E columns of a feature-layer mix)
        last = out.hidden[CHAIN_LOGITS_FIRST : 1 + n, -model.cfg.hidden_size :]
        return TreePass(_ChainLogits(model, out.logits, last), hidden, long_chain, True)
    return TreePass(out.logits[: 1 + n], hidden, long_chain, False)
