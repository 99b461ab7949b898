"""Verifying one target pass: from the target's logits over a draft tree to a Verdict.

The decode loop feeds the pending token plus the draft tree to the target in one
pass; this module turns the resulting logits into decisions, with the acceptance
rule of ``engine.acceptance`` and nothing else:

* ``walk_tree``: from the root, verify the children of the current node with
  ``acceptance.verify_children``; on an acceptance descend into that child, on a
  rejection of every child draw the extra token (*resampled*) from the
  distribution the rule left, and when the walk runs off the tree draw a *bonus*
  token from p. Greedy, sampled, chains, trees and point-mass drafts alike. It
  runs where the logits live (on CUDA a scalar is read back per test; trees are
  small, and their siblings are verified one after another, see
  engine/kernels/batched_verifier.py).
* ``verify_chain_batched``: a sampled chain in one call of
  ``batched_verifier.verify_batch`` (the Triton kernel where the logits live on
  CUDA, its torch reference elsewhere), which mirrors the same rule and returns
  the accept probabilities it tested, so the Verdict is built from its numbers.
* ``verify_chain_greedy``: a greedy chain as one argmax per row and a running
  product of matches, the walk's greedy decisions without a test per node.
* ``verify_chain_block``: a sampled chain by block verification
  (``acceptance.block_verify_chain``): the drafted prefix accepted by a joint
  ratio; every prefix length is tested, the longest that passes is kept.

``choose_verifier`` picks one from the run's settings and the draft's shape, and
``verify`` runs it (``logits_to_host``: where the pass leaves the logits for it).

The chain verifiers stay on the logits' device: uniforms and the race's exponentials are drawn there
with the run's generator (made on that device), q is stacked there, and what the Verdict and the events
record (the accepted count, the extra token, every tested number, and with ``tops`` the top ``TOP_N``
entries of p, q and the residual) comes back in one host copy per pass, never a [K+1, V] row.

A Verdict holds every decision and the numbers it was made from; ``engine.events`` records it and
nothing downstream decides again.

Glossary: p the target's distribution, q the drafter's; *drafted* the K tokens
proposed, *accepted* the verified prefix, *resampled* the extra token drawn from
the residual norm(max(0, p - q)) after a rejection, *bonus* the extra token drawn
from p when every draft was accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.acceptance import argmax_index, block_verify_chain, verify_children
from engine.drafters.base import DraftTree
from engine.kernels import cpu_build, cpu_calls
from engine.kernels.batched_verifier import extra_distribution, verify_batch
from engine.sampling import SamplingParams, draw, exponentials, probs_from_logits, sample
from engine.trace import TOP_N

__all__ = [
    "VERIFIERS",
    "Verdict",
    "choose_verifier",
    "logits_to_host",
    "resolve_tops",
    "top_entries",
    "top_entries_of",
    "verify",
    "verify_chain_batched",
    "verify_chain_block",
    "verify_chain_greedy",
    "walk_tree",
]

# Uniforms are drawn in float64 and used in float32 by the batched verifier; this
# keeps them strictly below 1 after the cast (a float32 1.0 would reject everything).
_BELOW_ONE_F32 = 1.0 - 2**-24

Top = list[tuple[int, float]]  # [(token_id, probability)], largest first, positive entries only

# What ``choose_verifier`` picks: the walk, or one of the chain verifiers (greedy, batched sampled, block).
VERIFIERS = ("walk", "chain_greedy", "chain_batched", "chain_block")


@dataclass
class Verdict:
    """What one target pass decided about a draft tree of n nodes.

    decisions: [n] "accepted" / "rejected" / "not_reached" per node
    records:   [n] the numbers each tried node's test compared (accept_prob, u,
               p_eff, q_eff, adjusted), None for nodes never tried
    path:      accepted node ids, root to leaf
    extra:     the one token the target adds itself: {"token_id", "kind"
               ("resampled" after a rejection, "bonus" past the last draft), "from_node", "p"
               (its probability under p at its position)}
    p_token:   [n] p of each node's token at its parent, for nodes whose parent was visited (the root
               and the accepted path), else None
    tops:      with ``tops`` asked, {"p": {node: Top}, "q": {node: Top or None}, "residual": Top or None}:
               the top TOP_N entries of p and q at each visited node (-1 = the root) and of the
               distribution a resampled token was drawn from (None after a bonus or when greedy)
    greedy:    decided by argmax (no uniforms, no residual)
    rule:      the acceptance rule that decided: "token" (draft by draft) or "block" (a chain's prefix by its
               joint ratio: a record's accept_prob is then the test h of the prefix ending at that node, its
               joint the running joint ratio and passed whether u < h held; an accepted node's own test may have
               failed)
    """

    decisions: list[str]
    records: list[dict | None]
    path: list[int]
    extra: dict
    p_token: list[float | None]
    tops: dict | None = field(default=None)
    greedy: bool = False
    rule: str = "token"

    def emitted(self, tree: DraftTree) -> list[dict]:
        """The tokens this pass adds to the output: the accepted path, then the extra token."""
        accepted = [{"token_id": tree.tokens[i], "kind": "accepted", "node": i} for i in self.path]
        return accepted + [{**self.extra, "node": None}]


def top_entries(probs: torch.Tensor) -> Top:
    """[V] probabilities -> the TOP_N largest positive entries as (token_id, probability)."""
    return top_entries_of([probs])[0]


def top_entries_of(rows: list[torch.Tensor]) -> list[Top]:
    """``top_entries`` of each [V] row, the lower token id first among equal probabilities. Float32 CPU vectors
    of one length go to the CPU kernels' top_rows in one call, several times quicker a row than torch.topk (a
    pass lists about two rows per drafted token; docs/bench/2026-12-07-notes-from-engine.md); others (rows of
    other lengths, other devices or dtypes, hosts without the kernels) to torch.topk, row by row."""
    same = all(r.device.type == "cpu" and r.dtype == torch.float32 and r.shape == rows[0].shape for r in rows)
    if rows and same and rows[0].dim() == 1 and cpu_build.available():
        tops = []
        for row, ids in zip(rows, cpu_calls.top_rows(list(rows), TOP_N)):
            values = row[ids].tolist()
            tops.append([(i, v) for i, v in zip(ids, values) if v > 0])
        return tops
    tops = []
    for probs in rows:
        values, ids = torch.topk(probs, min(TOP_N, probs.shape[-1]))
        tops.append([(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist()) if v > 0])
    return tops


def resolve_tops(verdict: Verdict) -> Verdict:
    """The walk keeps the rows its top entries come from (p and q at each visited node, the residual) and
    lists them here, after the pass was timed (the top entries are for the screen, not part of verifying);
    the chain verifiers list theirs in their one host copy. Idempotent."""
    tops = verdict.tops
    if tops is None:
        return verdict

    rows = [
        row for row in (*tops["p"].values(), *tops["q"].values(), tops["residual"]) if isinstance(row, torch.Tensor)
    ]
    listed = {id(row): top for row, top in zip(rows, top_entries_of(rows))}  # one call for the pass's rows

    def entries(row):
        return listed[id(row)] if isinstance(row, torch.Tensor) else row

    verdict.tops = {
        "p": {node: entries(row) for node, row in tops["p"].items()},
        "q": {node: entries(row) for node, row in tops["q"].items()},
        "residual": entries(tops["residual"]),
    }
    return verdict


def _uniform(gen: torch.Generator) -> float:
    """One uniform in [0, 1), drawn on the generator's device."""
    return float(torch.rand((), generator=gen, dtype=torch.float64, device=gen.device))


