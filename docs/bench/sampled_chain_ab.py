"""Sampled chains in one C call, measured against what they replace (T = 0.7, K = 6, 128 tokens), in one process.

    .venv/bin/python docs/bench/sampled_chain_ab.py chain [seeds]   q4's sampled chain in C against its
                                                                    pass-by-pass loop (greedy_chain_ready off)
    .venv/bin/python docs/bench/sampled_chain_ab.py dry [seeds]     q4+ngram's dry stretches chained in C
                                                                    against one round per token, and against q4

For each chat prompt (the `chat` and `chat-heldout` workloads) and seed, one run per setting, the order
alternating from prompt to prompt; a pair's ratio is one setting's tok/s over the other's, the verdict the
median of the pairs' ratios with its interval (engine.metrics). Prints one JSON object.
"""

import json
import statistics
import sys

sys.path.insert(0, ".")
import engine.drafters.multilevel as multilevel  # noqa: E402
from engine import SpeculativeEngine  # noqa: E402
from engine.metrics import _median_interval, median_of_ratios  # noqa: E402
from engine.model.transformer import Transformer  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "chain"
seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine = SpeculativeEngine.load()
workloads = json.load(open("assets/workloads.json"))
prompts = workloads["chat"] + workloads["chat-heldout"]
settings = {"temperature": 0.7, "max_new_tokens": 128, "k": 6}
ready = Transformer.greedy_chain_ready
loop_only = lambda self, cache: False  # noqa: E731
dry_rounds = multilevel.DRY_ROUNDS
# name: (drafter, greedy_chain_ready, DRY_ROUNDS)
setups = {
    "chain": {"chain": ("q4", ready, dry_rounds), "loop": ("q4", loop_only, dry_rounds)},
    "dry": {
        "dry chains": ("q4+ngram", ready, dry_rounds),
        "rounds": ("q4+ngram", ready, 10**9),
        "q4": ("q4", ready, dry_rounds),
    },
}[mode]
names = list(setups)
engine.run(prompts[0], setups[names[0]][0], **{**settings, "max_new_tokens": 8})
tok_s = {name: [] for name in names}
draft_ms = {name: [] for name in names}
for i, prompt in enumerate(prompts * seeds):
    seed = i // len(prompts)
    for name in names if i % 2 else reversed(names):
        drafter, Transformer.greedy_chain_ready, multilevel.DRY_ROUNDS = setups[name]
        run = engine.run(prompt, drafter, **settings, seed=seed)
        steps = [e for e in run["events"] if e["type"] == "step"]
        passes = sum((e.get("draft") or {}).get("model_passes") or 0 for e in steps)
        tok_s[name].append(run["metrics"]["tokens_per_s"])
        draft_ms[name].append(sum(e["draft_ms"] for e in steps) / max(1, passes))
Transformer.greedy_chain_ready, multilevel.DRY_ROUNDS = ready, dry_rounds
first = names[0]
report = {"mode": mode, "settings": settings, "pairs": len(tok_s[first]), "draft_ms_per_drafter_pass": {}}
for name in names:
    report["draft_ms_per_drafter_pass"][name] = round(statistics.median(draft_ms[name]), 3)
for name in names[1:]:
    ratios = [a / b for a, b in zip(tok_s[first], tok_s[name])]
    report[f"{first} over {name}"] = {
        "median": round(median_of_ratios(ratios), 3),
        "interval": [round(x, 3) for x in (_median_interval(ratios) or ())],
    }
print(json.dumps(report, indent=1))
