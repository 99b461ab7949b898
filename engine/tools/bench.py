"""Benchmark harness: ``python -m engine bench``.

Runs a fixed workload suite (assets/workloads.json: chat, code-edit, summarize)
with greedy decoding on the target, for our engine's systems and the reference
points users would otherwise pick (transformers ``generate``, prompt lookup,
assisted generation), interleaved prompt by prompt so that machine noise hits
every system alike. Reports tokens/s (median over repeats), tokens per target
pass, acceptance, speedups, and a memory-bandwidth roofline: weight bytes read
per target pass divided by the measured copy bandwidth (the machine and its
bandwidth: engine/tools/bench_machine.py).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time

import torch

from engine import config, paths
from engine.decode import GenerationSettings, SpeculativeEngine
from engine.metrics import draft_token_cost_of, ratio_of_medians
from engine.model.static_pass import capture_available
from engine.tools.bench_machine import copy_bandwidth_now, machine_info

__all__ = ["SYSTEMS", "run_bench"]

SYSTEMS = [
    "engine-baseline",
    "engine-ngram",
    "engine-suffix",
    "engine-int8",
    "engine-q4",
    "engine-tree",
    "engine-eagle",
    "engine-ngram-adaptive",
    "engine-int8-adaptive",
    "engine-eagle-adaptive",
    "engine-q4-adaptive",
    "engine-q4-multilevel",
    "engine-q4-hybrid",
    "engine-torch-float32",
    "engine-baseline-eager",
    "engine-ngram-eager",
    "hf-generate",
    "hf-prompt-lookup",
    "hf-assisted",
    "llamacpp",
    "vllm-baseline",
    "vllm-ngram",
]
# vLLM's CPU build beside our engine (engine/vllm/server.py): started by the bench when
# .venv-vllm exists, or reached at SPECLENS_VLLM_URL; vllm-ngram drafts K tokens like engine-ngram.
VLLM_SYSTEMS = ("vllm-baseline", "vllm-ngram")
Q4_K = 6  # the q4 rows' K (chosen by measurement: docs/bench/README.md)
ENGINE_SYSTEMS = {
    "engine-baseline": ("none", {}),
    # K = 15: long verbatim copies (code edits) go through in few passes. Which K pays depends on
    # the host's pass costs (how much a wide pass costs against a one-token pass differs between kernel
    # variants: docs/bench/2026-12-07-notes-from-engine.md): engine-ngram-adaptive picks K per pass from those.
    "engine-ngram": ("ngram", {"k": 15}),
    # Suffix decoding (engine/drafters/suffix.py) at engine-ngram's K, remembering the answers it gave to the
    # workload's earlier prompts, as a chat session or an agent loop would (vLLM's suffix method keeps them
    # across requests): on the first prompt of a workload it is prompt lookup with a frequency-ranked tree.
    "engine-suffix": ("suffix", {"k": 15}),
    "engine-int8": ("int8", {"k": 3}),
    # Greedy int8 drafts are accepted most of the time, so branching buys little; a 3-node tree
    # keeps the pass at 4 rows (a cheap width for this BLAS: see pass_cost_ms).
    "engine-tree": ("int8", {"k": 2, "topk": 2, "num_draft_tokens": 3}),
    # The EAGLE head reads the target's own features (engine/drafters/eagle.py); K = 4, the depth its
    # training reports held-out acceptance for. Skipped with a note when no head exists for the target.
    "engine-eagle": ("eagle", {"k": 4}),
    # Adaptive depth (engine/drafters/adaptive.py) at the same maximum K as the fixed row beside it, so the
    # pair measures the policy alone: each pass drafts the depth in [1, K] with the most expected
    # tokens per measured ms, model drafters stop below the default confidence threshold.
    "engine-ngram-adaptive": ("ngram", {"k": 15, "adaptive": True}),
    "engine-int8-adaptive": ("int8", {"k": 3, "adaptive": True}),
    "engine-eagle-adaptive": ("eagle", {"k": 4, "adaptive": True}),
    # The target's own 4-bit weights (engine/drafters/model.py q4_weights): a draft pass reads about a third
    # of the target's bytes, so deeper drafts pay than int8's K = 3.
    "engine-q4": ("q4", {"k": Q4_K}),
    "engine-q4-adaptive": ("q4", {"k": Q4_K, "adaptive": True}),
    # Drafts of drafts (engine/drafters/multilevel.py): n-gram proposes q4's own chain, q4 checks it in one pass.
    "engine-q4-multilevel": ("q4+ngram", {"k": Q4_K}),
    # The hybrid (engine/drafters/hybrid.py): each pass, suffix decoding's proposal (up to engine-suffix's K,
    # with its history) or q4's chain of Q4_K levels, whichever the run has measured to give more tokens per ms.
    "engine-q4-hybrid": (f"suffix/q4:{Q4_K}", {"k": 15}),
}
# Our decoder, no drafter, on float32 weights with torch's own products and attention: what a
# host where none of our kernels runs gets (issue #16's "float32 path"), in the same run as the
# rows it is compared with (before, a separate process with SPECLENS_CPU_KERNEL=0, minutes apart
# on a machine whose speed drifts). Its greedy outputs may differ from the bf16 rows' (other weights).
TORCH_FLOAT32 = "engine-torch-float32"
# On a CUDA target every engine row replays its passes as CUDA graphs (engine/model/static_pass.py); these
# rows run the same systems with eager passes (the pass_graphs setting "off"), in the same run, so the graphs'
# gain is read as a ratio. On the CPU every row is eager already: they are left out with a note.
EAGER_ROWS = {"engine-baseline-eager": "engine-baseline", "engine-ngram-eager": "engine-ngram"}
NAME_WIDTH = max(len(name) for name in SYSTEMS)


def hf_dtype(engine: SpeculativeEngine) -> tuple[torch.dtype, str]:
    """transformers' dtype for the reference rows: the best for it on this host. The engine's
    own dtype, except bf16 on a CPU where torch has no fast bf16 product (no AVX512-BF16 / AMX,
    or capped below it): there a prefill-sized bf16 product is measured against float32 and
    the faster wins (on an AVX2-only host torch's bf16 product is many times slower than float32)."""
    dtype = engine.target.dtype
    if engine.target.model.device.type != "cpu" or dtype != torch.bfloat16:
        return dtype, "the engine's dtype"
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=gen), torch.randn(1536, 576, generator=gen)
    times = {}
    for dt in (torch.bfloat16, torch.float32):
        xd, wd = x.to(dt), w.to(dt)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            torch.nn.functional.linear(xd, wd)
            best = min(best, time.perf_counter() - t0)
        times[dt] = best
    ratio = times[torch.bfloat16] / times[torch.float32]
    if ratio > 1.2:
        return (
            torch.float32,
            f"bf16 product {ratio:.1f}x float32's time on this torch ({torch.backends.cpu.get_cpu_capability()})",
        )
    return dtype, f"bf16 product {ratio:.2f}x float32's time"


