"""Our CPU kernels for decoding passes: built once per instruction set, called through ctypes.

The model's forward runs its hot loops here: products of a pass's few rows with weights packed once at load
(bf16, int8, and 4- and 2-bit blocks, the RMSNorm of x optionally fused into the product), attention of a
pass's new tokens over the KV cache (causal or under a draft tree's mask), the rotary embedding with the
cache write, whole stacks of decoder layers and whole draft chains in one call. ``__all__`` names the entry
points; the C source, ``csrc/decode_kernels.c`` plus one header per instruction set, says what each computes.

Variants (``VARIANTS``, best first; the first the CPU supports that builds and passes its self-check runs;
``variant()`` says which, ``describe()`` why), each chosen by the CPU's flags (``Variant.cpu_flags``):

* ``avx512bf16`` -- AVX512-BF16 + AVX512-VNNI: x rounded to bf16, ``vdpbf16ps`` on the packed weights; int8
  on ``vpdpwssd``.
* ``avx512`` -- AVX-512F/BW/VL without BF16: bf16 weights widened to float32 in 512-bit registers (a 16-bit
  shift), FMA with float32 activations; int8 on ``vpmaddwd``.
* ``avx2`` -- AVX2 + FMA (x86-64-v3): bf16 weights widened to float32 on 256-bit registers by unpacking with
  zero, the even and odd inputs summed apart (one FMA chain per accumulator: 16 registers cannot hide two
  chained FMAs per pair, see ``csrc/isa_avx2.h``); int8 on ``vpmaddwd``.

On other CPUs (ARM64, x86 without AVX2/FMA) no variant runs and the model uses torch's ops. The variant's
library is compiled with the system C compiler the first time it is needed, into the SpecLens cache,
self-checked against torch (values, and row invariance bit for bit) and reused while the sources are
unchanged. ``SPECLENS_CPU_KERNEL`` forces a choice: ``0`` (off), ``auto`` (the default), or a variant's name
(tests and benchmarks run ``avx2`` on an AVX-512 host that way).

Why not torch's own ops: a decoding pass is ~120 small matrix products and ~30 small attentions, and at these
sizes per-call overhead decides: oneDNN's product on pre-packed weights reads the per-layer matrices slower
than these kernels, and torch's SDPA spends longer on setup for a few query tokens than on the attention
(docs/bench/2026-12-07-notes-from-kernels-and-model.md). Every kernel of every variant computes each token of
a pass on its own, in the same order whatever the pass width (see the C file), so a K-token verification
pass gives bit for bit the logits of K one-token passes. (Variants differ from each other in the last bits.)

Where no kernel can be used (no variant for this CPU, no compiler, build failure, SPECLENS_CPU_KERNEL=0)
``available()`` is False with ``why_unavailable()`` saying why, and the model uses torch's ops instead.

One module on purpose: building each ISA variant, self-checking it, packing each weight kind for it and
calling it are one contract with the C source; the packing and the calls must change together with csrc/.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine import config
from engine.host import cpu_flags
from engine.kernels import pages
from engine.paths import cache_dir

__all__ = [
    "VARIANTS",
    "LayerStack",
    "PackedInt8Weight",
    "PackedQ2BWeight",
    "PackedQ4_1BWeight",
    "PackedQ4_1Weight",
    "PackedWeight",
    "RescoredQ4Head",
    "attend_few",
    "available",
    "describe",
    "greedy_chain",
    "head_q4_rescored",
    "int8_per_channel",
    "kv_bf16",
    "KV_DTYPES",
    "rope_and_store",
    "swiglu",
    "run_packed",
    "sampled_chain",
    "top_rows",
    "skinny_gemm_bf16",
    "skinny_gemm_int8w",
    "skinny_gemm_q4_1",
    "skinny_gemm_q4_1b",
    "skinny_gemm_q2b",
    "using",
    "variant",
    "variant_support",
    "why_unavailable",
]

CSRC = Path(__file__).resolve().parent / "csrc"  # the C sources live beside this module
SOURCE = CSRC / "decode_kernels.c"
# -ffp-contract=off: GCC's default fuses a multiply and an add it sees into one FMA
# wherever it likes, in some tiles and not in others (the int8 epilogue
# acc * sx * scale + bias), which breaks row invariance; with it off only our
# explicit FMAs fuse.
COMMON_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
# The KV caches the kernels read and write: float32 (the target's), or bf16 (a drafter's: half the bytes per
# attended position; the model's kv_dtype).
KV_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Variant:
    name: str
    cpu_flags: tuple[str, ...]  # as /proc/cpuinfo spells them
    cflags: tuple[str, ...]  # selects the ISA header in decode_kernels.c
    label: str  # for people
    x_bf16: bool  # float32 x rounded to bf16 for the bf16 product (else multiplied as float32)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "avx512bf16",
            ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "fma"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma"),
            "AVX512-BF16 + VNNI: vdpbf16ps on bf16 weights, vpdpwssd for int8",
            True,
        ),
        Variant(
            "avx512",
            ("avx512f", "avx512bw", "avx512vl", "fma"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"),
            "AVX-512: bf16 widened to float32 for FMA, vpmaddwd for int8",
            False,
        ),
        Variant(
            "avx2",
            ("avx2", "fma", "f16c"),
            ("-mavx2", "-mfma", "-mf16c"),
            "AVX2 + FMA: bf16 widened to float32 for FMA, vpmaddwd for int8",
            False,
        ),
    )
}
_OFF = ("0", "off", "false", "no", "none", "torch")
_AUTO = ("", "1", "auto", "on", "true", "yes")

_state: dict = {}  # "lib", "variant", "why", "reason"; "built": {name: lib or error string}
# The first choice builds and self-checks; the app's preload thread and a request may
# both get there first (the build's temporary file is named by pid, shared by threads).
_LOCK = threading.RLock()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "x64")


def _cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags (engine.host), None where unreadable; tests replace this to pose as another CPU."""
    return cpu_flags()


