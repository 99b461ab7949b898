"""Matrix-product bandwidth of each CPU kernel variant over the default model's matrices.

    .venv/bin/python docs/bench/kernel_bandwidth.py [--rows 1,4,8,16] [--repeats 15] [--threads 1 --clock cpu]

One "sweep" multiplies x [rows, in] by every matrix a SmolLM2-135M pass reads, in
pass order (30 layers of fused QKV 960x576, O 576x576, fused gate/up 3072x576,
down 576x1536, then the 49152x576 vocabulary projection): 269 MB of bf16 weights,
538 MB in float32. Random weights of those shapes (the speed does not depend on
the values). Reported: the median sweep in ms and the weight bytes read per
second at each pass width, for every kernel variant this CPU runs (selected with
cpu_kernels.using), the same with the layer matrices in Q4_1 (``<variant> q4_1``:
random 4-bit blocks; the vocabulary projection stays bf16, as for the default
model, whose GGUF stores it in Q8_0: 123 MB), and for torch (float32 on MKL, the fallback; bf16 on oneDNN's
packed layout where torch has it).

On a machine shared with other work, wall-clock times of 2 OpenMP threads blow up
(a descheduled thread stalls every barrier); ``--threads 1 --clock cpu`` (the
process's CPU time, best of the repeats) still compares the variants fairly there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from engine.kernels import cpu_kernels
from engine.model.transformer import Linear, Q4Linear

E, F, V, LAYERS, KV = 576, 1536, 49152, 30, 192  # hidden, MLP, vocabulary, layers, K+V width
SHAPES = [(E + 2 * KV, E), (E, E), (2 * F, E), (E, F)] * LAYERS + [(V, E)]  # (out, in), pass order


def sweep_ms(linears: list, rows: int, dtype: torch.dtype, repeats: int, clock) -> float:
    """Best sweep of `repeats` (after two warm-ups) in ms."""
    xs = {n: torch.randn(rows, n).to(dtype) for n in (E, F)}
    times = []
    for _ in range(repeats + 2):
        t0 = clock()
        for lin in linears:
            lin(xs[lin.shape[1]])
        times.append(clock() - t0)
    return min(times[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (1 thread)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        ap.error("--clock cpu measures one thread: add --threads 1")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows_list = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(torch.bfloat16) for o, i in SHAPES]
    nbytes = sum(w.numel() for w in weights) * 2
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, best of {args.repeats}; "
        f"bf16 weights {nbytes / 1e6:.0f} MB"
    )
    systems = []
    for name in cpu_kernels.VARIANTS:
        why = cpu_kernels.variant_support(name)
        if why is None:
            systems += [(name, name, torch.float32, 1), (f"{name} q4_1", name, torch.float32, 1)]
        else:
            print(f"{name}: skipped ({why})")
    systems += [("torch-float32", None, torch.float32, 2), ("torch-bf16 (oneDNN)", None, torch.bfloat16, 1)]
    print(f"{'system':<22}" + "".join(f"{f'{r} row' + ('s' if r > 1 else ''):>19}" for r in rows_list))
    for label, variant, act, width in systems:
        ctx = cpu_kernels.using(variant) if variant else _no_kernel()
        with ctx:
            if variant is None and act == torch.float32:
                linears = [Linear(w.float()) for w in weights]
            elif label.endswith("q4_1"):
                linears = [Q4Linear(_random_q4_1(*w.shape)) for w in weights[:-1]] + [Linear(weights[-1])]
            else:
                linears = [Linear(w) for w in weights]
            read = sum(lin.nbytes for lin in linears) if label.endswith("q4_1") else nbytes * width
            cells = []
            for rows in rows_list:
                ms = sweep_ms(linears, rows, act, args.repeats, clock)
                cells.append(f"{ms:6.1f} ms {read / ms / 1e6:3.0f} GB/s")
            print(f"{label:<22}" + "".join(f"{c:>19}" for c in cells))
        del linears


def _random_q4_1(out: int, n_in: int) -> cpu_kernels.PackedQ4_1Weight:
    gen = torch.Generator().manual_seed(out * n_in)
    q = torch.randint(0, 16, (out, n_in), generator=gen, dtype=torch.uint8)
    d = (torch.rand(out, n_in // 32, generator=gen) / 64).half()
    return cpu_kernels.PackedQ4_1Weight(q, d, (-8 * d.float()).half())


class _no_kernel:
    """Linear layers built inside take torch's path (as without a kernel)."""

    def __enter__(self):
        self.saved = dict(cpu_kernels._state)
        cpu_kernels._load()
        cpu_kernels._state.pop("lib", None)
        cpu_kernels._state.update(variant=None, why="benchmark: torch's path")

    def __exit__(self, *exc):
        cpu_kernels._state.clear()
        cpu_kernels._state.update(self.saved)


if __name__ == "__main__":
    main()
