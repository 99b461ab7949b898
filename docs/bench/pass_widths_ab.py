"""Target passes of 1-8 tokens on two builds of the CPU kernels, alternating in one process.

    .venv/bin/python docs/bench/pass_widths_ab.py "-DSTREAM_ROWS_bf16=1 -DSTREAM_ROWS_q4=1" [pairs] [widths] [quick]

The first argument adds compiler flags to this host's variant for the "old" build (here: STREAM_ROWS as it was
before 2026-12-06); the "new" build is the variant as it is. Each pair times, on each build (the order
alternating), passes of each width over 150 cached positions (the last row projected, as a verification's
first rows are), 5 of each. A pass's time moves with the host's memory speed at the moment, so besides every
pair the pairs whose one-token pass on the new build took less than `quick` ms (default 7.5) are summarised
apart: what a quick stretch shows. Prints one JSON object; ratios are old over new (> 1: new quicker).
"""

import dataclasses
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402

flags = tuple(sys.argv[1].split()) if len(sys.argv) > 1 else ()
pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 40
widths = [int(w) for w in (sys.argv[3] if len(sys.argv) > 3 else "1,2,3,4,5,6,7").split(",")]
quick = float(sys.argv[4]) if len(sys.argv) > 4 else 7.5
base = cpu_kernels.VARIANTS[cpu_kernels.variant()]
cpu_kernels.VARIANTS["old"] = dataclasses.replace(base, name="old", cflags=base.cflags + flags)
cpu_kernels.VARIANTS["new"] = dataclasses.replace(base, name="new")
engine = SpeculativeEngine.load()
model = engine.target.model
context = 150
ids = list(range(1000, 1000 + context))
times = {build: {w: [] for w in widths} for build in ("old", "new")}
for pair in range(pairs):
    for build in ("old", "new") if pair % 2 else ("new", "old"):
        with cpu_kernels.using(build):
            cache = model.new_cache(context + 16)
            model.run_pass(torch.tensor(ids), torch.arange(context), cache)
            for w in widths:
                start = time.perf_counter()
                for _ in range(5):
                    cache.length = context
                    model.run_pass(
                        torch.tensor([5] * w),
                        torch.arange(context, context + w),
                        cache,
                        logits_rows=torch.tensor([w - 1]),
                    )
                times[build][w].append((time.perf_counter() - start) / 5 * 1e3)


def summary(keep):
    out = {}
    for w in widths:
        old, new = [times["old"][w][i] for i in keep], [times["new"][w][i] for i in keep]
        out[w] = {
            "old_ms": round(statistics.median(old), 3),
            "new_ms": round(statistics.median(new), 3),
            "old over new": round(statistics.median([a / b for a, b in zip(old, new)]), 3),
        }
    return out


report = {"variant": base.name, "old_flags": list(flags), "pairs": pairs, "all": summary(range(pairs))}
fast = [i for i in range(pairs) if times["new"][widths[0]][i] < quick]
report[f"quick (one-token pass under {quick} ms): {len(fast)} pairs"] = summary(fast) if fast else None
print(json.dumps(report, indent=1))
