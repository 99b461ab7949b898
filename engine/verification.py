"""Verifying one target pass: from the target's logits over a draft tree to a Verdict.

The decode loop feeds the pending token plus the draft tree to the target in one
pass; this module turns the resulting logits into decisions, with the acceptance
rule of ``engine.acceptance`` and nothing else:

* ``walk_tree``: from the root, verify the children of the current node with
  ``acceptance.verify_children``; on an acceptance descend into that child, on a
  rejection of every child draw the extra token (*resampled*) from the
  distribution the rule left, and when the walk runs off the tree draw a *bonus*
  token from p. Greedy, sampled, chains, trees and point-mass drafts alike.
* ``verify_chain_batched``: a sampled chain in one call of
  ``batched_verifier.verify_batch`` (the Triton kernel where the logits live on
  CUDA, its torch reference elsewhere), which mirrors the same rule and returns
  the accept probabilities it tested, so the Verdict is built from its numbers.

A Verdict holds every decision and the numbers it was made from; ``engine.events``
records it and nothing downstream decides again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.acceptance import residual, verify_children
from engine.drafters.base import DraftTree
from engine.kernels.batched_verifier import verify_batch
from engine.sampling import SamplingParams, probs_from_logits, sample

__all__ = ["Verdict", "verify_chain_batched", "walk_tree"]

# Uniforms are drawn in float64 and used in float32 by the batched verifier; this
# keeps them strictly below 1 after the cast (a float32 1.0 would reject everything).
_BELOW_ONE_F32 = 1.0 - 2**-24


@dataclass
class Verdict:
    """What one target pass decided about a draft tree of n nodes.

    decisions: [n] "accepted" / "rejected" / "not_reached" per node
    records:   [n] the numbers each tried node's test compared (accept_prob, u,
               p_eff, q_eff, adjusted), None for nodes never tried
    path:      accepted node ids, root to leaf
    extra:     the one token the target adds itself: {"token_id", "kind"
               ("resampled" after a rejection, "bonus" past the last draft), "from_node"}
    extra_dist: [V] the distribution the extra token was drawn from (the residual
               after a sampled rejection, p for a bonus; a one-hot when greedy)
    p_rows:    node -> [V] float32 target probabilities at that node, for the
               visited nodes (-1 = the root, then the accepted path)
    greedy:    decided by argmax (no uniforms, no residual)
    """

    decisions: list[str]
    records: list[dict | None]
    path: list[int]
    extra: dict
    extra_dist: torch.Tensor
    p_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    greedy: bool = False

    def emitted(self, tree: DraftTree) -> list[dict]:
        """The tokens this pass adds to the output: the accepted path, then the extra token."""
        accepted = [{"token_id": tree.tokens[i], "kind": "accepted", "node": i} for i in self.path]
        return accepted + [{**self.extra, "node": None}]


def walk_tree(
    logits: torch.Tensor,
    tree: DraftTree,
    params: SamplingParams,
    gen: torch.Generator,
    verify_node: Callable = verify_children,
) -> Verdict:
    """Walk the draft tree from the root with exact (recursive) rejection sampling.

    logits: [1 + n, V] target logits; row 0 = the pending token (the root), row 1 + i = node i.
    verify_node: the test of one node's children, ``acceptance.verify_children`` (the exact rule);
    the Lossless lab and the negative-control tests pass a lossy one
    (``engine.tools.exactness.verify_children_ignoring_q``) to show what a shortcut does.
    """
    n = len(tree)
    p_rows: dict[int, torch.Tensor] = {}
    decisions = ["not_reached"] * n
    records: list[dict | None] = [None] * n
    path: list[int] = []
    node = -1
    while True:
        p = p_rows[node] = probs_from_logits(logits[node + 1], params)  # [V]
        children = tree.children(node)
        if not children:
            token = int(p.argmax()) if params.greedy else sample(p, gen)
            extra, dist = {"token_id": token, "kind": "bonus", "from_node": node}, p
            break
        u = [] if params.greedy else [float(torch.rand((), generator=gen, dtype=torch.float64)) for _ in children]
        q = tree.q_dists.get(node)
        chosen, dist, recs = verify_node(
            p, q if q is not None else p, [tree.tokens[c] for c in children], u, params.greedy, tree.point_mass
        )
        for c, rec in zip(children, recs):
            records[c], decisions[c] = rec, "rejected"
        if chosen is None:
            token = int(dist.argmax()) if params.greedy else sample(dist, gen)
            extra = {"token_id": token, "kind": "resampled", "from_node": node}
            break
        node = children[chosen]
        decisions[node] = "accepted"
        for c in children[chosen + 1 :]:  # siblings after the accepted one were never tried
            records[c], decisions[c] = None, "not_reached"
        path.append(node)
    extra["p"] = float(p[token])
    return Verdict(decisions, records, path, extra, dist, p_rows, params.greedy)


def verify_chain_batched(
    logits: torch.Tensor, tree: DraftTree, params: SamplingParams, gen: torch.Generator
) -> Verdict:
    """A sampled chain of K drafts in one call of ``verify_batch`` (B = 1).

    logits: [K+1, V] on the model's device (the Triton kernel runs where they live).
    The uniforms come from ``gen`` in a different order than the walk's, so one seed
    gives a different (equally exact) sample.
    """
    k = len(tree)
    device = logits.device
    p = probs_from_logits(logits, params)  # [K+1, V] float32 target probabilities
    ids = torch.tensor(tree.tokens, dtype=torch.long)  # [K] drafted ids
    q = None if tree.point_mass else torch.stack([tree.q_dists[i - 1] for i in range(k)]).to(device)  # [K, V]
    u = torch.rand(k, generator=gen, dtype=torch.float64).float().clamp_(max=_BELOW_ONE_F32)  # [K]
    u_sample = torch.rand(1, generator=gen, dtype=torch.float64).float().clamp_(max=_BELOW_ONE_F32)  # [1]
    num_accepted, next_token, accept_prob = verify_batch(
        p[None], None if q is None else q[None], ids[None].to(device), u[None].to(device), u_sample.to(device)
    )  # [1], [1], [1, K]
    accepted, token = int(num_accepted[0]), int(next_token[0])
    p_host = p.cpu()  # [K+1, V]
    accept_prob = accept_prob[0].cpu()  # [K]
    decisions = ["accepted"] * accepted + ["rejected"] * (accepted < k) + ["not_reached"] * (k - accepted - 1)
    records: list[dict | None] = [None] * k
    for i in range(min(accepted + 1, k)):  # the tests that ran: every accepted draft and the first rejected one
        x = tree.tokens[i]
        records[i] = {
            "accept_prob": float(accept_prob[i]),
            "u": float(u[i]),
            "p_eff": float(p_host[i, x]),
            "q_eff": 1.0 if q is None else float(tree.q_dists[i - 1][x]),
            "adjusted": False,  # a chain has no siblings
        }
    p_rows = {i - 1: p_host[i] for i in range(accepted + 1)}
    if accepted < k:
        q_row = tree.q_dists[accepted - 1] if q is not None else torch.zeros_like(p_host[accepted])
        if q is None:
            q_row[tree.tokens[accepted]] = 1.0  # the point mass of the rejected draft
        extra = {"token_id": token, "kind": "resampled", "from_node": accepted - 1}
        dist = residual(p_host[accepted], q_row.cpu())
    else:
        extra, dist = {"token_id": token, "kind": "bonus", "from_node": k - 1}, p_host[k]
    extra["p"] = float(p_host[accepted, token])
    return Verdict(decisions, records, list(range(accepted)), extra, dist, p_rows)
