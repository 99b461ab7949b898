"""The GPU figures in one JSON (docs/bench/gpu-latest.json) and a short report beside it: what the prepared
device run (scripts/gpu_check.sh) measures, each against the target issue #31 set.

    python scripts/gpu_latest.py [--device cuda] [--out docs/bench] [--quick]
    python scripts/gpu_latest.py --record-training RC SECONDS [--decision FILE] --out DIR   (after train-head)

Written as it goes: gpu-latest.json / .md are rewritten (atomically: a temporary file, then a rename) after
every figure, so a run killed by its time limit leaves a valid JSON of what it measured, with
``"complete": false``; the last write sets it true. Every required key (REQUIRED) is present from the
first write: None until measured, and None with a reason in ``reasons`` when it cannot be measured here
(a CUDA-only figure on the CPU) or its step failed. ``GPU_LATEST_STOP_AFTER=N`` kills this process
(SIGKILL, no clean-up) right after the N-th figure is written: how the test checks the partial file.

Every figure is measured in this process, none estimated (one model load for all of them):
  pass_ms_1, pass_ms_16   the target's strict pass of 1 and 16 tokens over a 128-token prefix, through the
                          engine's own fixed-shape runner (engine.model.runners: the one decode runs use, of
                          its capacity): replayed CUDA graphs on a GPU, the same function uncaptured elsewhere
  eager_pass_ms_1         the eager one-token pass the decode loop runs without graphs (no mask)
  launches_per_pass       {"eager", "cuda-graph"}: host CUDA launches per one-token pass (torch's profiler;
                          CUDA only)
  parity_static           (a) the graph path against the same fixed-shape pass uncaptured, bit for bit: on
                          CUDA graph replays ("auto") against the static strict pass ("static"); on the
                          CPU, where nothing is captured, the static strict pass against the eager strict
                          pass ("off", strict). Pass logits at widths 1, 5, 16, and whole greedy runs.
  parity_speculative      (b) speculative against plain greedy decoding, both on the graph path (CUDA
                          "auto"; the static strict path on the CPU): the first position where the tokens
                          differ, if any, and the target's top-2 logit margin there. The passes differ in
                          width (1 token against 1 + K), and cuBLAS / SDPA results are not invariant to
                          batch or sequence length, so on a GPU a bf16 run may take the other branch of a
                          near-tie with no bug. A near-tie is a margin at most NEAR_TIE[dtype] times the
                          row's largest |logit| with the two tokens the row's top two: "numerics". Any
                          other divergence is "bug" (the step fails).
  baseline_tok_s          the baseline's median tokens per second over 128 new tokens
  ngram_code_edit_speedup the measured speedup of n-gram (K = 15) on the code-edit prompts: alternating pairs
                          (engine.tools.race), the median over prompts, with each prompt's interval
  eagle_chat_speedup      the same for the EAGLE head (K = 4) on the chat prompts
  eagle_heldout_tokens_per_pass  the head's tokens per pass, greedy, K = 4, on held-out prompts it never saw
  chi_square              sampled EAGLE (T = 0.8, K = 4; on CUDA its chains are verified by the Triton
                          kernel, chain_verifier "auto") first tokens against the target's exact p
                          (engine.tools.exactness.chi_square_test at TEST_LEVEL); a rejection fails the step
Medians after a warm-up run of every configuration (the first run in a process was 4x slower on the H200).
``--device cpu --quick`` runs the same steps with fewer tokens (gpu_check.sh --dry-run, and its test).
Exit status: 0 when every figure that can run here was measured and the parity and chi-square held, else 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.host import host_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {  # issue #31, on the H200
    "pass_ms_1": ("<=", 2.5),
    "pass_ms_16": ("<=", 3.0),
    "baseline_tok_s": (">=", 350.0),
    "ngram_code_edit_speedup": (">=", 3.0),
    "eagle_chat_speedup": (">=", 1.5),
    "eagle_heldout_tokens_per_pass": (">=", 2.0),
}
# The keys the device issue requires in gpu-latest.json: all present from the first write.
REQUIRED = (
    "device",
    "date",
    "pass_ms_1",
    "pass_ms_16",
    "eager_pass_ms_1",
    "launches_per_pass",
    "baseline_tok_s",
    "ngram_code_edit_speedup",
    "eagle_chat_speedup",
    "eagle_heldout_tokens_per_pass",
    "parity_static",
    "parity_speculative",
    "chi_square",
)
# A divergence of speculative from plain greedy decoding is a near-tie (numerics) when the target's top-2
# margin there is at most this fraction of the row's largest |logit| (bf16 keeps 8 significant bits, 2^-8:
# a few roundings over 30 layers; float32's 2^-24 is far below what TF32 / reduction order can move).
NEAR_TIE = {"bfloat16": 2**-5, "float16": 2**-7, "float32": 1e-4}
PREFIX = list(range(100, 228))  # 128 tokens: the prefix every pass timing runs over
STOP_ENV = "GPU_LATEST_STOP_AFTER"
QUICK_WINDOW = 512  # --quick: the runners' window (the default model's full one attends over ~8200 slots a pass)


class Skipped:
    """A figure that cannot be measured here: recorded as None, with the reason in report["reasons"]."""

    def __init__(self, reason: str):
        self.reason = reason


class Report:
    """gpu-latest.json / .md, rewritten atomically after every figure."""

    def __init__(self, out: Path, head: dict):
        self.out = out
        self.data = {"complete": False, **{key: None for key in REQUIRED}, **head, "reasons": {}, "failed": []}
        self.figures = 0
        stop = os.environ.get(STOP_ENV)
        self.stop_after = int(stop) if stop else None

    def write(self) -> None:
        self.data["targets"] = targets(self.data)
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (
            ("gpu-latest.json", json.dumps(self.data, indent=1) + "\n"),
            ("gpu-latest.md", render(self.data)),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)

    def figure(self, name: str, keys: tuple[str, ...], measure) -> None:
        """Measure one figure (measure() -> {key: value or Skipped}), record it or why not, write both files."""
        t0 = time.perf_counter()
        print(f"[gpu_latest] {name} ...", file=sys.stderr, flush=True)
        try:
            values = measure()
        except Exception as exc:  # one figure's failure must not cost the others
            traceback.print_exc()
            values = {key: Skipped(f"failed: {type(exc).__name__}: {exc}") for key in keys}
            self.data["failed"].append(name)
        for key, value in values.items():
            if isinstance(value, Skipped):
                self.data[key] = None
                self.data["reasons"][key] = value.reason
            else:
                self.data[key] = value
        self.data.setdefault("seconds_by_figure", {})[name] = round(time.perf_counter() - t0, 1)
        self.write()
        self.figures += 1
        shown = {k: self.data[k] for k in keys if not isinstance(self.data[k], (dict, list))}
        print(f"[gpu_latest] {name}: {shown or 'recorded'} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        if self.stop_after is not None and self.figures >= self.stop_after:
            print(f"[gpu_latest] {STOP_ENV}={self.stop_after}: killing this process", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def describe_device(device: torch.device) -> tuple[str, dict]:
    """(one line, engine.host's record) for the machine the run happens on."""
    kernel = None
    if device.type == "cpu":
        from engine.kernels import cpu_build

        kernel = cpu_build.variant()
    info = host_info(device, kernel)
    if device.type == "cuda":
        return f"{info['gpu']} (host CPU {info['cpu']})", info
    return f"{info['cpu']}, {info['threads']} torch threads, CPU kernel {info['kernel'] or 'none (torch ops)'}", info


def targets(report: dict) -> dict:
    out = {}
    for key, (op, bound) in TARGETS.items():
        value = report.get(key)
        met = None if value is None else (value <= bound) if op == "<=" else (value >= bound)
        out[key] = {"want": f"{op} {bound}", "met": met}
    return out


# ------------------------------------------------------------------------------------------- the figures
def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and, with graphs, the recording)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # returns host logits: the device is synchronised
        times.append((time.perf_counter() - t0) * 1000.0)
    return round(statistics.median(times), 3)


