"""Run metrics: the one summary of a run, and the textbook speedup formulas.

Plain Python (no torch): the engine computes the finish event's metrics here,
and the visuals and the app read every run, live or recorded, complete or
partial, through ``run_summary``. The formula E = (1 − α^(K+1)) / (1 − α) lives
here and nowhere else, and so does every c and every speedup:

* c, a draft token's cost in target passes, has two meanings, because a run alone has no plain
  one-token pass to measure against: ``draft_cost_ratio`` (a run on its own: finish metrics'
  "draft_cost_ratio") and ``draft_token_cost`` (against a baseline run's passes: the Drafters lab,
  the bench's "draft_cost"). ``DRAFT_COST_RATIO_MEANS`` and ``DRAFT_TOKEN_COST_MEANS`` say which in words
  for every screen that shows one.
* A speedup of one pair of runs is ``measured_speedup``; repeats are aggregated either as
  ``median_of_ratios`` (runs in back-to-back pairs: ``compare_speedups``) or as ``ratio_of_medians``
  (repeats not paired one to one: the bench, vLLM batches), with ``ratio_bounds`` the spread of the latter.
* Decisions read from those numbers (``batch_throughputs``' verdict, ``compare_speedups``' verdict,
  ``fastest``) are made here once; the views only show them.
"""

from __future__ import annotations

import math

from engine.trace import finish_event, start_event, step_events

__all__ = [
    "BUSY_CPU_SHARE",
    "DRAFT_COST_RATIO_MEANS",
    "DRAFT_TOKEN_COST_MEANS",
    "MIN_EFFECT",
    "MIN_PAIRS",
    "batch_throughputs",
    "busy_machine",
    "compare_speedups",
    "cpu_share",
    "draft_cost_ratio",
    "draft_ms_per_position",
    "draft_token_cost",
    "rules_on_same_drafts",
    "draft_token_cost_of",
    "expected_tokens_per_pass",
    "fastest",
    "implied_speedup",
    "measured_speedup",
    "median",
    "modelled_speedup",
    "median_of_ratios",
    "paired_ratios",
    "ratio_bounds",
    "ratio_of_medians",
    "run_summary",
    "speedup_ceiling",
    "summarize_steps",
    "top_speedups",
    "wall_clock_speedup",
    "wide_pass_cost",
]

ALPHA_ONE = 1.0 - 1e-12  # α this close to 1: the series is K + 1 (avoids 0/0)


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """E = (1 − α^(K+1)) / (1 − α): expected tokens per target pass for a chain of
    K drafts, each accepted independently with probability α (bonus included)."""
    alpha, k = float(alpha), int(k)
    if k <= 0 or alpha <= 0.0:
        return 1.0
    if alpha >= ALPHA_ONE:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def wall_clock_speedup(alpha: float, k: int, c: float) -> float:
    """E / (K·c + 1), with c = cost of one draft token relative to one target pass."""
    return expected_tokens_per_pass(alpha, k) / (int(k) * float(c) + 1.0)


MS_PER_S = 1000.0


def ratio_of_medians(values: list[float], baseline_values: list[float]) -> float | None:
    """A speedup aggregated as the RATIO OF MEDIANS: median(values) ÷ median(baseline_values), e.g. the
    repeats' tokens per second of one system against the baseline's.

    For repeats that are not paired one to one (the bench's rows, each system's repeats rotated among the
    others; vLLM batches, each server's repeats of a batch size): there is no pair whose ratio cancels the
    machine's drift, so each side's median first, which one slow repeat does not move. Its spread is
    ``ratio_bounds``. None when either side is empty or the baseline's median is not positive."""
    if not values or not baseline_values:
        return None
    base = median([float(v) for v in baseline_values])
    return median([float(v) for v in values]) / base if base > 0 else None


def ratio_bounds(this: tuple[float, float], base: tuple[float, float]) -> tuple[float, float] | tuple[None, None]:
    """The spread of a ratio of medians from each side's (lowest, highest) repeat: (lowest this ÷ highest
    base, highest this ÷ lowest base), the worst and the best pairing of repeats. A ratio whose bounds
    straddle 1 is noise, never a verdict. (None, None) when a baseline bound is not positive."""
    (this_low, this_high), (base_low, base_high) = this, base
    if not base_low or not base_high or base_low <= 0 or base_high <= 0:
        return None, None
    return this_low / base_high, this_high / base_low


