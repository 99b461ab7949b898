"""Batched chain verification: a pure-torch reference and a Triton kernel with one contract.

``engine.acceptance`` walks the drafts one at a time with small torch ops, which is right for the CPU decode
loop, for trees and for the labs. On a GPU a batch of B chains is better verified by one kernel launch that
never materialises the residual on the host. This module mirrors the acceptance rule for chains: a Triton
kernel (``verify_batch_triton``), a pure-torch reference (``verify_batch_reference``) and a dispatcher
(``verify_batch``). Both return, beside the decision, the accept probability of every test, so the event
records the numbers the decision was made from (nothing downstream recomputes them).

Vocabulary (vLLM's rejection sampler): for each of the B rows the drafter *drafted* K tokens; the verifier
*accepts* a prefix of them; at the first *rejected* draft an extra token is *resampled* from the residual;
when all K drafts are accepted the extra token is the *bonus* token, drawn from the target's distribution at
position K. Every row emits ``num_accepted + 1`` tokens: the accepted drafts, then ``next_token``.

The maths (p = target, q = drafter), row b, positions i = 0 .. K-1, x_i = draft_ids[b, i]:

1. Accept test: ``accept_prob_i = min(1, p_i(x_i) / max(q_i(x_i), 1e-30))`` (float32, IEEE division), draft i
   accepted iff ``uniforms[b, i] < accept_prob_i``; ``num_accepted`` is the first rejected index, or K. This is
   ``acceptance.accept_probability`` (its Q_FLOOR clamp included), so both agree on the same uniforms. With
   ``draft_probs=None`` the drafts are point masses (n-gram): q_i = onehot(x_i), accept_prob_i = p_i(x_i).
2. The extra token's distribution ``dist``, unnormalised: at a rejection i < K the residual max(0, p_i - q_i),
   or p_i where that is zero everywhere (p == q, where a rejection has probability zero: it only keeps the draw
   defined); after K accepts the bonus p_K. Exact: P(keep x) = min(p(x), q(x)) and P(reject, then y) =
   max(0, p(y) - q(y)), which sum to p(y).
3. The draw, an exponential race over e = exponentials[b] (Exp(1), float32, > 0): score[j] = dist[j] / e[j]
   where dist[j] > 0, else -1 (IEEE division); ``next_token = argmax_j score[j]``, the first index on a tie.
   E_j / w_j ~ Exp(w_j), and the smallest of independent exponentials is the j-th with probability
   w_j / sum(w): a draw from dist / sum(dist) with no normalisation, no summation order and no host sync.

Every step is elementwise and correctly rounded in both implementations (the kernel uses ``div_rn``) and the
reductions are a max and a min of exact values, so kernel and reference agree bit for bit on any device and
any V block. The comments above ``_verify_kernel`` say how it streams a row and why any K runs one compiled
kernel. Trees (topk > 1) are not verified here: the decode loop walks them with ``acceptance.verify_children``,
whose sibling-by-sibling residual updates are sequential, over trees of tens of nodes.

Dispatch: ``verify_batch`` runs the compiled kernel on CUDA tensors when triton imports, the kernel under
Triton's CPU interpreter when ``SPECLENS_TRITON_INTERPRET=1`` or ``TRITON_INTERPRET=1`` is set (tests without a
GPU; ``triton_language_interpreted`` says when that mode can take effect), else the torch reference: all three
give the same results. The module imports without triton (``HAS_TRITON`` is then False: the reference).
"""

from __future__ import annotations

import os
import sys

import torch

from engine import config
from engine.acceptance import Q_FLOOR, race_scores

__all__ = [
    "HAS_TRITON",
    "MAX_K",
    "compile_key",
    "extra_distribution",
    "exponential_race",
    "triton_interpret_requested",
    "triton_language_interpreted",
    "verify_batch",
    "verify_batch_reference",
    "verify_batch_triton",
    "warm_up",
]

if config.triton_interpret() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton (triton_language_interpreted)

