"""The adaptive policy's pass prices: the run's own verifications (now) against the calibration alone (before).

    .venv/bin/python docs/bench/adaptive_costs_ab.py [repeats]     (from the repository's root)

Greedy, q4, K <= 6, 128 new tokens, the 9 `chat` and `chat-heldout` prompts. Three runs per prompt and repeat,
the order rotating: the fixed K = 6, `--adaptive` as it is (AdaptiveDepth.pass_cost: a width the run ran priced by
its own verify_ms) and `--adaptive` priced by the calibration alone (the previous pricing: pass_ms of the width
plus the step's overhead; a plain pass the one-token cost plus the step's overhead; the rest of the policy as it is). Twice: with this process's own
calibration, and with the calibration recorded on the AVX2 proxy that made runs draft 3-4 levels ([6.7, 9.5, 10.0,
13.0, 19.3, 17.1, 19.8] ms for 1-7 tokens) given to both policies. Per setting: tok/s over the fixed K = 6's (the
median of the runs' ratios with its interval, engine.metrics) and the mean tokens per target pass. Prints one JSON
object.
"""

import json
import sys

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402
from engine.drafters.adaptive import AdaptiveDepth  # noqa: E402
from engine.host import cpu_flags, cpu_name  # noqa: E402
from engine.metrics import _median_interval, median_of_ratios  # noqa: E402

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 2
RECORDED = [6.7, 9.5, 10.0, 13.0, 19.3, 17.1, 19.8]  # the AVX2 proxy's overstated calibration (2026-12-06)
engine = SpeculativeEngine.load()
workloads = json.load(open("assets/workloads.json"))
prompts = workloads["chat"] + workloads["chat-heldout"]
own_price = AdaptiveDepth.pass_cost


def calibration_price(policy, width):
    """The previous policy's price of a width: the calibration plus the step's overhead, whatever the run saw."""
    return policy.pass_ms[width - 1] + policy.step_overhead_ms


settings = {"fixed K=6": False, "adaptive (own record)": own_price, "adaptive (calibration alone)": calibration_price}
real_weighed = engine.costs.weighed_pass_ms
flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx")))
report = {"host": cpu_name(), "cpu_flags": flags, "repeats": repeats}
engine.run(prompts[0], "q4", max_new_tokens=8, k=6, adaptive=True)  # build the drafter, calibrate, warm up
for calibration in ("this process's", "recorded (AVX2 proxy)"):
    if calibration.startswith("recorded"):
        engine.costs.weighed_pass_ms = lambda *a, **kw: list(RECORDED)  # what every adaptive run is given
    runs = {name: {"tok_s": [], "tokens_per_pass": []} for name in settings}
    pass_ms = None
    turn = 0
    for _rep in range(repeats):
        for prompt in prompts:
            names = list(settings)
            names = names[turn % 3 :] + names[: turn % 3]
            turn += 1
            for name in names:
                price = settings[name]
                if price:
                    AdaptiveDepth.pass_cost = price
                run = engine.run(prompt, "q4", max_new_tokens=128, k=6, adaptive=bool(price))
                AdaptiveDepth.pass_cost = own_price
                if price:
                    pass_ms = run["events"][0]["adaptive"]["pass_ms"]
                runs[name]["tok_s"].append(run["metrics"]["tokens_per_s"])
                runs[name]["tokens_per_pass"].append(run["metrics"]["tokens_per_pass"])
    section = {"pass_ms": pass_ms}
    fixed = runs["fixed K=6"]["tok_s"]
    for name, got in runs.items():
        ratios = [a / b for a, b in zip(got["tok_s"], fixed)]
        section[name] = {
            "tokens_per_pass": round(sum(got["tokens_per_pass"]) / len(got["tokens_per_pass"]), 3),
            "tok_s_median": round(sorted(got["tok_s"])[len(got["tok_s"]) // 2], 1),
            "over fixed K=6": round(median_of_ratios(ratios), 3),
            "interval": [round(x, 3) for x in (_median_interval(ratios) or ())],
        }
    report[calibration] = section
    print(json.dumps({calibration: section}), file=sys.stderr, flush=True)
engine.costs.weighed_pass_ms = real_weighed
print(json.dumps(report, indent=1))