def _chain_mask(width: int, base: int, capacity: int) -> torch.Tensor:
    """[width, capacity] bool: row 0 the pending token at slot base, row i a chain's i-th drafted token."""
    mask = torch.zeros(width, capacity, dtype=torch.bool)
    mask[:, : base + 1] = True
    for i in range(1, width):
        mask[i, base + 1 : base + 1 + i] = True
    return mask


def _held_runner(engine, capture: bool):
    """The engine's own fixed-shape runner of the target (engine.model.runners), held, the prefix prefilled."""
    model = engine.target.model
    runner = engine.runners.acquire(model, capture, len(PREFIX) + 16, 16)
    if runner is None:
        raise RuntimeError("the engine's runner pool gave no fixed-shape runner")
    model.prefill(PREFIX, runner.cache)
    return runner


def pass_times(engine, repeats: int) -> dict:
    """ms per strict pass of 1 and 16 tokens (the engine's runner) and per eager one-token pass."""
    from engine.model.static_pass import capture_available

    model = engine.target.model
    runner = _held_runner(engine, capture_available(model.device))
    base = runner.cache.length
    out = {"pass_path": "cuda-graph" if runner.capture else "static", "pass_slots": runner.capacity}
    try:
        for width in (1, 16):
            mask = _chain_mask(width, base, runner.capacity)
            tokens, positions = [7] * width, [base + i for i in range(width)]

            def strict_pass(tokens=tokens, positions=positions, mask=mask):
                runner.cache.length = base
                return runner.run(tokens, positions, mask)

            out[f"pass_ms_{width}"] = _median_ms(strict_pass, repeats)
    finally:
        runner.release()
    eager = model.new_cache(512)
    model.prefill(PREFIX, eager)

    def eager_pass():
        eager.length = base
        return model.run_pass(torch.tensor([7]), torch.tensor([base]), eager)

    out["eager_pass_ms_1"] = _median_ms(eager_pass, repeats)
    out["graphs_recorded"] = sum(r.captured for r in engine.runners.held(model))
    return out


