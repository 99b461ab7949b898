"""What the q4 drafter's A/B scripts share (q4_scales_ab.py, q4_head_ab.py): two or more q4 drafters of the
default model measured side by side in one process, against the plain baseline.

- ``chain_pass_ms``: a greedy chain of 6 q4 passes over 150 cached positions per drafter, the drafters
  alternating round by round (ms per pass, one figure per round);
- ``greedy_runs``: the `chat` and `chat-heldout` prompts, REPEATS times each, greedy, K = 6, 128 new tokens: the
  baseline and each drafter one after another (swapped into the engine's q4 entry), the order rotating. Per
  system: median tok/s, tokens per target pass, c (engine.metrics.draft_token_cost_of: drafting ms per drafted
  token over the baseline's mean one-token pass, from the totals of each workload's runs), and the median of
  the runs' paired ratios to the baseline (with its interval); then the second drafter over the first, paired
  run by run. Every run's output is checked against the baseline's.
"""

import json
import statistics
import time

import torch

from engine.metrics import _median_interval, draft_token_cost_of, median_of_ratios


def chain_pass_ms(models: dict, rounds: int = 40) -> dict[str, list[float]]:
    """ms per q4 pass of each drafter, one figure per round (3 chains of 6 passes), the order alternating."""
    ids = list(range(1000, 1150))
    caches = {}
    for name, model in models.items():
        cache = caches[name] = model.new_cache(len(ids) + 64)
        model.run_pass(torch.tensor(ids), torch.arange(len(ids)), cache)
    times = {name: [] for name in models}
    for rep in range(rounds):
        for name in list(models) if rep % 2 else list(models)[::-1]:
            model, cache = models[name], caches[name]
            start = time.perf_counter()
            for _ in range(3):
                cache.length = len(ids)
                model.greedy_chain(5, cache, 6)
            times[name].append((time.perf_counter() - start) / 18 * 1e3)
    return times


def use(engine, model) -> None:
    """Swap `model` in as the engine's q4 drafter's weights (its registry entry exists once q4 has run)."""
    engine.drafters._weights["q4"] = model


def greedy_runs(engine, models: dict, repeats: int) -> tuple[dict, list]:
    """(report rows per workload, [(workload, prompt index)] whose outputs differed from the baseline's)."""
    systems = ["baseline", *models]
    first, second = list(models)[:2]
    workloads = json.load(open("assets/workloads.json"))
    engine.run(workloads["chat"][0], "q4", max_new_tokens=8, k=6)  # the registry's q4 entry exists: swapped below
    mismatches, report, turn = [], {}, 0
    for workload in ("chat", "chat-heldout"):
        runs = {name: [] for name in systems}
        for i, prompt in enumerate(workloads[workload]):
            for _rep in range(repeats):
                order = systems[turn % len(systems) :] + systems[: turn % len(systems)]
                turn += 1
                outputs = {}
                for name in order:
                    if name != "baseline":
                        use(engine, models[name])
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
        for name in systems:
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
        paired = [a["tok_s"] / b["tok_s"] for a, b in zip(runs[second], runs[first])]
        rows[f"{second} over {first}"] = {
            "median": round(median_of_ratios(paired), 3),
            "interval": [round(x, 3) for x in (_median_interval(paired) or ())],
        }
        rows["baseline_pass_ms"] = round(base_pass_ms, 3)
        report[workload] = rows
    return report, mismatches
