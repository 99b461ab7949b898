"""The acceptance rule: the one place where a draft is accepted or rejected.

Notation everywhere in SpecLens: ``p`` is the target model's distribution, ``q``
the drafter's. Every function here is pure and deterministic given its inputs
(the uniforms ``u`` are passed in), so the decode loop, the tests and the labs
replay a decision exactly. The batched verifier (``engine.kernels.batched_verifier``,
torch reference and Triton kernel) mirrors ``accept_probability`` and the
residual for chains and is tested equal to this walk.

Why the output is exactly p (Leviathan et al. 2023; Chen et al. 2023)
----------------------------------------------------------------------
A draft x ~ q is kept with probability min(1, p(x)/q(x)), so
P(keep x) = q(x) min(1, p(x)/q(x)) = min(q(x), p(x)). On a rejection the extra
token is drawn from the residual r = norm(max(0, p − q)), and
P(reject) = 1 − Σ_x min(p, q) = Σ_x max(0, p − q). Hence
P(emit y) = min(p(y), q(y)) + max(0, p(y) − q(y)) = p(y).

Several children at one tree node (recursive rejection sampling, SpecInfer /
EAGLE): the children were drawn from q *without replacement*, in order. Child j
is tested against p_j and q_j, where q_j is q with the earlier siblings removed
and renormalised (the law of the j-th draw given the first j − 1) and
p_j = norm(max(0, p_{j−1} − q_{j−1})) is the residual after the rejections so
far. Each round is an ordinary speculative step whose output law is p_j, so by
induction the node emits exactly p. A test that used p_j, q_j rather than p, q
is *adjusted* (j > 0 in sampling mode); the event records it as such.

Point-mass drafts (n-gram): child j is its own distribution q_j = onehot(c_j),
so it is kept with probability p_j(c_j) and a rejection removes c_j from p_j.

Greedy (temperature 0): a draft is accepted iff it is the target's argmax; the
extra token is the argmax at the stop. No uniforms are drawn.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "Q_FLOOR",
    "accept_probability",
    "argmax_index",
    "block_verify_chain",
    "race_scores",
    "residual",
    "verify_chain",
    "verify_children",
]

# q(x) is floored at this before dividing: a drafted token always has q(x) > 0, so
# the floor only keeps the division defined (the batched verifier uses the same).
Q_FLOOR = 1e-30


def argmax_index(x: torch.Tensor) -> int:
    """The index of a vector's maximum, the first one on a tie (NaN counts as the maximum): torch's argmax rule,
    the greedy choice everywhere. On a CPU float vector it asks numpy's argmax (the same rule), which is several
    times quicker than torch's over a vocabulary, and a greedy pass makes about two of these choices per drafted
    token (figures: docs/bench/2026-12-07-notes-from-engine.md)."""
    if x.device.type == "cpu" and x.dim() == 1 and x.dtype in (torch.float32, torch.float64):
        return int(np.argmax(x.numpy()))
    return int(x.argmax())


def accept_probability(p_x: float, q_x: float) -> float:
    """min(1, p(x) / q(x)): the probability of keeping a draft x."""
    return min(1.0, p_x / max(q_x, Q_FLOOR))


def race_scores(weights: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """[..., V] weights >= 0 and Exp(1) draws e -> [..., V] float32 race scores: w / e where w > 0, else -1 (never
    wins). Its argmax is a draw from w / sum(w) (the first index on a tie; the proof is in
    engine/kernels/batched_verifier.py): every race draws by it, engine.sampling's off the CPU and the batched
    verifier's extra token."""
    w = weights.float()
    return torch.where(w > 0, w / e.float(), -1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) on the last axis.

    p, q: [..., V] float32. If p ≤ q everywhere (only possible when p == q, in
    which case a rejection has probability zero) the residual is undefined; we
    return p so that callers never divide by zero.
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(Q_FLOOR), p)


