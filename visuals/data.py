"""Reading traces: validation, step access, run summary and the textbook formulas.

A trace is the list of event dicts from docs/events.md (start, step..., finish?). Every helper also
accepts the saved document form {"format": "speclens-trace", "events": [...]}. Nothing here needs the
engine: a trace is plain JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "TraceError",
    "events_of",
    "validate_events",
    "load_trace",
    "start_event",
    "finish_event",
    "step_events",
    "get_step",
    "extra_token",
    "run_summary",
    "expected_tokens_per_pass",
    "wall_clock_speedup",
    "acceptance_stats",
    "interesting_step_index",
    "default_position",
]

MAX_TRACE_BYTES = 20 * 1024 * 1024


class TraceError(ValueError):
    """The data is not a SpecLens trace."""


def events_of(trace) -> list[dict]:
    """The event list of a trace given as a list of events or as a saved document."""
    if isinstance(trace, dict) and "events" in trace:
        trace = trace["events"]
    if not isinstance(trace, list):
        raise TraceError("a trace must be a list of events or a JSON object with an 'events' list")
    return trace


def validate_events(doc) -> list[dict]:
    """Return the events of a trace (document or list), or raise TraceError saying what is wrong."""
    if isinstance(doc, dict):
        if "events" not in doc:
            raise TraceError("a trace must be a JSON object with an 'events' list (or a bare list)")
        events = doc["events"]
    elif isinstance(doc, list):
        events = doc
    else:
        raise TraceError("a trace must be a JSON object with an 'events' list (or a bare list)")
    if not isinstance(events, list) or not events:
        raise TraceError("the trace has no events")
    for i, event in enumerate(events):
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise TraceError(f"event {i} is not an object with a 'type'")
    if events[0]["type"] != "start":
        raise TraceError("a trace must begin with a 'start' event")
    for i, event in enumerate(events[1:], start=1):
        kind = event["type"]
        if kind == "step":
            for key in ("nodes", "emitted"):
                if not isinstance(event.get(key), list):
                    raise TraceError(f"step event {i} lacks a {key!r} list")
            for node in event["nodes"]:
                if not isinstance(node, dict) or not {"id", "parent", "decision"} <= node.keys():
                    raise TraceError(f"step event {i} has a malformed node")
            for tok in event["emitted"]:
                if not isinstance(tok, dict) or "kind" not in tok:
                    raise TraceError(f"step event {i} has a malformed emitted token")
        elif kind == "finish":
            if i != len(events) - 1:
                raise TraceError("the 'finish' event must be the last one")
        elif kind == "start":
            raise TraceError(f"a second 'start' event at position {i}")
        else:
            raise TraceError(f"unknown event type {kind!r} at position {i}")
    return events


def load_trace(path: str | Path) -> list[dict]:
    """Read and validate a trace file; raises TraceError (also for a missing or unreadable file)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise TraceError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if not path.is_file():
        raise TraceError(f"{str(path)!r} is not a file")
    if size > MAX_TRACE_BYTES:
        raise TraceError(f"{str(path)!r} is larger than {MAX_TRACE_BYTES // (1024 * 1024)} MiB")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceError(f"{str(path)!r} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise TraceError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    return validate_events(doc)


def start_event(trace) -> dict:
    events = events_of(trace)
    return events[0] if events and events[0].get("type") == "start" else {}


def finish_event(trace) -> dict | None:
    events = events_of(trace)
    return events[-1] if events and events[-1].get("type") == "finish" else None


def step_events(trace) -> list[dict]:
    """The step events (one per target pass), in order."""
    return [e for e in events_of(trace) if e.get("type") == "step"]


def get_step(trace, step_index: int) -> dict:
    """Step `step_index` (0-based; negative counts from the end). IndexError when there is no such step."""
    steps = step_events(trace)
    if not steps:
        raise IndexError("the trace has no step events yet")
    if not -len(steps) <= step_index < len(steps):
        raise IndexError(f"step_index {step_index} out of range: the trace has {len(steps)} steps (0-based)")
    return steps[step_index]


def extra_token(step: dict) -> dict | None:
    """The token the target added itself (resampled or bonus, hanging off `from_node`), if any."""
    emitted = step.get("emitted") or []
    if not emitted:
        return None
    last = emitted[-1]
    if last.get("kind") in ("resampled", "bonus") and "from_node" in last:
        return last
    return None


def _k(start: dict) -> int:
    tree = start.get("tree") or {}
    k = tree.get("steps")
    if k is None:
        k = (start.get("settings") or {}).get("k", 0)
    return int(k or 0)


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """E = (1 − α^(K+1)) / (1 − α): tokens per target pass for a K-token chain with i.i.d. acceptance α."""
    alpha = float(alpha)
    k = int(k)
    if alpha >= 1.0 - 1e-12:
        return float(k + 1)
    if alpha <= 0.0:
        return 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def wall_clock_speedup(alpha: float, k: int, c: float) -> float:
    """E / (K·c + 1), c = cost of one draft token relative to one target pass."""
    return expected_tokens_per_pass(alpha, k) / (int(k) * float(c) + 1.0)


def _mean(values: list[float]) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def run_summary(trace) -> dict:
    """Headline numbers of a (possibly partial) run.

    From the finish metrics when the run finished, else computed from the step events:
    passes, tokens, tokens_per_pass, acceptance_rate α = Σ accepted_len / Σ drafted, K (tree steps),
    theoretical tokens per pass, wall_s (last step's elapsed_s), tokens_per_s, mean draft/verify ms and
    the draft cost ratio c = mean draft_ms / (K · mean verify_ms) (an estimate: cost of one draft position
    relative to one target pass).
    """
    start = start_event(trace)
    steps = step_events(trace)
    finish = finish_event(trace)
    metrics = (finish or {}).get("metrics") or {}
    k = _k(start)
    passes = len(steps)
    tokens = sum(len(s.get("emitted") or []) for s in steps)
    drafted = sum(int(s.get("drafted") or 0) for s in steps)
    accepted = sum(int(s.get("accepted_len") or 0) for s in steps)
    wall_s = float(steps[-1].get("elapsed_s") or 0.0) if steps else 0.0

    passes = int(metrics.get("target_passes", passes))
    tokens = int(metrics.get("new_tokens", tokens))
    drafted = int(metrics.get("drafted", drafted))
    accepted = int(metrics.get("accepted", accepted))
    alpha = (
        float(metrics["acceptance_rate"]) if "acceptance_rate" in metrics else (accepted / drafted if drafted else 0.0)
    )
    wall_s = float(metrics.get("wall_s", wall_s) or 0.0)
    tokens_per_pass = tokens / passes if passes else 0.0
    tokens_per_s = float(metrics["tokens_per_s"]) if "tokens_per_s" in metrics else (tokens / wall_s if wall_s else 0.0)

    drafting_steps = [s for s in steps if s.get("nodes")] or steps
    mean_draft_ms = _mean([s.get("draft_ms") for s in drafting_steps])
    mean_verify_ms = _mean([s.get("verify_ms") for s in drafting_steps])
    c = None
    if mean_draft_ms is not None and mean_verify_ms and k > 0:
        c = mean_draft_ms / (k * mean_verify_ms)

    return {
        "mode": start.get("mode"),
        "target": start.get("target"),
        "drafter": start.get("drafter"),
        "greedy": bool(start.get("greedy", False)),
        "prompt": start.get("prompt"),
        "finished": finish is not None,
        "stop_reason": (finish or {}).get("stop_reason"),
        "k": k,
        "tree_topk": int((start.get("tree") or {}).get("topk") or 1),
        "passes": passes,
        "tokens": tokens,
        "tokens_per_pass": tokens_per_pass,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": alpha,
        "theoretical_tokens_per_pass": expected_tokens_per_pass(alpha, k) if drafted else 1.0,
        "wall_s": wall_s,
        "tokens_per_s": tokens_per_s,
        "mean_draft_ms": mean_draft_ms,
        "mean_verify_ms": mean_verify_ms,
        "draft_cost_ratio": c,
    }


def acceptance_stats(trace) -> dict:
    """Per draft position i = 1..K: drafted (passes that drafted that deep), reached (accepted path got there),
    and the share reached/drafted (None where nothing was drafted). From finish metrics when present."""
    start = start_event(trace)
    k = _k(start)
    metrics = (finish_event(trace) or {}).get("metrics") or {}
    steps = step_events(trace)
    if "acceptance_by_position" in metrics:
        rates = [None if r is None else float(r) for r in metrics["acceptance_by_position"]]
        n = len(rates)
        drafted = list(metrics.get("drafted_per_position") or [])
        reached = list(metrics.get("accepted_per_position") or [])
        if len(drafted) != n or len(reached) != n:
            drafted = [sum(1 for s in steps if int(s.get("draft_depth") or 0) >= i) for i in range(1, n + 1)]
            reached = [sum(1 for s in steps if int(s.get("accepted_len") or 0) >= i) for i in range(1, n + 1)]
        source = "finish metrics"
    else:
        n = max([k] + [int(s.get("draft_depth") or 0) for s in steps])
        drafted = [sum(1 for s in steps if int(s.get("draft_depth") or 0) >= i) for i in range(1, n + 1)]
        reached = [sum(1 for s in steps if int(s.get("accepted_len") or 0) >= i) for i in range(1, n + 1)]
        rates = [(r / d if d else None) for r, d in zip(reached, drafted)]
        source = "step events"
    return {
        "positions": list(range(1, len(rates) + 1)),
        "rates": rates,
        "drafted": drafted,
        "reached": reached,
        "source": source,
    }


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
