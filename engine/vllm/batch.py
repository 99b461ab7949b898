"""The Batch lab, measured: B concurrent requests to real vLLM servers, with and without speculation.

``measure_batches({"baseline": url_a, "speculative": url_b}, prompts)`` sends,
for each batch size B, B requests at once to each server (a thread per request,
released together) and times them: total throughput (completion tokens of the
batch ÷ wall time from release to the last response) and each request's latency.
Each B is repeated; the report gives the median and the spread (min, max) over
repeats. Modes and repeats are interleaved (the order rotates each repeat) so
machine noise hits both alike. The servers batch the requests themselves
(continuous batching): this is what speculation costs and buys at real batch
sizes, not a formula. ``engine.model.pass_timing.batch_tradeoff`` stays the computed
fallback when no server is available.

Greedy by default; every request stops at EOS or max_new_tokens like a real
client, so the tokens counted are the tokens a user would get.
"""

from __future__ import annotations

import statistics
import threading
import time

from engine.metrics import ratio_bounds, ratio_of_medians
from engine.vllm.backend import VllmBackend
from engine.vllm.client import VllmError

__all__ = ["MAX_BATCH", "measure_batches"]

MAX_BATCH = 64  # a bound on concurrent requests (the Batch lab asks for 1..16)
MAX_REPEATS = 10
MAX_NEW_TOKENS = 512


def _backend(server) -> VllmBackend:
    return server if isinstance(server, VllmBackend) else VllmBackend(server)


def _run_batch(backend: VllmBackend, prompts: list, batch: int, kw: dict, offset: int = 0) -> dict:
    """B requests released at once (request i gets prompts[(offset + i) % len]); their results
    and the batch's wall time."""
    results: list[dict | None] = [None] * batch
    errors: list[BaseException] = []
    gate = threading.Barrier(batch + 1)

    def worker(i: int) -> None:
        prompt = prompts[(offset + i) % len(prompts)]
        gate.wait()
        try:
            res = backend.complete(prompt, **kw)
            res["ended"] = time.perf_counter()
            results[i] = res
        except BaseException as exc:  # reported below, after every thread is joined
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(batch)]
    for t in threads:
        t.start()
    gate.wait()
    released = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise VllmError(f"a request of a batch of {batch} to {backend.url} failed: {errors[0]}")
    wall = max(r["ended"] for r in results) - released
    tokens = sum(len(r["token_ids"]) for r in results)
    drafted = accepted = 0
    for r in results:
        spec = r.get("speculative_decoding") or {}
        drafted += int(spec.get("num_draft_tokens") or 0)
        accepted += int(spec.get("num_accepted_draft_tokens") or 0)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_per_s": tokens / wall if wall > 0 else 0.0,
        "latencies_s": [r["ended"] - released for r in results],
        "drafted": drafted,
        "accepted": accepted,
        "token_ids": [r["token_ids"] for r in results],
    }


