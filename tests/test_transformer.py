"""Our forward pass against transformers, the tree mask, and KV cache surgery (tiny random models)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_transformer

from engine.drafters.base import DraftTree

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_forward_matches_transformers(model_type):
    hf, model = tiny_transformer(model_type, vocab_size=512)
    ids = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache = model.new_cache(64)
    got = model.run_pass(ids, torch.arange(23), cache).logits
    assert torch.allclose(got, ref, **TOL)
    # Token by token through the cache gives the same logits.
    cache = model.new_cache(64)
    model.run_pass(ids[:10], torch.arange(10), cache)
    for i in range(10, 23):
        row = model.run_pass(ids[i : i + 1], torch.tensor([i]), cache).logits[0]
        assert torch.allclose(row, ref[i], **TOL)


def _tree() -> DraftTree:
    # root -> a(0) -> c(2) -> e(4)
    #      -> b(1) -> d(3)
    #              -> f(5)
    tree = DraftTree()
    for token, parent, depth in [(5, -1, 1), (7, -1, 1), (9, 0, 2), (11, 1, 2), (13, 2, 3), (15, 1, 2)]:
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.q_token.append(1.0)
    return tree


def _tree_pass(model, prefix, tree):
    """Prefill prefix[:-1], then one pass over [pending] + tree nodes with the tree mask."""
    cache = model.new_cache(128)
    model.run_pass(torch.tensor(prefix[:-1]), torch.arange(len(prefix) - 1), cache)
    base = cache.length
    n = len(tree)
    mask = torch.zeros(1 + n, base + 1 + n, dtype=torch.bool)
    mask[:, : base + 1] = True
    for i in range(n):
        for anc in tree.path_to(i):
            mask[1 + i, base + 1 + anc] = True
    tokens = torch.tensor([prefix[-1]] + tree.tokens)
    positions = torch.tensor([base] + [base + d for d in tree.depths])
    logits = model.run_pass(tokens, positions, cache, mask=mask).logits
    return cache, base, logits


def test_tree_mask_logits_equal_each_root_to_node_path():
    _, model = tiny_transformer(vocab_size=512)
    prefix = [3, 14, 15, 92, 65, 35]
    tree = _tree()
    _, _, logits = _tree_pass(model, prefix, tree)
    for i in range(len(tree)):
        path_tokens = [tree.tokens[j] for j in tree.path_to(i)]
        seq = torch.tensor(prefix + path_tokens)
        plain = model.run_pass(seq, torch.arange(len(seq)), model.new_cache(64)).logits
        assert torch.allclose(logits[1 + i], plain[-1], **TOL), f"node {i}"
    plain = model.run_pass(torch.tensor(prefix), torch.arange(len(prefix)), model.new_cache(64)).logits
    assert torch.allclose(logits[0], plain[-1], **TOL)


def test_cache_after_tree_step_equals_cache_of_accepted_path():
    _, model = tiny_transformer(vocab_size=512)
    prefix = [3, 14, 15, 92, 65, 35]
    tree = _tree()
    cache, base, _ = _tree_pass(model, prefix, tree)
    path = [1, 5]  # root -> b -> f
    cache.keep(base, [0] + [1 + i for i in path])
    seq = prefix + [tree.tokens[i] for i in path]
    ref = model.new_cache(128)
    model.run_pass(torch.tensor(seq), torch.arange(len(seq)), ref)
    assert cache.length == ref.length == len(seq)
    assert torch.allclose(cache.k[:, :, : len(seq)], ref.k[:, :, : len(seq)], **TOL)
    assert torch.allclose(cache.v[:, :, : len(seq)], ref.v[:, :, : len(seq)], **TOL)
    # And decoding continues identically from both caches.
    nxt = torch.tensor([42])
    a = model.run_pass(nxt, torch.tensor([len(seq)]), cache).logits
    b = model.run_pass(nxt, torch.tensor([len(seq)]), ref).logits
    assert torch.allclose(a, b, **TOL)


def test_cache_capacity_is_enforced():
    _, model = tiny_transformer(vocab_size=512)
    cache = model.new_cache(4)
    with pytest.raises(ValueError, match="capacity"):
        model.run_pass(torch.arange(5), torch.arange(5), cache)


def test_int8_linear_is_close_to_full_precision():
    from engine.model.weights import Int8Linear, Linear

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    full = Linear(w)(x)
    for dtype in (torch.float32, torch.bfloat16):
        q = Int8Linear(w.to(dtype))(x.to(dtype)).float()
        rel = (q - full).norm() / full.norm()
        assert rel < 0.03, (dtype, float(rel))


def test_torch_ops_only_computes_the_same_pass():
    """use_torch_ops (the bench's engine-torch-float32: a host where none of our kernels runs)
    leaves only torch's products and attention; the pass is the same computation, and a model
    whose matrices sit on our bf16 kernel refuses it."""
    from conftest import tiny_hf_model

    from engine.kernels import cpu_build
    from engine.model.transformer import ModelConfig, Transformer

    hf, ours = tiny_transformer()
    plain = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.float32)
    plain.use_torch_ops()
    assert not plain._attention_kernel
    prompt = list(range(3, 40))
    got = [m.prefill(prompt, m.new_cache(64)) for m in (ours, plain)]
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)
    if cpu_build.available():
        bf16 = Transformer(ModelConfig.from_hf(hf.config), dict(tiny_hf_model().state_dict()), torch.bfloat16)
        with pytest.raises(ValueError, match="float32 weights"):
            bf16.use_torch_ops()


def test_int8_probe_runs_on_the_weights_device():
    """torch's int8 kernel is probed where the weight lives, once per (device, dtype): a CPU
    answer is not reused for another device, and a dtype torch's kernel refuses is refused."""
    from engine.model.weights import _INT8_KERNEL, Int8Linear, _int8_kernel_works

    assert _int8_kernel_works("cpu", torch.bfloat16)  # this torch's CPU kernel, run on CPU tensors
    assert not _int8_kernel_works("cpu", torch.float64)  # the CPU kernel takes 16/32-bit floats only
    assert not _int8_kernel_works("meta", torch.bfloat16)  # no values on meta: nothing to check against
    assert _INT8_KERNEL[("cpu", torch.bfloat16)] and not _INT8_KERNEL[("meta", torch.bfloat16)]
    # A CPU weight builds (our kernel, torch's, or dequantising); without our kernel its
    # fast path is exactly the CPU probe's answer for its kernel dtype.
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.float64):
        lin = Int8Linear(w.to(dtype))
        if lin._packed is None:
            assert lin._fast == _INT8_KERNEL[("cpu", lin.kernel_dtype)]


