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

With no drafter the tree is empty and each pass emits exactly one (bonus) token:
that is the plain autoregressive baseline, same model, same cache code, same events.
Stopping: EOS, max_new_tokens, or the caller closing the generator.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from engine import events
from engine.acceptance import verify_children
from engine.drafters import (
    Drafter,
    DraftTree,
    ModelDrafter,
    NgramDrafter,
    NoDrafter,
    SuffixDrafter,
    TreeShape,
    int8_weights,
)
from engine.drafters.adaptive import AdaptiveDepth, verified_outcomes
from engine.drafters.eagle import EagleDrafter, EagleHead, load_head
from engine.host import host_info
from engine.kernels import cpu_kernels
from engine.metrics import summarize_steps
from engine.model.loading import LoadedModel, check_same_vocab, load_model
from engine.model.pass_timing import pass_costs_ms
from engine.model.static_pass import StaticPasses, capture_available
from engine.model.transformer import KVCache, Transformer
from engine.sampling import SamplingParams, probs_from_logits
from engine.settings import GenerationSettings
from engine.verification import Verdict, verify_chain_batched, walk_tree

__all__ = ["DecodeState", "GenerationSettings", "OutOfMemory", "SpeculativeEngine", "StepResult"]


# A chain's verification reads the target's logits row by row and stops at the first rejection:
# rows past it are never used. On the CPU the lm_head product (49152 x 576 for the default model)
# is a sixth of a 16-token pass on the avx2 kernels, and up to a few rows it costs what one row
# costs (reading its 57 MB of weights). So a chain's pass computes the logits of its first
# CHAIN_LOGITS_FIRST rows and keeps the rest as last-layer rows; the walk projects them, all in one
# product, only if it gets that far (row-invariant kernels: the same bits as an eager pass).
CHAIN_LOGITS_FIRST = 5
STATIC_MAX_WIDTH = 16  # the widest fixed-shape pass (a K = 15 chain or 15 tree nodes): one graph per width


class OutOfMemory(RuntimeError):
    """The accelerator ran out of memory; the message suggests smaller settings."""


@dataclass
class DecodeState:
    """What one target pass needs: the committed context, the run's drafter, tree
    shape, sampling filters, random generator and the target's KV cache."""

    context: list[int]
    drafter: Drafter
    shape: TreeShape
    params: SamplingParams
    gen: torch.Generator
    cache: KVCache
    strict: bool = False  # pad every pass to `width` rows (shape-invariant passes)
    adaptive: AdaptiveDepth | None = None  # this run's K policy; None = every pass drafts `shape`
    static: StaticPasses | None = None  # the fixed-shape (graph-captured on CUDA) passes this run holds

    @property
    def width(self) -> int:
        """Tokens per target pass at most: the pending token plus the draft budget."""
        return self.shape.max_tokens + 1


@dataclass
class StepResult:
    """One target pass: the draft tree, what verification decided, the timings, and the K this pass
    drafted with (the run's K, or the adaptive policy's; 0 without a drafter)."""

    tree: DraftTree
    verdict: Verdict
    draft_ms: float
    verify_ms: float
    k: int = 0
    kv: dict | None = None  # the target cache this pass: slots written, kept, rolled back, length after
    why: dict | None = None  # adaptive drafting: why this pass's K (AdaptiveDepth.why), else None

    @property
    def draft_info(self) -> dict:
        """The step event's ``draft``: the K used and why drafting stopped (the drafter's own record), and for
        adaptive drafting why the policy chose that K."""
        info = {"k": self.k, "stop": self.tree.stop}
        if self.why is not None:
            info["why"] = self.why
        return info


class _ChainLogits:
    """The logits [1 + n, V] of a chain's pass (see CHAIN_LOGITS_FIRST): the first rows computed
    with the pass, the others from their last-layer rows [rest, E] in one product the first time
    the walk reads one of them. Read row by row like a tensor: chain[i] -> [V] float32."""

    def __init__(self, model: Transformer, first: torch.Tensor, rest_hidden: torch.Tensor):
        self.model = model
        self.first = first  # [CHAIN_LOGITS_FIRST, V]
        self.rest_hidden = rest_hidden  # [1 + n - CHAIN_LOGITS_FIRST, E]
        self.rest: torch.Tensor | None = None  # [1 + n - CHAIN_LOGITS_FIRST, V] once projected

    def __len__(self) -> int:
        return self.first.shape[0] + self.rest_hidden.shape[0]

    def __getitem__(self, row: int) -> torch.Tensor:
        if row < self.first.shape[0]:
            return self.first[row]
        if self.rest is None:
            self.rest = self.model.logits_of(self.rest_hidden)
        return self.rest[row - self.first.shape[0]]