try:  # triton is optional: CPU-only installs (macOS, aarch64) may lack it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAS_TRITON = False


# --------------------------------------------------------------- validation
def _check(target_probs, draft_probs, draft_ids, uniforms, exponentials) -> tuple[int, int, int]:
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got shape {tuple(target_probs.shape)}")
    b, k1, v = target_probs.shape
    k = k1 - 1
    if k < 0 or v < 1:
        raise ValueError(f"target_probs must be [B, K+1, V] with K >= 0 and V >= 1, got {tuple(target_probs.shape)}")
    if tuple(draft_ids.shape) != (b, k):
        raise ValueError(f"draft_ids must be [B, K] = {(b, k)}, got {tuple(draft_ids.shape)}")
    if tuple(uniforms.shape) != (b, k):
        raise ValueError(f"uniforms must be [B, K] = {(b, k)}, got {tuple(uniforms.shape)}")
    if tuple(exponentials.shape) != (b, v):
        raise ValueError(f"exponentials must be [B, V] = {(b, v)}, got {tuple(exponentials.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (b, k, v):
        raise ValueError(f"draft_probs must be [B, K, V] = {(b, k, v)} or None, got {tuple(draft_probs.shape)}")
    return b, k, v


# ---------------------------------------------------------------- reference
def exponential_race(dist: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """The module's draw (step 3), row by row, in float32.

    dist:         [B, V] non-negative weights (need not sum to 1)
    exponentials: [B, V] Exp(1) draws (``sampling.exponentials``)
    Returns [B] int64: argmax_j of dist[j] / e[j] over the entries with mass (the first on a tie;
    0 if the row is all zero).
    """
    return race_scores(dist, exponentials).argmax(dim=-1)  # [B]


def _accept_counts(target_probs, draft_probs, draft_ids, uniforms) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] int64 num_accepted, [B, K] float32 accept_prob): step 1 of the module docstring."""
    b, k1, _ = target_probs.shape
    k = k1 - 1
    if k == 0:
        zeros = torch.zeros(b, 0, dtype=torch.float32, device=target_probs.device)
        return torch.zeros(b, dtype=torch.int64, device=target_probs.device), zeros
    ids = draft_ids.long().unsqueeze(-1)  # [B, K, 1]
    p_draft = target_probs[:, :k].float().gather(-1, ids).squeeze(-1)  # [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # point masses: q_i(x_i) = 1
    else:
        q_draft = draft_probs.float().gather(-1, ids).squeeze(-1)  # [B, K]
    accept_prob = torch.clamp(p_draft / q_draft.clamp_min(Q_FLOOR), max=1.0)  # [B, K]
    rejected = uniforms.float() >= accept_prob  # [B, K]
    first = rejected.int().argmax(dim=-1)  # [B]
    return torch.where(rejected.any(dim=-1), first, torch.full_like(first, k)).long(), accept_prob


def extra_distribution(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    num_accepted: torch.Tensor,
) -> torch.Tensor:
    """[B, V] float32 unnormalised distribution of the extra token (step 2).

    target_probs: [B, K+1, V]; draft_probs: [B, K, V] or None (point masses);
    draft_ids: [B, K]; num_accepted: [B]. Rows with num_accepted == K get the
    bonus distribution p_K; the others the residual max(0, p_i - q_i) at the
    rejected position i (or p_i when that residual is zero everywhere).
    """
    b, k1, v = target_probs.shape
    k = k1 - 1
    rows = torch.arange(b, device=target_probs.device)
    pos = num_accepted.long()  # [B]
    p_row = target_probs[rows, pos].float()  # [B, V]
    bonus = pos == k  # [B]
    if k == 0:
        return p_row
    qpos = pos.clamp(max=k - 1)  # [B]
    if draft_probs is None:
        q_row = torch.zeros_like(p_row)
        q_row[rows, draft_ids[rows, qpos].long()] = 1.0  # onehot(x_i)
    else:
        q_row = draft_probs[rows, qpos].float()  # [B, V]
    q_row = torch.where(bonus[:, None], torch.zeros_like(q_row), q_row)
    resid = torch.clamp(p_row - q_row, min=0.0)  # [B, V]; == p_row on bonus rows
    has_resid = (resid > 0).any(dim=-1, keepdim=True)  # [B, 1]
    return torch.where(has_resid, resid, p_row)


def verify_batch_reference(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact rejection sampling over a batch of draft chains, in pure torch.

    target_probs:    [B, K+1, V] float32  target p at the K drafted positions plus the bonus position
    draft_probs:     [B, K, V]   float32  drafter q the drafts were sampled from, or None for
                                          point-mass drafts (n-gram): q_i = onehot(draft_ids[:, i])
    draft_ids:       [B, K]      int64    drafted token ids
    uniforms:        [B, K]      float32  in [0, 1), one accept test per draft
    exponentials:    [B, V]      float32  Exp(1), the race that draws the extra token
    Returns (num_accepted [B] int64, next_token [B] int64, accept_prob [B, K]
    float32): the number of accepted drafts, the resampled (or bonus) token that
    follows them, and min(1, p_i(x_i)/q_i(x_i)) of every draft (the number each
    test compared its uniform with; positions past the first rejection were
    computed but not tested).
    """
    _check(target_probs, draft_probs, draft_ids, uniforms, exponentials)
    num_accepted, accept_prob = _accept_counts(target_probs, draft_probs, draft_ids, uniforms)  # [B], [B, K]
    dist = extra_distribution(target_probs, draft_probs, draft_ids, num_accepted)  # [B, V]
    return num_accepted, exponential_race(dist, exponentials), accept_prob


