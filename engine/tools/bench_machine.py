"""The machine a benchmark runs on: what it is, and the memory roofline its rows are read against.

``machine_info`` says what ran (CPU or GPU, threads, dtype, library versions, which of our kernel variants ran
and the CPU flags that chose it, the pages the weights live on) and measures the copy and read bandwidth: the
weight bytes of one target pass over the copy bandwidth give the passes per second that no decoder on this
memory can beat. ``copy_bandwidth_now`` measures the copy again, so a report can say how far the machine's
memory drifted while it ran; ``launches_per_pass`` counts the host's CUDA launches for one pass, eager and
replayed as a graph. Apart from engine/tools/bench.py, which runs the systems, because the trace recorder
(machine_info), the GPU report (launches_per_pass) and the Explain lab (read_bandwidth_gbs) use them without
running a benchmark.
"""

from __future__ import annotations

import platform
import time

import torch

from engine import config
from engine.decode import SpeculativeEngine
from engine.host import cpu_flags, cpu_name
from engine.kernels import pages
from engine.model.static_pass import StaticPasses

__all__ = ["copy_bandwidth_gbs", "copy_bandwidth_now", "launches_per_pass", "machine_info", "read_bandwidth_gbs"]


def copy_bandwidth_gbs(size_mb: int = 256, repeats: int = 10) -> float:
    """Measured memory bandwidth in GB/s: bytes read + written by a large copy,
    best of ``repeats`` (both buffers touched first, so page faults are not timed; on the pages our kernels'
    weights live on, engine/kernels/pages.py)."""
    src = pages.zeros((size_mb * 1024 * 1024 // 4,), torch.float32).fill_(1.0)
    dst = pages.zeros(src.shape, torch.float32).fill_(0.0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def read_bandwidth_gbs(size_mb: int = 256, repeats: int = 10) -> float:
    """Measured read-only bandwidth in GB/s (a sum over a large buffer): what a
    matrix-vector product that streams weights can reach at best (on our kernels' pages, as above)."""
    src = pages.zeros((size_mb * 1024 * 1024 // 4,), torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best / 1e9


def machine_info(engine: SpeculativeEngine) -> dict:
    import transformers

    device = engine.target.model.device
    weight_bytes = engine.target.model.weight_bytes
    bandwidth = copy_bandwidth_now(engine)
    read_bw = None if device.type == "cuda" else round(read_bandwidth_gbs(), 2)
    accel = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "cpu": cpu_name(),
        "device": str(device),
        "gpu": accel,
        "threads": torch.get_num_threads(),
        "dtype": str(engine.target.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": engine.target.name,
        "weights": engine.target.weight_kind,
        # Which of our kernel variants ran and the CPU flags that decide it: reports differ per host.
        "cpu_kernel": _kernel_variant() if device.type == "cpu" else None,
        "cpu_flags": _cpu_flags(),
        # torch's own instruction set (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA can cap it, as an AVX2-only host)
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None,
        "torch_isa_caps": config.isa_caps(),
        # the pages the kernels' weights and caches live on (2 MB where Linux allows: engine/kernels/pages.py)
        "memory_pages": pages.describe() if device.type == "cpu" else None,
        "weight_bytes_per_pass": weight_bytes,
        "copy_bandwidth_gbs": bandwidth,
        "read_bandwidth_gbs": read_bw,
        "roofline_passes_per_s": round(bandwidth * 1e9 / weight_bytes, 2),
        # Host-side launches per one-token target pass, eager and replayed (CUDA only): what graphs remove.
        "launches_per_pass": launches_per_pass(engine) if device.type == "cuda" else None,
    }


def copy_bandwidth_now(engine: SpeculativeEngine) -> float:
    """The copy bandwidth (GB/s, two decimals) of the target's device, measured now: at the start (machine_info)
    and again after the runs."""
    device = engine.target.model.device
    return round(_cuda_copy_bandwidth_gbs(device) if device.type == "cuda" else copy_bandwidth_gbs(), 2)


def launches_per_pass(engine: SpeculativeEngine) -> dict:
    """{"eager": n, "cuda-graph": m}: CUDA launch calls the host makes for one one-token strict pass over a
    128-token prefix (kernel launches and graph launches, counted by torch's profiler), each path warmed up."""
    from torch.profiler import ProfilerActivity, profile

    model = engine.target.model
    runner = StaticPasses(model, 256, 1)
    cache = runner.acquire(256)
    model.prefill(list(range(100, 228)), cache)
    base = cache.length
    mask = torch.zeros(1, 256, dtype=torch.bool)
    mask[0, : base + 1] = True
    eager = model.new_cache(256)
    model.prefill(list(range(100, 228)), eager)

    def graph_pass():
        cache.length = base
        runner.run([7], [base], mask)

    def eager_pass():
        eager.length = base
        model.run_pass(torch.tensor([7]), torch.tensor([base]), eager, mask=mask, attend_len=256)

    counts = {}
    try:
        for label, fn in (("eager", eager_pass), ("cuda-graph", graph_pass)):
            fn()
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            counts[label] = sum(1 for e in prof.events() if "LaunchKernel" in e.name or "GraphLaunch" in e.name)
    finally:
        runner.release()
    return counts


def _kernel_variant() -> str | None:
    from engine.kernels import cpu_build

    return cpu_build.variant()


def _cpu_flags() -> list[str]:
    """The instruction-set flags our kernels (and llama.cpp's, vLLM's) choose by."""
    wanted = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16"}
    return sorted(wanted & (cpu_flags() or frozenset()))


def _cuda_copy_bandwidth_gbs(device, size_mb: int = 1024, repeats: int = 10) -> float:
    src = torch.ones(size_mb * 1024 * 1024 // 4, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9
