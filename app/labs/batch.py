"""The Batch lab: when does speculation stop paying? Pass times measured now, throughputs computed from them.

engine.model.pass_timing.measure_pass_times times one target pass for B sequences with 1 and with K + 1 tokens
each (interleaved repeats, median and spread); engine.metrics.batch_throughputs computes the throughputs
with and without speculation and the verdict from those times, α and the draft time, once: the title,
the text and the table all read that one result. Changing α or the draft time recomputes it at once from
the session's last measurement. SpecLens decodes one sequence at a time, so batched speculative decoding
is computed here, not run.
"""

from __future__ import annotations

import time

import gradio as gr

from engine.metrics import batch_throughputs, draft_ms_per_position, expected_tokens_per_pass
from visuals import batch_figure
from visuals.lab_figures import measured_batch_figure

from .. import config
from ..engine_access import get_engine, is_loaded
from ..figure_guard import guarded
from ..inputs import number
from ..stopping import ProgressReporter, Stopped
from ..wiring import PRIVATE, run_stop_buttons
from .last_run import last_run
from .panels import lab_tab, results_plot, results_table, status_box, wire_lab_run

__all__ = ["build_tab", "batch_refresh", "recompute", "run_batch", "run_vllm_batch", "vllm_available"]

# The run"s inputs (controls, in the order the run takes them) and outputs (results).
INPUTS = ["k", "alpha", "sizes", "draft_ms", "repeats", "source"]
OUTPUTS = ["status", "plot", "table", "measured"]

MAX_K = 8
MAX_ALPHA = 1.0  # a run that kept every draft has α = 1 (E = K + 1): capped at 0.99, its E came out otherwise
MAX_BATCH = 64
MAX_REPEATS = 10
MAX_DRAFT_MS = 10_000
BATCH_SIZES = [1, 2, 4, 8, 16]
START = {"k": 4, "alpha": 0.7, "draft_ms": 0, "repeats": 5}  # what the tab shows before the session has a run
# Where K, α and the draft time come from, named in every verdict (nothing borrowed changes a verdict silently).
START_SOURCE = "the tab's starting values (α = 0.7, free drafting): no Playground run taken yet"
TYPED_SOURCE = "set by you in this tab"
TREE_SOURCE = (
    "the tab's starting values (α = 0.7, free drafting): your last Playground run drafted a tree, which this lab's "
    "chain model does not take"
)
# The speedup beside its batch size: on a phone the table scrolls sideways and shows its first columns.
BATCH_HEADERS = [
    "batch B",
    "speedup (computed: median [spread])",
    "pass, 1 token per row (ms, measured: median [min–max])",
    "pass, K+1 tokens per row (ms, measured: median [min–max])",
    "without speculation (tok/s, computed)",
    "with speculation (tok/s, computed)",
]

BATCH_TEXT = """
**When does speculation stop paying?** A speculative pass verifies K + 1 tokens per sequence. Decoding one
sequence on this machine, a pass over K + 1 tokens costs little more than a pass over one (the weights are read
once either way); when many sequences share a pass, the extra tokens cost real compute. This lab **measures**,
now and on this machine, how long one target pass takes for B sequences with 1 token each and with K + 1 tokens
each (B independent prefixes of 64 tokens in one forward, median of a few repeats), then **computes** throughput:
without speculation B ÷ pass time; with speculation B × E ÷ (pass time with K + 1 tokens + K × draft time), where
E = (1 − α^(K+1)) / (1 − α) comes from α. SpecLens decodes one sequence at a time, so batched speculative
decoding itself is **computed from these measurements, not run**. Other runs on the server at the same time slow
the measurement.
"""