def measure_batches(
    servers: dict,
    prompts: list,
    batch_sizes=(1, 2, 4, 8, 16),
    *,
    max_new_tokens: int = 64,
    repeats: int = 3,
    temperature: float = 0.0,
    chat: bool = True,
    ignore_eos: bool = False,
    progress=None,
    warm_up: bool = True,
) -> dict:
    """Measured throughput and latency per batch size, for each server.

    servers: {mode name: URL or VllmBackend}, e.g. {"baseline": url, "speculative": url}.
    prompts: texts (chat) or token-id lists; request i of a batch in repeat r gets
    prompts[(r * B + i) % len]. max_num_seqs of the server must allow B at once. ignore_eos: every request
    decodes max_new_tokens (engine/tools/what_if.py's production-shaped requests). warm_up: one 4-token request
    to each server first (False where the servers are warm and a scrape window must hold only the batches).
    Returns {"batch_sizes", "modes": {name: {"url", "speculative", "k", "tok_per_s",
    "tok_per_s_min", "tok_per_s_max", "latency_s" (median per-request latency),
    "latency_min_s", "latency_max_s", "acceptance_rate"}}, "speedup" (speculative ÷
    baseline tok/s per B, when both are given: engine.metrics.ratio_of_medians of the repeats),
    "speedup_bounds" (per B, the slowest repeat of one server against the quickest of the other,
    both ways: engine.metrics.ratio_bounds), "speculation_pays_up_to"
    (the largest B of the leading run of B where even the lower bound is above 1) and
    "verdict" (that in words, a B whose bounds straddle 1 named as no verdict: what every
    view shows), "greedy_mismatches",
    "settings", "source": "measured"}.
    """
    sizes = _checked_sizes(batch_sizes, repeats, max_new_tokens, prompts, servers)
    backends = {name: _backend(server) for name, server in servers.items()}
    infos = {name: b.info() for name, b in backends.items()}
    kw = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "chat": chat, "seed": 0}
    if ignore_eos:  # every request decodes its full length (a what-if's production-shaped requests)
        kw["ignore_eos"] = True
    for b in backends.values() if warm_up else ():  # warm-up: first requests allocate and may compile
        b.complete(prompts[0], **{**kw, "max_new_tokens": 4})
    runs = _interleaved_batches(backends, prompts, sizes, kw, int(repeats), progress)
    report = {
        "batch_sizes": sizes,
        "modes": {name: _mode_summary(backends[name], infos[name], runs, sizes, name) for name in backends},
        "settings": {**kw, "repeats": int(repeats), "prompts": len(prompts)},
        "source": "measured",
        "greedy_mismatches": [],
    }
    spec = next((n for n in backends if infos[n]["speculative"]), None)
    base = next((n for n in backends if infos[n]["speculative"] is False), None)
    if spec and base:
        report.update(_speedups(runs, sizes, spec, base))
        if temperature == 0.0:
            report["greedy_mismatches"] = _greedy_mismatches(runs, sizes, spec, base)
    return report


def _checked_sizes(batch_sizes, repeats, max_new_tokens, prompts, servers) -> list[int]:
    """The batch sizes, sorted and without repeats, once every argument is in range (ValueError otherwise)."""
    sizes = [int(b) for b in batch_sizes]
    if not sizes or any(not 1 <= b <= MAX_BATCH for b in sizes):
        raise ValueError(f"batch sizes must be between 1 and {MAX_BATCH}, got {list(batch_sizes)}")
    if not 1 <= int(repeats) <= MAX_REPEATS:
        raise ValueError(f"repeats must be between 1 and {MAX_REPEATS}, got {repeats}")
    if not 1 <= int(max_new_tokens) <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}")
    if not prompts:
        raise ValueError("no prompts")
    if not servers:
        raise ValueError("no servers: give {'baseline': URL, 'speculative': URL}")
    return sorted(set(sizes))


def _interleaved_batches(backends: dict, prompts: list, sizes: list[int], kw: dict, repeats: int, progress) -> dict:
    """{(mode name, B): [one `_run_batch` result per repeat]}: every B on every server each repeat, the
    servers' order rotated each repeat so that machine noise hits both alike."""
    names = list(backends)
    runs: dict[tuple[str, int], list[dict]] = {}
    total = len(sizes) * repeats * len(names)
    done = 0
    for rep in range(repeats):
        for batch in sizes:
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                # Each repeat starts further along the prompts (small B still sees all of them);
                # both modes get the same prompts at the same (B, repeat).
                runs.setdefault((name, batch), []).append(_run_batch(backends[name], prompts, batch, kw, rep * batch))
                done += 1
                if progress is not None:
                    progress(done, total, name, batch)
    return runs


def _acceptance(rs: list[dict]) -> float | None:
    """Accepted ÷ drafted over a batch size's repeats (None when nothing was drafted)."""
    drafted = sum(r["drafted"] for r in rs)
    return sum(r["accepted"] for r in rs) / drafted if drafted else None