def variant_support(name: str) -> str | None:
    """None when this machine can run variant `name`, else why not (missing flags...)."""
    if name not in VARIANTS:
        return f"unknown kernel variant {name!r} (known: {', '.join(VARIANTS)})"
    if not _is_x86():
        return f"{platform.machine() or 'this'} CPU: our kernels are x86-64 only (AVX2+FMA or AVX-512)"
    flags = _cpu_flags()
    if flags is None:
        return "cannot read the CPU's flags (/proc/cpuinfo)"
    missing = [f for f in VARIANTS[name].cpu_flags if f not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def _cpu_supports() -> bool:
    """Some variant could run on this CPU (whether it builds is another matter)."""
    return any(variant_support(name) is None for name in VARIANTS)


def _build(name: str) -> ctypes.CDLL:
    """Compile (once per source and flags) and load variant `name`'s library."""
    spec = VARIANTS[name]
    cflags = [*COMMON_CFLAGS, *spec.cflags]
    digest = hashlib.sha256(" ".join(cflags).encode())
    for path in sorted(CSRC.glob("*.[ch]")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    tag = digest.hexdigest()[:16]
    folder = cache_dir() / "kernels"
    lib_path = folder / f"decode_kernels-{name}-{tag}.so"
    if not lib_path.is_file():
        compiler = config.c_compiler() or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler found (cc or gcc)")
        folder.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run(
            [compiler, *cflags, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling {SOURCE.name} for {name} failed: {result.stderr.strip()[:500]}")
        os.replace(tmp, lib_path)  # atomic: concurrent builders never load a half-written file
        # builds of earlier sources: this variant's other tags, and the single-variant names of old
        stale = [*folder.glob(f"decode_kernels-{name}-*.so"), *folder.glob("decode_kernels-" + "[0-9a-f]" * 16 + ".so")]
        for path in stale:
            if path != lib_path:
                path.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(lib_path))
    ptr, flag, size, real = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.skinny_gemm_bf16.restype = None
    lib.skinny_gemm_bf16.argtypes = [ptr, flag, ptr, ptr, ptr, flag, size, size, size, ptr, real]
    lib.skinny_gemm_int8w.restype = None
    lib.skinny_gemm_int8w.argtypes = [ptr, flag, ptr, ptr, ptr, ptr, flag, size, size, size, ptr, real]
    lib.skinny_gemm_q4_1.restype = None
    lib.skinny_gemm_q4_1.argtypes = [ptr, flag, ptr, ptr, ptr, flag, size, size, size, ptr, real]
    lib.skinny_gemm_q4_1b.restype = None
    lib.skinny_gemm_q4_1b.argtypes = [ptr, flag, ptr, ptr, ptr, ptr, flag, size, size, size, ptr, real]
    lib.head_q4_rescored.restype = None
    lib.skinny_gemm_q2b.restype = None
    lib.skinny_gemm_q2b.argtypes = [ptr, flag, ptr, ptr, ptr, ptr, flag, size, size, size, ptr, real]
    lib.head_q4_rescored.argtypes = [ptr, flag, ctypes.c_int, ptr, ptr, ptr, ptr, ptr] + [size] * 5 + [ptr, real]
    lib.rope_and_store.restype = None
    lib.rope_and_store.argtypes = [ptr] * 6 + [size] * 7
    lib.attend_few.restype = None
    lib.attend_few.argtypes = [ptr, ptr, ptr, ptr, ptr, size, size, size, size, size, size, real, size]
    lib.swiglu_rows.restype = None
    lib.swiglu_rows.argtypes = [ptr, ptr, size, size]
    lib.decode_layers.restype = None
    lib.decode_layers.argtypes = [ptr, size, ptr, size, real, ptr, ptr, ptr, ptr] + [size] * 7 + [ptr, real]
    lib.top_rows.restype = None
    lib.top_rows.argtypes = [ptr, size, size, size, ptr, ptr]
    lib.greedy_chain.restype = None
    lib.greedy_chain.argtypes = [size, size, ptr, flag, ptr, size, real, ptr, ptr, ptr, ptr] + [size] * 6
    lib.greedy_chain.argtypes += [real, ptr, ptr, ptr, ptr, size, ptr, ptr]
    lib.sampled_chain.restype = None
    lib.sampled_chain.argtypes = [*lib.greedy_chain.argtypes, real, ptr, ptr]
    return lib


class _Packed:
    """A matrix M [out, in] in the kernels' layout [out/16, in/2, 16, 2] (one 16-output x
    2-input line per multiply-add), zero-padded to out % 16 == 0 and in % 2 == 0, with
    its bias (bf16, padded alike) if any."""

    def __init__(self, matrix: torch.Tensor, bias: torch.Tensor | None):
        out, n_in = matrix.shape
        self.out, self.n_in = out, n_in
        self.out_padded, self.in_padded = -(-out // 16) * 16, -(-n_in // 2) * 2
        padded = torch.zeros(self.out_padded, self.in_padded, dtype=matrix.dtype)
        padded[:out, :n_in] = matrix
        lines = padded.view(self.out_padded // 16, 16, self.in_padded // 2, 2).permute(0, 2, 1, 3)
        self.data = pages.copy_of(lines)  # streamed by every pass: on huge pages (pages.py)
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(self.out_padded, dtype=torch.bfloat16)
            self.bias[:out] = bias
        self.sizes = (self.in_padded, self.out_padded)

    def unpack(self) -> torch.Tensor:
        """The plain matrix [out, in]."""
        plain = self.data.permute(0, 2, 1, 3).reshape(self.out_padded, self.in_padded)
        return plain[: self.out, : self.n_in].contiguous()


class PackedWeight(_Packed):
    """W [out, in] bf16 for skinny_gemm_bf16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.to(torch.bfloat16), bias)
        self.args = (self.data.data_ptr(), self.bias.data_ptr() if self.bias is not None else None)


class PackedInt8Weight(_Packed):
    """W ~= scale[:, None] * Q with Q int8 [out, in] (symmetric, per output channel) and
    scale float32 [out], for skinny_gemm_int8w."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(q.to(torch.int8), bias)
        self.scale = torch.zeros(self.out_padded, dtype=torch.float32)
        self.scale[: self.out] = scale.float()
        bias_ptr = self.bias.data_ptr() if self.bias is not None else None
        self.args = (self.data.data_ptr(), self.scale.data_ptr(), bias_ptr)


Q4_GROUP = 32  # weights per Q4_1 block (along the input)


class PackedQ4_1Weight:
    """W [out, in] in GGUF's Q4_1 kind: per 32 consecutive inputs of a row, w = d * q + m
    with q in 0..15 and float16 d, m (5 bits per weight). Repacked for skinny_gemm_q4_1
    as [out/16, in/32, 320 bytes]: per 16 outputs x 32 inputs, d[16] and m[16] float16,
    then 4 chunks of 64 bytes, chunk c byte [l][e] = q[l][4c + e] | q[l][4c + 16 + e] << 4
    (four inputs of one output per 32-bit lane, for byte dot products; 0.625 bytes per
    weight; bf16 takes 2). Rows padded to a multiple of 16 and inputs to
    a multiple of 32 with d = m = 0 (zero weights). The nibble shuffling runs in numpy, where
    torch's uint8 shifts and concatenations are many times slower
    (docs/bench/2026-12-07-notes-from-kernels-and-model.md)."""

    def __init__(self, q, d, m, bias: torch.Tensor | None = None):
        q, d, m = (np.asarray(a.numpy() if isinstance(a, torch.Tensor) else a) for a in (q, d, m))
        out, n_in = q.shape  # q uint8 [out, in] in 0..15; d, m float16 [out, in / 32]
        self.out, self.n_in = out, n_in
        self.out_padded, self.in_padded = -(-out // 16) * 16, -(-n_in // Q4_GROUP) * Q4_GROUP
        groups, blocks = self.in_padded // Q4_GROUP, self.out_padded // 16
        qp = np.zeros((self.out_padded, self.in_padded), dtype=np.uint8)
        qp[:out, :n_in] = q
        dp, mp = (np.zeros((self.out_padded, groups), dtype=np.float16) for _ in range(2))
        dp[:out], mp[:out] = d, m
        nibbles = _q4_nibbles(qp)
        scales = [a.reshape(blocks, 16, groups).transpose(0, 2, 1).copy().view(np.uint8) for a in (dp, mp)]
        blocks_q4 = torch.from_numpy(np.concatenate([*scales, nibbles], axis=2))  # [out/16, in/32, 320]
        self.data = pages.copy_of(blocks_q4)  # streamed by every pass: on huge pages (pages.py)
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(self.out_padded, dtype=torch.bfloat16)
            self.bias[:out] = bias
        self.sizes = (self.in_padded, self.out_padded)
        self.args = (self.data.data_ptr(), self.bias.data_ptr() if self.bias is not None else None)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedQ4_1Weight:
        """Q4_1 blocks of any matrix [out, in] (llama.cpp's rule: per 32 inputs m = min,
        d = (max - min) / 15, q = round((w - m) / d)); in is zero-padded to a multiple
        of 32."""
        w = weight.detach().float().cpu().numpy()
        out, n_in = w.shape
        padded = -(-n_in // Q4_GROUP) * Q4_GROUP
        w = np.pad(w, ((0, 0), (0, padded - n_in))).reshape(out, -1, Q4_GROUP)
        lo, hi = w.min(axis=2), w.max(axis=2)
        d = ((hi - lo) / 15).astype(np.float16)
        m = lo.astype(np.float16)
        inv = np.divide(1.0, d.astype(np.float32), out=np.zeros_like(lo), where=d != 0)
        q = np.clip(np.rint((w - m.astype(np.float32)[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
        packed = cls(q.reshape(out, padded), d, m, bias)
        packed.n_in = n_in  # the padded inputs multiply zero-padded x
        return packed

    @classmethod
    def from_gguf_blocks(cls, raw, n_in: int, bias: torch.Tensor | None = None) -> PackedQ4_1Weight:
        """From a GGUF Q4_1 tensor's bytes, uint8 [out, in / 32 * 20]: per block d, m
        (float16) and 16 bytes qs, weight j = qs[j] & 15 and weight j + 16 = qs[j] >> 4."""
        d, m, q = _q4_1_fields(raw, n_in)
        return cls(q, d, m, bias)

    def unpack(self) -> torch.Tensor:
        """The dequantised matrix [out, in], float32: d * q + m (exactly transformers')."""
        data = self.data.numpy()
        d = data[..., 0:32].copy().view(np.float16).astype(np.float32)  # [ob, g, l]
        m = data[..., 32:64].copy().view(np.float16).astype(np.float32)
        return _q4_unpack(data[..., 64:], d, m, (self.out, self.n_in))

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _q4_unpack(nibbles: np.ndarray, d: np.ndarray, m: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """A 4-bit matrix's weights d * q + m, float32 [out, in] (`shape`, the rest padding): nibbles uint8 [out/16,
    in/32, 256] (``_q4_nibbles``), d and m float32 [out/16, in/32, 16] per block and output."""
    blocks, groups = nibbles.shape[:2]
    nib = nibbles.reshape(blocks, groups, 4, 16, 4)  # [ob, g, c, l, e]
    q = np.stack([nib & 15, nib >> 4], axis=2).astype(np.float32)  # [ob, g, h, c, l, e]
    w = d[:, :, None, None, :, None] * q + m[:, :, None, None, :, None]
    w = w.transpose(0, 4, 1, 2, 3, 5).reshape(blocks * 16, groups * Q4_GROUP)
    return torch.from_numpy(np.ascontiguousarray(w[: shape[0], : shape[1]]))


def _q4_nibbles(qp: np.ndarray) -> np.ndarray:
    """q uint8 [out, in] in 0..15 (out a multiple of 16, in of 32) -> the blocks' nibble bytes [out/16, in/32,
    256]: q[16 ob + l, 32 g + 16 h + 4 c + e] -> [ob, g, h, c, l, e], the low nibble h = 0, the high h = 1."""
    out, n_in = qp.shape
    blocks, groups = out // 16, n_in // Q4_GROUP
    qv = qp.reshape(blocks, 16, groups, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5)
    return (qv[:, :, 0] | (qv[:, :, 1] << 4)).reshape(blocks, groups, 256)


class PackedQ4_1BWeight:
    """W [out, in] in Q4_1B: Q4_1's blocks (32 inputs, w = d * q + m, q in 0..15) with the two scales coded in
    a byte each, d = dc * dstep[o] (dc in 0..255, one float32 step per output row: its largest d / 255) and
    m = -d * mc / 16 (mc in 0..255: -15.94 <= m / d <= 0, a range the default model's blocks fall inside).
    4.5 bits per weight against Q4_1's 5: packed for skinny_gemm_q4_1b as [out/16, in/32,
    288 bytes], per 16 outputs x 32 inputs dc[16], mc[16], then Q4_1's 4 chunks of 64 nibble bytes
    (PackedQ4_1Weight), and dstep float32 [out]. decode_kernels.c explains the product.

    From Q4_1 blocks (the GGUF's: q, d, m), the nibbles are kept, d is rounded to its code and m re-fitted to
    the block's mean given the rounded d (m + (d - d') * mean(q)), then coded (how far that moves the default
    model's weights and outputs: docs/bench/2026-12-07-notes-from-kernels-and-model.md). A block with m / d
    outside the codes' range is clipped to it (the drafter's weights move; exactness never depends on them)."""

    def __init__(self, q, d, m, bias: torch.Tensor | None = None):
        _init_coded(self, q, d, m, bias, _q4_1b_codes, _q4_nibbles)  # q uint8 [out, in] in 0..15; d, m [out, in / 32]

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedQ4_1BWeight:
        """Q4_1B blocks of any matrix [out, in]: per 32 inputs the range [min(w, 0), max(w, 0)] (so that m / d
        is in the codes' range) in 15 steps of d rounded up to its code, m = -d * mc / 16 with mc from the
        range's low end, then q = round((w - m) / d) in 0..15; in is zero-padded to a multiple of 32."""
        w = weight.detach().float().cpu().numpy()
        out, n_in = w.shape
        padded = -(-n_in // Q4_GROUP) * Q4_GROUP
        w = np.pad(w, ((0, 0), (0, padded - n_in))).reshape(out, -1, Q4_GROUP)
        lo, hi = np.minimum(w.min(axis=2), 0.0), np.maximum(w.max(axis=2), 0.0)
        d = (hi - lo) / 15
        step = _row_steps(d)
        d = np.ceil(d / step[:, None]).clip(0, 255) * step[:, None]
        mc = np.divide(-lo * 16, d, out=np.zeros_like(d), where=d > 0).round().clip(0, 255)
        m = -d * mc / 16
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
        q = np.clip(np.rint((w - m[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
        packed = cls(q.reshape(out, padded), d, m, bias)
        packed.n_in = n_in  # the padded inputs multiply zero-padded x
        return packed

    @classmethod
    def from_gguf_blocks(cls, raw, n_in: int, bias: torch.Tensor | None = None) -> PackedQ4_1BWeight:
        """From a GGUF Q4_1 tensor's bytes, uint8 [out, in / 32 * 20] (PackedQ4_1Weight.from_gguf_blocks)."""
        d, m, q = _q4_1_fields(raw, n_in)
        return cls(q, d, m, bias)

    def unpack(self) -> torch.Tensor:
        """The dequantised matrix [out, in], float32: dc * dstep * (q - mc / 16), what the kernel multiplies."""
        data = self.data.numpy()
        step = self.dstep.numpy().reshape(data.shape[0], 1, 16)
        d = data[..., 0:16].astype(np.float32) * step  # [ob, g, l]
        m = -d * (data[..., 16:32].astype(np.float32) / 16)
        return _q4_unpack(data[..., 32:], d, m, (self.out, self.n_in))

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.dstep.numel()


def _init_coded(packed, q, d, m, bias, codes, weight_bytes) -> None:
    """A PackedQ4_1BWeight's or PackedQ2BWeight's fields from q uint8 [out, in], d, m [out, in / 32] (any float):
    sizes padded (outputs to 16, inputs to 32), per block the codes dc[16], mc[16] (`codes`: q [out, groups, 32],
    d, m float32 -> dc, mc [out, groups], dstep [out]) and then `weight_bytes(qp)` (the padded q's nibbles or
    crumbs [out/16, in/32, n]); dstep, the bias (bf16, padded) and the kernel's arguments."""
    q, d, m = (np.asarray(a.numpy() if isinstance(a, torch.Tensor) else a) for a in (q, d, m))
    out, n_in = q.shape
    packed.out, packed.n_in = out, n_in
    packed.out_padded, packed.in_padded = -(-out // 16) * 16, -(-n_in // Q4_GROUP) * Q4_GROUP
    groups, blocks = packed.in_padded // Q4_GROUP, packed.out_padded // 16
    qp = np.zeros((packed.out_padded, packed.in_padded), dtype=np.uint8)
    qp[:out, :n_in] = q
    d, m = d.astype(np.float32), m.astype(np.float32)
    dc, mc, step = codes(qp[:out].reshape(out, -1, Q4_GROUP)[:, : d.shape[1]], d, m)
    dcp, mcp = (np.zeros((packed.out_padded, groups), dtype=np.uint8) for _ in range(2))
    dcp[:out, : dc.shape[1]], mcp[:out, : mc.shape[1]] = dc, mc
    heads = [a.reshape(blocks, 16, groups).transpose(0, 2, 1) for a in (dcp, mcp)]
    data = np.ascontiguousarray(np.concatenate([*heads, weight_bytes(qp)], axis=2))
    packed.data = pages.copy_of(torch.from_numpy(data))  # [out/16, in/32, bytes], streamed by every pass: huge pages
    packed.dstep = torch.zeros(packed.out_padded, dtype=torch.float32)
    packed.dstep[:out] = torch.from_numpy(step)
    packed.bias = None
    if bias is not None:
        packed.bias = torch.zeros(packed.out_padded, dtype=torch.bfloat16)
        packed.bias[:out] = bias
    packed.sizes = (packed.in_padded, packed.out_padded)
    packed.args = (
        packed.data.data_ptr(),
        packed.dstep.data_ptr(),
        packed.bias.data_ptr() if packed.bias is not None else None,
    )


def _q2b_codes(q, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q2B's codes of blocks whose d, m are already fitted (PackedQ2BWeight.quantize): (dc, mc uint8 [out,
    groups], dstep float32 [out]), d rounded to the nearest code (at least 1 where d > 0), mc = round(-16 m / d')
    clipped to 0..255 (q unused: m is not re-fitted; the signature is _init_coded's)."""
    step = _row_steps(d)
    dc = np.rint(d / step[:, None]).clip(0, 255)
    dc = np.where((d > 0) & (dc == 0), 1, dc)
    mc = np.divide(-16 * m, dc * step[:, None], out=np.zeros_like(m), where=dc > 0).round().clip(0, 255)
    return dc.astype(np.uint8), mc.astype(np.uint8), step


def _row_steps(d: np.ndarray) -> np.ndarray:
    """Each row's step for d's codes: its largest d / 255 (1 for a row of zeros), float32 [out]."""
    step = (d.max(axis=1) / 255).astype(np.float32)
    return np.where(step > 0, step, np.float32(1.0))


def _q4_1b_codes(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1B's codes of Q4_1 blocks: q uint8 [out, groups, 32], d, m float32 [out, groups] -> (dc, mc uint8
    [out, groups], dstep float32 [out]). d rounded to the nearest code (at least 1 where d > 0); m re-fitted
    to the block's mean given that d, m + (d - d') * mean(q) (least squares over the block's 32 weights), then
    coded: mc = round(-16 m / d') clipped to 0..255."""
    step = _row_steps(d)
    dc = np.rint(d / step[:, None]).clip(0, 255)
    dc = np.where((d > 0) & (dc == 0), 1, dc)
    d2 = dc * step[:, None]
    fit = m + (d - d2) * q.astype(np.float32).mean(axis=2)
    mc = np.divide(-16 * fit, d2, out=np.zeros_like(fit), where=d2 > 0).round().clip(0, 255)
    return dc.astype(np.uint8), mc.astype(np.uint8), step


class PackedQ2BWeight:
    """W [out, in] in Q2B: 2-bit weights per 32 inputs, w = d * q + m with q in 0..3, the scales coded as Q4_1B's
    (PackedQ4_1BWeight: d = dc * dstep[o], m = -d * mc / 16, a byte each). Packed for skinny_gemm_q2b as
    [out/16, in/32, 160 bytes]: per 16 outputs x 32 inputs dc[16], mc[16], then 2 chunks of 64 bytes, chunk c
    byte [l][e] = q[l][4c + e] | q[l][4c + 8 + e] << 2 | q[l][16 + 4c + e] << 4 | q[l][16 + 4c + 8 + e] << 6
    (decode_kernels.c explains the product); 2.5 bits per weight, 0.3125 bytes. Rows padded to a multiple of 16
    and inputs to a multiple of 32 with zero weights.

    Coarse on purpose: the q4 drafter's output projection uses it only to rank the vocabulary, and computes its
    best `top` outputs again in int8 (RescoredQ4Head); its 8.8 MB for the default model's head are read by
    every draft pass where Q4_1B's are 15.9 MB."""

    def __init__(self, q, d, m, bias: torch.Tensor | None = None):
        _init_coded(self, q, d, m, bias, _q2b_codes, _q2_crumbs)  # q uint8 [out, in] in 0..3; d, m [out, in / 32]

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        importance: torch.Tensor | None = None,
        rounds: int = 3,
    ) -> PackedQ2BWeight:
        """Q2B blocks of any matrix [out, in], fitted per 32 inputs by weighted least squares: minimise
        sum_i a_i (w_i - d q_i - m)^2 with a = `importance` ([in], how much an error in input i moves the
        outputs: an output projection after an RMSNorm takes the norm's weight squared; default all ones).
        From the range [min(w, 0), max(w, 0)] in 3 steps, and from it widened and narrowed by 15%, `rounds`
        times: q = round((w - m) / d) in 0..3, then d, m solved for those q (m clipped to the codes' range
        [-15.9 d, 0]); each block keeps the start with the smallest error. Then d and m are coded (the row's
        step, a byte each) and q assigned once more to the coded d, m; in is zero-padded to a multiple of 32.

        Weighting by the final norm's weight squared ranks the int8 head's best output nearer the top of the Q2B
        product than an unweighted fit does, and a RescoredQ4Head needs it among the rows it re-scores for the
        q4 drafter's greedy drafts to be int8's (docs/bench/2026-12-07-notes-from-kernels-and-model.md)."""
        w = weight.detach().float().cpu()
        out, n_in = w.shape
        padded = -(-n_in // Q4_GROUP) * Q4_GROUP
        w = torch.nn.functional.pad(w, (0, padded - n_in)).reshape(out, -1, Q4_GROUP)  # [out, groups, 32]
        a = torch.ones(padded)
        if importance is not None:
            a[:n_in] = importance.detach().float().cpu().reshape(n_in)
        if not (torch.isfinite(a).all() and (a >= 0).all()):
            raise ValueError("a Q2B fit's importance must be finite and non-negative")
        a = a.reshape(1, -1, Q4_GROUP)  # [1, groups, 32], broadcast over the rows

        def assign(w, d, m):  # q [rows, groups, 32] in 0..3 (float)
            inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), 0.0)
            return torch.clamp(torch.round((w - m[..., None]) * inv[..., None]), 0, 3)

        def fit(w):  # (d, m) [rows, groups] of rows w [rows, groups, 32]
            sa, saw = a.sum(dim=2).expand(w.shape[0], -1), (a * w).sum(dim=2)  # [rows, groups]
            lo, hi = w.amin(dim=2).clamp_max(0.0), w.amax(dim=2).clamp_min(0.0)
            best = None
            for widen in (1.0, 0.85, 1.15):
                d, m = (hi - lo) * widen / 3, lo
                for _ in range(rounds):
                    q = assign(w, d, m)
                    aq = a * q
                    saq, saq2, saqw = aq.sum(dim=2), (aq * q).sum(dim=2), (aq * w).sum(dim=2)
                    det = sa * saq2 - saq * saq
                    ok = det > 1e-20
                    d_new = (sa * saqw - saq * saw) / torch.where(ok, det, 1.0)
                    d = torch.where(ok & (d_new > 0), d_new, d)
                    m = torch.where(ok & (sa > 0), (saw - d * saq) / sa.clamp_min(1e-30), m)
                    m = torch.minimum(torch.maximum(m, -d * 255 / 16), torch.zeros_like(m))
                e = (a * (w - d[..., None] * assign(w, d, m) - m[..., None]).square()).sum(dim=2)
                if best is None:
                    best = d, m, e
                else:
                    keep = e < best[2]
                    best = torch.where(keep, d, best[0]), torch.where(keep, m, best[1]), torch.where(keep, e, best[2])
            return best[0], best[1]

        # (1024 rows at a time: the fit's temporaries stay in cache, where whole-matrix ones are memory bound)
        fits = [fit(w[r : r + 1024]) for r in range(0, out, 1024)]
        best = torch.cat([f[0] for f in fits]), torch.cat([f[1] for f in fits])
        dc, mc, step = _q2b_codes(None, best[0].numpy(), best[1].numpy())
        d = dc * step[:, None]  # [out, groups] float32, as coded
        m = -d * (mc / np.float32(16))
        q = assign(w, torch.from_numpy(d), torch.from_numpy(m)).to(torch.uint8).numpy()
        packed = cls(q.reshape(out, padded), d, m, bias)
        packed.n_in = n_in  # the padded inputs multiply zero-padded x
        return packed

    def unpack(self) -> torch.Tensor:
        """The dequantised matrix [out, in], float32: dc * dstep * (q - mc / 16), what the kernel multiplies."""
        data = self.data.numpy()
        blocks, groups = data.shape[:2]
        step = self.dstep.numpy().reshape(blocks, 1, 16)
        d = data[..., 0:16].astype(np.float32) * step  # [ob, g, l]
        m = -d * (data[..., 16:32].astype(np.float32) / 16)
        crumbs = data[..., 32:].reshape(blocks, groups, 2, 16, 4)  # [ob, g, c, l, e]
        q = np.stack([(crumbs >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # [ob, g, (h, k), c, l, e]
        q = q.reshape(blocks, groups, 2, 2, 2, 16, 4).astype(np.float32)  # [ob, g, h, k, c, l, e]
        w = d[:, :, None, None, None, :, None] * q + m[:, :, None, None, None, :, None]
        w = w.transpose(0, 5, 1, 2, 3, 4, 6).reshape(blocks * 16, groups * Q4_GROUP)
        return torch.from_numpy(np.ascontiguousarray(w[: self.out, : self.n_in]))

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.dstep.numel()


def _q2_crumbs(qp: np.ndarray) -> np.ndarray:
    """q uint8 [out, in] in 0..3 (out a multiple of 16, in of 32) -> the blocks' crumb bytes [out/16, in/32, 128]:
    q[16 ob + l, 32 g + 16 h + 8 k + 4 c + e] -> byte [ob, g, c, l, e], bits 4 h + 2 k."""
    out, n_in = qp.shape
    blocks, groups = out // 16, n_in // Q4_GROUP
    qv = qp.reshape(blocks, 16, groups, 2, 2, 2, 4).transpose(0, 2, 5, 1, 3, 4, 6)  # [ob, g, c, l, h, k, e]
    crumbs = qv[..., 0, 0, :] | qv[..., 0, 1, :] << 2 | qv[..., 1, 0, :] << 4 | qv[..., 1, 1, :] << 6
    return crumbs.reshape(blocks, groups, 128)


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8 [out, in], scale float32 [out]): W ~= scale[:, None] * Q, symmetric per output channel (the
    int8 drafter's rule, Int8Linear)."""
    w = weight.float()  # [out, in]
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0  # [out]
    return torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8).contiguous(), scale


class RescoredQ4Head:
    """An output projection W [out, in] for ``head_q4_rescored``: W in Q4_1 (llama.cpp's rule), Q4_1B or Q2B
    (`packing`: PackedQ4_1Weight, PackedQ4_1BWeight or PackedQ2BWeight, the last fitted with `importance`) for
    the whole product, and in int8 per channel (``int8_per_channel``, row-major, zero-padded like the 4-bit
    blocks) for each row's `top` best outputs, computed again (decode_kernels.c explains why). Reads the blocks
    and `top` int8 rows per row of x: for the default model's head 18 MB (Q4_1; Q4_1B 16 MB, Q2B 9 MB) + 18 KB
    per 32 rows re-scored, against int8's 28 MB."""

    def __init__(
        self,
        weight: torch.Tensor,
        top: int,
        packing: type = PackedQ4_1Weight,
        importance: torch.Tensor | None = None,
    ):
        if not 1 <= top <= 1024:  # (the kernel keeps a row's candidates in a sorted list on the stack)
            raise ValueError(f"a re-scored head re-scores between 1 and 1024 outputs per row, got top={top}")
        if packing not in (PackedQ4_1Weight, PackedQ4_1BWeight, PackedQ2BWeight):
            raise ValueError(f"a re-scored head packs its blocks as Q4_1, Q4_1B or Q2B, not {packing!r}")
        # (importance: Q2B's fit weights each input's error by it, PackedQ2BWeight.quantize; the 4-bit rules need none)
        self.q4 = (
            packing.quantize(weight, importance=importance) if packing is PackedQ2BWeight else packing.quantize(weight)
        )
        self.top = int(top)
        self.out, self.n_in = self.q4.out, self.q4.n_in
        self.out_padded, self.in_padded = self.q4.out_padded, self.q4.in_padded
        q, scale = int8_per_channel(weight)
        self.w8 = torch.zeros(self.out_padded, self.in_padded, dtype=torch.int8)  # [out, in] row-major
        self.w8[: self.out, : self.n_in] = q
        self.scale8 = torch.zeros(self.out_padded, dtype=torch.float32)
        self.scale8[: self.out] = scale

    @property
    def nbytes(self) -> int:
        """Bytes one row's pass reads: the Q4_1 blocks, its re-scored int8 rows and their scales."""
        return self.q4.nbytes + self.top * (self.in_padded + 4)


def head_q4_rescored(
    x: torch.Tensor, head: RescoredQ4Head, norm_weight: torch.Tensor | None = None, eps: float = 1e-6, lib=None
) -> torch.Tensor:
    """y [rows, out] float32: x [rows, in] (float32 or bf16; float32 with norm_weight, RMS-normalised first)
    through the head's blocks, each row's `head.top` best outputs overwritten with the int8 product's values:
    those entries equal skinny_gemm_int8w's on the same int8 matrix bit for bit, the others the blocks' product
    (skinny_gemm_q4_1's, skinny_gemm_q4_1b's or skinny_gemm_q2b's). Where `in` is not a multiple of 32, rows to
    normalise are normalised by torch first, as skinny_gemm_q4_1 does: the int8 product then on those rows."""
    if lib is None:
        if not available():
            raise RuntimeError(f"CPU kernel unavailable: {why_unavailable()}")
        lib = _state["lib"]
    x = x.contiguous()
    if head.in_padded != head.n_in:
        if norm_weight is not None:  # padding zeros would change the mean of squares: normalise first
            x = torch.nn.functional.rms_norm(x.float(), norm_weight.shape, norm_weight, eps)
            norm_weight = None
        x = torch.nn.functional.pad(x, (0, head.in_padded - head.n_in))
    rows = x.shape[0]
    y = torch.empty(rows, head.out_padded, dtype=torch.float32)
    norm = norm_weight.data_ptr() if norm_weight is not None else None
    lib.head_q4_rescored(
        x.data_ptr(),
        x.dtype == torch.float32,
        _kind(head.q4),
        head.q4.data.data_ptr(),
        head.q4.dstep.data_ptr() if _kind(head.q4) > 2 else None,
        head.w8.data_ptr(),
        head.scale8.data_ptr(),
        y.data_ptr(),
        rows,
        head.in_padded,
        head.out_padded,
        head.out,
        head.top,
        norm,
        eps,
    )
    return y if head.out_padded == head.out else y[:, : head.out]


def _q4_1_fields(raw, n_in: int):
    """d, m float16 [out, in / 32] and q uint8 [out, in] of GGUF Q4_1 bytes [out, in / 32 * 20]."""
    raw = np.asarray(raw.numpy() if isinstance(raw, torch.Tensor) else raw, dtype=np.uint8)
    blocks = raw.reshape(raw.shape[0], n_in // Q4_GROUP, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    return d, m, np.concatenate([qs & 15, qs >> 4], axis=2).reshape(raw.shape[0], n_in)


def dequantize_q4_1(raw, n_in: int) -> torch.Tensor:
    """GGUF Q4_1 bytes [out, in / 32 * 20] -> float32 [out, in], w = d * q + m."""
    d, m, q = _q4_1_fields(raw, n_in)
    scale = np.repeat(d.astype(np.float32), Q4_GROUP, axis=1)
    return torch.from_numpy(scale * q.astype(np.float32) + np.repeat(m.astype(np.float32), Q4_GROUP, axis=1))


def _call(
    lib,
    x: torch.Tensor,
    packed: PackedWeight | PackedInt8Weight | PackedQ4_1Weight | PackedQ4_1BWeight,
    out_dtype: torch.dtype,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """x [rows, in] contiguous bf16 or float32 -> y [rows, out] in out_dtype (bf16 or float32),
    on library `lib` (None: the active variant's). The hot path of every decoding pass:
    kept to one allocation and one foreign call."""
    rows = x.shape[0]
    if packed.in_padded != packed.n_in:
        if norm_weight is not None:  # padding zeros would change the mean of squares: normalise first
            x = torch.nn.functional.rms_norm(x, norm_weight.shape, norm_weight, eps)
            norm_weight = None
        x = torch.nn.functional.pad(x, (0, packed.in_padded - packed.n_in))
    y = torch.empty(rows, packed.out_padded, dtype=out_dtype)
    norm = norm_weight.data_ptr() if norm_weight is not None else None
    x_f32, y_f32 = x.dtype == torch.float32, out_dtype == torch.float32
    lib = lib if lib is not None else _state["lib"]
    if isinstance(packed, PackedInt8Weight):
        fn = lib.skinny_gemm_int8w
    elif isinstance(packed, PackedQ4_1Weight):
        fn = lib.skinny_gemm_q4_1
    elif isinstance(packed, PackedQ4_1BWeight):
        fn = lib.skinny_gemm_q4_1b
    elif isinstance(packed, PackedQ2BWeight):
        fn = lib.skinny_gemm_q2b
    else:
        fn = lib.skinny_gemm_bf16
    fn(x.data_ptr(), x_f32, *packed.args, y.data_ptr(), y_f32, rows, *packed.sizes, norm, eps)
    return y if packed.out_padded == packed.out else y[:, : packed.out]


def _self_check(lib) -> None:
    """Every kernel against a float32 / SDPA reference, odd sizes included (padding,
    tails), and the products' rows against one-row products bit for bit."""
    gen = torch.Generator().manual_seed(0)
    for rows, n_in, n_out in ((1, 64, 16), (3, 101, 7), (5, 576, 96), (16, 64, 200)):
        x = torch.randn(rows, n_in, generator=gen).to(torch.bfloat16)
        w = torch.randn(n_out, n_in, generator=gen).to(torch.bfloat16)
        b = torch.randn(n_out, generator=gen).to(torch.bfloat16)
        q = torch.randint(-127, 128, (n_out, n_in), generator=gen, dtype=torch.int8)
        scale = torch.rand(n_out, generator=gen) / 64
        packed, packed_int8 = PackedWeight(w, b), PackedInt8Weight(q, scale, b)
        checks = []
        for xin, out_dtype in ((x, torch.bfloat16), (x.float(), torch.float32)):
            checks.append((_call(lib, xin, packed, out_dtype), x.float() @ w.float().t() + b.float()))
            checks.append((_call(lib, xin, packed_int8, out_dtype), (x.float() @ q.float().t()) * scale + b.float()))
        q4 = PackedQ4_1Weight(
            torch.randint(0, 16, (n_out, n_in), generator=gen, dtype=torch.uint8),
            (torch.rand(n_out, -(-n_in // Q4_GROUP), generator=gen) / 8).half(),
            (torch.randn(n_out, -(-n_in // Q4_GROUP), generator=gen) / 4).half(),
            b,
        )
        checks.append((_call(lib, x.float(), q4, torch.float32), x.float() @ q4.unpack().t() + b.float()))
        q4b = PackedQ4_1BWeight.quantize(w, b)
        checks.append((_call(lib, x.float(), q4b, torch.float32), x.float() @ q4b.unpack().t() + b.float()))
        q2b = PackedQ2BWeight.quantize(w, b)
        checks.append((_call(lib, x.float(), q2b, torch.float32), x.float() @ q2b.unpack().t() + b.float()))
        g = torch.rand(n_in, generator=gen) + 0.5
        xn = torch.nn.functional.rms_norm(x.float(), (n_in,), g, 1e-5)
        checks.append((_call(lib, x.float(), PackedWeight(w), torch.float32, g, 1e-5), xn @ w.float().t()))
        for got, ref in checks:
            if not torch.allclose(got.float(), ref, rtol=2e-2, atol=5e-2 * n_in**0.5):
                raise RuntimeError(f"self-check failed at rows={rows} in={n_in} out={n_out}")
        for p in (packed, packed_int8, q4, q4b, q2b):
            full = _call(lib, x.float(), p, torch.float32)
            if not all(
                torch.equal(_call(lib, x[r : r + 1].float(), p, torch.float32), full[r : r + 1]) for r in range(rows)
            ):
                raise RuntimeError(f"self-check failed: rows of a {rows}-row product differ from one-row products")
    q = torch.randn(6, 3, 64, generator=gen)
    k, v = torch.randn(2, 40, 64, generator=gen), torch.randn(2, 40, 64, generator=gen)
    out = torch.empty(3, 6 * 64)
    lib.attend_few(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, out.data_ptr(), 6, 2, 40, 33, 3, 64, 0.125, 0)
    mask = torch.ones(3, 33, dtype=torch.bool).tril(diagonal=30)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None, :, :33], v[None, :, :33], attn_mask=mask[None, None], enable_gqa=True
    )  # [1, H, T, D]
    tree = torch.rand(3, 33, generator=gen) < 0.5
    tree[:, 0] = True
    out_tree = torch.empty(3, 6 * 64)
    lib.attend_few(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), tree.data_ptr(), out_tree.data_ptr(), 6, 2, 40, 33, 3, 64, 0.125, 0
    )
    ref_tree = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None, :, :33], v[None, :, :33], attn_mask=tree[None, None], enable_gqa=True
    )
    for got, want in ((out, ref), (out_tree, ref_tree)):
        if not torch.allclose(got, want[0].transpose(0, 1).reshape(3, 6 * 64), atol=1e-4):
            raise RuntimeError("self-check of attend_few failed")


def load_variant(name: str) -> ctypes.CDLL:
    """Variant `name`'s library, built and self-checked (once per process); raises
    RuntimeError saying why where it cannot run here."""
    with _LOCK:
        return _load_variant(name)


def _load_variant(name: str) -> ctypes.CDLL:
    built = _state.setdefault("built", {})
    if name not in built:
        why = variant_support(name)
        if why is None:
            try:
                lib = _build(name)
                _self_check(lib)
                built[name] = lib
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
                built[name] = str(exc)
        else:
            built[name] = why
    if isinstance(built[name], str):
        raise RuntimeError(f"{name}: {built[name]}")
    return built[name]


def _choose() -> tuple[str | None, ctypes.CDLL | None, str]:
    """(variant, library, reason) per SPECLENS_CPU_KERNEL; variant None: no kernel, reason why."""
    setting = config.cpu_kernel_setting()
    if setting in _OFF:
        return None, None, f"disabled by SPECLENS_CPU_KERNEL={setting}"
    if setting in VARIANTS:
        try:
            return setting, load_variant(setting), f"forced by SPECLENS_CPU_KERNEL={setting}"
        except RuntimeError as exc:
            return None, None, f"SPECLENS_CPU_KERNEL={setting}, which cannot run here: {exc}"
    note = "" if setting in _AUTO else f" (SPECLENS_CPU_KERNEL={setting!r} is not 0, auto or a variant: ignored)"
    if not _is_x86():
        return None, None, variant_support("avx2") + note
    skipped = []
    for name in VARIANTS:
        try:
            lib = load_variant(name)
        except RuntimeError as exc:
            skipped.append(str(exc))
            continue
        reason = "the best variant for this CPU" if not skipped else "fallback; " + "; ".join(skipped)
        return name, lib, reason + note
    return None, None, "no kernel variant runs here: " + "; ".join(skipped) + note


def _load() -> None:
    if "why" in _state:
        return
    with _LOCK:
        if "why" in _state:
            return
        name, lib, reason = _choose()
        if lib is not None:
            _state["lib"] = lib
        _state.update(variant=name, reason=reason, why=None if lib is not None else reason)


def available() -> bool:
    """True when a kernel variant is built, loaded and passed its self-check here."""
    _load()
    return "lib" in _state


def variant() -> str | None:
    """The variant the model runs on ("avx512bf16", "avx512", "avx2"), None without a kernel."""
    _load()
    return _state["variant"]


def why_unavailable() -> str | None:
    """Why no kernel runs here (None when one does: see describe() for which and why)."""
    _load()
    return _state["why"]


def describe() -> dict:
    """For people (the app's Model panel, ``engine prepare``): {"variant": name or None,
    "label": what it computes with, "reason": why this one (or why none)}."""
    _load()
    name = _state["variant"]
    return {
        "variant": name,
        "label": VARIANTS[name].label if name else "torch's ops",
        "reason": _state["reason"],
    }


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    """Run variant `name` inside the block (tests, benchmarks): products, attention and
    the layers of models built inside it. Raises RuntimeError where it cannot run here.
    The packed layout is the same for every variant, so packed weights need no repacking."""
    lib = load_variant(name)
    _load()
    saved = dict(_state)
    _state.update(lib=lib, variant=name, why=None, reason=f"selected by cpu_kernels.using({name!r})")
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)


def run_packed(
    x: torch.Tensor, packed: PackedWeight | PackedInt8Weight, norm_weight: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    """The model's unchecked fast path: x [rows, in] contiguous float32 or bf16 (float32
    with norm_weight), y in x's dtype. The kernel must be available; see skinny_gemm_bf16."""
    return _call(None, x, packed, x.dtype, norm_weight, eps)


def skinny_gemm_bf16(
    x: torch.Tensor,
    packed: PackedWeight | PackedInt8Weight,
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """y [rows, out] = x [rows, in] @ W^T (+ bias) on the CPU, W and bias given packed.

    x is bf16 or float32 (on avx512bf16 float32 is rounded to bf16 for the products,
    inside the kernel; the widening variants multiply float32 as is and widen bf16
    x exactly); y is out_dtype, by default x's dtype (float32 output skips the final
    rounding: the accumulator is stored as is). With norm_weight [in] (float32,
    float32 x only) each row is RMS-normalised first: y = RMSNorm(x) @ W^T, the
    norm fused into the kernel's pass over x.
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
    if norm_weight is not None:
        if x.dtype != torch.float32 or norm_weight.dtype != torch.float32 or norm_weight.shape != (packed.n_in,):
            raise ValueError("norm_weight must be float32 [in], with float32 x")
        norm_weight = norm_weight.contiguous()
    return _call(None, x.contiguous(), packed, out_dtype, norm_weight, eps)


def skinny_gemm_int8w(
    x: torch.Tensor,
    packed: PackedInt8Weight,
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """y [rows, out] = (x [rows, in] @ Q^T) * scale (+ bias): the int8 drafter's product
    (x quantised per row to int16 inside the kernel); norm_weight as in skinny_gemm_bf16."""
    return skinny_gemm_bf16(x, packed, out_dtype, norm_weight, eps)


def skinny_gemm_q4_1(
    x: torch.Tensor,
    packed: PackedQ4_1Weight,
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """y [rows, out] = x [rows, in] @ W^T (+ bias) with W in Q4_1 (``PackedQ4_1Weight``),
    dequantised in registers and multiplied in float32 (x is never rounded to bf16 here,
    on any variant); norm_weight as in skinny_gemm_bf16."""
    return skinny_gemm_bf16(x, packed, out_dtype, norm_weight, eps)


def skinny_gemm_q4_1b(
    x: torch.Tensor,
    packed: PackedQ4_1BWeight,
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """y [rows, out] = x [rows, in] @ W^T (+ bias) with W in Q4_1B (``PackedQ4_1BWeight``): skinny_gemm_q4_1's
    rows of x and integer sums, the byte-coded scales applied per group; norm_weight as in skinny_gemm_bf16."""
    return skinny_gemm_bf16(x, packed, out_dtype, norm_weight, eps)


def skinny_gemm_q2b(
    x: torch.Tensor,
    packed: PackedQ2BWeight,
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """y [rows, out] = x [rows, in] @ W^T (+ bias) with W in Q2B (``PackedQ2BWeight``): skinny_gemm_q4_1b's
    product with 2-bit weights; norm_weight as in skinny_gemm_bf16."""
    return skinny_gemm_bf16(x, packed, out_dtype, norm_weight, eps)


def kv_bf16(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a KV cache (k, v: one layer [Hkv, S, D] or all [L, Hkv, S, D], contiguous) is bf16, which the
    kernels read widened to float32 (a drafter's cache: ``KV_DTYPES``), rather than float32; ValueError for
    any other dtype or a mix."""
    if k.dtype != v.dtype or k.dtype not in KV_DTYPES:
        raise ValueError(f"the kernels take a float32 or bf16 KV cache, got keys {k.dtype} and values {v.dtype}")
    return k.dtype == torch.bfloat16


def attend_few(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, mask: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Attention of T new tokens: q [H, T, D] float32 over k, v [Hkv, S, D] float32 or bf16 (one
    layer of the cache, positions [0, length) in view) -> [T, H * D]. Without a mask the
    new tokens are the last T positions and attend causally (token t sees [0, length - T + t]);
    mask [T, length] bool says which positions each token sees (a draft tree). Query head
    h reads key/value head h // (H // Hkv); softmax(q k^T / sqrt(D)) v.
    check=False skips the validation (the model validates a mask once per pass, not per layer)."""
    heads, tokens, dim = q.shape
    kv_heads, capacity, _ = k.shape
    if check:
        if not available():
            raise RuntimeError(f"CPU kernel unavailable: {why_unavailable()}")
        if not (
            q.dtype == torch.float32 and k.dtype == v.dtype in KV_DTYPES and k.is_contiguous() and v.is_contiguous()
        ):
            raise ValueError("attend_few takes float32 q and contiguous float32 or bf16 k, v (one dtype)")
        if heads % kv_heads or not 0 < tokens <= length <= capacity:
            raise ValueError(
                f"bad attention shapes: H={heads}, Hkv={kv_heads}, T={tokens}, length={length}, S={capacity}"
            )
        if mask is not None:
            if mask.dtype != torch.bool or mask.shape != (tokens, length) or not mask.is_contiguous():
                raise ValueError(
                    f"mask must be contiguous bool [{tokens}, {length}], got {mask.dtype} {tuple(mask.shape)}"
                )
            if not bool(mask.any(dim=1).all()):
                raise ValueError("every row of the mask must allow at least one position")
    mask_ptr = mask.data_ptr() if mask is not None else None
    q = q.contiguous()
    out = torch.empty(tokens, heads * dim, dtype=torch.float32)
    args = (heads, kv_heads, capacity, length, tokens, dim, dim**-0.5, k.dtype == torch.bfloat16)
    _state["lib"].attend_few(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask_ptr, out.data_ptr(), *args)
    return out


def rope_and_store(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, heads: int
) -> torch.Tensor:
    """Rotary embedding of the fused projection's queries and keys, keys and values
    written into one layer of the cache at slots [start, start + T); returns the
    rotated queries [H, T, D]. qkv [T, (H + 2 Hkv) D], cos, sin [T, D], all contiguous float32; k, v
    [Hkv, S, D] contiguous float32 or bf16 (``kv_bf16``: keys and values rounded to nearest even as they are
    stored). The model's fast path: not validated beyond shapes and the cache's dtype."""
    tokens = qkv.shape[0]
    kv_heads, capacity, dim = k.shape
    if qkv.shape[1] != (heads + 2 * kv_heads) * dim or start + tokens > capacity:
        raise ValueError("rope_and_store: shapes do not match")
    q = torch.empty(heads, tokens, dim, dtype=torch.float32)
    _state["lib"].rope_and_store(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        start,
        tokens,
        heads,
        kv_heads,
        capacity,
        dim,
        kv_bf16(k, v),
    )
    return q


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 I] contiguous float32 (gate first) -> [rows, I],
    the SwiGLU of every pass where our kernels run (decode_layers computes the same numbers
    per element, so long passes and short ones agree)."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _state["lib"].swiglu_rows(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


class _MatDesc(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("unused", ctypes.c_int32),
        ("wp", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("n_in", ctypes.c_int64),
        ("out", ctypes.c_int64),
    ]


class _LayerDesc(ctypes.Structure):
    _fields_ = [(name, _MatDesc) for name in ("qkv", "o", "gate_up", "down")] + [
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
    ]


def _kind(packed) -> int:
    """decode_kernels.c's mat_desc kind of a packed matrix: 0 bf16, 1 int8, 2 Q4_1, 3 Q4_1B, 4 Q2B."""
    kinds = ((PackedInt8Weight, 1), (PackedQ4_1Weight, 2), (PackedQ4_1BWeight, 3), (PackedQ2BWeight, 4))
    return next((kind for cls, kind in kinds if isinstance(packed, cls)), 0)


def _mat_desc(packed) -> _MatDesc | None:
    """A packed matrix as decode_layers reads it, or None where it cannot (padding)."""
    if packed.in_padded != packed.n_in or packed.out_padded != packed.out:
        return None
    kind = _kind(packed)
    if kind in (1, 3, 4):
        wp, scale, b = packed.args  # (scale: int8's per row; Q4_1B's and Q2B's the rows' steps of d)
    else:
        (wp, b), scale = packed.args, None
    return _MatDesc(kind, 0, wp, scale, b, packed.n_in, packed.out)


class LayerStack:
    """A model's decoder layers as one ``decode_layers`` call: every pass (a few tokens or a
    whole prompt) runs its layers in C without returning to Python between products (the same functions
    and order as the per-layer path, so the same bits). ``build`` returns None where a
    matrix is not on our kernel or is padded."""

    def __init__(self, descs: list[_LayerDesc], keep: list):
        self.layers = (_LayerDesc * len(descs))(*descs)
        self.count = len(descs)
        self._keep = keep  # the tensors whose memory the descriptors point into
        self._segments: dict[tuple[int, int], LayerStack] = {}

    def segment(self, first: int, stop: int) -> LayerStack:
        """Layers [first, stop) as a stack of their own (run it with the cache from layer
        `first` on: k[first:], v[first:]); kept, so a pass builds none."""
        if not 0 <= first < stop <= self.count:
            raise ValueError(f"no layers [{first}, {stop}) in a stack of {self.count}")
        key = (first, stop)
        if key not in self._segments:
            self._segments[key] = LayerStack(list(self.layers[first:stop]), self._keep)
        return self._segments[key]

    @classmethod
    def build(cls, layers: list[tuple]) -> LayerStack | None:
        """layers: per layer (qkv, o, gate_up, down packed matrices, attn_norm, mlp_norm [E] float32)."""
        if not available():
            return None
        descs, keep = [], []
        for qkv, o, gate_up, down, attn_norm, mlp_norm in layers:
            mats = [_mat_desc(m) for m in (qkv, o, gate_up, down)]
            if any(m is None for m in mats):
                return None
            norms = [n.contiguous() for n in (attn_norm, mlp_norm)]
            if any(n.dtype != torch.float32 for n in norms):
                return None
            keep += [qkv, o, gate_up, down, *norms]
            descs.append(_LayerDesc(*mats, norms[0].data_ptr(), norms[1].data_ptr()))
        return cls(descs, keep)

    def run(self, x, cos, sin, k, v, start: int, heads: int, attend: int, mask, eps: float) -> None:
        """x [T, E] float32 contiguous, updated in place; cos, sin [T, D]; k, v the whole cache
        [L, Hkv, S, D] float32 contiguous; mask [T, attend] bool contiguous or None (causal)."""
        mask_ptr = mask.data_ptr() if mask is not None else None
        args = self.args(eps, cos, sin, k, v, start, heads)
        _state["lib"].decode_layers(x.data_ptr(), x.shape[0], *args, attend, mask_ptr, k.shape[3] ** -0.5)

    def args(self, eps: float, cos, sin, k, v, start: int, heads: int) -> tuple:
        """The layers' part of a decode_layers or greedy_chain call, in the C functions' order: the layers and
        their count, eps, the rotary rows, the cache (k, v [L, Hkv, S, D], float32 or bf16: ``kv_bf16``) and its
        shape, from slot start, and whether it is bf16."""
        _, kv_heads, capacity, dim = k.shape
        cache = (k.data_ptr(), v.data_ptr(), start, heads, kv_heads, capacity, dim, kv_bf16(k, v))
        return (self.layers, self.count, eps, cos.data_ptr(), sin.data_ptr(), *cache)


def top_rows(rows: list[torch.Tensor], top: int) -> list[list[int]]:
    """Each row's `top` best indices (value descending, the lower index first among equals, NaN never one):
    rows are float32 CPU vectors [n] of one length, each contiguous (they may live in different tensors).
    One call for all of them (decode_kernels.c's top_rows): a pass's top entries for the events."""
    if not rows:
        return []
    n = rows[0].shape[0]
    if not 1 <= top <= 1024 or any(r.dtype != torch.float32 or r.dim() != 1 or r.shape[0] != n for r in rows):
        raise ValueError("top_rows takes float32 vectors of one length and a top between 1 and 1024")
    rows = [r if r.is_contiguous() else r.contiguous() for r in rows]
    top = min(top, n)
    pointers = (ctypes.c_void_p * len(rows))(*(r.data_ptr() for r in rows))
    idx = np.empty((len(rows), top), dtype=np.int64)
    count = np.empty(len(rows), dtype=np.int64)
    _state["lib"].top_rows(pointers, len(rows), n, top, idx.ctypes.data, count.ctypes.data)
    return [idx[r, : count[r]].tolist() for r in range(len(rows))]


def _chain_args(token, n, embed, stack, cos, sin, k, v, start, heads, head, norm_weight, eps) -> tuple[list, int]:
    """A chain call's arguments up to its outputs (decode_kernels.c's greedy_chain and sampled_chain), checked;
    and the vocabulary V."""
    rescored = isinstance(head, RescoredQ4Head)
    desc = _mat_desc(head.q4 if rescored else head)
    if desc is None or (rescored and head.out_padded != head.out):
        raise ValueError("a draft chain needs an unpadded head")
    vocab = int(desc.out)
    capacity, dim = k.shape[2], k.shape[3]
    if start + n > capacity:
        raise ValueError(f"a chain of {n} from slot {start} does not fit a cache of {capacity}")
    if embed.dtype not in (torch.bfloat16, torch.float32) or not embed.is_contiguous():
        raise ValueError("a draft chain takes a contiguous bf16 or float32 embedding")
    if embed.shape != (vocab, desc.n_in) or not 0 <= int(token) < vocab:
        raise ValueError(
            f"a draft chain needs an embedding [{vocab}, {desc.n_in}] and a token id below {vocab}: "
            f"got {tuple(embed.shape)} and {int(token)}"
        )
    args = [
        int(token),
        n,
        embed.data_ptr(),
        embed.dtype == torch.float32,
        *stack.args(eps, cos, sin, k, v, start, heads),
        dim**-0.5,
        ctypes.byref(desc),
        norm_weight.data_ptr(),
        head.w8.data_ptr() if rescored else None,
        head.scale8.data_ptr() if rescored else None,
        head.top if rescored else 0,
    ]
    return args, vocab


def greedy_chain(
    token: int,
    n: int,
    embed: torch.Tensor,
    stack: LayerStack,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    heads: int,
    head,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, list[int]]:
    """n greedy one-token passes in one call (decode_kernels.c's greedy_chain): token at slot and position
    start, then each pass's argmax at the next. embed [V, E] bf16 or float32; cos, sin [n, D] float32 (the
    positions' rotary rows); k, v the whole cache as ``LayerStack.run`` takes it; head a packed matrix
    (``PackedWeight``, ``PackedInt8Weight``, ``PackedQ4_1Weight``, unpadded) or a ``RescoredQ4Head``
    (unpadded), its out the vocabulary; norm_weight [E] float32, the final norm. Returns (logits [n, V]
    float32, the n tokens chosen): bit for bit what n one-token passes and their argmax give."""
    args, vocab = _chain_args(token, n, embed, stack, cos, sin, k, v, start, heads, head, norm_weight, eps)
    logits = torch.empty(n, vocab, dtype=torch.float32)
    tokens = np.empty(n, dtype=np.int64)
    _state["lib"].greedy_chain(*args, logits.data_ptr(), tokens.ctypes.data)
    return logits, tokens.tolist()


def sampled_chain(
    token: int,
    n: int,
    embed: torch.Tensor,
    stack: LayerStack,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    heads: int,
    head,
    norm_weight: torch.Tensor,
    eps: float,
    temperature: float,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``greedy_chain``'s passes with each pass's token drawn from q = softmax(logits / temperature) at one
    uniform of ``uniforms`` ([n] float64 in [0, 1)) by the inverse CDF (decode_kernels.c's sampled_chain).
    Returns (logits [n, V] float32, bit for bit the one-token passes'; q [n, V] float32, the distributions
    the tokens were drawn from; the n tokens)."""
    if not (math.isfinite(temperature) and np.float32(temperature) > 0):
        raise ValueError(f"a sampled chain needs a finite temperature > 0 (as a float32), got {temperature}")
    if uniforms.dtype != torch.float64 or uniforms.shape != (n,) or not uniforms.is_contiguous():
        raise ValueError(f"a sampled chain takes [{n}] contiguous float64 uniforms")
    args, vocab = _chain_args(token, n, embed, stack, cos, sin, k, v, start, heads, head, norm_weight, eps)
    logits = torch.empty(n, vocab, dtype=torch.float32)
    q = torch.empty(n, vocab, dtype=torch.float32)
    tokens = np.empty(n, dtype=np.int64)
    tokens[:] = -1
    _state["lib"].sampled_chain(
        *args, logits.data_ptr(), tokens.ctypes.data, float(temperature), uniforms.data_ptr(), q.data_ptr()
    )
    if (tokens < 0).any():
        at = int((tokens < 0).argmax())
        raise ValueError(f"pass {at} of a sampled chain has a NaN or infinite logit (at temperature {temperature})")
    return logits, q, tokens.tolist()