def batch_refresh(trace, seen: str, k, alpha, draft_ms, source: str = START_SOURCE):
    """Entering the Batch lab: when a new Playground run exists, take its K, α and draft time per token, and say
    so: the note and the source every verdict names. Returns (k, α, draft ms, note, seen run, source)."""
    summary, note = last_run(trace)
    if summary is None or summary["run_id"] == seen:
        note = f"{note} Until then α and the draft time are whatever you set here."
        return gr.skip(), gr.skip(), gr.skip(), note if summary is None else gr.skip(), seen, gr.skip()
    if summary.get("tree_topk", 1) > 1:
        # This lab models a chain of K drafts: a tree's α (per depth, any sibling) and its draft time per depth
        # (a level of several candidates) are not a chain's, and taken as one they rose with the batch size.
        return (
            START["k"],
            START["alpha"],
            START["draft_ms"],
            f"Your last Playground run drafted a tree (top-k {summary['tree_topk']}, run {_clock(summary)}): this lab "
            "models a chain of K drafts, so it does not take a tree's α and draft time. It uses its starting values; "
            "run a chain (tree top-k 1) to take yours.",
            summary["run_id"],
            TREE_SOURCE,
        )
    k = int(min(MAX_K, max(1, summary["k"])))
    alpha = round(min(MAX_ALPHA, max(0.0, summary["position_acceptance"])), 2)
    per_token = draft_ms_per_position(summary)
    taken = f"your Playground run ({summary.get('drafter')}, K = {summary['k']}, run {_clock(summary)})"
    return (
        k,
        alpha,
        round(per_token, 2),
        f"K, α and the draft time are set from it. {note} Drafting took {per_token:.2f} ms per draft token (measured)."
        + _depth_note(summary, k, alpha),
        summary["run_id"],
        taken,
    )


def _depth_note(summary: dict, k: int, alpha: float) -> str:
    """Why E here can exceed the run's measured tokens per pass: E assumes K drafts on every pass, and a run's
    passes can draft fewer (an n-gram match shorter than K, adaptive depth, nothing to copy)."""
    mean_k = summary.get("mean_depth_per_pass", k)
    if mean_k >= k - 0.05:
        return ""
    return (
        f" This lab's E = {expected_tokens_per_pass(alpha, k):.2f} assumes K = {k} drafts on every pass; your run's "
        f"passes drafted {mean_k:.2f} on average, which is why it measured fewer tokens per pass."
    )


def _clock(summary: dict) -> str:
    """When a run started, as the clock on this server read it ("14:02:31")."""
    started = summary.get("started_at")
    return time.strftime("%H:%M:%S", time.localtime(float(started))) if started else "earlier"


def _ms(median: float, spread: list[float] | None) -> str:
    return f"{median:.1f}" + (f" [{spread[0]:.1f}–{spread[1]:.1f}]" if spread else "")


def _batch_table(result: dict) -> list[list]:
    rows = []
    spreads_1 = result.get("spread_ms_1") or [None] * len(result["batch_sizes"])
    spreads_k1 = result.get("spread_ms_k1") or [None] * len(result["batch_sizes"])
    bounds = result.get("speedup_bounds") or [None] * len(result["batch_sizes"])
    for b, t1, s1, tk, sk, plain, spec, ratio, bound in zip(
        result["batch_sizes"],
        result["pass_ms_1"],
        spreads_1,
        result["pass_ms_k1"],
        spreads_k1,
        result["throughput_plain"],
        result["throughput_speculative"],
        result["speedup"],
        bounds,
    ):
        rows.append([b, _speedup_cell(ratio, bound), _ms(t1, s1), _ms(tk, sk), f"{plain:.1f}", f"{spec:.1f}"])
    return rows


def _speedup_cell(ratio: float, bound) -> str:
    """The speedup with the spread of the repeats' pairings beside it ("ratio× [low–high]"): a row whose spread
    straddles 1× reads as no verdict, as the headline says."""
    if not bound or bound[0] is None or bound[0] == bound[1]:
        return f"{ratio:.2f}×"
    return f"{ratio:.2f}× [{bound[0]:.2f}–{bound[1]:.2f}]"


COST_FINDINGS = {  # engine.metrics.wide_pass_cost's finding, in words
    "same": ": the same cost within this machine's noise",
    "cheaper": (
        ": cheaper in every repeat, which is this CPU's matrix library (it runs a few rows faster than one), "
        "not speculation"
    ),
}


def _cost_words(result: dict, b: int, k: int) -> str:
    """What a pass over K + 1 tokens per row costs against a one-token pass at the first batch size, with the
    spread of the repeats (the slowest over the quickest either way), as engine.metrics.wide_pass_cost found
    it: a ratio whose spread straddles 1 is the same cost within noise, never "cheaper"."""
    cost, bounds = result["pass_cost"][0], result["pass_cost_bounds"][0]
    words = f"At B = {b} a pass over K + 1 = {k + 1} tokens per row costs {cost:.2f}× a pass over one token"
    if not bounds or bounds[0] is None:
        return words
    words += f" ({bounds[0]:.2f}–{bounds[1]:.2f}× across the repeats)"
    return words + COST_FINDINGS.get(result["pass_cost_finding"][0], "")


