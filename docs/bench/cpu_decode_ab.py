"""A/B timing of the CPU decode path between two checkouts (#37's "no slower than today").

Run it from a checkout's root; it imports that checkout's engine and prints one JSON line: for each case the
median tok/s of `repeats` runs, and the last run's mean target pass ms, mean draft ms and tokens per pass.
Alternate two checkouts in one session and compare ratios, e.g.:

    git worktree add /tmp/base <commit>
    for r in 1 2; do for d in /tmp/base .; do (cd $d && python /path/to/cpu_decode_ab.py 3); done; done
"""

import json
import statistics
import sys

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
engine = SpeculativeEngine.load()
workloads = json.load(open("assets/workloads.json"))
chat, code = workloads["chat"][0], workloads["code-edit"][0]
cases = {
    "baseline-greedy": (chat, "none", dict(max_new_tokens=96)),
    "ngram-greedy-code": (code, "ngram", dict(max_new_tokens=96, k=8)),
    "int8-greedy-chat": (chat, "int8", dict(max_new_tokens=96, k=4)),
    "int8-T0.7-chat": (chat, "int8", dict(max_new_tokens=96, k=4, temperature=0.7, seed=1)),
    "int8-tree-T0.8": (chat, "int8", dict(max_new_tokens=64, k=3, topk=2, num_draft_tokens=6, temperature=0.8, seed=1)),
}
for prompt, drafter, settings in cases.values():  # build the drafters, warm the kernels
    engine.run(prompt, drafter, **{**settings, "max_new_tokens": 8})
out = {}
for name, (prompt, drafter, settings) in cases.items():
    rates = []
    for _ in range(repeats):
        m = engine.run(prompt, drafter, **settings)["metrics"]
        rates.append(m["new_tokens"] / m["wall_s"])
    out[name] = {
        "tok_s": round(statistics.median(rates), 1),
        "verify_ms": round(m["mean_verify_ms"], 2),
        "draft_ms": round(m["mean_draft_ms"], 2),
        "tokens_per_pass": round(m["tokens_per_pass"], 2),
    }
print(json.dumps(out))
