"""Which machine a run happens on: the CPU's name and instruction-set flags (read here, the one reader
of /proc/cpuinfo), recorded in every start event and benchmark report, because speed (and, across CPU
kernel variants, the last bits of bf16 logits) depends on it. A leaf: it imports nothing of the engine.
"""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

import torch

__all__ = ["cpu_flags", "cpu_has_native_bf16", "cpu_name", "host_info"]


@functools.cache
def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


@functools.cache
def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    match = re.search(r"^model name\s*:(.*)$", _cpuinfo() or "", re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as /proc/cpuinfo spells them (avx2, avx512_bf16...); None where unreadable."""
    match = re.search(r"^flags\s*:(.*)$", _cpuinfo() or "", re.MULTILINE)
    return frozenset(match.group(1).split()) if match else None


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: the CPU multiplies bf16 matrices in hardware (oneDNN uses it for torch's
    bf16 products where our kernels are off)."""
    flags = cpu_flags() or frozenset()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def host_info(device: torch.device, kernel: str | None = None) -> dict:
    """{"cpu", "threads", "kernel"}: the CPU, torch's thread count and, on the CPU, which of our kernel
    variants computes the passes (``cpu_build.variant()``; None: torch's own ops); on CUDA "gpu" names
    the card instead."""
    if device.type == "cuda":
        return {"cpu": cpu_name(), "gpu": torch.cuda.get_device_name(device)}
    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "kernel": kernel}
