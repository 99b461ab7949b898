"""The decode loop: a generator of plain, JSON-serialisable events.

One loop serves the baseline and every drafter. The target's KV cache holds all
committed tokens but the last one, the *pending* token. Each step:

1. the drafter proposes a draft tree for the context (``Drafter.propose``);
2. one target pass over the pending token plus the tree (a tree mask lets every
   node see the prefix and its own ancestors only);
3. verification (``engine.verification``, the rule of ``engine.acceptance``)
   decides which path is accepted and draws one more token: *resampled* after a
   rejection, *bonus* when the walk ran off the tree;
4. the accepted path stays in the target's cache, the drafter is told the path
   (``Drafter.accept``), and a step event records every decision (``engine.events``).

With no drafter the tree is empty and each pass emits exactly one (bonus) token: that is the plain
autoregressive baseline, same model, same cache code, same events. Stopping: EOS, max_new_tokens, or
the caller closing the generator. Around the loop, each in its own module: prompts (``engine.prompts``),
drafters by name (``engine.drafters.registry``), the fixed-shape runners and what the host measured
(``engine.model.runners``), lab sampling beside the exactness tools (``engine.tools.samples``).
"""

from __future__ import annotations

import atexit
import functools
import gc
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict

import torch

from engine import events
from engine.drafters.adaptive import verified_outcomes
from engine.drafters.base import DraftContext, Drafter, DraftTree, TreeShape, Verified
from engine.drafters.registry import DrafterRegistry
from engine.drafters.spec import family, parse
from engine.host import host_info
from engine.kernels import cpu_build
from engine.kernels.batched_verifier import warm_up
from engine.metrics import cpu_share, summarize_steps
from engine.model.loading import LoadedModel, load_model
from engine.model.runners import MeasuredCosts, RunnerPool
from engine.model.transformer import KVCache
from engine.prompts import PromptEncoder
from engine.run_state import DecodeState, StepResult
from engine.settings import GenerationSettings
from engine.verification import choose_verifier, logits_to_host, resolve_tops, verify

__all__ = ["GenerationSettings", "OutOfMemory", "SpeculativeEngine"]


class OutOfMemory(RuntimeError):
    """The accelerator ran out of memory; the message suggests smaller settings."""


def freeze_heap() -> None:
    """Set every object alive now aside from the garbage collector's full collections (gc.freeze, after one).

    Why: a process with a loaded engine holds hundreds of thousands of objects the collector tracks (torch,
    transformers, the tokenizer, Gradio in the app), and CPython's full collection walks every one of them, a
    stall inside whichever run (or, in the app, every session's stream) it lands in. Frozen objects are never
    walked again, nor freed while frozen: so each call first thaws the last call's (gc.unfreeze), and the full
    collection between frees what has become garbage since, an engine dropped for another among it. At exit the
    heap is thawed again (_thaw_at_exit), so that the interpreter's last collection sees it: left frozen,
    triton's objects outlive it and nanobind reports them on stderr as leaks under every command's own output
    (figures: docs/bench/2026-12-07-notes-from-engine.md)."""
    _thaw_at_exit()
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@functools.cache
def _thaw_at_exit() -> None:
    """Once per process: gc.unfreeze at exit (freeze_heap)."""
    atexit.register(gc.unfreeze)


