"""The calls into our CPU kernels: what the model's forward runs through ctypes on the loaded variant.

The forward's hot loops run here: products of a pass's few rows with packed weights (the RMSNorm of x
optionally fused in; the q4 drafter's re-scored output projection), attention of a pass's new tokens over
the KV cache (causal or under a draft tree's mask), the rotary embedding with the cache write, the SwiGLU,
whole stacks of decoder layers in one call (``LayerStack``), whole draft chains in one call
(``greedy_chain``, ``sampled_chain``, given a ``ChainArgs``), and each row's best entries for the events
(``top_rows``). The C source, ``csrc/decode_kernels.c``, says what each computes.

Why not torch's own ops: a decoding pass is many small matrix products and attentions, and at these sizes
per-call overhead decides (docs/bench/2026-12-07-notes-from-kernels-and-model.md). Every kernel of every
variant computes each token of a pass on its own, in the same order whatever the pass width (see the C
file), so a K-token verification pass gives bit for bit the logits of K one-token passes. (Variants differ
from each other in the last bits.)

The calls take weights packed by engine/kernels/cpu_packed.py and run the library engine/kernels/cpu_build.py
loaded; the fast paths the model uses (``run_packed``, ``rope_and_store``, ``attend_few`` with check=False,
``LayerStack.run``) validate no more than their shapes and need ``available()`` to hold.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.cpu_build import _state, available, packed_product, why_unavailable
from engine.kernels.cpu_packed import (
    PackedInt8Weight,
    PackedQ4_1BWeight,
    PackedQ4_1Weight,
    PackedWeight,
    RescoredQ4Head,
)

__all__ = [
    "KV_DTYPES",
    "ChainArgs",
    "LayerStack",
    "attend_few",
    "greedy_chain",
    "head_q4_rescored",
    "kv_bf16",
    "rope_and_store",
    "run_packed",
    "sampled_chain",
    "skinny_gemm_bf16",
    "swiglu",
    "top_rows",
]

# The KV caches the kernels read and write: float32 (the target's), or bf16 (a drafter's: half the bytes per
# attended position; the model's kv_dtype).
KV_DTYPES = (torch.float32, torch.bfloat16)


def run_packed(
    x: torch.Tensor, packed: PackedWeight | PackedInt8Weight, norm_weight: torch.Tensor | None = None, eps: float = 0.0
) -> torch.Tensor:
    """The model's unchecked fast path: x [rows, in] contiguous float32 or bf16 (float32
    with norm_weight), y in x's dtype. The kernel must be available; see skinny_gemm_bf16."""
    return packed_product(None, x, packed, x.dtype, norm_weight, eps)


