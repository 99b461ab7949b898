"""Whole-model speed of each CPU kernel variant: ms per target pass and tokens/s.

    .venv/bin/python docs/bench/cpu_variants.py [--settings avx512bf16,avx512,avx2,0] [--rounds 3] [--threads 1 --clock cpu]

For every SPECLENS_CPU_KERNEL setting (a variant, or 0 = torch's ops) a child
process loads the default model (bf16 on a kernel; float32 with 0, what an
AVX2-only CPU ran before the avx2 variant existed; ``<variant>+q4_1``: bf16 with
every layer matrix on the GGUF's own Q4_1 blocks, ``use_gguf_q4_1``) and measures

* ms of one target pass over W new tokens after a 128-token prefix (W = 1 is
  plain decoding, W = K + 1 verifies K drafts), median of 15 after a warm-up;
* greedy tokens/s of the engine's systems (baseline, n-gram K = 15, int8 K = 3:
  the settings of ``python -m engine bench``) on the first prompt of each
  workload in assets/workloads.json, 64 new tokens, median over rounds.

The settings run one after the other, ``--rounds`` times over (interleaved, so
that machine noise hits each alike); the table gives the best round's pass
times and the median round's tokens/s. On a machine shared with other work,
``--threads 1 --clock cpu`` times with the process's CPU time (tokens per CPU
second), which other processes barely disturb; 2 OpenMP threads' wall-clock
times blow up there (a descheduled thread stalls every barrier).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (1, 4, 8, 16)
SYSTEMS = {"baseline": ("none", {}), "ngram": ("ngram", {"k": 15}), "int8": ("int8", {"k": 3})}


def child(dtype: str, max_new: int, threads: int | None, clock_name: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    if threads:
        torch.set_num_threads(threads)
    clock = time.process_time if clock_name == "cpu" else time.perf_counter

    from engine.decode import GenerationSettings, SpeculativeEngine
    from engine.kernels import cpu_kernels

    engine = SpeculativeEngine.load(dtype="bfloat16" if dtype == "q4_1" else dtype)
    model = engine.target.model
    if dtype == "q4_1":
        from engine.model.loading import default_gguf_path
        from engine.model.transformer import use_gguf_q4_1

        use_gguf_q4_1(model, default_gguf_path())
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(256)
    model.prefill(torch.randint(0, model.cfg.vocab_size, (128,), generator=gen).tolist(), cache)
    passes = {}
    for w in WIDTHS:
        tokens = torch.randint(0, model.cfg.vocab_size, (w,), generator=gen)
        positions = torch.arange(128, 128 + w)
        times = []
        for _ in range(16):
            cache.length = 128
            t0 = clock()
            model.forward(tokens, positions, cache)
            times.append((clock() - t0) * 1e3)
        passes[w] = statistics.median(times[1:])
    workloads = json.loads((ROOT / "assets" / "workloads.json").read_text())
    prompts = [engine.encode_prompt(p[0]) for p in workloads.values()]
    speed = {}
    for name, (drafter, kw) in SYSTEMS.items():
        settings = GenerationSettings(max_new_tokens=max_new, temperature=0.0, seed=0, **kw)
        for _ in engine.generate(prompts[0], drafter, settings.merged({"max_new_tokens": 4})):
            pass  # warm-up: builds the drafter (the int8 copy of the weights) outside the timing
        new, wall, target_passes = 0, 0.0, 0
        for ids in prompts:
            t0 = clock()
            finish = None
            for event in engine.generate(ids, drafter, settings):
                finish = event
            wall += clock() - t0
            new += finish["metrics"]["new_tokens"]
            target_passes += finish["metrics"]["target_passes"]
        speed[name] = {"tok_s": new / wall, "tokens_per_pass": new / target_passes}
    return {
        "variant": cpu_kernels.variant(),
        "dtype": "q4_1" if dtype == "q4_1" else str(model.dtype),
        "pass_ms": passes,
        "speed": speed,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="avx512bf16,avx512,avx2,0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (1 thread)")
    ap.add_argument("--child", metavar="DTYPE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures one thread: add --threads 1")
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.max_new_tokens, args.threads, args.clock)))
        return
    settings = args.settings.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for setting in settings:
            kernel, _, weights = setting.partition("+")
            env = {**os.environ, "SPECLENS_CPU_KERNEL": kernel}
            dtype = weights or ("float32" if kernel == "0" else "bfloat16")
            cmd = [sys.executable, __file__, "--child", dtype, "--max-new-tokens", str(args.max_new_tokens)]
            cmd += ["--clock", args.clock] + (["--threads", str(args.threads)] if args.threads else [])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{setting}: failed\n{done.stderr[-2000:]}")
                continue
            runs[setting].append(json.loads(line[7:]))
    head = "".join(f"{f'W={w} ms':>9}" for w in WIDTHS) + "".join(f"{n + ' tok/s':>15}" for n in SYSTEMS)
    print(f"{'SPECLENS_CPU_KERNEL':<20}{'dtype':>15}{head}")
    for setting, results in runs.items():
        if not results:
            continue
        best = {w: min(r["pass_ms"][str(w)] for r in results) for w in WIDTHS}
        tok = {n: statistics.median(r["speed"][n]["tok_s"] for r in results) for n in SYSTEMS}
        tpp = {n: results[0]["speed"][n]["tokens_per_pass"] for n in SYSTEMS}
        cells = "".join(f"{best[w]:9.1f}" for w in WIDTHS)
        cells += "".join(f"{f'{tok[n]:.1f} ({tpp[n]:.2f}/p)':>15}" for n in SYSTEMS)
        print(f"{setting + ' -> ' + str(results[0]['variant']):<20}{results[0]['dtype']:>15}{cells}")
    print(f"(n/p: tokens per target pass; {results[0]['threads']} threads, {args.clock} clock)")


if __name__ == "__main__":
    main()