class SpeculativeEngine:
    """A loaded target plus the drafters built for it (loaded once, shared read-only).

    >>> engine = SpeculativeEngine.load()                      # offline default
    >>> for event in engine.generate("Hi!", drafter="ngram"):  # a generator of dicts
    ...     pass
    """

    def __init__(self, target: LoadedModel, allow_remote_code: bool = False):
        self.target = target
        self.tokenizer = target.tokenizer
        self.eos_ids = target.eos_token_ids
        self.prompts = PromptEncoder(self.tokenizer, target.model.cfg.vocab_size)
        self.special_ids = set(self.prompts.special_ids) | set(self.eos_ids)
        self.drafters = DrafterRegistry(target, frozenset(self.special_ids), allow_remote_code)
        self.runners = RunnerPool(target.context_window)
        self.costs = MeasuredCosts(target.model, self.runners)
        if target.model.device.type == "cuda":  # the Triton chain verifier, compiled before any pass needs it
            warm_up(target.model.device, target.model.cfg.vocab_size)
        freeze_heap()  # (last: with the model and the drafters' registry built)

    @classmethod
    def load(cls, target="default", dtype="auto", progress=None, device="auto", allow_remote_code=False):
        """The target by name (a preset, Hub id or folder; "default": the offline default model)."""
        loaded = load_model(target, dtype, progress, allow_remote_code=allow_remote_code, device=device)
        return cls(loaded, allow_remote_code)

    # ------------------------------------------------- what other modules own, by its old names
    def drafter(self, spec: str) -> Drafter:
        """A fresh drafter for one run (``DrafterRegistry.build``)."""
        return self.drafters.build(spec)

    def use_eagle_head(self, head) -> None:
        self.drafters.use_eagle_head(head)

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        return self.prompts.encode(prompt, chat)

    def token_text(self, token_id: int) -> str:
        return self.prompts.token_text(token_id)

    @staticmethod
    def level_nodes(drafter: Drafter, shape: TreeShape) -> int:
        """Draft nodes each level past the first adds: an n-gram tree's topk branches grow one node
        each, a model drafter expands its topk best nodes into topk children each (EAGLE-2)."""
        return shape.topk if drafter.needs.point_mass else shape.topk**2

    def run_slots(self, prompt_len: int, extra: int, shape: TreeShape) -> tuple[int, int]:
        """(The cache slots a run of a `prompt_len`-token prompt and `extra` new tokens uses: the prompt, the new
        tokens, one pass and a slot of slack; the slots a strict run's cache needs: one pass more, as every
        pass is padded to the widest). The runner the run gets is sized to the bucket of the latter."""
        width = shape.max_tokens + 1
        capacity = prompt_len + extra + width + 1
        return capacity, capacity + width

    def adaptive_policy(self, settings, shape: TreeShape, drafter: Drafter, needed: int = 1):
        """(A fresh K policy for one run, the measured pass ms by width it weighs: on the path its passes take,
        MeasuredCosts.weighed_pass_ms, on a runner of the run's size, `needed` slots), or (None, None) when not
        adaptive or for the baseline (no drafts)."""
        if not settings.adaptive or not drafter.drafts:
            return None, None
        pass_ms = self.costs.weighed_pass_ms(shape.max_tokens + 1, settings.pass_graphs, settings.strict, needed)
        return settings.adaptive_depth(shape, pass_ms, self.level_nodes(drafter, shape)), pass_ms

    # --------------------------------------------------------------- the loop
    def generate(
        self, prompt: str | list[int], drafter: str = "none", settings: GenerationSettings | None = None, **kw
    ):
        """Yield start, step... and finish events for one generation.

        prompt: text (the chat template is applied when settings.chat) or token ids.
        drafter: none | ngram | suffix | int8 | eagle | model:<id>. Keyword arguments override settings.
        Validation happens here, before the generator exists, so bad input raises
        ValueError at the call without touching any model state.
        """
        settings = (settings or GenerationSettings()).merged(kw)
        params, shape = settings.validate()
        drafter_obj = self.run_drafter(drafter, settings)
        prompt_ids = self.prompts.ids(prompt, settings.chat)
        window = self.target.context_window
        limit = min(window, settings.max_prompt_tokens or window)
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens; the limit is {limit - 1} (context window {window}). Shorten it."
            )
        seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**31)
        return self._run(prompt, prompt_ids, drafter_obj, settings, params, shape, seed)

    def run_drafter(self, spec: str, settings: GenerationSettings) -> Drafter:
        """A fresh drafter for one run, with what it may read besides the context (a copying drafter: the run's
        history, earlier answers as texts tokenised like a user's text, or token ids). Settings its family does
        not support are refused before anything is built."""
        parsed = parse(spec)
        supports = family(parsed.family)
        for wanted, supported, what in (
            (settings.adaptive, supports.adaptive, "adaptive drafting"),
            (settings.topk > 1, supports.trees, "a draft tree (topk > 1)"),
            (settings.verify == "block", supports.block, "block verification"),
        ):
            if wanted and not supported and parsed.drafts:
                raise ValueError(
                    f"{what} does not combine with the drafter {parsed.text!r} ({supports.label}); turn it off"
                )
        history = self.prompts.documents(settings.history) if settings.history else ()
        return self.drafters.build(parsed, history)

    @contextmanager
    def running(self, prompt_ids, drafter: Drafter, settings, shape, params, seed: int, extra: int, adaptive=None):
        """One run's lifetime: caches sized for the prompt plus `extra` tokens, the target's fixed-shape runner
        held where the run gets one (and its drafter's), the prompt prefilled but for its last token (the
        pending one); on leaving, the runners released and the drafter closed, whatever happened."""
        width = shape.max_tokens + 1
        capacity, needed = self.run_slots(len(prompt_ids), extra, shape)
        model = self.target.model
        strict = settings.strict
        static, why = self.runners.target_runner(model, settings.pass_graphs, strict, needed, width)
        try:
            if static is not None:
                strict, cache = True, static.cache
            else:  # (a strict run attends over its whole cache: the runner's bucket, so both give the same bits)
                cache = model.new_cache(self.runners.bucket(needed) if strict else capacity)
            t0 = time.perf_counter()
            features = self._prefill(prompt_ids, drafter, cache)
            prefill_s = time.perf_counter() - t0
            runner = None  # the drafter's own runner where the target's passes are fixed-shape (start takes it)
            if static is not None and drafter.needs.model is not None:
                runner = self.runners.acquire(drafter.needs.model, static.capture, capacity + width + 1)
            shared = cache if drafter.needs.target_kv else None  # (read only: the drafter copies what it needs)
            drafter.start(prompt_ids, capacity + width + 1, runner, features, shared)
            mode = settings.chain_verifier
            batch_chains = mode == "batch" or (mode == "auto" and model.device.type == "cuda")
            gen = torch.Generator(device=model.device).manual_seed(seed)  # draws stay on the model's device
            state = DecodeState(list(prompt_ids), drafter, shape, params, gen, cache, strict, adaptive, static)
            state.batch_chains, state.prefill_s, state.pass_path_reason = batch_chains, prefill_s, why
            state.tops, state.verify = settings.payload == "full", settings.verify
            yield state
        finally:
            if static is not None:
                static.release()
            drafter.close()

    def _prefill(self, prompt_ids: list[int], drafter: Drafter, cache: KVCache) -> torch.Tensor | None:
        """Prefill the target's cache with all prompt tokens but the pending one; the rows [len - 1, E] the
        drafter reads (its needs.target_features), else None."""
        if len(prompt_ids) < 2:
            return None
        model, needs = self.target.model, drafter.needs
        if needs.target_features:
            return model.prefill_features(prompt_ids[:-1], cache, needs.feature_layers).hidden
        model.prefill(prompt_ids[:-1], cache)
        return None

    def _start_info(self, drafter: Drafter, settings, params, shape, seed: int, max_new: int) -> dict:
        model = self.target.model
        return {
            "mode": "speculative" if drafter.drafts else "baseline",
            "target": self.target.name,
            "drafter": drafter.name,
            "family": parse(drafter.name).root,  # what screens group it under (a composite: its model's family)
            "dtype": self.target.weight_kind,
            "device": str(model.device),
            # (the earlier answers themselves stay out of the trace: how many there were is enough)
            "settings": {
                **asdict(settings),
                "seed": seed,
                "k": shape.k,
                "num_draft_tokens": shape.max_tokens,
                "history": len(settings.history),
            },
            "sampling": params.as_dict(),
            "greedy": params.greedy,
            "tree": {"k": shape.k, "topk": shape.topk, "num_draft_tokens": shape.max_tokens},
            "eos_ids": sorted(self.eos_ids),
            "max_new_tokens": max_new,
            "host": host_info(model.device, cpu_build.variant()),
        }

    def _kept(self, emitted: list[dict], produced: int, max_new: int) -> tuple[int, bool]:
        """How many of a pass's tokens the run keeps (cut after EOS or at the limit; the
        kept prefix is exact either way) and whether EOS ended the run."""
        for n, item in enumerate(emitted, start=1):
            if item["token_id"] in self.eos_ids:
                return n, True
            if produced + n >= max_new:
                return n, False
        return len(emitted), False

    def _run(self, prompt, prompt_ids, drafter: Drafter, settings, params, shape, seed) -> Iterator[dict]:
        max_new = min(settings.max_new_tokens, self.target.context_window - len(prompt_ids))
        # Measured before the run's clock starts (the first adaptive run on an engine times its target passes).
        adaptive, pass_ms = self.adaptive_policy(
            settings, shape, drafter, self.run_slots(len(prompt_ids), max_new, shape)[1]
        )
        started, cpu_started = time.perf_counter(), time.process_time()
        info = self._start_info(drafter, settings, params, shape, seed, max_new)
        if adaptive is not None:  # what the K policy weighs, recorded: a trace replays it on its own
            info["adaptive"] = {"pass_ms": pass_ms, "level_nodes": self.level_nodes(drafter, shape)}
        yield events.start_event(info, prompt, prompt_ids, self.token_text)
        with self.running(prompt_ids, drafter, settings, shape, params, seed, max_new, adaptive) as state:
            steps: list[dict] = []
            stop_reason, generated = "max_new_tokens", []
            while len(generated) < max_new:
                result = self.step(state)
                emitted = result.verdict.emitted(result.tree)
                kept, eos = self._kept(emitted, len(generated), max_new)
                new_ids = [item["token_id"] for item in emitted[:kept]]
                generated.extend(new_ids)
                state.context.extend(new_ids)
                # 5. Event: the pass's decisions recorded once, as plain JSON (docs/events.md).
                step = events.step_event(
                    result.tree,
                    result.verdict,
                    emitted=emitted,
                    kept=kept,
                    number=len(steps) + 1,
                    tokens_total=len(generated),
                    elapsed_s=time.perf_counter() - started,
                    draft_ms=result.draft_ms,
                    verify_ms=result.verify_ms,
                    draft=result.draft_info,
                    kv=result.kv,
                    payload=settings.payload,
                    token_text=self.token_text,
                )
                steps.append(step)
                if settings.payload != "off":
                    yield step
                if eos:
                    stop_reason = "eos"
                    break
            k = shape.k if drafter.drafts else 0
            metrics = summarize_steps(steps, k, time.perf_counter() - started, state.prefill_s)
            on_cpu = self.target.model.device.type == "cpu"  # (on a GPU the CPU mostly waits: no share)
            cpu_s = time.process_time() - cpu_started
            metrics["cpu_share"] = cpu_share(cpu_s, metrics["wall_s"], torch.get_num_threads()) if on_cpu else None
            self.costs.note_run(drafter.name, drafter.drafts, metrics)
            metrics["pass_path"], metrics["pass_path_reason"] = state.pass_path
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
        yield events.finish_event(stop_reason, text, generated, metrics)

    def step(self, state: DecodeState, verify_node: Callable | None = None) -> StepResult:
        """One target pass: draft, verify, keep the accepted path in the caches (and let an adaptive
        policy learn from the outcome, for the next pass). The numbered stages are those of
        docs/architecture.md ("One drafted token"); 5, the event, is built by the caller from the result.
        verify_node: None for the exact rule, or a replacement for ``acceptance.verify_children``."""
        # 1. Drafter: this pass's K (adaptive drafting picks it; 0: a plain pass, nothing drafted), then the tree.
        plain = state.adaptive is not None and not state.adaptive.drafts
        shape = state.adaptive.shape_for_step(state.shape) if state.adaptive and not plain else state.shape
        why = state.adaptive.why() if state.adaptive else None
        t0 = time.perf_counter()
        tree = (
            DraftTree() if plain else state.drafter.propose(DraftContext(state.context, shape, state.params, state.gen))
        )
        draft_ms = (time.perf_counter() - t0) * 1000.0
        t1 = time.perf_counter()
        cache, model, n = state.cache, self.target.model, len(tree)
        base = cache.length  # == len(context) - 1: the pending token's position
        # 2. Target pass: the pending token and every draft node in one forward (logits [1 + n, V], features
        # [1 + n, E] or None), the logits where the verifier chosen for this draft reads them (on the host or not).
        verifier = choose_verifier(tree, state.params, state.verify, state.batch_chains, verify_node)
        try:
            out = state.target_pass(model, tree, logits_to_host(verifier, model.device))
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(
                f"out of memory verifying {n} draft tokens; try a smaller K, topk or tree budget"
            ) from exc
        # 3. Acceptance: the rule walks the tree, or a chain's verifier decides it on the logits' device.
        verdict = verify(verifier, out.logits, tree, state.params, state.gen, state.tops, verify_node)
        # 4. Caches: the pending token and every draft node were written at slots base .. base + n; the pending
        # token and the accepted path stay, the other n - len(path) slots are rolled back (overwritten next pass).
        cache.length = base + 1 + n
        rows = [0] + [1 + i for i in verdict.path]
        cache.keep(base, rows)
        kv = {"written": 1 + n, "kept": len(rows), "rolled_back": n - len(verdict.path), "length": cache.length}
        state.note_walk(out, len(verdict.path))
        features = out.hidden[rows] if out.hidden is not None else None  # the committed rows' features, this pass's
        (state.drafter.skipped if plain else state.drafter.accept)(Verified(tree, verdict.path, features, base))
        verify_ms = (time.perf_counter() - t1) * 1000.0
        resolve_tops(verdict)  # (the screen's top entries, listed outside the pass's time)
        if state.adaptive is not None:  # (times as the step event records them, 3 decimals: a trace replays it)
            outcomes, depth = verified_outcomes(tree, verdict.path), max(tree.depths, default=0)
            state.adaptive.update(len(verdict.path), depth, outcomes, round(draft_ms, 3), round(verify_ms, 3), n)
        k = shape.k if state.drafter.drafts and not plain else 0
        return StepResult(tree, verdict, draft_ms, verify_ms, k, kv, why)

    def run(self, prompt, drafter: str = "none", settings: GenerationSettings | None = None, **kw) -> dict:
        """Run to completion; returns {"events": [...], "text", "token_ids", "metrics"}."""
        run_events = list(self.generate(prompt, drafter, settings, **kw))
        finish = run_events[-1]
        return {"events": run_events, **{key: finish[key] for key in ("text", "token_ids", "metrics")}}
