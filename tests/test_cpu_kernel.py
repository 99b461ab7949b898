"""Our CPU decoding kernels (engine/kernels/cpu_build.py, cpu_packed.py, cpu_calls.py, csrc/), every variant
this CPU runs.

(a) The products match float32 references: odd sizes, bias, float32 in/out, the
    fused RMSNorm, int8 weights against outlier activations.
(b) They are shape-invariant: each row of a multi-row product equals the one-row
    product bit for bit; the packed layout unpacks to the original weight.
(c) Attention matches torch's SDPA, causal and under tree masks.
(d) A whole bf16 pass is shape-invariant: a K-token pass equals K one-token
    passes, and a tree node equals the chain of its path, bit for bit; with Q4_1
    matrices too, and the default model runs on its GGUF's own Q4_1 blocks with
    greedy speculation equal to its baseline. decode_layers (all layers in one C
    call) equals the per-layer path bit for bit; the SwiGLU matches torch's.
(e) A bf16 model uses the kernels when they are available, and without them
    (disabled, a compiler that fails, a CPU without a variant, ARM64) falls back
    to torch and says why; SPECLENS_CPU_KERNEL forces a variant; dtype=auto
    picks bf16 where a kernel runs.
(f) A pass run on another thread, or on two threads at once (two visitors), gives
    the main thread's bits: the kernels hand out their own work (csrc/task_pool.h).
(a)-(d) and (f) run once per variant (``variant`` fixture: avx512bf16, avx512, avx2),
each selected with cpu_build.using; a variant this CPU lacks is skipped with
the reason, so an AVX512-BF16 host tests all three. (e) runs everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_build, cpu_calls, cpu_packed
from engine.model import chains
from engine.model.weights import Linear
from engine.tools.samples import next_token_distribution

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=list(cpu_build.VARIANTS))
def variant(request):
    """Run the test on one kernel variant; skipped where this CPU (or compiler) cannot."""
    name = request.param
    why = cpu_build.variant_support(name)
    if why is not None:
        pytest.skip(f"{name}: {why}")
    try:
        ctx = cpu_build.using(name)
        ctx.__enter__()
    except RuntimeError as exc:
        if "compil" in str(exc):  # an old compiler without the ISA's flags: the environment, not the kernel
            pytest.skip(str(exc))
        raise  # the CPU has the instructions and it built: a failed self-check is a bug
    try:
        yield name
    finally:
        ctx.__exit__(None, None, None)


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(
    "rows,n_in,n_out", [(1, 576, 960), (3, 576, 576), (9, 1536, 576), (16, 64, 49), (17, 33, 16), (40, 128, 64)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_reference(variant, rows, n_in, n_out, with_bias):
    x, w = _bf16(rows, n_in, seed=1), _bf16(n_out, n_in, seed=2)
    b = _bf16(n_out, seed=3) if with_bias else None
    got = cpu_calls.skinny_gemm_bf16(x, cpu_packed.PackedWeight(w, b))
    assert got.shape == (rows, n_out) and got.dtype == torch.bfloat16
    ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    # float32 accumulation, one bf16 rounding of the result: within a bf16 ulp or two of the reference
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2 * n_in**0.5)


@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (4, 1536, 576), (17, 33, 20)])
def test_float32_rows_in_and_out(variant, rows, n_in, n_out):
    """float32 x is rounded to bf16 inside the kernel on avx512bf16, multiplied as is on the
    widening variants; float32 y is the unrounded sum; bf16 x is taken exactly."""
    x, w = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(1)), _bf16(n_out, n_in, seed=2)
    packed = cpu_packed.PackedWeight(w)
    got = cpu_calls.skinny_gemm_bf16(x, packed)
    assert got.dtype == torch.float32
    x_seen = x.to(torch.bfloat16).float() if cpu_build.VARIANTS[variant].x_bf16 else x
    ref = x_seen.double() @ w.double().t()
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * n_in**0.5)
    xb = x.to(torch.bfloat16)
    as_bf16 = cpu_calls.skinny_gemm_bf16(xb, packed, out_dtype=torch.float32)
    assert torch.equal(as_bf16, cpu_calls.skinny_gemm_bf16(xb.float(), packed))
    if cpu_build.VARIANTS[variant].x_bf16:
        assert torch.equal(got, as_bf16)


@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (4, 1536, 576), (9, 37, 50)])
def test_int8_weights_match_the_dequantised_product(variant, rows, n_in, n_out):
    """x is quantised per row to int16 inside the kernel (|xq| * 127 * in < 2^31): the
    result is the dequantised product up to that rounding, far below bf16's."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, n_in, generator=gen) * torch.linspace(0.1, 30.0, n_in)  # outlier channels
    q = torch.randint(-127, 128, (n_out, n_in), generator=gen, dtype=torch.int8)
    scale, bias = torch.rand(n_out, generator=gen) / 100, _bf16(n_out, seed=4)
    got = cpu_calls.skinny_gemm_bf16(x, cpu_packed.PackedInt8Weight(q, scale, bias))
    ref = (x.double() @ q.double().t()) * scale.double() + bias.double()
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-3, float(err)


@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (5, 101, 40), (16, 1536, 64)])
def test_fused_rms_norm_matches_torch(variant, rows, n_in, n_out):
    """y = RMSNorm(x) W^T in one call (odd widths are normalised before padding)."""
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(rows, n_in, generator=gen) * 3, torch.rand(n_in, generator=gen) + 0.5
    w = _bf16(n_out, n_in, seed=6)
    got = cpu_calls.skinny_gemm_bf16(x, cpu_packed.PackedWeight(w), norm_weight=g, eps=1e-5)
    xn = torch.nn.functional.rms_norm(x, (n_in,), g, 1e-5)
    if cpu_build.VARIANTS[variant].x_bf16:
        xn = xn.to(torch.bfloat16).float()
    torch.testing.assert_close(got, xn @ w.float().t(), rtol=1e-2, atol=2e-2 * n_in**0.5)


def test_int8_linear_runs_on_the_kernel(variant):
    from engine.model.weights import Int8Linear

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    lin = Int8Linear(w)
    assert lin._packed is not None
    rel = (lin(x) - x @ w.t()).norm() / (x @ w.t()).norm()
    assert rel < 0.03, float(rel)