def wide_pass_cost(pass_times: dict) -> dict:
    """What a pass over K + 1 tokens per row costs against a one-token pass, at each measured batch size.

    pass_times as ``batch_throughputs`` takes them. Returns {"pass_cost": [pass_ms_k1 ÷ pass_ms_1 per B],
    "pass_cost_bounds": [``ratio_bounds`` of the repeats' spreads per B, None where none was measured],
    "pass_cost_finding": per B, "same" (the bounds hold 1: the same cost within the machine's noise),
    "cheaper" (below 1 in every pairing of repeats: the CPU's matrix library runs a few rows faster than
    one, not speculation), "dearer" (above 1 in every pairing), or None without spreads}. A wider pass is
    never called cheaper from noise."""
    spreads_1 = pass_times.get("spread_ms_1") or [None] * len(pass_times["pass_ms_1"])
    spreads_k1 = pass_times.get("spread_ms_k1") or [None] * len(pass_times["pass_ms_k1"])
    costs = [wide / one for wide, one in zip(pass_times["pass_ms_k1"], pass_times["pass_ms_1"])]
    bounds = [ratio_bounds(sk, s1) if s1 and sk else None for s1, sk in zip(spreads_1, spreads_k1)]
    findings = []
    for bound in bounds:
        if bound is None or bound[0] is None:
            findings.append(None)
        elif bound[0] <= 1.0 <= bound[1]:
            findings.append("same")
        elif bound[1] < 1.0:
            findings.append("cheaper")
        else:
            findings.append("dearer")
    return {"pass_cost": costs, "pass_cost_bounds": bounds, "pass_cost_finding": findings}


def _batch_verdict(sizes: list[int], bounds: list[tuple]) -> tuple[str, list[int], list[int], int | None]:
    """``batch_throughputs``' verdict from each B's speedup bounds: (sentence, pays_at, unclear_at,
    stops_paying_at)."""
    pays_at = [b for b, (low, _) in zip(sizes, bounds) if low > 1.0]
    unclear = [b for b, (low, high) in zip(sizes, bounds) if low <= 1.0 < high]
    stops = next((b for b, (_, high) in zip(sizes, bounds) if high <= 1.0), None)
    # "stops paying" only where it clearly paid at a smaller batch: a first clear loss after nothing but noise
    # is "never clearly pays", never a crossover (the headline must not contradict the speedups beside it)
    paid_before = [b for b in pays_at if stops is None or b < stops]
    if stops is None and not unclear:
        verdict = "speculation pays at every batch size measured"
    elif stops == sizes[0]:
        verdict = "speculation does not pay at any batch size measured"
    elif stops is not None and paid_before:
        verdict = f"speculation pays up to batch size {max(paid_before)} and stops paying at batch size {stops}"
    elif stops is not None:
        verdict = f"speculation never clearly pays here: not faster from batch size {stops}"
        stops = None  # no crossover to mark
    elif pays_at:
        verdict = "no batch size measured where it clearly stops paying"
    else:
        verdict = "no clear verdict at any batch size measured"
    if unclear:
        verdict += f" (at B = {', '.join(map(str, unclear))} the repeats' spread straddles 1×: no verdict there)"
    return verdict, pays_at, unclear, stops


def _throughput(b: int, ms: float, tokens_per_row: float = 1.0, draft_ms: float = 0.0) -> float:
    """Tokens per second of passes over b rows that take ms each plus draft_ms of drafting and yield
    tokens_per_row tokens per row (1 and no drafting: a pass without speculation)."""
    return b * tokens_per_row * MS_PER_S / (ms + draft_ms)


def _speedup_bounds(pass_times: dict, speedup: list, ceilings: list, e: float, draft: float) -> tuple[list, list]:
    """``batch_throughputs``' speedup bounds per B, each capped at that B's ceiling, and the B where the cap cut
    the spread's best pairing. e: expected tokens per pass; draft: a pass's drafting ms."""
    sizes = [int(b) for b in pass_times["batch_sizes"]]
    # The spread of the repeats bounds each ratio: at best the quickest wide pass against the slowest plain one.
    # A bound that straddles 1 is noise, never a verdict (without spreads the medians decide alone).
    spreads_1 = pass_times.get("spread_ms_1") or [None] * len(sizes)
    spreads_k1 = pass_times.get("spread_ms_k1") or [None] * len(sizes)
    bounds = [
        tuple(
            bound if bound is None else min(bound, ceiling)
            for bound in ratio_bounds(
                (_throughput(b, sk[1], e, draft), _throughput(b, sk[0], e, draft)),
                (_throughput(b, s1[1]), _throughput(b, s1[0])),
            )
        )
        if s1 and sk
        else (r, r)
        for b, r, s1, sk, ceiling in zip(sizes, speedup, spreads_1, spreads_k1, ceilings)
    ]
    # where the ceiling cut the spread's best pairing (the quickest wide pass below the slowest one-token pass)
    bound_capped_at = [
        b
        for b, (_, high), ceiling, s1, sk in zip(sizes, bounds, ceilings, spreads_1, spreads_k1)
        if s1 and sk and high is not None and sk[0] < s1[1] and high >= ceiling - 1e-12
    ]
    return bounds, bound_capped_at


