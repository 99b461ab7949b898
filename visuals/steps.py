"""What the figures read from one target pass, beyond what engine.trace and engine.metrics give.

engine.trace validates a trace and hands out its events (start, steps, finish); engine.metrics summarises a
run (run_summary). Both are plain Python. This module picks one pass out of a trace, finds the token the
target added itself, chooses the pass and the position worth showing first, and words a node's acceptance
test. It never re-derives the verification rule: the engine records in every tried node the `accept_prob`
it used, the uniform draw `u` (None when greedy), the p_eff / q_eff it compared and whether they were
`adjusted` by earlier rejected siblings; untried nodes have no accept_prob.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.trace import events_of, start_event, step_events

__all__ = [
    "CONTEXT",
    "Pass",
    "read_pass",
    "get_step",
    "extra_token",
    "interesting_step_index",
    "default_position",
    "mode_words",
    "tried",
    "accept_rule",
]

# Kinds of emitted token the target makes itself (not a kept draft).
TARGET_KINDS = ("resampled", "bonus")
CONTEXT = -1  # the node id the engine gives the context: parent of depth-1 drafts, `node` of the first dist


@dataclass(frozen=True)
class Pass:
    """One target pass (one step event) with the run facts every per-pass figure needs."""

    start: dict  # the run's start event
    step: dict  # the step event
    index: int  # 0-based among the step events
    previous: dict | None  # the step before, None for the first pass
    nodes: list[dict]  # the draft tree's nodes
    extra: dict | None  # the token the target added itself (extra_token)

    @property
    def number(self) -> int:
        """The pass number the engine gave the step (1-based)."""
        return self.step.get("step", self.index + 1)

    @property
    def greedy(self) -> bool:
        return bool(self.start.get("greedy"))

    @property
    def point_mass(self) -> bool:
        """n-gram drafts: q is 1 on the drafted token, so a draft is kept with probability p."""
        return bool(self.step.get("point_mass"))

    @property
    def drafted_by(self) -> str:
        """The drafter that proposed this pass: a hybrid's pick (draft.hybrid.picked), else the run's drafter."""
        pick = (self.step.get("draft") or {}).get("hybrid")
        if isinstance(pick, dict) and pick.get("picked"):
            return str(pick["picked"])
        return self.start.get("drafter") or "copied"

    @property
    def baseline(self) -> bool:
        """Nothing drafted in this pass (a baseline run, or nothing to draft)."""
        return self.start.get("mode") == "baseline" or not self.nodes


def get_step(trace, step_index: int) -> dict:
    """Step `step_index` (0-based; negative counts from the end). IndexError when there is no such step."""
    steps = step_events(trace)
    if not steps:
        raise IndexError("the trace has no step events yet")
    if not -len(steps) <= step_index < len(steps):
        raise IndexError(f"step_index {step_index} out of range: the trace has {len(steps)} steps (0-based)")
    return steps[step_index]


def read_pass(trace, step_index: int) -> Pass:
    """Pass `step_index` of a trace (as get_step: 0-based, negative from the end, IndexError if absent)."""
    events = events_of(trace)
    steps = step_events(events)
    step = get_step(events, step_index)
    index = step_index % len(steps)
    return Pass(
        start=start_event(events),
        step=step,
        index=index,
        previous=steps[index - 1] if index > 0 else None,
        nodes=[n for n in (step.get("nodes") or []) if isinstance(n, dict) and "id" in n],
        extra=extra_token(step),
    )


def extra_token(step: dict) -> dict | None:
    """The token the target added itself (resampled or bonus, hanging off `from_node`), if any."""
    emitted = step.get("emitted") or []
    if not emitted:
        return None
    last = emitted[-1]
    if last.get("kind") in TARGET_KINDS and "from_node" in last:
        return last
    return None


def interesting_step_index(trace) -> int:
    """The first step with a rejected draft, else the last step (0-based); 0 for a trace without steps."""
    steps = step_events(trace)
    for i, step in enumerate(steps):
        if any(n.get("decision") == "rejected" for n in step.get("nodes") or []):
            return i
    return max(0, len(steps) - 1)


def default_position(step: dict) -> int:
    """Index into step['dists'] of the first position with a rejected child, else 0."""
    nodes = step.get("nodes") or []
    rejected_parents = {n.get("parent") for n in nodes if n.get("decision") == "rejected"}
    for i, dist in enumerate(step.get("dists") or []):
        if dist.get("node") in rejected_parents:
            return i
    return 0


def mode_words(start: dict) -> str:
    """'baseline (no drafter)' or '<drafter> drafter', for subtitles."""
    if start.get("mode") == "baseline":
        return "baseline (no drafter)"
    return f"{start.get('drafter') or '?'} drafter"


def tried(node: dict) -> bool:
    """The target tested this draft (it was reached: its parent was kept and no sibling was accepted first)."""
    return node.get("decision") in ("accepted", "rejected")


def accept_rule(node: dict) -> str:
    """The acceptance test a tried node went through, as the engine recorded it.

    A first sibling is kept with probability min(1, p/q). After earlier siblings were rejected, the test
    compares the residual p_eff = norm(max(0, p − q)) with q_eff = q without the rejected tokens,
    renormalised: the node's `adjusted` flag says which one applied.
    """
    return "min(1, p_eff/q_eff)" if node.get("adjusted") else "min(1, p/q)"


def absent_note(start: dict) -> str:
    """'' for our engine's traces; for a production engine's (vLLM's), what it did not report, so that a
    figure says so instead of drawing what is not known."""
    absent = start.get("absent") or []
    if not absent:
        return ""
    return f"not reported by {start.get('backend') or 'the engine that ran this'}: " + "; ".join(absent)