# ------------------------------------------------------------------- triton
# One compiled kernel per vocabulary and draft kind, whatever K. Adaptive drafting changes K from pass to pass,
# and Triton specialises a kernel on its constexprs and on every runtime int (value 1, divisibility by 16), so a
# BLOCK_K = next_pow2(K) with K and the K-derived strides as arguments would compile a variant per K on first use,
# inside a pass. So the accept tests run at the fixed width BLOCK_K = MAX_K masked to the first K lanes, K is
# listed in do_not_specialize, and the strides are derived in the kernel from K and the constexpr V (the inputs
# are made contiguous). What stays in the compile key is V, BLOCK_V, HAS_Q and the pointers' 16-byte alignment:
# a model compiles two variants (q / point masses). ``compile_key`` computes the key with triton's own binder (no
# GPU needed) and ``warm_up(device, vocab)`` compiles both at load, checked against the reference. K > MAX_K
# goes to the torch reference in ``verify_batch`` (``verify_batch_triton`` refuses it).
MAX_K = 32  # the deepest chain the kernel takes (TreeShape's K limit, engine/drafters/base.py)
BLOCK_K = MAX_K  # the accept tests' vector width: fixed, so K never changes the compiled kernel
NO_SPECIALIZE = ("K",)  # runtime ints triton must not specialise on (value 1, divisibility by 16)


