"""The EAGLE-style drafter: a one-layer head that reads the target's own features.

A drafter model guesses badly when it is small and costs almost a target pass when it is not. EAGLE's way out: the
target already computed, in the pass that just verified the last draft, a last-layer hidden state h_t for every
committed position; h_t holds almost everything the target knows about the next token. A head that reads h_t can be
tiny and still guess well.

The head (our own design in the EAGLE-1/3 line, trained by ``engine.training.train_head``):

    pair j      = (h_j, x_{j+1})                 target feature at j, next token
    fused_j     = W_fuse · [RMSNorm(h_j) ; embed(x_{j+1})]      [2E] -> [E]
    y_j         = one decoder layer of the target's shape over fused_0..j (causal, its own KV cache)
    q(x_{j+2})  = softmax(lm_head_r · RMSNorm_target(y_j))       over the reduced vocabulary

y_j is trained to equal h_{j+1} (feature regression) and q to match the target's p (cross-entropy), so drafting
deeper feeds the head its own y as the next feature: depth d pairs (y of the parent node, the parent's drafted
token).

A head may read a mix of target layers instead of the last alone (EAGLE-3's fused features; ``train-head
--feature-layers 1,14,29``, head format 2): the last layer's rows are tuned to predict the next token, earlier
layers keep more of what comes after it. Then h_j = fc · [RMSNorm(l_j) for each layer l read] ([layers E] -> [E]),
computed once when the rows are handed over; the target pass returns those layers' outputs side by side
(``Transformer.run_pass(feature_layers=...)``: the layer stack split after each, the same bits).

- Embedding, final norm and lm_head rows are the target's, frozen and not shipped; the head file holds the fusion,
  the feature norm, the decoder layer (~4 M parameters for SmolLM2-135M; ~5 M with the layer-mixing fc) and the
  reduced vocabulary: the N most frequent tokens of the training data. q is 0 outside it, which exact verification
  handles like any other q (a token q cannot draft is still produced by the target through the residual).
- q gets the run's own temperature / top-k / top-p on the full vocabulary (logits of the tokens outside the reduced
  set are -inf): the same filters as p.
- The head's KV cache holds only pairs with real target features. Speculative slots (pairs with the head's own y)
  are dropped after each verification and the accepted tokens are fed again with the target's real features, which
  the decode loop hands over (``Verified.features``) from the pass it just ran.

Cost: one decoder layer of 30 plus an lm_head of N of V rows: for SmolLM2-135M with N = 8192 about 7% of a target
pass's weight bytes per draft token.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import paths
from engine.drafters.base import DraftContext, DrafterNeeds, DraftTree, Verified
from engine.drafters.model import ModelDrafter
from engine.drafters.spec import Family, Serving, register
from engine.model.transformer import Transformer, check_feature_layers
from engine.model.weights import Linear
from engine.sampling import SamplingParams, probs_from_logits

__all__ = ["FAMILY", "HEADS_DIR", "EagleDrafter", "EagleHead", "head_dir", "head_state_names", "load_head"]

HEADS_DIR = paths.HEADS
HEAD_FILE = "eagle-head.safetensors"
# 1: reads the target's last layer; 2: reads a mix of layers (meta "feature_layers", weight "fc.weight").
FORMAT = 2
FORMATS = (1, 2)


def head_dir(target_name: str) -> Path:
    """Where the head trained for `target_name` lives (a folder per target)."""
    return HEADS_DIR / target_name.replace("/", "--")


def head_state_names(mixes_layers: bool = False) -> list[str]:
    """The tensors a head file holds besides `vocab_ids` (names of a one-layer transformers
    checkpoint), with the layer-mixing fc where the head reads several target layers."""
    layer = "model.layers.0."
    return (["fc.weight"] if mixes_layers else []) + [
        "fuse.weight",  # [E, 2E]
        "feature_norm.weight",  # [E]
        layer + "input_layernorm.weight",
        layer + "self_attn.q_proj.weight",
        layer + "self_attn.k_proj.weight",
        layer + "self_attn.v_proj.weight",
        layer + "self_attn.o_proj.weight",
        layer + "post_attention_layernorm.weight",
        layer + "mlp.gate_proj.weight",
        layer + "mlp.up_proj.weight",
        layer + "mlp.down_proj.weight",
    ]


class EagleHead:
    """The head's weights around the target's frozen embedding, norm and lm_head rows (read-only, shared)."""

    def __init__(self, target: Transformer, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor, meta: dict):
        cfg = target.cfg
        self.meta = meta
        # [N] target ids of the reduced vocabulary, on the target's device
        self.vocab_ids = vocab_ids.to(device=target.device, dtype=torch.long)
        dtype = target.dtype
        head_rows = target.lm_head.weight[self.vocab_ids]  # [N, E]
        layer_state = {k: v for k, v in state.items() if k.startswith("model.layers.0.")}
        layer_state["model.embed_tokens.weight"] = target.embed  # shared, not copied
        layer_state["model.norm.weight"] = target.norm  # the target's final norm
        layer_state["lm_head.weight"] = head_rows
        head_cfg = replace(cfg, num_layers=1, vocab_size=len(self.vocab_ids), tie_word_embeddings=False)
        self.model = Transformer(head_cfg, layer_state, dtype, device=target.device)
        self.fuse = Linear(state["fuse.weight"].to(device=target.device, dtype=dtype))  # [E, 2E]
        self.feature_norm = state["feature_norm.weight"].to(device=target.device, dtype=self.model.act_dtype)
        # The target layers it reads (None: the last alone) and the fc that mixes them, [E, layers E].
        layers = meta.get("feature_layers")
        self.feature_layers = tuple(int(i) for i in layers.split(",")) if layers else None
        self.fc = Linear(state["fc.weight"].to(device=target.device, dtype=dtype)) if self.feature_layers else None
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size

    @property
    def parameters(self) -> int:
        """Trained parameters shipped in the head file."""
        layer = self.model.layers[0]
        mats = (self.fuse, layer.qkv, layer.o, layer.gate_up, layer.down) + ((self.fc,) if self.fc else ())
        return sum(m.weight.numel() for m in mats) + 3 * self.feature_norm.numel()

    def target_input(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, layers E] target rows (forward's feature_layers mix) -> [T, E]: each layer's row
        RMS-normalised, then mixed by the fc; the last layer's rows pass as they are."""
        if self.fc is None:
            return rows
        act = self.model.act_dtype
        E = self.feature_norm.shape[0]
        blocks = F.rms_norm(rows.to(act).unflatten(-1, (-1, E)), (E,), None, self.eps)  # [T, layers, E]
        return self.fc(blocks.flatten(-2)).to(act)

    def fused(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[T, E] features (target rows or the head's own y) + [T] next tokens -> [T, E] layer input."""
        act = self.model.act_dtype
        normed = F.rms_norm(features.to(act), self.feature_norm.shape, self.feature_norm, self.eps)
        pair = torch.cat([normed, self.model.embed[tokens].to(act)], dim=-1)  # [T, 2E]
        return self.fuse(pair).to(act)

    def full_logits(self, reduced: torch.Tensor) -> torch.Tensor:
        """[.., N] reduced-vocabulary logits -> [.., V] with -inf outside the reduced set."""
        out = torch.full((*reduced.shape[:-1], self.vocab_size), float("-inf"), device=reduced.device)
        out[..., self.vocab_ids] = reduced.float()
        return out


def load_head(target: Transformer, target_name: str, folder: Path | None = None) -> EagleHead:
    """The head trained for this target, or ValueError saying that none exists and how to train one."""
    from safetensors import safe_open

    folder = Path(folder) if folder is not None else head_dir(target_name)
    path = folder / HEAD_FILE
    if not path.is_file():
        raise ValueError(
            f"no EAGLE head has been trained for {target_name!r} (looked for {path}). Train one with "
            f"`python -m engine train-head --target {target_name}` (about an hour on 2 CPU cores), "
            "or pick another drafter (ngram, int8)."
        )
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        state = {name: f.get_tensor(name) for name in f.keys()}
    fmt = int(meta.get("format", 0)) if str(meta.get("format", "")).isdigit() else 0
    if fmt not in FORMATS:
        raise ValueError(f"{path} has head format {meta.get('format')!r}; this SpeculativeEngine reads {FORMATS}")
    layers = meta.get("feature_layers") if fmt >= 2 else None
    if layers:
        try:
            check_feature_layers(layers.split(","), target.cfg.num_layers)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    else:
        meta.pop("feature_layers", None)
    if int(meta.get("hidden_size", -1)) != target.cfg.hidden_size or meta.get("target") != target_name:
        raise ValueError(
            f"{path} was trained for {meta.get('target')!r} (hidden size {meta.get('hidden_size')}), "
            f"not for {target_name!r} (hidden size {target.cfg.hidden_size}); train a head for this target"
        )
    missing = [n for n in head_state_names(bool(layers)) + ["vocab_ids"] if n not in state]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    meta = {k: (json.loads(v) if k == "training" else v) for k, v in meta.items()}
    return EagleHead(target, state, state.pop("vocab_ids"), meta)


class EagleDrafter(ModelDrafter):
    """Drafts with an EagleHead from the target's features (handed over by the decode loop)."""

    def __init__(self, head: EagleHead, name: str = "eagle"):
        super().__init__(head.model, name)
        self.head = head
        self.needs = DrafterNeeds(target_features=True, feature_layers=head.feature_layers, model=head.model)
        self.features: torch.Tensor | None = None  # [capacity, E] target rows by position
        self.known = 0  # positions 0 .. known-1 have target features
        self._y: dict[int, torch.Tensor] = {}  # node (-1 = root) -> head output y [E] it was drawn from

    def start(self, prompt_ids, capacity, runner=None, features=None, target_cache=None) -> None:
        super().start(prompt_ids, capacity, runner)
        if self.features is None or self.features.shape[0] < capacity:
            size = (capacity, self.head.model.cfg.hidden_size)
            self.features = torch.zeros(size, dtype=self.head.model.act_dtype, device=self.head.model.device)
        self.known = 0
        if features is not None:
            self._take_features(features, 0)

    def rewind(self, length: int) -> None:
        super().rewind(length)
        self.known = min(self.known, length)

    def _take_features(self, hidden: torch.Tensor, first_position: int) -> None:
        """hidden: [m, E] pre-norm target rows of committed positions first_position .. + m - 1 ([m, layers E]
        with feature_layers)."""
        if first_position > self.known:
            raise RuntimeError(f"feature gap: have {self.known} positions, got rows from {first_position}")
        end = first_position + hidden.shape[0]
        self.features[first_position:end] = self.head.target_input(hidden).to(self.features.dtype)
        self.known = end
        # Pairs the head computed from positions now overwritten must be fed again.
        self.cache.length = min(self.cache.length, first_position)

    def draft_q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return probs_from_logits(self.head.full_logits(logits), params)  # [V] float32, 0 outside the reduced set

    def _catch_up(self, context: list[int]) -> tuple[torch.Tensor, int]:
        # Pairs (h_j, x_{j+1}) for j = cache.length .. len(context) - 2: every position
        # whose target feature is known; the last one's output y predicts h of the
        # pending token, and q for the first draft.
        cache = self.cache
        stop = len(context) - 1
        # At least the last pair is fed: its output y is the root's (after a rewind to the
        # prompt every pair may already be in the cache; recomputing one is exact).
        start = cache.length = min(cache.length, stop - 1)
        if stop > self.known:
            raise RuntimeError(f"the eagle head needs target features up to {stop}, has {self.known}")
        tokens = torch.tensor(context[start + 1 : stop + 1], dtype=torch.long)
        x_in = self.head.fused(self.features[start:stop], tokens)
        out = self.model_pass(tokens, torch.arange(start, stop), x_in=x_in, features=True, last_only=True)
        self._y = {-1: out.hidden[-1]}
        return out.logits[-1], cache.length

    def _expand(self, tree: DraftTree, frontier: list[int], positions: torch.Tensor, mask) -> torch.Tensor:
        tokens = torch.tensor([tree.tokens[i] for i in frontier], dtype=torch.long)
        parents_y = torch.stack([self._y[tree.parents[i]] for i in frontier])  # [F, E]
        out = self.model_pass(tokens, positions, mask, x_in=self.head.fused(parents_y, tokens), features=True)
        for row, node in enumerate(frontier):
            self._y[node] = out.hidden[row]
        return out.logits

    def propose(self, context: DraftContext) -> DraftTree:
        if len(context.tokens) < 2 or self.known < len(context.tokens) - 1:
            self._last = None
            return DraftTree()  # no target feature yet (a one-token prompt): the first pass drafts nothing
        return super().propose(context)

    def accept(self, verified: Verified) -> None:
        # Drop every speculative slot: the accepted tokens come back as pairs with the
        # target's real features at the next catch-up.
        if self.cache is not None and self._last is not None:
            self.cache.length = self._last[0]
        if verified.features is not None:
            self._take_features(verified.features, verified.first_position)

    def skipped(self, verified: Verified) -> None:
        # A plain pass: nothing speculative to drop, the pending token's target features to keep.
        if verified.features is not None:
            self._take_features(verified.features, verified.first_position)

    def close(self) -> None:
        super().close()
        self.features = None
        self._y = {}


FAMILY = register(
    Family(
        "eagle",
        label="eagle (a one-layer head on the target's own features)",
        help="a small trained head that reads the target's own hidden states from the pass that just verified",
        form="eagle",
        build=lambda spec, registry, history: EagleDrafter(registry.eagle_head()),
        kind="head",
        serving=Serving(
            "eagle",
            note="SpecLens's head is its own format: {engine} needs an EAGLE-3 checkpoint trained for this target "
            "(SpecForge trains one); put its path where the command says",
        ),
        unserved="this engine has no EAGLE-style head",
        order=70,
        about=(
            "**EAGLE head** is a tiny network trained on the target: it reads the target's own hidden states (a "
            "low, a middle and the last layer's) from the verification pass that just ran plus the embedding of the "
            "next token, runs one decoder layer and predicts over a reduced vocabulary. It reuses the work the "
            "target already did, which is why a draft token costs a small fraction of a target pass (its c, "
            "measured below), and why it guesses new text that n-gram cannot."
        ),
    )
)
