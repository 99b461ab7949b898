"""A lean decoder-only transformer (Llama / Qwen2 / Mistral family) with a static KV cache.

transformers loads and converts the weights; decoding runs here, in plain torch and our CPU kernels,
because speculative decoding needs three things a generic model wrapper makes
slow or awkward: a pre-allocated KV cache that can be rolled back or compacted in
place, arbitrary 4-D attention masks (a draft tree is verified in one pass), and
positions given per token (tree nodes sit at ``prefix + depth``).

The matrices' kinds (bf16, int8, 4-bit blocks) live in engine/model/weights.py, and a drafter's
chains of one-token passes in one C call in engine/model/chains.py.

Shapes: T = tokens in this forward, S = cache capacity, H = query heads,
Hkv = key/value heads, D = head dim, E = hidden size, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import cpu_build, cpu_calls, pages
from engine.model.weights import Int8Linear, Linear, kernel_matrix

__all__ = [
    "ModelConfig",
    "KVCache",
    "PassOutput",
    "Transformer",
    "check_feature_layers",
    "decoder_layer",
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


def _layer_of(state: dict, w, pre: str, attention_bias: bool, linear: type, act_dtype: torch.dtype) -> _Layer:
    """The decoder layer whose state-dict names start with `pre` ("model.layers.{i}."): its norms [E] in the
    activation dtype, its matrices as `linear` (Linear or Int8Linear) of w(name), the state's tensor on the
    model's device and dtype."""
    layer = _Layer()
    layer.attn_norm = w(pre + "input_layernorm.weight").to(act_dtype)
    # One fused QKV matrix and one fused gate/up matrix: fewer, larger matmuls.
    qkv_w = torch.cat([w(pre + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
    qkv_b = None
    if attention_bias and (pre + "self_attn.q_proj.bias") in state:
        qkv_b = torch.cat([w(pre + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
    layer.qkv = linear(qkv_w, qkv_b)
    o_bias = pre + "self_attn.o_proj.bias"
    layer.o = linear(w(pre + "self_attn.o_proj.weight"), w(o_bias) if o_bias in state else None)
    layer.mlp_norm = w(pre + "post_attention_layernorm.weight").to(act_dtype)
    layer.gate_up = linear(torch.cat([w(pre + "mlp.gate_proj.weight"), w(pre + "mlp.up_proj.weight")], dim=0))
    layer.down = linear(w(pre + "mlp.down_proj.weight"))
    return layer


def _kept_layers(features: bool, feature_layers, n_layers: int) -> tuple[tuple[int, ...] | None, set[int]]:
    """A pass's feature_layers, checked (``check_feature_layers``; None stays None), and the layers whose
    output it keeps besides the last: those feature_layers names before the last, where features are asked."""
    if feature_layers is not None:
        try:
            feature_layers = check_feature_layers(feature_layers, n_layers)
        except ValueError as exc:
            raise ValueError(f"feature_layers: {exc}") from None
    keep = set(feature_layers[:-1]) if feature_layers and features else set()  # layers whose output is read
    return feature_layers, keep


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
            torch.float32 if self.device.type == "cpu" and dtype == torch.bfloat16 and cpu_build.available() else dtype
        )

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")  # [V, E]
        self.layers: list[_Layer] = [
            _layer_of(state, w, f"model.layers.{i}.", cfg.attention_bias, linear, self.act_dtype)
            for i in range(cfg.num_layers)
        ]
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
        self._attention_kernel = self.device.type == "cpu" and cpu_build.available()
        self._stack: tuple[int, cpu_calls.LayerStack | None] | None = None  # (layer edits seen, stack)

    def use_torch_ops(self) -> None:
        """Run on torch's own ops only, no kernel of ours: the float32 path of a host where
        none of our kernels runs (bench row engine-torch-float32 measures it beside the
        kernels, in the same run). Float32 weights only: their products are torch's already."""
        mats = [self.lm_head] + [getattr(layer, a) for layer in self.layers for a in ("qkv", "o", "gate_up", "down")]
        if self.dtype != torch.float32 or any(not isinstance(m, Linear) or m._kernel is not None for m in mats):
            raise ValueError("use_torch_ops needs float32 weights (these matrices are on our kernels)")
        self._attention_kernel = False

    def _layer_stack(self) -> cpu_calls.LayerStack | None:
        """All layers as one C call (cpu_calls.LayerStack), where every matrix is on our kernel."""
        if self._stack is None or self._stack[0] != _LAYER_EDITS[0]:
            mats = [
                (
                    *(kernel_matrix(getattr(layer, a)) for a in ("qkv", "o", "gate_up", "down")),
                    layer.attn_norm,
                    layer.mlp_norm,
                )
                for layer in self.layers
            ]
            ok = all(m is not None for row in mats for m in row[:4])
            self._stack = (_LAYER_EDITS[0], cpu_calls.LayerStack.build(mats) if ok else None)
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
        (``_layers_on_stack``) or one ``decoder_layer`` at a time; (4) the asked rows projected.
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
        fused_rope = self._attention_kernel and self.act_dtype == torch.float32 and cache.k.dtype in cpu_calls.KV_DTYPES
        x = (self.embed[tokens] if x_in is None else x_in).to(self.act_dtype)  # [T, E]
        feature_layers, keep = _kept_layers(features, feature_layers, len(self.layers))
        # (3) the layers
        stack = self._layer_stack() if kernel_attention and fused_rope and x.dtype == torch.float32 else None
        if stack is not None:
            x = x.clone() if x_in is not None else x.contiguous()  # the stack works in place
            captured = self._layers_on_stack(stack, x, cos, sin, cache, start, attend, mask, keep)
        else:
            captured = {}  # layer -> its output rows [T, E]
            for li, layer in enumerate(self.layers):
                x = decoder_layer(
                    self, li, layer, x, cos, sin, cache, start, attend, mask, fused_rope, kernel_attention
                )
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
        """Every layer in one C call (cpu_calls.LayerStack), x [T, E] float32 updated in place: the same
        steps and numbers as ``decoder_layer``, without the Python around ~150 foreign calls per pass.
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


def decoder_layer(
    model: Transformer,
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
    """One decoder layer of `model` (its layer `li`, `layer`) on x [T, E]: attention (its K/V written to cache
    slots [start, start + T), or to the slots [T] given as a tensor: engine/model/static_pass.py) and the SwiGLU
    MLP, each added to the residual stream; returns the layer's output [T, E]. run_pass's path where the layers
    do not run as one C call (``Transformer._layers_on_stack``)."""
    cfg = model.cfg
    t = x.shape[0]
    nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = model._normed_linear(layer.qkv, x, layer.attn_norm)  # [T, (H + 2 Hkv) D]
    if fused_rope:
        q = cpu_calls.rope_and_store(qkv, cos, sin, cache.k[li], cache.v[li], start, nq)  # [H, T, D]
    else:
        qk, v = qkv.split([(nq + nkv) * hd, nkv * hd], dim=-1)
        # Queries and keys rotate together: one rotary call per layer.
        qk = model._apply_rope(qk.view(t, nq + nkv, hd).transpose(0, 1), cos, sin)  # [H + Hkv, T, D]
        q, k = qk[:nq].to(cache.k.dtype), qk[nq:]  # [H, T, D], [Hkv, T, D]
        v = v.view(t, nkv, hd).transpose(0, 1)  # [Hkv, T, D]
        if slots is None:
            cache.k[li, :, start : start + t] = k
            cache.v[li, :, start : start + t] = v
        else:  # the same values, at slots read from a device tensor (no host offset in the pass)
            cache.k[li].index_copy_(1, slots, k.to(cache.k.dtype))
            cache.v[li].index_copy_(1, slots, v.to(cache.v.dtype))
    if kernel_attention:
        attn = cpu_calls.attend_few(q, cache.k[li], cache.v[li], attend, mask, check=False)  # [T, H D]
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
    gate_up = model._normed_linear(layer.gate_up, x, layer.mlp_norm)  # [T, 2 I]: gate, up
    if model._attention_kernel and gate_up.dtype == torch.float32:
        hidden = cpu_calls.swiglu(gate_up.contiguous())  # decode_layers' SwiGLU, bit for bit
    else:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        hidden = F.silu(gate) * up
    return x + layer.down(hidden)