def _mode_summary(backend: VllmBackend, info: dict, runs: dict, sizes: list[int], name: str) -> dict:
    """One server's numbers per batch size: median and spread of throughput and per-request latency."""
    per_b = [runs[(name, b)] for b in sizes]
    latencies = [[x for r in rs for x in r["latencies_s"]] for rs in per_b]
    return {
        "url": backend.url,
        "speculative": info["speculative"],
        "k": info["k"] if info["speculative"] else 0,
        "tok_per_s": [statistics.median(r["tok_per_s"] for r in rs) for rs in per_b],
        "tok_per_s_min": [min(r["tok_per_s"] for r in rs) for rs in per_b],
        "tok_per_s_max": [max(r["tok_per_s"] for r in rs) for rs in per_b],
        "latency_s": [statistics.median(xs) for xs in latencies],
        "latency_min_s": [min(xs) for xs in latencies],
        "latency_max_s": [max(xs) for xs in latencies],
        "tokens_per_request": [sum(r["tokens"] for r in rs) / (len(rs) * b) for rs, b in zip(per_b, sizes)],
        "acceptance_rate": [_acceptance(rs) for rs in per_b],
    }


def _speedups(runs: dict, sizes: list[int], spec: str, base: str) -> dict:
    """The speculative server against the baseline per B (engine.metrics' ratio of medians over the repeats,
    with its bounds), and the verdict they allow."""
    speedup, bounds = [], []
    for batch in sizes:
        this = [r["tok_per_s"] for r in runs[(spec, batch)]]
        other = [r["tok_per_s"] for r in runs[(base, batch)]]
        speedup.append(ratio_of_medians(this, other))
        # The repeats' spread bounds each ratio (the slowest repeat of one server against the quickest of the
        # other): a B whose bounds straddle 1 gets no verdict, however its medians fall.
        bounds.append(ratio_bounds((min(this), max(this)), (min(other), max(other))))
    pays, verdict = _verdict(sizes, bounds)
    return {"speedup": speedup, "speedup_bounds": bounds, "speculation_pays_up_to": pays, "verdict": verdict}


def _verdict(sizes: list[int], bounds: list[tuple]) -> tuple[int | None, str]:
    """(the largest B of the leading run of B whose lower bound is above 1, or None; the verdict in words)."""
    pays = None
    for batch, (low, _) in zip(sizes, bounds):
        if low is None or low <= 1.0:
            break
        pays = batch
    stops = next((b for b, (_, high) in zip(sizes, bounds) if high is not None and high <= 1.0), None)
    unclear = [b for b, (low, high) in zip(sizes, bounds) if low is not None and low <= 1.0 < high]
    if pays == sizes[-1]:
        verdict = "speculation pays at every batch size measured"
    elif stops == sizes[0]:
        verdict = f"speculation does not pay at B = {sizes[0]}"
    elif stops is not None:
        verdict = (
            f"speculation pays up to B = {pays}, not from B = {stops}"
            if pays
            else f"speculation does not pay from B = {stops}"
        )
    else:
        verdict = "no batch size measured where speculation clearly stops paying"
    if unclear:
        verdict += f" (at B = {', '.join(map(str, unclear))} the repeats' spread straddles 1×: no verdict)"
    return pays, verdict


def _greedy_mismatches(runs: dict, sizes: list[int], spec: str, base: str) -> list[dict]:
    """Greedy speculation must not change the output: every request of every batch compared, the first
    differing token of each that differs."""
    mismatches = []
    for batch in sizes:
        for rep, (a, b) in enumerate(zip(runs[(base, batch)], runs[(spec, batch)])):
            for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])):
                if x != y:
                    at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                    mismatches.append({"batch": batch, "repeat": rep, "request": i, "first_difference_at": at})
    return mismatches
