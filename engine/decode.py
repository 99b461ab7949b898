"""The decode loop: a generator of plain, JSON-serialisable events.

One loop serves the baseline and every drafter. The target's KV cache holds all
committed tokens but the last one, the *pending* token. Each step feeds the
pending token plus the draft tree in one target pass (a tree mask lets every node
see the prefix and its own ancestors only), walks the tree with exact
verification, keeps the accepted path in the cache and emits the accepted tokens
plus one more: a *resampled* token after a rejection or a *bonus* token when the
walk ran off the end of the tree. With no drafter the tree is empty and each pass
emits exactly one (bonus) token: that is the plain autoregressive baseline, same
model, same cache code, same events.

Stopping: EOS, max_new_tokens, or the caller closing the generator.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import asdict, dataclass

import torch

from .drafters import Drafter, DraftTree, ModelDrafter, NgramDrafter, NoDrafter, TreeShape, int8_weights
from .metrics import summarize_steps
from .models import LoadedModel, check_same_vocab, load_model
from .sampling import SamplingParams, probs_from_logits, sample, verify_children
from .transformer import Transformer

__all__ = ["GenerationSettings", "OutOfMemory", "SpeculativeEngine", "TOP_N"]

TOP_N = 10  # entries of p and q kept per position in full payloads
EVENT_VERSION = 1


class OutOfMemory(RuntimeError):
    """The accelerator ran out of memory; the message suggests smaller settings."""


@dataclass
class GenerationSettings:
    """Everything a run depends on. Validated by ``validate``; bad values raise ValueError."""

    max_new_tokens: int = 64
    k: int = 4  # draft depth (SGLang's --steps); a chain drafts K tokens
    topk: int = 1  # branching per node; 1 = chain
    num_draft_tokens: int | None = None  # tree budget; None = K * topk
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    chat: bool = True
    payload: str = "full"  # "full" (top-k of p and q, token texts), "reduced", or "off" (start and finish only)
    strict: bool = False  # shape-invariant target passes: bitwise greedy parity in any dtype
    max_prompt_tokens: int | None = None

    def validate(self) -> tuple[SamplingParams, TreeShape]:
        params = SamplingParams(self.temperature, self.top_k, self.top_p)
        for name in ("max_new_tokens", "k", "topk", "num_draft_tokens", "seed"):
            value = getattr(self, name)
            if value is None and name in ("num_draft_tokens", "seed"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    setattr(self, name, int(value))
                else:
                    raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.max_new_tokens <= 4096:
            raise ValueError(f"max_new_tokens must be between 1 and 4096, got {self.max_new_tokens}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
                raise ValueError(f"seed must be an integer between 0 and 2**63 - 1, got {self.seed!r}")
        if self.payload not in ("full", "reduced", "off"):
            raise ValueError(f"payload must be 'full', 'reduced' or 'off', got {self.payload!r}")
        shape = TreeShape(self.k, self.topk, self.num_draft_tokens)
        return params, shape


class SpeculativeEngine:
    """A loaded target plus the drafters built for it (loaded once, shared read-only).

    >>> engine = SpeculativeEngine.load()                      # offline default
    >>> for event in engine.generate("Hi!", drafter="ngram"):  # a generator of dicts
    ...     pass
    """

    def __init__(self, target: LoadedModel):
        self.target = target
        self.tokenizer = target.tokenizer
        self._drafter_models: dict[str, Transformer] = {}
        self._drafter_lock = threading.Lock()
        self.allow_remote_code = False
        self._token_text: dict[int, str] = {}
        self.eos_ids = target.eos_token_ids
        # Special tokens (chat template markers) never start or continue an n-gram draft.
        self.special_ids = {int(i) for i in getattr(self.tokenizer, "all_special_ids", [])} | set(self.eos_ids)
        # How sampled chains are verified: "auto" = one batched call (engine.kernels.verify_batch:
        # the Triton kernel, on the GPU) when the target runs on CUDA, else the tree walk of
        # sampling.verify_children; "batch" or "walk" force one. Both are exact; they draw their
        # uniforms in a different order, so one seed gives different (equally exact) samples.
        self.chain_verifier = "auto"

    @classmethod
    def load(
        cls,
        target: str = "default",
        dtype: str = "auto",
        progress=None,
        device: str = "auto",
        allow_remote_code: bool = False,
    ) -> SpeculativeEngine:
        engine = cls(load_model(target, dtype, progress, allow_remote_code=allow_remote_code, device=device))
        engine.allow_remote_code = allow_remote_code
        return engine

    # ----------------------------------------------------------------- drafters
    def drafter(self, spec: str) -> Drafter:
        """A fresh drafter for one run: none, ngram[:MAX[,MIN[,WINDOW]]], int8 or model:<id>.

        Model weights (the int8 copy, a draft model) are built once per engine and
        shared read-only; the per-run state (the drafter's KV cache) is new for every
        call, so concurrent runs never share it.
        """
        if not isinstance(spec, str):
            raise ValueError(f"drafter must be a string, got {spec!r}")
        spec = spec.strip()
        if spec in ("none", "", "baseline"):
            return NoDrafter()
        if spec == "ngram" or spec.startswith("ngram:"):
            parts: list[int] = []
            if spec.startswith("ngram:"):
                try:
                    parts = [int(x) for x in spec.split(":", 1)[1].split(",")]
                except ValueError:
                    raise ValueError(f"ngram drafter takes ngram:MAX[,MIN[,WINDOW]], got {spec!r}") from None
                if len(parts) == 1:  # ngram:1 means single-token matches only
                    parts.append(min(2, parts[0]))
            return NgramDrafter(*parts, stop_ids=self.special_ids)
        return ModelDrafter(self._drafter_weights(spec), spec)

    def _drafter_weights(self, spec: str):
        with self._drafter_lock:
            model = self._drafter_models.get(spec)
            if model is not None:
                return model
            if spec == "int8":
                model = int8_weights(self.target.model)
            elif spec.startswith("model:"):
                model_id = spec.split(":", 1)[1].strip()
                if not model_id:
                    raise ValueError("model drafter needs an id: model:<hub id, preset or folder>")
                loaded = load_model(
                    model_id,
                    self.target.dtype,
                    device=str(self.target.model.device),
                    allow_remote_code=self.allow_remote_code,
                )
                check_same_vocab(self.tokenizer, loaded.tokenizer)
                model = loaded.model
            else:
                raise ValueError(f"unknown drafter {spec!r}; choose none, ngram, int8 or model:<id>")
            self._drafter_models[spec] = model
            return model

    # ------------------------------------------------------------------ helpers
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("prompt is empty: type something for the model to continue")
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(prompt)["input_ids"]
        return [int(i) for i in ids]

    def _top(self, probs: torch.Tensor) -> list[list]:
        values, ids = torch.topk(probs, min(TOP_N, probs.shape[-1]))
        return [[int(i), self.token_text(int(i)), round(float(v), 6)] for v, i in zip(values, ids) if v > 0]

    # --------------------------------------------------------------- the loop
    def generate(
        self, prompt: str | list[int], drafter: str = "none", settings: GenerationSettings | None = None, **kw
    ):
        """Yield start, step... and finish events for one generation.

        prompt: text (the chat template is applied when settings.chat) or token ids.
        drafter: none | ngram | int8 | model:<id>. Keyword arguments override settings.
        Validation happens before the first event, so bad input raises ValueError
        at the first next() call without touching any model state.
        """
        settings = settings or GenerationSettings()
        if kw:
            settings = GenerationSettings(**{**asdict(settings), **kw})
        params, shape = settings.validate()
        drafter_obj = self.drafter(drafter)
        if isinstance(prompt, str):
            prompt_ids = self.encode_prompt(prompt, settings.chat)
        else:
            prompt_ids = [int(t) for t in prompt]
            if not prompt_ids:
                raise ValueError("prompt is empty")
            vocab = self.target.model.cfg.vocab_size
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
        window = self.target.context_window
        limit = min(window, settings.max_prompt_tokens or window)
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens; the limit is {limit - 1} (context window {window}). Shorten it."
            )
        baseline = isinstance(drafter_obj, NoDrafter)
        max_new = min(settings.max_new_tokens, window - len(prompt_ids))
        width = shape.max_tokens + 1  # tokens per target pass at most (pending + drafts)
        capacity = len(prompt_ids) + max_new + width + 1
        seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**31)
        return self._run(
            prompt_ids, drafter_obj, settings, params, shape, baseline, max_new, width, capacity, seed, prompt
        )

    def _run(self, prompt_ids, drafter, settings, params, shape, baseline, max_new, width, capacity, seed, prompt):
        model = self.target.model
        full = settings.payload == "full"
        events = settings.payload != "off"  # "off": no step events, no per-node records (the benchmark's floor)
        gen = torch.Generator().manual_seed(seed)
        cache = model.new_cache(capacity + (width if settings.strict else 0))
        if isinstance(drafter, ModelDrafter):
            drafter.ensure_capacity(capacity + shape.max_tokens + 2)
        drafter.reset(prompt_ids)
        started = time.perf_counter()
        yield {
            "type": "start",
            "version": EVENT_VERSION,
            "mode": "baseline" if baseline else "speculative",
            "target": self.target.name,
            "drafter": drafter.name,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device),
            "settings": {**asdict(settings), "seed": seed, "k": shape.steps, "num_draft_tokens": shape.max_tokens},
            "sampling": params.as_dict(),
            "greedy": params.greedy,
            "tree": {"steps": shape.steps, "topk": shape.topk, "budget": shape.max_tokens},
            "prompt": prompt if isinstance(prompt, str) else None,
            "prompt_ids": list(prompt_ids),
            "prompt_tokens": len(prompt_ids),
            "prompt_tail": [self.token_text(t) for t in prompt_ids[-8:]],
            "run_id": uuid.uuid4().hex,
            "eos_ids": sorted(self.eos_ids),
            "max_new_tokens": max_new,
            "started_at": time.time(),
        }
        # Prefill everything but the last prompt token, which becomes the pending token.
        t0 = time.perf_counter()
        if len(prompt_ids) > 1:
            model.prefill(prompt_ids[:-1], cache)
        prefill_s = time.perf_counter() - t0
        context = list(prompt_ids)
        generated: list[int] = []
        steps: list[dict] = []
        stop_reason = "max_new_tokens"
        try:
            while len(generated) < max_new:
                try:
                    step = self._step(context, drafter, shape, params, gen, cache, settings, width, full, events=events)
                except torch.OutOfMemoryError as exc:
                    raise OutOfMemory(
                        f"out of memory verifying {width - 1} draft tokens; try a smaller K, topk or tree budget"
                    ) from exc
                step["step"] = len(steps) + 1
                # Truncate at EOS or at the token limit (exactness of the kept prefix is unaffected).
                kept = []
                for item in step["emitted"]:
                    kept.append(item)
                    if item["token_id"] in self.eos_ids:
                        stop_reason = "eos"
                        break
                    if len(generated) + len(kept) >= max_new:
                        break
                if len(kept) < len(step["emitted"]):
                    # Accepted drafts past EOS or the limit are verified but not emitted.
                    for item in step["emitted"][len(kept) :]:
                        if item.get("node") is not None and step["nodes"]:
                            step["nodes"][item["node"]]["dropped"] = True
                    step["emitted"] = kept
                    step["truncated"] = True
                new_ids = [item["token_id"] for item in kept]
                generated.extend(new_ids)
                context.extend(new_ids)
                step["target_passes"] = len(steps) + 1
                step["tokens_total"] = len(generated)
                step["elapsed_s"] = time.perf_counter() - started
                steps.append(step)
                if events:
                    yield step
                if stop_reason == "eos":
                    break
            wall = time.perf_counter() - started
            metrics = summarize_steps(steps, shape.steps if not baseline else 0, wall, prefill_s)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            yield {
                "type": "finish",
                "stop_reason": stop_reason,
                "text": text,
                "token_ids": generated,
                "metrics": metrics,
            }
        finally:
            drafter.close() if isinstance(drafter, ModelDrafter) else None

    def _step(
        self, context, drafter: Drafter, shape, params, gen, cache, settings, width, full, drop_q=False, events=True
    ) -> dict:
        model = self.target.model
        t0 = time.perf_counter()
        tree = drafter.propose(context, shape, params, gen)
        draft_ms = (time.perf_counter() - t0) * 1000.0
        t1 = time.perf_counter()
        base = cache.length  # == len(context) - 1
        n = len(tree)
        tokens = [context[-1]] + tree.tokens
        positions = [base] + [base + d for d in tree.depths]
        mask = None
        attend_len = None
        # A chain's tree mask is plain causal attention: leave it to the model
        # (which then runs its fast causal path).
        chain = all(parent == i - 1 for i, parent in enumerate(tree.parents))
        if (n and not chain) or settings.strict:
            rows = width if settings.strict else 1 + n
            attend_len = cache.capacity if settings.strict else base + 1 + n
            mask = torch.zeros(rows, attend_len, dtype=torch.bool)
            mask[: 1 + n, : base + 1] = True
            for i in range(n):
                for anc in tree.path_to(i):
                    mask[1 + i, base + 1 + anc] = True
            if settings.strict:
                mask[1 + n :, 0] = True  # padding rows: look at one slot, never used
                tokens = tokens + [0] * (rows - 1 - n)
                positions = positions + [base] * (rows - 1 - n)
        batched = self._use_batched_chain(tree, params, drop_q, model)
        logits = model.forward(
            torch.tensor(tokens), torch.tensor(positions), cache, mask=mask, attend_len=attend_len, to_host=not batched
        )[: 1 + n]  # [1 + n, V]: row 0 = the pending token, row 1 + i = node i
        if batched:
            decisions, records, emitted, dists, path, p_rows = self._verify_chain_batched(
                logits, tree, params, gen, full
            )
        else:
            decisions, records, emitted, dists, path, p_rows = self._walk_tree(logits, tree, params, gen, full, drop_q)
        # Keep the pending token and the accepted path in the target cache; drop the rest.
        cache.length = base + 1 + n
        cache.keep(base, [0] + [1 + i for i in path])
        drafter.accept(tree, path)
        verify_ms = (time.perf_counter() - t1) * 1000.0
        return self._step_event(
            tree, decisions, records, emitted, dists, path, p_rows, full, events, draft_ms, verify_ms
        )

    def _use_batched_chain(self, tree: DraftTree, params, drop_q: bool, model) -> bool:
        mode = self.chain_verifier
        if mode not in ("auto", "batch", "walk"):
            raise ValueError(f"chain_verifier must be auto, batch or walk; got {mode!r}")
        if not len(tree) or params.greedy or drop_q or mode == "walk":
            return False
        if any(parent != i - 1 for i, parent in enumerate(tree.parents)):
            return False  # a tree: siblings are verified one after another (see engine/kernels.py)
        return mode == "batch" or model.device.type == "cuda"

    def _verify_chain_batched(self, logits, tree: DraftTree, params, gen, full):
        """Sampled chain verification in one call of kernels.verify_batch (B = 1).

        logits: [K+1, V] on the model's device. The Triton kernel runs where the
        logits live (CUDA); on the CPU the dispatcher uses the torch reference.
        Returns what _walk_tree returns, so the events are the same.
        """
        from .kernels import verify_batch

        k = len(tree)
        device = logits.device
        p = probs_from_logits(logits, params)  # [K+1, V] float32 target probabilities
        ids = torch.tensor(tree.tokens, dtype=torch.long)  # [K] drafted ids
        q = None if tree.point_mass else torch.stack([tree.q_dists[i - 1] for i in range(k)]).to(device)  # [K, V]
        u = torch.rand(k, generator=gen, dtype=torch.float64).float().clamp_(max=1.0 - 2**-24)  # [K] in [0, 1)
        u_sample = torch.rand(1, generator=gen, dtype=torch.float64).float().clamp_(max=1.0 - 2**-24)  # [1]
        num_accepted, next_token = verify_batch(
            p[None], None if q is None else q[None], ids[None].to(device), u[None].to(device), u_sample.to(device)
        )  # [1], [1]
        accepted = int(num_accepted[0])
        token = int(next_token[0])
        p_host = p.float().cpu()  # [K+1, V] for the events
        q_host = None if q is None else q.cpu()
        p_rows = {i - 1: p_host[i] for i in range(min(accepted, k) + 1)}
        decisions = ["not_reached"] * k
        records: list[dict | None] = [None] * k
        dists: list[dict] = []
        emitted: list[dict] = []
        for i in range(min(accepted + 1, k)):
            x = tree.tokens[i]
            p_x = float(p_host[i, x])
            q_x = 1.0 if q_host is None else float(q_host[i, x])
            records[i] = {
                "accept_prob": min(1.0, p_x / max(q_x, 1e-30)),
                "u": float(u[i]),
                "p_eff": p_x,
                "q_eff": q_x,
            }
            decisions[i] = "accepted" if i < accepted else "rejected"
            if full:
                q_dist = tree.q_dists.get(i - 1)
                dists.append(
                    {
                        "node": i - 1,
                        "p_top": self._top(p_host[i]),
                        "q_top": self._top(q_dist) if q_dist is not None else None,
                    }
                )
            if i < accepted:
                emitted.append({"token_id": x, "kind": "accepted", "node": i})
        path = list(range(accepted))
        if accepted < k:
            extra = {"token_id": token, "kind": "resampled", "node": None, "from_node": accepted - 1}
            if full:
                from .sampling import residual

                q_row = (
                    q_host[accepted]
                    if q_host is not None
                    else torch.nn.functional.one_hot(torch.tensor(tree.tokens[accepted]), p_host.shape[-1]).float()
                )
                extra["residual_top"] = self._top(residual(p_host[accepted], q_row))
        else:
            extra = {"token_id": token, "kind": "bonus", "node": None, "from_node": k - 1}
            if full:
                dists.append({"node": k - 1, "p_top": self._top(p_host[k]), "q_top": None})
        extra["p"] = round(float(p_host[accepted, token]), 6)
        emitted.append(extra)
        return decisions, records, emitted, dists, path, p_rows

    def _walk_tree(self, logits, tree: DraftTree, params, gen, full, drop_q):
        """Walk the draft tree from the root with exact (recursive) rejection sampling."""
        n = len(tree)
        p_rows: dict[int, torch.Tensor] = {}

        def p_at(node: int) -> torch.Tensor:
            if node not in p_rows:
                p_rows[node] = probs_from_logits(logits[node + 1], params)  # node -1 -> row 0
            return p_rows[node]

        decisions = ["not_reached"] * n
        records: list[dict | None] = [None] * n
        emitted: list[dict] = []
        dists: list[dict] = []
        path: list[int] = []
        node = -1
        while True:
            children = tree.children(node)
            p = p_at(node)
            q = tree.q_dists.get(node)
            if children:
                u = (
                    []
                    if params.greedy
                    else [float(torch.rand((), generator=gen, dtype=torch.float64)) for _ in children]
                )
                chosen, dist, recs = verify_children(
                    p,
                    q if q is not None else p,
                    [tree.tokens[c] for c in children],
                    u,
                    params.greedy,
                    tree.point_mass,
                    drop_q,
                )
                for c, rec in zip(children, recs):
                    records[c] = rec
                    decisions[c] = "rejected"
                if full:
                    dists.append(
                        {"node": node, "p_top": self._top(p), "q_top": self._top(q) if q is not None else None}
                    )
                if chosen is not None:
                    accepted_node = children[chosen]
                    decisions[accepted_node] = "accepted"
                    for c in children[chosen + 1 :]:
                        decisions[c] = "not_reached"
                        records[c] = None
                    path.append(accepted_node)
                    emitted.append({"token_id": tree.tokens[accepted_node], "kind": "accepted", "node": accepted_node})
                    node = accepted_node
                    continue
                token = sample(dist, gen) if not params.greedy else int(dist.argmax())
                extra = {"token_id": token, "kind": "resampled", "node": None, "from_node": node}
                if full and not params.greedy:
                    extra["residual_top"] = self._top(dist)
            else:
                if full and n:
                    dists.append(
                        {"node": node, "p_top": self._top(p), "q_top": self._top(q) if q is not None else None}
                    )
                elif full:
                    dists.append({"node": node, "p_top": self._top(p), "q_top": None})
                token = int(p.argmax()) if params.greedy else sample(p, gen)
                extra = {"token_id": token, "kind": "bonus", "node": None, "from_node": node}
            extra["p"] = round(float(p[token]), 6)
            emitted.append(extra)
            break
        return decisions, records, emitted, dists, path, p_rows

    def _step_event(self, tree, decisions, records, emitted, dists, path, p_rows, full, events, draft_ms, verify_ms):
        n = len(tree)
        nodes = []
        for i in range(n if events else 0):
            parent = tree.parents[i]
            rec = records[i]
            p_parent = p_rows.get(parent)
            item = {
                "id": i,
                "parent": parent,
                "depth": tree.depths[i],
                "token_id": tree.tokens[i],
                "q": round(tree.q_token[i], 6),
                "p": round(float(p_parent[tree.tokens[i]]), 6) if p_parent is not None else None,
                "decision": decisions[i],
            }
            if rec is not None:
                item.update(
                    accept_prob=round(rec["accept_prob"], 6),
                    u=None if rec["u"] is None else round(rec["u"], 6),
                    p_eff=round(rec["p_eff"], 6),
                    q_eff=round(rec["q_eff"], 6),
                )
            if full:
                item["text"] = self.token_text(tree.tokens[i])
            nodes.append(item)
        if full:
            for item in emitted:
                item["text"] = self.token_text(item["token_id"])
        return {
            "type": "step",
            "nodes": nodes,
            "point_mass": tree.point_mass,
            "dists": dists,
            "emitted": emitted,
            "drafted": n,
            "draft_depth": max(tree.depths, default=0),
            "accepted_len": len(path),
            "draft_ms": round(draft_ms, 3),
            "verify_ms": round(verify_ms, 3),
        }

    # ---------------------------------------------------------------- helpers
    def sample_next_tokens(
        self,
        prompt: str | list[int],
        drafter: str = "none",
        n_samples: int = 1000,
        n_tokens: int = 1,
        settings: GenerationSettings | None = None,
        verifier: str = "exact",
        progress=None,
        **kw,
    ) -> list[tuple[int, ...]]:
        """Draw n_samples independent continuations of n_tokens tokens from one prompt.

        Real speculative sampling (drafts, one target pass, verification), but the
        prompt is prefilled once and both KV caches are rolled back to it before each
        sample, so thousands of samples are affordable. verifier="drop_q" swaps in a
        deliberately lossy verifier (the negative control of the lossless lab).
        """
        settings = settings or GenerationSettings()
        if kw:
            settings = GenerationSettings(**{**asdict(settings), **kw})
        params, shape = settings.validate()
        if verifier not in ("exact", "drop_q"):
            raise ValueError(f"verifier must be 'exact' or 'drop_q', got {verifier!r}")
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or not 1 <= n_samples <= 100_000:
            raise ValueError(f"n_samples must be between 1 and 100000, got {n_samples!r}")
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 1 <= n_tokens <= 8:
            raise ValueError(f"n_tokens must be between 1 and 8, got {n_tokens!r}")
        drafter_obj = self.drafter(drafter)
        prompt_ids = self.encode_prompt(prompt, settings.chat) if isinstance(prompt, str) else [int(t) for t in prompt]
        if len(prompt_ids) + n_tokens + shape.max_tokens + 2 >= self.target.context_window:
            raise ValueError("prompt too long for the context window")
        model = self.target.model
        width = shape.max_tokens + 1
        capacity = len(prompt_ids) + n_tokens + 2 * width + 2
        cache = model.new_cache(capacity)
        if isinstance(drafter_obj, ModelDrafter):
            drafter_obj.ensure_capacity(capacity + width)
        drafter_obj.reset(prompt_ids)
        if len(prompt_ids) > 1:
            model.prefill(prompt_ids[:-1], cache)
        base = cache.length
        gen = torch.Generator().manual_seed(settings.seed if settings.seed is not None else 0)
        samples: list[tuple[int, ...]] = []
        for index in range(n_samples):
            context = list(prompt_ids)
            cache.length = base  # roll back to the prompt: no recomputation of it
            if isinstance(drafter_obj, ModelDrafter) and drafter_obj.cache is not None:
                drafter_obj.cache.length = min(drafter_obj.cache.length, len(prompt_ids) - 1)
            out: list[int] = []
            while len(out) < n_tokens:
                step = self._step(
                    context, drafter_obj, shape, params, gen, cache, settings, width, False, verifier == "drop_q"
                )
                ids = [item["token_id"] for item in step["emitted"]]
                out.extend(ids)
                context.extend(ids)
            samples.append(tuple(out[:n_tokens]))
            if progress is not None:
                progress(index + 1, n_samples)
        return samples

    def next_token_distribution(self, prompt: str | list[int], prefix: list[int] | None = None, settings=None, **kw):
        """The target's exact next-token distribution p after prompt (+ prefix), as a
        [V] float32 tensor, with the run's temperature / top-k / top-p applied."""
        settings = settings or GenerationSettings()
        if kw:
            settings = GenerationSettings(**{**asdict(settings), **kw})
        params, _ = settings.validate()
        ids = self.encode_prompt(prompt, settings.chat) if isinstance(prompt, str) else [int(t) for t in prompt]
        ids = ids + list(prefix or [])
        model = self.target.model
        cache = model.new_cache(len(ids) + 1)
        return probs_from_logits(model.prefill(ids, cache), params)

    def run(self, prompt, drafter: str = "none", settings: GenerationSettings | None = None, **kw) -> dict:
        """Run to completion; returns {"events": [...], "text", "token_ids", "metrics"}."""
        events = list(self.generate(prompt, drafter, settings, **kw))
        finish = events[-1]
        return {
            "events": events,
            "text": finish["text"],
            "token_ids": finish["token_ids"],
            "metrics": finish["metrics"],
        }
