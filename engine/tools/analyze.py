"""Does speculation pay on your deployment? Two scrapes of a server's /metrics, read as a window.

vLLM exports ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos{position}`` (llama.cpp adopted the schema; SpecLens's own /metrics uses it
under ``speclens:``). Counters only grow, so what a window of traffic did is the difference of two scrapes:

* draft acceptance rate = accepted ÷ draft tokens (vLLM's definition: drafts never tried count as rejected);
* mean acceptance length = 1 + accepted ÷ drafts (tokens per verify pass that drafted, the bonus included);
* acceptance by position i = passes whose accepted path reached position i ÷ drafts; a chain whose drafts
  are each kept with probability α gives α^i, and α is fitted to the measured positions (least squares of
  log rate against i, through 1 at position 0);
* decode passes = tokens − requests − accepted, so the share of passes that drafted at all (an n-gram
  drafter often finds nothing) and, from vLLM's decode time, the ms each pass took;
* the expected tokens per pass with K drafts, d·E(α, K) + (1 − d), E(α, K) = (1 − α^(K+1)) / (1 − α), for
  K = 1 .. K_max, and, with the server's pass costs (plain and speculative ms by batch size: timed through its
  OpenAI API by engine/tools/pass_costs.py, or typed), the expected speedup for each K and batch size (see
  _weigh). The recommendation is the K with the highest expected speedup at low load and the batch from
  which no K clears 1 + MIN_GAIN (turn speculation off there), or turning it off where none ever does.

SGLang exports gauges instead (``sglang:spec_accept_length``, ``sglang:spec_accept_rate``): SGLang's recent
averages at the moment of a scrape, not counters. From them ``gauge_reading`` gives the mean acceptance length and
the rate as SGLang reports them, and says what cannot be derived: no window (the difference of two averages is not
the traffic between the scrapes), no per-position acceptance and so no α, no draft counts.

These speedups are estimates from measured inputs (the window's acceptance, the probed pass costs) under the
α^i chain model, and are labelled "expected" wherever shown; a race on the server measures the real one.

Read the rate and the length side by side: a rate can fall (more drafts tried per pass) while the length
stays; neither alone says whether drafting got worse. Nothing here runs a model.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.request

from engine.metrics import expected_tokens_per_pass, modelled_speedup, request_speedup

__all__ = [
    "AnalyzeError",
    "GAUGE_LIMITS",
    "analyze",
    "gauge_reading",
    "model_note",
    "parse_prometheus",
    "predicted_speedup",
    "read_window",
    "scrape",
    "snapshot",
    "ticket",
    "window_counts",
]

MAX_LINE = 4096
MIN_DRAFTS = 20  # fewer drafts in the window say too little about acceptance
PROBE_TABLES = (  # pass costs' tables by batch size (engine/tools/pass_costs.py writes them)
    "decode_ms",
    "mixed_ms",
    "verify_ms",
    "decode_share",
    "mixed_share",
    "verify_share",
    "baseline_decode_ms",
    "outside_ms",
    "baseline_outside_ms",
)
MIN_GAIN = 0.05  # a recommended K must be expected this much faster than no speculation
K_MAX = 8
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
SPEC = re.compile(r"^([a-zA-Z_]+):spec_decode_num_drafts(_total)?$")


# vLLM's per-request histograms and per-step counts read by `snapshot` (name after the prefix → key): the seconds
# each request spent decoding (first token to last), from arrival to its end (e2e), waiting, and from being
# scheduled to its first token (prefill: in a continuous batch that includes other requests' decode steps); the
# prompt tokens; and the engine's steps (iterations) with the tokens they processed.
TIMES = {
    "decode_s": "request_decode_time_seconds_sum",
    "e2e_s": "e2e_request_latency_seconds_sum",
    "queue_s": "request_queue_time_seconds_sum",
    "prefill_s": "request_prefill_time_seconds_sum",
    "timed_requests": "e2e_request_latency_seconds_count",
    "prompt_tokens": "request_prompt_tokens_sum",
    "steps": "iteration_tokens_total_count",
    "step_tokens": "iteration_tokens_total_sum",
}
WINDOW_KEYS = ("drafts", "draft_tokens", "accepted", "requests", "tokens", *TIMES)


class AnalyzeError(ValueError):
    """What is wrong with a server, a scrape or a window, in words for the user."""


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample of a Prometheus text exposition; AnalyzeError when the text is not
    one (an HTML page, JSON, an empty answer)."""
    if not isinstance(text, str) or not text.strip():
        raise AnalyzeError("the answer is empty, not Prometheus metrics")
    samples = []
    declared = False
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line.startswith("# TYPE "):
            declared = True
        if not line or line.startswith("#"):
            continue
        if len(line) > MAX_LINE:  # real samples are a few hundred characters; a huge line is not one (and the
            # pattern below would take quadratic time on it)
            raise AnalyzeError(f"line {number} is longer than {MAX_LINE} characters: not a Prometheus sample")
        match = SAMPLE.match(line)
        if match is None:
            raise AnalyzeError(f"line {number} is not a Prometheus sample: {line[:80]!r}")
        name, _, labels, value = match.group(1), match.group(2), match.group(3), match.group(4)
        try:
            number_value = float(value)
        except ValueError:
            raise AnalyzeError(f"line {number}: {value!r} is not a number") from None
        samples.append((name, dict(LABEL.findall(labels or "")), number_value))
    if not samples and not declared:
        raise AnalyzeError("the answer holds no Prometheus samples")
    return samples