def walk_tree(
    logits: torch.Tensor,
    tree: DraftTree,
    params: SamplingParams,
    gen: torch.Generator,
    verify_node: Callable = verify_children,
    tops: bool = False,
) -> Verdict:
    """Walk the draft tree from the root with exact (recursive) rejection sampling.

    logits: [1 + n, V] target logits; row 0 = the pending token (the root), row 1 + i = node i.
    verify_node: the test of one node's children, ``acceptance.verify_children`` (the exact rule);
    the Lossless lab and the negative-control tests pass a lossy one
    (``engine.tools.exactness.verify_children_ignoring_q``) to show what a shortcut does.
    tops: keep the top entries of p, q and the residual (``Verdict.tops``; the rows, listed by ``resolve_tops``).
    """
    n = len(tree)
    decisions = ["not_reached"] * n
    records: list[dict | None] = [None] * n
    p_token: list[float | None] = [None] * n
    top_p: dict[int, Top] = {}
    top_q: dict[int, Top | None] = {}
    residual_top = None
    path: list[int] = []
    node = -1
    while True:
        p = probs_from_logits(logits[node + 1], params)  # [V]
        children = tree.children(node)
        q = tree.q_dists.get(node)
        if tops:  # (kept as rows: resolve_tops lists their top entries once the pass is timed)
            top_p[node] = p
            top_q[node] = q
        if children:
            picked = p[torch.tensor([tree.tokens[c] for c in children], device=p.device)].tolist()
            for c, value in zip(children, picked):
                p_token[c] = value
        if not children:
            token = argmax_index(p) if params.greedy else sample(p, gen)
            extra = {"token_id": token, "kind": "bonus", "from_node": node}
            break
        u = [] if params.greedy else [_uniform(gen) for _ in children]
        chosen, dist, recs = verify_node(
            p, q if q is not None else p, [tree.tokens[c] for c in children], u, params.greedy, tree.point_mass
        )
        for c, rec in zip(children, recs):
            records[c], decisions[c] = rec, "rejected"
        if chosen is None:
            token = argmax_index(dist) if params.greedy else sample(dist, gen)
            extra = {"token_id": token, "kind": "resampled", "from_node": node}
            if tops and not params.greedy:
                residual_top = dist
            break
        node = children[chosen]
        decisions[node] = "accepted"
        for c in children[chosen + 1 :]:  # siblings after the accepted one were never tried
            records[c], decisions[c] = None, "not_reached"
        path.append(node)
    extra["p"] = float(p[token])
    kept = {"p": top_p, "q": top_q, "residual": residual_top} if tops else None
    return Verdict(decisions, records, path, extra, p_token, kept, params.greedy)


