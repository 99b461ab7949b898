"""The drafter interface: the draft tree, its shape, and the baseline that drafts nothing.

A drafter ``propose``s a draft tree for the current context and is told
afterwards which path the target ``accept``ed, so it can roll back its own state
(a model drafter's KV cache) and learn (dynamic K). A chain of K tokens is the
tree with one child per node. The drafters themselves: ``ngram`` (prompt lookup),
``model`` (``model:<id>`` and ``int8``), ``eagle`` (a learned head); ``adaptive``
chooses each pass's K; ``none`` is ``NoDrafter`` below.

Tree shape (SGLang's knobs): ``steps`` = depth, ``topk`` = children per expanded
node and nodes expanded per depth, ``budget`` = total draft tokens kept.
``min_confidence`` (adaptive drafting, ``engine.drafters.adaptive``): stop drafting deeper once the
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

from engine.sampling import SamplingParams

__all__ = ["DraftTree", "TreeShape", "Drafter", "NoDrafter"]


@dataclass(frozen=True)
class TreeShape:
    """steps: depth of the tree; topk: branching; budget: max draft tokens kept; min_confidence: a
    model drafter stops expanding deeper when the best frontier node's cumulative confidence is
    below it. A token's confidence is its q, or, with ``calibration`` (one acceptance rate per
    tenth of q, learnt by ``engine.drafters.adaptive.AdaptiveDepth`` from past verifications), the rate at
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
    where it did (``engine.drafters.adaptive.STOP_REASONS``), decided by the drafter.
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
    drafts = True  # False only for the baseline: no drafts, one target token per pass

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

    # A drafter that runs passes of a model of its own (int8 copy, draft model, EAGLE head) names it, and
    # takes the engine's fixed-shape runner of that model for the run (`static`: the decode loop hands it
    # over where the target's passes are graph-captured). None: it runs no model pass (n-gram, suffix).
    pass_model = None
    static = None

    def take_features(self, hidden: torch.Tensor, first_position: int) -> None:
        """hidden: [m, E] pre-norm last-layer rows of committed positions
        first_position .. first_position + m - 1 ([m, layers E] with feature_layers)."""

    def close(self) -> None:
        """Release per-run buffers."""


class NoDrafter(Drafter):
    """The baseline: nothing drafted, one target token per pass."""

    name = "none"
    drafts = False

    def propose(self, context, shape, params, gen) -> DraftTree:
        return DraftTree()
