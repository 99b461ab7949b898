"""Which requests does speculation pay for? Per-request speculative metrics, read as a distribution.

A server's /metrics (engine/tools/analyze.py) sums every request of a window into one acceptance; requests differ
widely (a code edit that copies its prompt keeps several tokens per pass, a chat answer little more than one), and
a window's mean, weighted by tokens, leans to the long ones. vLLM (≥ 0.28,
``--per-request-spec-decode-metrics summary|detailed``) reports each request's own in its response, under
``metrics.speculative_decoding``:

* ``acceptance_histogram``: verify steps by how many drafts they accepted. Two schemas are in the wild: **dense**,
  a list whose index j counts the steps that accepted exactly j drafts (K + 1 entries; vLLM's merged form,
  ``[39, 1, 0, 3]``), and **sparse**, an object with only the counts that occurred, keyed by j as text
  (``{"0": 39, "1": 1, "3": 3}``: an earlier variant, ``--per-request-spec-decode-stats``). Both read the same;
* ``num_spec_steps``, ``num_draft_tokens``, ``num_accepted_draft_tokens``, ``mean_acceptance_length`` (1 + accepted
  ÷ steps: tokens per verify step, the bonus token included), ``draft_acceptance_rate`` (accepted ÷ drafted).

A record is one JSON object per line (JSONL): a whole response, a stream's final chunk (also wrapped as
``{"data": {...}}``), or the ``speculative_decoding`` object alone. For each request this reads its steps, its
accepted drafts and so its mean acceptance length τ (from the histogram; a reported τ that disagrees with its own
histogram is refused, not averaged). Across requests: the spread of τ (quantiles), the histogram of all steps,
the request-weighted mean τ beside the step-weighted one (what a window of /metrics gives), and — given a
break-even τ* (the ratio of a speculative pass's cost to a plain one's, from pass costs or typed) — which
requests pay (τ > τ*) and which do not. Nothing here runs a model.
"""

from __future__ import annotations

import json
import math
import statistics

from engine.tools.analyze import AnalyzeError

__all__ = ["break_even_of", "histogram_of", "read_requests", "request_distribution", "spec_metrics_of"]

MAX_RECORDS = 100_000
MAX_K = 64  # histogram entries beyond this are not a draft length


def spec_metrics_of(record) -> dict | None:
    """The ``speculative_decoding`` object of one record (a response, a final chunk, ``{"data": chunk}`` or the
    object itself); None when the record has none (a request that did not speculate, or n > 1)."""
    if not isinstance(record, dict):
        return None
    if "acceptance_histogram" in record or "num_spec_steps" in record:
        return record
    for holder in (record, record.get("data") if isinstance(record.get("data"), dict) else None):
        if holder is None:
            continue
        metrics = holder.get("metrics")
        if isinstance(metrics, dict) and isinstance(metrics.get("speculative_decoding"), dict):
            return metrics["speculative_decoding"]
    return None


def histogram_of(spec: dict) -> list[int]:
    """The dense histogram (index j = steps that accepted exactly j drafts) of either schema; AnalyzeError when it
    is neither a list nor an object of whole counts."""
    raw = spec.get("acceptance_histogram")
    if isinstance(raw, list):
        counts = dict(enumerate(raw))
    elif isinstance(raw, dict):
        try:
            counts = {int(j): n for j, n in raw.items()}
        except (TypeError, ValueError):
            raise AnalyzeError(f"a sparse acceptance_histogram's keys are draft counts, got {list(raw)[:5]}") from None
    else:
        raise AnalyzeError("a request's speculative metrics have no acceptance_histogram (a list, or an object)")
    if any(
        not isinstance(n, (int, float)) or isinstance(n, bool) or n < 0 or n != int(n) or not 0 <= j <= MAX_K
        for j, n in counts.items()
    ):
        raise AnalyzeError(f"an acceptance_histogram holds whole counts of steps for 0..{MAX_K} drafts, got {raw}")
    size = max(counts, default=-1) + 1
    return [int(counts.get(j, 0)) for j in range(size)]


def _one(spec: dict, line: int, schema: str) -> dict:
    hist = histogram_of(spec)
    steps = sum(hist)
    accepted = sum(j * n for j, n in enumerate(hist))
    reported_steps = spec.get("num_spec_steps")
    if isinstance(reported_steps, (int, float)) and reported_steps != steps:
        raise AnalyzeError(f"line {line}: num_spec_steps {reported_steps} is not its histogram's {steps} steps")
    tau = 1.0 + accepted / steps if steps else None
    reported = spec.get("mean_acceptance_length")
    if tau is not None and isinstance(reported, (int, float)) and abs(reported - tau) > 1e-3 * max(1.0, tau):
        raise AnalyzeError(f"line {line}: mean_acceptance_length {reported} disagrees with its histogram's {tau:.4f}")
    drafted = spec.get("num_draft_tokens")
    return {
        "line": line,
        "schema": schema,
        "steps": steps,
        "accepted": accepted,
        "drafted": int(drafted) if isinstance(drafted, (int, float)) else None,
        "tau": tau,
        "histogram": hist,
    }


