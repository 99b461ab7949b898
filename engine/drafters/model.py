"""Drafting with a model of its own: a separate small model of the target's vocabulary (``model:<id>``) or the
target's own weights quantised (``int8``, ``q4``: self-speculation), each with its KV cache, one pass per level
(a chain in one C call where it can). The EAGLE head builds on ``ModelDrafter``; the families are at the bottom.
"""

from __future__ import annotations

import torch

from engine.acceptance import argmax_index
from engine.drafters.base import DraftContext, Drafter, DrafterNeeds, DraftTree, Verified
from engine.drafters.spec import DrafterMemory, DrafterSpec, Family, MemorySizes, Serving, family, register
from engine.model import chains
from engine.model.static_pass import StaticPasses
from engine.model.transformer import KVCache, PassOutput, Transformer
from engine.sampling import SamplingParams, probs_from_logits, sample_without_replacement

__all__ = ["INT8", "MODEL", "ModelDrafter", "Q4", "int8_weights", "q4_weights"]


# Static sibling-rank weights for sampling-mode trees: a node's score is the
# product of these along its path, so the kept set depends on ranks only.
_RANK_WEIGHT = [0.8, 0.3, 0.15, 0.08, 0.05, 0.03]


def _rank_weight(rank: int) -> float:
    return _RANK_WEIGHT[rank] if rank < len(_RANK_WEIGHT) else _RANK_WEIGHT[-1] * 0.5 ** (rank - len(_RANK_WEIGHT) + 1)