def launches(engine) -> dict:
    if engine.target.model.device.type != "cuda":
        return {"launches_per_pass": Skipped("CUDA only: torch's profiler counts CUDA kernel and graph launches")}
    from engine.tools.bench_machine import launches_per_pass

    return {"launches_per_pass": launches_per_pass(engine)}


def static_parity(engine, prompts, tokens: int) -> dict:
    """(a): the graph path against the same fixed-shape pass uncaptured (CUDA), or the static strict pass
    against the eager strict pass (CPU); pass logits bit for bit, and whole greedy runs token for token."""
    from engine.model.static_pass import StaticPasses, capture_available

    model = engine.target.model
    cuda = capture_available(model.device)
    got_mode, want_mode = ("auto", "static") if cuda else ("static", "off")
    passes = []
    runner = _held_runner(engine, cuda)  # the captured runner on CUDA, the uncaptured one elsewhere
    try:
        base = runner.cache.length
        if cuda:
            reference = StaticPasses(model, runner.capacity, runner.max_width, capture=False)
            reference.acquire(runner.capacity)
            model.prefill(PREFIX, reference.cache)
        else:
            reference = model.new_cache(runner.capacity)
            model.prefill(PREFIX, reference)
        for width in (1, 5, 16):
            mask = _chain_mask(width, base, runner.capacity)
            tokens_w, positions = list(range(3, 3 + width)), [base + i for i in range(width)]
            runner.cache.length = base
            got = runner.run(tokens_w, positions, mask).logits
            if cuda:
                reference.cache.length = base
                want = reference.run(tokens_w, positions, mask).logits
            else:
                reference.length = base
                want = model.run_pass(
                    torch.tensor(tokens_w), torch.tensor(positions), reference, mask=mask, attend_len=runner.capacity
                ).logits
            passes.append(
                {
                    "width": width,
                    "identical": bool(torch.equal(got, want)),
                    "max_abs_diff": float((got - want).abs().max()),
                }
            )
    finally:
        runner.release()
    # Whole greedy runs: every reference run first, then every graph-path run (the pool keeps runners of one
    # capture kind, so alternating would re-record the graphs each time).
    cases = [(p, d, s) for p in prompts for d, s in (("none", {}), ("ngram", {"k": 8}), ("eagle", {"k": 4}))]
    settings = dict(max_new_tokens=tokens, temperature=0.0, strict=True)
    want = [engine.run(p, d, pass_graphs=want_mode, **settings, **s) for p, d, s in cases]
    got = [engine.run(p, d, pass_graphs=got_mode, **settings, **s) for p, d, s in cases]
    runs = [
        {
            "drafter": d,
            "identical": g["token_ids"] == w["token_ids"],
            "pass_path": g["metrics"]["pass_path"],
            "reference_path": w["metrics"]["pass_path"],
        }
        for (_, d, _), g, w in zip(cases, got, want)
    ]
    # On CUDA both sides of a pass are the same function, captured or not: bit for bit. On the CPU the eager
    # strict pass runs our CPU kernels and the static one torch's ops, so their logits differ in the last bits
    # (tests/test_static_pass.py compares them bit for bit on torch's ops alone); the runs must still agree.
    ok = all(r["identical"] for r in runs) and (not cuda or all(p["identical"] for p in passes))
    compared = (
        "graph replays against the uncaptured static strict pass"
        if cuda
        else ("the static strict pass against the eager strict pass (no CUDA graphs here)")
    )
    must = (
        "required: the same function captured and not"
        if cuda
        else ("not required here: the eager CPU pass runs our kernels, the static one torch's ops")
    )
    value = {"ok": ok, "compared": compared, "passes_must_match": must, "passes": passes, "runs": runs}
    if not ok:
        raise ParityBroken("parity_static", value)
    return {"parity_static": value}


