"""Where the shipped EAGLE head's acceptance is limited: its fit, or what it was trained on?

    .venv/bin/python docs/bench/eagle_head_fit.py [--per-kind 16] [--tokens 64] [--json OUT]

The head (assets/heads/) is measured with the real engine, greedy, K = 4 chain, exactly as its
model card's held-out figure, on three sets of prompts:

* its own training prompts (``engine.training.head_data.build_prompts`` with the recipe's count and seed:
  the first ``TrainConfig.prompts`` of them were trained on, 12 epochs), a deterministic sample
  per kind;
* the held-out prompts (the recipe's last ``TrainConfig.held_out``: generated like the training
  ones, never trained on);
* the benchmark workloads (assets/workloads.json: another style of prompt).

If the head drafted its training prompts much better than held-out ones, more (or more varied)
data would be the lever; if it drafts them about as badly, the head's fit itself (training
compute, its inputs, its one layer) is. The prompts need no work folder: they are rebuilt from
the recipe's seed, and the answers are the engine's own greedy ones.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from engine.decode import SpeculativeEngine
from engine.host import host_info
from engine.kernels import cpu_kernels
from engine.training.head_data import build_prompts
from engine.training.train_head import TrainConfig, greedy_acceptance

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-kind", type=int, default=16, help="training prompts sampled per kind")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (the model card's: 64)")
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args()
    cfg = TrainConfig()
    everything = build_prompts(cfg.prompts + cfg.held_out, cfg.seed)
    train, held = everything[: cfg.prompts], everything[cfg.prompts :]
    rng = random.Random(0)
    engine = SpeculativeEngine.load()
    rows = []

    def add(group: str, kind: str, prompts: list[str]) -> None:
        m = greedy_acceptance(engine, prompts, args.tokens)
        row = {"set": group, "kind": kind, **{k: m[k] for k in ("prompts", "tokens_per_pass", "acceptance_by_depth")}}
        rows.append(row)
        print(
            f"{group:<10} {kind:<10} {row['prompts']:>3} prompts  tokens/pass {row['tokens_per_pass']:.3f}"
            f"  acceptance by depth {row['acceptance_by_depth']}",
            flush=True,
        )

    for kind in ("chat", "code", "summarize"):
        pool = [p["prompt"] for p in train if p["kind"] == kind]
        add("training", kind, rng.sample(pool, min(args.per_kind, len(pool))))
    for kind in ("chat", "code", "summarize"):
        add("held-out", kind, [p["prompt"] for p in held if p["kind"] == kind])
    add("held-out", "all", [p["prompt"] for p in held])
    workloads = json.loads((ROOT / "assets" / "workloads.json").read_text())
    for name, prompts in workloads.items():
        add("workload", name, prompts)
    if args.json:
        report = {
            "host": host_info(engine.target.model.device, cpu_kernels.variant()),
            "settings": {"k": 4, "greedy": True, "new_tokens": args.tokens, "per_kind": args.per_kind},
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
