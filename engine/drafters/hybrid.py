"""The hybrid drafter, ``COPY/MODEL[:DEPTH]`` (``suffix/q4``, ``ngram/q4``, ``suffix/int8:3``): each pass, the
copying drafter's proposal or the model drafter's chain, whichever this run has measured to give more tokens per
ms; where copying pays but has no match, the model bridges the gap and the copying drafter continues.

Why: a copying drafter (n-gram, suffix) costs nothing, and where the answer copies the prompt or an earlier answer
it proposes long runs that the target keeps; on open chat its rare proposals are short and mostly rejected, and a
model drafter (q4) pays there instead. One answer moves between the two (a summary copies a phrase, then writes its
own words). SuffixDecoding (Oliaro et al., arXiv 2411.04975) runs suffix speculation where it scores well and a
model drafter elsewhere; vLLM's Arctic Inference ships that hybrid. Which side pays differs by text and by host
(docs/bench/2026-12-06-hybrid.md), so the pick is made from the run's own measurements, not from a fixed rule.

The pick, once per pass, here (recorded in the step event's ``draft.hybrid``)::

    proposal   the copying drafter's tree for this context (its own rules decide its length; empty: no match)
    speed      per side, tokens committed per pass over ms per pass (propose to accept), recency-weighted
               (HYBRID_RECENCY per pass; the copying side's tokens start from one, COPY_PRIOR_TOKENS):
                 model  its own chains
                 copy   its own passes and bridges; and on each pass the model drafted, what the copying proposal
                        would have committed (its tokens that match the committed ones, plus the target's token
                        after them), priced at a copy pass's ms (before any ran: the model's less its drafting)
    rule       copy pays: its speed is at least the model's, or either side is not measured yet
                 a proposal, and copy pays             the proposal (up to K tokens)
                 no proposal, both measured, copy pays a bridge: the model drafts one level at a time (at most
                                                       DEPTH), asking the copying drafter after each; where it
                                                       matches, its proposal continues the chain (up to K)
                 otherwise                             the model's chain of min(K, DEPTH) levels (one call)

A copying drafter's drafts are point masses, so the matched count on a model pass has the law of the count a copy
pass would have kept, cut where the committed run ends (under the exact rule x1 is kept with probability p(x1), the
probability that the target's own token is x1, and so on): the copy side keeps learning while the model drafts. A
bridge is measured as a copy pass: bridges that pay less than the model's own chains turn the run back to them.

Why verification stays exact: each drafted token is drawn from the q handed on with it, given the tokens before it
(a copied token, a function of those, is handed on as a point mass, q = 1 on it, which the rule treats exactly).
Which drafter proposes, and where a bridge hands over, depend on the committed tokens, the drafts before and past
timings, never on what is drawn after: the target's rule (engine/acceptance.py) then gives the target's distribution
whatever the pick. K is the most a pass drafts: a copying proposal's depth, while the model drafts at most DEPTH
levels (its own best depth: deeper chains cost more drafting than they save). Trees (topk > 1): a proposal or the
model's tree, no bridge. ``--adaptive`` is refused with a hybrid: the pick is already its own per-pass policy.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from engine.drafters.base import DraftContext, Drafter, DrafterNeeds, DraftTree, TreeShape, Verified
from engine.drafters.model import ModelDrafter
from engine.drafters.spec import DrafterSpec, Family, family, parse, part, register

__all__ = ["DEFAULT_DEPTH", "FAMILY", "HybridDrafter", "parse_hybrid"]

# The model's chain depth when the spec gives none: the q4 rows' K (docs/bench/README.md); an int8 model pays
# most at a shallower depth (give suffix/int8:3).
DEFAULT_DEPTH = 6  # chosen by measurement: docs/bench/2026-12-07-notes-from-engine.md
# How fast the pick forgets: each side's means weigh a new pass by 1 - HYBRID_RECENCY (faster than adaptive depth's
# RECENCY, 0.9: a run's first copying proposals decide whether it copies, within its first few passes), and the
# copying side starts from one token a pass (what a pass commits when nothing drafted is kept), so that one lucky
# copy pass on open chat does not turn the run to copying (measured: docs/bench/2026-12-06-hybrid.md).
HYBRID_RECENCY = 0.7
LABEL = "COPY/MODEL (hybrid)"
COPY_PRIOR_TOKENS = 1.0


def parse_hybrid(text: str) -> DrafterSpec:
    """``COPY/MODEL[:DEPTH]``: COPY a copying drafter (they never hold a '/', so the first one splits), MODEL a model
    drafter (whose id may hold '/'), DEPTH 1-32."""
    copy_text, model_text = (piece.strip() for piece in text.split("/", 1))
    depth = DEFAULT_DEPTH
    head, _, tail = model_text.rpartition(":")
    if head and tail.strip().isdigit():
        try:
            if family(parse(head).family).kind == "model":
                model_text, depth = head, int(tail)
        except ValueError:
            pass
    copy = part(copy_text, ("copying",), "before the '/'", text, LABEL)
    model = part(model_text, ("model",), "after the '/'", text, LABEL)
    if not 1 <= depth <= 32:
        raise ValueError(f"a hybrid drafter's model depth must be between 1 and 32, got {depth} in {text!r}")
    return DrafterSpec(text, "hybrid", model=model, copy=copy, depth=depth)


class _Side:
    """One side's recency-weighted tokens and ms per pass (None: no pass yet)."""

    __slots__ = ("tokens", "ms")

    def __init__(self) -> None:
        self.tokens: float | None = None
        self.ms: float | None = None

    def add(self, tokens: float, ms: float | None) -> None:
        self.tokens = tokens if self.tokens is None else HYBRID_RECENCY * self.tokens + (1 - HYBRID_RECENCY) * tokens
        if ms is not None:
            self.ms = ms if self.ms is None else HYBRID_RECENCY * self.ms + (1 - HYBRID_RECENCY) * ms

    def speed(self, ms: float | None = None) -> float | None:
        """Tokens per ms: its own ms, or `ms` where it has none."""
        ms = self.ms if self.ms is not None else ms
        if self.tokens is None or not ms:
            return None
        return self.tokens / ms


