"""What the app says about the drafters: their names in the drafter menus (Playground, Race) and the help beside
them, with each drafter's cost c measured on this server, or recorded elsewhere and saying where."""

from __future__ import annotations

from engine.drafters.spec import BASELINE, families, menu, parse
from engine.metrics import DRAFT_COST_RATIO_MEANS

from . import config
from .engine_access import VLLM_DRAFTER
from .examples import load_examples

__all__ = ["ADAPTIVE_INFO", "drafter_choices", "drafter_info", "drafter_summary", "single_drafters"]

ADAPTIVE_INFO = (
    "Each pass drafts the depth between 1 and the slider's K that pays most on this machine (measured pass "
    "costs and recent acceptance), or nothing where no depth is expected to pay (a plain pass; every 8th "
    "drafts again to measure), and a model drafter stops guessing deeper when unsure; the text's "
    "distribution stays the target's."
)


def drafter_summary() -> str:
    """Who guesses ahead, one clause per registered drafter family (its own help line)."""
    # (a family's name, or its form where that is the point: model:<id>, MODEL+COPY, COPY/MODEL[:DEPTH])
    clauses = [f"{f.form if f.parse else f.name}: {f.help}" for f in families() if f.kind != "baseline"]
    return (
        "Who guesses ahead. "
        + " ".join(f"{clause}." for clause in clauses)
        + " What a guess costs is c, in target passes: "
    )


def drafter_info(engine=None) -> str:
    """drafter_summary with c as measured: this server's runs so far, else the examples' recorded figures (with
    their machine), never a fixed word like "cheap"."""
    measured = engine.costs.drafter_costs() if engine is not None else {}
    if measured:
        costs = ", ".join(
            f"{name} {m['c']:.2f} ({m['runs']} run{'s' if m['runs'] != 1 else ''})" for name, m in measured.items()
        )
        return drafter_summary() + f"measured on this server so far ({DRAFT_COST_RATIO_MEANS}): {costs}."
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
        return drafter_summary() + "measured by each run (the run card shows it)."
    costs = "; ".join(f"{', '.join(items)} (recorded on {cpu}, {day})" for (cpu, day), items in recorded.items())
    return drafter_summary() + f"{costs}; runs here measure their own ({DRAFT_COST_RATIO_MEANS})."


def drafter_choices(vllm: bool = True, baseline: bool = True) -> list[tuple[str, str]]:
    """The drafter menu: every registered family's entries, and the production engine when a vLLM server is
    configured (`vllm`); without the baseline where a comparison runs it anyway (`baseline` False)."""
    entries = [entry for entry in menu() if baseline or entry[1] != BASELINE]
    if vllm and config.VLLM_URL:
        entries.append((f"vllm: the production engine at {config.VLLM_URL} (its own speculation)", VLLM_DRAFTER))
    return entries


def single_drafters(baseline: bool = False) -> dict[str, str]:
    """{spec: its menu label} of every family that drafts alone and runs by its bare name (the labs that compare
    drafters one by one; a draft model needs an id, a composite its parts), in family order."""
    found = {}
    for f in families():
        if f.kind == "composite" or (f.kind == "baseline" and not baseline):
            continue
        try:
            parse(f.name)
        except ValueError:
            continue
        found[f.name] = f.label
    return found
