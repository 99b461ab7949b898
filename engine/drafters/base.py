"""The drafter interface: the draft tree, its shape, and the baseline that drafts nothing.

A drafter ``propose``s a draft tree for the current context and is told
afterwards which path the target kept (``accept``), so it can roll back its own state
(a model drafter's KV cache) and learn. What it needs from the loop besides (the
target's features, a runner for its own model) it declares once in ``needs``. A chain of K tokens is the
tree with one child per node. Each kind of drafter is a family (``engine.drafters.spec``), built by spec in
``engine.drafters.registry``; ``none`` is ``NoDrafter`` below.

Tree shape (SGLang's knobs): ``k`` = depth (SGLang's steps), ``topk`` = children per expanded
node and nodes expanded per depth, ``num_draft_tokens`` = total draft tokens kept.
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

from engine.drafters.spec import BASELINE, Family, Serving, register
from engine.sampling import SamplingParams

__all__ = [
    "BASELINE_FAMILY",
    "DraftContext",
    "DraftTree",
    "Drafter",
    "DrafterNeeds",
    "NoDrafter",
    "TreeShape",
    "Verified",
]


@dataclass(frozen=True)
class TreeShape:
    """k: depth of the tree (K: a chain drafts K tokens); topk: branching; num_draft_tokens: the most draft
    tokens kept (None: K × topk, ``max_tokens`` is the number in force); min_confidence: a
    model drafter stops expanding deeper when the best frontier node's cumulative confidence is
    below it. A token's confidence is its q, or, with ``calibration`` (one acceptance rate per
    tenth of q, learnt by ``engine.drafters.adaptive.AdaptiveDepth`` from past verifications), the rate at
    which drafts of that q were accepted."""

    k: int
    topk: int = 1
    num_draft_tokens: int | None = None
    min_confidence: float = 0.0
    calibration: tuple[float, ...] = ()

    def confidence(self, q_token: float) -> float:
        """A drafted token's chance of surviving verification, as far as the drafter can tell."""
        if not self.calibration:
            return q_token
        bins = len(self.calibration)
        return self.calibration[min(bins - 1, int(q_token * bins))]

    def sure_levels(self, depth: int, path_confidence: float) -> int:
        """How many levels from `depth` on (at most to K) a chain is sure to draft, path_confidence being
        the product of its confidences before `depth`: this level, and each deeper one whose parent's
        path cannot fall below min_confidence whatever is drafted. Every confidence is at least the
        smallest calibrated rate (0 for a raw q), and a product of floats never grows when a factor
        shrinks, so the bound, multiplied level by level as the chain multiplies, is exact. K - depth + 1
        without a threshold."""
        floor = min(self.calibration) if self.calibration else 0.0
        levels, bound = 1, path_confidence
        while depth + levels <= self.k:
            bound *= floor
            if bound < self.min_confidence:
                break
            levels += 1
        return levels

    def __post_init__(self):
        for name in ("k", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.k <= 32:
            raise ValueError(f"draft depth K must be between 1 and 32, got {self.k}")
        if not 1 <= self.topk <= 16:
            raise ValueError(f"topk must be between 1 and 16, got {self.topk}")
        budget = self.num_draft_tokens
        if budget is not None and (not isinstance(budget, int) or not 1 <= budget <= 256):
            raise ValueError(f"num_draft_tokens must be between 1 and 256, got {budget!r}")
        if not 0.0 <= self.min_confidence <= 1.0:  # also refuses NaN
            raise ValueError(f"min_confidence must be between 0 and 1, got {self.min_confidence!r}")

    @property
    def max_tokens(self) -> int:
        """The num_draft_tokens in force: as given, else K × topk."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        return self.k if self.topk == 1 else self.topk * self.k


@dataclass
class DraftTree:
    """Draft nodes in the order they were created (parents before children).

    parents[i] == -1 means node i hangs off the root, the last committed token.
    Siblings appear in the order they were drawn. q_dists maps a parent id (-1 for
    the root) to the drafter distribution its children were drawn from ([V]
    float32); a point-mass drafter (n-gram) has none. stop says why drafting ended
    where it did (``engine.drafters.adaptive.STOP_REASONS``), decided by the drafter.
    facts: the drafter's own record of this draft, plain JSON values that the step event's ``draft`` copies
    (docs/events.md): a model drafter's ``model_passes`` (its own passes, the catch-up included), drafts of
    drafts' ``copied``, a hybrid's ``hybrid`` pick.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    q_token: list[float] = field(default_factory=list)  # q(token) under the parent's q
    q_dists: dict[int, torch.Tensor] = field(default_factory=dict)
    point_mass: bool = False
    stop: str = "none"
    facts: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """One child per node (a tree mask would equal plain causal attention)."""
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def first_chain(self) -> list[int]:
        """The tokens of the chain from the root through each node's first child (a chain's tokens; a copying
        drafter's tree: its best continuation, nodes 0, 1, ... while each is one deeper than the one before)."""
        return [self.tokens[i] for i in range(len(self)) if self.depths[i] == i + 1]

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
        tree = DraftTree(point_mass=self.point_mass, stop=self.stop, facts=dict(self.facts))
        for old in keep:
            tree.tokens.append(self.tokens[old])
            tree.parents.append(remap[self.parents[old]])
            tree.depths.append(self.depths[old])
            tree.q_token.append(self.q_token[old])
        tree.q_dists = {remap[k]: v for k, v in self.q_dists.items() if k in remap}
        return tree


@dataclass(frozen=True)
class DrafterNeeds:
    """What a drafter needs from the decode loop, declared once; the loop hands it over and never writes
    into the drafter.

    target_features: the target's own rows of every committed position it computed (the prompt at
        prefill, then the pending token and the accepted path of each pass): ``start``'s and
        ``Verified.features``; drafting then costs no extra target work (the EAGLE head).
    feature_layers: where it reads several target layers (an EAGLE-3-style mix), which: layer indices, the
        last layer last (``Transformer.run_pass(feature_layers=...)``); None: the last layer alone.
    model: the weights it runs passes of (the int8 copy, a draft model, the EAGLE head's layer); the loop
        hands it that model's fixed-shape runner for the run where the target's passes are fixed-shape
        (``start``'s runner). None: it runs no model pass (n-gram, suffix).
    point_mass: its drafts are point masses (q = 1 on the drafted token: n-gram, suffix).
    target_kv: its model has the target's layer shapes (a quantised copy of the target: q4), and it reads the
        committed positions' keys and values from the target's KV cache (``start``'s target_cache, read only)
        instead of computing them itself: no prefill of its own, and one row per catch-up (QSpec-style KV
        sharing). q is still a function of the committed tokens alone, so verification stays exact."""

    target_features: bool = False
    feature_layers: tuple[int, ...] | None = None
    model: object = None  # engine.model.transformer.Transformer (not imported: base stays a leaf)
    point_mass: bool = False
    target_kv: bool = False


@dataclass
class DraftContext:
    """What ``Drafter.propose`` drafts from: the committed tokens (the last one is pending: the target
    has not run it yet), this pass's tree shape, the run's sampling filters and random generator."""

    tokens: list[int]
    shape: TreeShape
    params: SamplingParams = field(default_factory=SamplingParams)
    gen: torch.Generator | None = None


@dataclass
class Verified:
    """What the target decided about the drafter's last proposal: ``tree`` with ``path`` (accepted node
    ids, root to leaf) kept; with ``needs.target_features``, ``features`` [1 + len(path), E] (or
    [1 + len(path), layers E]) are the target's pre-norm rows of the committed positions
    first_position .. first_position + len(path): the pending token's and the accepted path's."""

    tree: DraftTree
    path: list[int]
    features: torch.Tensor | None = None
    first_position: int = 0


class Drafter:
    """The interface: two methods (``propose`` a draft tree; ``accept`` what the target kept) around one
    run's lifetime (``start`` a sequence, ``close``), and one ``needs`` record.

    ``rewind`` (optional) forgets what followed a prefix: the labs roll back to the prompt between
    samples instead of starting again."""

    name = "none"
    drafts = True  # False only for the baseline: no drafts, one target token per pass
    needs = DrafterNeeds()

    def start(
        self,
        prompt_ids: list[int],
        capacity: int,
        runner=None,
        features: torch.Tensor | None = None,
        target_cache=None,
    ) -> None:
        """A new sequence: room for `capacity` tokens of context plus drafts in the drafter's own state.
        runner: a fixed-shape runner of ``needs.model`` (``engine.model.static_pass.StaticPasses``) held for
        this run, the drafter's to release at ``close``, or None; features: with ``needs.target_features``, the
        target's rows [len(prompt_ids) - 1, E] of the prompt's positions but the pending one; target_cache: with
        ``needs.target_kv``, the target's KV cache for this run (read only; its first ``length`` slots are the
        committed positions but the pending one, whenever ``propose`` is called)."""

    def propose(self, context: DraftContext) -> DraftTree:
        raise NotImplementedError

    def accept(self, verified: Verified) -> None:
        """The target kept ``verified.path`` of the last proposal (roll back, learn)."""

    def skipped(self, verified: Verified) -> None:
        """A plain pass ran without asking this drafter (adaptive drafting chose K = 0): the target committed
        the pending token; ``verified`` carries that pass's features. By default nothing: the next ``propose``
        catches up on the committed tokens the drafter has not seen."""

    def rewind(self, length: int) -> None:
        """Forget everything after the first `length` committed tokens."""

    def close(self) -> None:
        """Release per-run buffers and any runner held."""


class NoDrafter(Drafter):
    """The baseline: nothing drafted, one target token per pass."""

    name = "none"
    drafts = False

    def propose(self, context: DraftContext) -> DraftTree:
        return DraftTree()


BASELINE_FAMILY = register(
    Family(
        BASELINE,
        label="none (baseline: no drafting)",
        help="no drafter: one target pass per token, the run every speedup is measured against",
        form="none",
        build=lambda spec, registry, history: NoDrafter(),
        kind="baseline",
        serving=Serving("none"),
        order=0,
    )
)