def _declared_prefixes(text: str) -> set[str]:
    """Prefixes of spec_decode counters declared by "# TYPE" lines (a fresh server declares its counters
    before it has counted anything)."""
    names = (line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ") and len(line.split()) > 2)
    return {m.group(1) for m in (SPEC.match(name) for name in names) if m}


def snapshot(text: str, model: str | None = None, require_speculation: bool = True) -> dict:
    """The speculation counters of one scrape, summed over engines and label sets (of one model_name when
    `model` is given): {"prefix", "drafts", "draft_tokens", "accepted", "per_position" {i: count},
    "requests", "tokens"}. AnalyzeError when the server exports no speculation counters."""
    samples = parse_prometheus(text)
    prefixes = {m.group(1) for m in (SPEC.match(name) for name, _, _ in samples) if m} | _declared_prefixes(text)
    if not prefixes and not require_speculation:  # a server without speculation: its own counters only
        prefixes = {m.group(1) for m in (re.match(r"^([a-zA-Z_]+):request_success", n) for n, _, _ in samples) if m}
        prefixes = prefixes or {"vllm"}
    if not prefixes:
        raise AnalyzeError(
            "this server exports no speculative decoding counters (no *:spec_decode_num_drafts): is speculation "
            "turned on (vLLM: --speculative-config)?"
        )
    prefix = sorted(prefixes)[0]

    def total(suffix: str, by: str | None = None):
        out: dict = {} if by else 0.0
        for name, labels, value in samples:
            if name not in (f"{prefix}:{suffix}", f"{prefix}:{suffix}_total"):
                continue
            if model is not None and labels.get("model_name") not in (None, model):
                continue
            if by:
                label = labels.get(by, "-1")
                if not re.fullmatch(r"-?\d{1,4}", label):
                    raise AnalyzeError(f"{name} has {by}={label!r}, not a small whole number")
                key = int(label)
                out[key] = out.get(key, 0.0) + value
            else:
                out += value
        return out

    requests = sum(v for n, _, v in samples if n in (f"{prefix}:request_success_total", f"{prefix}:request_success"))
    tokens = sum(v for n, _, v in samples if n in (f"{prefix}:generation_tokens_total", f"{prefix}:generation_tokens"))
    if not tokens:  # llama.cpp: the tokens it predicted
        tokens = sum(v for n, _, v in samples if n == f"{prefix}:tokens_predicted_total")
    if not tokens:  # ours: the tokens the runs emitted
        tokens = total("spec_decode_num_emitted_tokens")
    return {
        "prefix": prefix,
        "drafts": total("spec_decode_num_drafts"),
        "draft_tokens": total("spec_decode_num_draft_tokens"),
        "accepted": total("spec_decode_num_accepted_tokens"),
        "per_position": total("spec_decode_num_accepted_tokens_per_pos", by="position"),
        "requests": requests,
        "tokens": tokens,
        # vLLM's histograms, summed over requests (their _sum; 0 where a server does not keep them)
        **{key: total(name) for key, name in TIMES.items()},
    }


def scrape(url: str, timeout: float = 10.0) -> str:
    """GET a /metrics page (the URL as given, or with /metrics added); AnalyzeError saying why it failed."""
    if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url):
        raise AnalyzeError(f"not an http(s) URL: {url!r}")
    target = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            return response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        raise AnalyzeError(f"{target} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AnalyzeError(f"cannot reach {target}: {getattr(exc, 'reason', exc)}") from None


def _fit_alpha(rates: list[float]) -> float | None:
    """α for rates ≈ α^i, i = 1.. (least squares of log rate on i through the origin); None without data."""
    points = [(i, math.log(r)) for i, r in enumerate(rates, start=1) if r > 0]
    if not points:
        return None
    return math.exp(sum(i * y for i, y in points) / sum(i * i for i, _ in points))


def _recommend(result: dict, alpha: float) -> str:
    """One sentence: the K to run at the lowest load probed, and the batch from which speculation stops paying."""
    by_batch = result["speedup_by_batch"]
    batches = sorted(by_batch)
    best = result["best_k_by_batch"]
    low = batches[0]
    # where it stops paying for good: no K pays at that batch nor at any larger one probed
    stops = next((b for i, b in enumerate(batches) if not any(best[c] for c in batches[i:])), None)
    # a batch without gain between batches with gain is the probe's noise, and is said to be
    gaps = [b for b in batches if not best[b] and (stops is None or b < stops)]
    noise = (
        f" (the probe found no gain at batch {', '.join(map(str, gaps))} but did at larger ones: its noise; probe "
        "again before deciding there)"
        if gaps
        else ""
    )
    if not best[low]:
        top = max(by_batch[low], key=by_batch[low].__getitem__)
        return (
            f"turn speculation off: with α = {alpha:.2f} and {result['drafting_share']:.0%} of passes drafting, no K "
            f"is expected to be {MIN_GAIN:.0%} faster even at batch {low} (best K = {top}: {by_batch[low][top]:.2f}x), "
            "because a speculative pass costs more than the tokens it adds"
        )
    head = (
        f"K = {best[low]} at low load: {result['expected_tokens_per_pass'][best[low]]:.2f} tokens per pass, "
        f"{by_batch[low][best[low]]:.2f}x expected at batch {low}"
    )
    if stops is None and len(batches) == 1:
        return head + " (no larger batch was probed)"
    if stops is None:
        return head + f"; it still pays at batch {batches[-1]}, the largest probed (K = {best[batches[-1]]})" + noise
    last = batches[batches.index(stops) - 1]
    return (
        head + f"; turn it off from about {stops} concurrent requests, where a speculative pass costs more than the "
        f"tokens it adds (at {last} it still pays with K = {best[last]})" + noise
    )


def _window_passes(delta: dict, interval_s: float | None) -> dict:
    """What the window's traffic did per decode pass, from counters a vLLM server keeps:

    * decode passes = tokens − requests − accepted: a request's first token comes from its prefill, and each
      decode pass gives one token plus the drafts it accepted (None where requests or tokens are not counted);
    * drafting share = drafts ÷ passes: an n-gram drafter finds nothing to propose on many passes, which then
      give one token (1.0, assumed and said, where the passes are unknown);
    * ms per pass = decode seconds summed over requests ÷ passes: a pass as each request lived it;
    * the window's load (concurrency: requests in a step) = (requests + passes) ÷ the engine's steps (vLLM's
      ``iteration_tokens_total`` count: a request takes part in one prefill step and in each of its passes),
      else decode seconds ÷ the window's seconds;
    * per request: tokens, prompt tokens and the time outside its decode passes (e2e − decode: waiting, its
      prefill step, the server's work before and after), which dilutes what speculation changes.
    """
    passes = delta["tokens"] - delta["requests"] - delta["accepted"]
    known = delta["requests"] > 0 and passes >= delta["drafts"] > 0
    timed = delta.get("timed_requests", 0)
    out = {
        "decode_passes": passes if known else None,
        "drafting_share": min(1.0, delta["drafts"] / passes) if known else 1.0,
        "tokens_per_pass": (delta["tokens"] - delta["requests"]) / passes if known else None,
        "window_pass_ms": 1000.0 * delta["decode_s"] / passes if known and delta["decode_s"] > 0 else None,
        "concurrency": None,
        "tokens_per_request": delta["tokens"] / delta["requests"] if delta["requests"] > 0 else None,
        "prompt_tokens_per_request": delta.get("prompt_tokens", 0) / timed if timed > 0 else None,
        "outside_ms": None,
    }
    if timed > 0 and delta.get("e2e_s", 0) > 0:
        out["outside_ms"] = max(0.0, 1000.0 * (delta["e2e_s"] - delta["decode_s"]) / timed)
    if known and delta.get("steps", 0) > 0:
        # each request is one prefill step's row and one row of each of its decode passes: rows ÷ steps
        # (at least 1: a long prompt's prefill can take two steps, which reads a window of one request at a
        # time as 0.9)
        out["concurrency"] = max(1.0, (delta["requests"] + passes) / delta["steps"])
    elif out["window_pass_ms"] and interval_s:
        out["concurrency"] = delta["decode_s"] / interval_s
    return out


def _fit_pass_line(b: int, points: list[tuple[float, float]], k_probe: int) -> tuple[float, float]:
    """(ms of a pass where nothing is drafted, ms per drafted token) at batch `b`: the least-squares line of
    ms per pass against the share of the requests' passes that drafted, through the probe's cases (plain,
    half and all drafting, each at the share it really drafted), K_probe draft tokens per drafting pass:

        ms = plain + share · b · K_probe · token

    A single point, or shares that coincide, cannot give a slope: AnalyzeError."""
    n = len(points)
    mean_s = sum(p[0] for p in points) / n
    mean_ms = sum(p[1] for p in points) / n
    var = sum((p[0] - mean_s) ** 2 for p in points)
    if n < 2 or var < 1e-6:
        raise AnalyzeError(f"pass costs at batch {b} need passes at two different drafting shares")
    slope = sum((p[0] - mean_s) * (p[1] - mean_ms) for p in points) / var
    plain = mean_ms - slope * mean_s
    return plain, max(0.0, slope) / (b * k_probe)


def _cost_tables(costs: dict) -> tuple[dict[str, dict[int, float]], list[int]]:
    """The pass costs' tables (PROBE_TABLES) as numbers by batch size, checked, and the batch sizes with both a
    plain and a speculative time: what ``_weigh`` reads; an AnalyzeError says what is wrong with them."""
    try:
        tables = {name: {int(b): float(v) for b, v in (costs.get(name) or {}).items()} for name in PROBE_TABLES}
    except (TypeError, ValueError, AttributeError):
        raise AnalyzeError(
            "pass costs need plain and speculative ms by batch size ('decode_ms', 'verify_ms')"
        ) from None
    decode, verify = tables["decode_ms"], tables["verify_ms"]
    batches = sorted(b for b in decode if b in verify and b >= 1)
    values = [v for table in tables.values() for v in table.values()]
    if not all(math.isfinite(v) for v in values) or any(b > 4096 for b in decode):
        raise AnalyzeError("pass costs must be finite numbers, for batch sizes up to 4096")
    if not batches or any(v <= 0 for v in [*decode.values(), *verify.values()]):
        raise AnalyzeError("pass costs need positive plain and speculative times for at least one batch size")
    return tables, batches


def _weigh(result: dict, costs: dict, ks: list[int]) -> None:
    """Expected speedup by batch size and K from the server's pass costs (engine/tools/pass_costs.py).

    At batch B, from the probe's cases (_fit_pass_line): a pass where nothing is drafted costs plain(B), and
    every drafted token token(B) more (B·d·K of them at drafting share d, linear in K):

        pass(B, K) = plain(B) + B · d · K · token(B)

    reference(B) is a pass of a server without speculation where one was probed, else plain(B). A request
    also spends time outside its decode passes (waiting, its prefill step, the server's work around it), the
    same with and without speculation, which dilutes the gain: where vLLM counts it (e2e − decode per
    request), the speedup is of whole requests of the window's length (``predicted_speedup``), with
    outside(B) from the window and the probe's slope over B (``_outside_model``); elsewhere of decode passes:

        speedup(K, B) = tokens per pass(K) · reference(B) ÷ pass(B, K)

    Checked against the window: the model's ms per pass at the window's own K and load beside the ms per
    pass the server measured (its decode time ÷ its passes), and the window's speedup from its own numbers.
    """
    d = result["drafting_share"]
    tables, batches = _cost_tables(costs)
    plain = tables["baseline_decode_ms"]
    k_probe = max(1, int(costs.get("k") or result["k"] or 1))
    # typed costs carry no shares: none, half and all of the batch's requests drafting, as the words say
    default_share = {"decode": lambda b: 0.0, "mixed": lambda b: (b // 2) / b, "verify": lambda b: 1.0}
    parts = {}
    for b in batches:
        points = [
            (tables[f"{name}_share"].get(b, default_share[name](b)), tables[f"{name}_ms"][b])
            for name in ("decode", "mixed", "verify")
            if b in tables[f"{name}_ms"]
        ]
        parts[b] = _fit_pass_line(b, points, k_probe)

    def pass_ms(b: int, k: int) -> float:
        base, token = parts[b]
        return base + b * d * k * token

    outside_at = _outside_model(result, tables, costs.get("overhead_ms"))
    # What speculation is weighed against: a server without it where one was probed, else this server's own
    # passes without drafts (on vLLM's CPU build those cost more than a plain server's, so without the other
    # server the speedups lean high, and the words say so; docs/bench/2026-12-07-notes-from-engine.md).
    reference = {b: plain[b] if plain.get(b, 0) > 0 else parts[b][0] for b in batches}
    against = "a server without speculation" if all(plain.get(b, 0) > 0 for b in batches) else "its own plain passes"
    result["pass_costs"] = {
        "against": against,
        "reference_ms": reference,
        **{name: table for name, table in tables.items() if table},
        "k": k_probe,
        "source": costs.get("source"),
        "plain_ms": {b: parts[b][0] for b in batches},
        "token_ms": {b: parts[b][1] for b in batches},
        "outside_by_batch": {b: outside_at(b) for b in batches} if outside_at else None,
    }
    if result["window_pass_ms"] and result["k"]:
        load = min(batches, key=lambda b: abs(b - (result["concurrency"] or 1)))
        result["model_check"] = {
            "batch": load,
            "model_ms": pass_ms(load, result["k"]),
            "measured_ms": result["window_pass_ms"],
        }
        result["window_speedup"] = modelled_speedup(
            result["tokens_per_pass"], reference[load], result["window_pass_ms"]
        )
    result["speedup_by_batch"] = {
        b: {k: predicted_speedup(result, b, k, result["expected_tokens_per_pass"][k]) for k in ks} for b in batches
    }
    result["model"] = "requests" if _request_model(result) else "decode passes"
    result["speedup"] = result["speedup_by_batch"][batches[0]]
    result["best_k_by_batch"] = {
        b: max(ks, key=row.__getitem__) if max(row.values()) >= 1.0 + MIN_GAIN else 0
        for b, row in result["speedup_by_batch"].items()
    }


def _request_model(result: dict) -> bool:
    """Whether the window says enough to weigh whole requests (their time outside decode passes, their length)."""
    n = result.get("tokens_per_request")
    return bool(result["pass_costs"].get("outside_by_batch")) and n is not None and n > 1


def predicted_speedup(result: dict, b: int, k: int, tokens_per_pass: float, share: float | None = None):
    """The model's speedup at batch `b` with K = `k` drafts giving `tokens_per_pass`, for a weighed window
    (`_weigh` filled result["pass_costs"]); `share` of passes drafting (default: the window's). A request of the
    window's length N spends outside(B) outside decode passes, then N − 1 tokens at `tokens_per_pass`:

        plain(B)       = outside(B) + (N − 1) · reference(B)
        speculative(B) = outside(B) + (N − 1) ÷ tokens per pass · pass(B, K)
        speedup        = plain ÷ speculative

    Where the window has no per-request times (not vLLM), decode passes only: tokens per pass · reference ÷
    pass, which leaves out what dilutes the gain (and so reads high where requests have such times)."""
    costs = result["pass_costs"]
    d = result["drafting_share"] if share is None else share
    pass_ms = costs["plain_ms"][b] + b * d * k * costs["token_ms"][b]
    reference = costs["reference_ms"][b]
    if not _request_model(result):
        return modelled_speedup(tokens_per_pass, reference, pass_ms)
    return request_speedup(
        costs["outside_by_batch"][b], result["tokens_per_request"], tokens_per_pass, reference, pass_ms
    )


def _outside_model(result: dict, tables: dict, overhead: dict | None = None):
    """outside(B): ms of a request outside its decode passes at batch B (waiting, its prefill step, the server's
    work around the request), or None where the window does not say (a server without vLLM's e2e and decode
    histograms). The window's own per-request figure at its load, plus, per concurrent request more or less,
    the slope the probe measured on its plain requests (both servers' points, least squares over B), as each
    request waits for the others' prefill. Plus the fixed part of a request's decode time the probe took out of
    its passes (`overhead`: pass_costs' "overhead_ms"), which a request pays with or without speculation
    (figures: docs/bench/2026-12-07-notes-from-engine.md)."""
    outside, load = result.get("outside_ms"), result.get("concurrency") or 1.0
    if outside is None:
        return None
    try:
        fixed = {int(b): float(ms) for b, ms in ((overhead or {}).get("baseline") or {}).items()}
    except (TypeError, ValueError, AttributeError):
        raise AnalyzeError("pass costs' overhead_ms must be ms by batch size") from None
    points = [(b, ms) for name in ("outside_ms", "baseline_outside_ms") for b, ms in tables[name].items()]
    slope = None  # not probed (typed costs, or a probe from before it read them): held at the window's figure, said
    if len({b for b, _ in points}) >= 2:
        mean_b = sum(b for b, _ in points) / len(points)
        mean_ms = sum(ms for _, ms in points) / len(points)
        var = sum((b - mean_b) ** 2 for b, _ in points)
        slope = max(0.0, sum((b - mean_b) * (ms - mean_ms) for b, ms in points) / var)
    result["outside_per_request_ms"] = slope
    return lambda b: max(0.0, outside + (b - load) * (slope or 0.0)) + fixed.get(b, 0.0)


def model_note(result: dict) -> str:
    """What a weighed window's expected speedups count, in words (the CLI, the tab and its chart say this)."""
    if result.get("model") != "requests":
        return (
            "decode passes only: the server counts no per-request times, so a request's prefill and the server's "
            "work outside a pass are left out, and the speedups lean high"
        )
    slope = result.get("outside_per_request_ms")
    grows = (
        f"{slope:.0f} ms more per concurrent request, as the probe measured"
        if slope is not None
        else "held at that figure at every batch size: these pass costs do not say how it grows"
    )
    return (
        f"whole requests of {result['tokens_per_request']:.0f} tokens, each with its time outside decode passes "
        f"({result['outside_ms']:.0f} ms in the window at {result['concurrency'] or 1:.1f} concurrent requests; "
        f"{grows})"
    )


ENGINE_OF = {"vllm": "vllm", "llamacpp": "llama.cpp"}  # a scrape's prefix → engine/tools/launch.py's engine


def _bands(best: dict) -> str:
    """'K = 4 at B = 1–2, K = 2 at B = 4–8, off from B = 16': runs of batch sizes with the same best K; a batch
    without gain between batches with gain is named as the probe's noise (as the recommendation does)."""
    batches = sorted(best)
    runs: list[list[int]] = []
    for b in batches:
        if runs and best[runs[-1][-1]] == best[b]:
            runs[-1].append(b)
        else:
            runs.append([b])
    parts = []
    for i, run in enumerate(runs):
        span = f"B = {run[0]}" if len(run) == 1 else f"B = {run[0]}–{run[-1]}"
        if best[run[0]]:
            parts.append(f"K = {best[run[0]]} at {span}")
        elif any(best[b] for r in runs[i + 1 :] for b in r):
            parts.append(f"no clear gain at {span} (the probe's noise: probe again there)")
        else:
            parts.append(f"off from B = {run[0]}")
    return ", ".join(parts)


def ticket(result: dict, drafter: str = "ngram", what_if: dict | None = None) -> str:
    """The recommendation as one sentence an engineer can paste into a ticket: the K (or off) per load band, the
    gain (expected, or measured by a what-if, with its spread: each labelled), and the line that turns it on
    (engine/tools/launch.py, for the server's engine and the model its counters name). `drafter` is the method
    the server runs (its counters do not say)."""
    from engine.tools.launch import launch_command

    best = result.get("best_k_by_batch")
    if not best:
        return result["recommendation"]
    low = min(best)
    model = result.get("model_name") or "MODEL"
    engine = ENGINE_OF.get(result["server"])
    k_low = best[low] or max(result["speedup_by_batch"][low], key=result["speedup_by_batch"][low].__getitem__)
    line = None
    if engine:
        made = launch_command(engine, drafter if best[low] else "none", k=int(k_low), target=model)
        line = made["command"] or f"({made['notes'][0]})"
    if not any(best.values()):
        head = (
            f"Turn speculation off on this {result['server']} server: no K is expected to gain {MIN_GAIN:.0%} at any "
            f"load probed (best at batch {low}: K = {k_low}, {result['speedup_by_batch'][low][k_low]:.2f}× expected)"
        )
    else:
        head = (
            f"Run {_bands(best)} (B: concurrent requests) on this {result['server']} server: "
            f"{result['speedup_by_batch'][low][best[low]]:.2f}× expected at batch {low} (modelled from this window's "
            f"acceptance and the {'typed' if result['pass_costs'].get('source') == 'typed' else 'probed'} pass costs)"
        )
    if what_if and what_if.get("speedup"):
        i = 0
        lo, hi = what_if["speedup_bounds"][i]
        spread = f" ({lo:.2f}–{hi:.2f} over its repeats)" if lo is not None and hi is not None else ""
        head += (
            f"; measured by a what-if at K = {len(what_if['rates'])}: {what_if['speedup'][i]:.2f}×{spread} at batch "
            f"{what_if['batch_sizes'][i]}"
        )
    if line:
        head += f"; {'serve with' if best[low] else 'serve without speculation'}: {line}"
    elif result["server"] == "speclens":
        head += f"; SpecLens: python -m engine generate --drafter {drafter} --k {k_low}"
    return head


GAUGES = {"mean_acceptance_length": "sglang:spec_accept_length", "acceptance_rate": "sglang:spec_accept_rate"}
GAUGE_LIMITS = (
    "SGLang exports gauges, not counters: each is SGLang's recent average when scraped, so no window of traffic "
    "(the difference of two averages is not what happened between the scrapes), no acceptance by position and "
    "so no α, and no draft counts can be derived; the expected speedup by K needs counters (vLLM, llama.cpp, "
    "SpecLens) or a race on the server"
)


def gauge_reading(text: str, model: str | None = None) -> dict | None:
    """SGLang's speculation gauges in one scrape: {"server": "sglang", "mean_acceptance_length", "acceptance_rate"
    (None when not exported), "gauges_only": True, "limits"}; None when the scrape has no such gauge. The mean over
    label sets (one per model and engine)."""
    samples = parse_prometheus(text)
    found: dict = {}
    for key, name in GAUGES.items():
        values = [
            v
            for n, labels, v in samples
            if n == name and (model is None or labels.get("model_name") in (None, model)) and math.isfinite(v)
        ]
        found[key] = sum(values) / len(values) if values else None
    if found["mean_acceptance_length"] is None:
        return None
    return {"server": "sglang", **found, "gauges_only": True, "limits": GAUGE_LIMITS}


def analyze(
    before: str, after: str, interval_s: float | None = None, pass_costs: dict | None = None, model=None
) -> dict:
    """The window between two scrapes (texts): rates, lengths, per-position acceptance with its α fit, the
    window's passes, per K the expected tokens per pass and (with `pass_costs`, engine/tools/pass_costs.py's
    dict) the expected speedup by batch size, and a recommendation in one sentence. AnalyzeError for counters
    that went down, too few drafts, or unusable pass costs. A server that exports SGLang's gauges instead of
    counters gets what they say (``gauge_reading`` of the second scrape, ``gauges_only``) and what they cannot."""
    if not any(SPEC.match(name) for name, _, _ in parse_prometheus(after)) and not _declared_prefixes(after):
        gauges = gauge_reading(after, model)
        if gauges is not None:
            rate = gauges["acceptance_rate"]
            return {
                **gauges,
                "interval_s": interval_s,
                "recommendation": (
                    f"SGLang reports a mean acceptance length of {gauges['mean_acceptance_length']:.2f}"
                    + (f" and an acceptance rate of {rate:.2f}" if rate is not None else "")
                    + f" (its recent averages at the second scrape). {GAUGE_LIMITS}"
                ),
            }
    return read_window(window_counts(before, after, model), interval_s, pass_costs)


def window_counts(before: str, after: str, model: str | None = None, require_speculation: bool = True) -> dict:
    """What the traffic between two scrapes (texts) did, as counter differences: {"server" (the counters'
    prefix), "model_name", every key of WINDOW_KEYS, "per_position" [accepted at position 0, 1, ..]}. Plain
    numbers, so a window can be stored and read again (``read_window``) without its scrapes. AnalyzeError for
    scrapes of two servers, counters that went down or are not finite; `require_speculation` as `snapshot`."""
    a = snapshot(before, model, require_speculation)
    b = snapshot(after, model, require_speculation)
    if a["prefix"] != b["prefix"]:
        raise AnalyzeError(f"the two scrapes come from different servers ({a['prefix']} and {b['prefix']})")
    delta = {key: b[key] - a[key] for key in WINDOW_KEYS}
    positions = sorted(i for i in set(a["per_position"]) | set(b["per_position"]) if i >= 0)
    per_pos = [b["per_position"].get(i, 0.0) - a["per_position"].get(i, 0.0) for i in positions]
    if not all(math.isfinite(v) for v in [*delta.values(), *per_pos]):
        raise AnalyzeError("a speculation counter is not a finite number (NaN or Inf): not a usable scrape")
    if any(v < 0 for v in [*delta.values(), *per_pos]):
        raise AnalyzeError("a counter went down between the scrapes: the server restarted; scrape again")
    names = {
        labels.get("model_name")
        for name, labels, _ in parse_prometheus(after)
        if name.startswith(f"{b['prefix']}:") and labels.get("model_name")
    }
    return {
        "server": a["prefix"],
        "model_name": model or (names.pop() if len(names) == 1 else None),
        **delta,
        "per_position": per_pos,
    }


def read_window(delta: dict, interval_s: float | None = None, pass_costs: dict | None = None) -> dict:
    """`analyze` of a window already read (``window_counts``): AnalyzeError for too few drafts or unusable
    pass costs."""
    if delta["drafts"] < MIN_DRAFTS:
        raise AnalyzeError(
            f"too few drafts in the window ({delta['drafts']:.0f}, at least {MIN_DRAFTS} are needed): send traffic "
            "during it, or leave more time between the two scrapes"
        )
    rate = delta["accepted"] / delta["draft_tokens"] if delta["draft_tokens"] else 0.0
    length = 1.0 + delta["accepted"] / delta["drafts"]
    by_position = [count / delta["drafts"] for count in delta["per_position"]]
    alpha = _fit_alpha(by_position)
    k_now = len(by_position) or None
    result = {
        "server": delta["server"],
        "model_name": delta["model_name"],
        "interval_s": interval_s,
        "drafts": delta["drafts"],
        "draft_tokens": delta["draft_tokens"],
        "accepted": delta["accepted"],
        "requests": delta["requests"],
        "tokens": delta["tokens"],
        "acceptance_rate": rate,
        "mean_acceptance_length": length,
        "acceptance_by_position": by_position,
        "alpha_fit": alpha,
        "k": k_now,
    }
    result.update(_window_passes(delta, interval_s))
    ks = list(range(1, K_MAX + 1))
    share = result["drafting_share"]
    # Tokens per decode pass with K drafts: drafting passes give E(α, K), the others 1.
    result["expected_tokens_per_pass"] = {k: share * expected_tokens_per_pass(alpha or 0.0, k) + 1 - share for k in ks}
    if pass_costs:
        _weigh(result, pass_costs, ks)
        result["recommendation"] = _recommend(result, alpha or 0.0)
        if result["pass_costs"]["against"] != "a server without speculation":
            result["recommendation"] += (
                " (weighed against this server's own plain passes, which on vLLM cost more than a server without "
                "speculation: time one too to weigh it fairly)"
            )
    else:
        result["recommendation"] = (
            f"α = {alpha:.2f}: without the server's pass costs only tokens per pass can be compared "
            f"({result['expected_tokens_per_pass'][k_now or 1]:.2f} at the current K); time the server's passes (--probe) or give them (--pass-ms) to weigh them"
            if alpha is not None
            else "no per-position counters: only the rate and the length are known"
        )
    return result


def record(url: str, interval_s: float) -> dict:
    """Two scrapes `interval_s` apart: {"url", "interval_s", "before", "after"} (what --save writes)."""
    before = scrape(url)
    time.sleep(interval_s)
    return {"url": url, "interval_s": interval_s, "before": before, "after": scrape(url)}


def load_recording(path: str) -> dict:
    """A saved pair of scrapes (record's JSON); AnalyzeError when the file is not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise AnalyzeError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_recording(text, path)


def parse_recording(text: str, name: str = "the window") -> dict:
    """A saved pair of scrapes given as JSON text (`name` says where it came from in the errors)."""
    try:
        data = json.loads(text)
    except ValueError:
        raise AnalyzeError(f"{name} is not JSON (a saved scrape is {{'before', 'after', 'interval_s'}})") from None
    if not isinstance(data, dict) or not isinstance(data.get("before"), str) or not isinstance(data.get("after"), str):
        raise AnalyzeError(f"{name} is not a saved scrape: it needs the texts 'before' and 'after'")
    return data
