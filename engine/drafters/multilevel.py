"""Drafts of drafts (multi-level speculation): a model drafter whose own tokens are drafted by a copying
drafter and verified by the model with the exact rule, ``q4+ngram`` (also ``int8+ngram``, ``q4+suffix``...).

Why: on a CPU a model drafter pays in proportion to how cheap its passes are. When the text copies something
(the prompt, an earlier answer), n-gram lookup can propose the model drafter's next tokens for free, and the
model checks m of them in one pass of 1 + m rows, which costs about what one row costs (decoding is memory
bound), instead of m passes. ML-SpecQD (Georganas et al., arXiv 2503.13565) calls it multi-level speculative
decoding: a 4-bit draft of a bf16 target, itself accelerated by a smaller drafter.

The inner level, one round of ``propose``::

    q_cur   the drafter model's distribution at the next position (a row of its last pass)
    c_1..c_m  the copying drafter's proposal continuing context + drafts so far (point masses; m may be 0)
    pass    the model runs [unseen, c_1 .. c_m] in one pass (unseen: the committed tokens it has not run, in
            the first round; the token drawn last, later): rows q(. | .., c_1 .. c_j) for j = 0..m
    walk    c_j is kept with probability min(1, q_cur(c_j) / 1) = q_cur(c_j) (greedy: iff it is the argmax);
            on a rejection the token drawn instead comes from norm(max(0, q_cur - onehot(c_j))), q_cur without
            c_j; after m kept, one more token is drawn from the next row (the bonus). The test and the
            residual are engine.acceptance's (verify_children with point_mass, residual): the rule in one place
    cache   the model's slots of rejected c_j .. c_m are rolled back; the drawn token is the next round's pending

Why the target's verification stays exact: the target's rule needs each drafted token x_i to be drawn from the q_i
it is handed, given the tokens before it. The inner walk is the point-mass case of the rule proven in
``engine.acceptance``: P(emit c) = q(c) and P(emit y != c) = (1 - q(c)) q(y) / (1 - q(c)) = q(y), so every drafted
token is an exact draw from the model's q at its position, and that q (the row handed on) is the model's own
conditional there. Greedy: the inner walk emits the argmax exactly. Our CPU kernels are row-invariant (a row's
numbers do not depend on the other rows of its pass), so the q handed on are bit for bit those a plain chain of the
same model computes, and greedy drafts are the plain drafter's drafts: only the number of model passes changes.
tests/test_multilevel.py checks the law by chi-square with a negative control (the rejected token not removed from
the residual).

Dry stretches (greedy, or sampled with a temperature alone): where the copying drafter has proposed nothing for
DRY_ROUNDS rounds in a row (open chat), a round without a proposal runs the rest of the chain in one C call
(``chains.greedy_chain`` or ``sampled_chain``, as the plain drafter's chain does) instead of one Python pass
per token. Greedy, the drafts and q are the same bits (row invariance); sampled, each token is drawn in C from the
q the call returns (the model's softmax to float32 rounding) at a uniform from the run's generator, where a round
without a proposal draws one too: an exact draw from q either way, and a proposal would only have saved a pass,
never changed a draft's law. Only passes that a proposal might have saved are run. After the call the copying
drafter is asked at each position the chain passed: one proposal there ends the dry stretch. Chains only: a tree
(topk > 1) is drafted by the model alone, as its plain drafter does.
"""

from __future__ import annotations

import torch

from engine.acceptance import argmax_index, residual, verify_children
from engine.drafters.base import DraftContext, Drafter, DraftTree, TreeShape
from engine.drafters.model import ModelDrafter, temperature_only
from engine.drafters.spec import DrafterSpec, Family, family, part, register
from engine.model import chains
from engine.model.transformer import Transformer
from engine.sampling import SamplingParams, sample

__all__ = ["DRY_ROUNDS", "FAMILY", "MultiLevelDrafter"]

LABEL = "MODEL+COPY (drafts of drafts)"

# Rounds in a row without a proposal before a round without one chains the rest in C.
DRY_ROUNDS = 1  # chosen by measurement: docs/bench/2026-12-07-notes-from-engine.md


