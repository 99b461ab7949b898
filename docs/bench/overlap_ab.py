"""A verification and the next draft chain side by side, one core each, against one after the other on both cores.

    .venv/bin/python docs/bench/overlap_ab.py [ROUNDS] > report.json        (from the repository's root)

What it weighs: drafting the next chain while the target verifies the current one (PEARL-style parallel
drafting; SpecLens does not do it) pays only if the two, each on a core of its own, finish sooner than the two
one after the other on both cores. On the default model, 150 cached positions:
- verify: one target pass of 7 tokens (K = 6's verification), bf16 on our kernels;
- chain: the q4 drafter's greedy chain of 6 one-token passes (one C call, as ModelDrafter drafts);
- sequential: verify then chain, each on 2 threads (what a step costs today);
- side by side: verify and chain at once in two Python threads, each kernel team 1 thread (ctypes lets go of
  the GIL), timed from both starting to both done.
Each mode runs in a process of its own (a process that ran two teams of threads keeps them), ROUNDS times
alternating (default 3), 5 timed repeats each; medians. Run it under the AVX2 proxy's environment
(docs/bench/README.md) for the avx2 kernels. Prints one JSON object.
"""

import json
import os
import statistics
import subprocess
import sys
import threading
import time

MODES = ("sequential", "side by side")


def measure(mode: str) -> dict:
    import torch

    sys.path.insert(0, ".")
    from engine import SpeculativeEngine

    engine = SpeculativeEngine.load()
    target, draft = engine.target.model, engine.drafters._model_weights("q4")
    prefix = 150
    tokens = torch.randint(100, 20000, (prefix + 8,), generator=torch.Generator().manual_seed(0))
    target_cache, draft_cache = target.new_cache(prefix + 16), draft.new_cache(prefix + 16)
    with torch.inference_mode():
        target.forward(tokens[:prefix], torch.arange(prefix), target_cache)
        draft.forward(tokens[:prefix], torch.arange(prefix), draft_cache)

    def verify():
        with torch.inference_mode():
            target_cache.length = prefix
            target.forward(tokens[prefix : prefix + 7], torch.arange(prefix, prefix + 7), target_cache)

    def chain():
        with torch.inference_mode():
            draft_cache.length = prefix
            draft.greedy_chain(int(tokens[prefix]), draft_cache, 6)

    def timed(fn, repeats=5) -> float:
        times = []
        for _ in range(repeats + 1):  # (the first: warm-up)
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(statistics.median(times[1:]) * 1000, 2)

    if mode == "sequential":
        torch.set_num_threads(2)
        return {"verify_ms": timed(verify), "chain_ms": timed(chain), "cycle_ms": timed(lambda: (verify(), chain()))}

    def one_core(fn):
        torch.set_num_threads(1)  # (this thread's OpenMP teams: 1 thread)
        fn()

    def side_by_side():
        threads = [threading.Thread(target=one_core, args=(fn,)) for fn in (verify, chain)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    torch.set_num_threads(1)
    return {"verify_ms": timed(verify), "chain_ms": timed(chain), "cycle_ms": timed(side_by_side)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--mode":
        print(json.dumps(measure(sys.argv[2])))
        return
    sys.path.insert(0, ".")
    from engine.host import cpu_flags, cpu_name
    from engine.kernels import cpu_kernels

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            out = subprocess.run(
                [sys.executable, __file__, "--mode", mode], capture_output=True, text=True, check=True, env=os.environ
            )
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {
        mode: {key: round(statistics.median(run[key] for run in runs[mode]), 2) for key in runs[mode][0]}
        for mode in MODES
    }
    report = {
        "cpu": cpu_name(),
        "flags": sorted(set(cpu_flags() or ()) & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}),
        "kernel": cpu_kernels.variant(),
        "threads": 2,
        "rounds": rounds,
        "runs": runs,
        "medians": medians,
        "sequential_over_side_by_side": round(
            medians["sequential"]["cycle_ms"] / medians["side by side"]["cycle_ms"], 3
        ),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
