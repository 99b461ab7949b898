"""The analyzer's predictions against real batches: the validation table, recomputed from a stored grid.

scripts/validate_analyzer.py measures a grid on vLLM servers (one without speculation, n-gram at each K) and
stores, for each workload and batch size B, every server's window (engine/tools/analyze.py ``window_counts``)
and the batches' throughput, beside the probed pass costs. ``predict_grid`` reads that JSON alone:

* the prediction for (workload, B, K) reads what an engineer has: ONE window of the largest K's server (that
  workload's traffic at ``window_batch``) and the pass costs, through ``read_window`` (the analyzer itself); the
  pass costs are read again from the probe's stored counters where it kept them (``costs_from_cases``), so a
  grid recorded before a change to the probe's reading is predicted as the probe reads today;
* the measurement is the ratio of medians of the K server's and the plain server's throughput at (B), with its
  spread (engine.metrics.ratio_bounds);
* error = predicted ÷ measured − 1; the summary gives the median absolute error and the cells where the
  prediction is on the other side of 1 (no speedup) from a measurement whose spread excludes 1.
"""

from __future__ import annotations

import statistics

from engine.metrics import ratio_bounds
from engine.tools.analyze import AnalyzeError, read_window, scrape, window_counts
from engine.tools.pass_costs import costs_from_cases

__all__ = ["grid_markdown", "measure_cell", "pooled_summary", "predict_grid"]

# measure_batches' figures kept; the latencies show how far a batch's slowest request (which ends its wall time,
# hence its throughput) is from its median one
READ = ("tok_per_s", "tok_per_s_min", "tok_per_s_max", "tokens_per_request", "latency_s", "latency_max_s")


def measure_cell(urls: dict, prompts: list, batch: int, max_new_tokens: int = 128, repeats: int = 3) -> dict:
    """One (workload, B) of the grid: B concurrent requests of `prompts`, `repeats` times interleaved over the
    servers `urls` ({"baseline": url, "k<K>": url, ..}, already warm), and every server's window of exactly
    those batches: {"batch", "windows" {name: window_counts}, "tok_per_s", "tok_per_s_min", "tok_per_s_max",
    "tokens_per_request", "latency_s" (median request), "latency_max_s" (slowest) {name: value},
    "greedy_mismatches"}."""
    from engine.vllm.batch import measure_batches

    before = {name: scrape(url) for name, url in urls.items()}
    report = measure_batches(
        urls, prompts, [batch], max_new_tokens=max_new_tokens, repeats=repeats, temperature=0.0, warm_up=False
    )
    after = {name: scrape(url) for name, url in urls.items()}
    modes = report["modes"]
    return {
        "batch": batch,
        "windows": {name: window_counts(before[name], after[name], None, name != "baseline") for name in urls},
        **{key: {name: mode[key][0] for name, mode in modes.items()} for key in READ},
        "greedy_mismatches": len(report["greedy_mismatches"]),
    }


def _window(data: dict, workload: str) -> dict:
    """The window the predictions of `workload` read: the largest K's server at the grid's window batch."""
    k = max(data["settings"]["ks"])
    b = data["settings"].get("window_batch", 1)
    cell = next((c for c in data["cells"] if c["workload"] == workload and c["batch"] == b), None)
    if cell is None:
        raise AnalyzeError(f"the grid has no {workload} cell at batch {b} to read a window from")
    return cell["windows"][f"k{k}"]


def predict_grid(data: dict) -> dict:
    """{"rows": [{"workload", "batch", "k", "predicted", "measured", "measured_low", "measured_high", "error",
    "wrong_side"}], "summary": {"cells", "median_abs_error", "wrong_side", "window_batch"}} for a stored grid
    (scripts/validate_analyzer.py's JSON)."""
    rows = []
    costs = costs_from_cases(data["pass_costs"])  # today's reading of the probe's requests, where they are stored
    for workload in dict.fromkeys(c["workload"] for c in data["cells"]):
        result = read_window(_window(data, workload), None, costs)
        for cell in (c for c in data["cells"] if c["workload"] == workload):
            base = cell["tok_per_s"]["baseline"]
            for k in data["settings"]["ks"]:
                name = f"k{k}"
                predicted = result["speedup_by_batch"].get(cell["batch"], {}).get(k)
                measured = cell["tok_per_s"][name] / base if base else None
                low, high = ratio_bounds(
                    (cell["tok_per_s_min"][name], cell["tok_per_s_max"][name]),
                    (cell["tok_per_s_min"]["baseline"], cell["tok_per_s_max"]["baseline"]),
                )
                if predicted is None or measured is None:
                    continue
                clear = low is not None and (low > 1.0 or high < 1.0)
                rows.append(
                    {
                        "workload": workload,
                        "batch": cell["batch"],
                        "k": k,
                        "predicted": predicted,
                        "measured": measured,
                        "measured_low": low,
                        "measured_high": high,
                        "error": predicted / measured - 1.0,
                        "wrong_side": bool(clear and (predicted > 1.0) != (measured > 1.0)),
                    }
                )
    errors = [abs(r["error"]) for r in rows]
    return {
        "rows": rows,
        "summary": {
            "cells": len(rows),
            "median_abs_error": statistics.median(errors) if errors else None,
            "wrong_side": sum(r["wrong_side"] for r in rows),
            "window_batch": data["settings"].get("window_batch", 1),
        },
    }


def pooled_summary(tables: list[dict]) -> dict:
    """Several grids' tables (``predict_grid``) as one check: {"grids", "cells", "median_abs_error" over every
    cell of every grid, "wrong_side" summed, "per_grid" [each grid's median absolute error]}. One grid on this
    shared host is one draw of its noise; the median over runs is what the model is judged by."""
    rows = [r for table in tables for r in table["rows"]]
    if not rows:
        raise AnalyzeError("no grid cells to pool")
    return {
        "grids": len(tables),
        "cells": len(rows),
        "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
        "wrong_side": sum(r["wrong_side"] for r in rows),
        "per_grid": [table["summary"]["median_abs_error"] for table in tables],
    }


def grid_markdown(table: dict) -> str:
    """The validation table as Markdown (docs/vllm.md carries it; a test recomputes it from the stored grid):
    one row per workload and B, per K the measured speedup with its spread and the prediction beside it."""
    ks = sorted({r["k"] for r in table["rows"]})
    head = "| workload | B | " + " | ".join(f"K = {k}: measured [spread] · predicted" for k in ks) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(ks)]
    cells: dict = {}
    for r in table["rows"]:
        cells.setdefault((r["workload"], r["batch"]), {})[r["k"]] = r
    for (workload, batch), by_k in cells.items():
        parts = []
        for k in ks:
            r = by_k.get(k)
            if r is None:
                parts.append("—")
                continue
            flag = " (wrong side of 1)" if r["wrong_side"] else ""
            parts.append(
                f"{r['measured']:.2f}× [{r['measured_low']:.2f}–{r['measured_high']:.2f}] · "
                f"{r['predicted']:.2f}× ({r['error']:+.0%}){flag}"
            )
        lines.append(f"| {workload} | {batch} | " + " | ".join(parts) + " |")
    s = table["summary"]
    lines.append("")
    lines.append(
        f"Median absolute error {s['median_abs_error']:.0%} over {s['cells']} cells; {s['wrong_side']} on the wrong "
        "side of 1.0× where the measurement's spread excludes 1.0×."
    )
    return "\n".join(lines)