class _HF:
    """transformers' own decoding on the same weights, for the reference rows."""

    def __init__(self, engine: SpeculativeEngine):
        from transformers import AutoModelForCausalLM

        folder = engine.target.source.get("cache") or engine.target.source.get("id")
        self.device = engine.target.model.device
        self.dtype, self.dtype_why = hf_dtype(engine)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype).to(self.device)
        self.model.eval()
        self.eos = sorted(engine.eos_ids)
        self.assistant = None

    def load_assistant(self, engine: SpeculativeEngine) -> str | None:
        """Load the preset drafter as a transformers model; returns why not, or None."""
        from transformers import AutoModelForCausalLM

        from engine.model.loading import PRESETS, load_model

        name = engine.target.name
        drafter = PRESETS.get(name, {}).get("drafter")
        if not drafter:
            return f"no drafter model is paired with {name} (presets pair e.g. SmolLM2-360M-Instruct with the 135M)"
        try:
            loaded = load_model(drafter, engine.target.dtype, device=str(self.device))
            folder = loaded.source.get("cache") or loaded.source.get("id")
            self.assistant = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype).to(self.device)
        except Exception as exc:  # the row is optional: say why and go on
            return f"drafter {drafter} unavailable ({exc})"
        self.assistant.eval()
        return None

    def generate(self, prompt_ids: list[int], max_new: int, **kw) -> list[int]:
        ids = torch.tensor([prompt_ids], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=self.eos,
                pad_token_id=self.eos[0],
                **kw,
            )
        return out[0, len(prompt_ids) :].tolist()


def _llamacpp(engine):
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    from engine.model.loading import default_gguf_path

    return Llama(model_path=str(default_gguf_path()), n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)


