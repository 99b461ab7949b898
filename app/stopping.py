"""Cooperative Stop: run ids, the marks Stop leaves on them, and a progress reporter that honours them.

The Run click first gets a fresh run id (a fast, unqueued call), the run receives it, and Stop
marks that id. The run checks the mark after every target pass (or sample, or measurement),
closes the engine generator and finalises what it produced itself, so the last update the page
gets is always the stopped state. (Cancelling the event with `cancels=` instead can let a
streamed update that was already in flight arrive after the Stop handler's output, leaving the
page showing "running" for a run that no longer exists.) Marking an id of a run still waiting
in the queue stops it as soon as it starts; a stale mark never affects a later run (new id).

Plain Python: the Gradio wiring of the buttons is in `wiring`.
"""

from __future__ import annotations

import threading
import time
import uuid

__all__ = ["ProgressReporter", "Stopped", "new_run_id", "request_stop", "stop_requested"]

_STOPS: dict[str, float] = {}
_STOPS_LOCK = threading.Lock()
STOP_TTL_S = 6 * 3600  # marks older than this are forgotten (no run lasts that long)
PROGRESS_INTERVAL_S = 0.25  # the progress bar is redrawn at most this often


def new_run_id() -> str:
    return uuid.uuid4().hex


def request_stop(run_id: str | None) -> None:
    if not run_id:
        return
    now = time.time()
    with _STOPS_LOCK:
        for key in [k for k, t in _STOPS.items() if now - t > STOP_TTL_S]:
            del _STOPS[key]
        _STOPS[run_id] = now


def stop_requested(run_id: str | None) -> bool:
    return bool(run_id) and run_id in _STOPS


class Stopped(Exception):
    """Raised from a progress callback when the user pressed Stop."""


class ProgressReporter:
    """A progress(done, total) callback for engine loops: shows progress(i/n) at most every
    `interval` s, and raises Stopped when the run id was stopped (the engine loop then unwinds).

    offset and share place this loop's progress within a longer run (e.g. sampler 2 of 3)."""

    def __init__(self, progress, desc: str, run_id: str, offset: float = 0.0, share: float = 1.0, interval=None):
        self.progress, self.desc, self.run_id = progress, desc, run_id
        self.offset, self.share = offset, share
        self.interval = PROGRESS_INTERVAL_S if interval is None else interval
        self.next = 0.0

    def __call__(self, done: int, total: int) -> None:
        if stop_requested(self.run_id):
            raise Stopped
        now = time.perf_counter()
        if self.progress is None or (now < self.next and done < total):
            return
        self.next = now + self.interval
        show_progress(self.progress, self.offset + self.share * done / max(total, 1), f"{self.desc}: {done}/{total}")


def show_progress(progress, fraction: float | None, desc: str) -> None:
    """progress(fraction, desc=...) if there is a progress tracker; display is best effort, never an error."""
    if progress is None:
        return
    try:
        progress(fraction, desc=desc)
    except Exception:  # the bar is decoration; a run never fails for it
        pass
