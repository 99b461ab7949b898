"""Trace files in the app: the recorded real runs in assets/traces, uploads, and per-session downloads.

Every trace is read through engine.trace (one validator for the engine, the visuals and the app);
recorded traces are cached and shared between sessions, so treat them as read-only.
"""

from __future__ import annotations

import functools
import re
import shutil
import tempfile
import time
from pathlib import Path

import gradio as gr

from engine.trace import TraceError, dumps, finish_event, load, start_event

from .config import TRACES_DIR

__all__ = [
    "DEFAULT_TRACE",
    "load_recorded",
    "load_upload",
    "recorded_name",
    "recorded_traces",
    "session_id",
    "upload_path",
    "write_trace_file",
]

# The recorded run the page shows before anyone runs anything (and whose drafter app.py preloads).
DEFAULT_TRACE = "chat-int8-tree-sampling.json"
_DOWNLOAD_ROOT = Path(tempfile.gettempdir()) / "speclens-traces"
RECORDED_CACHE = 32  # recorded traces kept parsed in memory (assets/traces holds a handful)
SESSION_NAME_LEN = 64  # characters of a session id kept in a folder name
DRAFTER_NAME_LEN = 40  # characters of a drafter spec kept in a file name


def recorded_traces() -> list[str]:
    return sorted(p.name for p in TRACES_DIR.glob("*.json"))


def load_recorded(name: str) -> list[dict]:
    """A recorded trace from assets/traces (name only; no path tricks). Cached: treat it as read-only."""
    if not name or Path(name).name != name or name not in recorded_traces():
        raise gr.Error(f"Unknown recorded trace {name!r}; choose one of {', '.join(recorded_traces())}.")
    return _load_recorded(name)


@functools.lru_cache(maxsize=RECORDED_CACHE)
def _load_recorded(name: str) -> list[dict]:
    return load(TRACES_DIR / name)


def recorded_name(trace: list[dict] | None) -> str | None:
    """The file name if `trace` is one of the recorded traces (e.g. the Playground's initial one)."""
    if not trace:
        return None
    stamp = trace[0].get("started_at")
    for name in recorded_traces():
        try:
            if load_recorded(name)[0].get("started_at") == stamp:
                return name
        except (gr.Error, TraceError):
            continue
    return None


def upload_path(upload) -> str:
    """The local path of a gr.File value (a path string, or a file object from older clients)."""
    return upload if isinstance(upload, str) else getattr(upload, "name", None) or getattr(upload, "path", "")


def load_upload(path: str) -> list[dict]:
    """An uploaded trace, validated (engine.trace), or a gr.Error saying what is wrong with it."""
    try:
        return load(path)
    except TraceError as exc:
        raise gr.Error(f"This file is not a usable SpecLens trace: {exc}") from None
    except OSError as exc:
        raise gr.Error(f"Cannot read the uploaded file: {exc.strerror or exc}") from None


def session_id(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "anon"


def write_trace_file(trace: list[dict], session: str | None = None) -> str:
    """Write the trace as JSON to a per-session temp folder (older files of the session are removed)."""
    folder = _DOWNLOAD_ROOT / re.sub(r"[^A-Za-z0-9_-]", "", session or "shared")[:SESSION_NAME_LEN]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    drafter = re.sub(r"[^A-Za-z0-9_.-]", "-", str(start_event(trace).get("drafter", "run")))[:DRAFTER_NAME_LEN]
    finish = finish_event(trace)
    partial = "" if finish and not finish.get("incomplete") else "-partial"
    path = folder / f"speclens-{drafter}-{time.strftime('%Y%m%d-%H%M%S')}{partial}.json"
    path.write_text(dumps(trace), encoding="utf-8")
    return str(path)