def batch_throughputs(pass_times: dict, alpha: float, draft_ms_per_token: float = 0.0) -> dict:
    """Throughput with and without speculation at each batch size, computed from measured pass times.

    pass_times: {"batch_sizes": [B...], "k": K, "pass_ms_1": [ms...], "pass_ms_k1": [ms...]} (measured:
    one target pass over B rows of 1 token, and of K + 1 tokens; the median of the repeats). Without
    speculation a pass yields B tokens: B / pass_ms_1. With it, B · E(α, K) tokens per pass that also pays
    K draft tokens per row: B · E / (pass_ms_k1 + K · draft_ms). "speedup" per B is the ratio of the two
    throughputs, both computed from the repeats' median pass times (a ratio of medians). The verdict,
    computed once here and read by every view, reads the repeats' spread where measured ("spread_ms_1",
    "spread_ms_k1": [min, max] per B): ``speedup_bounds`` per B (``ratio_bounds`` of the throughputs the
    quickest and the slowest repeats give), ``pays_at`` (B where even the worst pairing of repeats is
    faster), ``unclear_at`` (the bounds straddle 1: noise, no verdict), ``stops_paying_at`` (the first B
    where even the best pairing is not faster, after a smaller B where it clearly paid; else None), with a
    sentence saying so ("never clearly pays here" when nothing before that loss clearly paid); and ``wide_pass_cost``'s
    keys (what the wider pass costs, per B).

    The ceiling: a pass over K + 1 tokens per row is never counted cheaper than a pass over one (a decoder
    without speculation could run its one token in the wider pass's shape, padded, at the same cost), so at
    each B the speedup and its bounds are at most ``speedup_ceiling`` = E × pass_ms_1 ÷ (pass_ms_1 + K ·
    draft_ms), which is E with free drafting. "capped_at" lists the B where the measured wide pass was the
    quicker one and the ceiling applied (what a CPU's matrix library does with a few rows, not speculation);
    "bound_capped_at" the B where it cut the spread's best pairing.
    """
    sizes, k = [int(b) for b in pass_times["batch_sizes"]], int(pass_times["k"])
    e = expected_tokens_per_pass(alpha, k)
    draft = k * draft_ms_per_token
    plain = [_throughput(b, ms) for b, ms in zip(sizes, pass_times["pass_ms_1"])]
    ceilings = [e * ms / (ms + draft) for ms in pass_times["pass_ms_1"]]
    # the wide pass counted at no less than the one-token pass (the ceiling above)
    spec = [
        _throughput(b, max(wide, one), e, draft)
        for b, wide, one in zip(sizes, pass_times["pass_ms_k1"], pass_times["pass_ms_1"])
    ]
    speedup = [s / p for s, p in zip(spec, plain)]
    capped_at = [b for b, wide, one in zip(sizes, pass_times["pass_ms_k1"], pass_times["pass_ms_1"]) if wide < one]
    bounds, bound_capped_at = _speedup_bounds(pass_times, speedup, ceilings, e, draft)
    verdict, pays_at, unclear, stops = _batch_verdict(sizes, bounds)
    return {
        **pass_times,
        "alpha": alpha,
        "draft_ms_per_token": draft_ms_per_token,
        "expected_tokens_per_pass": e,
        "throughput_plain": plain,
        "throughput_speculative": spec,
        "speedup": speedup,
        "speedup_bounds": bounds,
        "speedup_ceiling": ceilings,
        "capped_at": capped_at,
        "bound_capped_at": bound_capped_at,
        "pays_at": pays_at,
        "unclear_at": unclear,
        "stops_paying_at": stops,
        "verdict": verdict,
        **wide_pass_cost(pass_times),
    }


def _mean(values) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


# c, a draft token's cost in target passes, in words: what a screen shows beside each of the two.
DRAFT_COST_RATIO_MEANS = "c = the run's mean drafting time per pass ÷ (K × its mean target pass time)"
DRAFT_TOKEN_COST_MEANS = "c = drafting time per drafted token ÷ the baseline run's mean target pass time"


def draft_cost_ratio(mean_draft_ms: float | None, mean_verify_ms: float | None, k: int) -> float | None:
    """c of a run on its own (finish metrics' "draft_cost_ratio"): its mean drafting time per drafting pass
    ÷ (K × its mean target pass time over the same passes), ``DRAFT_COST_RATIO_MEANS``.

    What a run can measure without a baseline: then K·c + 1 is its own (drafting + verification) time per
    pass ÷ its verification time. The unit is the run's own pass over K + 1 tokens, which costs more than
    the one-token pass of E / (K·c + 1): against a baseline run, ``draft_token_cost`` is the c of the formula.
    None when a time is missing (vLLM traces have no drafting time) or K is 0."""
    if mean_draft_ms is None or not mean_verify_ms or not k:
        return None
    return mean_draft_ms / (int(k) * mean_verify_ms)


def draft_token_cost_of(draft_ms: float, drafted: int, baseline_pass_ms: float | None) -> float | None:
    """c against a baseline: drafting time per drafted token ÷ the baseline run's mean target pass time,
    ``DRAFT_TOKEN_COST_MEANS``, from totals: draft_ms (all drafting time of the runs, ms), drafted (all
    tokens they drafted) and baseline_pass_ms (the baseline's mean one-token pass, ms).

    The unit is a one-token pass of the baseline, the unit of E / (K·c + 1); a speculative pass over K + 1
    tokens costs more than that, which the formula leaves out and a measured speedup does not. A pass whose
    drafter proposed nothing (an n-gram lookup without a match) still pays its drafting time. The bench's
    "draft_cost" and the Drafters lab's c. None when nothing was drafted or the baseline has no timed pass."""
    if not drafted or not baseline_pass_ms:
        return None
    return float(draft_ms) / drafted / baseline_pass_ms