def _chain_q(tree: DraftTree, device: torch.device) -> torch.Tensor | None:
    """[K, V] the drafter's q at each drafted position, stacked on `device` (None for point masses)."""
    if tree.point_mass:
        return None
    return torch.stack([tree.q_dists[i - 1] for i in range(len(tree))]).to(device)


def _tops_on_device(p, q, dist) -> list[torch.Tensor]:
    """The top TOP_N (values, ids) of p [K+1, V], q [K, V] or None and dist [V] or None, flattened."""
    n = min(TOP_N, p.shape[-1])
    out = []
    for rows in (p, q, None if dist is None else dist[None]):
        if rows is not None and rows.shape[0]:
            values, ids = torch.topk(rows, n, dim=-1)  # [R, n], [R, n]
            out += [values.double().flatten(), ids.double().flatten()]
    return out


def _unpack_tops(flat: list[float], k: int, n: int, with_q: bool, with_dist: bool) -> dict:
    """The inverse of ``_tops_on_device`` on the host: node -> Top for p and q, and the residual's."""
    at = 0

    def rows(count: int) -> list[Top]:
        nonlocal at
        values = flat[at : at + count * n]
        ids = flat[at + count * n : at + 2 * count * n]
        at += 2 * count * n
        return [
            [(int(i), v) for v, i in zip(values[r * n : (r + 1) * n], ids[r * n : (r + 1) * n]) if v > 0]
            for r in range(count)
        ]

    p_rows = rows(k + 1)
    q_rows = rows(k) if with_q and k else [None] * k
    residual_top = rows(1)[0] if with_dist else None
    return {
        "p": {i - 1: p_rows[i] for i in range(k + 1)},
        "q": {i - 1: q_rows[i] for i in range(k)} | {k - 1: None},
        "residual": residual_top,
    }