class ModelDrafter(Drafter):
    """A small causal LM (or the int8 copy of the target) drafting with its own KV cache."""

    def __init__(self, model: Transformer, name: str, share_target_kv: bool = False):
        self.model = model
        self.name = name
        # share_target_kv: a quantised copy of the target (the registry says so for q4) reads the committed
        # positions' keys and values from the target's cache (DrafterNeeds.target_kv)
        self.needs = DrafterNeeds(model=model, target_kv=share_target_kv)
        self.cache: KVCache | None = None
        self.target_cache: KVCache | None = None
        # The fixed-shape passes (engine/model/static_pass.py) of this drafter's weights, held for one run
        # where the engine hands them over (``start``'s runner): the drafter's passes of up to its width then
        # run there too, over its static cache. None: every pass eager.
        self.static: StaticPasses | None = None

    def start(self, prompt_ids, capacity, runner=None, features=None, target_cache=None) -> None:
        self.close()
        self.target_cache = target_cache if self.needs.target_kv else None
        if runner is not None:  # held for this run by the engine's pool; released by close
            self.static, self.cache = runner, runner.cache
        else:  # eager passes
            self.cache = self.model.new_cache(capacity)
        self.cache.length = 0

    def model_pass(
        self, tokens, positions, mask=None, x_in=None, features=False, last_only=False, first_row=None
    ) -> PassOutput:
        """One drafter pass of T tokens at cache.length: the fixed-shape runner where this run holds one and
        T fits it (mask [T, A] or None for causal, padded to the runner's span), else the eager pass.
        last_only: the logits of the last row alone are wanted; first_row: those of rows first_row .. T - 1
        (the eager pass projects only those; the fixed-shape runner's rows are cut to them)."""
        t = tokens.shape[0]
        on_host = self.model.device.type == "cpu"  # q stays on the drafter's device (the run's generator is there)
        if self.static is not None and t <= self.static.max_width:
            start, span = self.cache.length, self.static.capacity
            full = torch.zeros(t, span, dtype=torch.bool)
            if mask is None:
                full[:, :start] = True
                full[:, start : start + t] = torch.tril(torch.ones(t, t, dtype=torch.bool))
            else:
                full[:, : mask.shape[1]] = mask.cpu()
            out = self.static.run(
                tokens.tolist(), positions.tolist(), full, features=features, x_in=x_in, to_host=on_host
            )
            return out if first_row is None else PassOutput(out.logits[first_row:], out.hidden)
        first_row = t - 1 if last_only else first_row
        rows = torch.arange(first_row, t) if first_row is not None else None
        return self.model.run_pass(
            tokens, positions, self.cache, mask=mask, logits_rows=rows, x_in=x_in, features=features, to_host=on_host
        )

    def rewind(self, length: int) -> None:
        if self.cache is not None:
            self.cache.length = min(self.cache.length, length)

    def draft_q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return probs_from_logits(logits, params)  # [.., V] float32

    def take_target_kv(self) -> None:
        """With the target's cache (needs.target_kv): take the keys and values of the committed positions the
        drafter has not computed from it (the prompt at the first step; later the last draft of a pass whose
        drafts were all accepted, which the drafter drew but never fed), so that only the pending token is left
        to feed."""
        target = self.target_cache
        if target is None or target.length <= self.cache.length:
            return
        begin, end = self.cache.length, target.length
        self.cache.k[:, :, begin:end].copy_(target.k[:, :, begin:end])  # [L, Hkv, n, D]
        self.cache.v[:, :, begin:end].copy_(target.v[:, :, begin:end])
        self.cache.length = end

    def _catch_up(self, context: list[int]) -> tuple[torch.Tensor, int]:
        """Feed the committed tokens the drafter has not seen (the prompt at the first
        step, then the target's extra token and any unseen accepted ones; with the target's
        keys and values shared, the pending token alone). Returns the logits [V] for the
        token after the context and the position the first draft node's slot follows (len(context))."""
        self.take_target_kv()
        cache = self.cache
        base = cache.length
        new = context[base:]
        tokens = torch.tensor(new, dtype=torch.long)
        positions = torch.arange(base, base + len(new))
        logits = self.model_pass(tokens, positions, last_only=True).logits
        return logits[-1], cache.length

    def _expand(self, tree: DraftTree, frontier: list[int], positions: torch.Tensor, mask) -> torch.Tensor:
        """Feed the frontier nodes ([F] tokens at `positions`, tree `mask` or None for a
        chain) in one pass; returns their logits [F, V]."""
        feed = torch.tensor([tree.tokens[i] for i in frontier], dtype=torch.long)
        return self.model_pass(feed, positions, mask).logits

    def propose(self, context: DraftContext) -> DraftTree:
        if self.cache is None:
            raise RuntimeError(f"{type(self).__name__}.start must be called before propose")
        shape, params, gen = context.shape, context.params, context.gen
        if shape.topk == 1 and self.static is None and (params.greedy or temperature_only(params)):
            chain = self._chain(context)
            if chain is not None:
                return chain
        cache = self.cache
        root_logits, committed = self._catch_up(context.tokens)
        tree = DraftTree(stop="depth", facts={"model_passes": 1})  # the catch-up pass, then one per level expanded
        slot_of: dict[int, int] = {}  # node -> cache slot, for nodes fed to the drafter
        score: list[float] = []
        path_q: list[float] = []  # cumulative confidence along each node's path (q, or calibrated q)
        frontier: list[int] = [-1]
        # A greedy chain's choice: the argmax of the logits where they are the model's own over the vocabulary
        # (greedy q is their softmax, so the same token but where rounding ties two probabilities), else of q
        by_logits = self._token_passes()
        frontier_logits = {-1: root_logits}  # [V] each
        frontier_q = {-1: self.draft_q(root_logits, params)}
        for depth in range(1, shape.k + 1):
            level: list[int] = []
            for parent in frontier:
                q = frontier_q[parent]
                tree.q_dists[parent] = q
                if params.greedy and shape.topk == 1:  # token passes: the logits' argmax, as greedy_chain's
                    children = [argmax_index(frontier_logits[parent] if by_logits else q)]
                elif params.greedy:
                    children = torch.topk(q, shape.topk).indices.tolist()
                else:
                    children = sample_without_replacement(q, shape.topk, gen)
                parent_score = 1.0 if parent == -1 else score[parent]
                parent_q = 1.0 if parent == -1 else path_q[parent]
                for rank, token in enumerate(children):
                    q_tok = float(q[token])
                    tree.tokens.append(int(token))
                    tree.parents.append(parent)
                    tree.depths.append(depth)
                    tree.q_token.append(q_tok)
                    score.append(parent_score * (q_tok if params.greedy else _rank_weight(rank)))
                    path_q.append(parent_q * shape.confidence(q_tok))
                    level.append(len(tree) - 1)
            if depth == shape.k:
                break
            # Expand the `topk` best nodes of this level (EAGLE-2), a chain expands one.
            level.sort(key=lambda i: -score[i])
            frontier = level[: shape.topk]
            frontier.sort()
            # Adaptive depth: a whole level gets children or none does (never a choice among
            # siblings by their drawn values), so every sibling list stays a full draw from q.
            if max(path_q[i] for i in frontier) < shape.min_confidence:
                tree.stop = "confidence"
                break
            # Feed the frontier to the drafter in one pass with a tree mask.
            start = cache.length
            pos = torch.tensor([committed - 1 + tree.depths[i] for i in frontier], dtype=torch.long)
            for offset, node in enumerate(frontier):
                slot_of[node] = start + offset
            mask = None  # a chain sees everything before it: plain causal attention
            if shape.topk > 1:
                mask = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool)  # moved by forward
                mask[:, :committed] = True
                for row, node in enumerate(frontier):
                    for anc in tree.path_to(node):
                        mask[row, slot_of[anc]] = True
            out = self._expand(tree, frontier, pos, mask)
            tree.facts["model_passes"] += 1
            frontier_logits = {node: out[row] for row, node in enumerate(frontier)}
            frontier_q = {node: self.draft_q(out[row], params) for row, node in enumerate(frontier)}
        return self._kept(tree, score, shape, committed, slot_of)

    def _kept(self, tree: DraftTree, score: list[float], shape, committed: int, slot_of: dict) -> DraftTree:
        """The budget's best nodes of a proposed tree (ancestor-closed, since scores only shrink along a path
        and ties are broken by creation order: parents first), remembered for ``accept``."""
        keep = sorted(range(len(tree)), key=lambda i: (-score[i], i))[: shape.max_tokens]
        keep_set = set(keep)
        for node in list(keep):
            for anc in tree.path_to(node):
                keep_set.add(anc)
        kept = sorted(keep_set)
        self._last = (committed, kept, slot_of)
        return tree.subset(kept) if len(kept) < len(tree) else tree

    def _token_passes(self) -> bool:
        """Whether this drafter's passes are plain token passes (a token's embedding in, the model's own
        logits and q out): ModelDrafter's own _catch_up, _expand and draft_q. A subclass that feeds other rows
        (EAGLE's fused features) or reads its logits otherwise (EAGLE's reduced vocabulary) never runs
        greedy_chain, which knows only token passes."""
        cls = type(self)
        return all(
            getattr(cls, name) is getattr(ModelDrafter, name)
            for name in ("_catch_up", "_expand", "draft_q", "model_pass")
        )

    def _chain(self, context: DraftContext) -> DraftTree | None:
        """``propose`` for a chain (topk 1) with the drafter's passes in one C call (where a confidence
        threshold may stop the chain, each call runs the levels the loop is sure to reach,
        ``TreeShape.sure_levels``, so that no pass runs that the loop would not run), without the Python the loop
        spends around each draft pass (docs/bench/2026-12-07-notes-from-engine.md):

        - greedy (``chains.greedy_chain``): the tree, q and cache the loop makes, bit for bit (the same
          kernel calls in the same order, the same argmax of the same logits);
        - sampled with a temperature alone (no top-k, no top-p: ``chains.sampled_chain``): the same
          passes, each token drawn in C from q = softmax(logits / T) at a uniform from the run's generator
          (drawn here, one per pass, in the loop's order), and that q, returned by the call, is the tree's:
          the loop's distribution (its q is the same softmax, computed by torch, to float32 rounding), drawn
          the same way (the inverse CDF on float64 running sums), so with the same seed the loop's draws but
          where a uniform lands within rounding of a step of the CDF.

        None where this drafter's passes are not plain token passes all on our CPU kernels (the loop runs).

        The chain's nodes sit at consecutive slots: node j (depth j + 1) at committed + j, whether the pending
        token was fed alone (its keys and values before it shared from the target's cache) or the first
        step's prompt was."""
        model, cache, shape, params = self.model, self.cache, context.shape, context.params
        if not (self._token_passes() and chains.greedy_chain_ready(model, cache)):
            return None
        self.take_target_kv()
        committed = len(context.tokens)
        new = context.tokens[cache.length :]
        if not new:
            return None
        tree = DraftTree(stop="depth", facts={"model_passes": 0})
        qs: list[torch.Tensor] = []  # q [V] of each level's parent (the softmax of its logits)
        chosen: list[int] = []  # the token drafted from each of them (their logits' argmax, or a draw from q)
        if len(new) > 1:  # the first step's prompt (or unseen accepted tokens): one pass over them
            root, _ = self._catch_up(context.tokens)
            tree.facts["model_passes"] = 1
            qs.append(self.draft_q(root, params))
            if params.greedy:
                chosen.append(argmax_index(root))
            else:  # (the loop's draw: a softmax always has mass)
                chosen.append(sample_without_replacement(qs[0], 1, context.gen)[0])
        score: list[float] = []
        path_q = 1.0
        for depth in range(1, shape.k + 1):
            if len(qs) < depth:  # feed the last drafted token (the pending one first) and what follows
                n = shape.sure_levels(depth, path_q)  # passes the loop is sure to run (all K without a threshold)
                first = new[0] if depth == 1 else tree.tokens[-1]
                if params.greedy:
                    logits, tokens = chains.greedy_chain(model, first, cache, n)  # [n, V]
                    qs += list(self.draft_q(logits, params))  # (row by row the bits of one row's softmax)
                else:
                    u = torch.rand(n, generator=context.gen, dtype=torch.float64)  # [n], one per draw
                    _, q_rows, tokens = chains.sampled_chain(model, first, cache, n, params.temperature, u)  # [n, V]
                    qs += list(q_rows)
                tree.facts["model_passes"] += n
                chosen += tokens
            parent = len(tree) - 1  # -1: the root
            q = qs[depth - 1]
            tree.q_dists[parent] = q
            token = chosen[depth - 1]
            q_tok = float(q[token])
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.depths.append(depth)
            tree.q_token.append(q_tok)
            score.append((score[-1] if score else 1.0) * q_tok)
            path_q *= shape.confidence(q_tok)
            if depth == shape.k:
                break
            if path_q < shape.min_confidence:
                tree.stop = "confidence"
                break
        slot_of = {node: committed + node for node in range(cache.length - committed)}
        return self._kept(tree, score, shape, committed, slot_of)

    def hold_chain(self, committed: int, nodes: int) -> None:
        """What ``accept`` reads for a chain of `nodes` tokens this drafter drafted one call at a time (a hybrid's
        bridge): node j at slot committed + j, fed by the next call's pass (the last one never fed)."""
        self._last = (committed, list(range(nodes)), {j: committed + j for j in range(nodes - 1)})

    def accept(self, verified: Verified) -> None:
        committed, kept, slot_of = self._last
        cache = self.cache
        offsets = []
        for node in verified.path:
            original = kept[node]
            if original not in slot_of:
                break
            offsets.append(slot_of[original] - committed)
        cache.length = committed
        cache.keep(committed, offsets)

    def close(self) -> None:
        if self.static is not None:
            self.static.release()
            self.static = None
        self.cache = None
        self.target_cache = None


