"""Our CPU kernels' libraries: one per instruction set, compiled from csrc/ when first needed, self-checked,
and the one this CPU runs chosen and loaded.

Variants (``VARIANTS``, best first; the first the CPU supports that builds and passes its self-check runs;
``variant()`` says which, ``describe()`` why), each chosen by the CPU's flags (``Variant.cpu_flags``):

* ``avx512bf16`` -- AVX512-BF16 + AVX512-VNNI: x rounded to bf16, ``vdpbf16ps`` on the packed weights; int8
  on ``vpdpwssd``.
* ``avx512`` -- AVX-512F/BW/VL without BF16: bf16 weights widened to float32 in 512-bit registers (a 16-bit
  shift), FMA with float32 activations; int8 on ``vpmaddwd``.
* ``avx2`` -- AVX2 + FMA (x86-64-v3): bf16 weights widened to float32 on 256-bit registers by unpacking with
  zero, the even and odd inputs summed apart (one FMA chain per accumulator: 16 registers cannot hide two
  chained FMAs per pair, see ``csrc/isa_avx2.h``); int8 on ``vpmaddwd``.

On other CPUs (ARM64, x86 without AVX2/FMA) no variant runs and the model uses torch's ops. A variant's
library is compiled with the system C compiler into the SpecLens cache, self-checked against torch (values,
and row invariance bit for bit) and reused while the sources are unchanged. ``SPECLENS_CPU_KERNEL`` forces a
choice: ``0`` (off), ``auto`` (the default), or a variant's name (tests and benchmarks run ``avx2`` on an
AVX-512 host that way). Where no kernel can be used (no variant for this CPU, no compiler, a failed build,
SPECLENS_CPU_KERNEL=0) ``available()`` is False with ``why_unavailable()`` saying why.

engine/kernels/cpu_calls.py calls the loaded library. ``packed_product`` is here because the self-check
multiplies on a library before any is chosen: it is the one product call, the self-check's and the calls'.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import config
from engine.host import cpu_flags
from engine.kernels.cpu_packed import Q4_GROUP, PackedInt8Weight, PackedQ4_1BWeight, PackedQ4_1Weight, PackedWeight
from engine.paths import cache_dir

__all__ = [
    "VARIANTS",
    "Variant",
    "available",
    "describe",
    "load_variant",
    "packed_product",
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

# "lib", "variant", "why", "reason"; "built": {name: lib or error string}. Updated in place, never rebound:
# engine/kernels/cpu_calls.py holds this dict and reads "lib" on every call.
_state: dict = {}
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


def packed_product(
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
            checks.append((packed_product(lib, xin, packed, out_dtype), x.float() @ w.float().t() + b.float()))
            checks.append(
                (packed_product(lib, xin, packed_int8, out_dtype), (x.float() @ q.float().t()) * scale + b.float())
            )
        q4 = PackedQ4_1Weight(
            torch.randint(0, 16, (n_out, n_in), generator=gen, dtype=torch.uint8),
            (torch.rand(n_out, -(-n_in // Q4_GROUP), generator=gen) / 8).half(),
            (torch.randn(n_out, -(-n_in // Q4_GROUP), generator=gen) / 4).half(),
            b,
        )
        checks.append((packed_product(lib, x.float(), q4, torch.float32), x.float() @ q4.unpack().t() + b.float()))
        q4b = PackedQ4_1BWeight.quantize(w, b)
        checks.append((packed_product(lib, x.float(), q4b, torch.float32), x.float() @ q4b.unpack().t() + b.float()))
        g = torch.rand(n_in, generator=gen) + 0.5
        xn = torch.nn.functional.rms_norm(x.float(), (n_in,), g, 1e-5)
        checks.append((packed_product(lib, x.float(), PackedWeight(w), torch.float32, g, 1e-5), xn @ w.float().t()))
        for got, ref in checks:
            if not torch.allclose(got.float(), ref, rtol=2e-2, atol=5e-2 * n_in**0.5):
                raise RuntimeError(f"self-check failed at rows={rows} in={n_in} out={n_out}")
        for p in (packed, packed_int8, q4, q4b):
            full = packed_product(lib, x.float(), p, torch.float32)
            if not all(
                torch.equal(packed_product(lib, x[r : r + 1].float(), p, torch.float32), full[r : r + 1])
                for r in range(rows)
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
    _state.update(lib=lib, variant=name, why=None, reason=f"selected by cpu_build.using({name!r})")
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)
