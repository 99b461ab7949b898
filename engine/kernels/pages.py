"""Memory for what our CPU kernels stream: packed weights and KV caches on 2 MB transparent huge pages.

Why. A decoding pass reads every weight once, in long runs, and reads the cache's keys and values;
each 4 KB page of them needs its own address translation. In a virtual machine (a Space's container,
a cloud guest) a missed translation walks two page tables, the guest's and the host's, and the
hardware prefetchers stop at every 4 KB boundary. On 2 MB pages the same buffers stream faster, and so
do the target's and the drafters' passes, with the same bits (docs/kernels.md, "Huge pages";
docs/bench/2026-12-05-huge-pages.md; docs/bench/2026-12-07-notes-from-kernels-and-model.md).

How. Linux backs an anonymous private mapping with 2 MB pages as they are first touched when its
transparent huge pages are enabled "always", or "madvise" and the mapping is advised MADV_HUGEPAGE
(the usual default; we advise). Tensors are carved out of 2 MB-aligned arenas of ``CHUNK`` bytes
(``ALIGN``-byte aligned within), so a model's ~120 small matrices share pages instead of rounding
each up to 2 MB; a tensor of ``OWN_MAPPING`` bytes or more (a vocabulary projection) and every KV
cache (it lives for one run) get a mapping of their own, unmapped when the tensor is gone. An arena
lives while any tensor carved from it does (torch.frombuffer holds the mapping). Where the kernel says
"never", or on another OS, or with ``SPECLENS_HUGE_PAGES=0`` (engine/config.py; the A/B of
docs/bench/2026-12-05-huge-pages.md), tensors are plain torch.zeros: the same values and bits, without the
speed (``describe`` says which). A kernel built without huge pages
refuses the advice; the mapping is then used as it is.
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import torch

from engine import config

__all__ = ["ALIGN", "CHUNK", "OWN_MAPPING", "copy_of", "describe", "zeros"]

HUGE = 2 << 20  # bytes in a huge page (x86-64)
CHUNK = 32 << 20  # bytes per shared arena
OWN_MAPPING = 8 << 20  # tensors this large get a mapping of their own
ALIGN = 64  # bytes: each tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_lock = threading.Lock()
_arena: dict = {"buf": None, "used": 0}  # the current shared arena (uint8 tensor) and its bytes handed out


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where it has none."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def _advised() -> bool:
    """Whether the kernels' memory goes to mappings advised MADV_HUGEPAGE: the setting on, the call there, and
    Linux backing advised mappings with huge pages ("always" or "madvise"). Else plain torch tensors."""
    return (
        config.huge_pages()
        and hasattr(mmap, "MADV_HUGEPAGE")
        and hasattr(mmap, "MAP_ANONYMOUS")
        and _thp_mode() in ("always", "madvise")
    )


def describe() -> str:
    """In words, for reports: whether the kernels' memory is on huge pages here."""
    mode = _thp_mode()
    if not config.huge_pages():
        return "4 KB pages (SPECLENS_HUGE_PAGES=0)"
    if mode is None:
        return "ordinary pages (no transparent huge pages on this OS)"
    if not _advised():
        return f"4 KB pages (transparent huge pages: {mode})"
    return f"2 MB transparent huge pages ({mode})"


def _mapping(nbytes: int) -> torch.Tensor:
    """A fresh zero-filled uint8 tensor of at least nbytes starting on a 2 MB boundary, its pages advised."""
    size = -(-nbytes // HUGE) * HUGE + HUGE  # room to move the start to a 2 MB boundary
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched
    except OSError:  # a kernel built without huge pages refuses the advice: ordinary pages, the same memory
        pass
    buf = torch.frombuffer(mm, dtype=torch.uint8)  # holds mm
    start = (-buf.data_ptr()) % HUGE
    return buf[start : start + size - HUGE]


def _carve(nbytes: int, own: bool) -> torch.Tensor:
    """nbytes of zeroed, advised memory, ALIGN-aligned: from the shared arena, or a mapping of its own if large
    or asked for."""
    if own or nbytes >= OWN_MAPPING:
        return _mapping(nbytes)[:nbytes]
    need = -(-nbytes // ALIGN) * ALIGN
    with _lock:
        buf, used = _arena["buf"], _arena["used"]
        if buf is None or used + need > buf.numel():
            buf, used = _mapping(CHUNK), 0
        _arena["buf"], _arena["used"] = buf, used + need
    return buf[used : used + nbytes]


def zeros(shape, dtype: torch.dtype, own_mapping: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor (contiguous) whose memory is on huge pages where this host allows (else
    torch.zeros, ordinary memory). own_mapping: never from a shared arena, so its memory goes back when the
    tensor does (a KV cache lives for one run; an arena lives as long as the weights carved from it)."""
    shape = tuple(int(s) for s in shape)
    if not _advised():
        return torch.zeros(shape, dtype=dtype)
    count = 1
    for s in shape:
        count *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = _carve(max(1, count * itemsize), own_mapping)
    return raw[: count * itemsize].view(dtype).view(shape)


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of t on huge pages where this host allows (the same values, bit for bit)."""
    out = zeros(t.shape, t.dtype)
    out.copy_(t)
    return out