def read_requests(text: str) -> list[dict]:
    """Per-request readings of a JSONL text (one record per line; blank lines skipped): {"line", "schema" (dense
    or sparse), "steps", "accepted", "drafted", "tau", "histogram"} for each record with speculative metrics and at
    least one verify step, plus any extra key the record carries as "speclens_workload" (kept as "label").
    AnalyzeError, naming the line, for a line that is not JSON or holds a malformed histogram; and when no
    record has speculative metrics."""
    out = []
    lines = text.splitlines()
    if len(lines) > MAX_RECORDS:
        raise AnalyzeError(f"at most {MAX_RECORDS} records, got {len(lines)}")
    seen = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        seen += 1
        try:
            record = json.loads(raw)
        except ValueError:
            raise AnalyzeError(
                f"line {number} is not JSON (one response or speculative_decoding object per line)"
            ) from None
        spec = spec_metrics_of(record)
        if spec is None:
            continue
        schema = "sparse" if isinstance(spec.get("acceptance_histogram"), dict) else "dense"
        try:
            reading = _one(spec, number, schema)
        except AnalyzeError as exc:
            message = str(exc)
            raise AnalyzeError(message if message.startswith("line ") else f"line {number}: {message}") from None
        if reading["steps"]:
            if isinstance(record, dict) and isinstance(record.get("speclens_workload"), str):
                reading["label"] = record["speclens_workload"]
            out.append(reading)
    if not out:
        raise AnalyzeError(
            f"none of the {seen} records carries per-request speculative metrics with a verify step "
            "(metrics.speculative_decoding: start vLLM with --per-request-spec-decode-metrics summary)"
        )
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def request_distribution(readings: list[dict], break_even: float | None = None) -> dict:
    """Across requests: {"requests", "schemas", "tau_quantiles" {min, p10, median, p90, max}, "tau_request_mean"
    (each request counts once), "tau_step_mean" (each verify step counts once: what /metrics gives), "histogram"
    (all steps), "break_even", "paying" / "not_paying" (requests with τ above / at or below it; None without a
    break-even), "by_label" {label: {"requests", "tau_median"}}}."""
    if not readings:
        raise AnalyzeError("no requests to read")
    if break_even is not None and not (math.isfinite(break_even) and break_even >= 1.0):
        raise AnalyzeError(f"the break-even τ is a pass cost ratio of at least 1, got {break_even}")
    taus = [r["tau"] for r in readings]
    steps = sum(r["steps"] for r in readings)
    size = max(len(r["histogram"]) for r in readings)
    histogram = [sum(r["histogram"][j] for r in readings if j < len(r["histogram"])) for j in range(size)]
    labels: dict[str, list[float]] = {}
    for r in readings:
        if r.get("label"):
            labels.setdefault(r["label"], []).append(r["tau"])
    out = {
        "requests": len(readings),
        "schemas": sorted({r["schema"] for r in readings}),
        "tau_quantiles": {
            name: _quantile(taus, q)
            for name, q in (("min", 0), ("p10", 0.1), ("median", 0.5), ("p90", 0.9), ("max", 1))
        },
        "tau_request_mean": statistics.fmean(taus),
        "tau_step_mean": 1.0 + sum(r["accepted"] for r in readings) / steps,
        "histogram": histogram,
        "break_even": break_even,
        "paying": None,
        "not_paying": None,
        "by_label": {k: {"requests": len(v), "tau_median": statistics.median(v)} for k, v in sorted(labels.items())},
    }
    if break_even is not None:
        out["paying"] = sum(1 for t in taus if t > break_even)
        out["not_paying"] = len(taus) - out["paying"]
    return out


def break_even_of(result: dict) -> float | None:
    """The τ a request needs to pay at batch 1 with every pass drafting at the server's K: its speculative pass's
    cost ÷ the reference pass's, from a window's fitted pass costs (engine/tools/analyze.py); None without them."""
    costs = result.get("pass_costs")
    if not costs:
        return None
    plain, token, ref = (
        {int(b): v for b, v in (costs.get(name) or {}).items()} for name in ("plain_ms", "token_ms", "reference_ms")
    )
    if 1 not in plain or 1 not in token or not ref.get(1):
        return None
    k = result.get("k") or costs.get("k") or 1
    return max(1.0, (plain[1] + k * token[1]) / ref[1])
