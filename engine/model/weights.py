"""The weight kinds of our forward's matrices: y = x W^T (+ b) with W in the model dtype, in int8 per output
channel (the int8 drafter), in GGUF's 4-bit blocks (the q4 drafter's layers, the q4_1 target), or in 4-bit
blocks with each row's best outputs computed again in int8 (the q4 drafter's output projection); and the
steps that turn a loaded model's matrices into one kind or another.

Why a module of their own: every kind answers the forward the same way -- ``__call__`` (the product),
``normed`` (RMSNorm(x) W^T in one fused kernel call, or None where not fused), ``shape``, ``bias``, ``nbytes``
-- and picks its product when it is built: our CPU kernels (engine/kernels/cpu_calls.py) where they run,
else torch's ops. The forward (engine/model/transformer.py) multiplies through that interface;
``kernel_matrix`` gives the packed form our layer stack and draft chains take.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels import cpu_build, cpu_calls
from engine.kernels.cpu_packed import (
    PackedInt8Weight,
    PackedQ4_1Weight,
    PackedWeight,
    RescoredQ4Head,
    int8_per_channel,
)

__all__ = [
    "Int8Linear",
    "Linear",
    "Q4Linear",
    "RescoredQ4Linear",
    "check_int8_device",
    "int8_refusal",
    "kernel_matrix",
    "quantize_q4_1",
    "use_gguf_q4_1",
]


class Linear:
    """y = x W^T (+ b) with W [out, in] in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias  # [out] or None
        self.shape = tuple(weight.shape)  # (out, in)
        self.element_size = weight.element_size()
        self._kernel = None  # PackedWeight: our kernels' layout (every variant)
        self._packed = None  # oneDNN's blocked layout
        self._weight = None  # plain [out, in]
        if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and cpu_build.available():
            # Our kernel (engine/kernels/csrc, the variant cpu_build chose for this
            # CPU), quicker than oneDNN on packed weights at the widths a pass has; the
            # avx2 variant reads as fast at 1 row and is compute bound beyond
            # (docs/bench/2026-11-30-cpu-kernel-variants.md,
            # docs/bench/2026-12-07-notes-from-kernels-and-model.md). Shape-invariant:
            # a row's result does not depend on the other rows of the pass.
            self._kernel = PackedWeight(weight, bias)
        else:
            # bf16 without our kernel: the weight is handed to oneDNN once,
            # reordered into its blocked layout (F.linear re-reads the plain layout
            # each call, slower over the same matrices:
            # docs/bench/2026-12-07-notes-from-kernels-and-model.md). Its rows are
            # shape-invariant too (checked bit for bit).
            self._packed = _onednn_pack(weight)
            if self._packed is None:
                self._weight = weight

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """RMSNorm(x) W^T fused into one kernel call, or None where not fused here."""
        if self._kernel is not None and x.dtype == torch.float32 and norm_weight.dtype == torch.float32:
            return cpu_calls.run_packed(x.contiguous(), self._kernel, norm_weight, eps)
        return None

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] matrix (unpacked on demand from a kernel layout)."""
        if self._kernel is not None:
            return self._kernel.unpack()
        return self._weight if self._weight is not None else self._packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return cpu_calls.run_packed(x.contiguous(), self._kernel)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [], "")
        if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu":
            # float32 on the CPU: W @ x^T lets BLAS stream W once without packing
            # it, quicker than x @ W^T for the vocabulary projection. A single row
            # is duplicated: with one row the BLAS takes its matrix-vector path,
            # which reads weights slower than the two-column matrix product; the
            # extra column costs no extra bytes. Layouts matter as much as shapes
            # here: x is made row-major first (an input with transposed strides
            # sends MKL down a slower path for the down projection), and y is
            # returned row-major (a transposed view leaves the queries with a
            # last-dim stride != 1, which pushes attention off its flash kernel
            # onto the math fallback). Figures:
            # docs/bench/2026-12-07-notes-from-kernels-and-model.md.
            rows = x.shape[0]
            x = x.contiguous() if rows > 1 else x.expand(2, -1).contiguous()  # [max(rows, 2), in]
            y = (self._weight @ x.t())[:, :rows].t().contiguous()  # [rows, out]
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self._weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.element_size


_ONEDNN_LINEAR: list[bool] = []


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered for oneDNN's linear, or None where that path is not
    used: only bf16 on the CPU, and only if this torch build has the ops and
    they agree with a reference product (checked once)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if not _ONEDNN_LINEAR:
        try:
            w = torch.randn(48, 64).to(torch.bfloat16)
            x = torch.randn(3, 64).to(torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            ref = F.linear(x.float(), w.float())
            _ONEDNN_LINEAR.append(bool(torch.allclose(got.float(), ref, rtol=2e-2, atol=1e-1)))
        except (RuntimeError, AttributeError):
            _ONEDNN_LINEAR.append(False)
    if not _ONEDNN_LINEAR[0]:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


class Int8Linear:
    """Weight-only int8, symmetric per output channel: W ~= scale[:, None] * W_int8.

    The int8 drafter is the target with every matrix stored like this: a quarter
    of the float32 bytes to read per token, slightly different logits, hence a
    cheap drafter whose guesses the full-precision target usually agrees with.

    Kernel: torch's int8 weight-only matmul, which is fast with bf16 activations;
    float32 activations are rounded to bf16 just for the product (elementwise
    work stays in float32, which is faster than bf16 on CPUs without native
    bf16). The activations are not quantised to int8 (fbgemm's dynamic int8
    linear): per-tensor int8 cannot hold the outlier channels of the residual
    stream, and the drafts would be useless (docs/bench/2026-12-07-notes-from-kernels-and-model.md).
    Without the kernel, dequantise and multiply. The drafter's precision never affects exactness:
    q can be any distribution.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight_int8, scale = int8_per_channel(weight)  # [out, in] int8, [out]
        self.dtype = weight.dtype
        # The kernel's activation dtype: bf16 for float32 models on the CPU.
        self.kernel_dtype = _int8_kernel_dtype(weight.device, weight.dtype)
        self.scale = scale.to(self.kernel_dtype)  # [out]
        self.bias = bias
        self._packed = None
        if weight.device.type == "cpu" and cpu_build.available():
            # Our kernel (engine/kernels/csrc): each row of x quantised to int16
            # (13-15 bits of range, not the 8 that fail above), exact int32 dot
            # products (vpdpwssd on AVX512-VNNI, vpmaddwd on the avx512 / avx2
            # variants), per-channel scale at the end; quicker than torch's int8
            # kernel (docs/bench/2026-12-07-notes-from-kernels-and-model.md).
            bias_bf16 = bias.to(torch.bfloat16) if bias is not None else None
            self._packed = PackedInt8Weight(self.weight_int8, scale, bias_bf16)
        self.shape = tuple(self.weight_int8.shape)  # (out, in)
        if self._packed is not None:
            self.weight_int8 = None  # the packed copy is the only one kept (half the drafter's memory)
        # torch's kernel, probed where this weight lives (a CPU probe says nothing about CUDA).
        self._fast = self._packed is None and _int8_kernel_works(weight.device, self.kernel_dtype)
        if self._packed is None and not self._fast and weight.device.type != "cpu":
            # Off the CPU the dequantising fallback would rebuild a float copy of every matrix on
            # every pass, slower than the target it is meant to draft for: refuse it instead.
            raise ValueError(int8_refusal(weight.device, self.kernel_dtype))

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """RMSNorm(x) W^T fused into one kernel call, or None where not fused here."""
        if (
            self._packed is not None
            and x.dim() == 2
            and x.dtype == torch.float32
            and norm_weight.dtype == torch.float32
        ):
            return cpu_calls.run_packed(x.contiguous(), self._packed, norm_weight, eps)
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            shape = x.shape
            y = cpu_calls.run_packed(x.reshape(-1, shape[-1]).contiguous(), self._packed)
            return y.reshape(*shape[:-1], y.shape[-1])
        if self._fast:
            shape = x.shape
            xk = x.reshape(-1, shape[-1]).to(self.kernel_dtype)
            y = torch._weight_int8pack_mm(xk, self.weight_int8, self.scale).to(x.dtype)
            y = y.reshape(*shape[:-1], y.shape[-1])
        else:
            y = F.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        return y + self.bias if self.bias is not None else y

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] + self.scale.numel() * self.scale.element_size()