def temperature_only(params: SamplingParams) -> bool:
    """Sampling with a temperature and no other filter (top-k off, top-p 1): what a sampled chain in C draws."""
    return not params.greedy and params.top_k == 0 and params.top_p == 1.0


def int8_weights(target: Transformer) -> Transformer:
    """Quantised self-speculation: the target's weights in int8 (weight-only, per channel)."""
    from engine.model.loading import _state_from_transformer
    from engine.model.weights import check_int8_device

    # On the CPU the drafter computes in float32 around fbgemm's int8 matmul
    # (elementwise bf16 ops are slow without native bf16, and the int8 kernel
    # takes float32 activations); elsewhere it keeps the target's dtype. The
    # drafter's precision does not affect exactness: q can be anything.
    act_dtype = torch.float32 if target.device.type == "cpu" else target.dtype
    # Refuse up front (ValueError naming the device) where torch has no int8 matmul for these
    # weights, probed on the target's device, before the state is copied and quantised.
    check_int8_device(target.device, act_dtype)
    return Transformer(target.cfg, _state_from_transformer(target), act_dtype, int8=True, device=target.device)


def q4_weights(target: Transformer, gguf_path=None) -> Transformer:
    """4-bit self-speculation: the target's weights in 4-bit blocks on our CPU kernels, the output projection
    included, in Q4_1B (PackedQ4_1BWeight: Q4_1's nibbles with the scales in a byte each, 0.5625 bytes per
    weight against GGUF's Q4_1's 0.625, so a draft pass reads fewer bytes at the same drafts). gguf_path: the
    file the target was loaded from, whose own Q4_1 blocks are used (the default model: its bf16 weights are
    those blocks dequantised, so the drafter computes nearly the target's function); without one, every matrix
    is quantised here by Q4_1B's rule.

    The output projection (tied to the embedding) is in Q4_1B with each row's best outputs computed again in
    int8 (RescoredQ4Linear): fewer bytes per pass than an int8 head. In 4-bit blocks alone acceptance falls (the
    head's rows are not the layers' blocks); re-scoring the few tokens that matter gives int8's drafts. Figures:
    docs/kernels.md and docs/bench/2026-12-07-notes-from-engine.md.
    The drafter's precision does not affect exactness: q can be anything; it only moves acceptance. Its KV
    cache is bf16."""
    from engine.kernels import cpu_build
    from engine.kernels.cpu_packed import PackedQ4_1BWeight
    from engine.model.loading import _state_from_transformer
    from engine.model.weights import RescoredQ4Linear, quantize_q4_1, use_gguf_q4_1

    if target.device.type != "cpu" or not cpu_build.available():
        why = "it runs on the CPU only" if target.device.type != "cpu" else cpu_build.why_unavailable()
        raise ValueError(f"the q4 drafter needs SpecLens's CPU kernels ({why}); use int8 or a draft model")
    state = _state_from_transformer(target)
    model = Transformer(target.cfg, state, torch.bfloat16, device=target.device)
    swapped = use_gguf_q4_1(model, gguf_path, PackedQ4_1BWeight) if gguf_path is not None else 0
    if swapped < 4 * len(model.layers):  # matrices the file does not hold as Q4_1 (or no file)
        quantize_q4_1(model, PackedQ4_1BWeight)
    model.lm_head = RescoredQ4Linear(target.lm_head.weight, RescoredQ4Linear.TOP, PackedQ4_1BWeight)
    # Its KV cache in bf16 (the kernels widen the rows exactly as they read them; keys and values rounded
    # once, as they are stored or taken from the target's cache): half the bytes a draft pass's attention
    # reads (measured: docs/bench/2026-12-07-notes-from-engine.md).
    model.attention_dtype = torch.bfloat16
    return model