def _vllm_backends(engine, systems: list[str], notes: list[str]) -> tuple[dict, list]:
    """{system: VllmBackend} for the vLLM rows asked for, and the servers started for them (the
    caller stops them). A server at SPECLENS_VLLM_URL serves the row of its mode; the others are
    started here from .venv-vllm; a row that cannot run is dropped with a note."""
    from engine.vllm.backend import VllmBackend
    from engine.vllm.client import ENV_URL, VllmError
    from engine.vllm.server import VllmServer, VllmServerError, ngram_config, why_unavailable

    k = ENGINE_SYSTEMS["engine-ngram"][1]["k"]
    wanted = [s for s in systems if s in VLLM_SYSTEMS]
    backends: dict = {}
    servers: list = []
    url = config.vllm_url()
    if url:
        try:
            backend = VllmBackend(url)
            info = backend.info()
            name = "vllm-ngram" if info["speculative"] else "vllm-baseline"
            if name in wanted:
                backends[name] = backend
                notes.append(f"{name}: the server at {ENV_URL} ({info['model']}, K = {info['k']})")
        except VllmError as exc:
            notes.append(f"vllm: {ENV_URL} unusable ({exc})")
    dtype = str(engine.target.dtype).removeprefix("torch.")
    launched = {}
    for name in wanted:
        if name in backends:
            continue
        reason = why_unavailable()
        if reason:
            notes.append(f"{name}: not run ({reason})")
            continue
        spec = ngram_config(k) if name == "vllm-ngram" else None
        launched[name] = VllmServer(speculative=spec, dtype=dtype).launch()  # start-ups overlap
    servers.extend(launched.values())
    for name, server in launched.items():
        try:
            server.wait()
        except VllmServerError as exc:
            notes.append(f"{name}: vLLM did not start ({str(exc).splitlines()[0]})")
            continue
        except BaseException:  # interrupted while waiting: leave no server behind
            for other in servers:
                other.stop()
            raise
        backends[name] = server.backend()
        notes.append(
            f"{name}: vLLM {backends[name].info()['version']} on this CPU, {dtype}, ready {server.start_s:.0f} s after launch"
        )
    for name in wanted:
        if name not in backends:
            systems.remove(name)
    return backends, servers


def _torch_float32_engine(engine, systems: list[str], notes: list[str]) -> SpeculativeEngine | None:
    """The target again in float32 on torch's ops only (TORCH_FLOAT32), or None with a note."""
    from engine.model.loading import load_model

    reason = None
    if engine.target.model.device.type != "cpu":
        reason = "a CPU comparison (our kernels against torch's ops on the same host)"
    else:
        try:
            loaded = load_model(engine.target.name, "float32", device="cpu")
            loaded.model.use_torch_ops()
            return SpeculativeEngine(loaded)
        except Exception as exc:  # an optional reference row: say why and go on
            reason = f"the float32 target could not be loaded ({exc})"
    notes.append(f"{TORCH_FLOAT32}: not run ({reason})")
    systems.remove(TORCH_FLOAT32)
    return None


def _drop_unavailable_drafters(engine, systems: list[str], notes: list[str]) -> None:
    """Engine rows whose drafter this target cannot have (no EAGLE head trained for it) are
    dropped, each with the engine's own reason as a note, like an uninstalled reference point."""
    for name in [s for s in systems if s in ENGINE_SYSTEMS and ENGINE_SYSTEMS[s][0] == "eagle"]:
        try:
            engine.drafter(ENGINE_SYSTEMS[name][0]).close()
        except ValueError as exc:
            notes.append(f"{name}: not run ({exc})")
            systems.remove(name)