def _spec_numbers(spec: str, form: str, most: int) -> list[int]:
    """The numbers after a drafter spec's colon ("suffix:24,3" -> [24, 3]); [] without a colon."""
    if ":" not in spec:
        return []
    try:
        numbers = [int(x) for x in spec.split(":", 1)[1].split(",")]
    except ValueError:
        numbers = []
    if not 1 <= len(numbers) <= most:
        raise ValueError(f"the drafter takes {form}, got {spec!r}")
    return numbers


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
        self._head: EagleHead | None = None  # the EAGLE head, loaded at the first eagle run
        self._pass_costs: list[float] = []  # measured target pass ms by width (pass_costs_ms)
        self._pass_costs_lock = threading.Lock()
        self.allow_remote_code = False
        self._token_text: dict[int, str] = {}
        self.eos_ids = target.eos_token_ids
        # Special tokens (chat template markers) never start or continue an n-gram draft.
        self.special_ids = {int(i) for i in getattr(self.tokenizer, "all_special_ids", [])} | set(self.eos_ids)
        # How sampled chains are verified: "auto" = one batched call (batched_verifier.verify_batch:
        # the Triton kernel, on the GPU) when the target runs on CUDA, else the walk of
        # acceptance.verify_children; "batch" or "walk" force one. Both are exact; they draw their
        # uniforms in a different order, so one seed gives different (equally exact) samples.
        self.chain_verifier = "auto"
        # How strict (fixed-shape) target passes run (engine/model/static_pass.py): "auto" = recorded once
        # per width as CUDA graphs and replayed, when the target runs on CUDA (every pass is then strict);
        # "static" = the same fixed-shape function without capture (what the CPU tests compare with the
        # eager pass); "off" = the eager pass always.
        self.pass_graphs = "auto"
        self._runners: dict[int, StaticPasses] = {}  # id(weights: the target's, a drafter's) -> their runner
        self._static_lock = threading.Lock()
        # The quickest mean baseline pass this engine has measured (ms): the host's quiet speed, against
        # which a comparison tells a busy machine (metrics.busy_machine).
        self.quickest_pass_ms: float | None = None
        # c (a draft token's cost in target passes) of every run so far, by drafter: what this host
        # measured, for texts that would otherwise say "a few percent" (measured_costs).
        self._costs: dict[str, list[float]] = {}

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

    # ------------------------------------------------------------ pass costs
    def pass_costs_ms(self, max_width: int) -> list[float]:
        """Measured ms of a target pass of w tokens (index w - 1, w up to max_width) on this machine:
        what adaptive drafting weighs a deeper draft against. Measured once per engine (~1 s for
        16 widths of the default model on a 2-core CPU) and again only for a wider shape."""
        with self._pass_costs_lock:
            if len(self._pass_costs) < max_width:
                self._pass_costs = pass_costs_ms(self.target.model, max_width)
            return self._pass_costs[:max_width]

    @staticmethod
    def level_nodes(drafter: Drafter, shape: TreeShape) -> int:
        """Draft nodes each level past the first adds: an n-gram tree's topk branches grow one node
        each, a model drafter expands its topk best nodes into topk children each (EAGLE-2)."""
        return shape.topk if drafter.point_mass else shape.topk**2

    def _adaptive_pass_ms(self, settings, shape: TreeShape, strict: bool | None = None, drafter=None):
        """The pass costs an adaptive run of this shape weighs (None when not adaptive, or for the
        baseline, which drafts nothing). Strict runs pad every pass to the full width, so every
        depth costs that width's pass."""
        if not settings.adaptive or not drafter.drafts:
            return None
        width = shape.max_tokens + 1
        costs = self.pass_costs_ms(width)
        strict = settings.strict if strict is None else strict
        return [costs[-1]] * width if strict else costs

    # ----------------------------------------------------------------- drafters
    def drafter(self, spec: str) -> Drafter:
        """A fresh drafter for one run: none, ngram[:MAX[,MIN[,WINDOW]]], suffix[:MAX[,MIN]], int8, eagle
        or model:<id>.

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
                    parts = []
                if not 1 <= len(parts) <= 4:
                    raise ValueError(f"ngram drafter takes ngram:MAX[,MIN[,WINDOW[,PER_MATCH]]], got {spec!r}")
                if len(parts) == 1:  # ngram:1 means single-token matches only
                    parts.append(min(2, parts[0]))
            return NgramDrafter(*parts, stop_ids=self.special_ids)
        if spec == "suffix" or spec.startswith("suffix:"):
            return SuffixDrafter(*_spec_numbers(spec, "suffix:MAX_MATCH[,MIN_MATCH]", 2), stop_ids=self.special_ids)
        if spec == "eagle":
            return EagleDrafter(self._eagle_head())
        return ModelDrafter(self._drafter_weights(spec), spec)

    def _run_drafter(self, spec: str, settings: GenerationSettings) -> Drafter:
        """``drafter(spec)`` for one run, with what it may read besides the context: the suffix drafter gets
        the run's history (earlier answers, as texts tokenised like a user's text, or token ids)."""
        drafter = self.drafter(spec)
        if settings.history and isinstance(drafter, SuffixDrafter):
            vocab = self.target.model.cfg.vocab_size
            docs = [self._text_ids(doc) if isinstance(doc, str) else list(doc) for doc in settings.history]
            if any(not 0 <= t < vocab for doc in docs for t in doc):
                raise ValueError(f"history token ids must be in [0, {vocab})")
            drafter.remember(docs)
        return drafter

    def use_eagle_head(self, head: EagleHead) -> None:
        """Draft `eagle` with this head instead of the one shipped for the target (training, tests)."""
        with self._drafter_lock:
            self._head = head

    def _eagle_head(self) -> EagleHead:
        with self._drafter_lock:
            if self._head is None:
                self._head = load_head(self.target.model, self.target.name)
            return self._head

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
                raise ValueError(f"unknown drafter {spec!r}; choose none, ngram, suffix, int8, eagle or model:<id>")
            self._drafter_models[spec] = model
            return model

    # ------------------------------------------------------------------ prompts
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def _text_ids(self, text: str) -> list[int]:
        """User text as plain text: a control token's spelling (``<|im_start|>``) in
        it is split into ordinary tokens, never turned into the control token."""
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of a prompt; with chat, wrapped in the model's chat template.

        The template's own markers are real control tokens; the user's text never
        produces one (a visitor cannot inject a system turn)."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("prompt is empty: type something for the model to continue")
        tok = self.tokenizer
        if not (chat and getattr(tok, "chat_template", None)):
            bos = [tok.bos_token_id] if getattr(tok, "add_bos_token", False) and tok.bos_token_id is not None else []
            return [int(i) for i in bos + self._text_ids(prompt)]
        # Render the template around a placeholder, then tokenise the template's parts
        # (markers parsed) and the user's text (markers split) separately.
        placeholder = "\ue000speclens-user-text\ue000"
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": placeholder}], add_generation_prompt=True, tokenize=False
        )
        before, after = rendered.split(placeholder, 1)
        template = lambda part: tok(part, add_special_tokens=False)["input_ids"] if part else []  # noqa: E731
        return [int(i) for i in template(before) + self._text_ids(prompt) + template(after)]

    def _prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.encode_prompt(prompt, chat)
        prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.target.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return prompt_ids

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
        drafter_obj = self._run_drafter(drafter, settings)
        prompt_ids = self._prompt_ids(prompt, settings.chat)
        window = self.target.context_window
        limit = min(window, settings.max_prompt_tokens or window)
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens; the limit is {limit - 1} (context window {window}). Shorten it."
            )
        seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**31)
        return self._run(prompt, prompt_ids, drafter_obj, settings, params, shape, seed)

    def _new_state(
        self, prompt_ids, drafter: Drafter, shape, params, seed: int, extra: int, strict: bool, adaptive=None
    ):
        """Caches sized for the prompt plus `extra` tokens, the prompt prefilled but for
        its last token (the pending one)."""
        width = shape.max_tokens + 1
        capacity = len(prompt_ids) + extra + width + 1
        static = self._static_passes(capacity + width, width, strict)
        if static is not None:
            strict, cache = True, static.cache
        else:
            cache = self.target.model.new_cache(capacity + (width if strict else 0))
        if static is not None and drafter.pass_model is not None:
            drafter.static = self._runner(drafter.pass_model, static.capture)
        try:
            drafter.ensure_capacity(capacity + width + 1)
            drafter.reset(prompt_ids)
            return self._prefilled_state(prompt_ids, drafter, shape, params, seed, strict, adaptive, cache, static)
        except BaseException:
            if static is not None:
                static.release()
            raise

    def _prefilled_state(self, prompt_ids, drafter, shape, params, seed, strict, adaptive, cache, static):
        gen = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        if len(prompt_ids) > 1:
            if drafter.reads_target_features:
                out = self.target.model.prefill_features(prompt_ids[:-1], cache, drafter.feature_layers)
                drafter.take_features(out.hidden, 0)
            else:
                self.target.model.prefill(prompt_ids[:-1], cache)
        state = DecodeState(list(prompt_ids), drafter, shape, params, gen, cache, strict, adaptive, static)
        return state, time.perf_counter() - t0

    @staticmethod
    def _pass_path(state: DecodeState) -> str:
        """How the run's target passes ran: "cuda-graph" (recorded once per width, replayed), "static" (the
        fixed-shape path without capture) or "eager"."""
        if state.static is None:
            return "eager"
        return "cuda-graph" if state.static.capture else "static"

    def _runner(self, model: Transformer, capture: bool) -> StaticPasses:
        """The fixed-shape runner of one set of weights (the target's, or a drafter's: int8 copy, draft model,
        EAGLE head), built once: every slot a run of the context window can use, plus the widest pass twice.
        A run holds it (``acquire``) or runs eagerly while another does."""
        with self._static_lock:
            runner = self._runners.get(id(model))
            if runner is None or runner.model is not model or runner.capture != capture:
                slots = self.target.context_window + 2 * STATIC_MAX_WIDTH + 2
                runner = StaticPasses(model, slots, STATIC_MAX_WIDTH, capture=capture)
                self._runners[id(model)] = runner
            return runner

    def _static_passes(self, needed: int, width: int, strict: bool) -> StaticPasses | None:
        """The engine's fixed-shape pass runner, held for one run, or None (the eager path): used for every
        run where CUDA graphs record it ("auto" on CUDA), for strict runs under "static"; None as well when
        another run holds it or the run needs more slots or a wider pass than it has."""
        mode = self.pass_graphs
        if mode not in ("auto", "static", "off"):
            raise ValueError(f"pass_graphs must be auto, static or off; got {mode!r}")
        model = self.target.model
        graphs = mode == "auto" and capture_available(model.device)
        if not (graphs or (mode == "static" and strict)):
            return None
        runner = self._runner(model, graphs)
        if width > runner.max_width or runner.acquire(needed) is None:
            return None
        return runner

    def _start_info(self, drafter: Drafter, settings, params, shape, seed: int, max_new: int) -> dict:
        model = self.target.model
        return {
            "mode": "speculative" if drafter.drafts else "baseline",
            "target": self.target.name,
            "drafter": drafter.name,
            "dtype": self.target.weight_kind,
            "device": str(model.device),
            # (the earlier answers themselves stay out of the trace: how many there were is enough)
            "settings": {
                **asdict(settings),
                "seed": seed,
                "k": shape.steps,
                "num_draft_tokens": shape.max_tokens,
                "history": len(settings.history),
            },
            "sampling": params.as_dict(),
            "greedy": params.greedy,
            "tree": {"steps": shape.steps, "topk": shape.topk, "budget": shape.max_tokens},
            "eos_ids": sorted(self.eos_ids),
            "max_new_tokens": max_new,
            "host": host_info(model.device, cpu_kernels.variant()),
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

    def _run(self, prompt, prompt_ids, drafter: Drafter, settings, params, shape, seed):
        max_new = min(settings.max_new_tokens, self.target.context_window - len(prompt_ids))
        # Measured before the run's clock starts (the first adaptive run on an engine, ~1 s).
        pass_ms = self._adaptive_pass_ms(settings, shape, drafter=drafter)
        started, cpu_started = time.perf_counter(), time.process_time()
        info = self._start_info(drafter, settings, params, shape, seed, max_new)
        if pass_ms is not None:  # what the K policy weighs, recorded: a trace replays it on its own
            info["adaptive"] = {"pass_ms": pass_ms, "level_nodes": self.level_nodes(drafter, shape)}
        yield events.start_event(info, prompt, prompt_ids, self.token_text)
        state = None
        try:
            adaptive = settings.adaptive_depth(shape, pass_ms, self.level_nodes(drafter, shape))
            state, prefill_s = self._new_state(
                prompt_ids, drafter, shape, params, seed, max_new, settings.strict, adaptive
            )
            generated: list[int] = []
            steps: list[dict] = []
            stop_reason = "max_new_tokens"
            while len(generated) < max_new:
                result = self._step(state)
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
            k = shape.steps if drafter.drafts else 0
            metrics = summarize_steps(steps, k, time.perf_counter() - started, prefill_s)
            metrics["cpu_share"] = self._cpu_share(time.process_time() - cpu_started, metrics["wall_s"])
            if drafter.drafts and metrics.get("draft_cost_ratio") is not None:
                self._costs.setdefault(drafter.name, []).append(metrics["draft_cost_ratio"])
            if not drafter.drafts and metrics.get("mean_verify_ms"):
                quickest = self.quickest_pass_ms
                self.quickest_pass_ms = min(quickest or math.inf, metrics["mean_verify_ms"])
            metrics["pass_path"] = self._pass_path(state)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            yield events.finish_event(stop_reason, text, generated, metrics)
        finally:
            if state is not None and state.static is not None:
                state.static.release()
            drafter.close()

    def measured_costs(self) -> dict[str, dict]:
        """{drafter name: {"c": the median c of its runs on this engine, "runs"}}: a draft token's cost in
        target passes as this host measured it (each run's finish metrics' draft_cost_ratio)."""
        return {
            name: {"c": statistics.median(values), "runs": len(values)} for name, values in sorted(self._costs.items())
        }

    def _cpu_share(self, cpu_s: float, wall_s: float) -> float | None:
        """The share of the cores it asked for (torch's threads) that this process got during a run: ~1 on a
        quiet machine, ~0.5 on 2 cores while two other processes run (measured on this host). Other runs in
        the same process count as its own. None on a GPU, where the CPU mostly waits."""
        if self.target.model.device.type != "cpu" or wall_s <= 0:
            return None
        return round(min(1.0, cpu_s / (wall_s * torch.get_num_threads())), 3)

    def _step(self, state: DecodeState, verify_node: Callable | None = None) -> StepResult:
        """One target pass: draft, verify, keep the accepted path in the caches (and let an adaptive
        policy learn from the outcome, for the next pass). The numbered stages are those of
        docs/architecture.md ("One drafted token"); 5, the event, is built by the caller from the result."""
        # 1. Drafter: this pass's K (adaptive drafting picks it), then the draft tree.
        shape = state.adaptive.shape_for_step(state.shape) if state.adaptive else state.shape
        why = state.adaptive.why() if state.adaptive else None
        t0 = time.perf_counter()
        tree = state.drafter.propose(state.context, shape, state.params, state.gen)
        draft_ms = (time.perf_counter() - t0) * 1000.0
        t1 = time.perf_counter()
        cache = state.cache
        base = cache.length  # == len(context) - 1: the pending token's position
        n = len(tree)
        batched = verify_node is None and self._use_batched_chain(tree, state.params)
        # 2. Target pass: the pending token and every draft node in one forward.
        try:
            logits, hidden = self._target_pass(state, tree, to_host=not batched)  # [1 + n, V], [1 + n, E] or None
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(
                f"out of memory verifying {n} draft tokens; try a smaller K, topk or tree budget"
            ) from exc
        # 3. Acceptance: the rule walks the tree (or a sampled chain on CUDA, in one kernel launch).
        if batched:
            verdict = verify_chain_batched(logits, tree, state.params, state.gen)
        else:
            verdict = walk_tree(logits, tree, state.params, state.gen, verify_node or verify_children)
        # 4. Caches: keep the pending token and the accepted path in the target cache; drop the rest.
        cache.length = base + 1 + n
        rows = [0] + [1 + i for i in verdict.path]
        cache.keep(base, rows)
        # The pending token and every draft node were written at slots base .. base + n; the pending token
        # and the accepted path stay, the other n - len(path) slots are rolled back (overwritten next pass).
        kv = {"written": 1 + n, "kept": len(rows), "rolled_back": n - len(verdict.path), "length": cache.length}
        state.drafter.accept(tree, verdict.path)
        if hidden is not None:  # the features of the committed rows, from the pass just run
            state.drafter.take_features(hidden[rows], base)
        verify_ms = (time.perf_counter() - t1) * 1000.0
        if state.adaptive is not None:
            # Times as the step event records them (3 decimals): a trace replays the policy exactly.
            state.adaptive.update(
                len(verdict.path),
                max(tree.depths, default=0),
                verified_outcomes(tree, verdict.path),
                round(draft_ms, 3),
                round(verify_ms, 3),
                n,
            )
        k = shape.steps if state.drafter.drafts else 0
        return StepResult(tree, verdict, draft_ms, verify_ms, k, kv, why)

    def _target_pass(self, state: DecodeState, tree: DraftTree, to_host: bool):
        """Logits [1 + n, V]: row 0 = the pending token, row 1 + i = draft node i (a long chain's
        on the CPU as _ChainLogits, projected when the walk reaches them); and the same rows'
        last-layer features [1 + n, E] when the drafter reads them (else None)."""
        model = self.target.model
        base = state.cache.length
        n = len(tree)
        tokens = [state.context[-1]] + tree.tokens
        positions = [base] + [base + d for d in tree.depths]
        mask = None
        attend_len = None
        # A chain's tree mask is plain causal attention: leave it to the model's causal path.
        if (n and not tree.is_chain) or state.strict:
            rows = state.width if state.strict else 1 + n
            attend_len = state.cache.capacity if state.strict else base + 1 + n
            mask = torch.zeros(rows, attend_len, dtype=torch.bool)
            mask[: 1 + n, : base + 1] = True
            for i in range(n):
                for anc in tree.path_to(i):
                    mask[1 + i, base + 1 + anc] = True
            if state.strict:
                mask[1 + n :, 0] = True  # padding rows: look at one slot, never used
                tokens = tokens + [0] * (rows - 1 - n)
                positions = positions + [base] * (rows - 1 - n)
        features = state.drafter.reads_target_features
        # (only where the lm_head runs on our row-invariant kernel: torch's BLAS may round a row
        # differently in products of another height)
        lazy = tree.is_chain and mask is None and to_host and model.lm_head_on_kernel and n + 1 > CHAIN_LOGITS_FIRST
        if state.static is not None:  # the same strict pass, in fixed buffers (replayed as a CUDA graph there)
            layers = state.drafter.feature_layers if features else None
            out = state.static.run(tokens, positions, mask, layers, features=features, to_host=to_host)
            return out.logits[: 1 + n], out.hidden[: 1 + n] if features else None
        out = model.run_pass(
            torch.tensor(tokens),
            torch.tensor(positions),
            state.cache,
            mask=mask,
            attend_len=attend_len,
            to_host=to_host,
            features=features or lazy,
            logits_rows=torch.arange(CHAIN_LOGITS_FIRST) if lazy else None,
            feature_layers=state.drafter.feature_layers if features else None,
        )
        logits, hidden = out.logits, out.hidden
        features = hidden[: 1 + n] if features else None
        if lazy:  # (the last layer's rows: the last E columns of a feature-layer mix)
            last = hidden[CHAIN_LOGITS_FIRST : 1 + n, -model.cfg.hidden_size :]
            return _ChainLogits(model, logits, last), features
        return logits[: 1 + n], features

    def _use_batched_chain(self, tree: DraftTree, params) -> bool:
        mode = self.chain_verifier
        if mode not in ("auto", "batch", "walk"):
            raise ValueError(f"chain_verifier must be auto, batch or walk; got {mode!r}")
        if not len(tree) or params.greedy or mode == "walk" or not tree.is_chain:
            return False  # trees: siblings are verified one after another (see engine/kernels/batched_verifier.py)
        return mode == "batch" or self.target.model.device.type == "cuda"

    # ------------------------------------------------------- sampling helpers
    def sample_next_tokens(
        self,
        prompt: str | list[int],
        drafter: str = "none",
        n_samples: int = 1000,
        n_tokens: int = 1,
        settings: GenerationSettings | None = None,
        verify_node: Callable | None = None,
        progress=None,
        **kw,
    ) -> list[tuple[int, ...]]:
        """Draw n_samples independent continuations of n_tokens tokens from one prompt.

        Real speculative sampling (drafts, one target pass, verification), but the
        prompt is prefilled once and both KV caches are rolled back to it before each
        sample, so thousands of samples are affordable. verify_node: None for the exact rule, or a
        replacement for ``acceptance.verify_children`` (the Lossless lab's negative control passes
        ``engine.tools.exactness.verify_children_ignoring_q``).
        """
        settings = (settings or GenerationSettings()).merged(kw)
        params, shape = settings.validate()
        if verify_node is not None and not callable(verify_node):
            raise ValueError(f"verify_node must be None (the exact rule) or a function, got {verify_node!r}")
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or not 1 <= n_samples <= 100_000:
            raise ValueError(f"n_samples must be between 1 and 100000, got {n_samples!r}")
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 1 <= n_tokens <= 8:
            raise ValueError(f"n_tokens must be between 1 and 8, got {n_tokens!r}")
        drafter_obj = self._run_drafter(drafter, settings)
        prompt_ids = self._prompt_ids(prompt, settings.chat)
        if len(prompt_ids) + n_tokens + shape.max_tokens + 2 >= self.target.context_window:
            raise ValueError("prompt too long for the context window")
        seed = settings.seed if settings.seed is not None else 0
        # One adaptive policy for all samples: K follows the acceptance of the samples before, which
        # changes how each sample is drafted but not its distribution (engine.drafters.adaptive).
        extra = n_tokens + shape.max_tokens + 1
        adaptive = settings.adaptive_depth(
            shape,
            self._adaptive_pass_ms(settings, shape, strict=False, drafter=drafter_obj),
            self.level_nodes(drafter_obj, shape),
        )
        samples: list[tuple[int, ...]] = []
        state = None
        try:
            state, _ = self._new_state(prompt_ids, drafter_obj, shape, params, seed, extra, False, adaptive)
            base = state.cache.length
            for index in range(n_samples):
                state.context = list(prompt_ids)
                state.cache.length = base  # roll back to the prompt: no recomputation of it
                drafter_obj.rewind(len(prompt_ids) - 1)
                out: list[int] = []
                while len(out) < n_tokens:
                    result = self._step(state, verify_node)
                    ids = [item["token_id"] for item in result.verdict.emitted(result.tree)]
                    out.extend(ids)
                    state.context.extend(ids)
                samples.append(tuple(out[:n_tokens]))
                if progress is not None:
                    progress(index + 1, n_samples)
        finally:
            if state is not None and state.static is not None:
                state.static.release()
            drafter_obj.close()
        return samples

    def next_token_distribution(self, prompt: str | list[int], prefix: list[int] | None = None, settings=None, **kw):
        """The target's exact next-token distribution p after prompt (+ prefix), as a
        [V] float32 tensor, with the run's temperature / top-k / top-p applied."""
        settings = (settings or GenerationSettings()).merged(kw)
        params, _ = settings.validate()
        ids = self._prompt_ids(prompt, settings.chat) + list(prefix or [])
        model = self.target.model
        cache = model.new_cache(len(ids) + 1)
        return probs_from_logits(model.prefill(ids, cache), params)

    def run(self, prompt, drafter: str = "none", settings: GenerationSettings | None = None, **kw) -> dict:
        """Run to completion; returns {"events": [...], "text", "token_ids", "metrics"}."""
        run_events = list(self.generate(prompt, drafter, settings, **kw))
        finish = run_events[-1]
        return {
            "events": run_events,
            "text": finish["text"],
            "token_ids": finish["token_ids"],
            "metrics": finish["metrics"],
        }
