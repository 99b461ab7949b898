"""Record the example prompts' measurements and the real traces shipped in assets/.

    .venv/bin/python scripts/record_traces.py [--repeats 3] [--dtype auto]

For every example in assets/examples.json: run it on the default model with its
settings and drafter, and the plain baseline with the same settings, alternating
`--repeats` times; write the median tokens per target pass, acceptance rate α,
tokens/s of both and the measured speedup into the example's ``measured`` entry
(with the CPU, dtype and date, since speed depends on the machine). Some examples'
first runs are also saved as traces in assets/traces/ (the app shows them before a
model loads; the tests use them as fixtures), the first example's baseline as the
recorded Race's opponent, and the Drafters lab's default comparison on the first
example in assets/traces/drafters-lab/ (alone: --drafters-lab-only). With --only LESSON, only that
lesson's examples are measured, and nothing else is written. With --sampled-traces-only, only the
traces of sampled (seeded) runs are recorded again, from their examples' and EXTRA_TRACES' settings (what
a change to the random draws asks for; the greedy traces and every measurement stay as they are).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import SpeculativeEngine  # noqa: E402
from engine import trace as trace_io  # noqa: E402
from engine.metrics import median_of_ratios, paired_ratios  # noqa: E402
from engine.tools.bench_machine import machine_info  # noqa: E402

EXAMPLES = ROOT / "assets" / "examples.json"
TRACES = ROOT / "assets" / "traces"


def _rounded(value: float | None) -> float | None:
    return round(value, 2) if value is not None else None


def measure(engine: SpeculativeEngine, example: dict, repeats: int) -> tuple[dict, list[dict], list[dict]]:
    settings = dict(example["settings"])
    prompt = example["prompt"]
    first_runs = []
    if example.get("then_ask"):  # a two-question lesson: its claim is the second answer's, after the first
        first_runs = [engine.run(prompt, example["drafter"], **settings) for _ in range(repeats)]
        settings["history"] = [engine.run(prompt, "none", **settings)["text"]]
        prompt = example["then_ask"]
    compare = example.get("compare_drafter")
    spec_runs, base_runs, compare_runs = [], [], []
    for _ in range(repeats):  # alternate (the compared drafter too), so machine noise hits them all alike
        spec_runs.append(engine.run(prompt, example["drafter"], **settings))
        base_runs.append(engine.run(prompt, "none", **settings))
        if compare:  # (measured after the rest once: its ratio drifted with the machine, 1.34x at 1.19 tokens a pass)
            compare_runs.append(engine.run(prompt, compare, **settings))
    spec = [r["metrics"] for r in spec_runs]
    base = [r["metrics"] for r in base_runs]
    spec_tps = statistics.median(m["tokens_per_s"] for m in spec)
    base_tps = statistics.median(m["tokens_per_s"] for m in base)
    summary = {
        "tokens_per_pass": round(statistics.median(m["tokens_per_pass"] for m in spec), 2),
        "alpha": round(statistics.median(m["position_acceptance"] for m in spec), 2),
        "acceptance_rate": round(statistics.median(m["acceptance_rate"] for m in spec), 2),
        "tokens_per_s": round(spec_tps, 1),
        "baseline_tokens_per_s": round(base_tps, 1),
        # (each speculative run beside the baseline run right after it: a median of the pairs' ratios)
        "speedup": _rounded(median_of_ratios(paired_ratios(list(zip(base, spec))))),
        "repeats": repeats,
    }
    costs = [m["draft_cost_ratio"] for m in spec if m.get("draft_cost_ratio") is not None]
    if costs:  # c: a draft token's cost in target passes, as this run measured it
        summary["draft_cost_ratio"] = round(statistics.median(costs), 3)
    if first_runs:  # the first question's own run, before anything was remembered
        summary["first_tokens_per_pass"] = round(
            statistics.median(r["metrics"]["tokens_per_pass"] for r in first_runs), 2
        )
    if compare_runs:  # the drafter the example is compared with, same settings
        other = [r["metrics"] for r in compare_runs]
        summary["compare"] = {
            "drafter": compare,
            "tokens_per_pass": round(statistics.median(m["tokens_per_pass"] for m in other), 2),
            # (each beside the baseline run just before it, as the example's own drafter)
            "speedup": _rounded(median_of_ratios(paired_ratios(list(zip(base, other))))),
        }
        other_costs = [m["draft_cost_ratio"] for m in other if m.get("draft_cost_ratio") is not None]
        if other_costs:
            summary["compare"]["draft_cost_ratio"] = round(statistics.median(other_costs), 3)
    return summary, spec_runs[0]["events"], base_runs[0]["events"]


# Traces the app and the tests use: example index -> file name; the first example's baseline is the
# recorded Race's opponent; one sampled n-gram tree that is not an example (point masses with siblings).
EXAMPLE_TRACES = {0: "code-edit-ngram-greedy.json", 4: "chat-int8-tree-sampling.json"}
RACE_BASELINE = "code-edit-baseline-greedy.json"
EXTRA_TRACES = {
    "summarize-ngram-sampling.json": (
        "summarize",
        "ngram",
        {"k": 4, "topk": 2, "max_new_tokens": 48, "temperature": 0.8, "seed": 3},
    )
}


def record_drafters_lab(engine: SpeculativeEngine, prompt: str) -> None:
    """The Drafters lab's defaults on `prompt`, run by the lab's own code (baseline, each drafter and its
    adaptive variant, each after an untimed warm-up): the lab shows these traces until Run all."""
    from app.labs import drafters as lab

    defaults = lab.DEFAULTS
    settings = lab._settings({"greedy": defaults["greedy"], "k": defaults["k"], "max_new": defaults["max_new"]})
    plan, notes = lab.plan_runs(engine, [d for d in defaults["drafters"] if d != lab.BASELINE])
    traces, failures = {}, {}
    for _status, traces, failures in lab.compare(engine, prompt, plan, settings):  # noqa: B007 (the last yield)
        pass
    if failures or len(traces) != len(plan):
        raise SystemExit(f"drafters lab: runs failed ({failures}); notes: {notes}")
    folder = lab.RECORDED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    for index, (label, events) in enumerate(traces.items()):
        trace_io.save(events, folder / f"{index:02d}.json")
        print(f"drafters lab: {label} -> {folder.name}/{index:02d}.json", flush=True)


def record_sampled_traces(engine: SpeculativeEngine) -> None:
    """The shipped traces whose runs sample (temperature > 0), run again with their recorded settings."""
    examples = json.loads(EXAMPLES.read_text(encoding="utf-8"))
    for index, name in EXAMPLE_TRACES.items():
        example = examples[index]
        if example["settings"].get("temperature", 0.0) > 0:
            trace_io.save(
                engine.run(example["prompt"], example["drafter"], **example["settings"])["events"], TRACES / name
            )
            print(f"recorded {name}", flush=True)
    workloads = json.loads((ROOT / "assets" / "workloads.json").read_text(encoding="utf-8"))
    for name, (workload, drafter, settings) in EXTRA_TRACES.items():
        if settings.get("temperature", 0.0) > 0:
            trace_io.save(engine.run(workloads[workload][0], drafter, **settings)["events"], TRACES / name)
            print(f"recorded {name}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafters-lab-only", action="store_true", help="record only the Drafters lab's run")
    parser.add_argument(
        "--only", metavar="LESSON", help="measure only the examples of this lesson (e.g. does-not-pay); no traces"
    )
    parser.add_argument(
        "--sampled-traces-only", action="store_true", help="record again only the traces of sampled runs"
    )
    args = parser.parse_args()
    engine = SpeculativeEngine.load(dtype=args.dtype)
    if args.sampled_traces_only:
        record_sampled_traces(engine)
        return 0
    if args.drafters_lab_only:
        record_drafters_lab(engine, json.loads(EXAMPLES.read_text(encoding="utf-8"))[0]["prompt"])
        return 0
    machine = machine_info(engine)
    examples = json.loads(EXAMPLES.read_text(encoding="utf-8"))
    TRACES.mkdir(parents=True, exist_ok=True)
    for index, example in enumerate(examples):
        if args.only and example.get("lesson") != args.only:
            continue
        engine.run(example["prompt"], example["drafter"], max_new_tokens=4)  # build and warm the drafter
        measured, events, baseline = measure(engine, example, args.repeats)
        measured.update(cpu=machine["cpu"], threads=machine["threads"], dtype=machine["dtype"])
        measured["recorded"] = time.strftime("%Y-%m-%d")
        example["measured"] = measured
        if args.only:
            print(f"{example['name']}: {json.dumps(measured)}", flush=True)
            continue
        if index in EXAMPLE_TRACES:
            trace_io.save(events, TRACES / EXAMPLE_TRACES[index])
        if index == 0:
            trace_io.save(baseline, TRACES / RACE_BASELINE)
        print(f"{example['name']}: {json.dumps(measured)}", flush=True)
    if args.only:
        EXAMPLES.write_text(json.dumps(examples, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return 0
    workloads = json.loads((ROOT / "assets" / "workloads.json").read_text(encoding="utf-8"))
    for name, (workload, drafter, settings) in EXTRA_TRACES.items():
        trace_io.save(engine.run(workloads[workload][0], drafter, **settings)["events"], TRACES / name)
    EXAMPLES.write_text(json.dumps(examples, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    record_drafters_lab(engine, examples[0]["prompt"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
