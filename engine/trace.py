"""A run's trace: the list of its events, saved as one JSON document and loaded back.

Format: {"format": "speclens-trace", "version": 1, "events": [start, step..., finish?]}.
A trace without a finish event is a partial run (stopped early or still going).
Loading validates the shape so that a malformed upload gets a clear message.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TRACE_FORMAT", "TraceError", "dumps", "loads", "save", "load", "validate"]

TRACE_FORMAT = "speclens-trace"
MAX_TRACE_BYTES = 20 * 1024 * 1024


class TraceError(ValueError):
    """The data is not a SpecLens trace."""


def dumps(events: list[dict]) -> str:
    return json.dumps({"format": TRACE_FORMAT, "version": 1, "events": events}, ensure_ascii=False)


def validate(doc) -> list[dict]:
    """Return the events of a trace document, or raise TraceError saying what is wrong."""
    if isinstance(doc, list):
        events = doc
    elif isinstance(doc, dict):
        if doc.get("format") not in (None, TRACE_FORMAT):
            raise TraceError(f"not a SpecLens trace (format is {doc.get('format')!r})")
        events = doc.get("events")
    else:
        raise TraceError("a trace must be a JSON object with an 'events' list")
    if not isinstance(events, list) or not events:
        raise TraceError("the trace has no events")
    if not all(isinstance(e, dict) and isinstance(e.get("type"), str) for e in events):
        raise TraceError("every event must be an object with a 'type'")
    if events[0]["type"] != "start":
        raise TraceError("a trace must begin with a 'start' event")
    for i, event in enumerate(events[1:], start=1):
        if event["type"] == "step":
            for key in ("emitted", "nodes", "accepted_len", "drafted"):
                if key not in event:
                    raise TraceError(f"step event {i} lacks {key!r}")
            if not isinstance(event["emitted"], list) or not isinstance(event["nodes"], list):
                raise TraceError(f"step event {i} is malformed")
        elif event["type"] == "finish":
            if i != len(events) - 1:
                raise TraceError("the 'finish' event must be the last one")
        else:
            raise TraceError(f"unknown event type {event['type']!r} at position {i}")
    return events


def loads(text: str | bytes) -> list[dict]:
    if len(text) > MAX_TRACE_BYTES:
        raise TraceError(f"trace is larger than {MAX_TRACE_BYTES // (1024 * 1024)} MiB")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceError(f"not valid JSON: {exc}") from None
    return validate(doc)


def save(events: list[dict], path: str | Path) -> None:
    Path(path).write_text(dumps(events), encoding="utf-8")


def load(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.stat().st_size > MAX_TRACE_BYTES:
        raise TraceError(f"trace is larger than {MAX_TRACE_BYTES // (1024 * 1024)} MiB")
    return loads(path.read_bytes())
