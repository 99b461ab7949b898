"""The q4 drafter on Q4_1B blocks (scales in bytes) against Q4_1's (float16 scales), in one process.

    .venv/bin/python docs/bench/q4_scales_ab.py [REPEATS] > report.json      (from the repository's root)

Two q4 drafters of the default model side by side, the same nibbles (the GGUF's) packed both ways
(engine/drafters/model.py's q4_weights with PackedQ4_1Weight or PackedQ4_1BWeight):
- passes: a greedy chain of 6 q4 passes over 150 cached positions, the two alternating (ms per pass, medians);
- runs: the `chat` and `chat-heldout` prompts, REPEATS times each (default 2), greedy, K = 6, 128 new tokens:
  the baseline, q4 on Q4_1 and q4 on Q4_1B one after another, the order rotating. Per system: median tok/s,
  tokens per target pass, c (engine.metrics.draft_token_cost_of: drafting ms per drafted token over the
  baseline's mean one-token pass, from the totals of each workload's runs), and the median of the runs'
  paired ratios to the baseline (with its interval). Every run's output is checked against the baseline's.
Prints one JSON object.
"""

import json
import statistics
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "docs/bench")
from _q4_ab import chain_pass_ms, greedy_runs  # noqa: E402

from engine import SpeculativeEngine  # noqa: E402
from engine.drafters.model import q4_weights  # noqa: E402
from engine.host import cpu_flags, cpu_name  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 2
engine = SpeculativeEngine.load()
source = engine.target.source
gguf = source.get("file") if source.get("kind") == "gguf-package" else None
models = {
    "Q4_1": q4_weights(engine.target.model, gguf, cpu_kernels.PackedQ4_1Weight),
    "Q4_1B": q4_weights(engine.target.model, gguf, cpu_kernels.PackedQ4_1BWeight),
}
report = {
    "cpu": cpu_name(),
    "flags": sorted(set(cpu_flags() or ()) & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}),
    "kernel": cpu_kernels.variant(),
    "weight_bytes": {
        name: sum(getattr(layer, attr).nbytes for layer in model.layers for attr in ("qkv", "o", "gate_up", "down"))
        + model.lm_head.nbytes
        for name, model in models.items()
    },
    "passes_ms": {},
    "runs": {},
}

times = chain_pass_ms(models)
report["passes_ms"] = {name: round(statistics.median(t), 3) for name, t in times.items()}
report["passes_ms"]["Q4_1 over Q4_1B"] = round(
    statistics.median(a / b for a, b in zip(times["Q4_1"], times["Q4_1B"])), 3
)
report["runs"], report["greedy_mismatches"] = greedy_runs(engine, models, repeats)
print(json.dumps(report, indent=1))