class ParityBroken(Exception):
    """A parity that must hold did not: the figure is recorded, and the step fails."""

    def __init__(self, key: str, value: dict):
        super().__init__(f"{key} does not hold")
        self.key, self.value = key, value


def _divergence(engine, prompt, plain: list[int], spec: list[int], near_tie: float) -> dict | None:
    """None when the runs agree (as far as both go); else the first differing position, the target's top-2
    logit margin there (an eager prefill of prompt + the common prefix) and the verdict."""
    at = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if at is None:
        return None
    model = engine.target.model
    ids = engine.prompts.ids(prompt, True) + plain[:at]
    cache = model.new_cache(len(ids) + 1)
    logits = model.prefill(ids, cache).float().flatten()  # [V]
    top = torch.topk(logits, 2)
    margin = float(top.values[0] - top.values[1])
    scale = float(logits.abs().max())
    top2 = {int(t) for t in top.indices}
    tie = margin <= near_tie * scale and {plain[at], spec[at]} == top2
    return {
        "position": at,
        "plain_token": plain[at],
        "speculative_token": spec[at],
        "top2_margin": round(margin, 5),
        "logit_scale": round(scale, 3),
        "relative_margin": round(margin / scale, 6) if scale else None,
        "tokens_are_top2": {plain[at], spec[at]} == top2,
        "verdict": "numerics (near-tie)" if tie else "bug",
    }


