"""The q4 drafter's output projection in Q2B (2-bit, the best 256 re-scored in int8) against Q4_1B (4-bit, the
best 32 re-scored), in one process.

    .venv/bin/python docs/bench/q4_head_ab.py [REPEATS] [SEEDS] > report.json      (from the repository's root)

Two q4 drafters of the default model side by side, the same layers (the GGUF's nibbles in Q4_1B blocks) and
two heads (engine/drafters/model.py's q4_weights with head_packing PackedQ4_1BWeight and top 32, or
PackedQ2BWeight and top 256, its other outputs -inf):
- passes: a greedy chain of 6 q4 passes over 150 cached positions, the two alternating, 40 rounds (ms per
  pass, medians, and the median of the rounds' ratios);
- head: the head's product alone on one row (x from the default model's embedding: cache-warm, so only the
  arithmetic; in a pass the head's bytes come from memory);
- greedy runs: the `chat` and `chat-heldout` prompts, REPEATS times each (default 2), K = 6, 128 new tokens:
  the baseline and the two drafters one after another, the order rotating. Per system: median tok/s, tokens
  per target pass, c (engine.metrics.draft_token_cost_of: drafting ms per drafted token over the baseline's
  mean one-token pass, from the totals of each workload's runs), and the median of the runs' paired ratios to
  the baseline (with its interval); then Q2B over Q4_1B, paired run by run. Every run's output is checked
  against the baseline's;
- sampled runs (temperature 0.7, SEEDS seeds per prompt, default 1): the two drafters' tokens per target pass
  on the same prompts and seeds (the 2-bit head moves q's tail: what it costs in acceptance).
Prints one JSON object.
"""

import json
import statistics
import sys
import time

sys.path.insert(0, ".")
sys.path.insert(0, "docs/bench")
from _q4_ab import chain_pass_ms, greedy_runs, use  # noqa: E402

from engine import SpeculativeEngine  # noqa: E402
from engine.drafters.model import q4_weights  # noqa: E402
from engine.host import cpu_flags, cpu_name  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402
from engine.metrics import median_of_ratios  # noqa: E402

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 2
seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
engine = SpeculativeEngine.load()
source = engine.target.source
gguf = source.get("file") if source.get("kind") == "gguf-package" else None
target = engine.target.model
heads = {"Q4_1B": (cpu_kernels.PackedQ4_1BWeight, 32), "Q2B": (cpu_kernels.PackedQ2BWeight, 256)}
models = {
    name: q4_weights(target, gguf, cpu_kernels.PackedQ4_1BWeight, packing, top)
    for name, (packing, top) in heads.items()
}
report = {
    "cpu": cpu_name(),
    "flags": sorted(set(cpu_flags() or ()) & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}),
    "kernel": cpu_kernels.variant(),
    "heads": {name: {"packing": p.__name__, "top": top} for name, (p, top) in heads.items()},
    "weight_bytes": {
        name: sum(getattr(layer, attr).nbytes for layer in model.layers for attr in ("qkv", "o", "gate_up", "down"))
        + model.lm_head.nbytes
        for name, model in models.items()
    },
    "head_bytes": {name: model.lm_head.nbytes for name, model in models.items()},
}

x = target.lm_head.weight[1000:1001].float().contiguous() if hasattr(target.lm_head, "weight") else None
if x is not None:
    head_ms = {name: [] for name in models}
    for rep in range(200):
        for name in list(models) if rep % 2 else list(models)[::-1]:
            start = time.perf_counter()
            for _ in range(5):
                models[name].lm_head(x)
            head_ms[name].append((time.perf_counter() - start) / 5 * 1e3)
    report["head_ms_cache_warm"] = {name: round(statistics.median(t), 4) for name, t in head_ms.items()}

times = chain_pass_ms(models)
report["passes_ms"] = {name: round(statistics.median(t), 3) for name, t in times.items()}
report["passes_ms"]["Q2B over Q4_1B"] = round(
    median_of_ratios([a / b for a, b in zip(times["Q2B"], times["Q4_1B"])]), 3
)
report["runs"], report["greedy_mismatches"] = greedy_runs(engine, models, repeats)

workloads = json.load(open("assets/workloads.json"))
sampled = {name: [] for name in models}
for prompt in workloads["chat"] + workloads["chat-heldout"]:
    for seed in range(seeds):
        for name in models:
            use(engine, models[name])
            m = engine.run(prompt, "q4", k=6, temperature=0.7, max_new_tokens=128, seed=seed)["metrics"]
            sampled[name].append(m["tokens_per_pass"])
report["sampled_t0.7_tokens_per_pass"] = {name: round(statistics.mean(v), 3) for name, v in sampled.items()}
print(json.dumps(report, indent=1))