def _ceiling_words(result: dict) -> str:
    """Where the wide pass was measured quicker than a one-token pass, what the lab counted instead (the
    ceiling engine.metrics.batch_throughputs applies): empty where it did not apply."""
    capped = result.get("capped_at") or []
    spread = [b for b in result.get("bound_capped_at") or [] if b not in capped]
    if not capped and not spread:
        return ""
    first = (capped or spread)[0]
    ceiling = result["speedup_ceiling"][result["batch_sizes"].index(first)]
    why = (
        "it is counted at the one-token pass's time (a decoder without speculation could run its token in the "
        f"wider shape too), so a speedup is at most {ceiling:.2f}× (E, less the drafting time)"
    )
    if capped:
        words = (
            f" At B = {', '.join(map(str, capped))} the wider pass was measured quicker than a one-token pass: {why}."
        )
        if spread:
            words += f" The same cuts the top of the spread at B = {', '.join(map(str, spread))}."
        return words
    return (
        f" At B = {', '.join(map(str, spread))} the quickest wider pass was quicker than the slowest one-token pass: "
        f"{why}, which is where the spread's top stops."
    )


def _status(result: dict) -> str:
    """What was measured (where, when), what computed, and the verdict, all from one result."""
    sizes, k, alpha = result["batch_sizes"], result["k"], result["alpha"]
    return (
        f"**Pass times measured on this machine ({result['measured_on']}; median of {result['repeats']} "
        f"interleaved repeats, spread in the table); throughputs computed from them, α and the draft time.** "
        f"{_cost_words(result, sizes[0], k)}; "
        f"with E = {result['expected_tokens_per_pass']:.2f} tokens per pass (α = {alpha:.2f}, K = {k}): "
        f"**{result['verdict']}**.{_ceiling_words(result)} K, α and the draft time ({result['draft_ms']:g} ms per draft token) come from "
        f"{result.get('source') or TYPED_SOURCE}: a new Playground run re-measures them, and **Measure** re-measures the pass times. "
        "Move α or the draft time to recompute at once from these pass times. The engine decodes one sequence at a "
        "time: batched speculative decoding is computed here, not run."
    )


def _outputs(result: dict):
    """(status, figure, table) of one computed result: the verdict is computed once, read by all three."""
    return _status(result), guarded("Batch measurements", batch_figure, result), _batch_table(result)


def recompute(measured: dict | None, k, alpha, draft_ms, source: str = TYPED_SOURCE):
    """α, K or the draft time changed: the throughputs again from the session's last pass times. source: where
    the new values came from (a Playground run taken on entering the tab, or typed here), named in the verdict."""
    if not measured:
        return gr.skip(), gr.skip(), gr.skip()
    try:
        k = number(k, "K", 1, MAX_K, integer=True)
        alpha = number(alpha, "α", 0.0, MAX_ALPHA)
        draft_ms = number(0 if draft_ms in (None, "") else draft_ms, "Draft time per token (ms)", 0, MAX_DRAFT_MS)
    except gr.Error:
        return gr.skip(), gr.skip(), gr.skip()
    if k != measured["k"]:
        return (
            f"K is now {k}, but the pass times were measured with K + 1 = {measured['k'] + 1} tokens per row: "
            "press **Measure** to time passes of the new width.",
            gr.skip(),
            gr.skip(),
        )
    return _outputs(
        {**measured, **batch_throughputs(measured, alpha, draft_ms), "draft_ms": draft_ms, "source": source}
    )


def _checked(k, alpha, batch_sizes, draft_ms, repeats) -> dict:
    lab = {
        "k": number(k, "K", 1, MAX_K, integer=True),
        "alpha": number(alpha, "α", 0.0, MAX_ALPHA),
        "draft_ms": number(0 if draft_ms in (None, "") else draft_ms, "Draft time per token (ms)", 0, MAX_DRAFT_MS),
        "repeats": number(repeats, "Repeats", 1, MAX_REPEATS, integer=True),
    }
    try:
        lab["sizes"] = sorted({int(b) for b in (batch_sizes or [])})
    except (TypeError, ValueError):
        raise gr.Error(f"Batch sizes must be whole numbers, got {batch_sizes!r}.") from None
    if not lab["sizes"]:
        raise gr.Error("Pick at least one batch size.")
    if any(not 1 <= b <= MAX_BATCH for b in lab["sizes"]):
        raise gr.Error(f"Batch sizes must be between 1 and {MAX_BATCH}.")
    return lab