_INT8_KERNEL: dict[tuple[str, torch.dtype], bool] = {}


def _int8_kernel_dtype(device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype Int8Linear hands torch's int8 kernel: bf16 for float32 models on the CPU."""
    return torch.bfloat16 if weight_dtype == torch.float32 and torch.device(device).type == "cpu" else weight_dtype


def _int8_kernel_works(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether torch's int8 weight-only matmul (``torch._weight_int8pack_mm``) runs and is
    right for `dtype` activations on `device`: probed there, on that device's tensors,
    once per (device, dtype). Its kernels are per device (the CPU's everywhere, others
    depending on the torch version) and per dtype (the CPU one refuses float64), so a probe elsewhere
    proves nothing about the tensors the drafter will multiply."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _INT8_KERNEL:
        try:
            gen = torch.Generator().manual_seed(0)  # drawn on the CPU, then moved: same inputs everywhere
            x = torch.randn(2, 64, generator=gen).to(device=device, dtype=dtype)
            w = torch.randint(-127, 127, (32, 64), generator=gen, dtype=torch.int8).to(device)
            s = torch.rand(32, generator=gen).to(device=device, dtype=dtype)
            got = torch._weight_int8pack_mm(x, w, s)
            ref = F.linear(x.float(), w.float()) * s.float()
            _INT8_KERNEL[key] = bool(torch.allclose(got.float(), ref, rtol=2e-2, atol=2e-1))
        except (RuntimeError, AttributeError, NotImplementedError, TypeError):
            _INT8_KERNEL[key] = False
    return _INT8_KERNEL[key]


def int8_refusal(device: torch.device | str, dtype: torch.dtype) -> str:
    """The ValueError message for an int8 drafter on a device without torch's int8 kernel."""
    device = torch.device(device)
    return (
        f"int8 drafting needs torch's int8 weight-only matmul (torch._weight_int8pack_mm) for {dtype} "
        f"activations on {device}, which torch {torch.__version__} does not provide there; "
        "choose ngram, suffix or eagle"
    )


def check_int8_device(device: torch.device | str, weight_dtype: torch.dtype) -> None:
    """Raise ValueError, before any weight is quantised, where Int8Linear would have no int8
    path for `weight_dtype` weights on `device`. The CPU always has one (our kernel, torch's,
    or dequantising); elsewhere torch's kernel must work there (probed on that device)."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    dtype = _int8_kernel_dtype(device, weight_dtype)
    if not _int8_kernel_works(device, dtype):
        raise ValueError(int8_refusal(device, dtype))


class Q4Linear:
    """y = x W^T (+ b) with W in GGUF's Q4_1 kind (PackedQ4_1Weight: per 32
    inputs w = d * q + m, q in 0..15, float16 d and m; 0.625 bytes per weight), or in
    Q4_1B (PackedQ4_1BWeight: the same nibbles, d and m coded in a byte each;
    0.5625 bytes per weight: the q4 drafter's).

    On our kernel (every variant, same numbers on each): each row of x quantised to
    int8 per 16 inputs, exact integer sums per half of each 32-input group, the scales
    applied per group (decode_kernels.c). The weights are the GGUF's own, not rounded
    to bf16; one pass reads 66 MB of layer weights for the default model instead of
    212 MB in bf16, so a one-row sweep of the layers is quicker too
    (docs/bench/2026-12-07-notes-from-kernels-and-model.md). Without a kernel the
    dequantised matrix is multiplied by torch in float32."""

    def __init__(self, packed: PackedQ4_1Weight):
        self.packed = packed
        self.shape = (packed.out, packed.n_in)  # (out, in)
        self.bias = packed.bias[: packed.out] if packed.bias is not None else None
        self._dense = None if cpu_build.available() else packed.unpack()

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised [out, in] matrix, float32 (the int8 drafter quantises it)."""
        return self._dense if self._dense is not None else self.packed.unpack()

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """RMSNorm(x) W^T fused into one kernel call, or None where not fused here."""
        if self._dense is None and x.dim() == 2 and x.dtype == torch.float32 and norm_weight.dtype == torch.float32:
            return cpu_calls.run_packed(x.contiguous(), self.packed, norm_weight, eps)
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is None:
            shape = x.shape
            y = cpu_calls.run_packed(x.reshape(-1, shape[-1]).contiguous(), self.packed)
            return y.reshape(*shape[:-1], y.shape[-1])
        y = F.linear(x.float(), self._dense, self.bias.float() if self.bias is not None else None)
        return y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


class RescoredQ4Linear:
    """The q4 drafter's output projection (no bias): Q4_1 (or Q4_1B, `packing`: the q4 drafter's) for every
    output, each row's `top` best outputs computed again in int8 (RescoredQ4Head, decode_kernels.c's
    head_q4_rescored): 18 MB (Q4_1B 16 MB) read per pass for the default model against 28 MB in int8, and
    the greedy drafts the int8 head would make, where Q4_1 alone makes worse ones
    (docs/bench/2026-12-05-q4-rescored-head.md, docs/bench/2026-12-07-notes-from-kernels-and-model.md).
    CPU kernels only. The drafter's precision never affects exactness: q can be any distribution."""

    TOP = 32  # outputs re-scored per row

    def __init__(self, weight: torch.Tensor, top: int = TOP, packing: type = PackedQ4_1Weight):
        self.head = RescoredQ4Head(weight, top, packing)
        self.shape = (self.head.out, self.head.n_in)  # (out, in)
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        """The Q4_1 matrix dequantised [out, in], float32 (what most outputs are computed from)."""
        return self.head.q4.unpack()

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """RMSNorm(x) W^T fused into one kernel call, or None where not fused here."""
        if x.dim() == 2 and x.dtype == torch.float32 and norm_weight.dtype == torch.float32:
            return cpu_calls.head_q4_rescored(x, self.head, norm_weight, eps)
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = cpu_calls.head_q4_rescored(x.reshape(-1, shape[-1]), self.head)
        return y.reshape(*shape[:-1], y.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.head.nbytes


def quantize_q4_1(model, packing: type = PackedQ4_1Weight) -> int:
    """Quantise every layer matrix of `model` (a Transformer) to Q4_1 blocks (llama.cpp's rule; `packing`
    PackedQ4_1BWeight: Q4_1B's) on a Q4Linear, for models that do not come from a Q4_1
    GGUF (the default model has its own blocks: use_gguf_q4_1). The embedding / output
    projection stays as loaded. Returns how many fused matrices were quantised."""
    count = 0
    for layer in model.layers:
        for attr in ("qkv", "o", "gate_up", "down"):
            current = getattr(layer, attr)
            if isinstance(current, Q4Linear):
                continue
            bias = current.bias.to(torch.bfloat16) if getattr(current, "bias", None) is not None else None
            setattr(layer, attr, Q4Linear(packing.quantize(current.weight, bias)))
            count += 1
    return count


def use_gguf_q4_1(model, gguf_path, packing: type = PackedQ4_1Weight) -> int:
    """Swap every layer matrix of `model` (a Transformer) that the GGUF file stores as Q4_1 for a
    Q4Linear on the file's own blocks (the default model: all 210 of them; its Q8_0
    embedding / tied output projection stays as loaded); `packing` PackedQ4_1BWeight
    keeps their nibbles with the scales in bytes (Q4_1B). Returns how many fused
    matrices were swapped. The file must hold the model's weights: each swapped
    matrix is checked against the loaded one (transformers' dequantisation of the
    same file) and a mismatch raises ValueError before anything is changed.

    llama.cpp's converter permutes the rows of the query and key projections (its
    rotary pairs adjacent dimensions); they are permuted back, as transformers does,
    which moves whole rows and so keeps the 32-input blocks intact."""
    import gguf  # transformers' GGUF loader needs it too

    cfg = model.cfg
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    q4_type = gguf.GGMLQuantizationType.Q4_1

    def rows(name: str, heads: int | None = None) -> torch.Tensor | None:
        t = tensors.get(name)
        if t is None or t.tensor_type != q4_type:
            return None
        raw = t.data  # numpy uint8 [out, in / 32 * 20]
        if heads is not None:  # undo llama.cpp's permute: its rows [H, D/2, 2] are ours [H, 2, D/2]
            out = raw.shape[0]
            raw = raw.reshape(heads, out // heads // 2, 2, -1).swapaxes(1, 2).reshape(out, -1)
        return raw

    swapped = []
    for i, layer in enumerate(model.layers):
        pre = f"blk.{i}."
        parts = {
            "qkv": [rows(pre + "attn_q.weight", cfg.num_heads), rows(pre + "attn_k.weight", cfg.num_kv_heads)]
            + [rows(pre + "attn_v.weight")],
            "o": [rows(pre + "attn_output.weight")],
            "gate_up": [rows(pre + "ffn_gate.weight"), rows(pre + "ffn_up.weight")],
            "down": [rows(pre + "ffn_down.weight")],
        }
        for attr, raws in parts.items():
            if any(r is None for r in raws):
                continue
            current = getattr(layer, attr)
            raw = np.concatenate(raws)
            bias = current.bias.to(torch.bfloat16) if getattr(current, "bias", None) is not None else None
            new = Q4Linear(packing.from_gguf_blocks(raw, current.shape[1], bias))
            # One product each against the loaded matrix (transformers' dequantisation of the
            # same blocks, maybe rounded to bf16): a wrong file or row order is off by O(1) of the
            # largest output; bf16 rounding, the kernel's int8 rows (one scale per 16 inputs) and
            # Q4_1B's codes by well under the 2% tolerance on this random probe. A product, not a
            # comparison of the matrices, which is slow on a small host (figures:
            # docs/bench/2026-12-07-notes-from-kernels-and-model.md).
            probe = torch.randn(1, current.shape[1], generator=torch.Generator().manual_seed(i))
            want, got = current(probe.to(model.act_dtype)).float(), new(probe.to(model.act_dtype)).float()
            if new.shape != current.shape or (got - want).abs().max() > 2e-2 * want.abs().max():
                raise ValueError(f"{gguf_path}: Q4_1 blocks of layer {i} {attr} do not match the loaded weights")
            swapped.append((layer, attr, new))
    for layer, attr, new in swapped:
        setattr(layer, attr, new)
    return len(swapped)


def kernel_matrix(linear):
    """The packed matrix our kernels multiply for this layer matrix, or None (torch's product)."""
    if isinstance(linear, Linear):
        return linear._kernel
    if isinstance(linear, Int8Linear):
        return linear._packed
    if isinstance(linear, Q4Linear) and linear._dense is None:
        return linear.packed
    return None