def verify_children(
    p: torch.Tensor,
    q: torch.Tensor,
    child_ids: list[int],
    u: list[float],
    greedy: bool,
    point_mass: bool = False,
    keep: Callable[[float, float], float] | None = None,
) -> tuple[int | None, torch.Tensor, list[dict]]:
    """Verify the children of one tree node (a chain is a tree of single children).

    p:          [V] target probabilities at the node
    q:          [V] drafter distribution the children were drawn from, without
                replacement and in the given order (ignored when point_mass)
    child_ids:  the children's token ids, in the order they were drawn
    u:          one uniform in [0, 1) per child (unused when greedy)
    point_mass: the children are deterministic proposals (n-gram), see the module docstring
    keep:       None: the exact rule, min(1, p(c)/q(c)); another keep probability keep(p(c), q(c)), clipped
                to [0, 1], is a Shortcuts lab rule (engine.tools.shortcuts), not exact (unused when greedy)
    Returns (index of the accepted child or None, the distribution the extra token
    is drawn from after all rejections, one record per child tried). A record holds
    the numbers the test compared: ``p_eff``, ``q_eff``, ``accept_prob``, ``u`` (None
    when greedy) and ``adjusted`` (p_eff/q_eff are the residual p′ and the
    renormalised q′ left by earlier rejected siblings).
    """
    records: list[dict] = []
    if greedy:
        best = argmax_index(p)
        for j, c in enumerate(child_ids):
            ok = c == best
            q_c = 1.0 if point_mass else float(q[c])
            records.append({"p_eff": float(p[c]), "q_eff": q_c, "accept_prob": float(ok), "u": None, "adjusted": False})
            if ok:
                return j, p, records
        dist = torch.zeros_like(p)
        dist[best] = 1.0
        return None, dist, records
    p_j = p
    q_j = q
    for j, c in enumerate(child_ids):
        if point_mass:
            q_j = torch.zeros_like(p)
            q_j[c] = 1.0
        p_c, q_c = float(p_j[c]), float(q_j[c])
        if keep is None:
            accept_prob = accept_probability(p_c, q_c)
        else:
            accept_prob = min(1.0, max(0.0, keep(p_c, max(q_c, Q_FLOOR))))
        records.append({"p_eff": p_c, "q_eff": q_c, "accept_prob": accept_prob, "u": float(u[j]), "adjusted": j > 0})
        if u[j] < accept_prob:
            return j, p_j, records
        p_j = residual(p_j, q_j)
        if point_mass:
            continue
        q_next = q_j.clone()
        q_next[c] = 0.0
        total = float(q_next.sum())
        q_j = q_next / total if total > 0 else q_next
    return None, p_j, records


def verify_chain(
    p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, u: torch.Tensor, greedy: bool
) -> tuple[int, torch.Tensor]:
    """A chain of K drafts walked with ``verify_children`` (one child per node).

    p:         [K+1, V] target probabilities at the K draft positions plus the bonus position
    q:         [K, V]   drafter distributions the drafts were sampled from
    draft_ids: [K]      drafted token ids
    u:         [K]      uniforms in [0, 1)
    Returns (num_accepted, dist [V]): dist is the residual at the first rejection,
    p_K (the bonus) when all K were accepted; greedy: a one-hot of the argmax.
    """
    k = int(draft_ids.shape[0])
    for i in range(k):
        chosen, dist, _ = verify_children(p[i], q[i], [int(draft_ids[i])], [float(u[i])], greedy)
        if chosen is None:
            return i, dist
    if greedy:
        dist = torch.zeros_like(p[k])
        dist[argmax_index(p[k])] = 1.0
        return k, dist
    return k, p[k]