def run_batch(
    k,
    alpha,
    batch_sizes,
    draft_ms,
    repeats=START["repeats"],
    source: str = TYPED_SOURCE,
    run_id: str = "",
    progress=gr.Progress(),  # noqa: B008
):
    """Generator: measure pass times per batch size, then compute throughputs; yields (status, figure, rows,
    the measured pass times kept for instant recomputation)."""
    from engine.host import cpu_name
    from engine.model.pass_timing import measure_pass_times

    lab = _checked(k, alpha, batch_sizes, draft_ms, repeats)
    if not is_loaded("default", "auto"):
        yield "Loading the model (once per server)…", gr.skip(), gr.skip(), gr.skip()
    engine = get_engine("default", "auto", progress)
    sizes = ", ".join(map(str, lab["sizes"]))
    yield f"Measuring pass times for B = {sizes} ({lab['repeats']} rounds)…", gr.skip(), gr.skip(), gr.skip()
    tracker = ProgressReporter(progress, "rounds measured", run_id, interval=0.0)
    started = time.perf_counter()
    try:
        measured = measure_pass_times(
            engine.target.model, lab["k"], lab["sizes"], repeats=lab["repeats"], progress=tracker
        )
    except Stopped:
        yield "■ Stopped. Nothing is computed from an unfinished measurement.", gr.skip(), gr.skip(), gr.skip()
        return
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    dtype = str(engine.target.model.dtype).removeprefix("torch.")
    measured["measured_on"] = (
        f"{engine.target.name}, {dtype}, {cpu_name()}, {time.perf_counter() - started:.0f} s, {time.strftime('%H:%M')}"
    )
    yield (
        *_outputs(
            {
                **measured,
                **batch_throughputs(measured, lab["alpha"], lab["draft_ms"]),
                "draft_ms": lab["draft_ms"],
                "source": source,
            }
        ),
        measured,
    )


# ------------------------------------------------------------------------------ measured on vLLM
VLLM_HEADERS = [
    "batch B",
    "without speculation (tok/s, measured: median [min–max])",
    "with speculation (tok/s, measured: median [min–max])",
    "speedup (measured)",
    "latency per request without / with (s, median)",
]
VLLM_MAX_NEW_TOKENS = 64


def vllm_available() -> bool:
    """Both servers configured: one with speculation, one without (SPECLENS_VLLM_URL, ..._BASELINE_URL)."""
    return bool(config.VLLM_URL and config.VLLM_BASELINE_URL)


def _vllm_table(report: dict) -> list[list]:
    base, spec = report["modes"]["baseline"], report["modes"]["speculative"]
    rows = []
    for i, b in enumerate(report["batch_sizes"]):
        cells = [
            f"{m['tok_per_s'][i]:.1f} [{m['tok_per_s_min'][i]:.1f}–{m['tok_per_s_max'][i]:.1f}]" for m in (base, spec)
        ]
        speedup = (report.get("speedup") or [None] * (i + 1))[i]
        rows.append(
            [
                b,
                *cells,
                f"{speedup:.2f}×" if speedup else "—",
                f"{base['latency_s'][i]:.2f} / {spec['latency_s'][i]:.2f}",
            ]
        )
    return rows


def run_vllm_batch(batch_sizes, repeats=START["repeats"], run_id: str = "", progress=gr.Progress()):  # noqa: B008
    """Generator: B concurrent requests to the two vLLM servers at each batch size, throughput measured, not
    computed; yields (status, figure, rows, measured pass times unchanged)."""
    import json

    from engine.vllm.batch import measure_batches
    from engine.vllm.client import VllmError

    if not vllm_available():
        raise gr.Error("Set SPECLENS_VLLM_URL and SPECLENS_VLLM_BASELINE_URL to measure real batches on vLLM.")
    lab = _checked(1, 0.0, batch_sizes, 0, repeats)
    prompts = json.loads((config.ASSETS / "workloads.json").read_text(encoding="utf-8"))["code-edit"]
    yield f"Sending real batches of B = {', '.join(map(str, lab['sizes']))} to both vLLM servers…", *[gr.skip()] * 3
    tracker = ProgressReporter(progress, "batches measured", run_id, interval=0.0)
    started = time.perf_counter()
    servers = {"baseline": config.VLLM_BASELINE_URL, "speculative": config.VLLM_URL}
    try:
        report = measure_batches(
            servers,
            prompts,
            lab["sizes"],
            max_new_tokens=VLLM_MAX_NEW_TOKENS,
            repeats=lab["repeats"],
            progress=lambda done, total, *_: tracker(done, total),
        )
    except Stopped:
        yield "■ Stopped. Nothing is reported from an unfinished measurement.", *[gr.skip()] * 3
        return
    except (VllmError, ValueError) as exc:
        raise gr.Error(str(exc)) from None
    status = (
        f"**Measured on vLLM, not computed** ({time.perf_counter() - started:.0f} s; code-edit prompts, "
        f"{VLLM_MAX_NEW_TOKENS} new tokens, greedy, median of {lab['repeats']} repeats): **{report.get('verdict')}**. "
        f"Greedy outputs with and without speculation differed in {len(report.get('greedy_mismatches') or [])} "
        "requests."
    )
    table = gr.Dataframe(value=_vllm_table(report), headers=VLLM_HEADERS)
    yield status, guarded("vLLM batches", measured_batch_figure, report), table, gr.skip()


