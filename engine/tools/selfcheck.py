"""``python -m engine selfcheck``: can this install be trusted? Two checks in under a minute.

1. **Greedy parity.** Greedy speculative decoding must emit the target's argmax at every position, so
   with the n-gram and the int8 drafters it must reproduce the plain baseline token for token
   (``engine.tools.parity``). A divergence at a numerical near-tie (a multi-token pass rounding
   differently from a one-token pass) is rerun in strict mode, whose shape-invariant passes are
   bitwise identical to the baseline's in any dtype: the check passes only if every case is identical
   (directly, or strictly at a near-tie). Speculation must also have done something: the int8 drafter
   must have emitted more than one token per target pass.
2. **Exact sampling, with its negative control.** Real speculative samples of the first two tokens
   after a prompt (int8 drafts, a small tree) against the target's exact law p(x1) · p(x2 | x1),
   computed from its logits (``engine.tools.exactness``): the exact rule must be consistent with p
   (chi-square p-value at least ``TEST_LEVEL``) and the lossy shortcut that ignores q
   (``verify_children_ignoring_q``) on the same drafts must be detected (p-value below it). The control
   shows the test has the power to see a wrong rule at this sample size; without it a pass means little.

``selfcheck(engine)`` returns a plain JSON-serialisable dict with every figure and a pass / fail per
check; the CLI prints it (``format_report``). The sizes (PARITY, EXACTNESS) are the default model's
(SmolLM2-135M-Instruct), chosen to fit a minute on two CPU cores: greedy runs of 32 tokens, and 400 samples
per sampler. Power: at n = 400 the control's expected chi-square statistic is about three times the critical
value at the 1e-3 level, so it goes undetected for fewer than one seed in 2000 (the noncentral chi-square's
tail), while the exact rule fails by chance for one seed in 1000 (TEST_LEVEL). The measured noncentrality and
sample cost behind these sizes: docs/bench/2026-12-07-notes-from-engine.md.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from engine.tools.exactness import (
    TEST_LEVEL,
    chi_square_test,
    exactness_verdict,
    first_tokens_law,
    verify_children_ignoring_q,
)
from engine.tools.parity import parity_check
from engine.tools.samples import sample_next_tokens

__all__ = ["EXACTNESS", "PARITY", "format_report", "run_selfcheck", "selfcheck"]

# Check 1: two prompts (one the n-gram drafter copies from, one chat), each drafter on each.
PARITY = {
    "prompts": [
        "Rename the variable x to total in this code:\nx = 0\nfor v in values:\n    x += v\nprint(x)",
        "Explain in two sentences why the sky is blue.",
    ],
    "drafters": {"ngram": {"k": 4}, "int8": {"k": 4}},
    "max_new_tokens": 32,
}
# Check 2: the Lossless lab's defaults (app/labs/lossless.py): a peaked p after "Hi!" at top-k 8, int8 drafts
# in a tree of 2 alternatives per node, K = 2 so one pass drafts both tokens of a pair.
EXACTNESS = {
    "prompt": "Hi!",
    "drafter": "int8",
    "temperature": 1.0,
    "top_k": 8,
    "k": 2,
    "topk": 2,
    "n_tokens": 2,
    "n_samples": 400,
}


def _strictly_identical(engine, prompt: str, drafter: str, shape: dict) -> bool:
    """A near-tie rerun in strict mode (every pass one shape): bitwise the baseline's computation, any dtype."""
    result = next(
        parity_check(engine, [prompt], drafter, max_new_tokens=PARITY["max_new_tokens"], strict=True, **shape)
    )
    return result["identical"]


