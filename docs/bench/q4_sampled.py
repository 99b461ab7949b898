"""Sampled chat (temperature 0.7) with the q4 drafter against the plain baseline, in alternating pairs.

The benchmark (python -m engine bench) decodes greedily; #39 also asks for T = 0.7. For each chat prompt
(the `chat` and `chat-heldout` workloads) and each seed, one plain run and one run per drafter setting,
the order alternating from pair to pair; a pair's ratio is the drafter run's tok/s over the plain run's,
and the verdict is the median of the pairs' ratios with its interval (engine.metrics: median_of_ratios and
the interval the Race uses). Prints one JSON object; the markdown beside it in docs/bench/ was written from it.

    .venv/bin/python docs/bench/q4_sampled.py [seeds]     (from the repository's root)
"""

import json
import sys

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402
from engine.host import cpu_flags, cpu_name  # noqa: E402
from engine.metrics import _median_interval, median, median_of_ratios  # noqa: E402

seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
engine = SpeculativeEngine.load()
workloads = json.load(open("assets/workloads.json"))
prompts = workloads["chat"] + workloads["chat-heldout"]
settings = {"temperature": 0.7, "max_new_tokens": 128}
runs = {"q4 K=6": ("q4", {"k": 6}), "q4 K=6 block": ("q4", {"k": 6, "verify": "block"})}
for drafter, extra in runs.values():  # build the drafters, warm the kernels
    engine.run(prompts[0], drafter, **{**settings, **extra, "max_new_tokens": 8})
ratios: dict[str, list[float]] = {name: [] for name in runs}
per_pass: dict[str, list[float]] = {name: [] for name in runs}
pair = 0
for prompt in prompts:
    for seed in range(seeds):
        for name, (drafter, extra) in runs.items():
            order = [("none", {}), (drafter, extra)]
            if pair % 2:
                order.reverse()
            pair += 1
            result = {}
            for spec, kw in order:
                m = engine.run(prompt, spec, **settings, **kw, seed=seed)["metrics"]
                result[spec] = m
            ratios[name].append(result[drafter]["tokens_per_s"] / result["none"]["tokens_per_s"])
            per_pass[name].append(result[drafter]["tokens_per_pass"])
flags = sorted(f for f in (cpu_flags() or ()) if f.startswith(("avx", "amx", "fma", "f16c")))
report = {
    "cpu": cpu_name(),
    "flags": flags,
    "settings": settings,
    "pairs": pair // len(runs),
    "rows": {
        name: {
            "median_speedup": round(median_of_ratios(ratios[name]), 3),
            "interval": [round(x, 3) for x in (_median_interval(ratios[name]) or ())],
            "tokens_per_pass": round(median(per_pass[name]), 2),
        }
        for name in runs
    },
}
print(json.dumps(report, indent=1))