def _controls() -> dict:
    c = {}
    c["run_btn"], c["stop_btn"] = run_stop_buttons("▶ Measure", "bl-run", "bl-stop")
    c["vllm_btn"] = gr.Button(
        "▶ Measure real batches on vLLM",
        visible=vllm_available(),
        elem_id="bl-vllm",
    )
    c["k"] = gr.Slider(1, MAX_K, START["k"], step=1, label="K (draft depth)", elem_id="bl-k")
    c["alpha"] = gr.Slider(
        0,
        MAX_ALPHA,
        START["alpha"],
        step=0.01,
        label="α (acceptance rate)",
        info="Taken from your last Playground run when there is one.",
        elem_id="bl-alpha",
    )
    c["sizes"] = gr.CheckboxGroup(BATCH_SIZES, value=BATCH_SIZES, label="Batch sizes B", elem_id="bl-sizes")
    c["draft_ms"] = gr.Number(
        START["draft_ms"],
        label="Draft time per draft token (ms)",
        info="Measured by your last Playground run when there is one; 0 = free drafting (n-gram).",
        minimum=0,
        elem_id="bl-draft",
    )
    c["repeats"] = gr.Slider(
        1, MAX_REPEATS, START["repeats"], step=1, label="Rounds of measurements (median, spread shown)"
    )
    c["note"] = gr.Markdown(
        "No Playground run in this session yet: α = 0.7 and free drafting are assumed.", elem_id="bl-note"
    )
    c["source"] = gr.State(START_SOURCE)  # where K, α and the draft time came from (START/TYPED_SOURCE or a run)
    return c


def _results() -> dict:
    status = status_box(
        "*Press **Measure** to time real target passes (about half a minute with all batch sizes).*", "bl-status"
    )
    plot = results_plot("Throughput vs batch size", "Press Measure to time real target passes", "bl-plot")
    widths = ["10%", "18%", "18%", "18%", "18%", "18%"]
    table = results_table([["—", "not run"] + ["—"] * 4], BATCH_HEADERS, "Measured and computed", widths, "bl-table")
    return {"status": status, "plot": plot, "table": table, "measured": gr.State(None)}


def build_tab(trace_state: gr.State) -> gr.Tab:
    """The Batch lab; `trace_state` is the Playground's per-session trace (its K, α and draft time)."""

    def wire(c: dict, out: dict) -> None:
        seen = gr.State("")  # the run whose K, α and draft time were last taken
        wire_lab_run(c, out, run_batch, INPUTS, OUTPUTS)
        c["vllm_btn"].click(
            run_vllm_batch, [c["sizes"], c["repeats"]], [out[key] for key in OUTPUTS], show_progress_on=[out["status"]]
        )
        refreshed = [c["k"], c["alpha"], c["draft_ms"]]
        for control in refreshed:
            # A value the user types is theirs from then on (.input: their edits only, not the run taken below).
            control.input(lambda: TYPED_SOURCE, None, [c["source"]], queue=False, show_progress="hidden", **PRIVATE)
            control.change(
                recompute,
                [out["measured"], *refreshed, c["source"]],
                [out["status"], out["plot"], out["table"]],
                show_progress="hidden",
                concurrency_limit=None,
                **PRIVATE,
            )
        c["tab"].select(
            batch_refresh,
            [trace_state, seen, *refreshed, c["source"]],
            [*refreshed, c["note"], seen, c["source"]],
            show_progress="hidden",
            concurrency_limit=None,
            **PRIVATE,
        )

    return lab_tab("Batch lab", "batch", BATCH_TEXT, _controls, _results, wire)