def draft_token_cost(steps: list[dict], baseline_steps: list[dict]) -> float | None:
    """``draft_token_cost_of`` from step events: the run's summed draft_ms and drafted tokens against the
    mean verify_ms of the baseline run's passes. None also when a draft time is missing (vLLM traces have
    none)."""
    draft_ms = [s.get("draft_ms") for s in steps]
    if any(ms is None for ms in draft_ms):
        return None
    drafted = sum(s.get("drafted") or 0 for s in steps)
    pass_ms = _mean(s.get("verify_ms") for s in baseline_steps)
    return draft_token_cost_of(sum(float(ms) for ms in draft_ms), drafted, pass_ms)


def draft_ms_per_position(summary: dict) -> float:
    """A run's drafting time per draft position: its mean drafting time per drafting pass ÷ K (0 when it
    has no drafting time), the draft time ``batch_throughputs`` takes; ``draft_cost_ratio`` is this ÷ the
    run's mean target pass time."""
    return (summary.get("mean_draft_ms") or 0.0) / max(1, int(summary.get("k") or 0))


def _position_counts(steps: list[dict], k: int) -> tuple[list[int], list[int]]:
    """(drafted_at, accepted_at) over depths 1 .. max(K, the deepest draft): at each depth, the steps that
    drafted a token there and the steps whose accepted path reached it (``summarize_steps``' per-position
    counts)."""
    max_depth = max([k] + [s.get("draft_depth", 0) for s in steps])
    drafted_at = [0] * max_depth
    accepted_at = [0] * max_depth
    for s in steps:
        for depth in range(s.get("draft_depth", 0)):
            drafted_at[depth] += 1
        for depth in range(s["accepted_len"]):
            accepted_at[depth] += 1
    return drafted_at, accepted_at


def _accepted_histogram(steps: list[dict], depths: list[int], max_depth: int) -> list[int]:
    """How many drafts each drafting pass kept (0 .. its depth): the histogram a rate alone hides. depths: each
    step's drafted depth (0 where it drafted nothing, and then not counted)."""
    histogram = [0] * (max_depth + 1)
    for s, d in zip(steps, depths):
        if d:
            histogram[min(s["accepted_len"], max_depth)] += 1
    return histogram


def _drafting_pass_times(steps: list[dict], k: int) -> tuple[float | None, float | None, float | None]:
    """(mean_draft_ms, mean_verify_ms, ``draft_cost_ratio``) over the steps that drafted (over every step
    where none did)."""
    drafting = [s for s in steps if s.get("drafted")] or steps
    mean_draft_ms = _mean(s.get("draft_ms") for s in drafting)
    mean_verify_ms = _mean(s.get("verify_ms") for s in drafting)
    return mean_draft_ms, mean_verify_ms, draft_cost_ratio(mean_draft_ms, mean_verify_ms, k)


