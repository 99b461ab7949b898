"""Our CPU kernel for bf16 decoding passes: build it once, call it through ctypes.

``skinny_gemm_bf16(x, weight, bias)`` computes y = x W^T (+ b) for the few rows a
decoding pass has (1 token, or K + 1 when verifying K drafts) on CPUs with
AVX512-BF16. The C source is ``csrc/skinny_gemm_bf16.c``; it is compiled with the
system C compiler the first time it is needed, into the SpecLens cache (a few
hundred milliseconds), and reused while the source is unchanged.

Why not torch's own product: a decoding pass is ~120 small matrix products, and
at these sizes per-call overhead decides. Measured on a 2-core AVX512-BF16 EPYC
over the default model's matrices, oneDNN's product on pre-packed weights read
10-18 GB/s for the per-layer matrices (576x576 to 3072x576), this kernel reads
them near the machine's ~34 GB/s. It is also shape-invariant by construction
(see the C file), which the greedy parity check needs.

Where the kernel cannot be used (no AVX512-BF16, no compiler, build failure,
SPECLENS_CPU_KERNEL=0) ``available()`` is False with ``why_unavailable()``
saying why, and the model uses torch's products instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

__all__ = ["PackedInt8Weight", "PackedWeight", "available", "why_unavailable", "skinny_gemm_bf16", "skinny_gemm_int8w"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "skinny_gemm_bf16.c"
CFLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mavx512vnni",
    "-mfma",
    "-fopenmp",
    "-fPIC",
    "-shared",
]

_state: dict = {}


def _cpu_supports() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"))


def _build() -> ctypes.CDLL:
    from .models import cache_dir

    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    folder = cache_dir() / "kernels"
    lib_path = folder / f"skinny_gemm_bf16-{tag}.so"
    if not lib_path.is_file():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler found (cc or gcc)")
        folder.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run(
            [compiler, *CFLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling {SOURCE.name} failed: {result.stderr.strip()[:500]}")
        os.replace(tmp, lib_path)  # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(lib_path))
    ptr, flag, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.skinny_gemm_bf16.restype = None
    lib.skinny_gemm_bf16.argtypes = [ptr, flag, ptr, ptr, ptr, flag, size, size, size, ptr]
    lib.skinny_gemm_int8w.restype = None
    lib.skinny_gemm_int8w.argtypes = [ptr, flag, ptr, ptr, ptr, ptr, flag, size, size, size, ptr, ptr]
    return lib


class PackedWeight:
    """W [out, in] bf16 in the kernel's layout [out/16, in/2, 16, 2], zero-padded to
    out % 16 == 0 and in % 2 == 0, with the bias (if any) padded alike."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        out, n_in = weight.shape
        self.out, self.n_in = out, n_in
        out_p, in_p = -(-out // 16) * 16, -(-n_in // 2) * 2
        w = torch.zeros(out_p, in_p, dtype=torch.bfloat16)
        w[:out, :n_in] = weight
        self.data = w.view(out_p // 16, 16, in_p // 2, 2).permute(0, 2, 1, 3).contiguous()  # [out/16, in/2, 16, 2]
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(out_p, dtype=torch.bfloat16)
            self.bias[:out] = bias
        self.out_padded, self.in_padded = out_p, in_p

    def unpack(self) -> torch.Tensor:
        """The plain W [out, in]."""
        d = self.data
        w = d.permute(0, 2, 1, 3).reshape(self.out_padded, self.in_padded)
        return w[: self.out, : self.n_in].contiguous()


class PackedInt8Weight:
    """W ~= scale[:, None] * Q with Q int8 (symmetric, per output channel), Q in the
    kernel's layout [out/16, in/2, 16, 2]; scale float32 [out]; padded like PackedWeight."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        out, n_in = q.shape
        self.out, self.n_in = out, n_in
        out_p, in_p = -(-out // 16) * 16, -(-n_in // 2) * 2
        padded = torch.zeros(out_p, in_p, dtype=torch.int8)
        padded[:out, :n_in] = q
        self.data = padded.view(out_p // 16, 16, in_p // 2, 2).permute(0, 2, 1, 3).contiguous()
        self.scale = torch.zeros(out_p, dtype=torch.float32)
        self.scale[:out] = scale.float()
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(out_p, dtype=torch.bfloat16)
            self.bias[:out] = bias
        self.out_padded, self.in_padded = out_p, in_p


def _call(fn, x: torch.Tensor, packed: PackedWeight | PackedInt8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """x [rows, in] contiguous bf16 or float32 -> y [rows, out] in out_dtype (bf16 or float32)."""
    rows = x.shape[0]
    if packed.in_padded != packed.n_in:
        x = torch.nn.functional.pad(x, (0, packed.in_padded - packed.n_in))
    x_f32 = x.dtype == torch.float32
    tmp = torch.empty(rows * packed.in_padded, dtype=torch.bfloat16) if x_f32 else None
    y = torch.empty(rows, packed.out_padded, dtype=out_dtype)
    y_f32 = out_dtype == torch.float32
    bias = packed.bias.data_ptr() if packed.bias is not None else None
    sizes = (rows, packed.in_padded, packed.out_padded, tmp.data_ptr() if tmp is not None else None)
    if isinstance(packed, PackedInt8Weight):
        fn = _state["lib"].skinny_gemm_int8w if fn is None else fn
        xq = torch.empty(rows * packed.in_padded, dtype=torch.int16)  # x quantised per row
        sx = torch.empty(rows, dtype=torch.float32)  # its scales
        sizes = (*sizes[:3], xq.data_ptr(), sx.data_ptr())
        fn(x.data_ptr(), x_f32, packed.data.data_ptr(), packed.scale.data_ptr(), bias, y.data_ptr(), y_f32, *sizes)
    else:
        fn = _state["lib"].skinny_gemm_bf16 if fn is None else fn
        fn(x.data_ptr(), x_f32, packed.data.data_ptr(), bias, y.data_ptr(), y_f32, *sizes)
    return y if packed.out_padded == packed.out else y[:, : packed.out]


def _self_check(lib) -> None:
    """Both kernels against a float32 reference, odd sizes included (padding, tails)."""
    gen = torch.Generator().manual_seed(0)
    for rows, n_in, n_out in ((1, 64, 16), (3, 101, 7), (5, 576, 96), (16, 64, 200)):
        x = torch.randn(rows, n_in, generator=gen).to(torch.bfloat16)
        w = torch.randn(n_out, n_in, generator=gen).to(torch.bfloat16)
        b = torch.randn(n_out, generator=gen).to(torch.bfloat16)
        q = torch.randint(-127, 128, (n_out, n_in), generator=gen, dtype=torch.int8)
        scale = torch.rand(n_out, generator=gen) / 64
        checks = []
        for xin, out_dtype in ((x, torch.bfloat16), (x.float(), torch.float32)):
            checks.append(
                (_call(lib.skinny_gemm_bf16, xin, PackedWeight(w, b), out_dtype), x.float() @ w.float().t() + b.float())
            )
            checks.append(
                (
                    _call(lib.skinny_gemm_int8w, xin, PackedInt8Weight(q, scale, b), out_dtype),
                    (x.float() @ q.float().t()) * scale + b.float(),
                )
            )
        for got, ref in checks:
            if not torch.allclose(got.float(), ref, rtol=2e-2, atol=5e-2 * n_in**0.5):
                raise RuntimeError(f"self-check failed at rows={rows} in={n_in} out={n_out}")


def _load() -> None:
    if _state:
        return
    why = None
    if os.environ.get("SPECLENS_CPU_KERNEL", "1") == "0":
        why = "disabled by SPECLENS_CPU_KERNEL=0"
    elif not _cpu_supports():
        why = "this CPU has no AVX512-BF16"
    else:
        try:
            lib = _build()
            _self_check(lib)
            _state["lib"] = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            why = str(exc)
    _state["why"] = why


def available() -> bool:
    """True when the kernel is built, loaded and passed its self-check here."""
    _load()
    return "lib" in _state


def why_unavailable() -> str | None:
    _load()
    return _state["why"]


def skinny_gemm_bf16(
    x: torch.Tensor, packed: PackedWeight | PackedInt8Weight, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """y [rows, out] = x [rows, in] @ W^T (+ bias) on the CPU, W and bias given packed.

    x is bf16 or float32 (float32 is rounded to bf16 for the products, inside the
    kernel); y is out_dtype, by default x's dtype (float32 output skips the final
    rounding: the accumulator is stored as is).
    """
    if not available():
        raise RuntimeError(f"CPU kernel unavailable: {why_unavailable()}")
    if x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError("skinny_gemm_bf16 takes a 2-D bf16 or float32 CPU tensor")
    if x.shape[1] != packed.n_in:
        raise ValueError(f"x has {x.shape[1]} columns, the weight takes {packed.n_in}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bf16 or float32, got {out_dtype}")
    return _call(None, x.contiguous(), packed, out_dtype)


def skinny_gemm_int8w(x: torch.Tensor, packed: PackedInt8Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [rows, out] = (x [rows, in] @ Q^T) * scale (+ bias): the int8 drafter's product
    (the int8 values are widened exactly to bf16 inside the kernel)."""
    return skinny_gemm_bf16(x, packed, out_dtype)
