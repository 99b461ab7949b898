"""The trace model: a run's events, validated, saved, loaded and read back.

A trace is the list of event dicts of one run (docs/events.md): ``start``, one
``step`` per target pass, and ``finish`` (absent for a partial run, stopped early
or still going). On disk it is one JSON document
``{"format": "speclens-trace", "version": N, "events": [...]}``.

This module is plain Python (no torch), so the engine, the visuals and the app
all read traces through it: one validator, one set of accessors. Every accessor
accepts a trace as a list of events or as the saved document.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "EVENT_VERSION",
    "MAX_TRACE_BYTES",
    "TRACE_FORMAT",
    "TraceError",
    "dumps",
    "events_of",
    "finish_event",
    "load",
    "loads",
    "save",
    "start_event",
    "step_events",
    "validate",
]

TRACE_FORMAT = "speclens-trace"
# 2: every tried node records ``adjusted`` (its test used p′/q′ after earlier sibling rejections).
# 3: the start event's ``tree`` names K and the budget as the settings do: ``k``, ``num_draft_tokens``.
EVENT_VERSION = 3
TOP_N = 10  # entries of p, q and the residual a full payload keeps per position (the verifier picks them)
MAX_TRACE_BYTES = 20 * 1024 * 1024
_MAX_MIB = MAX_TRACE_BYTES // (1024 * 1024)


class TraceError(ValueError):
    """The data is not a SpecLens trace; the message says what is wrong."""


def events_of(trace) -> list[dict]:
    """The event list of a trace given as a list of events or as a saved document."""
    if isinstance(trace, dict) and "events" in trace:
        trace = trace["events"]
    if not isinstance(trace, list):
        raise TraceError("a trace must be a list of events or a JSON object with an 'events' list")
    return trace


def start_event(trace) -> dict:
    events = events_of(trace)
    return events[0] if events and events[0].get("type") == "start" else {}


def finish_event(trace) -> dict | None:
    events = events_of(trace)
    return events[-1] if events and events[-1].get("type") == "finish" else None


def step_events(trace) -> list[dict]:
    """The step events (one per target pass), in order."""
    return [e for e in events_of(trace) if e.get("type") == "step"]


def _validate_step(event: dict, i: int) -> None:
    for key in ("nodes", "emitted"):
        if not isinstance(event.get(key), list):
            raise TraceError(f"step event {i} lacks a {key!r} list")
    for key in ("accepted_len", "drafted"):
        if not isinstance(event.get(key), int) or isinstance(event.get(key), bool):
            raise TraceError(f"step event {i} lacks an integer {key!r}")
    for node in event["nodes"]:
        if not isinstance(node, dict) or not {"id", "parent", "decision"} <= node.keys():
            raise TraceError(f"step event {i} has a malformed node")
    for tok in event["emitted"]:
        if not isinstance(tok, dict) or "kind" not in tok or "token_id" not in tok:
            raise TraceError(f"step event {i} has a malformed emitted token")


def _upgrade_v1(events: list[dict]) -> None:
    """Version-1 traces predate the ``adjusted`` flag and ``extra_kind``. Their
    numbers tell both: a sibling's test was adjusted exactly when the p or q it
    compared (p_eff, q_eff) differs from the node's own p or q; a pass ended on a
    rejection exactly when a child of the last accepted node (or of the root) was
    rejected. Filled in here, once, at load, so that no reader ever derives them.
    Their recorded theory used accepted ÷ drafted as α; it is dropped so that the
    summary recomputes it with version 2's α (accepted ÷ depths tried)."""
    greedy = bool(events[0].get("greedy"))
    finish = finish_event(events)
    if finish is not None:
        (finish.get("metrics") or {}).pop("theoretical_tokens_per_pass", None)
    for event in step_events(events):
        accepted = [n for n in event["nodes"] if n.get("decision") == "accepted"]
        end = max(accepted, key=lambda n: n.get("depth", 0))["id"] if accepted else -1
        stopped = any(n.get("decision") == "rejected" and n.get("parent") == end for n in event["nodes"])
        event.setdefault("extra_kind", "resampled" if stopped else "bonus")
        for node in event["nodes"]:
            if "adjusted" in node or node.get("accept_prob") is None:
                continue
            p_eff, q_eff, p, q = (node.get(key) for key in ("p_eff", "q_eff", "p", "q"))
            node["adjusted"] = bool(
                not greedy
                and None not in (p_eff, q_eff, p, q)
                and (abs(p_eff - p) > 1e-6 or abs(q_eff - q) > 1e-6)  # v1 rounded both to 6 decimals
            )


def _upgrade_v2(events: list[dict]) -> None:
    """Version-2 traces named the tree's K ``steps`` and its budget ``budget``: renamed here, once, at load."""
    tree = events[0].get("tree")
    if isinstance(tree, dict):
        for old, new in (("steps", "k"), ("budget", "num_draft_tokens")):
            if old in tree:
                tree.setdefault(new, tree.pop(old))


def validate(doc) -> list[dict]:
    """The events of a trace (saved document or bare list), or TraceError saying what is wrong."""
    if isinstance(doc, dict):
        if doc.get("format") not in (None, TRACE_FORMAT):
            raise TraceError(f"not a SpecLens trace (format is {doc.get('format')!r})")
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
            _validate_step(event, i)
        elif kind == "finish":
            if i != len(events) - 1:
                raise TraceError("the 'finish' event must be the last one")
        elif kind == "start":
            raise TraceError(f"a second 'start' event at position {i}")
        else:
            raise TraceError(f"unknown event type {kind!r} at position {i}")
    version = int(events[0].get("version") or 1)
    if version < 2:
        _upgrade_v1(events)
    if version < 3:
        _upgrade_v2(events)
    return events


def dumps(events: list[dict]) -> str:
    return json.dumps({"format": TRACE_FORMAT, "version": EVENT_VERSION, "events": events}, ensure_ascii=False)


def loads(text: str | bytes) -> list[dict]:
    if len(text) > MAX_TRACE_BYTES:
        raise TraceError(f"trace is larger than {_MAX_MIB} MiB")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceError(f"not valid JSON: {exc}") from None
    return validate(doc)


def save(events: list[dict], path: str | Path) -> None:
    Path(path).write_text(dumps(events), encoding="utf-8")


def load(path: str | Path) -> list[dict]:
    """Read and validate a trace file; TraceError also for a missing or unreadable file."""
    path = Path(path)
    try:
        if not path.is_file():
            raise TraceError(f"{str(path)!r} is not a file")
        if path.stat().st_size > MAX_TRACE_BYTES:
            raise TraceError(f"{str(path)!r} is larger than {_MAX_MIB} MiB")
        data = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    return loads(data)
