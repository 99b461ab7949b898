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

import torch

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402
from engine.drafters.model import q4_weights  # noqa: E402
from engine.host import cpu_flags, cpu_name  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402
from engine.metrics import _median_interval, draft_token_cost_of, median_of_ratios  # noqa: E402

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

ids = list(range(1000, 1150))
caches = {}
for name, model in models.items():
    cache = caches[name] = model.new_cache(len(ids) + 64)
    model.run_pass(torch.tensor(ids), torch.arange(len(ids)), cache)
times = {name: [] for name in models}
for rep in range(40):
    for name in list(models) if rep % 2 else list(models)[::-1]:
        model, cache = models[name], caches[name]
        start = time.perf_counter()
        for _ in range(3):
            cache.length = len(ids)
            model.greedy_chain(5, cache, 6)
        times[name].append((time.perf_counter() - start) / 18 * 1e3)
report["passes_ms"] = {name: round(statistics.median(t), 3) for name, t in times.items()}
report["passes_ms"]["Q2B over Q4_1B"] = round(
    median_of_ratios([a / b for a, b in zip(times["Q2B"], times["Q4_1B"])]), 3
)


def use(name: str) -> None:
    engine.drafters._weights["q4"] = models[name]


SYSTEMS = ["baseline", "Q4_1B", "Q2B"]
workloads = json.load(open("assets/workloads.json"))
engine.run(workloads["chat"][0], "q4", max_new_tokens=8, k=6)  # the registry's q4 entry exists: swapped below
mismatches = []
report["runs"] = {}
turn = 0
for workload in ("chat", "chat-heldout"):
    runs = {name: [] for name in SYSTEMS}
    for i, prompt in enumerate(workloads[workload]):
        for _rep in range(repeats):
            order = SYSTEMS[turn % 3 :] + SYSTEMS[: turn % 3]
            turn += 1
            outputs = {}
            for name in order:
                if name != "baseline":
                    use(name)
                run = engine.run(prompt, "none" if name == "baseline" else "q4", max_new_tokens=128, k=6)
                steps = [e for e in run["events"] if e["type"] == "step"]
                runs[name].append(
                    {
                        "tok_s": run["metrics"]["tokens_per_s"],
                        "tokens_per_pass": run["metrics"]["tokens_per_pass"],
                        "draft_ms": sum(e["draft_ms"] or 0.0 for e in steps),
                        "drafted": sum(e.get("drafted") or 0 for e in steps),
                        "pass_ms": statistics.mean(e["verify_ms"] for e in steps),
                    }
                )
                outputs[name] = run["token_ids"]
            if any(out != outputs["baseline"] for out in outputs.values()):
                mismatches.append((workload, i))
    base = runs["baseline"]
    base_pass_ms = statistics.mean(r["pass_ms"] for r in base)
    rows = {}
    for name in SYSTEMS:
        rs = runs[name]
        row = {
            "tok_s": round(statistics.median(r["tok_s"] for r in rs), 1),
            "tokens_per_pass": round(statistics.mean(r["tokens_per_pass"] for r in rs), 3),
        }
        if name != "baseline":
            ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)]
            row["over_baseline"] = round(median_of_ratios(ratios), 3)
            row["interval"] = [round(x, 3) for x in (_median_interval(ratios) or ())]
            c = draft_token_cost_of(sum(r["draft_ms"] for r in rs), sum(r["drafted"] for r in rs), base_pass_ms)
            row["c"] = round(c, 3) if c is not None else None
        rows[name] = row
    paired = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["Q2B"], runs["Q4_1B"])]
    rows["Q2B over Q4_1B"] = {
        "median": round(median_of_ratios(paired), 3),
        "interval": [round(x, 3) for x in (_median_interval(paired) or ())],
    }
    rows["baseline_pass_ms"] = round(base_pass_ms, 3)
    report["runs"][workload] = rows
report["greedy_mismatches"] = mismatches

sampled = {name: [] for name in models}
for prompt in workloads["chat"] + workloads["chat-heldout"]:
    for seed in range(seeds):
        for name in models:
            use(name)
            m = engine.run(prompt, "q4", k=6, temperature=0.7, max_new_tokens=128, seed=seed)["metrics"]
            sampled[name].append(m["tokens_per_pass"])
report["sampled_t0.7_tokens_per_pass"] = {name: round(statistics.mean(v), 3) for name, v in sampled.items()}
print(json.dumps(report, indent=1))
