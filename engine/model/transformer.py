"""A lean decoder-only transformer (Llama / Qwen2 / Mistral family) with a static KV cache.

transformers loads and converts the weights; decoding runs here, in plain torch,
because speculative decoding needs three things a generic model wrapper makes
slow or awkward: a pre-allocated KV cache that can be rolled back or compacted in
place, arbitrary 4-D attention masks (a draft tree is verified in one pass), and
positions given per token (tree nodes sit at ``prefix + depth``).

Shapes: T = tokens in this forward, S = cache capacity, H = query heads,
Hkv = key/value heads, D = head dim, E = hidden size, V = vocabulary.

One module on purpose: the forward and the weight kinds it multiplies with (every
``*Linear`` class here) are one concern; split, every kind would reach back into the
forward's private layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels, pages

__all__ = [
    "ModelConfig",
    "KVCache",
    "Transformer",
    "Linear",
    "Int8Linear",
    "Q4Linear",
    "quantize_q4_1",
    "use_gguf_q4_1",
]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf(cls, cfg) -> ModelConfig:
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rope_theta = getattr(cfg, "rope_theta", None)
        if rope_theta is None:  # transformers 5 keeps it in rope_parameters
            params = getattr(cfg, "rope_parameters", None) or {}
            rope_theta = params.get("rope_theta", 10000.0)
            if params.get("rope_type", "default") not in ("default", None):
                raise ValueError(f"unsupported rope scaling {params.get('rope_type')!r}")
        else:
            scaling = getattr(cfg, "rope_scaling", None)
            if scaling and scaling.get("rope_type", scaling.get("type")) not in ("default", None):
                raise ValueError(f"unsupported rope scaling {scaling!r}")
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        )


class Linear:
    """y = x W^T (+ b) with W [out, in] in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias  # [out] or None
        self.shape = tuple(weight.shape)  # (out, in)
        self.element_size = weight.element_size()
        self._kernel = None  # cpu_kernels.PackedWeight: our kernels' layout (every variant)
        self._packed = None  # oneDNN's blocked layout
        self._weight = None  # plain [out, in]
        if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and cpu_kernels.available():
            # Our kernel (engine/kernels/csrc, the variant cpu_kernels chose for this
            # CPU), quicker than oneDNN on packed weights at the widths a pass has; the
            # avx2 variant reads as fast at 1 row and is compute bound beyond
            # (docs/bench/2026-11-30-cpu-kernel-variants.md,
            # docs/bench/2026-12-07-notes-from-kernels-and-model.md). Shape-invariant:
            # a row's result does not depend on the other rows of the pass.
            self._kernel = cpu_kernels.PackedWeight(weight, bias)
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
            return cpu_kernels.run_packed(x.contiguous(), self._kernel, norm_weight, eps)
        return None

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] matrix (unpacked on demand from a kernel layout)."""
        if self._kernel is not None:
            return self._kernel.unpack()
        return self._weight if self._weight is not None else self._packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return cpu_kernels.run_packed(x.contiguous(), self._kernel)
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
        self.weight_int8, scale = cpu_kernels.int8_per_channel(weight)  # [out, in] int8, [out]
        self.dtype = weight.dtype
        # The kernel's activation dtype: bf16 for float32 models on the CPU.
        self.kernel_dtype = _int8_kernel_dtype(weight.device, weight.dtype)
        self.scale = scale.to(self.kernel_dtype)  # [out]
        self.bias = bias
        self._packed = None
        if weight.device.type == "cpu" and cpu_kernels.available():
            # Our kernel (engine/kernels/csrc): each row of x quantised to int16
            # (13-15 bits of range, not the 8 that fail above), exact int32 dot
            # products (vpdpwssd on AVX512-VNNI, vpmaddwd on the avx512 / avx2
            # variants), per-channel scale at the end; quicker than torch's int8
            # kernel (docs/bench/2026-12-07-notes-from-kernels-and-model.md).
            bias_bf16 = bias.to(torch.bfloat16) if bias is not None else None
            self._packed = cpu_kernels.PackedInt8Weight(self.weight_int8, scale, bias_bf16)
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
            return cpu_kernels.run_packed(x.contiguous(), self._packed, norm_weight, eps)
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            shape = x.shape
            y = cpu_kernels.run_packed(x.reshape(-1, shape[-1]).contiguous(), self._packed)
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
    """y = x W^T (+ b) with W in GGUF's Q4_1 kind (cpu_kernels.PackedQ4_1Weight: per 32
    inputs w = d * q + m, q in 0..15, float16 d and m; 0.625 bytes per weight), or in
    Q4_1B (cpu_kernels.PackedQ4_1BWeight: the same nibbles, d and m coded in a byte each;
    0.5625 bytes per weight: the q4 drafter's).

    On our kernel (every variant, same numbers on each): each row of x quantised to
    int8 per 16 inputs, exact integer sums per half of each 32-input group, the scales
    applied per group (decode_kernels.c). The weights are the GGUF's own, not rounded
    to bf16; one pass reads 66 MB of layer weights for the default model instead of
    212 MB in bf16, so a one-row sweep of the layers is quicker too
    (docs/bench/2026-12-07-notes-from-kernels-and-model.md). Without a kernel the
    dequantised matrix is multiplied by torch in float32."""

    def __init__(self, packed: cpu_kernels.PackedQ4_1Weight):
        self.packed = packed
        self.shape = (packed.out, packed.n_in)  # (out, in)
        self.bias = packed.bias[: packed.out] if packed.bias is not None else None
        self._dense = None if cpu_kernels.available() else packed.unpack()

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised [out, in] matrix, float32 (the int8 drafter quantises it)."""
        return self._dense if self._dense is not None else self.packed.unpack()

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """RMSNorm(x) W^T fused into one kernel call, or None where not fused here."""
        if self._dense is None and x.dim() == 2 and x.dtype == torch.float32 and norm_weight.dtype == torch.float32:
            return cpu_kernels.run_packed(x.contiguous(), self.packed, norm_weight, eps)
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is None:
            shape = x.shape
            y = cpu_kernels.run_packed(x.reshape(-1, shape[-1]).contiguous(), self.packed)
            return y.reshape(*shape[:-1], y.shape[-1])
        y = F.linear(x.float(), self._dense, self.bias.float() if self.bias is not None else None)
        return y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


class RescoredQ4Linear:
    """The q4 drafter's output projection (no bias): Q4_1 (or Q4_1B, `packing`: the q4 drafter's) for every
    output, each row's `top` best outputs computed again in int8 (cpu_kernels.RescoredQ4Head, decode_kernels.c's
    head_q4_rescored): 18 MB (Q4_1B 16 MB) read per pass for the default model against 28 MB in int8, and
    the greedy drafts the int8 head would make, where Q4_1 alone makes worse ones
    (docs/bench/2026-12-05-q4-rescored-head.md, docs/bench/2026-12-07-notes-from-kernels-and-model.md).
    CPU kernels only. The drafter's precision never affects exactness: q can be any distribution."""

    TOP = 32  # outputs re-scored per row

    def __init__(
        self,
        weight: torch.Tensor,
        top: int = TOP,
        packing: type = cpu_kernels.PackedQ4_1Weight,
        importance: torch.Tensor | None = None,
    ):
        self.head = cpu_kernels.RescoredQ4Head(weight, top, packing, importance)
        self.shape = (self.head.out, self.head.n_in)  # (out, in)
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        """The Q4_1 matrix dequantised [out, in], float32 (what most outputs are computed from)."""
        return self.head.q4.unpack()

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """RMSNorm(x) W^T fused into one kernel call, or None where not fused here."""
        if x.dim() == 2 and x.dtype == torch.float32 and norm_weight.dtype == torch.float32:
            return cpu_kernels.head_q4_rescored(x, self.head, norm_weight, eps)
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = cpu_kernels.head_q4_rescored(x.reshape(-1, shape[-1]), self.head)
        return y.reshape(*shape[:-1], y.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.head.nbytes


def quantize_q4_1(model: Transformer, packing: type = cpu_kernels.PackedQ4_1Weight) -> int:
    """Quantise every layer matrix of `model` to Q4_1 blocks (llama.cpp's rule; `packing`
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


def use_gguf_q4_1(model: Transformer, gguf_path, packing: type = cpu_kernels.PackedQ4_1Weight) -> int:
    """Swap every layer matrix of `model` that the GGUF file stores as Q4_1 for a
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


@dataclass
class PassOutput:
    """What one target pass returns (``Transformer.run_pass``)."""

    logits: torch.Tensor  # [R, V] float32: the rows asked for (all T by default), on the host unless to_host=False
    hidden: torch.Tensor | None = None  # [T, E] pre-norm last-layer rows ([T, layers E] for a mix), when asked


class KVCache:
    """Pre-allocated keys and values for every layer; ``length`` tokens are valid.

    k, v: [L, Hkv, S, D]. Slots [0, length) hold the committed sequence in order;
    a forward writes its T new tokens at [length, length + T) (tree nodes included)
    and the caller then keeps some of them with ``keep`` or drops them with
    ``rollback``. No accepted token is ever recomputed.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
        if torch.device(device).type == "cpu":  # read by every pass: on huge pages (engine/kernels/pages.py)
            self.k, self.v = pages.zeros(shape, dtype, own_mapping=True), pages.zeros(shape, dtype, own_mapping=True)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` slots."""
        if not 0 <= length <= self.length + self.capacity:
            raise ValueError(f"cannot roll back to {length}")
        self.length = length

    def keep(self, base: int, offsets: list[int]) -> None:
        """Commit the tokens written at slots base + offsets (in that order) right
        after slot base - 1, discarding the other tree branches: the cache then
        equals the cache of running the accepted path alone."""
        dst = base
        for off in offsets:
            src = base + off
            if src != dst:
                self.k[:, :, dst].copy_(self.k[:, :, src])
                self.v[:, :, dst].copy_(self.v[:, :, src])
            dst += 1
        self.length = dst


def check_feature_layers(layers, n_layers: int) -> tuple[int, ...]:
    """The layers an EAGLE-3-style head reads, as a tuple, or ValueError: increasing layer
    numbers of a target of n_layers layers, ending with the last one."""
    try:
        chosen = tuple(int(i) for i in layers)
    except (TypeError, ValueError):
        chosen = ()
    if not chosen or list(chosen) != sorted(set(chosen)) or chosen[0] < 0 or chosen[-1] != n_layers - 1:
        raise ValueError(
            f"feature layers must be increasing layer numbers of the target (0..{n_layers - 1}) ending with "
            f"the last, {n_layers - 1}; got {layers!r}"
        )
    return chosen


_LAYER_EDITS = [0]  # bumped whenever a layer's matrix or norm is replaced: stale LayerStacks rebuild


class _Layer:
    __slots__ = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        _LAYER_EDITS[0] += 1


def _kernel_matrix(linear):
    """The packed matrix our kernels multiply for this layer matrix, or None (torch's product)."""
    if isinstance(linear, Linear):
        return linear._kernel
    if isinstance(linear, Int8Linear):
        return linear._packed
    if isinstance(linear, Q4Linear) and linear._dense is None:
        return linear.packed
    return None


class Transformer:
    """Inference-only forward over weights taken from a transformers state dict."""

    def __init__(
        self,
        cfg: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        int8: bool = False,
        device: torch.device | str | None = None,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.int8 = int8
        self.device = torch.device(device) if device is not None else next(iter(state.values())).device
        linear = Int8Linear if int8 else Linear
        # Activations (residual stream, norms, rotary, attention) in float32 where
        # our CPU kernel runs the bf16 products: it takes float32 rows, rounds them
        # to bf16 for the multiply-adds and returns float32 sums, so no pass pays
        # for ~370 dtype conversions, and RMSNorm is one fused float32 call
        # (docs/bench/2026-12-07-notes-from-kernels-and-model.md). Weights stay bf16: the bytes read
        # per token, what decoding speed is bound by, are unchanged.
        self.act_dtype = (
            torch.float32
            if self.device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels.available()
            else dtype
        )

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype)

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in state else None

        self.embed = w("model.embed_tokens.weight")  # [V, E]
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}."
            layer = _Layer()
            layer.attn_norm = w(pre + "input_layernorm.weight").to(self.act_dtype)
            # One fused QKV matrix and one fused gate/up matrix: fewer, larger matmuls.
            qkv_w = torch.cat([w(pre + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            qkv_b = None
            if cfg.attention_bias and (pre + "self_attn.q_proj.bias") in state:
                qkv_b = torch.cat([w(pre + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
            layer.qkv = linear(qkv_w, qkv_b)
            layer.o = linear(w(pre + "self_attn.o_proj.weight"), opt(pre + "self_attn.o_proj.bias"))
            layer.mlp_norm = w(pre + "post_attention_layernorm.weight").to(self.act_dtype)
            layer.gate_up = linear(torch.cat([w(pre + "mlp.gate_proj.weight"), w(pre + "mlp.up_proj.weight")], dim=0))
            layer.down = linear(w(pre + "mlp.down_proj.weight"))
            self.layers.append(layer)
        self.norm = w("model.norm.weight").to(self.act_dtype)
        head = state.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = state["model.embed_tokens.weight"]
        self.lm_head = linear(head.to(device=self.device, dtype=dtype))
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        self.inv_freq = inv_freq.to(self.device)  # [D/2] float64 for exact angles
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, D]
        # The KV cache's dtype (new_cache): float32 on the CPU even for a bf16 model: torch's
        # CPU flash attention is several times slower in bf16 than in float32
        # (docs/bench/2026-12-07-notes-from-kernels-and-model.md). Costs 2x the cache memory
        # (46 KB per token for the default model). A drafter may set bf16 where our kernels
        # run its passes (q4_weights: they read either, widened exactly).
        self.attention_dtype = torch.float32 if self.device.type == "cpu" else dtype
        self._attention_kernel = self.device.type == "cpu" and cpu_kernels.available()
        self._stack: tuple[int, cpu_kernels.LayerStack | None] | None = None  # (layer edits seen, stack)

    def use_torch_ops(self) -> None:
        """Run on torch's own ops only, no kernel of ours: the float32 path of a host where
        none of our kernels runs (bench row engine-torch-float32 measures it beside the
        kernels, in the same run). Float32 weights only: their products are torch's already."""
        mats = [self.lm_head] + [getattr(layer, a) for layer in self.layers for a in ("qkv", "o", "gate_up", "down")]
        if self.dtype != torch.float32 or any(not isinstance(m, Linear) or m._kernel is not None for m in mats):
            raise ValueError("use_torch_ops needs float32 weights (these matrices are on our kernels)")
        self._attention_kernel = False

    def _layer_stack(self) -> cpu_kernels.LayerStack | None:
        """All layers as one C call (cpu_kernels.LayerStack), where every matrix is on our kernel."""
        if self._stack is None or self._stack[0] != _LAYER_EDITS[0]:
            mats = [
                (
                    *(_kernel_matrix(getattr(layer, a)) for a in ("qkv", "o", "gate_up", "down")),
                    layer.attn_norm,
                    layer.mlp_norm,
                )
                for layer in self.layers
            ]
            ok = all(m is not None for row in mats for m in row[:4])
            self._stack = (_LAYER_EDITS[0], cpu_kernels.LayerStack.build(mats) if ok else None)
        return self._stack[1]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read by one forward pass (the roofline numerator)."""
        total = self.lm_head.nbytes + self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            total += layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes + layer.down.nbytes
            total += (layer.attn_norm.numel() + layer.mlp_norm.numel()) * self.norm.element_size()
        return total

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.cfg, capacity, self.attention_dtype, self.device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.cfg.rms_norm_eps)  # one fused kernel
        # Lower precision: normalise in float32, round, then scale (the Hugging Face order).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _normed_linear(self, linear: Linear | Int8Linear, x: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        """linear(RMSNorm(x)): one fused kernel call where our CPU kernel runs the product."""
        y = linear.normed(x, norm_weight, self.cfg.rms_norm_eps)
        return y if y is not None else linear(self._rms_norm(x, norm_weight))

    def _rope(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for the given positions, from a table computed once in float64."""
        needed = max_position + 1
        if self._rope_table is None or self._rope_table[0].shape[0] < needed:
            size = max(needed, 2 * (self._rope_table[0].shape[0] if self._rope_table else 1024))
            angles = torch.arange(size, dtype=torch.float64, device=self.device)[:, None] * self.inv_freq[None, :]
            angles = torch.cat([angles, angles], dim=-1)  # [size, D]
            self._rope_table = (angles.cos().to(self.act_dtype), angles.sin().to(self.act_dtype))
        cos, sin = self._rope_table
        return cos[positions], sin[positions]

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [heads, T, D]; rotate_half convention of the Hugging Face checkpoints.
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        attend_len: int | None = None,
        logits_rows: torch.Tensor | None = None,
        to_host: bool = True,
        x_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass (``run_pass``) when only its logits are wanted: [R, V]."""
        return self.run_pass(tokens, positions, cache, mask, attend_len, logits_rows, to_host, x_in).logits

    def run_pass(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        attend_len: int | None = None,
        logits_rows: torch.Tensor | None = None,
        to_host: bool = True,
        x_in: torch.Tensor | None = None,
        features: bool = False,
        feature_layers: tuple[int, ...] | None = None,
    ) -> PassOutput:
        """Run T new tokens, writing their K/V at slots [cache.length, cache.length + T).

        tokens:      [T] int64 token ids
        positions:   [T] int64 rotary positions (tree nodes: prefix length + depth)
        mask:        [T, A] bool, True = may attend, over cache slots [0, A) where
                     A = attend_len (default cache.length + T); None means plain
                     causal attention (T == 1 needs no mask at all)
        logits_rows: [R] rows of the T outputs to project to the vocabulary (None = all)
        x_in:        [T, E] input rows in place of the token embeddings (the EAGLE head
                     feeds its fused feature + embedding rows; tokens then only give T)
        features:    also return the last layer's output before the final norm,
                     [T, E] in the activation dtype, every row (the features an
                     EAGLE head reads: engine/drafters/eagle.py)
        feature_layers: with features, the outputs (the residual stream) of these
                     layers side by side instead, [T, len(feature_layers) E], the last
                     layer last (an EAGLE-3-style head reads a low / middle / high mix)
        Inputs may live on the CPU; logits come back as float32 on the CPU (the
        verification and the events are host-side), or stay on the model's device
        with to_host=False (the batched GPU verification). Advances cache.length by T;
        the caller decides afterwards which of the new slots to keep.

        The steps: (1) the new slots and the attention plan (``_attention_plan``); (2) rotary
        angles and input rows; (3) the layers, in one C call on the CPU kernels
        (``_layers_on_stack``) or one ``_layer`` at a time; (4) the asked rows projected.
        """
        max_position = int(positions.max())  # read on the host: no device sync per pass
        if self.device.type != "cpu":
            tokens, positions = tokens.to(self.device), positions.to(self.device)
            mask = mask.to(self.device) if mask is not None else None
            logits_rows = logits_rows.to(self.device) if logits_rows is not None else None
        t = tokens.shape[0]
        start = cache.length
        end = start + t
        if end > cache.capacity:
            raise ValueError(f"sequence of {end} tokens exceeds the KV cache capacity {cache.capacity}")
        attend = end if attend_len is None else attend_len
        # (1) which attention runs, and its mask
        kernel_attention, mask = self._attention_plan(t, start, end, attend, mask, tokens.device)
        # (2) rotary angles, input rows
        cos, sin = self._rope(positions, max_position)
        # Rotary + KV write in one C call per layer where activations and cache are float32 CPU tensors.
        fused_rope = (
            self._attention_kernel and self.act_dtype == torch.float32 and cache.k.dtype in cpu_kernels.KV_DTYPES
        )
        x = (self.embed[tokens] if x_in is None else x_in).to(self.act_dtype)  # [T, E]
        n_layers = len(self.layers)
        if feature_layers is not None:
            try:
                feature_layers = check_feature_layers(feature_layers, n_layers)
            except ValueError as exc:
                raise ValueError(f"feature_layers: {exc}") from None
        keep = set(feature_layers[:-1]) if feature_layers and features else set()  # layers whose output is read
        # (3) the layers
        stack = self._layer_stack() if kernel_attention and fused_rope and x.dtype == torch.float32 else None
        if stack is not None:
            x = x.clone() if x_in is not None else x.contiguous()  # the stack works in place
            captured = self._layers_on_stack(stack, x, cos, sin, cache, start, attend, mask, keep)
        else:
            captured = {}  # layer -> its output rows [T, E]
            for li, layer in enumerate(self.layers):
                x = self._layer(li, layer, x, cos, sin, cache, start, attend, mask, fused_rope, kernel_attention)
                if li in keep:
                    captured[li] = x
        cache.length = end
        # (4) the rows asked for, projected to the vocabulary
        hidden = None
        if features:
            hidden = torch.cat([captured[i] for i in feature_layers[:-1]] + [x], dim=-1) if keep else x
        if logits_rows is not None:
            x = x[logits_rows]
        return PassOutput(self.logits_of(x, to_host), hidden)

    def _attention_plan(
        self, t: int, start: int, end: int, attend: int, mask: torch.Tensor | None, device
    ) -> tuple[bool, torch.Tensor | None]:
        """(whether our attention kernel runs, the [T, A] bool mask or None) for T new tokens at slots
        [start, end) attending over [0, attend)."""
        # Every pass on the CPU kernel's host attends on our kernel, causally or through
        # the tree mask: for a few tokens torch's SDPA spends longer on setup than on the
        # attention, and a prefill then runs its layers in one C call too, quicker
        # (docs/bench/2026-12-07-notes-from-kernels-and-model.md), its rows bit for bit what
        # decoding gives them.
        kernel_attention = self._attention_kernel and (mask is not None or attend == end)
        if kernel_attention and mask is not None:
            if mask.shape != (t, attend) or not bool(mask.any(dim=1).all()):
                raise ValueError(f"mask must be [{t}, {attend}] with at least one allowed position per row")
            mask = mask.to(torch.bool).contiguous()
        if mask is None and t > 1 and not kernel_attention:
            # Causal over the new tokens, full view of the committed prefix.
            mask = torch.ones(t, attend, dtype=torch.bool, device=device)
            mask[:, start:end] = torch.tril(mask[:, start:end])
            if attend > end:
                mask[:, end:] = False
        return kernel_attention, mask

    def _layers_on_stack(self, stack, x, cos, sin, cache: KVCache, start: int, attend: int, mask, keep: set) -> dict:
        """Every layer in one C call (cpu_kernels.decode_layers), x [T, E] float32 updated in place: the same
        steps and numbers as ``_layer``, without the Python around ~150 foreign calls per pass.
        A layer whose output is wanted (keep) ends a call of its own (one more call each); returns
        {layer: a copy of its output rows}."""
        cfg, n_layers = self.cfg, len(self.layers)
        captured: dict[int, torch.Tensor] = {}
        first = 0
        for last in sorted(keep) + [n_layers - 1]:
            part = stack if (first, last) == (0, n_layers - 1) else stack.segment(first, last + 1)
            part.run(
                x, cos, sin, cache.k[first:], cache.v[first:], start, cfg.num_heads, attend, mask, cfg.rms_norm_eps
            )
            if last in keep:
                captured[last] = x.clone()
            first = last + 1
        return captured

    def _layer(
        self,
        li: int,
        layer,
        x,
        cos,
        sin,
        cache: KVCache,
        start: int | None,
        attend: int,
        mask,
        fused_rope,
        kernel_attention,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder layer on x [T, E]: attention (its K/V written to cache slots [start, start + T), or to
        the slots [T] given as a tensor: engine/model/static_pass.py) and the SwiGLU MLP, each added to the
        residual stream; returns the layer's output [T, E]."""
        cfg = self.cfg
        t = x.shape[0]
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self._normed_linear(layer.qkv, x, layer.attn_norm)  # [T, (H + 2 Hkv) D]
        if fused_rope:
            q = cpu_kernels.rope_and_store(qkv, cos, sin, cache.k[li], cache.v[li], start, nq)  # [H, T, D]
        else:
            qk, v = qkv.split([(nq + nkv) * hd, nkv * hd], dim=-1)
            # Queries and keys rotate together: one rotary call per layer.
            qk = self._apply_rope(qk.view(t, nq + nkv, hd).transpose(0, 1), cos, sin)  # [H + Hkv, T, D]
            q, k = qk[:nq].to(cache.k.dtype), qk[nq:]  # [H, T, D], [Hkv, T, D]
            v = v.view(t, nkv, hd).transpose(0, 1)  # [Hkv, T, D]
            if slots is None:
                cache.k[li, :, start : start + t] = k
                cache.v[li, :, start : start + t] = v
            else:  # the same values, at slots read from a device tensor (no host offset in the pass)
                cache.k[li].index_copy_(1, slots, k.to(cache.k.dtype))
                cache.v[li].index_copy_(1, slots, v.to(cache.v.dtype))
        if kernel_attention:
            attn = cpu_kernels.attend_few(q, cache.k[li], cache.v[li], attend, mask, check=False)  # [T, H D]
        else:
            keys = cache.k[li, :, :attend]  # [Hkv, A, D]
            values = cache.v[li, :, :attend]
            # Grouped-query attention: query head h reads key/value head h // group.
            attn = F.scaled_dot_product_attention(
                q[None],
                keys[None],
                values[None],
                attn_mask=mask[None, None] if mask is not None else None,  # [1, 1, T, A]
                enable_gqa=nq > nkv,
            )  # [1, H, T, D]
            attn = attn[0].transpose(0, 1).reshape(t, nq * hd)
        x = x + layer.o(attn.to(x.dtype))
        gate_up = self._normed_linear(layer.gate_up, x, layer.mlp_norm)  # [T, 2 I]: gate, up
        if self._attention_kernel and gate_up.dtype == torch.float32:
            hidden = cpu_kernels.swiglu(gate_up.contiguous())  # decode_layers' SwiGLU, bit for bit
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            hidden = F.silu(gate) * up
        return x + layer.down(hidden)

    def _chain_head(self):
        """The lm_head as cpu_kernels.greedy_chain takes it (a packed matrix or a RescoredQ4Head, unpadded),
        or None."""
        head = self.lm_head.head if isinstance(self.lm_head, RescoredQ4Linear) else _kernel_matrix(self.lm_head)
        if head is None or head.out_padded != head.out or head.in_padded != head.n_in:
            return None
        return head

    def greedy_chain_ready(self, cache: KVCache) -> bool:
        """Whether ``greedy_chain`` runs here: every matrix and the attention on our CPU kernels, float32
        activations, a float32 or bf16 cache, an unpadded head whose rows are the vocabulary."""
        head = self._chain_head()
        return (
            self._attention_kernel
            and self.act_dtype == torch.float32
            and cache.k.dtype in cpu_kernels.KV_DTYPES
            and cache.v.dtype == cache.k.dtype
            and cache.k.is_contiguous()
            and cache.v.is_contiguous()
            and self.embed.dtype in (torch.bfloat16, torch.float32)
            and self.embed.is_contiguous()
            and self.norm.dtype == torch.float32
            and self._layer_stack() is not None
            and head is not None
            and (head.out, head.n_in) == tuple(self.embed.shape)
        )

    @torch.inference_mode()
    def greedy_chain(self, token: int, cache: KVCache, n: int) -> tuple[torch.Tensor, list[int]]:
        """n one-token passes in one C call (cpu_kernels.greedy_chain): `token` at slot and position
        cache.length, then each pass's argmax (the first maximum) at the next. Returns (logits [n, V] float32,
        the n tokens chosen) and advances cache.length by n: bit for bit what n ``run_pass`` calls of one
        token at consecutive slots and positions give, each followed by ``argmax_index`` of its logits.
        Where ``greedy_chain_ready`` says so only."""
        return self._chain(cpu_kernels.greedy_chain, token, cache, n)

    @torch.inference_mode()
    def sampled_chain(
        self, token: int, cache: KVCache, n: int, temperature: float, uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``greedy_chain`` with each pass's token drawn from q = softmax(logits / temperature) by the inverse
        CDF at uniforms[i] ([n] float64, from the run's generator; cpu_kernels.sampled_chain). Returns (logits
        [n, V], bit for bit the one-token passes'; q [n, V] float32, what each token was drawn from; the n
        tokens) and advances cache.length by n. Where ``greedy_chain_ready`` says so only."""
        return self._chain(cpu_kernels.sampled_chain, token, cache, n, temperature, uniforms)

    def _chain(self, kernel, token: int, cache: KVCache, n: int, *extra):
        start = cache.length
        if start + n > cache.capacity:
            raise ValueError(f"sequence of {start + n} tokens exceeds the KV cache capacity {cache.capacity}")
        cos, sin = self._rope(torch.arange(start, start + n), start + n - 1)  # [n, D] each
        out = kernel(
            token,
            n,
            self.embed,
            self._layer_stack(),
            cos.contiguous(),
            sin.contiguous(),
            cache.k,
            cache.v,
            start,
            self.cfg.num_heads,
            self._chain_head(),
            self.norm,
            self.cfg.rms_norm_eps,
            *extra,
        )
        cache.length = start + n
        return out

    @property
    def lm_head_on_kernel(self) -> bool:
        """Whether the lm_head runs on our (row-invariant) CPU kernel."""
        return isinstance(self.lm_head, Linear) and self.lm_head._kernel is not None

    def logits_of(self, hidden: torch.Tensor, to_host: bool = True) -> torch.Tensor:
        """[R, E] last-layer rows (run_pass's hidden) -> their logits [R, V] float32: the
        final norm and the lm_head, as forward ends. Row by row the same bits on our kernels
        (shape-invariant), so logits computed later for some rows of a pass equal the pass's own."""
        logits = self._normed_linear(self.lm_head, hidden, self.norm).float()
        return logits.cpu() if to_host else logits

    def prefill(self, token_ids: list[int], cache: KVCache) -> torch.Tensor:
        """Append token_ids to the cache; returns the logits [V] of the last one."""
        return self.prefill_features(token_ids, cache, features=False).logits[0]

    def prefill_features(
        self, token_ids: list[int], cache: KVCache, feature_layers: tuple | None = None, features: bool = True
    ) -> PassOutput:
        """Append token_ids to the cache: the logits [1, V] of the last one and the pre-norm last-layer
        rows [n, E] of all of them (or run_pass's feature_layers mix [n, layers E])."""
        n = len(token_ids)
        start = cache.length
        return self.run_pass(
            torch.tensor(token_ids),
            torch.arange(start, start + n),
            cache,
            logits_rows=torch.tensor([n - 1]),
            features=features,
            feature_layers=feature_layers,
        )