# ------------------------------------------------------------------------------------------- the families
def _build(spec, registry, history) -> ModelDrafter:
    return ModelDrafter(registry.weights(spec), spec.text, share_target_kv=family(spec.family).target_kv)


def _int8(spec, registry) -> Transformer:
    return int8_weights(registry.target.model)


def _q4(spec, registry) -> Transformer:
    source = registry.target.source
    return q4_weights(registry.target.model, source.get("file") if source.get("kind") == "gguf-package" else None)


def _draft_model(spec, registry) -> Transformer:
    from engine.model.loading import check_same_vocab, load_model

    target = registry.target
    loaded = load_model(
        spec.model_id, target.dtype, device=str(target.model.device), allow_remote_code=registry.allow_remote_code
    )
    check_same_vocab(target.tokenizer, loaded.tokenizer)
    return loaded.model


def _int8_memory(spec, sizes: MemorySizes) -> DrafterMemory:
    d = sizes.dims
    matrices = d["params"] - d["embed_params"]  # every matrix of the layers (and an untied head)
    scales = d["layers"] * 8 * d["hidden"] + d["vocab"]  # float32 per output channel, roughly
    act = 4 if sizes.device == "cpu" else sizes.weight_bytes  # the int8 drafter computes in float32 on the CPU
    return DrafterMemory(
        matrices + 4 * scales + d["embed_params"] * act,
        sizes.kv_per_token * sizes.context * sizes.runs,  # same layers, its own cache
        "int8 drafter: an estimate (matrices in int8, per-channel scales, embedding unquantised)",
        d,
    )


