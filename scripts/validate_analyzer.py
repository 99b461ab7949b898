"""Check the analyzer's expected speedups against real batches of the same traffic on the same vLLM server.

    .venv/bin/python scripts/validate_analyzer.py [--sizes 1,4,16] [--repeats 4] [--tokens 128] [--out FILE]

Starts two vLLM CPU servers, n-gram K = 8 and none, and times the speculative one's passes
(engine/tools/pass_costs.py). Then for each workload (code-edit, chat) and batch size B it measures real
batches of that workload's prompts on both servers (engine/vllm/batch.py: B concurrent requests, repeats
interleaved, median and spread), scraping the speculative server around them: that window of exactly this
traffic, read by engine/tools/analyze.py with the probed costs, gives the expected speedup at B and K = 8,
which is printed beside the measured one and written as JSON. The servers are stopped by their process
groups at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.host import cpu_name  # noqa: E402
from engine.tools.analyze import AnalyzeError, analyze, scrape  # noqa: E402
from engine.tools.pass_costs import probe_pass_costs  # noqa: E402
from engine.vllm.batch import measure_batches  # noqa: E402
from engine.vllm.server import VllmServer, ngram_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = [int(b) for b in args.sizes.split(",")]
    workloads = json.loads((ROOT / "assets" / "workloads.json").read_text())
    rows, costs = [], None
    servers = {"speculative": VllmServer(speculative=ngram_config(8)), "baseline": VllmServer(speculative=None)}
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.wait()
        urls = {name: server.url for name, server in servers.items()}
        costs = probe_pass_costs(urls["speculative"], max_batch=max(sizes), repeats=3, baseline_url=urls["baseline"])
        print(json.dumps({"pass_costs": costs}), flush=True)
        for name in ("code-edit", "chat"):
            for b in sizes:
                before = scrape(urls["speculative"])
                report = measure_batches(
                    urls, workloads[name], [b], max_new_tokens=args.tokens, repeats=args.repeats, temperature=0.0
                )
                try:
                    result = analyze(before, scrape(urls["speculative"]), None, costs)
                except AnalyzeError as exc:  # a window too thin to read: said, not skipped silently
                    print(json.dumps({"workload": name, "batch": b, "error": str(exc)}), flush=True)
                    continue
                spec, base = report["modes"]["speculative"], report["modes"]["baseline"]
                row = {
                    "workload": name,
                    "batch": b,
                    "k": result["k"],
                    "expected": result["speedup_by_batch"][b][result["k"]],
                    "measured": report["speedup"][0],
                    "measured_low": report["speedup_bounds"][0][0],
                    "measured_high": report["speedup_bounds"][0][1],
                    "tok_per_s": [base["tok_per_s"][0], spec["tok_per_s"][0]],
                    "acceptance_rate": result["acceptance_rate"],
                    "drafting_share": result["drafting_share"],
                    "tokens_per_pass": result["tokens_per_pass"],
                    "window_pass_ms": result["window_pass_ms"],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    out = {
        "what": "the analyzer's expected speedup (a window of this traffic + probed pass costs) against real batches",
        "cpu": cpu_name(),
        "pass_costs": costs,
        "recorded": time.strftime("%Y-%m-%d"),
        "settings": {"sizes": sizes, "repeats": args.repeats, "max_new_tokens": args.tokens, "temperature": 0.0},
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