@pytest.mark.parametrize("kind", ["bf16", "bf16-float32-normed", "int8", "q4_1", "q4_1b"])
def test_rows_are_shape_invariant(variant, kind):
    """Each row of a 16-row product equals its one-row product bit for bit, whatever tiles
    the rows and outputs land in (3072 outputs: full tiles, 200: tails on each thread).
    The int8 case has a bias: GCC's default FMA contraction once fused the epilogue's
    multiply and add in some tiles only (fixed with -ffp-contract=off)."""
    for n_out in (3072, 200):
        w, b = _bf16(n_out, 576, seed=4), _bf16(n_out, seed=5)
        x, norm = _bf16(16, 576, seed=6), None
        if kind == "int8":
            q = torch.randint(-127, 128, (n_out, 576), generator=torch.Generator().manual_seed(7), dtype=torch.int8)
            packed = cpu_packed.PackedInt8Weight(q, torch.rand(n_out) / 64, b)
            x = x.float() * torch.linspace(0.1, 30.0, 576)
        elif kind == "q4_1":
            packed = cpu_packed.PackedQ4_1Weight(*_q4_1_fields(n_out, 576, seed=7), b)
            x = x.float() * torch.linspace(0.1, 30.0, 576)
        elif kind == "q4_1b":
            packed = cpu_packed.PackedQ4_1BWeight(*_q4_1_fields(n_out, 576, seed=7, gguf_like=True), b)
            x = x.float() * torch.linspace(0.1, 30.0, 576)
        else:
            packed = cpu_packed.PackedWeight(w, b)
        if kind == "bf16-float32-normed":
            x, norm = torch.randn(16, 576, generator=torch.Generator().manual_seed(8)), torch.rand(576) + 0.5
        full = cpu_calls.skinny_gemm_bf16(x, packed, norm_weight=norm)
        for r in range(16):
            assert torch.equal(cpu_calls.skinny_gemm_bf16(x[r : r + 1], packed, norm_weight=norm), full[r : r + 1]), r
        # (odd: avx2 bf16's leftover row runs over two blocks at once; up to 4 rows on avx512bf16: one block at a
        # time, STREAM_ROWS)
        for n in (2, 3, 4, 5, 7, 9):
            assert torch.equal(cpu_calls.skinny_gemm_bf16(x[:n], packed, norm_weight=norm), full[:n]), n


def test_packed_weight_unpacks_to_the_original(variant):
    w = _bf16(50, 37, seed=7)  # both dimensions padded
    assert torch.equal(cpu_packed.PackedWeight(w).unpack(), w)


def test_bf16_linear_runs_on_the_kernel(variant):
    w, x = _bf16(64, 96, seed=8), _bf16(2, 96, seed=9)
    linear = Linear(w)
    assert linear._kernel is not None
    assert torch.equal(linear.weight, w)
    assert torch.equal(linear(x), cpu_calls.skinny_gemm_bf16(x, cpu_packed.PackedWeight(w)))


def test_bad_inputs_are_refused_with_a_message():
    if not cpu_build.available():
        with pytest.raises(RuntimeError, match="unavailable"):
            cpu_calls.skinny_gemm_bf16(_bf16(1, 8, seed=0), cpu_packed.PackedWeight(_bf16(16, 8, seed=1)))
        return
    packed = cpu_packed.PackedWeight(_bf16(16, 8, seed=1))
    with pytest.raises(ValueError, match="columns"):
        cpu_calls.skinny_gemm_bf16(_bf16(1, 9, seed=0), packed)
    with pytest.raises(ValueError, match="bf16 or float32"):
        cpu_calls.skinny_gemm_bf16(torch.randn(1, 8, dtype=torch.float64), packed)


SNIPPET = """
import torch
from engine.kernels import cpu_build
from engine.model.weights import Linear
w = torch.randn(32, 64).to(torch.bfloat16)
x = torch.randn(3, 64).to(torch.bfloat16)
lin = Linear(w)
y = lin(x)
ref = x.float() @ w.float().t()
assert torch.allclose(y.float(), ref, rtol=2e-2, atol=0.5), (y, ref)
assert lin._kernel is None
assert torch.equal(lin.weight, w)
print("WHY:", cpu_build.why_unavailable())
"""


@pytest.mark.parametrize(
    "env,why",
    [
        ({"SPECLENS_CPU_KERNEL": "0"}, "SPECLENS_CPU_KERNEL=0"),
        ({"CC": "/bin/false", "SPECLENS_CPU_KERNEL": "auto"}, None),
    ],
    ids=["disabled", "compiler-fails"],
)
def test_without_the_kernel_bf16_falls_back_and_says_why(tmp_path, env, why):
    full_env = {**os.environ, "SPECLENS_CACHE": str(tmp_path), **env}
    if "CC" in env:
        if not cpu_build._cpu_supports():
            pytest.skip(f"no kernel variant for this CPU, the kernel is never compiled: {cpu_build.why_unavailable()}")
        why = "compiling"
    done = subprocess.run(
        [sys.executable, "-c", SNIPPET], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "WHY:" in done.stdout and why in done.stdout, done.stdout


@pytest.mark.parametrize("weights", ["bf16", "q4_1"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_bf16_passes_are_shape_invariant_end_to_end(variant, model_type, weights):
    """With our kernels every piece of a bf16 pass on the CPU treats each token on its
    own (products, fused RMSNorm, rotary, attention), so the logits of a token do not
    depend on how many tokens share the pass: a K-token verification pass agrees bit
    for bit with K one-token passes, and greedy speculative decoding reproduces the
    baseline exactly (no near-ties)."""
    from conftest import tiny_hf_model

    from engine.model.transformer import ModelConfig, Transformer

    hf = tiny_hf_model(model_type, 512, 0)
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16)
    assert model.act_dtype == torch.float32
    if weights == "q4_1":  # every layer matrix quantised to Q4_1 blocks (Qwen2's q/k/v bias kept)
        from engine.model.weights import quantize_q4_1

        assert quantize_q4_1(model) == 4 * model.cfg.num_layers
    prompt = list(range(3, 40))
    cache = model.new_cache(64)
    model.prefill(prompt, cache)
    base = cache.length
    new = torch.tensor([7, 9, 11, 13, 15])
    positions = torch.arange(base, base + 5)
    together = model.run_pass(new, positions, cache).logits  # [5, V]
    for i in range(5):
        cache.length = base + i
        alone = model.run_pass(new[i : i + 1], positions[i : i + 1], cache).logits
        assert torch.equal(alone[0], together[i]), i
    # a tree mask (token 3 sees the prefix, token 0 and itself) agrees with the causal pass of that path
    cache.length = base
    mask = torch.zeros(4, base + 4, dtype=torch.bool)
    mask[:, :base] = True
    for row, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 3]]):
        mask[row, [base + a for a in ancestors]] = True
    tree = model.run_pass(new[:4], torch.tensor([base, base + 1, base + 1, base + 1]), cache, mask=mask).logits
    cache.length = base
    chain = model.run_pass(new[[0, 3]], positions[:2], cache).logits
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
    tree = model.run_pass(tokens, base + torch.tensor(depth), cache, mask=mask).logits
    cache.length = base
    chain = model.run_pass(tokens[[0, 2, 4]], positions[:3], cache).logits
    assert torch.equal(tree[[0, 2, 4]], chain)


def test_a_prefill_gives_its_rows_what_decoding_gives_them(variant):
    """A prompt's pass runs on the same kernels (attention included) as decoding, so its
    rows -- hidden states, the cache, the last logits -- are bit for bit those of a
    shorter prefill followed by one-token passes."""
    from conftest import tiny_hf_model

    from engine.model.transformer import ModelConfig, Transformer

    hf = tiny_hf_model("llama", 512, 0)
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16)
    prompt = list(range(3, 80))
    whole = model.new_cache(96)
    out = model.prefill_features(prompt, whole)
    logits, hidden = out.logits[0], out.hidden
    parts = model.new_cache(96)
    rows = [model.prefill_features(prompt[:70], parts).hidden]
    for i in range(70, len(prompt)):
        one = model.run_pass(torch.tensor([prompt[i]]), torch.tensor([i]), parts, features=True)
        rows.append(one.hidden)
    assert torch.equal(torch.cat(rows), hidden)
    assert torch.equal(one.logits[0], logits)
    assert torch.equal(whole.k[:, :, : len(prompt)], parts.k[:, :, : len(prompt)])
    assert torch.equal(whole.v[:, :, : len(prompt)], parts.v[:, :, : len(prompt)])