def _q4_memory(spec, sizes: MemorySizes) -> DrafterMemory:
    d = sizes.dims
    matrices = d["params"] - d["embed_params"]
    # Q4_1B: 18 bytes per 32 weights, a float32 step per row; the head in Q4_1B and in int8 with a scale per row
    # (its best outputs re-scored); the embedding kept in bf16 (q4_weights)
    weights = (matrices + d["embed_params"]) * 18 // 32 + d["embed_params"] * (1 + 2) + 8 * d["vocab"]
    kv = sizes.kv_per_token // sizes.attention_bytes * 2 * sizes.context * sizes.runs  # its own bf16 cache
    note = "q4 drafter: an estimate (Q4_1B layers and head, the head in int8 too, bf16 embedding)"
    return DrafterMemory(weights, kv, note, d)


def _model_memory(spec, sizes: MemorySizes) -> DrafterMemory:
    d = sizes.dims_of(spec.model_id)
    kv = 2 * d["layers"] * d["kv_heads"] * d["head_dim"] * sizes.attention_bytes * sizes.context * sizes.runs
    return DrafterMemory(d["params"] * sizes.weight_bytes, kv, "", d)


def _parse_model(text: str) -> DrafterSpec:
    model_id = text.partition(":")[2].strip()
    if not model_id:
        raise ValueError("model drafter needs an id: model:<hub id, preset or folder>")
    return DrafterSpec(f"model:{model_id}", "model", model_id=model_id)


