"""Where the time of a decode goes on this device: per-pass spread of real runs.

Run by scripts/gpu_check.sh (also works on CPU: `python scripts/gpu_timing_spread.py --device cpu`).
The first GPU check (docs/bench/) showed rows of the same configuration running 1x or 5x slower
in one bench (e.g. engine-baseline at 78 ms per token while a bare pass took 13 ms, and hf-generate
alike), so this prints, for a few back-to-back runs of the same request, the wall time, the sum
of the step times the engine measured (draft + verify), the time outside them (prefill, events,
tokenizer), and the median / 90th percentile / max of the verify step, then the same percentiles
for bare one-token passes timed with a host clock after a device synchronize."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: engine/


def percentiles(values: list[float]) -> str:
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    return f"median {statistics.median(values):6.1f}  p90 {p90:6.1f}  max {values[-1]:6.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    from engine import GenerationSettings, SpeculativeEngine, load_model
    from engine.model.pass_timing import _PassBench

    engine = SpeculativeEngine(load_model(device=args.device))
    print(f"device {engine.target.model.device}, dtype {engine.target.model.dtype}")
    sync = torch.cuda.synchronize if torch.cuda.is_available() and args.device != "cpu" else (lambda: None)
    ids = engine.encode_prompt("Write a Python function that returns the squares of a list of numbers.")
    for drafter, kw in (("none", {}), ("ngram", {"k": 15}), ("ngram", {"k": 15, "adaptive": True})):
        label = drafter + (" adaptive" if kw.get("adaptive") else "")
        settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0.0, seed=0, **kw)
        for run in range(args.runs):
            t0 = time.perf_counter()
            steps, finish = [], None
            for event in engine.generate(ids, drafter, settings):
                if event.get("type") == "step":
                    steps.append(event)
                finish = event
            sync()
            wall = 1000.0 * (time.perf_counter() - t0)
            inside = sum(s["draft_ms"] + s["verify_ms"] for s in steps)
            n = finish["metrics"]["new_tokens"]
            print(
                f"{label:15s} run {run}: {n} tokens in {wall:7.1f} ms ({1000 * n / wall:6.1f} tok/s), "
                f"steps {inside:7.1f} ms, outside {wall - inside:6.1f} ms; verify per pass: "
                + percentiles([s["verify_ms"] for s in steps])
            )
    bench = _PassBench(engine.target.model, 1, 1, 64)
    times = [bench() for _ in range(100)]
    print(f"bare 1-token pass x100: {percentiles(times)}")


if __name__ == "__main__":
    main()
