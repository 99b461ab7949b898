"""Race every example against the baseline, as a teacher would see it, on a quiet or a busy machine.

    .venv/bin/python scripts/race_examples.py [--busy N] [--pairs 5] [--out FILE.json]

For each example in assets/examples.json: engine.tools.race (an uncounted warm-up, then alternating
baseline / speculative pairs) with the example's own drafter and settings on the app's default engine
(bfloat16 where our kernels run). --busy N keeps N other processes spinning on the CPU meanwhile (what
other visitors of a 2-core Space do), started here and stopped by their process group id. Prints one line
per example (median speedup, interval, verdict, ceiling, share of the cores) and writes them as JSON.
A two-question example ("then_ask") is raced on its second question with its first answer remembered.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import SpeculativeEngine  # noqa: E402
from engine.tools.race import race  # noqa: E402

SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=0, help="other processes kept spinning meanwhile")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--lessons", default=None, help="comma-separated lessons to race (default: every example)")
    args = parser.parse_args()
    engine = SpeculativeEngine.load(dtype="auto")
    examples = json.loads((ROOT / "assets" / "examples.json").read_text(encoding="utf-8"))
    if args.lessons:
        examples = [e for e in examples if e["lesson"] in args.lessons.split(",")]
    # A SIGTERM ends the script through its finally block, so the spinners it started never outlive it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=3600)], start_new_session=True)
        for _ in range(args.busy)
    ]
    rows = []
    try:
        time.sleep(0.5 if spinners else 0)
        for example in examples:
            settings = dict(example["settings"])
            prompt = example["prompt"]
            if example.get("then_ask"):
                settings["history"] = [engine.run(prompt, "none", **settings)["text"]]
                prompt = example["then_ask"]
            result = race(engine, prompt, example["drafter"], pairs=args.pairs, **settings)
            row = {"example": example["name"], "lesson": example["lesson"], "busy_processes": args.busy, **result}
            rows.append(row)
            print(
                f"{example['name'][:60]:<60} {result['speedup']:.2f}x [{result['low']:.2f}-{result['high']:.2f}] "
                f"{result['verdict']:<20} tokens/pass {result['speculative_tokens_per_pass']:.2f} "
                f"ceiling {result['ceiling']:.2f} cores {result['busy']['cpu_share']}",
                flush=True,
            )
    finally:
        for proc in spinners:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