def summarize_steps(steps: list[dict], k: int, wall_s: float, prefill_s: float = 0.0) -> dict:
    """Aggregate step events into the metrics every view shows.

    target_passes counts verification passes (the prefill is reported apart);
    tokens_per_pass includes the resampled or bonus token of each pass;
    acceptance_rate = accepted / drafted (vLLM's draft acceptance rate: drafts never
    tried, after a rejection or on side branches, count as not accepted);
    position_acceptance α = accepted / positions tried, where a pass tries each depth
    its accepted path reached plus the depth where it stopped on a rejection: the
    per-token acceptance rate of E = (1 − α^(K+1)) / (1 − α) (for a tree, the chance
    that some sibling at a tried depth is accepted; positions_tried is its denominator), so
    theoretical_tokens_per_pass uses it, at the depth each pass drafted (E = 1 for a pass
    that drafted nothing; adaptive K and short n-gram matches draft less than K), with
    theoretical_tokens_per_drafting_pass the same over the passes_drafted alone and
    mean_drafted_depth their mean K (mean_depth_per_pass: over every pass, 0 where none was drafted, the
    depth the theory averages); accepted_histogram[j] counts the drafting passes that kept j
    drafts, and mean_acceptance_length = 1 + accepted / passes_drafted (vLLM's definition); acceptance_by_position[i] is the share of steps that drafted a token at
    depth i+1 whose accepted path reached depth i+1 (the chain model predicts α^(i+1));
    draft_cost_ratio is ``draft_cost_ratio``: c of this run on its own, mean draft time per drafting
    pass ÷ (K × mean target pass time over those passes).
    """
    passes = len(steps)
    tokens = sum(len(s["emitted"]) for s in steps)
    drafted = sum(s["drafted"] for s in steps)
    accepted = sum(s["accepted_len"] for s in steps)
    drafted_at, accepted_at = _position_counts(steps, k)
    rejections = sum(1 for s in steps if s.get("extra_kind") == "resampled")
    alpha = accepted / (accepted + rejections) if accepted + rejections else 0.0
    # The theory at the depth each pass actually drafted (adaptive K, an n-gram match shorter than K, or
    # nothing at all: E = 1 for a pass without drafts), and over the passes that drafted alone.
    depths = [s.get("draft_depth", 0) if s.get("drafted") else 0 for s in steps]
    drafted_depths = [d for d in depths if d]
    histogram = _accepted_histogram(steps, depths, len(drafted_at))
    theory_each = [expected_tokens_per_pass(alpha, d) for d in depths]
    mean_draft_ms, mean_verify_ms, cost_ratio = _drafting_pass_times(steps, k)
    return {
        "target_passes": passes,
        "new_tokens": tokens,
        "tokens_per_pass": tokens / passes if passes else 0.0,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "position_acceptance": alpha,
        "accepted_per_position": accepted_at,
        "drafted_per_position": drafted_at,
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_at, drafted_at)],
        "positions_tried": accepted + rejections,
        "accepted_histogram": histogram,
        # vLLM's mean acceptance length: tokens per pass that drafted (its accepted drafts + the bonus or
        # resampled token). Read beside acceptance_rate: a rate can fall while the length stays.
        "mean_acceptance_length": 1.0 + accepted / len(drafted_depths) if drafted_depths else 1.0,
        # Tokens the passes produced past the run's end (an end-of-sequence token, or max_new_tokens, met inside
        # a pass's accepted path): counted in the acceptance, not in the output, so the mean acceptance length
        # can exceed tokens per pass even when every pass drafted.
        "dropped_at_end": max(0, accepted + passes - tokens) if passes else 0,
        "theoretical_tokens_per_pass": sum(theory_each) / passes if drafted else 1.0,
        "passes_drafted": len(drafted_depths),
        "mean_drafted_depth": sum(drafted_depths) / len(drafted_depths) if drafted_depths else 0.0,
        # the K that theoretical_tokens_per_pass averages over every pass (0 where nothing was drafted): at
        # α = 1 the theory is this + 1, which every view can show beside it
        "mean_depth_per_pass": sum(depths) / passes if passes else 0.0,
        "theoretical_tokens_per_drafting_pass": (
            sum(t for t, d in zip(theory_each, depths) if d) / len(drafted_depths) if drafted_depths else 1.0
        ),
        "mean_tree_size": drafted / passes if passes else 0.0,
        "mean_accepted_depth": accepted / passes if passes else 0.0,
        "mean_draft_ms": mean_draft_ms,
        "mean_verify_ms": mean_verify_ms,
        "draft_cost_ratio": cost_ratio,
        # Timings a backend could not measure are null (a vLLM step's drafting): summed as known.
        "draft_s": sum(s.get("draft_ms") or 0.0 for s in steps) / 1000.0,
        "verify_s": sum(s.get("verify_ms") or 0.0 for s in steps) / 1000.0,
        "prefill_s": prefill_s,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "rules_on_same_drafts": rules_on_same_drafts(steps),
    }


def rules_on_same_drafts(steps: list[dict]) -> dict | None:
    """Over a run's block-verified passes ("verify": "block", whose nodes record every prefix's test): the
    expected tokens per pass of both acceptance rules on the very drafts those passes verified, computed from
    the recorded numbers alone (no sampling noise between the rules):
        token rule:  1 + sum_i prod_{j<=i} min(1, p_j / q_j)          (p_eff, q_eff of each draft)
        block rule:  1 + sum_i i * h_i * prod_{j>i} (1 - h_j)          (h_i = the node's accept_prob)
    {"passes", "token_tokens_per_pass", "block_tokens_per_pass"}, or None when no pass was block-verified."""
    token_e, block_e = [], []
    for s in steps:
        nodes = s.get("nodes") or []
        if s.get("verify") != "block" or not nodes or any(n.get("accept_prob") is None for n in nodes):
            continue
        kept, run = 0.0, 1.0
        for n in nodes:
            run *= min(1.0, n["p_eff"] / max(n["q_eff"], 1e-30))
            kept += run
        token_e.append(1.0 + kept)
        h = [n["accept_prob"] for n in nodes]
        block = 0.0
        for i in range(len(h)):
            later = 1.0
            for hj in h[i + 1 :]:
                later *= 1.0 - hj
            block += (i + 1) * h[i] * later
        block_e.append(1.0 + block)
    if not token_e:
        return None
    return {
        "passes": len(token_e),
        "token_tokens_per_pass": sum(token_e) / len(token_e),
        "block_tokens_per_pass": sum(block_e) / len(block_e),
    }


def measured_speedup(baseline: dict, run: dict) -> float | None:
    """The measured speedup of a run over a baseline run: its tokens per second ÷ the baseline's (both
    from ``summarize_steps`` / ``run_summary``). With the same number of tokens (greedy, same prompt) this
    is the baseline's wall time ÷ the run's; with sampling the two runs may emit different counts, and
    tokens per second is the fair ratio. None when either run has no timing. The one definition every
    view (Race, the run charts, the calculator, the Drafters lab) shows; repeats of it are aggregated by
    ``median_of_ratios`` (pairs) or ``ratio_of_medians`` (unpaired repeats)."""
    base, this = baseline.get("tokens_per_s") or 0.0, run.get("tokens_per_s") or 0.0
    return this / base if base > 0 and this > 0 else None


