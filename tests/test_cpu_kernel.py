"""Our AVX512-BF16 decoding kernels (engine/cpu_kernels.py, engine/csrc/decode_kernels.c).

(a) The products match float32 references: odd sizes, bias, float32 in/out, the
    fused RMSNorm, int8 weights against outlier activations.
(b) They are shape-invariant: each row of a multi-row product equals the one-row
    product bit for bit; the packed layout unpacks to the original weight.
(c) Attention matches torch's SDPA, causal and under tree masks.
(d) A whole bf16 pass is shape-invariant: a K-token pass equals K one-token
    passes, and a tree node equals the chain of its path, bit for bit.
(e) A bf16 model uses the kernels when they are available, and without them
    (disabled, a compiler that fails) falls back to torch and says why.
(a)-(d) need a CPU with AVX512-BF16/VNNI and skip elsewhere; (e) runs everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import cpu_kernels
from engine.transformer import Linear

ROOT = Path(__file__).resolve().parent.parent
needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"CPU kernel unavailable here: {cpu_kernels.why_unavailable()}"
)


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize(
    "rows,n_in,n_out", [(1, 576, 960), (3, 576, 576), (9, 1536, 576), (16, 64, 49), (17, 33, 16), (40, 128, 64)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_reference(rows, n_in, n_out, with_bias):
    x, w = _bf16(rows, n_in, seed=1), _bf16(n_out, n_in, seed=2)
    b = _bf16(n_out, seed=3) if with_bias else None
    got = cpu_kernels.skinny_gemm_bf16(x, cpu_kernels.PackedWeight(w, b))
    assert got.shape == (rows, n_out) and got.dtype == torch.bfloat16
    ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    # float32 accumulation, one bf16 rounding of the result: within a bf16 ulp or two of the reference
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2 * n_in**0.5)


@needs_kernel
@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (4, 1536, 576), (17, 33, 20)])
def test_float32_rows_in_and_out(rows, n_in, n_out):
    """float32 x is rounded to bf16 inside the kernel; float32 y is the unrounded sum."""
    x, w = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(1)), _bf16(n_out, n_in, seed=2)
    packed = cpu_kernels.PackedWeight(w)
    got = cpu_kernels.skinny_gemm_bf16(x, packed)
    assert got.dtype == torch.float32
    ref = x.to(torch.bfloat16).float() @ w.float().t()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * n_in**0.5)
    as_bf16 = cpu_kernels.skinny_gemm_bf16(x.to(torch.bfloat16), packed, out_dtype=torch.float32)
    assert torch.equal(got, as_bf16)


@needs_kernel
@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (4, 1536, 576), (9, 37, 50)])
def test_int8_weights_match_the_dequantised_product(rows, n_in, n_out):
    """x is quantised per row to int16 inside the kernel (|xq| * 127 * in < 2^31): the
    result is the dequantised product up to that rounding, far below bf16's."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, n_in, generator=gen) * torch.linspace(0.1, 30.0, n_in)  # outlier channels
    q = torch.randint(-127, 128, (n_out, n_in), generator=gen, dtype=torch.int8)
    scale, bias = torch.rand(n_out, generator=gen) / 100, _bf16(n_out, seed=4)
    got = cpu_kernels.skinny_gemm_int8w(x, cpu_kernels.PackedInt8Weight(q, scale, bias))
    ref = (x.double() @ q.double().t()) * scale.double() + bias.double()
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-3, float(err)


@needs_kernel
def test_int8_linear_runs_on_the_kernel():
    from engine.transformer import Int8Linear

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    lin = Int8Linear(w)
    assert lin._packed is not None
    rel = (lin(x) - x @ w.t()).norm() / (x @ w.t()).norm()
    assert rel < 0.03, float(rel)


