"""Memory planning before a load: will target + drafter + KV caches fit, and if not, say so with numbers.

``plan_memory(target, drafter, ...)`` sizes a run before anything is loaded:

* weights: the model is built from its config on the meta device with
  accelerate's ``init_empty_weights`` (no memory, any architecture transformers
  knows) and sized with accelerate's ``compute_module_sizes`` at the run's dtype;
  a tied output head is counted once, as our forward shares it;
* the drafter: ``ngram``, ``suffix`` and ``none`` hold nothing; ``int8`` is a second copy of the target's
  matrices in int8 (one byte per weight, a float32 scale per output channel) plus its embedding at the
  activation dtype; ``q4`` the matrices in Q4_1B (its head in int8 too), a bf16 embedding and a bf16 cache;
  a spec that combines drafters (``q4+ngram``, ``suffix/q4``) holds q4's; ``model:<id>`` is sized like a target;
* KV caches: keys and values for every layer and KV head, for the prompt, the new
  tokens and one verification pass of the draft budget (engine/decode.py sizes its
  caches the same way), in the attention dtype (float32 on the CPU); a model
  drafter has its own;
* working memory: one target pass's logits and the target's p rows kept per tree
  node (vocabulary-sized float32 rows);
* fixed-shape runners (``engine.model.runners``), where the run's passes take them (every run on CUDA with
  ``pass_graphs="auto"``, strict runs with ``"static"``): each run's target cache (and a model drafter's) is
  then its runner's, sized to the run's bucket (``run_bucket``: a power of two from 256 slots) instead of the
  exact slots; each runner adds its fixed buffers (the [16, S] mask, the logits and feature rows of the widest
  pass) and, with CUDA graphs, a graph memory pool shared by its widths that keeps every recorded width's
  outputs and one widest pass's activations (an estimate: the allocator's rounding is not counted);
* the load peak: the checkpoint's tensors and our converted copy coexist briefly.

Not counted: on the CPU, engine/kernels/pages.py puts the kernels' packed weights and every KV cache on 2 MB
pages, so each cache tensor may round up by under 2 MB and the last weights arena holds up to 32 MB not
yet handed out (only the pages touched are resident).

The memory available comes from accelerate's ``get_max_memory`` (free GPU memory
per device; available system memory via psutil), capped on Linux by the
process's cgroup limit. ``check_memory`` raises ``MemoryPlanError`` (a
ValueError) with the numbers when the plan needs more than ``USABLE_FRACTION`` of
what is available: a clear refusal instead of an out-of-memory crash midway.

Models too large for one device go to a vLLM deployment (README "Bigger
models"): our own forward runs on one device and does not split a model across
GPU and CPU.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.drafters.spec import DrafterMemory, MemorySizes, family, memory_of, parse

__all__ = ["USABLE_FRACTION", "MemoryPlan", "MemoryPlanError", "available_memory", "check_memory", "plan_memory"]

USABLE_FRACTION = 0.9  # head-room for the allocator, the interpreter and the OS
GIB = 1024**3
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class MemoryPlanError(ValueError):
    """The planned run does not fit in the memory available; the message has the numbers."""


@dataclass
class MemoryPlan:
    """Bytes a run needs, by part, against what the device has free."""

    target: str
    drafter: str
    device: str
    dtype: str
    target_bytes: int
    drafter_bytes: int
    kv_bytes: int
    drafter_kv_bytes: int
    working_bytes: int
    runner_bytes: int  # fixed-shape runners' buffers and graph pools (0 where the run's passes are eager)
    load_peak_bytes: int  # transient, during the load
    available_bytes: int
    context_tokens: int
    notes: list[str] = field(default_factory=list)

    @property
    def steady_bytes(self) -> int:
        parts = (self.target_bytes, self.drafter_bytes, self.kv_bytes, self.drafter_kv_bytes, self.working_bytes)
        return sum(parts) + self.runner_bytes

    @property
    def needed_bytes(self) -> int:
        return max(self.steady_bytes, self.load_peak_bytes)

    @property
    def usable_bytes(self) -> int:
        return int(self.available_bytes * USABLE_FRACTION)

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.usable_bytes

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "steady_bytes": self.steady_bytes,
            "needed_bytes": self.needed_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
        }

    def describe(self) -> str:
        """One line for the Model panel or an error message."""
        parts = [
            f"target {_gib(self.target_bytes)}",
            f"drafter {_gib(self.drafter_bytes)}",
            f"KV cache {_gib(self.kv_bytes + self.drafter_kv_bytes)} ({self.context_tokens} tokens)",
            f"working {_gib(self.working_bytes)}",
        ]
        if self.runner_bytes:
            parts.append(f"fixed-shape runners {_gib(self.runner_bytes)}")
        peak = f", load peak {_gib(self.load_peak_bytes)}" if self.load_peak_bytes > self.steady_bytes else ""
        return (
            f"{self.target} + {self.drafter} in {self.dtype} on {self.device}: needs {_gib(self.needed_bytes)} "
            f"({', '.join(parts)}{peak}); {_gib(self.available_bytes)} available, "
            f"{_gib(self.usable_bytes)} usable ({USABLE_FRACTION:.0%})"
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def available_memory(device: str = "cpu") -> int:
    """Free bytes on `device` ("cpu", "cuda", "cuda:N"): accelerate's get_max_memory (GPU free
    memory, or psutil's available system memory), capped by this process's cgroup limit on the CPU."""
    from accelerate.utils import get_max_memory

    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        memory = get_max_memory()
        if index not in memory:
            raise MemoryPlanError(f"no GPU {index} is visible")
        return int(memory[index])
    import psutil  # (not accelerate's get_max_memory here: it probes every CUDA device it believes exists)

    free = int(psutil.virtual_memory().available)
    limit = _cgroup_room()
    return min(free, limit) if limit is not None else free


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still allocate, None without a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=32)
def _config(target: str):
    """(transformers config, checkpoint dtype name or None) of a target name, preset, Hub id or folder.
    Reads only the config (the Hub's cache or network for an id)."""
    from transformers import AutoConfig

    from engine.model.loading import DEFAULT_MODEL, PRESETS, ModelLoadError
    from engine.paths import model_cache

    if target in ("default", DEFAULT_MODEL):
        folder = model_cache()
        if (folder / "config.json").is_file():
            return AutoConfig.from_pretrained(str(folder)), "float32"  # the cache stores float32 weights
        from engine.model.loading import default_gguf_path

        gguf = default_gguf_path()
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name), "float32"
    name = PRESETS.get(target, {}).get("hub_id", target)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the config of {target!r} to plan its memory: {exc}") from None
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return config, (str(stored).removeprefix("torch.") if stored else None)