# Speedups compared on a busy machine: a verdict only when the spread excludes 1.
COMPARE_LEVEL = 0.1  # the interval of the median ratio covers it with probability >= 1 - COMPARE_LEVEL
MIN_PAIRS = 5  # fewer alternating pairs give no interval at that level (0.5^4 * 2 = 0.125 > 0.1)
# A difference smaller than this is called neither way, however tight its interval: on a shared small machine a
# few percent come and go with the other work, and an interval just above 1 says nothing a user should act on.
MIN_EFFECT = 0.05  # chosen by measurement: docs/bench/2026-12-07-notes-from-engine.md


def median(values: list[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count)."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _median_interval(values: list[float], level: float = COMPARE_LEVEL) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values` (order statistics): [x_(j), x_(n+1-j)] with
    the largest j such that P(Binomial(n, 1/2) < j) <= level / 2, so it covers the median with probability
    >= 1 - level whatever the noise's distribution. None when n is too small for any j >= 1."""
    n = len(values)
    s = sorted(values)
    below, j = 0.0, 0
    for i in range(n + 1):  # below = P(B < i + 1) after step i
        below += math.comb(n, i) / 2**n
        if below > level / 2:
            break
        j = i + 1
    return (s[j - 1], s[n - j]) if j >= 1 else None


def paired_ratios(pairs: list[tuple[dict, dict]], ratio=None) -> list[float]:
    """``ratio``(baseline, run) of each (baseline summary, run summary) pair, the pairs without one left out;
    ratio defaults to ``measured_speedup`` (``speedup_ceiling`` and ``implied_speedup`` take the same)."""
    ratio = ratio or measured_speedup
    return [r for r in (ratio(b, s) for b, s in pairs) if r is not None]


def median_of_ratios(ratios: list[float]) -> float | None:
    """A speedup aggregated as the MEDIAN OF PER-PAIR RATIOS (``paired_ratios``), None without any.

    For runs that come in back-to-back pairs (a baseline run, then the speculative run, alternating:
    ``compare_speedups``): both runs of a pair see the same machine, so each ratio cancels the drift that a
    busy shared host adds between pairs, and the median ignores the pair another process slowed on one
    side; its distribution-free interval is ``_median_interval``. Unpaired repeats take
    ``ratio_of_medians``."""
    return median(ratios) if ratios else None


def compare_speedups(
    pairs: list[tuple[dict, dict]], level: float = COMPARE_LEVEL, quickest_pass_ms: float | None = None
) -> dict:
    """The measured speedup of alternating baseline / speculative runs, with its spread and a verdict.

    pairs: (baseline summary, speculative summary) per pair (``summarize_steps`` / ``run_summary``), the
    two runs of a pair back to back so that they see the same machine. Each pair gives one ratio
    (``measured_speedup``); the result is their median, a distribution-free interval for it
    (``_median_interval``) — the speedup aggregated as ``median_of_ratios`` — and a verdict that only a spread excluding 1 can give: "faster" (the whole
    interval at or above 1 + MIN_EFFECT), "slower" (at or below 1 - MIN_EFFECT), else "no clear
    difference"; "too few pairs" under MIN_PAIRS. "faster" also needs the passes saved to allow it
    (``speedup_ceiling`` at or above 1 + MIN_EFFECT); where they do not, "note" says so. "busy" is
    ``busy_machine``'s finding (quickest_pass_ms: the quickest baseline pass this process has measured).
    Also what the measured costs imply, which wall-clock noise moves less: the median over the pairs of
    ``implied_speedup`` (tokens per pass × the baseline's mean pass time ÷ the run's mean pass plus
    drafting time)."""
    ratios = paired_ratios(pairs)
    interval = _median_interval(ratios, level) if len(ratios) >= MIN_PAIRS else None
    ceiling = median_of_ratios(paired_ratios(pairs, speedup_ceiling))
    note = None
    if interval is None:
        verdict = "too few pairs"
    elif interval[0] >= 1.0 + MIN_EFFECT and ceiling is not None and ceiling < 1.0 + MIN_EFFECT:
        # Faster than fewer passes allow: the runs saved under MIN_EFFECT of their passes, so whatever
        # the clock says beyond that came from the machine, not from speculation.
        verdict = "no clear difference"
        note = (
            f"measured {interval[0]:.2f}-{interval[1]:.2f}x, but the drafts saved passes for only "
            f"{ceiling:.2f}x: the rest is the machine's noise"
        )
    elif interval[0] >= 1.0 + MIN_EFFECT:
        verdict = "faster"
    elif interval[1] <= 1.0 - MIN_EFFECT:
        verdict = "slower"
    else:
        verdict = "no clear difference"
    return {
        "pairs": len(ratios),
        "ratios": [round(r, 4) for r in ratios],
        "speedup": median_of_ratios(ratios),
        "low": interval[0] if interval else None,
        "high": interval[1] if interval else None,
        "level": level,
        "min_effect": MIN_EFFECT,
        "verdict": verdict,
        "implied_speedup": median_of_ratios(paired_ratios(pairs, implied_speedup)),
        "ceiling": ceiling,
        "note": note,
        "busy": busy_machine([b for b, _ in pairs], quickest_pass_ms),
    }


def top_speedups(speedups: dict[str, float | None], n: int = 2) -> list[str]:
    """The labels of the n highest speedups ({label: speedup}), fastest first, those without one left out:
    the runs a lab measures again in alternating pairs (``compare_speedups``) before naming a fastest."""
    known = [(label, value) for label, value in speedups.items() if value is not None]
    return [label for label, _ in sorted(known, key=lambda item: -item[1])[:n]]


def fastest(comparisons: dict[str, dict]) -> dict:
    """Which of several runs, each compared with the same baseline by ``compare_speedups`` ({label: its
    result}), is the fastest: {"ranked" (labels by median speedup, fastest first), "fastest" (the first,
    named only when the low end of its interval lies above the high end of every other's), "runner_up"
    (the second), "verdict" ("fastest", "no clear fastest" when the intervals overlap or one is missing, or
    None with fewer than two runs to rank), "busy" (the first busy reason of ``busy_machine`` among them, or
    None)}. One run each is never a verdict: only intervals that do not overlap name a fastest."""
    ranked = sorted(comparisons, key=lambda label: -(comparisons[label].get("speedup") or 0))
    busy = next(
        (c["busy"]["reason"] for c in (comparisons[label] for label in ranked) if (c.get("busy") or {}).get("busy")),
        None,
    )
    result = {"ranked": ranked, "fastest": None, "runner_up": None, "verdict": None, "busy": busy}
    if len(ranked) < 2:
        return result
    best, others = comparisons[ranked[0]], [comparisons[label] for label in ranked[1:]]
    result["runner_up"] = ranked[1]
    highs = [c.get("high") for c in others]
    if best.get("low") is not None and all(h is not None for h in highs) and best["low"] > max(highs):
        result.update(fastest=ranked[0], verdict="fastest")
    else:
        result["verdict"] = "no clear fastest"
    return result


# A machine is called busy when its baseline passes ran this much slower than they can: the slowest
# baseline run of the comparison against the quickest one, or the median against the quickest pass the
# process has measured.
BUSY_SLOWDOWN = 1.25  # chosen by measurement: docs/bench/2026-12-07-notes-from-engine.md


# ... or when the runs got less than this share of the cores they asked for (finish metrics' "cpu_share": near
# 1 on a quiet machine, near 0.5 with as many other processes spinning as there are cores).
BUSY_CPU_SHARE = 0.75  # chosen by measurement: docs/bench/2026-12-07-notes-from-engine.md


def busy_machine(baselines: list[dict], quickest_pass_ms: float | None = None) -> dict:
    """Whether the machine was busy while the baseline runs ran, from their own measurements: {"busy",
    "spread" (slowest ÷ quickest run's mean pass), "slowdown" (median pass ÷ quickest_pass_ms, or None),
    "cpu_share" (median share of the asked-for cores the runs got, or None), "reason"}."""
    times = [b["mean_verify_ms"] for b in baselines if b.get("mean_verify_ms")]
    shares = [b["cpu_share"] for b in baselines if b.get("cpu_share") is not None]
    share = median(shares) if shares else None
    if not times:
        return {"busy": False, "spread": None, "slowdown": None, "cpu_share": share, "reason": "no pass timed"}
    spread = max(times) / min(times)
    slowdown = median(times) / quickest_pass_ms if quickest_pass_ms else None
    reasons = []
    if share is not None and share < BUSY_CPU_SHARE:
        reasons.append(f"the runs got {share:.0%} of the cores they asked for (other processes held the rest)")
    if spread >= BUSY_SLOWDOWN:
        reasons.append(f"the same baseline run took {min(times):.0f}-{max(times):.0f} ms per pass")
    if slowdown is not None and slowdown >= BUSY_SLOWDOWN:
        reasons.append(
            f"its passes took {slowdown:.1f}x the quickest this server has measured ({quickest_pass_ms:.0f} ms)"
        )
    return {
        "busy": bool(reasons),
        "spread": spread,
        "slowdown": slowdown,
        "cpu_share": share,
        "reason": "; ".join(reasons) if reasons else "baseline passes ran at this machine's usual speed",
    }


def speedup_ceiling(baseline: dict, run: dict) -> float | None:
    """The most a run can be faster than the baseline on the same machine: its tokens per pass ÷ the
    baseline's. A speculative pass costs at least a baseline pass (the same model over one token or more)
    and drafting costs at least nothing, so fewer passes is the only way speculation saves time. A measured
    ratio above this ceiling is the machine's doing (another process paused one run more than the other)."""
    base, this = baseline.get("tokens_per_pass") or 0.0, run.get("tokens_per_pass") or 0.0
    return this / base if base > 0 and this > 0 else None


def cpu_share(cpu_s: float, wall_s: float, threads: int) -> float | None:
    """The share of the cores a run asked for (its threads) that its process got: CPU seconds ÷ (wall seconds ×
    threads), at most 1. ~1 on a quiet machine, ~0.5 on 2 cores while two other processes run; other runs in the
    same process count as its own. None without a wall time."""
    if wall_s <= 0 or threads < 1:
        return None
    return round(min(1.0, cpu_s / (wall_s * threads)), 3)


def modelled_speedup(tokens_per_pass: float, plain_pass_ms: float, pass_ms: float) -> float | None:
    """A MODELLED speedup, from pass costs rather than from timed runs: tokens per pass × a plain pass's ms ÷
    a speculative pass's ms (drafting included). The analyzer weighs a server's probed pass costs with it;
    ``implied_speedup`` is the same formula read from two measured runs."""
    if not plain_pass_ms or not pass_ms or pass_ms <= 0:
        return None
    return tokens_per_pass * plain_pass_ms / pass_ms


def request_speedup(
    outside_ms: float, tokens: float, tokens_per_pass: float, plain_pass_ms: float, pass_ms: float
) -> float | None:
    """A MODELLED speedup of whole requests of `tokens` tokens: each spends `outside_ms` outside its decode passes
    (waiting, its prefill step, the server's work around it: the same with and without speculation), then its
    tokens − 1 decoded tokens, one per plain pass or `tokens_per_pass` per speculative pass:
    (outside + (N − 1) · plain) ÷ (outside + (N − 1) ÷ tokens per pass · pass). The analyzer's model where a
    server counts per-request times (engine/tools/analyze.py ``predicted_speedup``). None when undefined."""
    if not tokens_per_pass or tokens_per_pass <= 0 or not plain_pass_ms or not pass_ms or pass_ms <= 0:
        return None
    speculative = outside_ms + (tokens - 1) / tokens_per_pass * pass_ms
    return (outside_ms + (tokens - 1) * plain_pass_ms) / speculative if speculative > 0 else None


def implied_speedup(baseline: dict, run: dict) -> float | None:
    """The speedup a run's measured costs imply: its tokens per pass × the baseline's mean pass time ÷ (its
    mean target pass + mean drafting time per pass). Wall-clock speedup also counts the prefill and the
    loop's own time; this is the part speculation changes."""
    base_pass = baseline.get("mean_verify_ms")
    passes = run.get("target_passes") or 0
    if not base_pass or not passes:
        return None
    spec_pass = (run.get("verify_s") or 0.0) * 1000.0 / passes
    draft = (run.get("draft_s") or 0.0) * 1000.0 / passes
    return modelled_speedup(run.get("tokens_per_pass", 0.0), base_pass, spec_pass + draft)


# Metrics added after traces were first recorded; a recorded finish event without them gets them from its steps.
LATER_METRICS = (
    "theoretical_tokens_per_pass",
    "theoretical_tokens_per_drafting_pass",
    "passes_drafted",
    "mean_drafted_depth",
    "mean_depth_per_pass",
    "positions_tried",
    "accepted_histogram",
    "mean_acceptance_length",
)


def trace_k(start: dict) -> int:
    """The run's draft depth K (0 for the baseline)."""
    k = (start.get("tree") or {}).get("k")
    if k is None:
        k = (start.get("settings") or {}).get("k", 0)
    return 0 if start.get("mode") == "baseline" else int(k or 0)


def run_summary(trace) -> dict:
    """The headline numbers of a run, live or recorded, finished or partial.

    A finished run's numbers are its finish event's metrics (computed by the
    engine with ``summarize_steps``); a partial run's are ``summarize_steps`` over
    the steps so far, with the last step's elapsed time as wall time. Either way
    the same keys, plus what the run was: mode, target, drafter, greedy, prompt,
    finished, stop_reason, k, tree_topk.
    """
    start = start_event(trace)
    steps = step_events(trace)
    finish = finish_event(trace)
    k = trace_k(start)
    wall_s = float(steps[-1].get("elapsed_s") or 0.0) if steps else 0.0
    summary = summarize_steps(steps, k, wall_s)
    if finish is not None:
        metrics = finish.get("metrics") or {}
        if steps:
            # Recorded before these were computed (the histogram, the theory at each pass's drafted depth,
            # which replaced a theory at the slider's K): the steps give them.
            later = {key: summary[key] for key in LATER_METRICS if key not in metrics}
            if "passes_drafted" not in metrics:
                later["theoretical_tokens_per_pass"] = summary["theoretical_tokens_per_pass"]
            metrics = {**metrics, **later}
        summary.update(metrics)  # the engine's numbers win (payload "off" has no steps)
    summary.update(
        mode=start.get("mode"),
        target=start.get("target"),
        drafter=start.get("drafter"),
        greedy=bool(start.get("greedy", False)),
        prompt=start.get("prompt"),
        finished=finish is not None,
        stop_reason=(finish or {}).get("stop_reason"),
        k=k,
        tree_topk=int((start.get("tree") or {}).get("topk") or 1),
    )
    return summary