def speculative_parity(engine, prompts, tokens: int) -> dict:
    """(b): speculative against plain greedy decoding on the graph path (CUDA "auto"; "static" strict here)."""
    from engine.model.static_pass import capture_available

    cuda = capture_available(engine.target.model.device)
    settings = dict(max_new_tokens=tokens, temperature=0.0, pass_graphs="auto" if cuda else "static", strict=True)
    near_tie = NEAR_TIE.get(str(engine.target.dtype).removeprefix("torch."), NEAR_TIE["float32"])
    rows = []
    for prompt in prompts:
        plain = engine.run(prompt, "none", **settings)
        for drafter, shape in (("ngram", {"k": 15}), ("eagle", {"k": 4})):
            spec = engine.run(prompt, drafter, **settings, **shape)
            div = _divergence(engine, prompt, plain["token_ids"], spec["token_ids"], near_tie)
            rows.append(
                {
                    "drafter": drafter,
                    "pass_path": spec["metrics"]["pass_path"],
                    "tokens": len(spec["token_ids"]),
                    "identical": div is None,
                    "divergence": div,
                }
            )
    bugs = [r for r in rows if r["divergence"] and r["divergence"]["verdict"] == "bug"]
    value = {
        "ok": not bugs,
        "near_tie_threshold": f"top-2 margin <= {near_tie:g} x the row's largest |logit|, the two tokens the top two",
        "identical": sum(r["identical"] for r in rows),
        "near_ties": sum(bool(r["divergence"]) for r in rows) - len(bugs),
        "bugs": len(bugs),
        "runs": rows,
    }
    if bugs:
        raise ParityBroken("parity_speculative", value)
    return {"parity_speculative": value}


def tok_s(engine, prompt, tokens: int, repeats: int) -> dict:
    engine.run(prompt, "none", max_new_tokens=min(8, tokens))
    runs = [engine.run(prompt, "none", max_new_tokens=tokens, temperature=0.0) for _ in range(repeats)]
    return {
        "baseline_tok_s": round(statistics.median(r["metrics"]["tokens_per_s"] for r in runs), 1),
        "baseline_pass_path": runs[-1]["metrics"]["pass_path"],
    }


def speedups(engine, prompts, drafter: str, k: int, tokens: int, pairs: int, key: str) -> dict:
    from engine.tools.race import race

    per_prompt = []
    for prompt in prompts:
        result = race(engine, prompt, drafter, pairs=pairs, k=k, max_new_tokens=tokens, temperature=0.0)
        per_prompt.append({name: result[name] for name in ("speedup", "low", "high", "verdict")})
        per_prompt[-1]["tokens_per_pass"] = result["speculative_tokens_per_pass"]
    return {
        key: round(statistics.median(p["speedup"] for p in per_prompt), 3),
        key.removesuffix("_speedup"): per_prompt,
    }


def heldout_tpp(engine, count: int, tokens: int) -> dict:
    from engine.training.head_data import held_out_texts

    held = sorted(held_out_texts())[:count]
    tpp = [
        engine.run(p, "eagle", k=4, max_new_tokens=tokens, temperature=0.0)["metrics"]["tokens_per_pass"] for p in held
    ]
    return {"eagle_heldout_tokens_per_pass": round(statistics.mean(tpp), 3)}


def chi_square(engine, prompt, n: int) -> dict:
    from engine.tools.exactness import TEST_LEVEL, as_distribution, chi_square_test, exactness_verdict
    from engine.tools.samples import next_token_distribution, sample_next_tokens

    settings = dict(temperature=0.8, k=4, seed=0)
    t0 = time.perf_counter()
    samples = sample_next_tokens(engine, prompt, "eagle", n_samples=n, n_tokens=1, **settings)
    sampling_s = time.perf_counter() - t0
    p = as_distribution(next_token_distribution(engine, prompt, temperature=0.8))
    test = chi_square_test(Counter(s[0] for s in samples), p, n)
    value = {
        "drafter": "eagle",
        **settings,
        "n": n,
        "chain_verifier": "batch (Triton kernel)" if engine.target.model.device.type == "cuda" else "walk",
        "pvalue": test["pvalue"],
        "tv": round(test["tv"], 4),
        "cells": test["cells"],
        "level": TEST_LEVEL,
        "verdict": exactness_verdict(test),
        "samples_per_s": round(n / sampling_s, 1),
    }
    value["ok"] = test["pvalue"] is None or test["pvalue"] >= TEST_LEVEL
    if not value["ok"]:
        raise ParityBroken("chi_square", value)
    return {"chi_square": value}