@pytest.mark.parametrize(
    "weights,kv", [("bf16", "f32"), ("q4_1", "f32"), ("int8", "f32"), ("q4_1", "bf16"), ("q4_1b", "bf16")]
)
def test_layer_stack_equals_the_per_layer_path(variant, weights, kv):
    """decode_layers (every layer of a few-token pass in one C call) gives the per-layer
    Python path's logits, hidden rows and cache bit for bit, causal and under a tree mask,
    with a rebuilt stack after a matrix is swapped; with a float32 cache and a bf16 one (the q4
    drafter's)."""
    from conftest import tiny_hf_model

    from engine.model.transformer import ModelConfig, Transformer
    from engine.model.weights import quantize_q4_1

    hf = tiny_hf_model("qwen2", 512, 0)  # q/k/v bias: the biased product path too
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16, int8=weights == "int8")
    if weights == "q4_1":
        quantize_q4_1(model)
    if weights == "q4_1b":
        quantize_q4_1(model, cpu_packed.PackedQ4_1BWeight)
    if kv == "bf16":
        model.attention_dtype = torch.bfloat16
    assert model._layer_stack() is not None
    cache = model.new_cache(64)
    assert cache.k.dtype == (torch.bfloat16 if kv == "bf16" else torch.float32)
    model.prefill(list(range(3, 30)), cache)
    base = cache.length
    new = torch.tensor([7, 9, 11, 13])
    mask = torch.zeros(4, base + 4, dtype=torch.bool)
    mask[:, :base] = True
    for row, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3]]):
        mask[row, [base + a for a in ancestors]] = True
    for kw in ({}, {"mask": mask}):
        results = []
        for use_stack in (True, False):
            cache.length = base
            if not use_stack:
                model._layer_stack = lambda: None
            out = model.run_pass(new, torch.arange(base, base + 4), cache, features=True, **kw)
            logits, hidden = out.logits, out.hidden
            model.__dict__.pop("_layer_stack", None)
            results.append((logits, hidden, cache.k[:, :, : base + 4].clone(), cache.v[:, :, : base + 4].clone()))
        for fused, loop in zip(*results):
            assert torch.equal(fused, loop)
    first = model._layer_stack()
    model.layers[0].o = model.layers[1].o  # a swapped matrix: the stack is rebuilt, never stale
    assert model._layer_stack() is not first


def test_passes_on_other_threads_and_at_once_give_the_main_threads_bits(variant):
    """Gradio runs each request on a worker thread, and two visitors' passes run at once: every pass (a
    prefill, then few-token passes with the layer stack in one call) equals the main thread's bit for bit."""
    import threading

    from conftest import tiny_hf_model

    from engine.model.transformer import ModelConfig, Transformer

    hf = tiny_hf_model("llama", 512, 0)
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16)
    assert model._layer_stack() is not None

    def passes(seed: int) -> list[torch.Tensor]:
        cache = model.new_cache(96)
        out = [model.prefill(list(range(3 + seed, 40 + seed)), cache).clone()]
        for step in range(12):
            new = torch.tensor([5 + step + seed, 9, 11])
            out.append(model.run_pass(new, torch.arange(cache.length, cache.length + 3), cache).logits.clone())
        return out

    expected = {seed: passes(seed) for seed in (0, 1)}
    assert not torch.equal(expected[0][-1], expected[1][-1])  # two different runs: a mix-up would show
    results: dict = {}

    def worker(seed: int, key: str) -> None:
        results[key] = passes(seed)

    alone = threading.Thread(target=worker, args=(0, "alone"))
    alone.start()
    alone.join()
    both = [threading.Thread(target=worker, args=(seed, f"both-{seed}")) for seed in (0, 1)]
    for thread in both:
        thread.start()
    for thread in both:
        thread.join()
    for key, seed in (("alone", 0), ("both-0", 0), ("both-1", 1)):
        assert len(results[key]) == len(expected[seed])
        for got, want in zip(results[key], expected[seed]):
            assert torch.equal(got, want), key


TEAM_SNIPPET = """
import sys, torch
sys.path.insert(0, "tests")
from conftest import tiny_hf_model
from engine.kernels import cpu_build
from engine.model import chains
from engine.model.transformer import ModelConfig, Transformer
from engine.model.weights import quantize_q4_1
torch.set_num_threads(int(sys.argv[3]))  # the kernels' team is torch's libgomp's
torch.manual_seed(0)
hf = tiny_hf_model("llama", 512, 0)
out = []
with cpu_build.using(sys.argv[2]):
    for weights in ("bf16", "q4_1"):
        model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16)
        if weights == "q4_1":
            quantize_q4_1(model)
        cache = model.new_cache(160)
        out.append(model.prefill(list(range(3, 90)), cache))
        for step in range(6):
            new = torch.tensor([5 + step, 9, 11, 2, 7, 13, 4][: 1 + step])
            out.append(model.run_pass(new, torch.arange(cache.length, cache.length + len(new)), cache).logits)
        if chains.greedy_chain_ready(model, cache):
            out.append(chains.greedy_chain(model, 5, cache, 4)[0])
torch.save(out, sys.argv[1])
"""


