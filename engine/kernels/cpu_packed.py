"""The weight layouts our CPU kernels multiply: each matrix packed once, at load, in the order
csrc/decode_kernels.c reads it.

Why a layout of our own: a decoding pass streams every weight once for a few rows of x, so the kernels
read each matrix as lines of 16 outputs (one vector of accumulators) in the order they multiply them, with
no gather and no reshuffle per pass. Every kind pads its matrix to whole blocks with zero weights and keeps
what the calls need: the true and padded sizes (``out``, ``n_in``, ``out_padded``, ``in_padded``), the
pointers the C function takes (``args``) and its sizes (``sizes``); ``unpack`` gives the matrix back as the
kernel multiplies it. The layout is the same for every instruction set, so a matrix is packed once whatever
variant runs.

Packing is numpy and torch only: nothing here compiles or calls C (engine/kernels/cpu_build.py builds the
variants, engine/kernels/cpu_calls.py calls them), so the build's self-check packs its test matrices here
before any variant is chosen. The packed bytes live on huge pages (engine/kernels/pages.py): every pass
streams them.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import pages

__all__ = [
    "PackedInt8Weight",
    "PackedQ4_1BWeight",
    "PackedQ4_1Weight",
    "PackedWeight",
    "Q4_GROUP",
    "RescoredQ4Head",
    "int8_per_channel",
]


def _padded_bias(bias: torch.Tensor | None, out: int, out_padded: int) -> torch.Tensor | None:
    """A matrix's bias [out] as every kind keeps it: bf16, zero-padded to out_padded; None without one."""
    if bias is None:
        return None
    padded = torch.zeros(out_padded, dtype=torch.bfloat16)
    padded[:out] = bias
    return padded


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
        self.bias = _padded_bias(bias, out, self.out_padded)
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
        self.bias = _padded_bias(bias, out, self.out_padded)
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
        _init_q4_1b(self, q, d, m, bias)  # q uint8 [out, in] in 0..15; d, m [out, in / 32]

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


def _init_q4_1b(packed, q, d, m, bias) -> None:
    """A PackedQ4_1BWeight's fields from q uint8 [out, in] in 0..15, d, m [out, in / 32] (any float): sizes
    padded (outputs to 16, inputs to 32), per block the codes dc[16], mc[16] (``_q4_1b_codes``) and then the
    padded q's nibbles [out/16, in/32, 256] (``_q4_nibbles``); dstep, the bias (bf16, padded) and the kernel's
    arguments."""
    q, d, m = (np.asarray(a.numpy() if isinstance(a, torch.Tensor) else a) for a in (q, d, m))
    out, n_in = q.shape
    packed.out, packed.n_in = out, n_in
    packed.out_padded, packed.in_padded = -(-out // 16) * 16, -(-n_in // Q4_GROUP) * Q4_GROUP
    groups, blocks = packed.in_padded // Q4_GROUP, packed.out_padded // 16
    qp = np.zeros((packed.out_padded, packed.in_padded), dtype=np.uint8)
    qp[:out, :n_in] = q
    d, m = d.astype(np.float32), m.astype(np.float32)
    dc, mc, step = _q4_1b_codes(qp[:out].reshape(out, -1, Q4_GROUP)[:, : d.shape[1]], d, m)
    dcp, mcp = (np.zeros((packed.out_padded, groups), dtype=np.uint8) for _ in range(2))
    dcp[:out, : dc.shape[1]], mcp[:out, : mc.shape[1]] = dc, mc
    heads = [a.reshape(blocks, 16, groups).transpose(0, 2, 1) for a in (dcp, mcp)]
    data = np.ascontiguousarray(np.concatenate([*heads, _q4_nibbles(qp)], axis=2))
    packed.data = pages.copy_of(torch.from_numpy(data))  # [out/16, in/32, 288], streamed by every pass: huge pages
    packed.dstep = torch.zeros(packed.out_padded, dtype=torch.float32)
    packed.dstep[:out] = torch.from_numpy(step)
    packed.bias = _padded_bias(bias, out, packed.out_padded)
    packed.sizes = (packed.in_padded, packed.out_padded)
    packed.args = (
        packed.data.data_ptr(),
        packed.dstep.data_ptr(),
        packed.bias.data_ptr() if packed.bias is not None else None,
    )


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


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8 [out, in], scale float32 [out]): W ~= scale[:, None] * Q, symmetric per output channel (the
    int8 drafter's rule, Int8Linear)."""
    w = weight.float()  # [out, in]
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0  # [out]
    return torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8).contiguous(), scale


class RescoredQ4Head:
    """An output projection W [out, in] for ``head_q4_rescored`` (engine/kernels/cpu_calls.py): W in Q4_1
    (llama.cpp's rule) or Q4_1B (`packing`: PackedQ4_1Weight or PackedQ4_1BWeight) for the whole product, and in
    int8 per channel (``int8_per_channel``, row-major, zero-padded like the 4-bit blocks) for each row's `top`
    best outputs, computed again (decode_kernels.c explains why). Reads the blocks and `top` int8 rows per row
    of x: for the default model's head 18 MB (Q4_1; Q4_1B 16 MB) + 18 KB per 32 rows re-scored, against int8's
    28 MB."""

    def __init__(
        self,
        weight: torch.Tensor,
        top: int,
        packing: type = PackedQ4_1Weight,
    ):
        if not 1 <= top <= 1024:  # (the kernel keeps a row's candidates in a sorted list on the stack)
            raise ValueError(f"a re-scored head re-scores between 1 and 1024 outputs per row, got top={top}")
        if packing not in (PackedQ4_1Weight, PackedQ4_1BWeight):
            raise ValueError(f"a re-scored head packs its blocks as Q4_1 or Q4_1B, not {packing!r}")
        self.q4 = packing.quantize(weight)
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


def _q4_1_fields(raw, n_in: int):
    """d, m float16 [out, in / 32] and q uint8 [out, in] of GGUF Q4_1 bytes [out, in / 32 * 20]."""
    raw = np.asarray(raw.numpy() if isinstance(raw, torch.Tensor) else raw, dtype=np.uint8)
    blocks = raw.reshape(raw.shape[0], n_in // Q4_GROUP, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    return d, m, np.concatenate([qs & 15, qs >> 4], axis=2).reshape(raw.shape[0], n_in)
