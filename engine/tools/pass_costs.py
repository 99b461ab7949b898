"""What a server's decode passes cost, plain and speculative, by batch size, timed through its OpenAI API.

Whether speculation pays depends on how much dearer a pass that verifies K drafts is than a plain decode
step, at the batch sizes the server runs. A server does not report its pass times, so they are measured from
outside, with requests whose work is known, B at a time (sent together, so the server batches them), three
cases per B:

* plain: every prompt is random token ids, which give an n-gram drafter nothing to match;
* all drafting: every prompt is a random run of tokens repeated (S S S S[:8]); the model continues it by
  copying, so the drafter proposes its K tokens on (nearly) every pass and the pass verifies them;
* half drafting: half of each (B ≥ 2), as real traffic mixes them.

The model continues random prompts too, sometimes by copying a piece of them, so even the plain case drafts on
some passes and the drafting cases not on all: each case is kept with the share of its passes that drafted, and
engine/tools/analyze.py fits ms per pass against that share, batch size by batch size.

A request's decode time holds more than its passes: a fixed part per request, which over the few passes of a
short probe request would read every pass dearer. So each plain case is sent twice, with requests of TOKENS and
of LONG tokens; per server and batch size the pair separates that fixed part (_overhead_ms), taken out of every
case's decode time at that batch size. Around each plain case the probe also reads each request's time outside
its decode passes (e2e − decode): how it grows with the batch (each request waits for the others' prefill) is
what the analyzer adds to a window's own figure.

Each request asks for TOKENS tokens (the drafting ones (K + 1)× as many, so that the batch keeps its mix to the
end) and ignores end of sequence. Around each case the probe scrapes the server's counters: passes = tokens −
requests − accepted, the share of them that drafted, and K = draft tokens ÷ drafts. Where the server reports how
long each request decoded (vLLM's ``request_decode_time_seconds``), ms per pass = those seconds ÷ the passes: the
server's own clock in steady state, free of HTTP and prefill; elsewhere it is the wall-time difference with
requests of one token, over the passes. The rounds of all the cases are interleaved, so that a slow spell of the
host lands on every case alike, after one untimed round of every case (a fresh server compiles each new shape
the first time it sees it). Prompts are fresh random tokens every time (no prefix-cache hit). These are measured
costs at the server's own K; the analyzer scales the drafted part linearly to other K, and says so. Why each
step is there: docs/bench/2026-12-07-notes-from-engine.md.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.error
import urllib.request

from engine.tools.analyze import PROBE_TABLES, AnalyzeError

__all__ = ["BATCHES", "costs_from_cases", "counted_reading", "parse_pass_costs", "probe_pass_costs"]

BATCHES = (1, 2, 4, 8, 16)  # batch sizes probed (capped by the caller's max_batch)
TOKEN_IDS = (100, 10_000)  # random prompt ids drawn here: ordinary tokens in any vocabulary of ≥ 10k
# Tokens in the repeated run of the speculative probe's prompt (S S S S[:8]): three copies make the model copy
# reliably, where two copies of a shorter run leave many of its passes without a draft.
RUN = 24  # chosen by measurement: docs/bench/2026-12-07-notes-from-engine.md
MIN_SHARE = 0.1  # a batch whose drafting case drafted on less than this share more than its plain case is left out
TOKENS = 9  # tokens asked of each probe request: 8 decode passes (fewer where drafts are accepted)


def parse_pass_costs(text: str, k: int | None = None) -> dict:
    """ "1:60/81, 4:77/110/128" (batch : plain ms / [half drafting ms /] all drafting ms, at the server's K) →
    the probe's dict; AnalyzeError saying what is wrong (hand-entered costs)."""
    decode, mixed, verify = {}, {}, {}
    try:
        for item in text.replace(" ", "").split(","):
            if not item:
                continue
            batch, times = item.split(":")
            values = [float(v) for v in times.split("/")]
            if len(values) not in (2, 3):
                raise ValueError(item)
            decode[int(batch)], verify[int(batch)] = values[0], values[-1]
            if len(values) == 3:
                mixed[int(batch)] = values[1]
    except ValueError:
        raise AnalyzeError(
            f"pass costs are BATCH:PLAIN_MS/SPECULATIVE_MS (or PLAIN/HALF/ALL) such as 1:60/81,4:77/110/128, got {text!r}"
        ) from None
    times = [*decode.values(), *mixed.values(), *verify.values()]
    if 1 not in decode or any(b < 1 for b in decode) or any(not 0 < ms < 1e6 for ms in times):
        raise AnalyzeError("pass costs need positive times at batch 1 (and at any other batch size given)")
    return {"k": k, "decode_ms": decode, "mixed_ms": mixed, "verify_ms": verify, "source": "typed"}


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:200]
        raise AnalyzeError(f"{url} answered HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AnalyzeError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    except ValueError:
        raise AnalyzeError(f"{url} did not answer JSON: is it an OpenAI-compatible server?") from None


def _model(base: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=timeout) as response:
            data = json.loads(response.read().decode("utf-8", "replace"))
        return data["data"][0]["id"]
    except (urllib.error.URLError, OSError) as exc:
        raise AnalyzeError(f"cannot reach {base}/v1/models: {getattr(exc, 'reason', exc)}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise AnalyzeError(f"{base}/v1/models lists no model: is it an OpenAI-compatible server?") from None


COUNTERS = ("requests", "tokens", "accepted", "drafts", "draft_tokens", "decode_s", "e2e_s", "timed_requests")
LONG = 33  # tokens of the longer plain requests that separate a request's fixed decode time from its passes
CASES = ("decode", "mixed", "verify", "baseline_decode")  # plain, half drafting, all drafting, plain elsewhere
# plain requests of LONG tokens on each server at each batch size: with the plain case of TOKENS, what a
# request's decode time holds besides its passes (_overhead_ms)
LONG_CASES = {"decode_long": "decode", "baseline_long": "baseline_decode"}
PROBED = ("decode", "mixed", "verify")  # the cases sent to the probed server (not to the one without speculation)


def _server_base(url: str) -> str:
    """The server's base URL: `url` without a trailing /metrics or /v1."""
    return url.rstrip("/").removesuffix("/metrics").removesuffix("/v1")


class _Probe:
    """The requests of one probe: random prompts (from `seed`), B of them sent at once to a server, the
    rounds of a case bracketed by scrapes of the server's counters, and a case's rounds read as ms per pass."""

    def __init__(self, base: str, model: str, repeats: int, timeout: float, seed: int):
        self.base, self.model, self.repeats, self.timeout = base, model, repeats, timeout
        self.rng = random.Random(seed)

    def prompt(self, pattern: bool) -> list[int]:
        """Random token ids: a run then two copies and a bit of it (pattern), or nothing to copy."""
        run = [self.rng.randrange(*TOKEN_IDS) for _ in range(RUN)]
        tail = run + run + run[:8] if pattern else [self.rng.randrange(*TOKEN_IDS) for _ in range(2 * RUN + 8)]
        return run + tail

    def bodies(self, batch: int, drafting: int, max_tokens: int) -> list[dict]:
        """`batch` completion requests, the first `drafting` of them with a prompt to draft on. Those ask for
        (K + 1)× the tokens, K ≤ 8, so that where every draft is kept they take as many passes as the plain
        ones: the batch keeps its mix until the end."""
        long = 1 + (max_tokens - 1) * 9
        return [
            {
                "model": self.model,
                "prompt": self.prompt(i < drafting),
                "max_tokens": long if i < drafting else max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "min_tokens": long if i < drafting else max_tokens,
            }
            for i in range(batch)
        ]

    def send(self, body: dict, server: str, errors: list[Exception]) -> None:
        """One request; an AnalyzeError (unreachable, or not the tokens asked for) goes to `errors`."""
        try:
            made = (_post(server + "/v1/completions", body, self.timeout).get("usage") or {}).get("completion_tokens")
            if made != body["max_tokens"]:
                raise AnalyzeError(
                    f"asked for {body['max_tokens']} tokens, the server made {made}: it cannot be probed this way"
                )
        except AnalyzeError as exc:
            errors.append(exc)

    def timed(self, batch: int, drafting: int, max_tokens: int, server: str | None = None) -> float:
        """Wall ms of `batch` concurrent requests (self.bodies) to `server` (default: the probed one)."""
        errors: list[Exception] = []
        threads = [
            threading.Thread(target=self.send, args=(body, server or self.base, errors))
            for body in self.bodies(batch, drafting, max_tokens)
        ]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return (time.perf_counter() - start) * 1000.0

    def warm_up(self, largest: int, other: str | None) -> None:
        """The first requests of a fresh server pay for compilation: a few, untimed."""
        self.timed(1, 1, TOKENS)
        self.timed(largest, 0, 2)
        if other:
            self.timed(largest, 0, 2, other)

    def round_of(self, batch: int, drafting: int, total: dict, server: str, tokens: int = TOKENS) -> None:
        """One round of a case: `batch` concurrent requests of `tokens` tokens, `drafting` of them with a prompt
        to draft on, bracketed by scrapes; the counters' deltas and the wall time added to `total`."""
        from engine.tools.analyze import scrape, snapshot

        speculating = server == self.base
        before = snapshot(scrape(server), require_speculation=speculating)
        total["walls"].append(self.timed(batch, drafting, tokens, server))
        after = snapshot(scrape(server), require_speculation=speculating)
        for key in COUNTERS:
            total[key] += after[key] - before[key]

    def reading(self, batch: int, drafting: int, total: dict, server: str, overhead_ms: float = 0.0) -> dict:
        """A case's rounds read: `counted_reading` where the server counted them, else wall-time differences
        with requests of one token (a server without vLLM's counters), over the passes."""
        counted = counted_reading(total, batch, self.repeats, overhead_ms)
        if counted is not None:
            return counted
        passes = _passes(total)
        known = total["requests"] == self.repeats * batch and passes > 0
        ones = [self.timed(batch, drafting, 1, server) for _ in range(self.repeats)]
        per_request = passes / (self.repeats * batch) if known else TOKENS - 1
        ms = (statistics.median(total["walls"]) - statistics.median(ones)) / per_request
        _check_positive(ms)
        share = total["drafts"] / passes if known else (drafting / batch)
        return {"ms": ms, "share": min(1.0, share), "clock": "wall-time differences", "outside_ms": None}


def _check_positive(ms: float) -> None:
    if ms <= 0:
        raise AnalyzeError(
            "the timings could not separate a pass from the requests' overhead (the host is too busy or the "
            "server too far): enter the pass costs by hand"
        )


def counted_reading(total: dict, batch: int, repeats: int, overhead_ms: float = 0.0) -> dict | None:
    """A case's rounds read from the server's counters alone: {"ms" per decode pass, "share" of the requests'
    passes that drafted, "clock", "outside_ms" per request (e2e − decode, where the server counts both)}, or
    None where the server did not count every request's decode time. `overhead_ms`: what each request's decode
    time holds besides its passes (_overhead_ms), taken out. A pure function of the counters, so a stored probe
    (its "cases") reads again the same way (``costs_from_cases``)."""
    passes = _passes(total)
    if not (total["requests"] == repeats * batch and passes > 0 and total["decode_s"] > 0):
        return None
    outside = None
    if total["timed_requests"] > 0 and total["e2e_s"] > 0:
        outside = max(0.0, 1000.0 * (total["e2e_s"] - total["decode_s"]) / total["timed_requests"])
    # the server's own clock: the seconds each request decoded, less its fixed part, over the passes
    ms = (1000.0 * total["decode_s"] - overhead_ms * total["requests"]) / passes
    _check_positive(ms)
    share = min(1.0, total["drafts"] / passes)
    return {"ms": ms, "share": share, "clock": "the server's decode time per pass", "outside_ms": outside}


def _cases(batches: list[int], servers: dict[str, str | None]) -> list[tuple[int, str, int]]:
    """(batch, case name, requests drafting) of every case probed: half drafting from B = 2, the server
    without speculation only where one is given."""
    cases = [
        (batch, name, {"mixed": batch // 2, "verify": batch}.get(name, 0))
        for batch in batches
        for name in CASES
        if (name != "mixed" or batch >= 2) and servers[name]
    ]
    return cases + [(batch, name, 0) for batch in batches for name, short in LONG_CASES.items() if servers[short]]


def _run_rounds(probe: _Probe, cases: list, servers: dict[str, str | None]) -> dict:
    """{case: its summed counters and wall times}, the rounds interleaved across cases: a slow spell of the
    host lands on all of them."""
    totals = {case: {"walls": [], **dict.fromkeys(COUNTERS, 0.0)} for case in cases}
    for case in cases:  # one round untimed: a fresh server compiles each new shape the first time it meets it
        probe.timed(
            case[0], case[2], LONG if case[1] in LONG_CASES else TOKENS, servers[LONG_CASES.get(case[1], case[1])]
        )
    for _ in range(probe.repeats):
        for case in cases:
            tokens = LONG if case[1] in LONG_CASES else TOKENS
            probe.round_of(case[0], case[2], totals[case], servers[LONG_CASES.get(case[1], case[1])], tokens)
    return totals


def _overhead_ms(short: dict, long: dict) -> float:
    """What each request's decode time holds besides its passes, on one server at one batch size: from plain
    requests of TOKENS and of LONG tokens, decode ms per request = overhead + passes × ms per pass, solved for
    the overhead (0 where the two cannot separate it)."""
    per = []
    for total in (short, long):
        passes = _passes(total)
        if total["requests"] <= 0 or passes <= 0 or total["decode_s"] <= 0:
            return 0.0
        per.append((passes / total["requests"], 1000.0 * total["decode_s"] / total["requests"]))
    (p_short, d_short), (p_long, d_long) = per
    if p_long - p_short < 1:
        return 0.0
    ms_per_pass = (d_long - d_short) / (p_long - p_short)
    return min(max(0.0, d_short - p_short * ms_per_pass), d_short)


def _passes(total: dict) -> float:
    """Decode passes of a case: every request's first token comes from its prefill, each pass adds one plus what
    it accepted."""
    return total["tokens"] - total["requests"] - total["accepted"]


def _no_cheaper_than_plain(own: dict, plain: dict, totals: dict) -> dict:
    """The speculating server's fixed decode time per request by batch size (`own`: its pair of request lengths),
    at most what leaves its plain case's pass (drafting on few passes) as dear as the plain server's pass at
    the same B: a pass that drafts nothing still runs the same model on the same batch, plus the drafter's
    lookup. The pair is noisy, and an overstated fixed part leaves a pass far cheaper than the plain server's,
    so the analyzer would expect far more than is measured (docs/bench/2026-12-07-notes-from-engine.md).
    Without a plain server: `own` as it is."""
    capped = {}
    for b, ms in own.items():
        mine, theirs = totals.get((b, "decode", 0)), totals.get((b, "baseline_decode", 0))
        if mine and theirs and min(_passes(mine), _passes(theirs), mine["requests"], theirs["requests"]) > 0:
            floor_ms = (1000.0 * theirs["decode_s"] - plain.get(b, 0.0) * theirs["requests"]) / _passes(theirs)
            ms = min(ms, max(0.0, (1000.0 * mine["decode_s"] - floor_ms * _passes(mine)) / mine["requests"]))
        capped[b] = ms
    return capped


def _read_cases(read, cases: list, totals: dict) -> tuple[dict, set]:
    """(costs {"<case>_ms", "<case>_share" (speculative cases): {B: value}}, the clocks the readings used);
    read(batch, case name, requests drafting, fixed ms per request) reads one case (live: the probe's
    ``reading``; stored: ``counted_reading``)."""
    costs: dict[str, dict[int, float]] = {
        "decode_ms": {},
        "mixed_ms": {},
        "verify_ms": {},
        "decode_share": {},
        "mixed_share": {},
        "verify_share": {},
        "baseline_decode_ms": {},
    }
    clocks = set()
    overhead: dict = {short: {} for short in LONG_CASES.values()}
    for batch, name, _ in cases:
        if name in LONG_CASES:
            short = LONG_CASES[name]
            overhead[short][batch] = _overhead_ms(totals[batch, short, 0], totals[batch, name, 0])
    # Each server's own pair. The speculating server's often reads near 0, but taking the plain server's figure
    # for both instead reads its passes cheaper than its traffic, and the analyzer errs more with it (docs/vllm.md,
    # docs/bench/2026-12-07-notes-from-engine.md).
    taken_out = _no_cheaper_than_plain(overhead["decode"], overhead["baseline_decode"], totals)
    costs["overhead_ms"] = {"speculative": taken_out, "baseline": overhead["baseline_decode"]}
    costs["outside_ms"], costs["baseline_outside_ms"] = {}, {}
    # every case's summed counters, so that a reading can be recomputed from the probe's output alone
    costs["cases"] = [
        {"batch": b, "case": name, "drafting": n, **{key: totals[b, name, n][key] for key in COUNTERS}}
        for b, name, n in cases
    ]
    for batch, name, drafting in cases:
        if name in LONG_CASES:
            continue
        fixed = (overhead["baseline_decode"] if name == "baseline_decode" else taken_out).get(batch, 0.0)
        result = read(batch, name, drafting, fixed)
        costs[f"{name}_ms"][batch] = result["ms"]
        clocks.add(result["clock"])
        if name in PROBED:
            costs[f"{name}_share"][batch] = result["share"]
        if name in ("decode", "baseline_decode") and result["outside_ms"] is not None:
            costs["outside_ms" if name == "decode" else "baseline_outside_ms"][batch] = result["outside_ms"]
    return costs, clocks


def _server_k(cases: list, totals: dict) -> int:
    """K as the server's counters saw it: draft tokens per draft over the probed server's cases."""
    speculative = [totals[case] for case in cases if case[1] in PROBED]
    return round(sum(t["draft_tokens"] for t in speculative) / sum(t["drafts"] for t in speculative))


def _drop_unclear(costs: dict, batches: list[int]) -> list[int]:
    """A batch size whose drafting and plain cases drafted on nearly the same share of passes cannot show what
    drafting costs there: it is left out of `costs` (and returned), not guessed; AnalyzeError if all are."""
    unclear = [b for b in batches if costs["verify_share"][b] - costs["decode_share"][b] < MIN_SHARE]
    for b in unclear:  # from every table by batch size (not from the list of cases)
        for table in [*(costs[name] for name in PROBE_TABLES if name in costs), *costs.get("overhead_ms", {}).values()]:
            table.pop(b, None)
    if len(unclear) == len(batches):
        raise AnalyzeError(
            "at every batch size the passes meant to draft and the plain ones drafted on nearly the same share: "
            "the probe cannot tell what drafting costs on this server; enter the pass costs by hand"
        )
    return unclear


def costs_from_cases(costs: dict) -> dict:
    """A stored probe read again from its cases' summed counters (its "cases"), as ``probe_pass_costs`` reads
    them now: what a stored validation grid predicts from is then today's reading of the same requests, not the
    figures of the code that recorded it. A probe without cases (or with a case its server did not count, read
    from wall times that are not stored) comes back as it was."""
    stored = costs.get("cases") or []
    try:
        cases = [(int(c["batch"]), str(c["case"]), int(c["drafting"])) for c in stored]
        totals = {case: {key: float(c[key]) for key in COUNTERS} for case, c in zip(cases, stored)}
        repeats = int(costs["repeats"])
    except (KeyError, TypeError, ValueError):
        raise AnalyzeError("a stored probe's cases need batch, case, drafting and every counter") from None
    if not cases:
        return costs

    def read(batch: int, name: str, drafting: int, fixed: float) -> dict:
        reading = counted_reading(totals[batch, name, drafting], batch, repeats, fixed)
        if reading is None:
            raise LookupError
        return reading

    try:
        again, _ = _read_cases(read, cases, totals)
    except LookupError:
        return costs
    batches = sorted({b for b, name, _ in cases if name == "decode"})
    return {**costs, **again, "left_out": _drop_unclear(again, batches)}


def probe_pass_costs(
    url: str,
    model: str | None = None,
    max_batch: int = 16,
    repeats: int = 5,
    timeout: float = 120.0,
    seed: int = 0,
    baseline_url: str | None = None,
) -> dict:
    """Time plain and speculative decode passes of the server at `url` (base URL, with or without /v1) at
    each batch size in BATCHES up to `max_batch`, as the module says.

    Returns {"decode_ms", "mixed_ms" (B ≥ 2), "verify_ms": {B: ms per decode pass}, "decode_share",
    "mixed_share", "verify_share": {B: share of the requests' passes that drafted}, "baseline_decode_ms" {B: ms
    per pass of the server at `baseline_url`, when given}, "outside_ms", "baseline_outside_ms" {B: ms per plain
    request outside its decode passes, where the server counts e2e and decode time}, "overhead_ms"
    {"speculative", "baseline": {B: the fixed decode ms per request taken out}}, "cases" [each case's summed
    counters], "k": draft tokens per drafting pass
    as the server's counters saw them, "tokens_per_request", "repeats", "model", "source"};
    AnalyzeError when the server cannot be reached, does not generate the tokens asked for, does not draft on
    the probe's prompts, or the timings cannot separate a pass from the overhead."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise AnalyzeError(f"not an http(s) URL: {url!r}")
    if not 2 <= repeats <= 50:
        raise AnalyzeError("repeats must be between 2 and 50")
    base = _server_base(url)
    probe = _Probe(base, model or _model(base, timeout), repeats, timeout, seed)
    batches = [b for b in BATCHES if b <= max_batch] or [1]
    other = None
    if baseline_url:
        if not baseline_url.startswith(("http://", "https://")):
            raise AnalyzeError(f"not an http(s) URL: {baseline_url!r}")
        other = _server_base(baseline_url)
    servers = {"decode": base, "mixed": base, "verify": base, "baseline_decode": other}
    probe.warm_up(max(batches), other)
    cases = _cases(batches, servers)
    totals = _run_rounds(probe, cases, servers)
    costs, clocks = _read_cases(
        lambda b, name, n, fixed: probe.reading(b, n, totals[b, name, n], servers[name], fixed), cases, totals
    )
    unclear = _drop_unclear(costs, batches)
    return {
        **costs,
        "left_out": unclear,
        "k": _server_k(cases, totals),
        "tokens_per_request": TOKENS,
        "repeats": repeats,
        "model": probe.model,
        "source": "timed through the server's OpenAI API (" + " and ".join(sorted(clocks)) + ")",
    }
