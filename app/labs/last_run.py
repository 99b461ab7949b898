"""The session's last Playground run as the Explain and Batch labs use it: its measured α, K and timings."""

from __future__ import annotations

import logging

from engine.metrics import run_summary

from ..traces import recorded_name

__all__ = ["last_run"]

log = logging.getLogger("speclens.app")


def last_run(trace) -> tuple[dict | None, str]:
    """(run_summary of the session's last real speculative Playground run or None, a sentence saying which).

    A recorded trace (what the Playground shows before anyone runs anything) is not the user's run."""
    if not trace or recorded_name(trace):
        return None, "No Playground run in this session yet: run one and come back to see it here."
    try:
        s = run_summary(trace)
    except Exception as exc:  # a malformed trace never breaks the tab
        log.exception("run_summary failed")
        return None, f"Your last Playground run cannot be summarised ({type(exc).__name__})."
    if s.get("mode") == "baseline" or not s.get("drafted"):
        return (
            None,
            "Your last Playground run drafted nothing (a baseline run, or nothing to copy), so it has no α to show.",
        )
    s["run_id"] = str(trace[0].get("run_id") or trace[0].get("started_at"))
    s["started_at"] = trace[0].get("started_at")
    return s, (
        f"Your last Playground run ({s.get('drafter')}, K = {s['k']}"
        + (f", tree top-k {s['tree_topk']}" if s.get("tree_topk", 1) > 1 else "")
        + f"): α = {s['position_acceptance']:.3f}, {s['tokens_per_pass']:.2f} tokens per target pass (measured)."
    )
