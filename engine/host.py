"""Which machine a run happened on, in words: recorded in every start event and benchmark report,
because speed (and, across CPU kernel variants, the last bits of bf16 logits) depends on it."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

__all__ = ["cpu_name", "host_info"]


@functools.cache
def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def host_info(device: torch.device) -> dict:
    """{"cpu", "threads", "kernel"}: the CPU, torch's thread count and, on the CPU, which of our kernel
    variants computes the passes (None: torch's own ops); on CUDA "gpu" names the card instead."""
    if device.type == "cuda":
        return {"cpu": cpu_name(), "gpu": torch.cuda.get_device_name(device)}
    from . import cpu_kernels

    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "kernel": cpu_kernels.variant()}