INT8 = register(
    Family(
        "int8",
        label="int8 (quantised target)",
        help="the target itself with int8 weights: a near copy that runs the whole network per guess",
        form="int8",
        build=_build,
        order=30,
        weights=_int8,
        memory=_int8_memory,
        copy_of_target=True,
        serving=Serving(
            "quantised_copy",
            bits=8,
            gguf_type="Q8_0",
            note="the draft model is the target itself quantised to 8 bits, as SpecLens's int8 is (its own rule: int8"
            " per output channel, the rows of x in int16); acceptance and speed differ",
        ),
        about=(
            "**int8 self-drafting** runs the target itself with its weights quantised to int8, with its own KV "
            "cache: the same network, so it agrees with the target often (high α) on any text, but each draft token "
            "is a whole forward pass through every layer, one after another, so c is a large share of a target pass "
            "and K drafts eat much of what the accepted ones save."
        ),
    )
)
Q4 = register(
    Family(
        "q4",
        label="q4 (the target's own 4-bit weights)",
        help="the target's own layers in 4 bits, reading the target's cache: a fraction of a pass per guess",
        form="q4",
        build=_build,
        target_kv=True,
        order=40,
        weights=_q4,
        memory=_q4_memory,
        copy_of_target=True,
        serving=Serving(
            "quantised_copy",
            bits=4,
            gguf_type="Q4_1",
            own_gguf=True,
            note="the draft model is the target itself quantised to 4 bits, as a model of its own: {engine} runs it"
            " with its own KV cache and prefill, where SpecLens's q4 reads the target's keys and values for the"
            " tokens already committed and computes its head's best outputs again in int8; acceptance and speed"
            " differ",
        ),
        about=(
            "**q4 self-drafting** is int8's idea in fewer bytes: the target's own layers in 4 bits (the GGUF file's "
            "Q4_1 nibbles, their scales in a byte each; the output projection too, its best few tokens re-scored in "
            "int8), reading the committed tokens' keys and values from the target's cache. A forward pass reads a "
            "little over a quarter of the target's bytes, and decoding on a CPU is paced by the bytes read, so a "
            "draft token costs that share of a target pass or somewhat more (c, measured below: the work outside "
            "the matrices adds to it) while the target still agrees with most drafts."
        ),
    )
)
MODEL = register(
    Family(
        "model",
        label="model:<id> (a separate small model)",
        help="a separate small model of the same vocabulary (type any Hub id after model:)",
        form="model:<id>",
        build=_build,
        order=80,
        menu=(("model:SmolLM2-135M-Instruct", "model:SmolLM2-135M-Instruct"),),
        weights=_draft_model,
        memory=_model_memory,
        parse=_parse_model,
        serving=Serving("draft_model"),
    )
)
