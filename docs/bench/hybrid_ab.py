"""The hybrid drafter (suffix/q4) beside the drafters it picks between, greedy, in rotating order in one process.

    .venv/bin/python docs/bench/hybrid_ab.py [REPEATS] > report.json      (from the repository's root)

Every workload's prompts (assets/workloads.json), 128 new tokens, REPEATS times each (default 3); each prompt's
runs of every system one after another, the order rotating. The suffix drafters remember the system's own
answers to the workload's earlier prompts, as the bench's engine-suffix row does. Systems: the baseline,
engine-suffix (K = 15), engine-q4 (K = 6), engine-q4-multilevel (q4+ngram, K = 6) and engine-q4-hybrid
(suffix/q4:6, K = 15). Per workload and system: median tok/s, tokens per target pass, the median of the runs'
paired ratios to the baseline (with its interval, engine.metrics); for the hybrid, its passes by pick (suffix,
q4, or a bridge: q4's tokens then suffix's; how many, tokens committed per pass, ms per committed token from the
step events' draft_ms + verify_ms).
Every run's output is checked against the baseline's. Prints one JSON object.
"""

import json
import statistics
import sys

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402
from engine.host import cpu_flags, cpu_name  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402
from engine.metrics import _median_interval, median_of_ratios  # noqa: E402

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SYSTEMS = [("none", 1), ("suffix", 15), ("q4", 6), ("q4+ngram", 6), ("suffix/q4:6", 15)]
engine = SpeculativeEngine.load()
workloads = json.load(open("assets/workloads.json"))
engine.run(workloads["chat"][0], "q4", max_new_tokens=8, k=6)  # build the drafter, warm up
runs: dict = {}
picks: dict = {}
mismatches = []
turn = 0
for workload, prompts in workloads.items():
    answers: dict = {}
    for i, prompt in enumerate(prompts):
        for _rep in range(repeats):
            order = SYSTEMS[turn % len(SYSTEMS) :] + SYSTEMS[: turn % len(SYSTEMS)]
            turn += 1
            outputs = {}
            for spec, k in order:
                history = tuple(answers[(spec, j)] for j in range(i)) if spec.startswith("suffix") else ()
                run = engine.run(prompt, spec, max_new_tokens=128, k=k, history=history)
                answers[(spec, i)] = outputs[spec] = run["token_ids"]
                metrics = run["metrics"]
                runs.setdefault((workload, spec), []).append((metrics["tokens_per_s"], metrics["tokens_per_pass"]))
                for step in (e for e in run["events"] if e["type"] == "step" and e["draft"].get("hybrid")):
                    pick = step["draft"]["hybrid"]
                    kind = "bridge" if pick["continued"] else pick["picked"]
                    tally = picks.setdefault((workload, kind), [0, 0, 0.0])
                    tally[0] += 1
                    tally[1] += len(step["emitted"])
                    tally[2] += step["draft_ms"] + step["verify_ms"]
            if any(out != outputs["none"] for out in outputs.values()):
                mismatches.append((workload, i))
report = {
    "cpu": cpu_name(),
    "flags": sorted(set(cpu_flags() or ()) & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}),
    "kernel": cpu_kernels.variant(),
    "repeats": repeats,
    "greedy_mismatches": mismatches,
    "workloads": {},
}
for workload in workloads:
    base = [tok_s for tok_s, _ in runs[(workload, "none")]]
    rows = {}
    for spec, k in SYSTEMS:
        tok_s = [t for t, _ in runs[(workload, spec)]]
        ratios = [a / b for a, b in zip(tok_s, base)]
        rows[f"{spec} (K = {k})"] = {
            "tok_s_median": round(statistics.median(tok_s), 1),
            "tokens_per_pass": round(statistics.mean(tpp for _, tpp in runs[(workload, spec)]), 2),
            "over_baseline": round(median_of_ratios(ratios), 3),
            "interval": [round(x, 3) for x in (_median_interval(ratios) or ())],
        }
    rows["hybrid passes by pick"] = {
        picked: {"passes": n, "tokens_per_pass": round(tokens / n, 2), "ms_per_token": round(ms / tokens, 2)}
        for (w, picked), (n, tokens, ms) in picks.items()
        if w == workload
    }
    report["workloads"][workload] = rows
print(json.dumps(report, indent=1))
