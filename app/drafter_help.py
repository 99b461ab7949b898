"""What the app says about the drafters: their names in the drafter menus (Playground, Race) and the help beside
them, with each drafter's cost c measured on this server, or recorded elsewhere and saying where."""

from __future__ import annotations

from engine.drafters.hybrid import DEFAULT_DEPTH as HYBRID_DEPTH
from engine.metrics import DRAFT_COST_RATIO_MEANS

from . import config
from .engine_access import VLLM_DRAFTER
from .examples import load_examples

__all__ = ["ADAPTIVE_INFO", "DRAFTER_CHOICES", "DRAFTER_INFO", "drafter_choices", "drafter_info"]

DRAFTER_CHOICES = [
    ("none (baseline: no drafting)", "none"),
    ("ngram (prompt lookup)", "ngram"),
    ("suffix (suffix decoding: the prompt and this session's earlier answers)", "suffix"),
    ("int8 (quantised target)", "int8"),
    ("q4 (the target's own 4-bit weights)", "q4"),
    ("q4+ngram (q4, its own guesses proposed by n-gram)", "q4+ngram"),
    ("suffix/q4 (hybrid: suffix's proposal or q4's guesses, each pass the one measured faster)", "suffix/q4"),
    ("eagle (a one-layer head on the target's own features)", "eagle"),
    ("model:SmolLM2-135M-Instruct", "model:SmolLM2-135M-Instruct"),
]
ADAPTIVE_INFO = (
    "Each pass drafts the depth between 1 and the slider's K that pays most on this machine (measured pass "
    "costs and recent acceptance), or nothing where no depth is expected to pay (a plain pass; every 8th "
    "drafts again to measure), and a model drafter stops guessing deeper when unsure; the text's "
    "distribution stays the target's."
)
DRAFTER_INFO = (
    "Who guesses ahead. ngram copies from the prompt: free, shines when the answer repeats it. suffix copies from "
    "the prompt and from this session's earlier answers (ask a similar question twice). int8 is the target itself "
    "with int8 weights: a near copy that runs the whole network per guess. q4 is the same with the target's own 4-bit "
    "weights: a little over a quarter of the target's bytes per guess, so a guess costs a fraction of a pass; q4+ngram lets "
    "n-gram propose q4's own guesses, which q4 checks several at a time. suffix/q4 picks, each pass, suffix's "
    f"proposal (as deep as K) or q4's guesses (at most {HYBRID_DEPTH}), whichever this run has measured to give more "
    "tokens per ms. eagle is a tiny trained head that reads "
    "the target's own hidden states (a low, a middle and the last layer's) from the pass that just verified (no "
    "extra target work) and runs one layer. model:<id> (type any Hub id) is a separate small model. What a guess "
    "costs is c, in target passes: "
)


def drafter_info(engine=None) -> str:
    """DRAFTER_INFO with c as measured: this server's runs so far, else the examples' recorded figures (with
    their machine), never a fixed word like "cheap"."""
    measured = engine.costs.drafter_costs() if engine is not None else {}
    if measured:
        costs = ", ".join(
            f"{name} {m['c']:.2f} ({m['runs']} run{'s' if m['runs'] != 1 else ''})" for name, m in measured.items()
        )
        return DRAFTER_INFO + f"measured on this server so far ({DRAFT_COST_RATIO_MEANS}): {costs}."
    recorded: dict[tuple, list[str]] = {}  # (cpu, date) -> "drafter c" recorded there: each figure says where
    named: set[str] = set()
    for example in load_examples():
        m = example.get("measured") or {}
        where = (m.get("cpu", "?"), m.get("recorded", "?"))
        for drafter, block in (
            (example.get("drafter"), m),
            ((m.get("compare") or {}).get("drafter"), m.get("compare") or {}),
        ):
            if drafter and block.get("draft_cost_ratio") is not None and drafter not in named:
                named.add(drafter)
                recorded.setdefault(where, []).append(f"{drafter} {block['draft_cost_ratio']:.2f}")
    if not recorded:
        return DRAFTER_INFO + "measured by each run (the run card shows it)."
    costs = "; ".join(f"{', '.join(items)} (recorded on {cpu}, {day})" for (cpu, day), items in recorded.items())
    return DRAFTER_INFO + f"{costs}; runs here measure their own ({DRAFT_COST_RATIO_MEANS})."


def drafter_choices() -> list[tuple[str, str]]:
    """Our drafters, and the production engine when a vLLM server is configured (hidden otherwise)."""
    if not config.VLLM_URL:
        return DRAFTER_CHOICES
    return DRAFTER_CHOICES + [(f"vllm: the production engine at {config.VLLM_URL} (its own speculation)", VLLM_DRAFTER)]
