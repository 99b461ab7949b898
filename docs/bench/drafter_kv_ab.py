"""The q4 drafter's KV cache in bf16 against float32, in one process (greedy, K = 6, 128 tokens).

    .venv/bin/python docs/bench/drafter_kv_ab.py [repeats]

Two measurements, each alternating the two caches:
- passes: a greedy chain of 6 q4 passes over 30, 150 and 300 cached positions (ms per pass, medians);
- runs: the 9 `chat` and `chat-heldout` prompts, one run per cache each, the order alternating from prompt to
  prompt: tok/s (the median of the pairs' ratios with its interval, engine.metrics), tokens per target pass and
  ms per draft pass.
The target's cache stays float32 either way; the drafter's `attention_dtype` picks its own. Prints one JSON object.
"""

import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402
from engine.metrics import _median_interval, median_of_ratios  # noqa: E402

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 2
engine = SpeculativeEngine.load()
model = engine.drafter("q4").model  # the registry's q4 model: every q4 drafter of this engine runs it
kinds = {"float32": torch.float32, "bf16": torch.bfloat16}
report = {"passes_ms": {}, "runs": {}}

ids = list(range(1000, 1300))
caches = {}
for name, dtype in kinds.items():
    model.attention_dtype = dtype
    for length in (30, 150, 300):
        cache = caches[(name, length)] = model.new_cache(length + 64)
        model.run_pass(torch.tensor(ids[:length]), torch.arange(length), cache)
times = {key: [] for key in caches}
for rep in range(30):
    for key in list(caches) if rep % 2 else list(caches)[::-1]:
        cache, length = caches[key], key[1]
        start = time.perf_counter()
        for _ in range(3):
            cache.length = length
            model.greedy_chain(5, cache, 6)
        times[key].append((time.perf_counter() - start) / 18 * 1e3)
for length in (30, 150, 300):
    f32, b16 = times[("float32", length)], times[("bf16", length)]
    report["passes_ms"][length] = {
        "float32": round(statistics.median(f32), 3),
        "bf16": round(statistics.median(b16), 3),
        "float32 over bf16": round(statistics.median([a / b for a, b in zip(f32, b16)]), 3),
    }

workloads = json.load(open("assets/workloads.json"))
prompts = workloads["chat"] + workloads["chat-heldout"]
engine.run(prompts[0], "q4", max_new_tokens=8, k=6)
runs = {name: {"tok_s": [], "tokens_per_pass": [], "draft_ms": []} for name in kinds}
for rep in range(repeats):
    for i, prompt in enumerate(prompts):
        for name in list(kinds) if (i + rep) % 2 else list(kinds)[::-1]:
            model.attention_dtype = kinds[name]
            run = engine.run(prompt, "q4", max_new_tokens=128, k=6)
            steps = [e for e in run["events"] if e["type"] == "step"]
            passes = sum((e.get("draft") or {}).get("model_passes") or 0 for e in steps)
            runs[name]["tok_s"].append(run["metrics"]["tokens_per_s"])
            runs[name]["tokens_per_pass"].append(run["metrics"]["tokens_per_pass"])
            runs[name]["draft_ms"].append(sum(e["draft_ms"] for e in steps) / max(1, passes))
model.attention_dtype = torch.bfloat16
ratios = [a / b for a, b in zip(runs["bf16"]["tok_s"], runs["float32"]["tok_s"])]
for name in kinds:
    report["runs"][name] = {
        "tokens_per_pass": round(statistics.mean(runs[name]["tokens_per_pass"]), 3),
        "draft_ms_per_pass": round(statistics.median(runs[name]["draft_ms"]), 3),
    }
report["runs"]["bf16 over float32 tok/s"] = {
    "pairs": len(ratios),
    "median": round(median_of_ratios(ratios), 3),
    "interval": [round(x, 3) for x in (_median_interval(ratios) or ())],
}
print(json.dumps(report, indent=1))
