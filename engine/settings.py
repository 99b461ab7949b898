"""What a run depends on: ``GenerationSettings``, validated once before anything loads or runs.

The CLI builds them from its arguments (``engine.cli.settings_from_args``), the app from its controls
(``app/engine_access.py``), the API from its request; the decode loop only reads them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.drafters.adaptive import AdaptiveDepth, check_min_confidence
from engine.drafters.base import TreeShape
from engine.sampling import SamplingParams

__all__ = ["MAX_HISTORY_DOCS", "MAX_NEW_TOKENS", "VERIFY_RULES", "GenerationSettings", "check_history"]

MAX_NEW_TOKENS = 4096
VERIFY_RULES = ("token", "block")  # GenerationSettings.verify: the acceptance rule of a sampled chain


MAX_HISTORY_DOCS = 16
MAX_HISTORY_CHARS = 200_000


def check_history(value) -> tuple:
    """Earlier answers as a tuple of texts or of token-id lists (like a prompt), at most MAX_HISTORY_DOCS
    and MAX_HISTORY_CHARS characters (or tokens) in all; else a ValueError saying what is wrong."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"history must be a list of earlier answers (strings), got {type(value).__name__}")
    if len(value) > MAX_HISTORY_DOCS:
        raise ValueError(f"history holds at most {MAX_HISTORY_DOCS} earlier answers, got {len(value)}")
    docs = []
    for doc in value:
        if isinstance(doc, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in doc):
            doc = tuple(doc)
        elif not isinstance(doc, str):
            raise ValueError("history must be a list of earlier answers: strings, or lists of token ids")
        docs.append(doc)
    if sum(len(doc) for doc in docs) > MAX_HISTORY_CHARS:
        raise ValueError(f"history is longer than {MAX_HISTORY_CHARS} characters in all")
    return tuple(docs)


@dataclass
class GenerationSettings:
    """Everything a run depends on. Validated by ``validate``; bad values raise ValueError."""

    max_new_tokens: int = 64
    k: int = 4  # draft depth (SGLang's --steps); a chain drafts K tokens
    topk: int = 1  # branching per node; 1 = chain
    num_draft_tokens: int | None = None  # tree budget; None = K * topk
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    chat: bool = True
    payload: str = "full"  # "full" (top-k of p and q, token texts), "reduced", or "off" (start and finish only)
    strict: bool = False  # shape-invariant target passes: bitwise greedy parity in any dtype
    max_prompt_tokens: int | None = None
    # Drafting that adapts (engine.drafters.adaptive): each pass drafts the depth in [1, k] with the most expected
    # tokens per measured ms, and a model drafter stops deeper when its best path's calibrated cumulative
    # q is below adaptive_min_confidence.
    adaptive: bool = False
    adaptive_min_confidence: float = 0.3
    # Earlier answers of the session (texts, oldest first) that the suffix drafter may draft from; other
    # drafters ignore them. The app passes the session's own answers, never another session's.
    history: tuple = ()  # of str, or of token-id tuples
    # Run modes, recorded in the start event like every other setting. pass_graphs: how fixed-shape target
    # passes run ("auto": CUDA graphs where the target runs on CUDA; "static": the same fixed-shape passes
    # without capture, for strict runs; "off": eager always; engine.model.runners). chain_verifier: how a
    # sampled chain is verified ("auto": one batched call, the Triton kernel, where the target runs on CUDA,
    # else the walk of acceptance.verify_children; "batch" or "walk" force one). Both verifiers are exact;
    # they draw their uniforms in a different order, so one seed gives different (equally exact) samples.
    pass_graphs: str = "auto"
    chain_verifier: str = "auto"
    # The acceptance rule of a sampled chain: "token" (accept draft by draft, min(1, p/q)) or "block" (the
    # drafted prefix by a joint ratio, acceptance.block_verify_chain; exact too, never fewer tokens on
    # average). Trees and greedy passes take the token rule whatever this says; each step event records the
    # rule that decided it ("verify").
    verify: str = "token"

    def validate(self) -> tuple[SamplingParams, TreeShape]:
        params = SamplingParams(self.temperature, self.top_k, self.top_p)
        for name in ("max_new_tokens", "k", "topk", "num_draft_tokens", "seed"):
            value = getattr(self, name)
            if value is None and name in ("num_draft_tokens", "seed"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    setattr(self, name, int(value))
                else:
                    raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer between 0 and 2**63 - 1, got {self.seed!r}")
        if self.payload not in ("full", "reduced", "off"):
            raise ValueError(f"payload must be 'full', 'reduced' or 'off', got {self.payload!r}")
        if self.pass_graphs not in ("auto", "static", "off"):
            raise ValueError(f"pass_graphs must be auto, static or off; got {self.pass_graphs!r}")
        if self.chain_verifier not in ("auto", "batch", "walk"):
            raise ValueError(f"chain_verifier must be auto, batch or walk; got {self.chain_verifier!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be token or block; got {self.verify!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        self.adaptive_min_confidence = check_min_confidence(self.adaptive_min_confidence)
        self.history = check_history(self.history)
        return params, TreeShape(self.k, self.topk, self.num_draft_tokens)

    def adaptive_depth(self, shape: TreeShape, pass_ms=None, level_nodes: int | None = None) -> AdaptiveDepth | None:
        """A fresh adaptive-depth policy for one run of this shape, or None when drafting does not adapt.
        pass_ms: measured target pass times by width (index w - 1; SpeculativeEngine.pass_costs_ms);
        level_nodes: draft nodes each level past the first adds (SpeculativeEngine.level_nodes)."""
        if not self.adaptive:
            return None
        return AdaptiveDepth(
            shape.k,
            self.adaptive_min_confidence,
            pass_ms=pass_ms,
            branching=shape.topk,
            budget=shape.max_tokens,
            level_nodes=level_nodes,
        )

    def merged(self, overrides: dict) -> GenerationSettings:
        return GenerationSettings(**{**asdict(self), **overrides}) if overrides else self