class HybridDrafter(Drafter):
    """Each pass, the copying drafter's proposal or the model drafter's chain (module docstring)."""

    def __init__(self, name: str, copy: Drafter, model: Drafter, depth: int = DEFAULT_DEPTH):
        if not copy.needs.point_mass:
            raise ValueError(f"the first drafter of {name!r} must be a copying drafter (ngram or suffix)")
        if not isinstance(model, ModelDrafter) or model.needs.target_features:
            raise ValueError(f"the second drafter of {name!r} must be a model drafter (int8, q4, model:<id>)")
        self.name, self.copy, self.model, self.depth = name, copy, model, depth
        self.needs = DrafterNeeds(model=model.needs.model, target_kv=model.needs.target_kv)
        self._reset()

    def _reset(self) -> None:
        self._copy_side, self._model_side = _Side(), _Side()
        self._copy_side.tokens = COPY_PRIOR_TOKENS
        self._model_draft_ms: float | None = None  # the model passes' drafting, recency-weighted
        self._used: Drafter | None = None
        self._started = 0.0
        self._draft_ms = 0.0
        self._unused: tuple[list[int], int] | None = None  # a model pass's copy proposal, and where it began
        self._continued = 0  # the copied tokens that continued the model's bridge this pass
        self._bridged = False  # this pass is a bridge (the model's tokens, then the copying drafter's)
        self._model_nodes = 0  # the bridge's model tokens (its first nodes)

    def start(self, prompt_ids, capacity, runner=None, features=None, target_cache=None) -> None:
        self._reset()
        self.copy.start(prompt_ids, capacity)
        self.model.start(prompt_ids, capacity, runner, features, target_cache)

    def speeds(self) -> dict:
        """{"copy", "model"}: the tokens per ms each side is expected to give (None: not measured yet)."""
        verify_ms = None
        if self._model_side.ms is not None and self._model_draft_ms is not None:
            verify_ms = max(self._model_side.ms - self._model_draft_ms, 1e-3)
        return {"copy": self._copy_side.speed(verify_ms), "model": self._model_side.speed()}

    def _settle(self, tokens: list[int]) -> None:
        """The copy side's share of the model pass just verified: its proposal against the committed tokens."""
        if self._unused is None:
            return
        proposal, begin = self._unused
        self._unused = None
        committed = tokens[begin:]  # the accepted drafts and the target's own token (the new pending one)
        matched = 0
        while matched < min(len(proposal), len(committed)) and proposal[matched] == committed[matched]:
            matched += 1
        self._copy_side.add(matched + 1 if matched < len(committed) else len(committed), None)

    def _copy_chain(self, tokens: list[int], room: int) -> list[int]:
        """The copying drafter's chain continuing `tokens`, at most `room` tokens ([]: no match)."""
        shape = TreeShape(k=room)
        tree = self.copy.propose(DraftContext(tokens, shape))
        return tree.first_chain()[:room]

    def propose(self, context: DraftContext) -> DraftTree:
        self._settle(context.tokens)
        self._started = time.perf_counter()
        self._continued, self._bridged = 0, False
        proposal = self.copy.propose(context)
        speeds = self.speeds()
        copy, model = speeds["copy"], speeds["model"]
        depth = min(context.shape.k, self.depth)
        if len(proposal) and (copy is None or model is None or copy >= model):
            self._used, tree = self.copy, proposal
        elif copy is not None and model is not None and copy >= model and context.shape.topk == 1:
            # copying pays in this run but has no match here (a code edit's changed token): the model bridges
            # the gap level by level, and the copying drafter continues the chain where it matches again
            self._used = self.model
            tree = self._bridge(context, depth)
        else:
            self._used = self.model
            shape = dataclasses.replace(context.shape, k=depth)
            tree = self.model.propose(dataclasses.replace(context, shape=shape))
            self._draft_ms = (time.perf_counter() - self._started) * 1000.0
        if len(proposal) and self._used is self.model:  # (its chain: the first branch of a copying tree)
            chain = proposal.first_chain()
            self._unused = (chain, len(context.tokens))
        tree.facts["hybrid"] = {
            "picked": self._used.name,
            "proposed": len(proposal),  # the copying drafter's proposal here (0: none)
            "bridged": self._bridged,  # the model bridged a gap in copying (its tokens, then the copying drafter's)
            "continued": self._continued,  # tokens the copying drafter added after the model's bridge
            "speeds": {side: None if v is None else round(v, 4) for side, v in speeds.items()},
        }
        return tree

    def _bridge(self, context: DraftContext, depth: int) -> DraftTree:
        """The model's chain one level at a time (at most `depth`), asking the copying drafter after each
        level; where it matches, its proposal continues the chain (up to K tokens in all). The model's tokens
        carry the model's q; the copied ones a point mass as a distribution (q = 1 on the token), which the
        exact rule treats as it treats a copying drafter's point masses. Every token is drawn from the q handed
        on given the tokens before it (the copied ones are a function of them), so verification stays exact."""
        k, one = context.shape.k, dataclasses.replace(context.shape, k=1)
        tree = DraftTree(stop="depth", facts={"model_passes": 0})
        drafted: list[int] = []
        while len(drafted) < depth:
            level = self.model.propose(dataclasses.replace(context, tokens=context.tokens + drafted, shape=one))
            tree.facts["model_passes"] += level.facts.get("model_passes", 0)
            if not len(level):  # (a model drafter always drafts; kept for safety)
                break
            q = level.q_dists[-1]  # [V]: the model's q at this level
            self._append(tree, drafted, level.tokens[0], level.q_token[0], q)
            room = k - len(drafted)
            copied = self._copy_chain(context.tokens + drafted, room) if room else []
            if copied:
                for token in copied:
                    point = torch.zeros_like(q)  # [V]: q = 1 on the copied token
                    point[token] = 1.0
                    self._append(tree, drafted, token, 1.0, point)
                self._continued = len(copied)
                break
        # The model's own slots: its j-th token sits at committed + j (fed by the next level's pass), as in a chain.
        committed = len(context.tokens)
        n_model = len(drafted) - self._continued
        self.model.hold_chain(committed, n_model)
        self._model_nodes, self._bridged = n_model, True
        self._draft_ms = (time.perf_counter() - self._started) * 1000.0
        return tree

    @staticmethod
    def _append(tree: DraftTree, drafted: list[int], token: int, q_token: float, q: torch.Tensor) -> None:
        parent = len(tree) - 1
        tree.q_dists[parent] = q
        tree.tokens.append(int(token))
        tree.parents.append(parent)
        tree.depths.append(len(tree.tokens))
        tree.q_token.append(float(q_token))
        drafted.append(int(token))

    def accept(self, verified: Verified) -> None:
        ms = (time.perf_counter() - self._started) * 1000.0
        tokens = len(verified.path) + 1  # the accepted drafts and the target's own token
        if self._used is self.copy:
            self.copy.accept(verified)
            self._copy_side.add(tokens, ms)
            return
        if self._bridged:  # the model keeps its own accepted tokens' slots; the copied ones it never fed
            path = [node for node in verified.path if node < self._model_nodes]
            self.model.accept(dataclasses.replace(verified, path=path))
            # A bridge is how the copying side drafts where it has no match: measured as one of its passes, so
            # bridges that pay less than the model's own chains turn the run back to the model
            self._copy_side.add(tokens, ms)
            return
        self.model.accept(verified)
        self._model_side.add(tokens, ms)
        d = self._draft_ms
        self._model_draft_ms = (
            d if self._model_draft_ms is None else HYBRID_RECENCY * self._model_draft_ms + (1 - HYBRID_RECENCY) * d
        )

    def rewind(self, length: int) -> None:
        self.copy.rewind(length)
        self.model.rewind(length)
        self._unused = None

    def close(self) -> None:
        self.copy.close()
        self.model.close()


def _build(spec: DrafterSpec, registry, history) -> HybridDrafter:
    return HybridDrafter(spec.text, registry.build(spec.copy, history), registry.build(spec.model), spec.depth)


FAMILY = register(
    Family(
        "hybrid",
        label=LABEL,
        help="each pass, the copying drafter's proposal or the model drafter's chain, whichever measures faster",
        form="COPY/MODEL[:DEPTH]",
        build=_build,
        kind="composite",
        parse=parse_hybrid,
        join="/",
        unserved="a hybrid (each pass, a copying drafter's proposal or a model drafter's chain, whichever measures "
        "faster) is SpecLens's here; Arctic Inference pairs suffix decoding with its own speculator in vLLM, not "
        "with a drafter of your choice: the closest is the copying drafter alone",
        adaptive=False,
        order=60,
        menu=(
            (
                "suffix/q4 (hybrid: suffix's proposal or q4's guesses, each pass the one measured faster)",
                "suffix/q4",
            ),
        ),
    )
)