def _measured(report: Report, name: str, keys: tuple[str, ...], measure) -> None:
    """report.figure, where a broken parity is recorded as measured (with ok false) and counted as failed."""

    def run():
        try:
            return measure()
        except ParityBroken as broken:
            report.data["failed"].append(name)
            return {broken.key: broken.value}

    report.figure(name, keys, run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench"), help="folder for gpu-latest.json/.md")
    parser.add_argument("--quick", action="store_true", help="fewer tokens, prompts and samples (a smoke run)")
    parser.add_argument(
        "--record-training",
        nargs=2,
        metavar=("RC", "SECONDS"),
        help="add the head-training step's outcome to the JSON in --out (gpu_check.sh runs it after train-head)",
    )
    parser.add_argument("--decision", default=None, help="with --record-training: train-head's decision.json")
    args = parser.parse_args(argv)
    if args.record_training:
        return record_training(Path(args.out), args.device, *args.record_training, args.decision)
    quick = args.quick
    tokens, repeats, pairs, samples = (12, 3, 3, 60) if quick else (128, 20, 5, 3000)
    workloads = json.loads((ROOT / "assets" / "workloads.json").read_text())
    t0 = time.perf_counter()
    from engine import SpeculativeEngine

    engine = SpeculativeEngine.load(device=args.device)
    if quick:  # fixed-shape runners sized for a short window: the same code, passes over fewer cache slots
        from engine.model.runners import RunnerPool

        engine.runners = RunnerPool(QUICK_WINDOW)
    device = engine.target.model.device
    name, info = describe_device(device)
    report = Report(
        Path(args.out),
        {
            "device": name,
            "host": info,
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "dtype": engine.target.weight_kind,
            "quick": quick,
            "runner_window": QUICK_WINDOW if quick else engine.target.context_window,
            "head": "the shipped head (assets/heads), measured before this run's train-head step",
            "load_s": round(time.perf_counter() - t0, 1),
        },
    )
    report.write()  # every required key present (None) from the start
    chat = workloads["chat"][:1] if quick else workloads["chat"]
    code = workloads["code-edit"][:1] if quick else workloads["code-edit"]
    report.figure("pass times", ("pass_ms_1", "pass_ms_16", "eager_pass_ms_1"), lambda: pass_times(engine, repeats))
    report.figure("launches", ("launches_per_pass",), lambda: launches(engine))
    _measured(report, "parity static", ("parity_static",), lambda: static_parity(engine, chat[:1] + code[:1], tokens))
    _measured(
        report,
        "parity speculative",
        ("parity_speculative",),
        lambda: speculative_parity(engine, chat[:1] + code[:1], tokens),
    )
    report.figure("baseline tok/s", ("baseline_tok_s",), lambda: tok_s(engine, chat[0], tokens, repeats=3))
    report.figure(
        "ngram speedup",
        ("ngram_code_edit_speedup",),
        lambda: speedups(engine, code, "ngram", 15, tokens, pairs, "ngram_code_edit_speedup"),
    )
    report.figure(
        "eagle speedup",
        ("eagle_chat_speedup",),
        lambda: speedups(engine, chat, "eagle", 4, tokens, pairs, "eagle_chat_speedup"),
    )
    report.figure(
        "eagle held-out", ("eagle_heldout_tokens_per_pass",), lambda: heldout_tpp(engine, 2 if quick else 8, tokens)
    )
    _measured(report, "chi-square", ("chi_square",), lambda: chi_square(engine, chat[0], samples))
    report.data["seconds"] = round(time.perf_counter() - t0, 1)
    report.data["complete"] = True
    report.write()
    print(render(report.data))
    return 1 if report.data["failed"] else 0


def record_training(out: Path, device: str, rc: str, seconds: str, decision: str | None) -> int:
    """Add {"head_training"} to gpu-latest.json (atomically): where the head was trained (engine.host's record
    of this machine), how the time-boxed step ended, and train-head's decision when it wrote one."""
    path = out / "gpu-latest.json"
    data = json.loads(path.read_text()) if path.exists() else {"complete": False, "reasons": {}, "failed": []}
    where = torch.device("cuda" if device in ("cuda", "auto") and torch.cuda.is_available() else "cpu")
    name, info = describe_device(where)
    record = {"device": name, "host": info, "rc": int(rc), "seconds": int(seconds)}
    record["ended"] = (
        "finished" if record["rc"] == 0 else "time box reached (resumable)" if record["rc"] in (124, 137) else "failed"
    )
    if decision and Path(decision).exists():
        record["decision"] = json.loads(Path(decision).read_text())
    data["head_training"] = record
    report = Report(out, {})
    report.data = data
    report.write()
    print(f"head training on {name}: {record['ended']} (rc={rc}, {seconds}s)")
    return 0


def _cell(value) -> str:
    return "—" if value is None else str(value)


def render(report: dict) -> str:
    quick = " (quick smoke run)" if report.get("quick") else ""
    state = "" if report.get("complete") else " **Partial: the run stopped before its last figure.**"
    lines = [
        f"# GPU figures, {report.get('date')}",
        "",
        f"{report.get('device')}, torch {report.get('torch')}, {report.get('dtype')}, passes "
        f"{report.get('pass_path', '—')}{quick}. Written by `scripts/gpu_latest.py`; every figure measured in that "
        f"run.{state}",
        "",
        "| figure | measured | target (H200) | met |",
        "|---|---|---|---|",
    ]
    for key, target in (report.get("targets") or {}).items():
        met = {True: "yes", False: "no", None: "—"}[target["met"]]
        lines.append(f"| {key} | {_cell(report.get(key))} | {target['want']} | {met} |")
    lines.append(f"| eager_pass_ms_1 | {_cell(report.get('eager_pass_ms_1'))} | (before graphs) | |")
    lines.append(f"| launches_per_pass | {_cell(report.get('launches_per_pass'))} | | |")
    lines.append("")
    static = report.get("parity_static")
    if static:
        runs = sum(r["identical"] for r in static["runs"])
        passes = sum(p["identical"] for p in static["passes"])
        lines.append(
            f"Parity (a), {static['compared']}: greedy runs {runs}/{len(static['runs'])} identical; pass logits "
            f"{passes}/{len(static['passes'])} bit-identical ({static['passes_must_match']})."
        )
    spec = report.get("parity_speculative")
    if spec:
        lines.append(
            f"Parity (b), speculative against plain greedy: {spec['identical']}/{len(spec['runs'])} identical, "
            f"{spec['near_ties']} near-ties, {spec['bugs']} bugs ({spec['near_tie_threshold']})."
        )
    chi = report.get("chi_square")
    if chi:
        lines.append(
            f"Chi-square, sampled {chi['drafter']} (T = {chi['temperature']}, K = {chi['k']}, N = {chi['n']}, "
            f"{chi['chain_verifier']}): p = {chi['pvalue']}, TV = {chi['tv']}: {chi['verdict']}."
        )
    training = report.get("head_training")
    lines.append(
        f"Head: {report.get('head')}."
        + (
            f" Trained in this run on {training['device']}: {training['ended']} ({training['seconds']} s)."
            if training
            else ""
        )
    )
    for key, reason in (report.get("reasons") or {}).items():
        lines.append(f"- `{key}`: {reason}")
    if report.get("failed"):
        lines.append(f"- failed: {', '.join(report['failed'])}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
