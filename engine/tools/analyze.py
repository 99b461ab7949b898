"""Does speculation pay on your deployment? Two scrapes of a server's /metrics, read as a window.

vLLM exports ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos{position}`` (llama.cpp adopted the schema; SpecLens's own /metrics uses it
under ``speclens:``). Counters only grow, so what a window of traffic did is the difference of two scrapes:

* draft acceptance rate = accepted ÷ draft tokens (vLLM's definition: drafts never tried count as rejected);
* mean acceptance length = 1 + accepted ÷ drafts (tokens per verify pass that drafted, the bonus included);
* acceptance by position i = passes whose accepted path reached position i ÷ drafts; a chain whose drafts
  are each kept with probability α gives α^i, and α is fitted to the measured positions (least squares of
  log rate against i, through 1 at position 0);
* the expected tokens per pass E(α, K) = (1 − α^(K+1)) / (1 − α) for K = 1 .. K_max, and, with the server's
  pass costs (entered: the ms of a pass over 1 and over K + 1 tokens), the speedup E / (pass(K + 1) ÷
  pass(1)) at each K, linear in the pass width between the two costs measured. The recommendation is the K
  with the highest expected speedup, or turning speculation off where none clears 1 + MIN_GAIN.

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

from engine.metrics import expected_tokens_per_pass

__all__ = ["AnalyzeError", "analyze", "parse_prometheus", "scrape", "snapshot"]

MIN_DRAFTS = 20  # fewer drafts in the window say too little about acceptance
MIN_GAIN = 0.05  # a recommended K must be expected this much faster than no speculation
K_MAX = 8
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
SPEC = re.compile(r"^([a-zA-Z_]+):spec_decode_num_drafts(_total)?$")


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


def snapshot(text: str, model: str | None = None) -> dict:
    """The speculation counters of one scrape, summed over engines and label sets (of one model_name when
    `model` is given): {"prefix", "drafts", "draft_tokens", "accepted", "per_position" {i: count},
    "requests", "tokens"}. AnalyzeError when the server exports no speculation counters."""
    samples = parse_prometheus(text)
    prefixes = {m.group(1) for m in (SPEC.match(name) for name, _, _ in samples) if m} | _declared_prefixes(text)
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
                key = int(labels.get(by, -1))
                out[key] = out.get(key, 0.0) + value
            else:
                out += value
        return out

    requests = sum(v for n, _, v in samples if n in (f"{prefix}:request_success_total", f"{prefix}:request_success"))
    tokens = sum(v for n, _, v in samples if n in (f"{prefix}:generation_tokens_total", f"{prefix}:generation_tokens"))
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


def _pass_ratio(width: int, pass_ms: dict[int, float]) -> float:
    """pass(width) ÷ pass(1), linear between the widths measured (and beyond the widest)."""
    widths = sorted(pass_ms)
    if width in pass_ms:
        return pass_ms[width] / pass_ms[1]
    lo = max((w for w in widths if w < width), default=widths[0])
    hi = min((w for w in widths if w > width), default=widths[-1])
    if hi == lo:
        lo, hi = widths[-2], widths[-1]
    slope = (pass_ms[hi] - pass_ms[lo]) / (hi - lo)
    return (pass_ms[lo] + slope * (width - lo)) / pass_ms[1]


def analyze(before: str, after: str, interval_s: float | None = None, pass_ms: dict | None = None, model=None) -> dict:
    """The window between two scrapes (texts): rates, lengths, per-position acceptance with its α fit, and
    per K the expected tokens per pass and (with `pass_ms` {tokens in a pass: ms}, 1 included) speedup, and a
    recommendation in one sentence. AnalyzeError for counters that went down or too few drafts."""
    a, b = snapshot(before, model), snapshot(after, model)
    if a["prefix"] != b["prefix"]:
        raise AnalyzeError(f"the two scrapes come from different servers ({a['prefix']} and {b['prefix']})")
    delta = {key: b[key] - a[key] for key in ("drafts", "draft_tokens", "accepted", "requests", "tokens")}
    positions = sorted(set(a["per_position"]) | set(b["per_position"]))
    per_pos = {i: b["per_position"].get(i, 0.0) - a["per_position"].get(i, 0.0) for i in positions}
    if any(v < 0 for v in [*delta.values(), *per_pos.values()]):
        raise AnalyzeError("a counter went down between the scrapes: the server restarted; scrape again")
    if delta["drafts"] < MIN_DRAFTS:
        raise AnalyzeError(
            f"too few drafts in the window ({delta['drafts']:.0f}, at least {MIN_DRAFTS} are needed): send traffic "
            "during it, or widen --interval"
        )
    rate = delta["accepted"] / delta["draft_tokens"] if delta["draft_tokens"] else 0.0
    length = 1.0 + delta["accepted"] / delta["drafts"]
    by_position = [per_pos[i] / delta["drafts"] for i in positions if i >= 0]
    alpha = _fit_alpha(by_position)
    k_now = len(by_position) or None
    result = {
        "server": a["prefix"],
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
    ks = list(range(1, K_MAX + 1))
    result["expected_tokens_per_pass"] = {k: expected_tokens_per_pass(alpha or 0.0, k) for k in ks}
    if pass_ms:
        costs = {int(w): float(ms) for w, ms in pass_ms.items()}
        if 1 not in costs or len(costs) < 2 or any(ms <= 0 for ms in costs.values()):
            raise AnalyzeError("pass costs need a positive time for 1 token and for at least one wider pass")
        result["speedup"] = {k: result["expected_tokens_per_pass"][k] / _pass_ratio(k + 1, costs) for k in ks}
        best = max(ks, key=result["speedup"].__getitem__)
        if result["speedup"][best] < 1.0 + MIN_GAIN:
            result["recommendation"] = (
                f"turn speculation off at this load: with α = {alpha:.2f} no K is expected to be {MIN_GAIN:.0%} "
                f"faster (best K = {best}: {result['speedup'][best]:.2f}x) once a wider pass's cost is counted"
            )
        else:
            result["recommendation"] = (
                f"K = {best}: {result['expected_tokens_per_pass'][best]:.2f} tokens per pass at α = {alpha:.2f} "
                f"for a pass {_pass_ratio(best + 1, costs):.2f}x a one-token pass, {result['speedup'][best]:.2f}x expected"
            )
    else:
        result["recommendation"] = (
            f"α = {alpha:.2f}: without the server's pass costs only tokens per pass can be compared "
            f"({result['expected_tokens_per_pass'][k_now or 1]:.2f} at the current K); give --pass-ms to weigh them"
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
            data = json.load(fh)
    except OSError as exc:
        raise AnalyzeError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise AnalyzeError(f"{path} is not JSON (a saved scrape is {{'before', 'after', 'interval_s'}})") from None
    if not isinstance(data, dict) or not isinstance(data.get("before"), str) or not isinstance(data.get("after"), str):
        raise AnalyzeError(f"{path} is not a saved scrape: it needs the texts 'before' and 'after'")
    return data