@functools.lru_cache(maxsize=32)
def _weights(target: str) -> dict:
    """Parameter counts of a target from its config, built on the meta device (no memory)."""
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoModelForCausalLM

    config, stored = _config(target)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    total = compute_module_sizes(model, dtype=torch.float32)[""] // 4  # parameters (float32 = 4 bytes each)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_params = head.weight.numel() if head is not None else 0
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and head is not None and head.weight is not embed:
        total -= head_params  # our forward uses the embedding as the head: one copy
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return {
        "params": int(total),
        "embed_params": int(embed.numel()),
        "head_params": 0 if tied else int(head_params),
        "vocab": int(text.vocab_size),
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "hidden": int(text.hidden_size),
        "max_positions": int(getattr(text, "max_position_embeddings", 0) or 0),
        "stored_dtype": stored,
        "tied": tied,
    }


def _resolve(dtype: str, device: str, planned_elsewhere: bool = False) -> tuple[str, str]:
    """The plan's dtype and device. planned_elsewhere (the caller gave the memory available): a CUDA device
    may be planned for from a machine without one (sizing a GPU deployment from a laptop; "auto" is bf16 there)."""
    import torch

    from engine.model.loading import resolve_device, resolve_dtype

    if planned_elsewhere and str(device).startswith("cuda") and not torch.cuda.is_available():
        return str(resolve_dtype(dtype, str(device))).removeprefix("torch."), str(device)
    device = resolve_device(device)
    return str(resolve_dtype(dtype, device)).removeprefix("torch."), device


def plan_memory(
    target: str = "default",
    drafter: str = "ngram",
    *,
    dtype: str = "auto",
    device: str = "auto",
    k: int = 4,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    max_new_tokens: int = 64,
    prompt_tokens: int = 512,
    concurrent_runs: int = 1,
    available_bytes: int | None = None,
    pass_graphs: str = "auto",
    strict: bool = False,
) -> MemoryPlan:
    """What a run of `target` with `drafter` needs, by part, before anything is loaded.

    k, topk, num_draft_tokens: the tree (budget = num_draft_tokens or k * topk nodes per pass).
    concurrent_runs: runs sharing the loaded weights, each with its own caches (app sessions).
    available_bytes: override what the device has free (default: measured now); given, a CUDA device can be
                     planned for on a machine without one.
    pass_graphs, strict: the run's settings (``GenerationSettings``): whether its passes take fixed-shape
    runners (CUDA graphs on a CUDA device with "auto", uncaptured strict passes with "static").
    """
    dtype, device = _resolve(dtype, device, available_bytes is not None)
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    _check_counts(
        k=k, topk=topk, max_new_tokens=max_new_tokens, concurrent_runs=concurrent_runs, prompt_tokens=prompt_tokens
    )
    w = _weights(target)
    wbytes = _DTYPE_BYTES[dtype]
    attn_bytes = 4 if device == "cpu" else wbytes  # engine/model/transformer.py: float32 attention on the CPU
    spec = parse(drafter)
    budget = (num_draft_tokens if num_draft_tokens is not None else k * topk) if spec.drafts else 0
    width = budget + 1  # one target pass: the pending token plus the tree
    # engine/decode.py: prompt + new tokens + one pass, plus a pass of slack for the drafter.
    context = prompt_tokens + max_new_tokens + 2 * width + 1
    notes: list[str] = []
    if w["max_positions"] and prompt_tokens + max_new_tokens > w["max_positions"]:
        notes.append(f"prompt + new tokens exceed the context window ({w['max_positions']})")
    sizes = MemorySizes(w, wbytes, attn_bytes, device, context, concurrent_runs, _weights)
    kv_per_token = sizes.kv_per_token
    target_bytes = w["params"] * wbytes
    kv = kv_per_token * context * concurrent_runs
    held = _drafter_memory(spec, sizes, notes)
    drafter_bytes, drafter_kv = held.weight_bytes, held.kv_bytes
    # One pass's logits plus the p rows kept per tree position (float32, vocabulary-sized).
    working = (2 * width) * w["vocab"] * 4 * concurrent_runs
    runner_bytes = 0
    models = [w] + ([held.runs_model] if held.runs_model else [])
    runner = _runner_plan(models, device, pass_graphs, strict, width, context, wbytes)
    if runner is not None:  # the caches are the runners', at the run's bucket
        slots, per_run, note = runner
        kv, drafter_kv = kv_per_token * slots * concurrent_runs, drafter_kv // context * slots
        runner_bytes = per_run * concurrent_runs
        notes.append(note)
    stored = _DTYPE_BYTES.get(w["stored_dtype"] or "", wbytes)
    load_peak = w["params"] * stored + target_bytes + drafter_bytes  # checkpoint tensors + our copy
    if device.startswith("cuda"):
        load_peak = target_bytes + drafter_bytes  # the checkpoint is read to the host, converted on the way
    avail = int(available_bytes) if available_bytes is not None else available_memory(device)
    return MemoryPlan(
        target=target,
        drafter=spec.text,
        device=device,
        dtype=dtype,
        target_bytes=int(target_bytes),
        drafter_bytes=int(drafter_bytes),
        kv_bytes=int(kv),
        drafter_kv_bytes=int(drafter_kv),
        working_bytes=int(working),
        runner_bytes=int(runner_bytes),
        load_peak_bytes=int(load_peak),
        available_bytes=avail,
        context_tokens=int(context),
        notes=notes,
    )


