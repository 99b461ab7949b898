"""Check the analyzer's predicted speedups against real batches of the same traffic on the same vLLM server.

    .venv/bin/python scripts/validate_analyzer.py [--ks 2,4,8] [--sizes 1,2,4,8,16] [--repeats 4]
        [--tokens 128] [--workloads code-edit,chat] [--window-batch 4] [--out FILE]
    .venv/bin/python scripts/validate_analyzer.py --from docs/bench/FILE.json   # the table of a stored grid

Starts vLLM CPU servers without speculation and with n-gram at each K, and times the largest K's passes
(engine/tools/pass_costs.py, against the plain server). Then for each workload and batch size B it measures
real batches of that workload's prompts on every server (engine/vllm/batch.py: B concurrent requests, repeats
interleaved over the servers, median and spread), scraping every server around them. Each (workload, B) keeps
every server's window as counter differences (engine/tools/analyze.py ``window_counts``), so the table can be
recomputed from the JSON alone when the model changes (engine/tools/validate.py ``predict_grid``; a test
recomputes the committed table).

A prediction for (workload, B, K) reads only what an engineer would have: the largest K's window of that
workload at one load (``--window-batch``, default B = 4: every prompt at least once), and the probed pass
costs. It is compared with the speedup measured at (B, K) on the servers. vLLM's CPU build refuses synthetic rejection, so
this grid is n-gram K = 2, 4, 8; the synthetic τ rows need a GPU server (engine/tools/what_if.py prints its
lines). The servers are stopped by their process groups at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.host import cpu_flags, cpu_name  # noqa: E402
from engine.tools.pass_costs import probe_pass_costs  # noqa: E402
from engine.tools.validate import grid_markdown, measure_cell, pooled_summary, predict_grid  # noqa: E402
from engine.vllm.batch import measure_batches  # noqa: E402
from engine.vllm.server import VllmServer, ngram_config  # noqa: E402

PROMPTS = {"chat": ("chat", "chat-heldout"), "code-edit": ("code-edit",), "summarize": ("summarize",)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="2,4,8")
    parser.add_argument("--sizes", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--workloads", default="code-edit,chat")
    parser.add_argument("--window-batch", type=int, default=4)
    parser.add_argument("--out", default="validate-analyzer.json")
    parser.add_argument(
        "--from", dest="stored", nargs="+", default=None, help="recompute the tables of stored grids (no servers)"
    )
    args = parser.parse_args()
    if args.stored:
        tables = [predict_grid(json.loads(Path(path).read_text())) for path in args.stored]
        for path, table in zip(args.stored, tables):
            print(f"{path}\n\n{grid_markdown(table)}\n")
        if len(tables) > 1:
            pooled = pooled_summary(tables)
            print(
                f"Pooled over {pooled['grids']} grids: median absolute error {pooled['median_abs_error']:.0%} over "
                f"{pooled['cells']} cells (each grid: {', '.join(f'{e:.0%}' for e in pooled['per_grid'])}); "
                f"{pooled['wrong_side']} on the wrong side of 1.0×."
            )
        return 0
    ks = [int(k) for k in args.ks.split(",")]
    sizes = [int(b) for b in args.sizes.split(",")]
    workloads = json.loads((ROOT / "assets" / "workloads.json").read_text())
    servers = {"baseline": VllmServer(speculative=None)}
    servers.update({f"k{k}": VllmServer(speculative=ngram_config(k)) for k in ks})
    cells, costs = [], None
    t0 = time.time()
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.wait()
        urls = {name: server.url for name, server in servers.items()}
        costs = probe_pass_costs(
            urls[f"k{max(ks)}"], max_batch=max(sizes), repeats=args.repeats, baseline_url=urls["baseline"]
        )
        print(json.dumps({"pass_costs": costs, "s": round(time.time() - t0)}), flush=True)
        for name in args.workloads.split(","):
            prompts = [p for key in PROMPTS.get(name, (name,)) for p in workloads[key]]
            measure_batches(urls, prompts, [1], max_new_tokens=4, repeats=1)  # warm every server on these prompts
            for b in sizes:
                cell = {"workload": name, **measure_cell(urls, prompts, b, args.tokens, args.repeats)}
                cells.append(cell)
                print(json.dumps({**cell, "windows": None, "s": round(time.time() - t0)}), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    out = {
        "what": "the analyzer's predicted speedup (one window of the traffic + probed pass costs) against real "
        "batches of it on vLLM CPU servers without speculation and with n-gram at each K",
        "cpu": cpu_name(),
        "cpu_flags": sorted(f for f in (cpu_flags() or ()) if f.startswith(("avx", "amx", "fma", "f16c"))),
        "recorded": time.strftime("%Y-%m-%d"),
        "settings": {
            "ks": ks,
            "sizes": sizes,
            "repeats": args.repeats,
            "max_new_tokens": args.tokens,
            "temperature": 0.0,
            "window_batch": args.window_batch,
            "seconds": round(time.time() - t0),
        },
        "pass_costs": costs,
        "cells": cells,
    }
    if args.out:  # the measurements first: a table that cannot be computed loses nothing measured
        Path(args.out).write_text(json.dumps(out, indent=1))
    out["table"] = predict_grid(out)
    print(grid_markdown(out["table"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
