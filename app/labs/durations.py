"""How long the sampling labs' runs took on this server: the time a lab promises, measured here.

A lab that draws real samples (Lossless, Shortcuts) records each finished run's duration and sample count; before
its next run it promises the range the last runs imply for its defaults, on this server, with the load the
machine had. Until a run has finished here it quotes a recorded time with its machine and date, saying so. The
record is per server process (every session's runs are this machine's), never per visitor's content.
"""

from __future__ import annotations

import os
import threading
from collections import deque

__all__ = ["KEEP", "clear", "promise", "record"]

KEEP = 5  # the last runs a promise is read from
_RUNS: dict[str, deque] = {}
_LOCK = threading.Lock()


def record(lab: str, seconds: float, samples: int) -> None:
    """A finished run of `lab`: `samples` real samples in `seconds`, with the machine's load average then."""
    if samples <= 0 or seconds <= 0:
        return
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with _LOCK:
        _RUNS.setdefault(lab, deque(maxlen=KEEP)).append((float(seconds), int(samples), load))


def clear(lab: str | None = None) -> None:
    """Forget the recorded runs (of one lab, or all): for tests."""
    with _LOCK:
        if lab is None:
            _RUNS.clear()
        else:
            _RUNS.pop(lab, None)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def promise(lab: str, samples: int, recorded: str) -> str:
    """What a run of `samples` samples will take: the range the last runs on this server imply (their seconds per
    sample × samples), with the load they ran under; `recorded` (a time measured elsewhere, with its machine and
    date) until a run has finished here."""
    with _LOCK:
        runs = list(_RUNS.get(lab, ()))
    if not runs:
        return f"{recorded} (recorded elsewhere: no run has finished on this server yet)"
    rates = [seconds / n for seconds, n, _ in runs]
    low, high = min(rates) * samples, max(rates) * samples
    span = _duration(low) if high - low < 1 else f"{_duration(low)}–{_duration(high)}"
    loads = [load for _, _, load in runs if load is not None]
    cores = os.cpu_count() or 1
    under = f", load average {min(loads):.1f}–{max(loads):.1f} on {cores} cores" if loads else ""
    count = "run" if len(runs) == 1 else f"{len(runs)} runs"
    return f"{span} for {samples} samples, measured on this server (its last {count}{under})"