# The kernel: one program per batch row. It runs the K accept tests as one vector (independent gathers of
# p_i(x_i), q_i(x_i) and u_i; the first rejection is a min-reduction, the same as looping and stopping), then
# streams the one relevant row of p (and q) and the row's exponentials over V in blocks of BLOCK_V, once,
# running two races side by side (over the residual and over p) with a carried best score and index, and keeps
# the residual's winner unless the residual had no mass. Nothing of size V is written anywhere: the memory
# traffic is three row reads. Point-mass drafts (draft_probs=None) are a constexpr flag, q built in registers
# as offs == x_i. Greedy chains are verified by an argmax beside it (engine.verification.verify_chain_greedy).
def _verify_kernel(
    p_ptr,  # [B, K+1, V] float32 target probs (contiguous)
    q_ptr,  # [B, K, V]   float32 draft probs (contiguous; unused when HAS_Q is False)
    draft_ptr,  # [B, K]  int64 drafted ids (contiguous)
    u_ptr,  # [B, K]      float32 accept uniforms (contiguous)
    e_ptr,  # [B, V]      float32 Exp(1) draws of the race (contiguous)
    num_acc_ptr,  # [B]   int64 out: number of accepted drafts
    token_ptr,  # [B]     int64 out: resampled / bonus token
    acc_prob_ptr,  # [B, K] float32 out: min(1, p_i(x_i) / q_i(x_i)) of every draft
    # K is a runtime value and is NOT specialised (do_not_specialize): adaptive drafting changes
    # it from pass to pass and each new value must not compile a new kernel. The tensors are
    # contiguous, so every stride is derived from K and V here instead of being passed (a
    # stride such as (K+1)*V would otherwise be specialised on its divisibility by 16).
    K,
    # V is a compile-time constant: a vocabulary is fixed per model, so this costs one compile
    # per model, and Triton 3.6's interpreter (TRITON_INTERPRET=1) cannot take a runtime
    # scalar as the loop bound below (int() of a 1-element array; seen on the GPU check).
    V: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K: the accept tests are masked to the first K lanes
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    k64 = K.to(tl.int64)
    p_base = p_ptr + row * (k64 + 1) * V  # row b of [B, K+1, V]
    q_row = q_ptr + row * k64 * V  # row b of [B, K, V]
    d_base = draft_ptr + row * k64
    u_base = u_ptr + row * k64

    # ---- accept tests at the K drafted positions, as one vector (independent loads,
    # no dependent chain): num_accepted = the first rejected position, or K.
    koffs = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    kin = koffs < K
    x = tl.load(d_base + koffs, mask=kin, other=0)  # [BLOCK_K] drafted ids x_i (int64)
    p_x = tl.load(p_base + koffs * V + x, mask=kin, other=0.0)  # [BLOCK_K] p_i(x_i)
    if HAS_Q:
        q_x = tl.load(q_row + koffs * V + x, mask=kin, other=1.0)  # [BLOCK_K] q_i(x_i)
    else:
        q_x = tl.full((BLOCK_K,), 1.0, tl.float32)  # point masses
    accept_prob = tl.minimum(tl.math.div_rn(p_x, tl.maximum(q_x, 1e-30)), 1.0)  # [BLOCK_K]; 1e-30 == Q_FLOOR
    tl.store(acc_prob_ptr + row * k64 + koffs, accept_prob, mask=kin)
    u = tl.load(u_base + koffs, mask=kin, other=0.0)  # [BLOCK_K]
    rejected = (u >= accept_prob) & kin  # [BLOCK_K]
    num_acc = tl.min(tl.where(rejected, koffs, K), axis=0)  # int32 scalar

    # ---- the row the extra token comes from: residual at the rejection, or the bonus p_K.
    not_bonus = num_acc < K
    qpos = tl.minimum(num_acc, K - 1).to(tl.int64)  # rejected position (unused for the bonus)
    pk_base = p_base + num_acc.to(tl.int64) * V  # p_i at the rejection, p_K for the bonus
    q_base = q_row + qpos * V
    v_q = tl.where(not_bonus, V, 0)  # q is read only at a rejection (the bonus row uses q = 0)
    x_rej = tl.load(d_base + qpos, mask=not_bonus, other=-1)  # the rejected draft (point-mass q)

    # one pass: two exponential races side by side, over the residual max(0, p - q) and over p,
    # each with a carried best score (strict >: the first block wins a tie) and the first index
    # within a block that reaches the block's best (the first index overall on a tie).
    e_base = e_ptr + row * V
    best_r = tl.full((), -2.0, tl.float32)
    best_p = tl.full((), -2.0, tl.float32)
    idx_r = tl.full((), 0, tl.int32)
    idx_p = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        inb = offs < V
        p = tl.load(pk_base + offs, mask=inb, other=0.0)  # [BLOCK_V]
        e = tl.load(e_base + offs, mask=inb, other=1.0)  # [BLOCK_V]
        if HAS_Q:
            q = tl.load(q_base + offs, mask=offs < v_q, other=0.0)  # [BLOCK_V]
        else:
            q = tl.where(offs == x_rej, 1.0, 0.0)  # [BLOCK_V] onehot(x_i), zero for the bonus
        r = tl.maximum(p - q, 0.0)  # [BLOCK_V] the residual, 0 out of bounds
        score_r = tl.where(r > 0.0, tl.math.div_rn(r, e), -1.0)  # [BLOCK_V]
        score_p = tl.where(p > 0.0, tl.math.div_rn(p, e), -1.0)  # [BLOCK_V]
        top_r = tl.max(score_r, axis=0)
        top_p = tl.max(score_p, axis=0)
        at_r = tl.min(tl.where(score_r == top_r, offs, V), axis=0)
        at_p = tl.min(tl.where(score_p == top_p, offs, V), axis=0)
        idx_r = tl.where(top_r > best_r, at_r, idx_r)
        idx_p = tl.where(top_p > best_p, at_p, idx_p)
        best_r = tl.maximum(best_r, top_r)
        best_p = tl.maximum(best_p, top_p)

    # the residual has mass somewhere iff its best score is positive (else p itself, as the reference)
    token = tl.where(best_r > 0.0, idx_r, idx_p)
    tl.store(num_acc_ptr + row, num_acc.to(tl.int64))
    tl.store(token_ptr + row, token.to(tl.int64))


_KERNELS: dict[bool, object] = {}


def triton_language_interpreted() -> bool:
    """True when triton was imported in interpreter mode (TRITON_INTERPRET=1 set
    before its first import); then only the interpreted kernel can run here.

    The mode is fixed per process (triton 3.9, read from its source): ``triton.jit`` reads TRITON_INTERPRET when
    it *decorates* a function, and triton.language's own helpers (``tl.zeros``, ``tl.sum``, ``tl.max``,
    ``tl.cumsum``, ...) are ``@jit`` functions decorated when ``triton`` is first imported, so the interpreter
    works only in a process where TRITON_INTERPRET=1 was set before the first ``import triton`` (and the
    compiled kernel only where it was not). ``transformers`` imports triton, so set it in the process's
    environment; importing this module with SPECLENS_TRITON_INTERPRET=1 sets TRITON_INTERPRET=1 when triton
    has not been imported yet. The kernel object is built for the mode in force (``InterpretedFunction`` or
    ``JITFunction``: ``_kernel``), and asking for the other one raises a clear error."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def triton_interpret_requested() -> bool:
    """True when SPECLENS_TRITON_INTERPRET=1 or TRITON_INTERPRET=1 is set."""
    return config.triton_interpret()


def _kernel(interpret: bool):
    """The kernel, interpreted (CPU, numpy) or compiled (GPU), built once each."""
    if interpret != triton_language_interpreted():
        if interpret:
            raise RuntimeError(
                "Triton's interpreter needs TRITON_INTERPRET=1 (or SPECLENS_TRITON_INTERPRET=1) in the "
                "environment before triton is first imported in this process; it was imported in compiled mode"
            )
        raise RuntimeError(
            "triton was imported with TRITON_INTERPRET=1, so this process cannot compile the kernel; "
            "unset it (and SPECLENS_TRITON_INTERPRET) to use the GPU kernel"
        )
    if interpret not in _KERNELS:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            _KERNELS[interpret] = InterpretedFunction(_verify_kernel, do_not_specialize=NO_SPECIALIZE)
        else:
            from triton.runtime.jit import JITFunction

            _KERNELS[interpret] = JITFunction(_verify_kernel, do_not_specialize=NO_SPECIALIZE)
    return _KERNELS[interpret]


def _default_block_v(v: int) -> int:
    return min(triton.next_power_of_2(v), 1024)


def _launch(target_probs, draft_probs, draft_ids, uniforms, exponentials, block_v):
    """(args, kwargs, outputs) of one kernel launch; the tensors it passes are contiguous
    float32 / int64 on the device of target_probs. The one place the launch is built, so
    that ``compile_key`` sees exactly what ``verify_batch_triton`` launches."""
    b, k, v = _check(target_probs, draft_probs, draft_ids, uniforms, exponentials)
    if k > MAX_K:
        raise ValueError(f"the Triton verifier takes chains of at most K = {MAX_K} drafts, got K = {k}")
    if block_v is None:
        block_v = _default_block_v(v)
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    device = target_probs.device
    p = target_probs.float().contiguous()
    has_q = draft_probs is not None and k > 0  # with K == 0 only the bonus is drawn: q is unused
    q = draft_probs.to(device=device, dtype=torch.float32).contiguous() if has_q else p  # p: any valid pointer
    ids = draft_ids.to(device=device, dtype=torch.int64).contiguous()
    u = uniforms.to(device=device, dtype=torch.float32).contiguous()
    e = exponentials.to(device=device, dtype=torch.float32).contiguous()
    num_accepted = torch.empty(b, dtype=torch.int64, device=device)
    next_token = torch.empty(b, dtype=torch.int64, device=device)
    accept_prob = torch.empty(b, k, dtype=torch.float32, device=device)
    args = (p, q, ids, u, e, num_accepted, next_token, accept_prob, k)
    kwargs = {"V": v, "HAS_Q": has_q, "BLOCK_K": BLOCK_K, "BLOCK_V": block_v}
    return args, kwargs, (num_accepted, next_token, accept_prob)


def compile_key(*inputs: torch.Tensor | None, block_v: int | None = None) -> tuple:
    """The specialisation under which triton would cache the compiled kernel for the call
    ``verify_batch_triton(*inputs, block_v=block_v)``: inputs are its five tensors in its order
    (target_probs, draft_probs, draft_ids, uniforms, exponentials), checked as it checks them.

    Computed by triton's own argument binder (``create_function_from_signature``, the
    function ``JITFunction.run`` keys its kernel cache on) with the base backend, whose
    integer and pointer specialisation (value 1, divisibility by 16) is the one the
    NVIDIA backend uses. It needs no GPU and launches nothing, so on a CPU it shows how
    many compiled variants a set of calls would cost: one per distinct key. Tensors on
    any device.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = _KERNELS.get(False) or JITFunction(_verify_kernel, do_not_specialize=NO_SPECIALIZE)
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    args, kwargs, _ = _launch(*inputs, block_v)
    _, specialization, options = binder(*args, **kwargs)
    return tuple((name, *spec) for name, spec in zip(jit.arg_names, specialization)) + tuple(sorted(options.items()))


