"""The target's verify pass over a draft tree: the pending token and every draft node in one forward.

Row 0 is the pending token (the last committed one, not yet in the cache), row 1 + i is draft node i at
position base + depth(i). A chain's mask is plain causal attention (the model's causal path); a tree's
mask lets each node see the committed prefix and its own ancestors. A strict run (``GenerationSettings.strict``,
and every pass on the fixed-shape runner) pads every pass to the run's widest, attending over the whole
cache: shape-invariant passes, the same bits whatever the draft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.transformer import Transformer

if TYPE_CHECKING:  # (a DraftTree and the loop's DecodeState are read, never built, here)
    from engine.drafters.base import DraftTree

__all__ = ["CHAIN_LOGITS_FIRST", "lazy_logits_pay", "note_walk", "target_pass", "tree_mask"]


# A chain's verification reads the target's logits row by row and stops at the first rejection:
# rows past it are never used. On the CPU the lm_head product (49152 x 576 for the default model)
# is a large share of a wide pass, and up to a few rows it costs what one row costs (reading its
# 57 MB of weights). So a chain's pass computes the logits of its first
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


def note_walk(state, tree: DraftTree, accepted: int) -> None:
    """Count a verified chain longer than CHAIN_LOGITS_FIRST rows in the run's state, and whether its walk read
    past them (`accepted` drafts kept: the walk read row CHAIN_LOGITS_FIRST once it kept that many), lazy or not."""
    if tree.is_chain and len(tree) + 1 > CHAIN_LOGITS_FIRST:
        state.long_chains += 1
        state.long_chains_read_past += accepted >= CHAIN_LOGITS_FIRST


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


def tree_mask(tree: DraftTree, base: int, rows: int, span: int) -> torch.Tensor:
    """[rows, span] bool: the pending token (row 0) and node i (row 1 + i) see the committed prefix
    (slots < base + 1) and their own ancestors (slot base + 1 + ancestor); padding rows see slot 0."""
    n = len(tree)
    mask = torch.zeros(rows, span, dtype=torch.bool)
    mask[: 1 + n, : base + 1] = True
    for i in range(n):
        for anc in tree.path_to(i):
            mask[1 + i, base + 1 + anc] = True
    mask[1 + n :, 0] = True
    return mask


def target_pass(model: Transformer, state, tree: DraftTree, to_host: bool):
    """Logits [1 + n, V]: row 0 = the pending token, row 1 + i = draft node i (a long chain's
    on the CPU as _ChainLogits, projected when the walk reaches them); and the same rows'
    last-layer features [1 + n, E] when the drafter reads them (else None)."""
    needs = state.drafter.needs
    base, n = state.cache.length, len(tree)
    tokens = [state.context[-1]] + tree.tokens
    positions = [base] + [base + d for d in tree.depths]
    mask = attend_len = None
    # A chain's tree mask is plain causal attention: leave it to the model's causal path.
    if (n and not tree.is_chain) or state.strict:
        rows = state.width if state.strict else 1 + n
        attend_len = state.cache.capacity if state.strict else base + 1 + n
        mask = tree_mask(tree, base, rows, attend_len)
        tokens += [0] * (rows - 1 - n)  # strict: padding rows
        positions += [base] * (rows - 1 - n)
    features = needs.target_features
    layers = needs.feature_layers if features else None
    if state.static is not None:  # the same strict pass, in fixed buffers (replayed as a CUDA graph there)
        out = state.static.run(tokens, positions, mask, layers, features=features, to_host=to_host)
        return out.logits[: 1 + n], out.hidden[: 1 + n] if features else None
    # (only where the lm_head runs on our row-invariant kernel: torch's BLAS may round a row
    # differently in products of another height)
    lazy = tree.is_chain and mask is None and to_host and model.lm_head_on_kernel and n + 1 > CHAIN_LOGITS_FIRST
    lazy = lazy and lazy_logits_pay(state.long_chains, state.long_chains_read_past)
    out = model.run_pass(
        torch.tensor(tokens),
        torch.tensor(positions),
        state.cache,
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
        return _ChainLogits(model, out.logits, last), hidden
    return out.logits[: 1 + n], hidden