def block_verify_chain(
    p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block verification of a sampled chain (Sun et al., "Block Verification Accelerates Speculative
    Decoding", ICLR 2025; vLLM's ``rejection_sample_method: "block"``): the drafted prefix is accepted by a
    joint ratio instead of token by token, still exactly lossless, and never fewer tokens on average.

    p:         [K+1, V] target probabilities at the K draft positions plus the bonus position
    q:         [K, V]   drafter distributions the drafts were sampled from (one-hot rows for point masses)
    draft_ids: [K]      drafted token ids
    u:         [K]      uniforms in [0, 1), one per prefix length
    Returns, on the inputs' device and without a host synchronisation:
      num_accepted []    tau: the longest prefix whose test passed (0 .. K)
      h            [K]   the test of prefix length i + 1: accepted when u_i < h_i
      joint        [K]   p_i, the running joint ratio after draft i
      passed       [K]   bool: u_i < h_i, the test of prefix length i + 1 (recorded: a rounded h cannot retell it)
      dist         [V]   what the extra token is drawn from (unnormalised): the weighted residual at tau,
                         or p_K (the bonus) when tau = K; p at tau where the residual has no mass

    The rule, with p_0 = 1 and positions i = 1 .. K (row i - 1 here):
        p_i   = min(1, p_{i-1} * p(x_i) / q(x_i))                          the joint ratio
        r_i   = max(0, p_i * p(. | x_<=i) - q(. | x_<=i))                  the weighted residual after i
        h_i   = |r_i| / (|r_i| + 1 - p_i)  for i < K  (1 where that is 0 / 0);   h_K = p_K
        tau   = the largest i with u_i < h_i (0 if none): x_1 .. x_tau are kept, every test is run
        extra ~ norm(r_tau) (r_0 = max(0, p - q), the token rule's residual) or p_K when tau = K.
    Why it is exact: the paper's Theorem 1 (its appendix proves that the kept prefix plus the extra token
    has the target's joint law, by induction over the block from its end); with K = 1 the rule is the
    token rule (h_1 = p_1 = min(1, p/q), r_0 = max(0, p - q)). That h_i tests a whole prefix, not one token,
    is why a later prefix can pass where an earlier one failed, and why it accepts at least as much as the
    token rule on average (the paper's Theorem 2). tests/test_block_verification.py checks the joint law of
    the first tokens by chi-square, with negative controls.
    """
    k = int(draft_ids.shape[0])
    if k < 1:
        raise ValueError("block verification needs at least one draft")
    rows = torch.arange(k, device=p.device)
    ratio = p[rows, draft_ids].double() / q[rows, draft_ids].double().clamp_min(Q_FLOOR)  # [K]
    joint_list = []
    running = torch.ones((), dtype=torch.float64, device=p.device)
    for i in range(k):  # K <= 32: a short scan of device scalars, no host read
        running = torch.clamp(running * ratio[i], max=1.0)
        joint_list.append(running)
    joint = torch.stack(joint_list)  # [K] float64
    weighted = torch.clamp(joint[:-1, None] * p[1:k].double() - q[1:k].double(), min=0.0)  # [K-1, V]: r_1 .. r_{K-1}
    mass = weighted.sum(dim=-1)  # [K-1] |r_i|
    denom = mass + 1.0 - joint[:-1]
    h = torch.cat([torch.where(denom > 0, mass / denom.clamp_min(Q_FLOOR), torch.ones_like(mass)), joint[-1:]])  # [K]
    passed = u.double() < h  # [K]
    num_accepted = torch.where(passed, torch.arange(1, k + 1, device=p.device), 0).amax()  # []
    # The extra token's distribution, row tau of [r_0 = max(0, p - q), r_1 .. r_{K-1}, p_K (the bonus)].
    first = torch.clamp(p[:1].double() - q[:1].double(), min=0.0)  # [1, V]
    chosen = torch.cat([first, weighted, p[k : k + 1].double()], dim=0)[num_accepted]  # [V]
    dist = torch.where(chosen.sum() > 0, chosen, p[num_accepted].double()).float()
    return num_accepted, h.float(), joint.float(), dist, passed