def test_teams_of_any_size_give_the_same_bits(tmp_path):
    """csrc/task_pool.h hands a product's grains out by owned ranges and stealing: a team of 1 thread, and one of
    4 (more threads than a 2-core host has: helpers descheduled mid-pass, their grains taken by others), give
    every pass -- a prefill, one- to six-token passes, a greedy chain, bf16 and Q4_1 -- the bits of a team of 2.
    On the variant this CPU runs: the pool is the same C for every variant, and each row's sums are the
    variant's own whichever thread computes them (the variants' row invariance is tested above)."""
    variant = cpu_build.variant()
    if variant is None:
        pytest.skip(f"no CPU kernel here: {cpu_build.why_unavailable()}")
    results = {}
    for n in (2, 1, 4):
        path = tmp_path / f"{n}.pt"
        done = subprocess.run(
            [sys.executable, "-c", TEAM_SNIPPET, str(path), variant, str(n)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        results[n] = torch.load(path)
    for n in (1, 4):
        assert len(results[n]) == len(results[2]) >= 14
        for got, want in zip(results[n], results[2]):
            assert torch.equal(got, want), n


def test_feature_layers_are_the_layers_outputs_bit_for_bit(variant):
    """forward's feature_layers (what an EAGLE-3-style head reads): the layer stack, split after
    the wanted layers, gives the per-layer path's rows bit for bit; the last layer's rows, the
    logits and the cache are those of a pass without it."""
    from conftest import tiny_hf_model

    from engine.model.transformer import ModelConfig, Transformer

    hf = tiny_hf_model("llama", 512, 0)
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16)
    n_layers, E = len(model.layers), model.cfg.hidden_size
    want = tuple(sorted({0, n_layers // 2, n_layers - 1}))
    cache = model.new_cache(64)
    model.prefill(list(range(3, 30)), cache)
    base = cache.length
    new, positions = torch.tensor([7, 9, 11, 13]), torch.arange(base, base + 4)
    runs = []
    for use_stack, layers in ((True, None), (True, want), (False, want)):
        cache.length = base
        if not use_stack:
            model._layer_stack = lambda: None
        out = model.run_pass(new, positions, cache, features=True, feature_layers=layers)
        logits, hidden = out.logits, out.hidden
        model.__dict__.pop("_layer_stack", None)
        runs.append((logits, hidden, cache.k[:, :, : base + 4].clone(), cache.v[:, :, : base + 4].clone()))
    plain, split, loop = runs
    assert split[1].shape == (4, len(want) * E)
    assert torch.equal(split[1][:, -E:], plain[1])
    for a, b in zip(split, loop):
        assert torch.equal(a, b)
    for a, b in zip(split[::2], plain[::2]):
        assert torch.equal(a, b)
    cache.length = base
    with pytest.raises(ValueError, match="feature_layers"):
        model.run_pass(new, positions, cache, features=True, feature_layers=(0,) if n_layers > 1 else (1,))


def test_swiglu_matches_torch(variant):
    """The kernels' SwiGLU against torch's silu(gate) * up, over the range where exp matters."""
    gate_up = torch.randn(5, 2 * 77, generator=torch.Generator().manual_seed(3)) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    got = cpu_calls.swiglu(gate_up)
    ref = torch.nn.functional.silu(gate_up[:, :77]) * gate_up[:, 77:]
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(cpu_calls.swiglu(gate_up[2:3].contiguous()), got[2:3])  # rows on their own


@pytest.mark.parametrize("tokens,length", [(1, 7), (1, 1000), (5, 130), (16, 400), (40, 40), (64, 300)])
@pytest.mark.parametrize("dim", [64, 72])
@pytest.mark.parametrize("tree", [False, True])
def test_attention_matches_torch(variant, tokens, length, dim, tree):
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
    got = cpu_calls.attend_few(q, k, v, length, mask if tree else None)  # [T, H D]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None, :, :length], v[None, :, :length], attn_mask=mask[None, None], enable_gqa=True
    )[0]  # [H, T, D]
    torch.testing.assert_close(got, ref.transpose(0, 1).reshape(tokens, 6 * dim), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [2, 5, 16, 90])
@pytest.mark.parametrize("hole", [None, 40, 10])
def test_attention_rows_do_not_depend_on_the_pass(variant, tokens, hole):
    """Queries of one key/value head walk the shared prefix together (attend_few's key
    blocks); each token's output must still be bit for bit what it gets alone: causally,
    under a tree mask, and when a row does not see the whole prefix (hole: a cached
    position one row skips, which shortens or disables the shared walk)."""
    gen = torch.Generator().manual_seed(tokens)
    length, heads = 200, 9
    q = torch.randn(heads, tokens, 64, generator=gen)
    k = torch.randn(3, length + 8, 64, generator=gen)
    v = torch.randn(3, length + 8, 64, generator=gen)
    mask = torch.ones(tokens, length, dtype=torch.bool)
    mask[:, length - tokens :] = torch.tril(mask[:, length - tokens :])
    mask[1:, length - tokens] = False  # a tree: only token 0 sees the first new slot
    if hole is not None:
        mask[tokens - 1, hole] = False
    for rows in (None, mask):
        together = cpu_calls.attend_few(q, k, v, length, rows)  # [T, H D]
        for t in range(tokens):
            if rows is None:
                alone = cpu_calls.attend_few(q[:, t : t + 1], k, v, length - tokens + t + 1)
            else:
                alone = cpu_calls.attend_few(q[:, t : t + 1], k, v, length, rows[t : t + 1].contiguous())
            assert torch.equal(alone[0], together[t]), (t, rows is None)


@pytest.mark.parametrize("tokens,length", [(1, 150), (5, 130), (16, 400)])
@pytest.mark.parametrize("dim", [64, 72])
@pytest.mark.parametrize("tree", [False, True])
def test_attention_reads_a_bf16_cache_as_its_float32_values(variant, tokens, length, dim, tree):
    """A bf16 cache (the q4 drafter's) is read widened, exactly: attention over bf16 keys and values gives,
    bit for bit, what it gives over float32 ones holding the same numbers, causally and under a mask, on
    the chunked path (D = 64) and the one-query path (D = 72)."""
    gen = torch.Generator().manual_seed(tokens + length + dim)
    q = torch.randn(9, tokens, dim, generator=gen)
    k = torch.randn(3, length + 8, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(3, length + 8, dim, generator=gen).to(torch.bfloat16)
    mask = None
    if tree:
        mask = torch.rand(tokens, length, generator=gen) < 0.6
        mask[:, 0] = True
    got = cpu_calls.attend_few(q, k, v, length, mask)
    want = cpu_calls.attend_few(q, k.float(), v.float(), length, mask)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="float32 or bf16"):
        cpu_calls.attend_few(q, k, v.float(), length, mask)


def test_rope_and_store_rounds_keys_and_values_into_a_bf16_cache(variant):
    """rope_and_store into a bf16 cache writes the float32 path's keys and values rounded to nearest even
    (torch's rounding), and the same rotated queries."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens, start = 9, 3, 64, 4, 17
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, 1).contiguous(), torch.cat([angles.sin()] * 2, 1).contiguous()
    k32, v32 = torch.zeros(kv_heads, 32, dim), torch.zeros(kv_heads, 32, dim)
    k16, v16 = (
        torch.zeros(kv_heads, 32, dim, dtype=torch.bfloat16),
        torch.zeros(kv_heads, 32, dim, dtype=torch.bfloat16),
    )
    q32 = cpu_calls.rope_and_store(qkv, cos, sin, k32, v32, start, heads)
    q16 = cpu_calls.rope_and_store(qkv, cos, sin, k16, v16, start, heads)
    assert torch.equal(q32, q16)
    assert torch.equal(k16.view(torch.int16), k32.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(v16.view(torch.int16), v32.to(torch.bfloat16).view(torch.int16))


# ---- (e) choosing a variant -------------------------------------------------------


@pytest.fixture
def fresh_choice(monkeypatch):
    """cpu_build with no choice made yet (restored afterwards); nothing compiled unless a
    test lets it."""
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.delenv("SPECLENS_CPU_KERNEL", raising=False)
    return monkeypatch


AVX2_ONLY = {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}


def test_an_avx2_cpu_gets_the_avx2_variant_and_says_why(fresh_choice):
    fresh_choice.setattr(cpu_build, "_cpu_flags", lambda: AVX2_ONLY)
    fresh_choice.setattr(cpu_build, "_is_x86", lambda: True)
    fresh_choice.setattr(cpu_build, "_build", lambda name: pytest.fail(f"built {name}") if name != "avx2" else None)
    fresh_choice.setattr(cpu_build, "_self_check", lambda lib: None)
    # (the fake avx2 library is None: load_variant stores it, _choose reports it)
    name, _, reason = cpu_build._choose()
    assert name == "avx2"
    assert "fallback" in reason and "avx512bf16: this CPU lacks avx512f" in reason and "avx512_bf16" in reason


def test_a_forced_variant_the_cpu_lacks_leaves_torch_with_the_reason(fresh_choice):
    fresh_choice.setattr(cpu_build, "_cpu_flags", lambda: AVX2_ONLY)
    fresh_choice.setattr(cpu_build, "_is_x86", lambda: True)
    fresh_choice.setenv("SPECLENS_CPU_KERNEL", "avx512bf16")
    assert not cpu_build.available()
    why = cpu_build.why_unavailable()
    assert "SPECLENS_CPU_KERNEL=avx512bf16" in why and "lacks" in why
    assert cpu_build.describe() == {"variant": None, "label": "torch's ops", "reason": why}


@pytest.mark.parametrize("machine", ["aarch64", "arm64"])
def test_arm64_falls_back_without_calling_the_compiler(fresh_choice, machine):
    fresh_choice.setattr(cpu_build.platform, "machine", lambda: machine)
    fresh_choice.setattr(cpu_build, "_build", lambda name: pytest.fail("no x86 flags on ARM"))
    for setting in ("auto", "avx2"):
        fresh_choice.setattr(cpu_build, "_state", {})
        fresh_choice.setenv("SPECLENS_CPU_KERNEL", setting)
        assert not cpu_build.available() and cpu_build.variant() is None
        assert machine in cpu_build.why_unavailable() and "x86-64 only" in cpu_build.why_unavailable()


def test_a_cpu_without_avx2_gets_no_variant(fresh_choice):
    fresh_choice.setattr(cpu_build, "_cpu_flags", lambda: {"fpu", "sse2", "sse4_2", "avx"})
    fresh_choice.setattr(cpu_build, "_is_x86", lambda: True)
    fresh_choice.setattr(cpu_build, "_build", lambda name: pytest.fail("nothing to build"))
    assert not cpu_build.available()
    assert "no kernel variant runs here" in cpu_build.why_unavailable()
    assert "avx2: this CPU lacks avx2, fma" in cpu_build.why_unavailable()


def test_dtype_auto_is_bf16_wherever_a_kernel_runs(monkeypatch):
    from engine.model import loading as models

    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(cpu_build, "available", lambda: True)
    assert models.resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(cpu_build, "available", lambda: False)
    assert models.resolve_dtype("auto") == torch.float32
    assert models.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert models.resolve_dtype("float32") == torch.float32


VARIANT_SNIPPET = """
import torch
from engine.kernels import cpu_build
from engine.model.loading import resolve_dtype
from engine.model.weights import Linear
lin = Linear(torch.randn(32, 64).to(torch.bfloat16))
print("VARIANT:", cpu_build.variant(), lin._kernel is not None, resolve_dtype("auto"))
print("DESCRIBE:", cpu_build.describe())
"""


@pytest.mark.parametrize("setting", ["avx2", "bogus"])
def test_speclens_cpu_kernel_forces_a_variant(setting):
    """SPECLENS_CPU_KERNEL=<variant> runs that variant; an unknown value is ignored with a note."""
    if setting == "avx2" and cpu_build.variant_support("avx2") is not None:
        pytest.skip(cpu_build.variant_support("avx2"))
    if setting == "bogus" and not cpu_build.available():
        pytest.skip(f"no kernel here: {cpu_build.why_unavailable()}")
    env = {**os.environ, "SPECLENS_CPU_KERNEL": setting}
    done = subprocess.run(
        [sys.executable, "-c", VARIANT_SNIPPET], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    if setting == "avx2":
        assert "VARIANT: avx2 True torch.bfloat16" in done.stdout, done.stdout
    else:  # ignored: the automatic choice runs (whichever this CPU's best is)
        assert "VARIANT: None" not in done.stdout and " True torch.bfloat16" in done.stdout, done.stdout
        assert "'bogus' is not 0, auto or a variant" in done.stdout, done.stdout


# ---- Q4_1 weights ------------------------------------------------------------------


def _q4_1_fields(n_out, n_in, seed, gguf_like=False):
    """Random Q4_1 blocks: q uint8 [out, in] in 0..15, d and m float16 [out, in / 32]. gguf_like: as
    llama.cpp's rule makes them from a matrix whose blocks straddle 0 (m the block's minimum: -15 d < m < 0;
    the default model's blocks have -14.6 <= m / d <= -0.63)."""
    gen = torch.Generator().manual_seed(seed)
    groups = n_in // 32
    q = torch.randint(0, 16, (n_out, n_in), generator=gen, dtype=torch.uint8)
    d = torch.rand(n_out, groups, generator=gen) / 8
    if gguf_like:
        d = d + 1 / 64  # a row's largest d at most 9x its smallest (the default model: 28x at most, 2x typically)
        return q, d.half(), (-d * (0.6 + 14 * torch.rand(n_out, groups, generator=gen))).half()
    return q, d.half(), (torch.randn(n_out, groups, generator=gen) / 4).half()


def _dequantised(q, d, m):
    return d.float().repeat_interleave(32, 1) * q.float() + m.float().repeat_interleave(32, 1)


def _q4_product(x, w):
    """What the Q4_1 kernel computes, in float64: x [rows, in] zero-padded to a multiple of 32 and
    quantised per 16 inputs to int8 (scale = max |x| / 127, nearest even; llama.cpp's Q8 rows take
    one scale per 32), times the dequantised w [out, in]."""
    x = torch.nn.functional.pad(x.float(), (0, -x.shape[1] % 32))
    groups = x.view(x.shape[0], -1, 16)
    scale = groups.abs().amax(2) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    xq = torch.clamp(torch.round(groups * (1.0 / scale)), -127, 127)
    xd = (xq.double() * scale.double()).view(x.shape[0], -1)[:, : w.shape[1]]
    return xd @ w.double().t()


def _assert_q4_product(product, packed, w, x, bias) -> torch.Tensor:
    """A 4-bit product's contract (decode_kernels.c's skinny_gemm_q4_1 or _q4_1b): x [rows, in] quantised per 16 inputs times the
    dequantised w [out, in] (+ bias), to float32 rounding; bf16 x as its float32 widening; the fused RMSNorm
    alike. Returns the product of x."""
    rows, n_in = x.shape
    got = product(x, packed)
    assert got.dtype == torch.float32 and got.shape == (rows, w.shape[0])
    ref = _q4_product(x, w) + bias
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    as_bf16 = product(x.to(torch.bfloat16), packed, out_dtype=torch.float32)
    assert torch.equal(as_bf16, product(x.to(torch.bfloat16).float(), packed))
    g = torch.rand(n_in, generator=torch.Generator().manual_seed(4)) + 0.5
    normed = product(x, packed, norm_weight=g, eps=1e-5)
    ref = _q4_product(torch.nn.functional.rms_norm(x, (n_in,), g, 1e-5), w) + bias
    assert float((normed.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    return got


@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (5, 1536, 40), (16, 64, 200), (3, 96, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q4_1_matches_the_dequantised_product(variant, rows, n_in, n_out, with_bias):
    """x is quantised per 16 inputs to int8 (|xq| <= 127) and the nibbles multiply it exactly:
    the result is the product of that x with the GGUF's weights, w = d q + m, up to float32
    rounding, and within 2% of the exact product (outlier channels included: one scale per 16
    inputs)."""
    q, d, m = _q4_1_fields(n_out, n_in, seed=1)
    b = _bf16(n_out, seed=3) if with_bias else None
    packed = cpu_packed.PackedQ4_1Weight(q, d, m, b)
    w = _dequantised(q, d, m)
    assert torch.equal(packed.unpack(), w)
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 30.0, n_in)
    bias = b.double() if b is not None else 0
    got = _assert_q4_product(cpu_calls.skinny_gemm_bf16, packed, w, x, bias)
    exact = x.double() @ w.double().t() + bias
    assert float((got.double() - exact).abs().max() / exact.abs().max()) < 2e-2


def test_q4_1_quantises_any_matrix_and_pads_odd_widths(variant):
    w = torch.randn(50, 70, generator=torch.Generator().manual_seed(5))  # 70 inputs: padded to 96
    packed = cpu_packed.PackedQ4_1Weight.quantize(w)
    deq = packed.unpack()
    blocks = torch.nn.functional.pad(w, (0, 26)).view(50, 3, 32)  # zero padding takes part in min / max
    step = ((blocks.amax(2) - blocks.amin(2)) / 15).repeat_interleave(32, 1)[:, :70]
    assert deq.shape == (50, 70) and bool(((deq - w).abs() <= 0.51 * step + 2e-3).all())  # half a step
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(
        cpu_calls.skinny_gemm_bf16(x, packed).double(), _q4_product(x, deq), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kind", ["q4_1", "q4_1b"])
def test_4_bit_products_give_the_same_bits_on_every_variant(kind):
    """Integer sums, one quantisation of x (per 16 inputs) and the same float ops per lane: the Q4_1 and Q4_1B
    products do not depend on the instruction set (bf16's does, in the last bits)."""
    names = [n for n in cpu_build.VARIANTS if cpu_build.variant_support(n) is None]
    if len(names) < 2:
        pytest.skip(f"fewer than two variants here ({names})")
    b = _bf16(960, seed=9)
    if kind == "q4_1":
        packed, product = cpu_packed.PackedQ4_1Weight(*_q4_1_fields(960, 576, seed=8), b), cpu_calls.skinny_gemm_bf16
    else:
        packed = cpu_packed.PackedQ4_1BWeight(*_q4_1_fields(960, 576, seed=8, gguf_like=True), b)
        product = cpu_calls.skinny_gemm_bf16
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(10)) * torch.linspace(0.1, 30.0, 576)
    outs = []
    for name in names:
        with cpu_build.using(name):
            outs.append(product(x, packed))
    assert all(torch.equal(outs[0], other) for other in outs[1:]), names


@pytest.mark.parametrize("packing", ["Q4_1", "Q4_1B"])
@pytest.mark.parametrize("rows,n_in,n_out,top", [(1, 576, 960, 32), (7, 576, 200, 8), (3, 70, 50, 64), (2, 64, 40, 1)])
def test_rescored_q4_head_is_q4_1_with_its_best_outputs_in_int8(variant, rows, n_in, n_out, top, packing):
    """head_q4_rescored's contract, bit for bit: each row's `top` best outputs of the 4-bit product
    (Q4_1 or Q4_1B: its own blocks' product; value
    descending, the lower index first among equals) hold the int8 product's values (x quantised per row to
    int16, as skinny_gemm_int8w), every other output the Q4_1 product's; fused RMSNorm and bf16 x alike;
    a row's result does not depend on the other rows; top >= n_out re-scores every output (the whole int8
    product). Odd widths: 70 inputs are padded to 96, 50 outputs to 64 (padding never a candidate)."""
    gen = torch.Generator().manual_seed(21)
    w = torch.randn(n_out, n_in, generator=gen)
    w[:, :3] *= 8.0  # a few strong inputs, as a model's output projection has
    x = torch.randn(rows, n_in, generator=gen) * torch.linspace(0.2, 3.0, n_in)
    x[0, 5] = 40.0  # an outlier: the int16 rows' scale follows it
    packing = {"Q4_1": cpu_packed.PackedQ4_1Weight, "Q4_1B": cpu_packed.PackedQ4_1BWeight}[packing]
    head = cpu_packed.RescoredQ4Head(w, top, packing)
    assert isinstance(head.q4, packing)
    q, scale = cpu_packed.int8_per_channel(w)
    int8 = cpu_packed.PackedInt8Weight(q, scale)
    g = torch.rand(n_in, generator=gen) + 0.5
    for xin, norm in ((x, None), (x, g), (x.to(torch.bfloat16), None)):
        got = cpu_calls.head_q4_rescored(xin, head, norm, 1e-5)
        q4_only = cpu_calls.skinny_gemm_bf16(xin, head.q4, torch.float32, norm, 1e-5)  # (dispatches on the kind)
        if norm is not None and n_in % 32:  # padded to Q4_1's groups: the rows are normalised by torch first
            xn = torch.nn.functional.rms_norm(xin, (n_in,), norm, 1e-5)
            int8_all = cpu_calls.skinny_gemm_bf16(xn, int8, torch.float32)
        else:
            int8_all = cpu_calls.skinny_gemm_bf16(xin, int8, torch.float32, norm, 1e-5)
        best = torch.sort(q4_only, dim=1, descending=True, stable=True).indices[:, :top]  # [rows, top]
        want = q4_only.clone()
        want.scatter_(1, best, int8_all.gather(1, best))
        assert got.shape == (rows, n_out) and torch.equal(got, want), (xin.dtype, norm is not None)
        for t in range(rows):  # rows are independent
            assert torch.equal(cpu_calls.head_q4_rescored(xin[t : t + 1], head, norm, 1e-5)[0], got[t])
    whole = cpu_packed.RescoredQ4Head(w, n_out + 5, packing)
    assert torch.equal(cpu_calls.head_q4_rescored(x, whole), cpu_calls.skinny_gemm_bf16(x, int8, torch.float32))
    with pytest.raises(ValueError, match="as Q4_1 or Q4_1B"):
        cpu_packed.RescoredQ4Head(w, 4, cpu_packed.PackedInt8Weight)
    for bad in (0, 1025):
        with pytest.raises(ValueError, match="between 1 and 1024"):
            cpu_packed.RescoredQ4Head(w, bad)


def test_rescored_q4_head_breaks_ties_by_index(variant):
    """Equal Q4_1 values: the lower output index is re-scored (a stable order, the same on every variant and
    every row count)."""
    w = torch.zeros(200, 64)
    w[:, 0] = 1.0  # every output equal (one strong input)
    w[150, 0] = 2.0  # one best output, far along
    head = cpu_packed.RescoredQ4Head(w, 4)
    x = torch.zeros(1, 64)
    x[0, 0] = 1.0
    q4_only = cpu_calls.skinny_gemm_bf16(x, head.q4, torch.float32)
    got = cpu_calls.head_q4_rescored(x, head)
    changed = (got != q4_only).nonzero()[:, 1].tolist()
    assert set(changed) <= {150, 0, 1, 2}  # only the candidates may change
    q, scale = cpu_packed.int8_per_channel(w)
    int8_all = cpu_calls.skinny_gemm_bf16(x, cpu_packed.PackedInt8Weight(q, scale), torch.float32)
    assert torch.equal(got[0, [150, 0, 1, 2]], int8_all[0, [150, 0, 1, 2]])
    assert torch.equal(got[0, 3:150], q4_only[0, 3:150])


def test_top_rows_are_the_best_entries_lower_index_first(variant):
    """top_rows (the events' top entries, all of a pass's rows in one call): each row's best entries, value
    descending, the lower index first among equals, NaN never one of them; rows from different tensors (views
    included); torch.topk's values on rows without ties."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(3, 49152, generator=gen)
    tied = torch.zeros(49152)
    tied[[25000, 40, 41, 49151]] = 1.0
    tied[7] = float("nan")
    rows = [big[0], big[2], torch.softmax(torch.randn(49152, generator=gen) * 4, -1), tied]
    got = cpu_calls.top_rows(rows, 10)
    for row, ids in zip(rows[:3], got[:3]):
        values, want = torch.topk(row, 10)
        assert ids == want.tolist() and torch.equal(row[ids], values)
    assert got[3][:4] == [40, 41, 25000, 49151] and 7 not in got[3]
    short = torch.randn(7, generator=gen)
    assert cpu_calls.top_rows([short], 10) == [torch.topk(short, 7).indices.tolist()]
    assert cpu_calls.top_rows([], 10) == []
    with pytest.raises(ValueError, match="float32 vectors of one length"):
        cpu_calls.top_rows([rows[0], short], 10)


def _chain_model(weights: str, vocab: int = 512):
    """A tiny model all on our kernels, its weights bf16, int8 (float32 activations, as the int8 drafter's),
    q4 (the q4 drafter's: Q4_1B blocks) or q4-q4_1 (the q4 drafter's build on Q4_1 blocks, its head re-scored
    alike), and a cache of 64 holding a 27-token prompt."""
    from conftest import tiny_hf_model

    from engine.drafters.model import q4_weights
    from engine.model.loading import _state_from_transformer
    from engine.model.transformer import ModelConfig, Transformer
    from engine.model.weights import RescoredQ4Linear, quantize_q4_1

    hf = tiny_hf_model("llama", vocab, 0)
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16)
    if weights == "int8":
        model = Transformer(model.cfg, dict(hf.state_dict()), torch.float32, int8=True)
    if weights == "q4":
        model = q4_weights(model)
    if weights == "q4-q4_1":
        target = model
        model = Transformer(target.cfg, _state_from_transformer(target), torch.bfloat16)
        quantize_q4_1(model, cpu_packed.PackedQ4_1Weight)
        model.lm_head = RescoredQ4Linear(target.lm_head.weight, RescoredQ4Linear.TOP, cpu_packed.PackedQ4_1Weight)
        model.attention_dtype = torch.bfloat16
    cache = model.new_cache(64)
    assert chains.greedy_chain_ready(model, cache)
    model.prefill(list(range(3, 30)), cache)
    return model, cache


@pytest.mark.parametrize("weights", ["bf16", "int8", "q4", "q4-q4_1"])
def test_greedy_chain_is_one_token_passes_and_their_argmax(variant, weights):
    """greedy_chain (a greedy drafter's n passes in one C call) gives, bit for bit, what n one-token
    run_pass calls at consecutive slots give, each fed the argmax of the last: the logits, the tokens and
    the cache; from a cache holding a prompt, and from one slot further on. The q4 drafter's head (Q4_1 with
    its best outputs re-scored in int8) and the plain kernel heads alike."""
    from engine.acceptance import argmax_index

    model, cache = _chain_model(weights)
    for start in (cache.length, cache.length + 1):
        cache.length = start
        logits, tokens = chains.greedy_chain(model, 11, cache, 6)
        chain_k, chain_v = cache.k.clone(), cache.v.clone()
        assert cache.length == start + 6 and logits.shape == (6, 512)
        cache.length = start
        token, rows, chosen = 11, [], []
        for i in range(6):
            out = model.run_pass(torch.tensor([token]), torch.tensor([start + i]), cache).logits  # [1, V]
            token = argmax_index(out[0])
            rows.append(out[0])
            chosen.append(token)
        assert torch.equal(logits, torch.stack(rows)) and tokens == chosen
        assert torch.equal(cache.k[:, :, : start + 6], chain_k[:, :, : start + 6])
        assert torch.equal(cache.v[:, :, : start + 6], chain_v[:, :, : start + 6])
    cache.length = 60
    with pytest.raises(ValueError, match="exceeds the KV cache capacity"):
        chains.greedy_chain(model, 11, cache, 6)
    cache.length = 30
    with pytest.raises(ValueError, match="a token id below 512"):
        chains.greedy_chain(model, 512, cache, 2)


def _inverse_cdf(q: torch.Tensor, u: float) -> int:
    """The loop's draw from q [V] at u (engine.sampling.index_at over float64 running sums)."""
    from engine.sampling import index_at

    cdf = torch.cumsum(q, 0, dtype=torch.float64)
    return index_at(q, cdf, cdf[-1].item(), u)


@pytest.mark.parametrize("weights,vocab", [("bf16", 512), ("int8", 512), ("q4", 512), ("bf16", 528)])
def test_sampled_chain_is_one_token_passes_and_draws_from_q(variant, weights, vocab):
    """sampled_chain (a sampled drafter's n passes in one C call, temperature alone): its logits are, bit for
    bit, n one-token run_pass calls' fed the chain's own tokens, and so is the cache; each q row is
    softmax(logits / T) to float32 rounding and sums to 1; each token is the inverse CDF of its q row at its
    uniform (u = 0 and u just below 1 among them); and drawn again and again from one slot, the tokens follow
    q (chi-square), where the softmax at another temperature is rejected (the test can fail). A vocabulary of
    528 ends in a part block of the draw's running sums. A row that y / T overflows has no q: a clear error."""
    from scipy.stats import chisquare

    model, cache = _chain_model(weights, vocab)
    start, temperature = cache.length, 1.3
    u = torch.tensor([0.0, 0.37, 1.0 - 2.0**-53, 0.9, 0.05, 0.61], dtype=torch.float64)
    logits, q, tokens = chains.sampled_chain(model, 11, cache, 6, temperature, u)
    chain_k, chain_v = cache.k.clone(), cache.v.clone()
    assert cache.length == start + 6 and logits.shape == q.shape == (6, vocab)
    cache.length = start
    token = 11
    for i in range(6):
        row = model.run_pass(torch.tensor([token]), torch.tensor([start + i]), cache).logits[0]  # [V]
        assert torch.equal(row, logits[i])
        torch.testing.assert_close(q[i], torch.softmax(row / temperature, -1), rtol=1e-5, atol=1e-7)
        assert abs(float(q[i].sum()) - 1.0) < 1e-5
        assert tokens[i] == _inverse_cdf(q[i], float(u[i]))
        token = tokens[i]
    assert torch.equal(cache.k[:, :, : start + 6], chain_k[:, :, : start + 6])
    assert torch.equal(cache.v[:, :, : start + 6], chain_v[:, :, : start + 6])
    # Many draws from one slot (the first pass again and again): they follow q.
    gen = torch.Generator().manual_seed(7)
    draws = torch.zeros(vocab)
    for _ in range(3000):
        cache.length = start
        _, q0, (t,) = chains.sampled_chain(
            model, 11, cache, 1, temperature, torch.rand(1, generator=gen, dtype=torch.float64)
        )
        draws[t] += 1

    def p_value(probs: torch.Tensor) -> float:
        expected = probs.double() * draws.sum()
        big = expected >= 5  # tokens expected 5 times or more each, the rest pooled
        observed = torch.cat([draws[big], draws[~big].sum().view(1)]).double()
        expected = torch.cat([expected[big], expected[~big].sum().view(1)])
        return float(
            chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue
        )

    assert p_value(q0[0]) > 1e-3
    assert p_value(torch.softmax(logits[0] / (temperature * 1.5), -1)) < 1e-6  # the control
    with pytest.raises(ValueError, match="temperature > 0"):
        chains.sampled_chain(model, 11, cache, 2, 0.0, u[:2])
    with pytest.raises(ValueError, match="temperature > 0"):
        chains.sampled_chain(model, 11, cache, 2, 1e-50, u[:2])  # 0 as a float32
    cache.length = start
    with pytest.raises(ValueError, match="NaN or infinite logit"):
        chains.sampled_chain(model, 11, cache, 2, 1e-38, u[:2])  # every logit / T beyond float32
    with pytest.raises(ValueError, match="float64 uniforms"):
        chains.sampled_chain(model, 11, cache, 2, 1.0, u[:3])


def test_q4_1_reads_gguf_blocks():
    """GGUF's Q4_1 block: d, m float16, then qs[16] with weight j in the low nibble of
    qs[j] and weight j + 16 in the high one."""
    q, d, m = _q4_1_fields(40, 96, seed=11)
    qb = q.view(40, 3, 32)
    raw = torch.cat(
        [d.view(torch.uint8).view(40, 3, 2), m.view(torch.uint8).view(40, 3, 2), qb[..., :16] | (qb[..., 16:] << 4)],
        dim=2,
    ).reshape(40, 60)
    from_raw = cpu_packed.PackedQ4_1Weight.from_gguf_blocks(raw, 96)
    assert torch.equal(from_raw.data, cpu_packed.PackedQ4_1Weight(q, d, m).data)
    as_bytes = cpu_packed.PackedQ4_1BWeight.from_gguf_blocks(raw, 96)
    assert torch.equal(as_bytes.data, cpu_packed.PackedQ4_1BWeight(q, d, m).data)
    assert torch.equal(from_raw.unpack(), _dequantised(q, d, m))


# ---- Q4_1B weights: Q4_1's nibbles, the scales in bytes (the q4 drafter's) ------------------------


@pytest.mark.parametrize("rows,n_in,n_out", [(1, 576, 960), (5, 1536, 40), (16, 64, 200), (3, 96, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q4_1b_keeps_the_nibbles_and_codes_the_scales(variant, rows, n_in, n_out, with_bias):
    """From Q4_1 blocks: the nibbles are Q4_1's, byte for byte; d is its row's step times a code within half a
    step; the weights move by under 1% (rms over rms: m is re-fitted to the block's mean); and the product is
    x (quantised per 16 inputs, as Q4_1's) times what unpack() gives, up to float32 rounding, on bf16 x
    and with the fused RMSNorm alike."""
    q, d, m = _q4_1_fields(n_out, n_in, seed=1, gguf_like=True)
    b = _bf16(n_out, seed=3) if with_bias else None
    packed = cpu_packed.PackedQ4_1BWeight(q, d, m, b)
    q4_1 = cpu_packed.PackedQ4_1Weight(q, d, m, b)
    assert torch.equal(packed.data[..., 32:], q4_1.data[..., 64:])  # [out/16, in/32, 256] nibble bytes
    assert packed.nbytes == packed.data.numel() + 4 * packed.out_padded and packed.data.shape[2] == 288
    codes = packed.data[..., :16].permute(0, 2, 1).reshape(packed.out_padded, -1)[:n_out].float()  # [out, in/32]
    step = packed.dstep[:n_out, None]
    assert bool(((codes * step - d.float()).abs() <= step * (0.5 + 1e-4)).all())
    w = packed.unpack()
    exact_w = _dequantised(q, d, m)
    assert float((w - exact_w).norm() / exact_w.norm()) < 1e-2
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 30.0, n_in)
    bias = b.double() if b is not None else 0
    _assert_q4_product(cpu_calls.skinny_gemm_bf16, packed, w, x, bias)


def test_q4_1b_quantises_any_matrix_and_pads_odd_widths(variant):
    """Any matrix: per block the range [min(w, 0), max(w, 0)] in 15 steps of d rounded up to its code, so each
    weight is within half a step (and m's rounding, d / 32) of its value; blocks of one sign and zero blocks
    included; 70 inputs padded to 96."""
    w = torch.randn(50, 70, generator=torch.Generator().manual_seed(5))
    w[3] = w[3].abs() + 1.0  # a row of positive blocks
    w[4] = -w[4].abs() - 1.0  # and of negative ones
    w[5, :32] = 0.0  # a zero block
    packed = cpu_packed.PackedQ4_1BWeight.quantize(w)
    deq = packed.unpack()
    blocks = torch.nn.functional.pad(w, (0, 26)).view(50, 3, 32)
    lo, hi = blocks.amin(2).clamp_max(0), blocks.amax(2).clamp_min(0)
    d = packed.dstep[:50, None] * torch.ceil((hi - lo) / 15 / packed.dstep[:50, None])
    bound = (0.5 + 1 / 32) * d.repeat_interleave(32, 1)[:, :70] + 1e-5
    assert deq.shape == (50, 70) and bool(((deq - w).abs() <= bound).all())
    assert bool((deq[5, :32] == 0).all())
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(
        cpu_calls.skinny_gemm_bf16(x, packed).double(), _q4_product(x, deq), rtol=1e-5, atol=1e-5
    )


@pytest.mark.real_model
def test_default_model_runs_on_its_gguf_q4_1_blocks():
    """The default model's 210 Q4_1 matrices (fused into 120) run from the GGUF's own
    blocks: 123 MB of weights per pass instead of 269 MB in bf16, and greedy speculation
    reproduces the baseline bit for bit (the kernel is row-invariant; the n-gram drafter
    needs no weights, the tiny-model tests above cover its pass shapes)."""
    if not cpu_build.available():
        pytest.skip(f"no CPU kernel here: {cpu_build.why_unavailable()}")
    from engine import SpeculativeEngine
    from engine.model.loading import ModelLoadError, default_gguf_path
    from engine.model.weights import Q4Linear, use_gguf_q4_1
    from engine.tools.parity import parity_check

    try:
        path = default_gguf_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    engine = SpeculativeEngine.load(dtype="bfloat16")
    model = engine.target.model
    bf16_bytes = model.weight_bytes
    prompt = "Rename x to total: x = 1\nprint(x)"
    before = next_token_distribution(engine, prompt)
    assert use_gguf_q4_1(model, path) == 4 * model.cfg.num_layers
    assert isinstance(model.layers[0].qkv, Q4Linear) and model.weight_bytes < 0.5 * bf16_bytes
    after = next_token_distribution(engine, prompt)
    assert int(torch.as_tensor(before).argmax()) == int(torch.as_tensor(after).argmax())
    # the int8 drafter is built from the Q4_1 matrices (dequantised, then int8 per channel)
    results = list(parity_check(engine, [prompt], "int8", max_new_tokens=12, k=3))
    assert all(r["identical"] for r in results), results
    with pytest.raises(ValueError, match="do not match"):  # another model's file would be refused
        model.layers[0].qkv = Linear(model.layers[0].qkv.weight.flip(0).to(torch.bfloat16))
        use_gguf_q4_1(model, path)
