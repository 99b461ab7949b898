"""Speculation metrics where dashboards read them: a Prometheus endpoint at /metrics on the app's server.

The counters carry vLLM's names and meanings under our prefix (``speclens:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos{position}``), with
``model_name`` and ``drafter`` labels, so a Grafana board built on vLLM's counters reads ours by swapping the
prefix (docs/grafana-speculation.json). vLLM cannot export what it does not count; we add the number of verify
passes (without it the mean acceptance length cannot be derived) and histograms of accepted drafts per pass,
tokens per pass and pass time.

Every finished run the app serves (the Playground, the Race's streamed pair, the labs that stream a run, the
/generate API) is counted once, from its trace: the engine decided, the trace recorded, this module only adds
up (``record_run``). A run stopped before its end is not counted. Each process has its own registry.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.trace import finish_event, start_event, step_events

__all__ = ["CONTENT_TYPE_LATEST", "REGISTRY", "metrics_text", "record_run"]

PREFIX = "speclens:spec_decode"
LABELS = ("model_name", "drafter")
ACCEPTED_BUCKETS = tuple(float(n) for n in range(17))  # drafts kept in one pass: 0 .. 16
TOKENS_BUCKETS = tuple(float(n) for n in range(1, 18))  # tokens one pass emits: 1 .. 17
PASS_SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)

REGISTRY = CollectorRegistry()
_LOCK = threading.Lock()
DRAFTS = Counter(f"{PREFIX}_num_drafts", "Verify passes that checked drafts (vLLM: drafts).", LABELS, registry=REGISTRY)
DRAFT_TOKENS = Counter(f"{PREFIX}_num_draft_tokens", "Draft tokens proposed.", LABELS, registry=REGISTRY)
ACCEPTED = Counter(f"{PREFIX}_num_accepted_tokens", "Draft tokens accepted.", LABELS, registry=REGISTRY)
ACCEPTED_PER_POS = Counter(
    f"{PREFIX}_num_accepted_tokens_per_pos",
    "Passes whose accepted path reached this draft position (0 = the first draft).",
    (*LABELS, "position"),
    registry=REGISTRY,
)
PASSES = Counter(f"{PREFIX}_num_verify_passes", "Target passes, drafting or not.", LABELS, registry=REGISTRY)
EMITTED = Counter(f"{PREFIX}_num_emitted_tokens", "Tokens the runs emitted.", LABELS, registry=REGISTRY)
ACCEPTED_PER_PASS = Histogram(
    f"{PREFIX}_accepted_per_pass",
    "Drafts kept by each drafting pass.",
    LABELS,
    buckets=ACCEPTED_BUCKETS,
    registry=REGISTRY,
)
TOKENS_PER_PASS = Histogram(
    f"{PREFIX}_tokens_per_pass", "Tokens each target pass emitted.", LABELS, buckets=TOKENS_BUCKETS, registry=REGISTRY
)
PASS_SECONDS = Histogram(
    f"{PREFIX}_pass_seconds",
    "Each target pass with its checks (seconds).",
    LABELS,
    buckets=PASS_SECONDS_BUCKETS,
    registry=REGISTRY,
)


def record_run(trace: list[dict]) -> bool:
    """Add a finished run's trace to the counters (False, nothing added, for an unfinished one)."""
    if finish_event(trace) is None:
        return False
    start = start_event(trace)
    labels = {"model_name": str(start.get("target") or "?"), "drafter": str(start.get("drafter") or "none")}
    steps = step_events(trace)
    with _LOCK:
        for step in steps:
            PASSES.labels(**labels).inc()
            EMITTED.labels(**labels).inc(len(step.get("emitted") or []))
            TOKENS_PER_PASS.labels(**labels).observe(len(step.get("emitted") or []))
            if step.get("verify_ms") is not None:
                PASS_SECONDS.labels(**labels).observe(step["verify_ms"] / 1000.0)
            if not step.get("drafted"):
                continue
            accepted = int(step.get("accepted_len") or 0)
            DRAFTS.labels(**labels).inc()
            DRAFT_TOKENS.labels(**labels).inc(int(step["drafted"]))
            ACCEPTED.labels(**labels).inc(accepted)
            ACCEPTED_PER_PASS.labels(**labels).observe(accepted)
            for position in range(accepted):
                ACCEPTED_PER_POS.labels(**labels, position=str(position)).inc()
    return True


def metrics_text() -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(REGISTRY)
