"""One run's state between target passes (``DecodeState``: what the next pass needs, and the counts the loop
keeps) and one pass's result (``StepResult``: the draft, the verdict, the timings, what the step event records).

The loop in ``engine.decode`` owns both: it builds the state when a run starts, hands it to each pass and reads
each result into a step event. The pass itself (``engine.model.tree_pass``) is handed plain arguments by
``DecodeState.target_pass`` and returns what it measured; it never reads or writes this state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.drafters.adaptive import AdaptiveDepth
from engine.drafters.base import Drafter, DraftTree, TreeShape
from engine.model.static_pass import StaticPasses
from engine.model.transformer import KVCache, Transformer
from engine.model.tree_pass import TreePass, lazy_logits_pay, note_walk, target_pass
from engine.sampling import SamplingParams
from engine.verification import Verdict

__all__ = ["DecodeState", "StepResult"]


@dataclass
class DecodeState:
    """What one target pass needs: the committed context, the run's drafter, tree shape, sampling
    filters, random generator and the target's KV cache; how its passes run (strict: padded to
    `width` rows; static: the fixed-shape runner it holds; batch_chains: sampled chains verified in one
    batched call); its adaptive K policy (None: every pass drafts `shape`)."""

    context: list[int]
    drafter: Drafter
    shape: TreeShape
    params: SamplingParams
    gen: torch.Generator
    cache: KVCache
    strict: bool = False
    adaptive: AdaptiveDepth | None = None
    static: StaticPasses | None = None
    batch_chains: bool = False
    prefill_s: float = 0.0
    tops: bool = False  # the verifier keeps the top entries of p, q and the residual (full payloads draw them)
    verify: str = "token"  # a sampled chain's acceptance rule (GenerationSettings.verify)
    pass_path_reason: str = ""  # why the target's passes take the path they take (the finish metrics say it)
    # Chains longer than tree_pass.CHAIN_LOGITS_FIRST rows this run, and how many of them the walk read past those
    # rows (the verdict's path reached them): whether projecting the rest later pays (tree_pass.lazy_logits_pay)
    long_chains: int = 0
    long_chains_read_past: int = 0

    @property
    def width(self) -> int:
        """Tokens per target pass at most: the pending token plus the draft budget."""
        return self.shape.max_tokens + 1

    def target_pass(self, model: Transformer, tree: DraftTree, to_host: bool) -> TreePass:
        """The target's pass over the pending token and `tree` as this run makes it: in its cache (on its fixed-shape
        runner, if any), padded to `width` rows when strict, with the features its drafter reads, and a long chain's
        last rows left unprojected while that pays for the run so far (tree_pass.lazy_logits_pay)."""
        needs = self.drafter.needs
        return target_pass(
            model,
            self.cache,
            self.static,
            self.context[-1],
            tree.tokens,
            tree.depths,
            tree.parents,
            width=self.width if self.strict else None,
            features=needs.target_features,
            feature_layers=needs.feature_layers,
            to_host=to_host,
            lazy_ok=lazy_logits_pay(self.long_chains, self.long_chains_read_past),
        )

    def note_walk(self, verified: TreePass, accepted: int) -> None:
        """Count a verified pass in the run's long chains, and whether its walk (`accepted` drafts kept) read past
        their first rows (tree_pass.note_walk)."""
        counts = note_walk(self.long_chains, self.long_chains_read_past, verified.long_chain, accepted)
        self.long_chains, self.long_chains_read_past = counts

    @property
    def pass_path(self) -> tuple[str, str]:
        """How the run's target passes ran, and why: "cuda-graph" (recorded once per width, replayed), "static"
        (the fixed-shape path uncaptured; also after a capture failed, which the reason names) or "eager"."""
        if self.static is None:
            return "eager", self.pass_path_reason
        if self.static.capture_error:
            return "static", self.static.capture_error
        return ("cuda-graph" if self.static.capture else "static"), self.pass_path_reason


@dataclass
class StepResult:
    """One target pass: the draft tree, what verification decided, the timings, and the K this pass
    drafted with (the run's K, or the adaptive policy's; 0 without a drafter)."""

    tree: DraftTree
    verdict: Verdict
    draft_ms: float
    verify_ms: float
    k: int = 0
    kv: dict | None = None  # the target cache this pass: slots written, kept, rolled back, length after
    why: dict | None = None  # adaptive drafting: why this pass's K (AdaptiveDepth.why), else None

    @property
    def draft_info(self) -> dict:
        """The step event's ``draft``: the K used, why drafting stopped, the drafter's own facts (``DraftTree.facts``),
        and for adaptive drafting why the policy chose that K."""
        info = {"k": self.k, "stop": self.tree.stop, **self.tree.facts}
        if self.why is not None:
            info["why"] = self.why
        return info
