"""Record the real traces shipped in assets/traces/ (they render the app before a
model loads and serve as test fixtures). Run: python scripts/record_traces.py"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import SpeculativeEngine  # noqa: E402
from engine import trace as trace_io  # noqa: E402

EXAMPLES = {e["regime"]: e["prompt"] for e in json.loads((ROOT / "assets" / "examples.json").read_text())}

RUNS = [
    ("code-edit-ngram-greedy", EXAMPLES["code-edit"], "ngram", dict(k=4, max_new_tokens=64, temperature=0.0, seed=0)),
    ("code-edit-baseline-greedy", EXAMPLES["code-edit"], "none", dict(k=4, max_new_tokens=64, temperature=0.0, seed=0)),
    (
        "chat-int8-tree-sampling",
        EXAMPLES["chat"],
        "int8",
        dict(k=3, topk=2, num_draft_tokens=6, max_new_tokens=40, temperature=0.8, seed=1),
    ),
    (
        "summarize-ngram-sampling",
        EXAMPLES["summarize"],
        "ngram",
        dict(k=4, topk=2, max_new_tokens=48, temperature=0.8, seed=3),
    ),
]

if __name__ == "__main__":
    engine = SpeculativeEngine.load()
    out = ROOT / "assets" / "traces"
    out.mkdir(parents=True, exist_ok=True)
    for name, prompt, drafter, kw in RUNS:
        run = engine.run(prompt, drafter, **kw)
        trace_io.save(run["events"], out / f"{name}.json")
        m = run["metrics"]
        print(
            f"{name}: {m['new_tokens']} tokens, {m['tokens_per_pass']:.2f} per pass, alpha {m['acceptance_rate']:.2f}"
        )