def _row_tops(p: torch.Tensor, q: torch.Tensor | None, dist: torch.Tensor | None) -> dict:
    """The rows ``_tops_on_device`` would take the top entries of, by node (listed later by ``resolve_tops``)."""
    k = p.shape[0] - 1
    return {
        "p": {i - 1: p[i] for i in range(k + 1)},
        "q": {i - 1: (q[i] if q is not None else None) for i in range(k)} | {k - 1: None},
        "residual": dist,
    }


def _kept_tops(tail: list[float], p: torch.Tensor, q: torch.Tensor | None, dist: torch.Tensor | None, accepted: int):
    """A chain's top entries at the positions it visited (the root and the accepted path), and the residual's
    after a rejection: from the packed copy's tail off the CPU; on the CPU (where the copy is free) the rows
    themselves, which ``resolve_tops`` lists once the pass is timed (as the walk's)."""
    k = p.shape[0] - 1
    if p.device.type != "cpu":
        kept = _unpack_tops(tail, k, min(TOP_N, p.shape[-1]), q is not None, dist is not None)
    else:
        kept = _row_tops(p, q, dist)
    return {
        "p": {node: top for node, top in kept["p"].items() if node < accepted},
        "q": {node: top for node, top in kept["q"].items() if node < accepted},
        "residual": kept["residual"] if accepted < k else None,  # a bonus is drawn from p itself
    }


def _chain_verdict(tree, accepted, token, tested, u, p_eff, q_eff, p_extra, greedy, kept) -> Verdict:
    """A chain's Verdict from the numbers one host copy brought back (lists of floats)."""
    k = len(tree)
    decisions = ["accepted"] * accepted + ["rejected"] * (accepted < k) + ["not_reached"] * (k - accepted - 1)
    records: list[dict | None] = [None] * k
    for i in range(min(accepted + 1, k)):  # the tests that ran: every accepted draft and the first rejected one
        records[i] = {
            "accept_prob": tested[i],
            "u": None if greedy else u[i],
            "p_eff": p_eff[i],
            "q_eff": q_eff[i],
            "adjusted": False,  # a chain has no siblings
        }
    p_token = [p_eff[i] if i <= accepted else None for i in range(k)]
    if accepted < k:
        extra = {"token_id": token, "kind": "resampled", "from_node": accepted - 1}
    else:
        extra = {"token_id": token, "kind": "bonus", "from_node": k - 1}
    extra["p"] = p_extra
    return Verdict(decisions, records, list(range(accepted)), extra, p_token, kept, greedy)


def verify_chain_batched(
    logits: torch.Tensor, tree: DraftTree, params: SamplingParams, gen: torch.Generator, tops: bool = False
) -> Verdict:
    """A sampled chain of K drafts in one call of ``verify_batch`` (B = 1), on the logits' device.

    logits: [K+1, V] on the model's device (the Triton kernel runs where they live); gen: on the same device.
    The uniforms come from ``gen`` in a different order than the walk's, so one seed gives a different
    (equally exact) sample.
    """
    k = len(tree)
    device = logits.device
    p = probs_from_logits(logits, params)  # [K+1, V] float32 target probabilities
    ids = torch.tensor(tree.tokens, dtype=torch.long, device=device)  # [K] drafted ids
    q = _chain_q(tree, device)  # [K, V] or None
    u = torch.rand(k, generator=gen, dtype=torch.float64, device=device).float().clamp_(max=_BELOW_ONE_F32)  # [K]
    e = exponentials(p[:1], gen)  # [1, V] the race that draws the extra token
    num_accepted, next_token, accept_prob = verify_batch(
        p[None], None if q is None else q[None], ids[None], u[None], e
    )  # [1], [1], [1, K]
    rows = torch.arange(k, device=device)
    p_eff = p[rows, ids]  # [K] p_i(x_i)
    q_eff = torch.ones_like(p_eff) if q is None else q[rows, ids]  # [K] q_i(x_i)
    p_extra = p[num_accepted, next_token]  # [1] p of the extra token at its position
    packed = [num_accepted.double(), next_token.double(), accept_prob[0].double(), u.double()]
    packed += [p_eff.double(), q_eff.double(), p_extra.double()]
    dist = None
    if tops:
        dist = extra_distribution(p[None], None if q is None else q[None], ids[None], num_accepted)[0]  # [V]
        dist = dist / dist.sum()
        packed += [] if device.type == "cpu" else _tops_on_device(p, q, dist)
    host = torch.cat(packed).tolist()  # the pass's one host copy
    accepted, token = int(host[0]), int(host[1])
    tested, u_h, p_h, q_h = (host[2 + j * k : 2 + (j + 1) * k] for j in range(4))
    p_extra_h = host[2 + 4 * k]
    kept = _kept_tops(host[3 + 4 * k :], p, q, dist, accepted) if tops else None
    return _chain_verdict(tree, accepted, token, tested, u_h, p_h, q_h, p_extra_h, False, kept)


