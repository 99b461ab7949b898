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

from engine.metrics import expected_tokens_per_pass

__all__ = ["AnalyzeError", "analyze", "parse_prometheus", "scrape", "snapshot"]

MAX_LINE = 4096
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
    # vLLM: the seconds each request spent decoding, summed over requests (a histogram's _sum)
    decode_s = sum(v for n, _, v in samples if n == f"{prefix}:request_decode_time_seconds_sum")
    return {
        "prefix": prefix,
        "drafts": total("spec_decode_num_drafts"),
        "draft_tokens": total("spec_decode_num_draft_tokens"),
        "accepted": total("spec_decode_num_accepted_tokens"),
        "per_position": total("spec_decode_num_accepted_tokens_per_pos", by="position"),
        "requests": requests,
        "tokens": tokens,
        "decode_s": decode_s,
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
    stops = next((b for b in batches if not best[b]), None)
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
        return head + f"; it still pays at batch {batches[-1]}, the largest probed (K = {best[batches[-1]]})"
    last = batches[batches.index(stops) - 1]
    return (
        head + f"; turn it off from about {stops} concurrent requests, where a speculative pass costs more than the "
        f"tokens it adds (at {last} it still pays with K = {best[last]})"
    )


def _window_passes(delta: dict, interval_s: float | None) -> dict:
    """What the window's traffic did per decode pass, from counters a vLLM server keeps:

    * decode passes = tokens − requests − accepted: a request's first token comes from its prefill, and each
      decode pass gives one token plus the drafts it accepted (None where requests or tokens are not counted);
    * drafting share = drafts ÷ passes: an n-gram drafter finds nothing to propose on many passes, which then
      give one token (1.0, assumed and said, where the passes are unknown);
    * ms per pass = decode seconds summed over requests ÷ passes: a pass as each request lived it, at the
      window's load (concurrency = decode seconds ÷ the window's seconds).
    """
    passes = delta["tokens"] - delta["requests"] - delta["accepted"]
    known = delta["requests"] > 0 and passes >= delta["drafts"] > 0
    out = {
        "decode_passes": passes if known else None,
        "drafting_share": min(1.0, delta["drafts"] / passes) if known else 1.0,
        "tokens_per_pass": (delta["tokens"] - delta["requests"]) / passes if known else None,
        "window_pass_ms": 1000.0 * delta["decode_s"] / passes if known and delta["decode_s"] > 0 else None,
        "concurrency": None,
    }
    if out["window_pass_ms"] and interval_s:
        out["concurrency"] = delta["decode_s"] / interval_s
    return out


def _path_and_token_costs(
    b: int, decode: float, mixed: float | None, s_mixed: float, verify: float, s_verify: float, k_probe: int
) -> tuple[float, float]:
    """(fixed ms of the speculative path, ms per drafted token) of a pass of `b` requests, from the plain pass,
    the one where a share s_mixed of the requests' passes drafted (when probed) and the one where s_verify
    did, K_probe drafts each (in both, some request of the batch drafts on every pass):

        mixed = decode + path + b·s_mixed·K·token        verify = decode + path + b·s_verify·K·token

    Without the mixed point, at b = 1, or with shares too close to separate, all of the difference is taken
    per drafted token (path = 0)."""
    if mixed is None or b < 2 or s_verify - s_mixed < 0.1:
        return 0.0, max(0.0, verify - decode) / (b * s_verify * k_probe)
    token = max(0.0, verify - mixed) / (b * k_probe * (s_verify - s_mixed))
    return max(0.0, verify - decode - b * s_verify * k_probe * token), token


def _weigh(result: dict, costs: dict, ks: list[int]) -> None:
    """Expected speedup by batch size and K from the server's pass costs (engine/tools/pass_costs.py).

    At batch B a plain step costs decode(B). A pass where requests draft costs more in two ways: a fixed cost
    of the speculative path, paid once any request of the batch drafts (probability 1 − (1 − d)^B at drafting
    share d), and a cost per drafted token (B·d·K of them, linear in K). Both come from the probe's plain,
    half-drafting and all-drafting cases at its K (_path_and_token_costs):

        pass(B, K) = decode(B) + (1 − (1 − d)^B) · path(B) + B · d · K · token(B)
        speedup(K, B) = tokens per pass(K) · decode(B) ÷ pass(B, K)

    Checked against the window: the model's ms per pass at the window's own K and load beside the ms per
    pass the server measured (its decode time ÷ its passes), and the window's speedup from its own numbers.
    """
    d = result["drafting_share"]
    try:
        decode = {int(b): float(ms) for b, ms in costs["decode_ms"].items()}
        verify = {int(b): float(ms) for b, ms in costs["verify_ms"].items()}
        mixed = {int(b): float(ms) for b, ms in (costs.get("mixed_ms") or {}).items()}
        s_mixed = {int(b): float(v) for b, v in (costs.get("mixed_share") or {}).items()}
        s_verify = {int(b): float(v) for b, v in (costs.get("verify_share") or {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise AnalyzeError(
            "pass costs need plain and speculative ms by batch size ('decode_ms', 'verify_ms')"
        ) from None
    batches = sorted(b for b in decode if b in verify and b >= 1)
    values = [*decode.values(), *verify.values(), *mixed.values(), *s_mixed.values(), *s_verify.values()]
    if not all(math.isfinite(v) for v in values) or any(b > 4096 for b in decode):
        raise AnalyzeError("pass costs must be finite numbers, for batch sizes up to 4096")
    if not batches or any(decode[b] <= 0 or verify[b] <= 0 for b in batches):
        raise AnalyzeError("pass costs need positive plain and speculative times for at least one batch size")
    k_probe = max(1, int(costs.get("k") or result["k"] or 1))
    # typed costs carry no shares: half of the batch's requests and all of them, as the words say
    parts = {
        b: _path_and_token_costs(
            b,
            decode[b],
            mixed.get(b),
            s_mixed.get(b, (b // 2) / b),
            verify[b],
            max(s_verify.get(b, 1.0), 0.05),
            k_probe,
        )
        for b in batches
    }

    def pass_ms(b: int, k: int) -> float:
        path, token = parts[b]
        return decode[b] + (1 - (1 - d) ** b) * path + b * d * k * token

    result["pass_costs"] = {
        "decode_ms": decode,
        "mixed_ms": mixed,
        "verify_ms": verify,
        "k": k_probe,
        "source": costs.get("source"),
        "path_ms": {b: parts[b][0] for b in batches},
        "token_ms": {b: parts[b][1] for b in batches},
    }
    if result["window_pass_ms"] and result["k"]:
        load = min(batches, key=lambda b: abs(b - (result["concurrency"] or 1)))
        result["model_check"] = {
            "batch": load,
            "model_ms": pass_ms(load, result["k"]),
            "measured_ms": result["window_pass_ms"],
        }
        result["window_speedup"] = result["tokens_per_pass"] * decode[load] / result["window_pass_ms"]
    result["speedup_by_batch"] = {
        b: {k: result["expected_tokens_per_pass"][k] * decode[b] / pass_ms(b, k) for k in ks} for b in batches
    }
    result["speedup"] = result["speedup_by_batch"][batches[0]]
    result["best_k_by_batch"] = {
        b: max(ks, key=row.__getitem__) if max(row.values()) >= 1.0 + MIN_GAIN else 0
        for b, row in result["speedup_by_batch"].items()
    }


def analyze(
    before: str, after: str, interval_s: float | None = None, pass_costs: dict | None = None, model=None
) -> dict:
    """The window between two scrapes (texts): rates, lengths, per-position acceptance with its α fit, the
    window's passes, per K the expected tokens per pass and (with `pass_costs`, engine/tools/pass_costs.py's
    dict) the expected speedup by batch size, and a recommendation in one sentence. AnalyzeError for counters
    that went down, too few drafts, or unusable pass costs."""
    a, b = snapshot(before, model), snapshot(after, model)
    if a["prefix"] != b["prefix"]:
        raise AnalyzeError(f"the two scrapes come from different servers ({a['prefix']} and {b['prefix']})")
    delta = {key: b[key] - a[key] for key in ("drafts", "draft_tokens", "accepted", "requests", "tokens", "decode_s")}
    positions = sorted(set(a["per_position"]) | set(b["per_position"]))
    per_pos = {i: b["per_position"].get(i, 0.0) - a["per_position"].get(i, 0.0) for i in positions}
    if not all(math.isfinite(v) for v in [*delta.values(), *per_pos.values()]):
        raise AnalyzeError("a speculation counter is not a finite number (NaN or Inf): not a usable scrape")
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
    result.update(_window_passes(delta, interval_s))
    ks = list(range(1, K_MAX + 1))
    share = result["drafting_share"]
    # Tokens per decode pass with K drafts: drafting passes give E(α, K), the others 1.
    result["expected_tokens_per_pass"] = {k: share * expected_tokens_per_pass(alpha or 0.0, k) + 1 - share for k in ks}
    if pass_costs:
        _weigh(result, pass_costs, ks)
        result["recommendation"] = _recommend(result, alpha or 0.0)
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
            data = json.load(fh)
    except OSError as exc:
        raise AnalyzeError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise AnalyzeError(f"{path} is not JSON (a saved scrape is {{'before', 'after', 'interval_s'}})") from None
    if not isinstance(data, dict) or not isinstance(data.get("before"), str) or not isinstance(data.get("after"), str):
        raise AnalyzeError(f"{path} is not a saved scrape: it needs the texts 'before' and 'after'")
    return data