def run_bench(
    engine: SpeculativeEngine,
    quick: bool = False,
    repeats: int | None = None,
    max_new_tokens: int | None = None,
    systems=None,
    progress=True,
    workloads_subset=None,
    events_check: bool = True,
    pass_costs: bool = True,
    verify_rules: bool = True,
) -> dict:
    """Run the suite; returns the report (see format_table and docs/bench/README.md).

    Three stages: (1) set-up (``_bench_setup``: workloads, which systems can run here and their
    engines or servers), (2) every system on every prompt, interleaved (``_interleaved_runs``),
    (3) aggregation into rows (``_aggregate``) and the greedy-output check (``_greedy_mismatches``).
    events_check adds a short measurement of the event stream's cost: engine-int8 on the chat
    prompts with payload off, reduced and full, interleaved; pass_costs the target's pass time by
    tokens in the pass; verify_rules the token and block acceptance rules on the same drafts (``_verify_rules``).
    """
    setup = _bench_setup(engine, quick, repeats, max_new_tokens, systems, workloads_subset)
    repeats, max_new, systems, workloads = setup["repeats"], setup["max_new"], setup["systems"], setup["workloads"]
    # vLLM servers started for the vLLM rows are stopped whatever happens below.
    try:
        samples, outputs = _interleaved_runs(engine, setup, progress)
        # The same copy measured again once every system has run: how far the machine's memory drifted meanwhile.
        machine = {**setup["machine"], "copy_bandwidth_gbs_after": copy_bandwidth_now(engine)}
        events = _event_overhead(engine, workloads, repeats, max_new, progress) if events_check else None
        pass_cost = pass_cost_ms(engine) if pass_costs else None
        rules = _verify_rules(engine, workloads, max_new, progress) if verify_rules else None
        return {
            "machine": machine,
            "settings": {"max_new_tokens": max_new, "repeats": repeats, "quick": quick, "greedy": True, "batch": 1},
            "rows": _aggregate(samples, machine, setup["plain"]),
            "greedy_mismatches": _greedy_mismatches(outputs),
            "event_overhead": events,
            "pass_cost_ms": pass_cost,
            "verify_rules": rules,
            "notes": setup["notes"],
            "date": time.strftime("%Y-%m-%d"),
        }
    finally:
        for server in setup["servers"]:
            server.stop()


def _bench_setup(engine, quick, repeats, max_new_tokens, systems, workloads_subset) -> dict:
    """(1) The workloads, the repeats and token count, the systems that can run here (with a note for
    each one dropped and why), the machine's description, and the reference engines or servers the rows
    need (transformers, llama.cpp, the float32 path, vLLM servers)."""
    workloads = json.loads((paths.ASSETS / "workloads.json").read_text())
    if workloads_subset:
        unknown = set(workloads_subset) - set(workloads)
        if unknown:
            raise ValueError(f"unknown workload {sorted(unknown)}; choose from {', '.join(workloads)}")
        workloads = {name: workloads[name] for name in workloads_subset}
    if quick:
        workloads = {name: prompts[:1] for name, prompts in workloads.items()}
    notes: list[str] = []
    explicit = systems is not None
    systems = list(systems or SYSTEMS)
    if quick and not explicit:
        # Starting vLLM takes minutes (graph compile on first start): the smoke run leaves it out.
        for name in VLLM_SYSTEMS:
            systems.remove(name)
            notes.append(f"{name}: not run in --quick (starting vLLM takes minutes; name it in --systems)")
    machine = machine_info(engine)
    _drop_unavailable_drafters(engine, systems, notes)
    if not capture_available(engine.target.model.device):
        for name in [s for s in systems if s in EAGER_ROWS]:
            systems.remove(name)
            notes.append(f"{name}: CUDA only (without CUDA graphs every row's passes are eager)")
    hf = _HF(engine) if any(s.startswith("hf-") for s in systems) else None
    if hf is not None:
        machine["hf_dtype"] = str(hf.dtype).removeprefix("torch.")
        notes.append(f"hf rows in {machine['hf_dtype']}: {hf.dtype_why}")
    if "hf-assisted" in systems:
        # Assisted generation needs a separate small drafter model with the same
        # vocabulary: the target's preset names one (e.g. SmolLM2-360M -> 135M).
        # The offline default has none (its int8 copy is ours, not a transformers
        # model), so there the row is reported as unavailable.
        reason = hf.load_assistant(engine) if hf is not None else "no transformers reference"
        if reason:
            notes.append(f"hf-assisted: {reason}")
            systems.remove("hf-assisted")
    llm = None
    if "llamacpp" in systems:
        llm = _llamacpp(engine)
        if llm is None:
            notes.append("llamacpp: llama-cpp-python not installed (optional)")
            systems.remove("llamacpp")
    plain = _torch_float32_engine(engine, systems, notes) if TORCH_FLOAT32 in systems else None
    vllm, servers = _vllm_backends(engine, systems, notes) if any(s in VLLM_SYSTEMS for s in systems) else ({}, [])
    return {
        "workloads": workloads,
        "repeats": repeats or (1 if quick else 3),
        "max_new": max_new_tokens or (32 if quick else 128),
        "systems": systems,
        "machine": machine,
        "notes": notes,
        "hf": hf,
        "llm": llm,
        "plain": plain,
        "vllm": vllm,
        "servers": servers,
    }