class MultiLevelDrafter(ModelDrafter):
    """A model drafter (``model``) whose chain is proposed, m tokens at a time, by ``inner`` (n-gram or
    suffix: a point-mass drafter) and verified by the model in one pass per round."""

    def __init__(self, model: Transformer, name: str, inner: Drafter, share_target_kv: bool = False):
        super().__init__(model, name, share_target_kv)
        if not inner.needs.point_mass:
            raise ValueError(f"the inner drafter of {name!r} must be a copying drafter (ngram or suffix)")
        self.inner = inner
        self._dry = 0  # rounds in a row whose copying drafter proposed nothing

    def start(self, prompt_ids, capacity, runner=None, features=None, target_cache=None) -> None:
        super().start(prompt_ids, capacity, runner, features, target_cache)
        self.inner.start(prompt_ids, capacity)
        self._dry = 0

    def _proposal(self, tokens: list[int], room: int) -> list[int]:
        """The copying drafter's chain continuing `tokens`, at most `room` tokens."""
        tree = self.inner.propose(DraftContext(tokens, TreeShape(k=room)))
        return tree.first_chain()[:room]

    def propose(self, context: DraftContext) -> DraftTree:
        shape, params, gen = context.shape, context.params, context.gen
        if shape.topk > 1:  # trees: the model drafts alone
            return super().propose(context)
        if self.cache is None:
            raise RuntimeError("MultiLevelDrafter.start must be called before propose")
        self.take_target_kv()
        tree = DraftTree(stop="depth", facts={"model_passes": 0, "copied": 0})
        drafted: list[int] = []
        # The first round rides on the catch-up pass: the committed tokens the model has not seen, then the
        # first proposal, so a rejected proposal never costs a pass the plain drafter would not run.
        unseen = context.tokens[self.cache.length :]
        committed = len(context.tokens)
        fed, first, room = unseen, len(unseen) - 1, shape.k  # the round's tokens the model has not seen
        proposal = self._proposal(context.tokens, room - 1) if room > 1 else []
        while not self._chain_the_rest(tree, drafted, context, fed, proposal, room):
            q_cur, rows = self._rows(tree, fed + proposal, first, params)  # [V], [m, V]
            kept, q_cur = self._walk(tree, drafted, proposal, q_cur, rows, params, gen)
            tree.facts["copied"] += kept
            self.cache.length -= len(proposal) - kept  # the model's slots of rejected proposals
            # the round's own draw, always room for it: the bonus after all kept, or the resample
            token = self._draw(q_cur, None if kept == len(proposal) else proposal[kept], params, gen)
            self._add(tree, drafted, token, q_cur)
            room = shape.k - len(drafted)
            if room == 0:
                break
            # next round: the token just drawn (the model has not seen it) and up to room - 1 proposals
            fed, first = [token], 0
            proposal = self._proposal(context.tokens + drafted, room - 1) if room > 1 else []
        # every drafted token but the last was fed, in order: node i sits at slot committed + i
        self._last = (committed, list(range(len(tree))), {i: committed + i for i in range(len(tree) - 1)})
        return tree

    def _chain_the_rest(self, tree, drafted, context: DraftContext, fed: list[int], proposal, room: int) -> bool:
        """In a dry stretch (greedy or a temperature alone, no proposal now nor in the DRY_ROUNDS rounds before):
        the remaining `room` levels in one C call from `fed` (the one token the model has not seen); True if it
        ran. Otherwise counts this round as dry or not and returns False (the round's Python pass runs)."""
        if proposal or room < 2:
            self._dry = 0 if proposal else self._dry + 1
            return False
        params, cache = context.params, self.cache
        if not (
            (params.greedy or temperature_only(params))
            and self._dry >= DRY_ROUNDS
            and len(fed) == 1
            and self.static is None
            and chains.greedy_chain_ready(self.model, cache)
        ):
            self._dry += 1
            return False
        # [room, V] rows: the token's pass, then each draft's
        if params.greedy:
            logits, tokens = chains.greedy_chain(self.model, fed[0], cache, room)
            qs = self.draft_q(logits, params)  # each q the bits of its one-row pass's softmax
        else:  # one uniform per draw, as a round without a proposal draws one; qs: what each was drawn from
            u = torch.rand(room, generator=context.gen, dtype=torch.float64)  # [room]
            _, qs, tokens = chains.sampled_chain(self.model, fed[0], cache, room, params.temperature, u)
        tree.facts["model_passes"] += room
        for q, token in zip(qs, tokens):
            self._add(tree, drafted, token, q)
        # Would the copying drafter have proposed at a position the chain passed? Then the stretch is over.
        done = context.tokens + drafted
        wet = any(self._proposal(done[: len(done) - room + i], 1) for i in range(1, room))
        self._dry = 0 if wet else self._dry + room
        return True

    def _rows(self, tree: DraftTree, fed: list[int], first: int, params: SamplingParams):
        """One model pass over `fed` at the cache's end; (q after row `first`, q after each later row [m, V])."""
        start = self.cache.length
        logits = self.model_pass(
            torch.tensor(fed, dtype=torch.long), torch.arange(start, start + len(fed)), first_row=first
        )
        tree.facts["model_passes"] += 1
        rows = self.draft_q(logits.logits, params)  # [len(fed) - first, V]
        return rows[0], rows[1:]

    def _walk(self, tree, drafted, proposal, q_cur, rows, params: SamplingParams, gen) -> tuple[int, torch.Tensor]:
        """Test the proposal against the model's rows, in order; returns (how many were kept, the q at the
        position after the last kept one). rows [m, V]: q after each proposed token."""
        for j, token in enumerate(proposal):
            u = [] if params.greedy else [float(torch.rand((), generator=gen, dtype=torch.float64))]
            # the model's q plays p, the proposal is a point mass: kept with probability q(c) (greedy: its argmax)
            chosen, _, _ = verify_children(q_cur, q_cur, [token], u, params.greedy, point_mass=True)
            if chosen is None:
                return j, q_cur
            self._add(tree, drafted, token, q_cur)
            q_cur = rows[j]
        return len(proposal), q_cur

    @staticmethod
    def _draw(q: torch.Tensor, rejected: int | None, params: SamplingParams, gen) -> int:
        """A token from q (the bonus), or from norm(max(0, q - onehot(rejected))) after a rejection."""
        if params.greedy:
            return argmax_index(q)  # a rejected proposal was not the argmax: the argmax stands
        if rejected is not None:
            point = torch.zeros_like(q)
            point[rejected] = 1.0
            q = residual(q, point)  # [V]: q without the rejected proposal, renormalised
        return sample(q, gen)

    @staticmethod
    def _add(tree: DraftTree, drafted: list[int], token: int, q: torch.Tensor) -> None:
        """Append one drafted token to the chain with the q it was drawn from."""
        parent = len(tree) - 1
        tree.q_dists[parent] = q
        tree.tokens.append(int(token))
        tree.parents.append(parent)
        tree.depths.append(len(tree.tokens))
        tree.q_token.append(float(q[token]))
        drafted.append(int(token))

    def accept(self, verified) -> None:
        super().accept(verified)
        self.inner.accept(verified)

    def close(self) -> None:
        super().close()
        self.inner.close()


def _parse(text: str) -> DrafterSpec:
    """``MODEL+COPY``: MODEL a quantised copy of the target, COPY a copying drafter."""
    outer, inner = (piece.strip() for piece in text.split("+", 1))
    model = part(outer, ("model",), "before the '+'", text, LABEL, lambda f: f.copy_of_target)
    copy = part(inner, ("copying",), "after the '+'", text, LABEL)
    return DrafterSpec(text, "multilevel", model=model, copy=copy)


def _build(spec: DrafterSpec, registry, history) -> MultiLevelDrafter:
    inner = registry.build(spec.copy, history)
    return MultiLevelDrafter(registry.weights(spec.model), spec.text, inner, family(spec.model.family).target_kv)


FAMILY = register(
    Family(
        "multilevel",
        label=LABEL,
        help="a quantised copy of the target whose own guesses a copying drafter proposes, checked several at once",
        form="MODEL+COPY",
        build=_build,
        kind="composite",
        parse=_parse,
        join="+",
        unserved="drafts of drafts (a model drafter whose own chain a copying drafter proposes) is SpecLens's alone here",
        order=50,
        menu=(("q4+ngram (q4, its own guesses proposed by n-gram)", "q4+ngram"),),
    )
)