def verify_chain_greedy(logits: torch.Tensor, tree: DraftTree, params: SamplingParams, tops: bool = False) -> Verdict:
    """A greedy chain of K drafts on the logits' device: draft i is accepted while it is the argmax of p at its
    position (the walk's greedy test, ``acceptance.verify_children``), the extra token is the argmax at the first
    mismatch (or past the last draft). The same Verdict as the walk's, in one host copy.

    logits: [K+1, V] on the model's device."""
    k = len(tree)
    device = logits.device
    p = probs_from_logits(logits, params)  # [K+1, V] (greedy: the softmax of the raw logits, for the record)
    best = p.argmax(dim=-1)  # [K+1] the target's choice at each position
    ids = torch.tensor(tree.tokens, dtype=torch.long, device=device)  # [K]
    match = best[:k] == ids  # [K]
    accepted_t = torch.cumprod(match.long(), dim=0).sum(dim=0, keepdim=True)  # [1] the matching prefix
    token_t = best[accepted_t]  # [1]
    q = _chain_q(tree, device)
    rows = torch.arange(k, device=device)
    p_eff = p[rows, ids]  # [K]
    q_eff = torch.ones_like(p_eff) if q is None else q[rows, ids]  # [K]
    packed = [accepted_t.double(), token_t.double(), match.double(), p_eff.double(), q_eff.double()]
    packed += [p[accepted_t, token_t].double()]
    if tops and device.type != "cpu":
        packed += _tops_on_device(p, q, None)
    host = torch.cat(packed).tolist()  # the pass's one host copy
    accepted, token = int(host[0]), int(host[1])
    tested, p_h, q_h = (host[2 + j * k : 2 + (j + 1) * k] for j in range(3))
    kept = _kept_tops(host[3 + 3 * k :], p, q, None, accepted) if tops else None
    return _chain_verdict(tree, accepted, token, tested, None, p_h, q_h, host[2 + 3 * k], True, kept)


