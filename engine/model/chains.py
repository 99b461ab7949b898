"""A model drafter's chain of one-token passes in one C call: each pass fed the token the pass before chose
(its argmax, or a draw from q = softmax(logits / T)), without returning to Python between passes.

Why: a drafter's passes are one token each, and on our CPU kernels the Python around a pass costs about as
much as its arithmetic. A chain is a shortcut over ``Transformer.run_pass``, never another computation: bit
for bit the logits and cache of the one-token passes it replaces (engine/kernels/cpu_calls.py's
greedy_chain and sampled_chain run the same C functions a pass does). These are functions of the model, not
its methods: the forward is the model's; the chains are a drafter's way of running it. The drafters
(engine/drafters/model.py, engine/drafters/multilevel.py) ask ``greedy_chain_ready`` first and run the
Python passes where it says no.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_calls
from engine.model.transformer import KVCache, Transformer
from engine.model.weights import RescoredQ4Linear, kernel_matrix

__all__ = ["chain_head", "greedy_chain", "greedy_chain_ready", "sampled_chain"]


def chain_head(model: Transformer):
    """The model's lm_head as cpu_calls.greedy_chain takes it (a packed matrix or a RescoredQ4Head, unpadded),
    or None."""
    head = model.lm_head.head if isinstance(model.lm_head, RescoredQ4Linear) else kernel_matrix(model.lm_head)
    if head is None or head.out_padded != head.out or head.in_padded != head.n_in:
        return None
    return head


def greedy_chain_ready(model: Transformer, cache: KVCache) -> bool:
    """Whether ``greedy_chain`` runs here: every matrix and the attention on our CPU kernels, float32
    activations, a float32 or bf16 cache, an unpadded head whose rows are the vocabulary."""
    head = chain_head(model)
    return (
        model._attention_kernel
        and model.act_dtype == torch.float32
        and cache.k.dtype in cpu_calls.KV_DTYPES
        and cache.v.dtype == cache.k.dtype
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
        and model.embed.dtype in (torch.bfloat16, torch.float32)
        and model.embed.is_contiguous()
        and model.norm.dtype == torch.float32
        and model._layer_stack() is not None
        and head is not None
        and (head.out, head.n_in) == tuple(model.embed.shape)
    )


@torch.inference_mode()
def greedy_chain(model: Transformer, token: int, cache: KVCache, n: int) -> tuple[torch.Tensor, list[int]]:
    """n one-token passes of `model` in one C call (cpu_calls.greedy_chain): `token` at slot and position
    cache.length, then each pass's argmax (the first maximum) at the next. Returns (logits [n, V] float32,
    the n tokens chosen) and advances cache.length by n: bit for bit what n ``run_pass`` calls of one
    token at consecutive slots and positions give, each followed by ``argmax_index`` of its logits.
    Where ``greedy_chain_ready`` says so only."""
    return _chain(model, cpu_calls.greedy_chain, token, cache, n)


@torch.inference_mode()
def sampled_chain(
    model: Transformer, token: int, cache: KVCache, n: int, temperature: float, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``greedy_chain`` with each pass's token drawn from q = softmax(logits / temperature) by the inverse
    CDF at uniforms[i] ([n] float64, from the run's generator; cpu_calls.sampled_chain). Returns (logits
    [n, V], bit for bit the one-token passes'; q [n, V] float32, what each token was drawn from; the n
    tokens) and advances cache.length by n. Where ``greedy_chain_ready`` says so only."""
    return _chain(model, cpu_calls.sampled_chain, token, cache, n, temperature, uniforms)


def _chain(model: Transformer, kernel, token: int, cache: KVCache, n: int, *extra):
    """`kernel` (cpu_calls.greedy_chain or sampled_chain, with its `extra` arguments) on n passes of `model`
    from slot cache.length; advances cache.length by n."""
    start = cache.length
    if start + n > cache.capacity:
        raise ValueError(f"sequence of {start + n} tokens exceeds the KV cache capacity {cache.capacity}")
    cos, sin = model._rope(torch.arange(start, start + n), start + n - 1)  # [n, D] each
    chain = cpu_calls.ChainArgs(
        token=token,
        n=n,
        embed=model.embed,
        stack=model._layer_stack(),
        cos=cos.contiguous(),
        sin=sin.contiguous(),
        k=cache.k,
        v=cache.v,
        start=start,
        heads=model.cfg.num_heads,
        head=chain_head(model),
        norm_weight=model.norm,
        eps=model.cfg.rms_norm_eps,
    )
    out = kernel(chain, *extra)
    cache.length = start + n
    return out