def _interleaved_runs(engine, setup: dict, progress) -> tuple[dict, dict]:
    """(2) Every system on every prompt, `repeats` times, the systems' order rotated each repeat so that
    the machine's drift falls on all of them alike (ratios are read within one run). Returns the runs by
    (system, workload) and each run's greedy token ids by (system, workload, prompt index)."""
    systems, repeats, max_new = setup["systems"], setup["repeats"], setup["max_new"]
    refs = dict(hf=setup["hf"], llm=setup["llm"], vllm=setup["vllm"], plain=setup["plain"])

    def run(name, ids, tokens, history=()):
        return _run_system(
            name, engine, refs["hf"], refs["llm"], ids, tokens, vllm=refs["vllm"], plain=refs["plain"], history=history
        )

    # Warm up every system once (first calls allocate and build the int8 drafter).
    warm = engine.encode_prompt("Hello")
    for name in systems:
        run(name, warm, 4)
    samples: dict[tuple[str, str], list[dict]] = {}
    outputs: dict[tuple[str, str, int], list[int]] = {}
    total = sum(len(p) for p in setup["workloads"].values()) * repeats * len(systems)
    done = 0
    for workload, prompts in setup["workloads"].items():
        for pi, prompt in enumerate(prompts):
            ids = engine.encode_prompt(prompt)
            for rep in range(repeats):
                order = systems[rep % len(systems) :] + systems[: rep % len(systems)]  # rotate
                for name in order:
                    # The system's own answers to this workload's earlier prompts (the suffix row drafts from them).
                    history = [outputs[(name, workload, j)] for j in range(pi)]
                    result = run(name, ids, max_new, history)
                    samples.setdefault((name, workload), []).append(result)
                    outputs[(name, workload, pi)] = result["token_ids"]
                    done += 1
                    if progress:
                        bar = "#" * int(30 * done / total)
                        print(
                            f"\r[{bar:<30}] {done}/{total} {name:<{NAME_WIDTH}} {workload:<10}",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
    if progress:
        print(file=sys.stderr)
    return samples, outputs


def _aggregate(samples: dict, machine: dict, plain) -> list[dict]:
    """(3) One row per (system, workload): median tokens/s over the repeats, tokens per pass, acceptance,
    our engine's pass and drafting times, the fraction of the memory roofline, and the ratios to
    engine-baseline and hf-generate (speedup: engine.metrics.ratio_of_medians of the repeats' tok/s; and c,
    the drafting cost in baseline passes: engine.metrics.draft_token_cost_of)."""
    rows = []
    for (name, workload), runs in samples.items():
        tokens = sum(r["new_tokens"] for r in runs)
        row = {
            "system": name,
            "workload": workload,
            "tok_per_s": statistics.median(_rates(runs)),
            "tokens_per_pass": sum(r["new_tokens"] for r in runs) / max(1, sum(r["passes"] for r in runs))
            if runs[0]["passes"]
            else None,
            "acceptance_rate": (sum(r["accepted"] for r in runs) / sum(r["drafted"] for r in runs))
            if sum(r["drafted"] for r in runs)
            else None,
            "new_tokens": tokens,
            "pass_path": runs[0].get("pass_path"),  # our engine's: eager, static or cuda-graph
        }
        drafted = sum(r["drafted"] for r in runs)
        if all(r.get("verify_s") is not None for r in runs):
            # Our engine's own timings: mean target pass, and the drafting time per drafted token.
            row["pass_ms"] = 1000.0 * sum(r["verify_s"] for r in runs) / max(1, sum(r["passes"] for r in runs))
            row["draft_ms_per_token"] = 1000.0 * sum(r["draft_s"] for r in runs) / drafted if drafted else None
        roofline = machine["roofline_passes_per_s"]
        if name == TORCH_FLOAT32:  # its own weights: float32, twice the bytes per pass
            roofline = machine["copy_bandwidth_gbs"] * 1e9 / plain.target.model.weight_bytes
        if row["tokens_per_pass"]:
            passes_per_s = row["tok_per_s"] / row["tokens_per_pass"]
            row["roofline_fraction"] = passes_per_s / roofline
        if row.get("pass_ms"):
            # The target passes alone (prefill and drafting left out): the weight bytes of one pass
            # over its measured mean time, against the copy bandwidth.
            row["pass_roofline_fraction"] = 1000.0 / row["pass_ms"] / roofline
        rows.append(row)
    by = {(r["system"], r["workload"]): r for r in rows}
    for r in rows:
        runs, workload = samples[(r["system"], r["workload"])], r["workload"]
        base = by.get(("engine-baseline", workload))
        # Each system's repeats rotate among the others, unpaired: the speedups are ratios of medians.
        for key, reference in (
            ("speedup_vs_engine_baseline", "engine-baseline"),
            ("speedup_vs_hf_generate", "hf-generate"),
        ):
            ref_runs = samples.get((reference, workload))
            r[key] = ratio_of_medians(_rates(runs), _rates(ref_runs)) if ref_runs else None
        # c of E / (K·c + 1): one drafted token's time in plain one-token target passes (the baseline's).
        if r.get("draft_ms_per_token") is not None and base and base.get("pass_ms"):
            drafted = sum(run["drafted"] for run in runs)
            r["draft_cost"] = draft_token_cost_of(
                1000.0 * sum(run["draft_s"] for run in runs), drafted, base["pass_ms"]
            )
    return rows


def _rates(runs: list[dict]) -> list[float]:
    """Each run's tokens per second (new tokens ÷ wall time): what a row's tok/s is the median of."""
    return [r["new_tokens"] / r["wall_s"] for r in runs]


def _greedy_mismatches(outputs: dict) -> list[dict]:
    """(3) Where a system on the same weights emitted other greedy tokens than engine-baseline: the first
    differing position of each such prompt (an empty list is greedy parity across the rows)."""
    mismatches = []
    for (name, workload, pi), toks in outputs.items():
        ref = outputs.get(("engine-baseline", workload, pi))
        if ref is None or name in ("engine-baseline", "llamacpp", TORCH_FLOAT32):  # the same weights only
            continue
        if toks != ref:
            at = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
            mismatches.append({"system": name, "workload": workload, "prompt": pi, "first_difference_at": at})
    return mismatches


PASS_WIDTHS = (1, 2, 3, 4, 5, 8, 9, 12, 16)


def pass_cost_ms(engine: SpeculativeEngine, widths=PASS_WIDTHS, prefix_len: int = 128) -> dict[str, float]:
    """Median ms of one target pass over W new tokens (W = K + 1 for a chain of K drafts):
    what verification costs against a plain one-token pass on this machine."""
    from engine.model.pass_timing import measure_pass_ms

    return {str(w): round(measure_pass_ms(engine.target.model, 1, w, prefix_len=prefix_len), 1) for w in widths}


EVENT_SYSTEM = "engine-int8"  # the system whose event stream is richest per pass (q and p for every draft)


def _event_overhead(engine, workloads, repeats, max_new, progress) -> dict:
    """tok/s of EVENT_SYSTEM with payload off / reduced / full, interleaved per prompt."""
    prompts = workloads.get("chat") or next(iter(workloads.values()))
    modes = ["off", "reduced", "full"]
    samples: dict[str, list[float]] = {m: [] for m in modes}
    # At least 4 rounds per prompt: the cost being measured (building event dicts) is a few
    # percent, below the spread of a single run on a shared machine.
    rounds = max(4, 2 * repeats)
    for prompt in prompts:
        ids = engine.encode_prompt(prompt)
        for rep in range(rounds):
            for mode in modes[rep % 3 :] + modes[: rep % 3]:
                result = _run_system(EVENT_SYSTEM, engine, None, None, ids, max_new, payload=mode)
                samples[mode].append(result["new_tokens"] / result["wall_s"])
        if progress:
            print(f"events: {len(samples['off'])}/{len(prompts) * rounds}", file=sys.stderr, flush=True)
    tps = {m: statistics.median(v) for m, v in samples.items()}
    return {
        "system": EVENT_SYSTEM,
        "workload": "chat" if "chat" in workloads else next(iter(workloads)),
        "tok_per_s": {m: round(v, 3) for m, v in tps.items()},
        # How much slower the event stream makes a run: the ratio of medians (modes rotated, unpaired) - 1.
        "slowdown_reduced": round(ratio_of_medians(samples["off"], samples["reduced"]) - 1.0, 4),
        "slowdown_full": round(ratio_of_medians(samples["off"], samples["full"]) - 1.0, 4),
    }


RULES_SYSTEM = "engine-int8"  # a model drafter: its q makes the two rules differ (a point mass's block test is p's)
RULES_TEMPERATURES = (0.7, 1.0)


def _verify_rules(engine, workloads, max_new, progress) -> dict:
    """The token and block acceptance rules on the same drafts: RULES_SYSTEM's chains (its K) on the chat prompts,
    sampled at each of RULES_TEMPERATURES with ``verify="block"``; for the drafts those passes verified, the expected
    tokens per pass of each rule from the recorded numbers (``metrics.rules_on_same_drafts``: no sampling noise
    between the rules), pooled over the prompts, and the measured tokens per pass of the block runs."""
    drafter, kw = ENGINE_SYSTEMS[RULES_SYSTEM]
    prompts = workloads.get("chat") or next(iter(workloads.values()))
    out = {}
    for temperature in RULES_TEMPERATURES:
        passes = token = block = measured = 0.0
        for index, prompt in enumerate(prompts):
            run = engine.run(
                engine.encode_prompt(prompt),
                drafter,
                max_new_tokens=max_new,
                temperature=temperature,
                seed=index,
                verify="block",
                payload="reduced",
                **kw,
            )
            rules = run["metrics"]["rules_on_same_drafts"]
            if rules:
                n = rules["passes"]
                passes += n
                token += rules["token_tokens_per_pass"] * n
                block += rules["block_tokens_per_pass"] * n
            measured += run["metrics"]["tokens_per_pass"]
        out[str(temperature)] = {
            "passes": int(passes),
            "token_tokens_per_pass": round(token / passes, 4) if passes else None,
            "block_tokens_per_pass": round(block / passes, 4) if passes else None,
            "measured_block_tokens_per_pass": round(measured / len(prompts), 4),
        }
        if progress:
            print(f"verify rules: T = {temperature} done", file=sys.stderr, flush=True)
    return {"system": RULES_SYSTEM, "k": kw.get("k"), "workload": "chat", "by_temperature": out}


def _timed(start_run) -> dict:
    """Run an event stream to its finish (started by start_run(), so the clock includes its start):
    wall time plus the finish event's counts."""
    t0 = time.perf_counter()
    finish = None
    for event in start_run():
        finish = event
    wall = time.perf_counter() - t0
    m = finish["metrics"]
    return {
        "token_ids": finish["token_ids"],
        "new_tokens": m["new_tokens"],
        "wall_s": wall,
        "passes": m["target_passes"],
        "pass_path": m.get("pass_path"),
        "accepted": m["accepted"],
        "drafted": m["drafted"],
        "draft_s": m.get("draft_s"),
        "verify_s": m.get("verify_s"),
    }


def _run_system(
    name, engine, hf, llm, ids, max_new, payload="reduced", vllm=None, plain=None, history=(), pass_graphs="auto"
) -> dict:
    if name == TORCH_FLOAT32:
        settings = GenerationSettings(max_new_tokens=max_new, temperature=0.0, payload=payload, seed=0)
        return _timed(lambda: plain.generate(ids, "none", settings))
    if name in EAGER_ROWS:
        return _run_system(EAGER_ROWS[name], engine, hf, llm, ids, max_new, payload, vllm, plain, history, "off")
    if name in ENGINE_SYSTEMS:
        drafter, kw = ENGINE_SYSTEMS[name]
        settings = GenerationSettings(
            max_new_tokens=max_new, temperature=0.0, payload=payload, seed=0, pass_graphs=pass_graphs, **kw
        )
        settings.history = tuple(history) if drafter.split("/", 1)[0] == "suffix" else ()  # (suffix/q4 too)
        return _timed(lambda: engine.generate(ids, drafter, settings))
    if name in VLLM_SYSTEMS:
        # The prompt as token ids (/v1/completions): exactly the ids our engine decodes from. Streamed
        # without logprobs (payload off): the chunks place vLLM's per-step counts, so passes are exact.
        return _timed(
            lambda: vllm[name].generate(ids, max_new_tokens=max_new, temperature=0.0, chat=False, seed=0, payload="off")
        )
    if name == "llamacpp":
        t0 = time.perf_counter()
        out = llm(llm.detokenize(ids).decode("utf-8", "ignore"), max_tokens=max_new, temperature=0.0)
        wall = time.perf_counter() - t0
        n = out["usage"]["completion_tokens"]
        return {"token_ids": [], "new_tokens": n, "wall_s": wall, "passes": n, "accepted": 0, "drafted": 0}
    kw = {}
    if name == "hf-prompt-lookup":
        kw = {"prompt_lookup_num_tokens": ENGINE_SYSTEMS["engine-ngram"][1]["k"]}  # same K as engine-ngram
    elif name == "hf-assisted":
        kw = {"assistant_model": hf.assistant}
    t0 = time.perf_counter()
    toks = hf.generate(ids, max_new, **kw)
    wall = time.perf_counter() - t0
    toks = _cut_at_eos(toks, engine.eos_ids)
    return {
        "token_ids": toks,
        "new_tokens": len(toks),
        "wall_s": wall,
        "passes": len(toks) if name == "hf-generate" else 0,
        "accepted": 0,
        "drafted": 0,
    }


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def format_table(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"machine: {m['cpu']}, {m['threads']} threads, {m['dtype']}, torch {m['torch']}, transformers {m['transformers']}",
        f"kernel: {m.get('cpu_kernel')}, weights {m.get('weights')}, torch ISA {m.get('torch_cpu_capability')}"
        f" (caps {m.get('torch_isa_caps')}), flags {' '.join(m.get('cpu_flags') or [])}"
        + (f", memory on {m['memory_pages']}" if m.get("memory_pages") else ""),
        f"roofline: {m['weight_bytes_per_pass'] / 1e6:.0f} MB of weights per pass / {m['copy_bandwidth_gbs']:.1f} GB/s copy bandwidth"
        f" = {m['roofline_passes_per_s']:.1f} passes/s"
        + (f" (read-only bandwidth {m['read_bandwidth_gbs']:.1f} GB/s)" if m.get("read_bandwidth_gbs") else "")
        + (
            f"; copy {m['copy_bandwidth_gbs_after']:.1f} GB/s after the runs"
            if m.get("copy_bandwidth_gbs_after")
            else ""
        ),
        f"settings: greedy, batch 1, {report['settings']['max_new_tokens']} new tokens, median of {report['settings']['repeats']}",
        "",
        f"{'system':<{NAME_WIDTH}} {'workload':<10} {'tok/s':>7} {'tok/pass':>8} {'accept':>7} {'vs base':>8} {'vs hf':>7} {'roofline':>8} {'pass':>5}",
    ]

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    for r in sorted(report["rows"], key=lambda r: (r["workload"], SYSTEMS.index(r["system"]))):
        lines.append(
            f"{r['system']:<{NAME_WIDTH}} {r['workload']:<10} {r['tok_per_s']:>7.2f} {fmt(r['tokens_per_pass'], '>8.2f'):>8} "
            f"{fmt(r['acceptance_rate'], '>7.2f'):>7} {fmt(r['speedup_vs_engine_baseline'], '>7.2f')}x "
            f"{fmt(r['speedup_vs_hf_generate'], '>6.2f')}x {fmt(r.get('roofline_fraction'), '>8.0%'):>8}"
            f" {fmt(r.get('pass_roofline_fraction'), '>5.0%'):>5}"
        )
    if report["greedy_mismatches"]:
        lines.append("")
        lines.append("greedy outputs that differ from engine-baseline:")
        for mm in report["greedy_mismatches"]:
            lines.append(
                f"  {mm['system']} {mm['workload']} prompt {mm['prompt']}: first difference at token {mm['first_difference_at']}"
            )
    else:
        lines.append("\nall greedy outputs identical to engine-baseline")
    ev = report.get("event_overhead")
    if ev:
        t = ev["tok_per_s"]
        lines.append(
            f"event stream ({ev['system']}, {ev['workload']}): off {t['off']:.2f} tok/s, reduced {t['reduced']:.2f}"
            f" ({ev['slowdown_reduced']:+.1%}), full {t['full']:.2f} ({ev['slowdown_full']:+.1%})"
        )
    costs = report.get("pass_cost_ms")
    if costs:
        one = costs.get("1") or 1.0
        lines.append(
            "target pass cost by tokens in the pass: "
            + ", ".join(f"{w}: {ms:.0f} ms ({ms / one:.2f}x)" for w, ms in costs.items())
        )
    rules = report.get("verify_rules")
    if rules:
        for temperature, r in rules["by_temperature"].items():
            if r["passes"]:
                lines.append(
                    f"acceptance rules on the same drafts ({rules['system']}, K = {rules['k']}, {rules['workload']}, "
                    f"T = {temperature}, {r['passes']} passes): token {r['token_tokens_per_pass']:.3f}, "
                    f"block {r['block_tokens_per_pass']:.3f} tokens/pass expected; block runs measured "
                    f"{r['measured_block_tokens_per_pass']:.2f}"
                )
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