@needs_kernel
def test_rows_are_shape_invariant():
    w, b = _bf16(3072, 576, seed=4), _bf16(3072, seed=5)
    packed = cpu_kernels.PackedWeight(w, b)
    x = _bf16(16, 576, seed=6)
    full = cpu_kernels.skinny_gemm_bf16(x, packed)
    for r in range(16):
        assert torch.equal(cpu_kernels.skinny_gemm_bf16(x[r : r + 1], packed), full[r : r + 1]), r
    for n in (2, 5, 9):
        assert torch.equal(cpu_kernels.skinny_gemm_bf16(x[:n], packed), full[:n]), n


@needs_kernel
def test_int8_rows_with_bias_are_shape_invariant():
    """GCC's default FMA contraction fused the int8 epilogue's multiply and add
    (acc * sx * scale + bias) in some tiles only: 4 rows of this 16-row product (200
    outputs: tail tiles on each thread) differed from their one-row products in the
    last bit (fixed with -ffp-contract=off)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 576, generator=gen)
    q = torch.randint(-127, 128, (200, 576), generator=gen, dtype=torch.int8)
    scale, bias = torch.rand(200, generator=gen) / 64, torch.randn(200, generator=gen).to(torch.bfloat16)
    packed = cpu_kernels.PackedInt8Weight(q, scale, bias)
    full = cpu_kernels.skinny_gemm_int8w(x, packed)
    for r in range(16):
        assert torch.equal(cpu_kernels.skinny_gemm_int8w(x[r : r + 1], packed), full[r : r + 1]), r


@needs_kernel
def test_packed_weight_unpacks_to_the_original():
    w = _bf16(50, 37, seed=7)  # both dimensions padded
    assert torch.equal(cpu_kernels.PackedWeight(w).unpack(), w)


@needs_kernel
def test_bf16_linear_runs_on_the_kernel():
    w, x = _bf16(64, 96, seed=8), _bf16(2, 96, seed=9)
    linear = Linear(w)
    assert linear._kernel is not None
    assert torch.equal(linear.weight, w)
    assert torch.equal(linear(x), cpu_kernels.skinny_gemm_bf16(x, cpu_kernels.PackedWeight(w)))


def test_bad_inputs_are_refused_with_a_message():
    if not cpu_kernels.available():
        with pytest.raises(RuntimeError, match="unavailable"):
            cpu_kernels.skinny_gemm_bf16(_bf16(1, 8, seed=0), cpu_kernels.PackedWeight(_bf16(16, 8, seed=1)))
        return
    packed = cpu_kernels.PackedWeight(_bf16(16, 8, seed=1))
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.skinny_gemm_bf16(_bf16(1, 9, seed=0), packed)
    with pytest.raises(ValueError, match="bf16 or float32"):
        cpu_kernels.skinny_gemm_bf16(torch.randn(1, 8, dtype=torch.float64), packed)


SNIPPET = """
import torch
from engine import cpu_kernels
from engine.transformer import Linear
w = torch.randn(32, 64).to(torch.bfloat16)
x = torch.randn(3, 64).to(torch.bfloat16)
lin = Linear(w)
y = lin(x)
ref = x.float() @ w.float().t()
assert torch.allclose(y.float(), ref, rtol=2e-2, atol=0.5), (y, ref)
assert lin._kernel is None
assert torch.equal(lin.weight, w)
print("WHY:", cpu_kernels.why_unavailable())
"""


@pytest.mark.parametrize(
    "env,why",
    [({"SPECLENS_CPU_KERNEL": "0"}, "SPECLENS_CPU_KERNEL=0"), ({"CC": "/bin/false"}, None)],
    ids=["disabled", "compiler-fails"],
)
def test_without_the_kernel_bf16_falls_back_and_says_why(tmp_path, env, why):
    full_env = {**os.environ, "SPECLENS_CACHE": str(tmp_path), **env}
    if "CC" in env:
        if not cpu_kernels._cpu_supports():
            pytest.skip("no AVX512-BF16 here: the kernel is never compiled")
        why = "compiling"
    done = subprocess.run(
        [sys.executable, "-c", SNIPPET], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "WHY:" in done.stdout and why in done.stdout, done.stdout


@needs_kernel
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_bf16_passes_are_shape_invariant_end_to_end(model_type):
    """With our kernels every piece of a bf16 pass on the CPU treats each token on its
    own (products, fused RMSNorm, rotary, attention), so the logits of a token do not
    depend on how many tokens share the pass: a K-token verification pass agrees bit
    for bit with K one-token passes, and greedy speculative decoding reproduces the
    baseline exactly (no near-ties)."""
    from conftest import tiny_hf_model

    from engine.transformer import ModelConfig, Transformer

    hf = tiny_hf_model(model_type, 512, 0)
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16)
    assert model.act_dtype == torch.float32
    prompt = list(range(3, 40))
    cache = model.new_cache(64)
    model.prefill(prompt, cache)
    base = cache.length
    new = torch.tensor([7, 9, 11, 13, 15])
    positions = torch.arange(base, base + 5)
    together = model.forward(new, positions, cache)  # [5, V]
    for i in range(5):
        cache.length = base + i
        alone = model.forward(new[i : i + 1], positions[i : i + 1], cache)
        assert torch.equal(alone[0], together[i]), i
    # a tree mask (token 3 sees the prefix, token 0 and itself) agrees with the causal pass of that path
    cache.length = base
    mask = torch.zeros(4, base + 4, dtype=torch.bool)
    mask[:, :base] = True
    for row, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 3]]):
        mask[row, [base + a for a in ancestors]] = True
    tree = model.forward(new[:4], torch.tensor([base, base + 1, base + 1, base + 1]), cache, mask=mask)
    cache.length = base
    chain = model.forward(new[[0, 3]], positions[:2], cache)
    assert torch.equal(tree[3], chain[1])
    # a deeper path at scattered slots: nodes 0 -> 2 -> 4 of a 5-node tree (1 and 3 are side branches)
    cache.length = base
    parents = [-1, 0, 0, 1, 2]
    depth = [0, 1, 1, 2, 2]
    mask = torch.zeros(5, base + 5, dtype=torch.bool)
    mask[:, :base] = True
    for node in range(5):
        a = node
        while a != -1:
            mask[node, base + a] = True
            a = parents[a]
    tokens = torch.tensor([21, 22, 23, 24, 25])
    tree = model.forward(tokens, base + torch.tensor(depth), cache, mask=mask)
    cache.length = base
    chain = model.forward(tokens[[0, 2, 4]], positions[:3], cache)
    assert torch.equal(tree[[0, 2, 4]], chain)


@needs_kernel
@pytest.mark.parametrize("tokens,length", [(1, 7), (1, 1000), (5, 130), (16, 400)])
@pytest.mark.parametrize("dim", [64, 72])
@pytest.mark.parametrize("tree", [False, True])
def test_attention_matches_torch(tokens, length, dim, tree):
    gen = torch.Generator().manual_seed(tokens * length + dim)
    q = torch.randn(6, tokens, dim, generator=gen)
    k = torch.randn(2, length + 8, dim, generator=gen) * 2  # capacity beyond the attended length
    v = torch.randn(2, length + 8, dim, generator=gen)
    mask = torch.ones(tokens, length, dtype=torch.bool)
    mask[:, length - tokens :] = torch.tril(mask[:, length - tokens :])
    if tree:  # drop random non-diagonal entries: an arbitrary ancestor pattern
        keep = torch.rand(tokens, length, generator=gen) < 0.7
        own = torch.zeros(tokens, length, dtype=torch.bool)
        own[:, length - tokens :] = torch.eye(tokens, dtype=torch.bool)  # every token sees itself
        mask &= keep | own
    got = cpu_kernels.attend_few(q, k, v, length, mask if tree else None)  # [T, H D]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None, :, :length], v[None, :, :length], attn_mask=mask[None, None], enable_gqa=True
    )[0]  # [H, T, D]
    torch.testing.assert_close(got, ref.transpose(0, 1).reshape(tokens, 6 * dim), rtol=1e-5, atol=1e-5)
