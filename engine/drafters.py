"""Drafters: cheap guessers of the next tokens, with one small interface.

A drafter ``propose``s a draft tree for the current context and is told
afterwards which path the target ``accept``ed, so it can roll back its own state
(a model drafter's KV cache) and learn (dynamic K). A chain of K tokens is the
tree with one child per node.

- ``ngram``: prompt lookup. The longest recent suffix (n = max..min) of
  prompt + generated text that occurred before proposes what followed it; several
  distinct earlier continuations become sibling branches. No model, q is a point
  mass on each proposal.
- ``model:<id or preset>``: an independent small model sharing the target's vocabulary.
- ``int8``: the target's own weights quantised to int8 (quantised self-speculation).
- ``none``: no drafts, the plain autoregressive baseline.

Tree shape (SGLang's knobs): ``steps`` = depth, ``topk`` = children per expanded
node and nodes expanded per depth, ``budget`` = total draft tokens kept.
``min_confidence`` (adaptive drafting, ``engine.adaptive``): stop drafting deeper once the
best node to expand has a cumulative confidence (q, calibrated by past acceptance) below it
(0 = never stop early).
Greedy decoding ranks nodes by cumulative draft probability (EAGLE-2 style).
Sampling draws the children of a node without replacement from q and decides
which nodes to keep from their sibling ranks only, never from the drawn values:
that keeps every sibling list a genuine without-replacement draw from q, which
the recursive rejection rule in ``acceptance.verify_children`` needs to be exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, probs_from_logits, sample_without_replacement
from .transformer import KVCache, Transformer

__all__ = ["DraftTree", "TreeShape", "Drafter", "NoDrafter", "NgramDrafter", "ModelDrafter"]


@dataclass(frozen=True)
class TreeShape:
    """steps: depth of the tree; topk: branching; budget: max draft tokens kept; min_confidence: a
    model drafter stops expanding deeper when the best frontier node's cumulative confidence is
    below it. A token's confidence is its q, or, with ``calibration`` (one acceptance rate per
    tenth of q, learnt by ``engine.adaptive.AdaptiveDepth`` from past verifications), the rate at
    which drafts of that q were accepted."""

    steps: int
    topk: int = 1
    budget: int | None = None
    min_confidence: float = 0.0
    calibration: tuple[float, ...] = ()

    def confidence(self, q_token: float) -> float:
        """A drafted token's chance of surviving verification, as far as the drafter can tell."""
        if not self.calibration:
            return q_token
        bins = len(self.calibration)
        return self.calibration[min(bins - 1, int(q_token * bins))]

    def __post_init__(self):
        for name in ("steps", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.steps <= 32:
            raise ValueError(f"draft depth (K / steps) must be between 1 and 32, got {self.steps}")
        if not 1 <= self.topk <= 16:
            raise ValueError(f"topk must be between 1 and 16, got {self.topk}")
        if self.budget is not None and (not isinstance(self.budget, int) or not 1 <= self.budget <= 256):
            raise ValueError(f"num_draft_tokens must be between 1 and 256, got {self.budget!r}")
        if not 0.0 <= self.min_confidence <= 1.0:  # also refuses NaN
            raise ValueError(f"min_confidence must be between 0 and 1, got {self.min_confidence!r}")

    @property
    def max_tokens(self) -> int:
        if self.budget is not None:
            return self.budget
        return self.steps if self.topk == 1 else self.topk * self.steps


@dataclass
class DraftTree:
    """Draft nodes in the order they were created (parents before children).

    parents[i] == -1 means node i hangs off the root, the last committed token.
    Siblings appear in the order they were drawn. q_dists maps a parent id (-1 for
    the root) to the drafter distribution its children were drawn from ([V]
    float32); a point-mass drafter (n-gram) has none. stop says why drafting ended
    where it did (``engine.adaptive.STOP_REASONS``), decided by the drafter.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    q_token: list[float] = field(default_factory=list)  # q(token) under the parent's q
    q_dists: dict[int, torch.Tensor] = field(default_factory=dict)
    point_mass: bool = False
    stop: str = "none"

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """One child per node (a tree mask would equal plain causal attention)."""
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path_to(self, node: int) -> list[int]:
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def subset(self, keep: list[int]) -> DraftTree:
        """The tree restricted to `keep` (must be closed under parents), renumbered."""
        keep = sorted(keep)
        remap = {old: new for new, old in enumerate(keep)}
        remap[-1] = -1
        tree = DraftTree(point_mass=self.point_mass, stop=self.stop)
        for old in keep:
            tree.tokens.append(self.tokens[old])
            tree.parents.append(remap[self.parents[old]])
            tree.depths.append(self.depths[old])
            tree.q_token.append(self.q_token[old])
        tree.q_dists = {remap[k]: v for k, v in self.q_dists.items() if k in remap}
        return tree


class Drafter:
    """Interface. Subclasses override propose (and accept / the cache hooks when they keep state)."""

    name = "none"
    point_mass = False

    def ensure_capacity(self, capacity: int) -> None:
        """Room for `capacity` tokens of context plus drafts in the drafter's own state."""

    def reset(self, prompt_ids: list[int]) -> None:
        """A new sequence starts."""

    def rewind(self, length: int) -> None:
        """Forget everything after the first `length` committed tokens (the labs
        roll back to the prompt between samples)."""

    def propose(self, context: list[int], shape: TreeShape, params: SamplingParams, gen: torch.Generator) -> DraftTree:
        raise NotImplementedError

    def accept(self, tree: DraftTree, path: list[int]) -> None:
        """The target kept `path` (node ids, root to leaf) of the last proposal."""

    # A drafter that reads the target's own features (the EAGLE head) sets this; the
    # decode loop then hands it the last layer's rows of every committed position the
    # target computed (the prompt at prefill, then the pending token and the accepted
    # path of each verification pass), so drafting costs no extra target work.
    reads_target_features = False
    # ... and, where it reads several layers (an EAGLE-3-style mix), which: layer indices, the
    # last layer last (Transformer.forward's feature_layers). None: the last layer alone.
    feature_layers: tuple[int, ...] | None = None

    def take_features(self, hidden: torch.Tensor, first_position: int) -> None:
        """hidden: [m, E] pre-norm last-layer rows of committed positions
        first_position .. first_position + m - 1 ([m, layers E] with feature_layers)."""

    def close(self) -> None:
        """Release per-run buffers."""


class NoDrafter(Drafter):
    """The baseline: nothing drafted, one target token per pass."""

    name = "none"

    def propose(self, context, shape, params, gen) -> DraftTree:
        return DraftTree()


class NgramDrafter(Drafter):
    """Prompt lookup over prompt + generated text.

    For n from max_ngram down to min_ngram, take the last n tokens of the context
    and look for earlier occurrences (most recent first, within `window` tokens);
    the first n with any match wins (longest match). Each distinct continuation
    found becomes a branch (up to topk), followed for up to `steps` tokens.
    Continuations stop before any of `stop_ids` (special tokens such as chat
    template markers), which the target would almost never accept as a draft.
    min_ngram defaults to 2: single-token matches ("the", a newline) propose
    continuations the target rarely accepts, and every rejected draft widens the
    verification pass (measured on the code-edit workload: 17.6 vs 14.8 tok/s).

    A draft is as long as its evidence: after an n-token match it copies at most
    `per_match` * n tokens (0: no limit, up to the pass's K). A 2-token match ("= ",
    "in the") is as often a coincidence as the start of a verbatim copy, and every
    rejected token widens the verification pass; the longer the match, the more
    often it is a verbatim copy. Replayed over the greedy outputs of the benchmark
    workloads with the AVX2 proxy's measured pass costs (ms for 1/2/4/8/16 tokens:
    7.0/8.4/11.6/16.9/31.2), K = 15 at most: speedup over the baseline chat 0.89 -> 1.10,
    code edit 1.60 -> 1.84, summarize 1.24 -> 1.38 for matches of up to 6 tokens with
    per_match = 2, against matches of up to 3 and no limit (drafted tokens on the code
    edits: 472 -> 393, the same number of passes). Measured interleaved, same outputs:
    AVX2 proxy 0.86 -> 1.05x, 1.44 -> 1.62x, 1.14 -> 1.29x; on avx512bf16, where a
    16-token pass costs 1.8x a one-token pass, unchanged (code edit 2.86 -> 2.85x);
    docs/bench/2026-12-01-per-match.md. The limit reads the context only, like the
    lookup: the draft is still a function of the past, so verification stays exact.
    """

    name = "ngram"
    point_mass = True

    def __init__(self, max_ngram: int = 6, min_ngram: int = 2, window: int = 1024, per_match: int = 2, stop_ids=()):
        if not (1 <= min_ngram <= max_ngram <= 16):
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max <= 16, got {min_ngram}..{max_ngram}")
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not 0 <= per_match <= 64:
            raise ValueError(f"per_match must be 0 (no limit) to 64 drafted tokens per matched token, got {per_match}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.window = window
        self.per_match = per_match
        self.stop_ids = frozenset(stop_ids)

    def find_continuations(self, context: list[int], length: int, max_branches: int) -> list[list[int]]:
        """Distinct continuations (each up to `length` tokens) of the longest matching suffix."""
        return self.match(context, length, max_branches)[0]

    def match(self, context: list[int], length: int, max_branches: int) -> tuple[list[list[int]], int]:
        """(find_continuations' branches, the length n of the suffix they continue; 0: no match)."""
        ctx = context[-self.window :]
        total = len(ctx)
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            suffix = ctx[total - n :]
            found: list[list[int]] = []
            seen_first: set[int] = set()
            # Most recent occurrence first; the suffix itself (at total - n) is excluded.
            for start in range(total - n - 1, -1, -1):
                if ctx[start : start + n] != suffix:
                    continue
                follow = ctx[start + n : start + n + length]
                for cut, token in enumerate(follow):
                    if token in self.stop_ids:  # never draft template markers or EOS
                        follow = follow[:cut]
                        break
                if not follow or follow[0] in seen_first:
                    continue
                seen_first.add(follow[0])
                found.append(follow)
                if len(found) >= max_branches:
                    break
            if found:
                return found, n
        return [], 0

    def propose(self, context, shape, params, gen) -> DraftTree:
        branches, n = self.match(context, shape.steps, shape.topk)
        # No confidence to consult: the draft is as deep as the longest continuation found, or
        # as the match vouches for (per_match tokens per matched token), whichever is shorter.
        vouched = self.per_match * n if self.per_match else shape.steps
        longest = max((len(branch) for branch in branches), default=0)
        if longest >= shape.steps and vouched >= shape.steps:
            stop = "depth"
        elif longest > vouched:
            stop = "short-match"
            branches = [branch[:vouched] for branch in branches]
        else:
            stop = "no-match"
        tree = DraftTree(point_mass=True, stop=stop)
        budget = shape.max_tokens
        for branch in branches:
            parent = -1
            for depth, token in enumerate(branch, start=1):
                if len(tree) >= budget:
                    tree.stop = "depth"  # the tree budget is full
                    return tree
                tree.tokens.append(int(token))
                tree.parents.append(parent)
                tree.depths.append(depth)
                tree.q_token.append(1.0)
                parent = len(tree) - 1
        return tree


# Static sibling-rank weights for sampling-mode trees: a node's score is the
# product of these along its path, so the kept set depends on ranks only.
_RANK_WEIGHT = [0.8, 0.3, 0.15, 0.08, 0.05, 0.03]


def _rank_weight(rank: int) -> float:
    return _RANK_WEIGHT[rank] if rank < len(_RANK_WEIGHT) else _RANK_WEIGHT[-1] * 0.5 ** (rank - len(_RANK_WEIGHT) + 1)


class ModelDrafter(Drafter):
    """A small causal LM (or the int8 copy of the target) drafting with its own KV cache."""

    def __init__(self, model: Transformer, name: str):
        self.model = model
        self.name = name
        self.cache: KVCache | None = None
        self._capacity = 0

    def reset(self, prompt_ids: list[int]) -> None:
        if self.cache is not None:
            self.cache.length = 0

    def ensure_capacity(self, capacity: int) -> None:
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = self.model.new_cache(capacity)

    def rewind(self, length: int) -> None:
        if self.cache is not None:
            self.cache.length = min(self.cache.length, length)

    def _q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return probs_from_logits(logits, params)  # [.., V] float32

    def _catch_up(self, context: list[int]) -> tuple[torch.Tensor, int]:
        """Feed the committed tokens the drafter has not seen (the prompt at the first
        step, then the target's extra token and any unseen accepted ones). Returns the
        logits [V] for the token after the context and the position the first draft
        node's slot follows (len(context))."""
        cache = self.cache
        base = cache.length
        new = context[base:]
        tokens = torch.tensor(new, dtype=torch.long)
        positions = torch.arange(base, base + len(new))
        logits = self.model.forward(tokens, positions, cache, logits_rows=torch.tensor([len(new) - 1]))
        return logits[0], cache.length

    def _expand(self, tree: DraftTree, frontier: list[int], positions: torch.Tensor, mask) -> torch.Tensor:
        """Feed the frontier nodes ([F] tokens at `positions`, tree `mask` or None for a
        chain) in one pass; returns their logits [F, V]."""
        feed = torch.tensor([tree.tokens[i] for i in frontier], dtype=torch.long)
        return self.model.forward(feed, positions, self.cache, mask=mask)

    def propose(self, context, shape, params, gen) -> DraftTree:
        if self.cache is None:
            raise RuntimeError(f"{type(self).__name__}.ensure_capacity must be called before propose")
        cache = self.cache
        root_logits, committed = self._catch_up(context)
        tree = DraftTree(stop="depth")
        slot_of: dict[int, int] = {}  # node -> cache slot, for nodes fed to the drafter
        score: list[float] = []
        path_q: list[float] = []  # cumulative confidence along each node's path (q, or calibrated q)
        frontier: list[int] = [-1]
        frontier_q = {-1: self._q(root_logits, params)}
        for depth in range(1, shape.steps + 1):
            level: list[int] = []
            for parent in frontier:
                q = frontier_q[parent]
                tree.q_dists[parent] = q
                if params.greedy:
                    children = torch.topk(q, shape.topk).indices.tolist()
                else:
                    children = sample_without_replacement(q, shape.topk, gen)
                parent_score = 1.0 if parent == -1 else score[parent]
                parent_q = 1.0 if parent == -1 else path_q[parent]
                for rank, token in enumerate(children):
                    q_tok = float(q[token])
                    tree.tokens.append(int(token))
                    tree.parents.append(parent)
                    tree.depths.append(depth)
                    tree.q_token.append(q_tok)
                    score.append(parent_score * (q_tok if params.greedy else _rank_weight(rank)))
                    path_q.append(parent_q * shape.confidence(q_tok))
                    level.append(len(tree) - 1)
            if depth == shape.steps:
                break
            # Expand the `topk` best nodes of this level (EAGLE-2), a chain expands one.
            level.sort(key=lambda i: -score[i])
            frontier = level[: shape.topk]
            frontier.sort()
            # Adaptive depth: a whole level gets children or none does (never a choice among
            # siblings by their drawn values), so every sibling list stays a full draw from q.
            if max(path_q[i] for i in frontier) < shape.min_confidence:
                tree.stop = "confidence"
                break
            # Feed the frontier to the drafter in one pass with a tree mask.
            start = cache.length
            pos = torch.tensor([committed - 1 + tree.depths[i] for i in frontier], dtype=torch.long)
            for offset, node in enumerate(frontier):
                slot_of[node] = start + offset
            mask = None  # a chain sees everything before it: plain causal attention
            if shape.topk > 1:
                mask = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool)  # moved by forward
                mask[:, :committed] = True
                for row, node in enumerate(frontier):
                    for anc in tree.path_to(node):
                        mask[row, slot_of[anc]] = True
            out = self._expand(tree, frontier, pos, mask)
            frontier_q = {node: self._q(out[row], params) for row, node in enumerate(frontier)}
        # Keep the budget's best nodes (ancestor-closed, since scores only shrink
        # along a path and ties are broken by creation order: parents first).
        keep = sorted(range(len(tree)), key=lambda i: (-score[i], i))[: shape.max_tokens]
        keep_set = set(keep)
        for node in list(keep):
            for anc in tree.path_to(node):
                keep_set.add(anc)
        kept = sorted(keep_set)
        self._last = (committed, kept, slot_of)
        return tree.subset(kept) if len(kept) < len(tree) else tree

    def accept(self, tree: DraftTree, path: list[int]) -> None:
        committed, kept, slot_of = self._last
        cache = self.cache
        offsets = []
        for node in path:
            original = kept[node]
            if original not in slot_of:
                break
            offsets.append(slot_of[original] - committed)
        cache.length = committed
        cache.keep(committed, offsets)

    def close(self) -> None:
        self.cache = None


def int8_weights(target: Transformer) -> Transformer:
    """Quantised self-speculation: the target's weights in int8 (weight-only, per channel)."""
    from .models import _state_from_transformer

    # On the CPU the drafter computes in float32 around fbgemm's int8 matmul
    # (elementwise bf16 ops are slow without native bf16, and the int8 kernel
    # takes float32 activations); elsewhere it keeps the target's dtype. The
    # drafter's precision does not affect exactness: q can be anything.
    act_dtype = torch.float32 if target.device.type == "cpu" else target.dtype
    return Transformer(target.cfg, _state_from_transformer(target), act_dtype, int8=True, device=target.device)
