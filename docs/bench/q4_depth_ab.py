"""The q4 drafter at several fixed depths K, greedy, in rotating order in one process.

    .venv/bin/python docs/bench/q4_depth_ab.py 6,8,10      (from the repository's root)

The 9 `chat` and `chat-heldout` prompts, 128 new tokens, twice each; each prompt's runs at every K one after
another, the order rotating. Per K: mean tokens per target pass, median tok/s, and tok/s over the first K's (the
median of the runs' ratios with its interval, engine.metrics). Prints one JSON object.
"""

import json
import statistics
import sys

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402
from engine.metrics import _median_interval, median_of_ratios  # noqa: E402

ks = [int(k) for k in (sys.argv[1] if len(sys.argv) > 1 else "6,8,10").split(",")]
engine = SpeculativeEngine.load()
workloads = json.load(open("assets/workloads.json"))
prompts = workloads["chat"] + workloads["chat-heldout"]
engine.run(prompts[0], "q4", max_new_tokens=8, k=max(ks))  # build the drafter, warm up
runs = {k: {"tok_s": [], "tokens_per_pass": []} for k in ks}
turn = 0
for _rep in range(2):
    for prompt in prompts:
        for k in ks[turn % len(ks) :] + ks[: turn % len(ks)]:
            metrics = engine.run(prompt, "q4", max_new_tokens=128, k=k)["metrics"]
            runs[k]["tok_s"].append(metrics["tokens_per_s"])
            runs[k]["tokens_per_pass"].append(metrics["tokens_per_pass"])
        turn += 1
report = {}
for k in ks:
    ratios = [a / b for a, b in zip(runs[k]["tok_s"], runs[ks[0]]["tok_s"])]
    report[f"K={k}"] = {
        "tokens_per_pass": round(statistics.mean(runs[k]["tokens_per_pass"]), 3),
        "tok_s_median": round(statistics.median(runs[k]["tok_s"]), 1),
        f"over K={ks[0]}": round(median_of_ratios(ratios), 3),
        "interval": [round(x, 3) for x in (_median_interval(ratios) or ())],
    }
print(json.dumps(report, indent=1))