def verify_chain_block(
    logits: torch.Tensor, tree: DraftTree, params: SamplingParams, gen: torch.Generator, tops: bool = False
) -> Verdict:
    """A sampled chain of K drafts by block verification, on the logits' device, in one host copy.

    logits: [K+1, V]; gen: on the same device. Every prefix length is tested (u_i against h_i); the longest
    that passes is kept, so nodes before it are accepted even where their own test failed, and every node
    after it is rejected (tested, failed)."""
    k = len(tree)
    device = logits.device
    p = probs_from_logits(logits, params)  # [K+1, V]
    ids = torch.tensor(tree.tokens, dtype=torch.long, device=device)  # [K]
    q = _chain_q(tree, device)  # [K, V] or None
    q_rows = torch.nn.functional.one_hot(ids, p.shape[-1]).float() if q is None else q  # [K, V]
    u = torch.rand(k, generator=gen, dtype=torch.float64, device=device)  # [K]
    num_accepted, h, joint, dist, passed = block_verify_chain(p, q_rows, ids, u)  # [], [K], [K], [V], [K]
    token = draw(dist, gen)  # [] the extra token
    dist = dist / dist.sum()  # (what the screen's residual entries are read from)
    rows = torch.arange(k, device=device)
    p_eff, q_eff = p[rows, ids], q_rows[rows, ids]  # [K], [K]
    packed = [num_accepted[None].double(), token[None].double(), h.double(), u, p_eff.double(), q_eff.double()]
    packed += [joint.double(), passed.double(), p[num_accepted, token][None].double()]
    if tops and device.type != "cpu":
        packed += _tops_on_device(p, q, dist)
    host = torch.cat(packed).tolist()  # the pass's one host copy
    accepted, token_id = int(host[0]), int(host[1])
    tested, u_h, p_h, q_h, joint_h, passed_h = (host[2 + j * k : 2 + (j + 1) * k] for j in range(6))
    decisions = ["accepted"] * accepted + ["rejected"] * (k - accepted)
    records: list[dict | None] = [
        {
            "accept_prob": tested[i],
            "u": u_h[i],
            "p_eff": p_h[i],
            "q_eff": q_h[i],
            "adjusted": False,
            "joint": joint_h[i],
            "passed": passed_h[i] > 0,
        }
        for i in range(k)
    ]
    kind = "bonus" if accepted == k else "resampled"
    extra = {"token_id": token_id, "kind": kind, "from_node": accepted - 1, "p": host[2 + 6 * k]}
    kept = _kept_tops(host[3 + 6 * k :], p, q, dist, accepted) if tops else None
    p_token = [p_h[i] if i <= accepted else None for i in range(k)]
    return Verdict(decisions, records, list(range(accepted)), extra, p_token, kept, False, "block")


def choose_verifier(
    tree: DraftTree,
    params: SamplingParams,
    rule: str = "token",
    batch_chains: bool = False,
    verify_node: Callable | None = None,
) -> str:
    """Which of VERIFIERS decides a pass over `tree`: "chain_block" for a sampled chain under the block rule
    (rule: GenerationSettings.verify); with batch_chains, "chain_greedy" or "chain_batched" for a greedy or
    sampled chain; else "walk" (trees, the empty draft, and any verify_node: only the walk takes another test)."""
    if verify_node is None and len(tree) and tree.is_chain:
        if rule == "block" and not params.greedy:
            return "chain_block"
        if batch_chains:
            return "chain_greedy" if params.greedy else "chain_batched"
    return "walk"


def logits_to_host(verifier: str, device: torch.device) -> bool:
    """Whether the target pass hands `verifier` its logits on the host: the walk's on the CPU, which reads them
    row by row (a long chain's last rows then stay unprojected until it does, tree_pass.CHAIN_LOGITS_FIRST). The
    chain verifiers read them where they live, with one host copy; on CUDA the walk too (a scalar per test)."""
    return verifier == "walk" and device.type == "cpu"


def verify(
    verifier: str,
    logits,
    tree: DraftTree,
    params: SamplingParams,
    gen: torch.Generator,
    tops: bool = False,
    verify_node: Callable | None = None,
) -> Verdict:
    """The Verdict of `verifier` (``choose_verifier``) on one pass's logits [1 + n, V] (a walk's may be a lazy
    chain's rows, read one by one). verify_node: the walk's node test, None for ``acceptance.verify_children``."""
    if verifier == "chain_block":  # (a sampled chain's prefix by its joint ratio, on the logits' device)
        return verify_chain_block(logits, tree, params, gen, tops)
    if verifier == "chain_greedy":
        return verify_chain_greedy(logits, tree, params, tops)
    if verifier == "chain_batched":
        return verify_chain_batched(logits, tree, params, gen, tops)
    return walk_tree(logits, tree, params, gen, verify_node or verify_children, tops)