def verify_batch_triton(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    *,
    interpret: bool | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``verify_batch_reference``, computed by the Triton kernel.

    target_probs:    [B, K+1, V] float32
    draft_probs:     [B, K, V]   float32 or None (point-mass drafts)
    draft_ids:       [B, K]      int64
    uniforms:        [B, K]      float32 in [0, 1)
    exponentials:    [B, V]      float32 Exp(1) draws
    K is at most MAX_K (32) and any K in 0 .. MAX_K runs the same compiled kernel
    (per V, block_v and draft kind), see ``compile_key``.
    interpret: None (default) runs in the mode triton was imported in (see
               ``triton_language_interpreted``); True / False insist on the interpreter / the
               compiled kernel and raise if this process cannot provide it.
               The compiled kernel needs CUDA tensors; the interpreter takes
               tensors on any device (it copies them to the host).
    block_v:   the V block size, a power of two (default min(next_pow2(V), 1024));
               results do not depend on it (bit for bit).
    Returns (num_accepted [B] int64, next_token [B] int64, accept_prob [B, K]
    float32) on the input device.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use verify_batch_reference (or verify_batch)")
    device = target_probs.device
    if interpret is None:
        interpret = triton_language_interpreted()
    args, kwargs, outputs = _launch(target_probs, draft_probs, draft_ids, uniforms, exponentials, block_v)
    if not interpret and device.type != "cuda":
        raise ValueError(f"the compiled Triton kernel needs CUDA tensors, got device {device}")
    kernel = _kernel(bool(interpret))
    b = target_probs.shape[0]
    if b > 0:
        kernel[(b,)](*args, **kwargs)
    return outputs


def warm_up(device: torch.device | str, vocab: int, *, block_v: int | None = None) -> int:
    """Compile (or, under the interpreter, run) the kernel for a vocabulary before decoding.

    Launches it once per draft kind (model drafts with q, point-mass drafts without)
    on a small batch, and checks it bit for bit against the torch reference: a kernel
    that miscompiles or fails to launch on this device is found here, at load, not in
    the first verification pass. As the compiled kernel does not depend on K, no later
    pass compiles again. Call it once per model on CUDA (the engine's load path); it is
    a no-op returning 0 where the dispatcher would use the reference (no triton, or a
    non-CUDA device without the interpreter). Returns the number of launches made.
    """
    device = torch.device(device)
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    if not HAS_TRITON:
        return 0
    interpreted = triton_language_interpreted()
    if not interpreted and device.type != "cuda":
        return 0
    k, v = 3, vocab
    masses = {1: [1.0], 2: [0.5, 0.5], 3: [0.5, 0.25, 0.25], 4: [0.25] * 4}[min(v, 4)]
    p = torch.zeros(2, k + 1, v)
    p[:, :, : len(masses)] = torch.tensor(masses)
    q = torch.zeros(2, k, v)
    q[:, :, 0] = 1.0  # every draft is token 0 with q = 1
    ids = torch.zeros(2, k, dtype=torch.int64)
    u = torch.tensor([[0.9, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 0 rejects at once, row 1 accepts all
    e = torch.empty(2, v).exponential_(generator=torch.Generator().manual_seed(0))  # [2, V]
    launches = 0
    for draft_probs in (q, None):
        case = [None if x is None else x.to(device) for x in (p, draft_probs, ids, u, e)]
        got = verify_batch_triton(*case, interpret=interpreted, block_v=block_v)
        ref = verify_batch_reference(p, draft_probs, ids, u, e)
        launches += 1
        if not all(torch.equal(g.cpu(), r) for g, r in zip(got, ref)):
            kind = "q" if draft_probs is not None else "point-mass"
            raise RuntimeError(
                f"the Triton verifier disagrees with the torch reference on {device} (V={v}, {kind} drafts): "
                f"got {[g.cpu().tolist() for g in got]}, expected {[r.tolist() for r in ref]}"
            )
    return launches


_warned = False


Tensor = torch.Tensor


def verify_batch(
    target_probs: Tensor, draft_probs: Tensor | None, draft_ids: Tensor, uniforms: Tensor, exponentials: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Dispatch: the Triton kernel on CUDA tensors (or under the interpreter
    env vars) when triton imports and K <= MAX_K, else the torch reference. Shapes as in
    ``verify_batch_reference``; returns (num_accepted [B], next_token [B], accept_prob [B, K])."""
    global _warned
    args = (target_probs, draft_probs, draft_ids, uniforms, exponentials)
    fits = target_probs.dim() == 3 and target_probs.shape[1] - 1 <= MAX_K
    if HAS_TRITON and fits:
        interpreted = triton_language_interpreted()
        if triton_interpret_requested():
            if interpreted:
                return verify_batch_triton(*args, interpret=True)
            if not _warned:  # asked for too late: triton was imported in compiled mode
                import warnings

                warnings.warn(
                    "SPECLENS_TRITON_INTERPRET/TRITON_INTERPRET is set but triton was imported before it took "
                    "effect; verifying with the torch reference",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _warned = True
        elif target_probs.is_cuda and not interpreted:
            return verify_batch_triton(*args, interpret=False)
    return verify_batch_reference(*args)