def test_int8_drafter_refused_where_the_device_has_no_int8_path():
    """Off the CPU, no int8 kernel on the weight's device means no int8 drafter: a clear
    ValueError when the int8 weights are built, before any copy is quantised. `meta` is a
    real device of this torch on which the kernel cannot be checked (it computes no values)."""
    from engine.drafters.model import int8_weights
    from engine.model.transformer import ModelConfig, Transformer
    from engine.model.weights import Int8Linear, check_int8_device

    hf, ours = tiny_transformer(vocab_size=512)
    meta = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16, device="meta")
    refusal = r"int8 drafting needs .*torch\.bfloat16 .*on meta.*; choose ngram, suffix or eagle"
    with pytest.raises(ValueError, match=refusal):
        int8_weights(meta)
    with pytest.raises(ValueError, match=refusal):
        Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16, int8=True, device="meta")
    with pytest.raises(ValueError, match=refusal):
        Int8Linear(torch.zeros(32, 64, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match=refusal):
        check_int8_device("meta", torch.bfloat16)
    check_int8_device("cpu", torch.float64)  # the CPU always has a path, even where torch's kernel refuses
    drafter = int8_weights(ours)  # and the CPU target still gets its int8 drafter
    assert drafter.int8 and drafter.device.type == "cpu"