def skinny_gemm_bf16(
    x: torch.Tensor,
    packed: PackedWeight | PackedInt8Weight | PackedQ4_1Weight | PackedQ4_1BWeight,
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """y [rows, out] = x [rows, in] @ W^T (+ bias) on the CPU, W and bias given packed, checked: the product
    of the packed kind's C kernel (``cpu_build.packed_product`` picks it).

    x is bf16 or float32; y is out_dtype, by default x's dtype (float32 output skips the final
    rounding: the accumulator is stored as is). With norm_weight [in] (float32,
    float32 x only) each row is RMS-normalised first: y = RMSNorm(x) @ W^T, the
    norm fused into the kernel's pass over x. Per kind:

    * bf16 (``PackedWeight``): on avx512bf16 float32 x is rounded to bf16 for the products, inside the
      kernel; the widening variants multiply float32 as is and widen bf16 x exactly.
    * int8 (``PackedInt8Weight``, the int8 drafter's): (x @ Q^T) * scale (+ bias), x quantised per row to
      int16 inside the kernel (decode_kernels.c's skinny_gemm_int8w).
    * Q4_1 (``PackedQ4_1Weight``): dequantised in registers and multiplied in float32, x never rounded to
      bf16 on any variant (skinny_gemm_q4_1).
    * Q4_1B (``PackedQ4_1BWeight``): Q4_1's rows of x and integer sums, the byte-coded scales applied per
      group (skinny_gemm_q4_1b).
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
    return packed_product(None, x.contiguous(), packed, out_dtype, norm_weight, eps)


def head_q4_rescored(
    x: torch.Tensor, head: RescoredQ4Head, norm_weight: torch.Tensor | None = None, eps: float = 1e-6, lib=None
) -> torch.Tensor:
    """y [rows, out] float32: x [rows, in] (float32 or bf16; float32 with norm_weight, RMS-normalised first)
    through the head's blocks, each row's `head.top` best outputs overwritten with the int8 product's values:
    those entries equal the int8 product's (``skinny_gemm_bf16`` on the same int8 matrix) bit for bit, the others
    the blocks' product (``skinny_gemm_bf16`` on ``head.q4``). Where `in` is not a multiple of 32, rows to
    normalise are normalised by torch first, as the 4-bit product does: the int8 product then on those rows."""
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
    """decode_kernels.c's mat_desc kind of a packed matrix: 0 bf16, 1 int8, 2 Q4_1, 3 Q4_1B."""
    kinds = ((PackedInt8Weight, 1), (PackedQ4_1Weight, 2), (PackedQ4_1BWeight, 3))
    return next((kind for cls, kind in kinds if isinstance(packed, cls)), 0)


def _mat_desc(packed) -> _MatDesc | None:
    """A packed matrix as decode_layers reads it, or None where it cannot (padding)."""
    if packed.in_padded != packed.n_in or packed.out_padded != packed.out:
        return None
    kind = _kind(packed)
    if kind in (1, 3):
        wp, scale, b = packed.args  # (scale: int8's per row; Q4_1B's the rows' steps of d)
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


@dataclass  # (not frozen: one is built per chain call, and a frozen one sets each field by object.__setattr__)
class ChainArgs:
    """What a draft chain runs on (decode_kernels.c's greedy_chain and sampled_chain): n one-token passes of
    a model whose matrices and attention are all on our kernels, the first fed `token` at slot and position
    `start`, each later one the token the pass before chose."""

    token: int  # the first pass's token id
    n: int  # passes
    embed: torch.Tensor  # [V, E] bf16 or float32, contiguous: the next pass's input row is read here
    stack: LayerStack  # the model's layers
    cos: torch.Tensor  # [n, D] float32: the positions' rotary rows
    sin: torch.Tensor  # [n, D] float32
    k: torch.Tensor  # [L, Hkv, S, D] the whole cache, as LayerStack.run takes it
    v: torch.Tensor  # [L, Hkv, S, D]
    start: int  # the first pass's slot and position
    heads: int  # query heads H
    head: object  # the lm_head: a packed matrix (unpadded) or a RescoredQ4Head (unpadded), its out V
    norm_weight: torch.Tensor  # [E] float32: the final norm
    eps: float  # the RMSNorms' eps


def _chain_args(chain: ChainArgs) -> tuple[list, int]:
    """A chain call's arguments up to its outputs (decode_kernels.c's greedy_chain and sampled_chain), checked;
    and the vocabulary V."""
    token, n, embed, head, k = chain.token, chain.n, chain.embed, chain.head, chain.k
    rescored = isinstance(head, RescoredQ4Head)
    desc = _mat_desc(head.q4 if rescored else head)
    if desc is None or (rescored and head.out_padded != head.out):
        raise ValueError("a draft chain needs an unpadded head")
    vocab = int(desc.out)
    capacity, dim = k.shape[2], k.shape[3]
    if chain.start + n > capacity:
        raise ValueError(f"a chain of {n} from slot {chain.start} does not fit a cache of {capacity}")
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
        *chain.stack.args(chain.eps, chain.cos, chain.sin, k, chain.v, chain.start, chain.heads),
        dim**-0.5,
        ctypes.byref(desc),
        chain.norm_weight.data_ptr(),
        head.w8.data_ptr() if rescored else None,
        head.scale8.data_ptr() if rescored else None,
        head.top if rescored else 0,
    ]
    return args, vocab


def greedy_chain(chain: ChainArgs) -> tuple[torch.Tensor, list[int]]:
    """chain.n greedy one-token passes in one call (decode_kernels.c's greedy_chain): chain.token at slot and
    position chain.start, then each pass's argmax at the next. Returns (logits [n, V] float32, the n tokens
    chosen): bit for bit what n one-token passes and their argmax give."""
    args, vocab = _chain_args(chain)
    logits = torch.empty(chain.n, vocab, dtype=torch.float32)
    tokens = np.empty(chain.n, dtype=np.int64)
    _state["lib"].greedy_chain(*args, logits.data_ptr(), tokens.ctypes.data)
    return logits, tokens.tolist()


def sampled_chain(
    chain: ChainArgs, temperature: float, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``greedy_chain``'s passes with each pass's token drawn from q = softmax(logits / temperature) at one
    uniform of ``uniforms`` ([n] float64 in [0, 1)) by the inverse CDF (decode_kernels.c's sampled_chain).
    Returns (logits [n, V] float32, bit for bit the one-token passes'; q [n, V] float32, the distributions
    the tokens were drawn from; the n tokens)."""
    n = chain.n
    if not (math.isfinite(temperature) and np.float32(temperature) > 0):
        raise ValueError(f"a sampled chain needs a finite temperature > 0 (as a float32), got {temperature}")
    if uniforms.dtype != torch.float64 or uniforms.shape != (n,) or not uniforms.is_contiguous():
        raise ValueError(f"a sampled chain takes [{n}] contiguous float64 uniforms")
    args, vocab = _chain_args(chain)
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