def _drafter_memory(spec, sizes: MemorySizes, notes: list[str]) -> DrafterMemory:
    """The drafter's share (its family's estimate), its note added to `notes`; a model drafter whose family has
    no estimate is counted as nothing, and the notes say so."""
    held = memory_of(spec, sizes)
    if held is None:
        held = DrafterMemory()
        if family(spec.family).kind in ("model", "head"):
            notes.append(f"{spec.text} drafter: its weights and caches are not counted")
    if held.note:
        notes.append(held.note)
    return held


def _check_counts(**counts) -> None:
    """Each count a positive integer (k may be 0)."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "k" else 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _runner_plan(models, device, pass_graphs, strict, width, context, wbytes) -> tuple[int, int, str] | None:
    """(slots, bytes, note) of the fixed-shape runners a run takes (engine.model.runners), one per model: their
    slots (the bucket of the run's `context`), their bytes beside the caches; None where the passes are eager."""
    from engine.model.runners import STATIC_MAX_WIDTH, run_bucket  # (torch: imported when a plan is made)

    graphs = pass_graphs == "auto" and device.startswith("cuda")
    if not (graphs or (pass_graphs == "static" and strict)) or width > STATIC_MAX_WIDTH:
        return None
    slots = run_bucket(context, (models[0]["max_positions"] or context) + 2 * STATIC_MAX_WIDTH + 2)
    size = sum(_runner_bytes(m, slots, wbytes, graphs, STATIC_MAX_WIDTH) for m in models)
    note = f"fixed-shape runners of {slots} slots (the run's bucket)" + (
        ", with CUDA graph pools (an estimate)" if graphs else ""
    )
    return slots, size, note


def _runner_bytes(m: dict, slots: int, wbytes: int, graphs: bool, w_max: int) -> int:
    """One fixed-shape runner of `slots` slots (engine/model/static_pass.py), beside its cache: the mask [W, S]
    (bool), the widest pass's logits [W, V] (float32) and feature rows [W, E]; with graphs, the pool of its
    recorded widths: every width's logits kept as its output (sum of w over 1..W rows) and one widest pass's
    activations (the MLP's [W, 4E] and the attention's scores [W, heads, S] float32, roughly)."""
    rows_v = m["vocab"] * 4
    fixed = w_max * slots + w_max * rows_v + w_max * m["hidden"] * wbytes
    if not graphs:
        return fixed
    outputs = sum(range(1, w_max + 1)) * (rows_v + m["hidden"] * wbytes)
    heads = max(1, m["hidden"] // max(1, m["head_dim"]))
    activations = w_max * 4 * m["hidden"] * 4 + w_max * heads * slots * 4
    return fixed + outputs + activations


def check_memory(*args, **kwargs) -> MemoryPlan:
    """plan_memory, then refuse (MemoryPlanError with the numbers) when it does not fit."""
    plan = plan_memory(*args, **kwargs)
    if not plan.fits:
        raise MemoryPlanError(
            f"not enough memory: {plan.describe()}. Try a smaller K, tree budget or max_new_tokens, "
            "the n-gram drafter, bfloat16, or serve the model with vLLM (README: Bigger models) and "
            "connect with --vllm-url."
        )
    return plan