def _parity(engine, log: Callable[[str], None]) -> dict:
    """Check 1: every (drafter, prompt) identical to the greedy baseline, and int8 drafting accepted."""
    t0 = time.perf_counter()
    cases = []
    baselines: dict = {}
    for drafter, shape in PARITY["drafters"].items():
        log(f"greedy parity: {drafter} drafter on {len(PARITY['prompts'])} prompts")
        for result in parity_check(
            engine,
            PARITY["prompts"],
            drafter,
            max_new_tokens=PARITY["max_new_tokens"],
            baseline_cache=baselines,
            **shape,
        ):
            case = {
                "drafter": drafter,
                "prompt": result["prompt"],
                **shape,
                "tokens": result["baseline_tokens"],
                "tokens_per_pass": result["tokens_per_pass"],
                "verdict": result["verdict"],
                "identical": result["identical"],
            }
            if not result["identical"]:
                case.update(position=result["position"], margin=result["margin"], tolerance=result["tolerance"])
            if result["verdict"] == "numerical near-tie":
                log(f"greedy parity: near-tie for {drafter} at token {result['position']}: rerunning it strictly")
                case["strict_identical"] = _strictly_identical(engine, result["prompt"], drafter, shape)
            case["passed"] = case["identical"] or case.get("strict_identical", False)
            cases.append(case)
    int8 = [c["tokens_per_pass"] for c in cases if c["drafter"] == "int8"]
    per_pass = sum(int8) / len(int8)
    return {
        "name": "greedy parity",
        "passed": all(c["passed"] for c in cases) and per_pass > 1.0,
        "identical": sum(c["identical"] for c in cases),
        "cases": cases,
        "int8_tokens_per_pass": per_pass,
        "speculated": per_pass > 1.0,  # int8 drafts were accepted: the parity above tested speculation
        "max_new_tokens": PARITY["max_new_tokens"],
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _exactness(engine, seed: int, log: Callable[[str], None]) -> dict:
    """Check 2: the exact rule consistent with p, the control that ignores q detected (same drafts, same n)."""
    cfg = EXACTNESS
    filters = {"temperature": cfg["temperature"], "top_k": cfg["top_k"]}

    t0 = time.perf_counter()
    law = first_tokens_law(engine, cfg["prompt"], **filters)
    law_seconds = round(time.perf_counter() - t0, 2)
    n = cfg["n_samples"]
    tests = {}
    for kind, verifier in (("exact", None), ("control", verify_children_ignoring_q)):
        log(f"chi-square: {n} samples of the first {cfg['n_tokens']} tokens, {kind} rule")
        t0 = time.perf_counter()
        samples = sample_next_tokens(
            engine,
            cfg["prompt"],
            cfg["drafter"],
            n_samples=n,
            n_tokens=cfg["n_tokens"],
            verify_node=verifier,
            seed=seed,
            k=cfg["k"],
            topk=cfg["topk"],
            **filters,
        )
        counts = Counter(tuple(int(t) for t in s[: cfg["n_tokens"]]) for s in samples)
        test = chi_square_test(counts, law, n)
        tests[kind] = {**test, "n": n, "seconds": round(time.perf_counter() - t0, 2)}
    exact, control = tests["exact"], tests["control"]
    exact_ok = exact["pvalue"] is not None and exact["pvalue"] >= TEST_LEVEL
    control_ok = control["pvalue"] is not None and control["pvalue"] < TEST_LEVEL
    exact["verdict"] = exactness_verdict(exact)
    control["verdict"] = exactness_verdict(control, lossy=True)
    return {
        "name": "exact sampling",
        "passed": exact_ok and control_ok,
        "level": TEST_LEVEL,
        "support": len(law),
        "law_seconds": law_seconds,
        "seed": seed,
        **{key: cfg[key] for key in ("prompt", "drafter", "temperature", "top_k", "k", "topk", "n_tokens")},
        "exact": exact,
        "control": control,
    }


def selfcheck(engine, seed: int = 0, log: Callable[[str], None] | None = None) -> dict:
    """Both checks on `engine` (a SpeculativeEngine; the sizes are the default model's).

    seed: the samplers' seed (a fixed seed repeats exactly; about one seed in a thousand makes the exact
    rule fail by chance, another seed then tells chance from a bug). log: called with a line as each
    stage starts (the CLI prints them to stderr). Returns {"passed", "checks": [...], "target", "dtype",
    "check_seconds"}: JSON-serialisable, every figure in it."""
    log = log or (lambda line: None)
    t0 = time.perf_counter()
    checks = [_parity(engine, log), _exactness(engine, seed, log)]
    return {
        "passed": all(c["passed"] for c in checks),
        "target": engine.target.name,
        "dtype": str(engine.target.dtype).removeprefix("torch."),
        "checks": checks,
        "check_seconds": round(time.perf_counter() - t0, 2),
    }


def run_selfcheck(dtype: str = "auto", seed: int = 0, log: Callable[[str], None] | None = None) -> dict:
    """``python -m engine selfcheck``: load the default model in `dtype`, build the int8 drafter's copy,
    run ``selfcheck``; the result adds what loading took and the total seconds (``seconds``)."""
    from engine.decode import SpeculativeEngine
    from engine.kernels import cpu_build

    log = log or (lambda line: None)
    t0 = time.perf_counter()
    log(f"loading the default model ({dtype})")
    engine = SpeculativeEngine.load("default", dtype)
    t1 = time.perf_counter()
    log("building the int8 drafter's weights")
    engine.drafter("int8")  # the shared int8 copy, built once (its time is not the checks')
    t2 = time.perf_counter()
    result = selfcheck(engine, seed, log)
    kernel = cpu_build.describe()["variant"] if engine.target.model.device.type == "cpu" else None
    return {
        **result,
        "device": engine.target.model.device.type,
        "cpu_kernel": kernel,
        "load_seconds": round(t1 - t0, 2),
        "int8_build_seconds": round(t2 - t1, 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _fmt_p(pvalue) -> str:
    return "—" if pvalue is None else f"{pvalue:.3g}"


def _fmt_test(test: dict) -> str:
    statistic = "—" if test["statistic"] is None else f"{test['statistic']:.1f}"
    return (
        f"chi-square {statistic}, df {test['df']}, p-value {_fmt_p(test['pvalue'])}, TV {test['tv']:.3f}: "
        f"{test['verdict']}"
    )


def format_report(result: dict) -> str:
    """The result as lines for people: one per check, PASS or FAIL first, then the total time."""
    parity, exact = result["checks"]
    mark = {True: "PASS", False: "FAIL"}
    by_drafter: dict[str, list[str]] = {}
    for case in parity["cases"]:
        text = f"{case['tokens_per_pass']:.2f}"
        if not case["identical"]:
            strict = case.get("strict_identical")
            text += f" (differs at token {case['position']}, top-2 margin {case['margin']:.4f}: {case['verdict']}"
            text += "; identical in strict mode)" if strict else ")"
        by_drafter.setdefault(f"{case['drafter']} K={case['k']}", []).append(text)
    drafters = "; ".join(f"{name}: {', '.join(rates)}" for name, rates in by_drafter.items())
    lines = [
        f"{mark[parity['passed']]} greedy parity: {parity['identical']}/{len(parity['cases'])} identical to the "
        f"baseline over {parity['max_new_tokens']} new tokens (tokens per pass, per prompt: {drafters})"
        + ("" if parity["speculated"] else "; no int8 draft was accepted, so speculation was not tested"),
        f"{mark[exact['passed']]} exact sampling: {exact['control']['n']} samples of the first {exact['n_tokens']} "
        f"tokens after {exact['prompt']!r} ({exact['drafter']}, K={exact['k']}, tree top-k {exact['topk']}, "
        f"temperature {exact['temperature']:g}, top-k {exact['top_k']}, seed {exact['seed']}; {exact['support']} "
        f"pairs in p's support, level {exact['level']:g})",
        f"    exact rule: {_fmt_test(exact['exact'])}",
        f"    control that ignores q: {_fmt_test(exact['control'])}",
        f"selfcheck {'passed' if result['passed'] else 'FAILED'} in {result['seconds']:.1f} s ({result['target']}, "
        f"{result['dtype']}, {result['cpu_kernel'] or result['device']}; load {result['load_seconds']:.1f} s, "
        f"int8 copy {result['int8_build_seconds']:.1f} s, checks {result['check_seconds']:.1f} s)",
    ]
    return "\n".join(lines)
