"""The Lossless lab: real next-token samples from three samplers (a fourth, block verification, by choice), tested against the target's exact p.

Plain sampling (the reference), speculative sampling with the exact rule, and a deliberately broken
verifier that ignores q each draw N real samples of the token after a prompt; engine.tools.exactness
tests each histogram against p (chi-square, total variation), visuals.lab_figures draws them.
"""

from __future__ import annotations

import time
from collections import Counter

import gradio as gr

from engine.drafters.spec import family as drafter_family
from engine.tools.exactness import (
    TEST_LEVEL,
    chi_square_test,
    exactness_verdict,
    verify_children_ignoring_q,
)
from engine.tools.samples import sample_next_tokens
from visuals.lab_figures import fmt_pvalue, lossless_figure

from ..config import MAX_LAB_SAMPLES
from ..drafter_help import single_drafters
from ..engine_access import get_engine, is_loaded, use_drafter
from ..inputs import number, seed_or_random
from ..stopping import ProgressReporter, Stopped
from . import durations
from .panels import (
    MIN_SAMPLES,
    TOKENS_TESTED,
    WaitingStatus,
    draft_shape_controls,
    exact_law,
    lab_tab,
    results_table,
    sampling_controls,
    sampling_results,
    wire_sampling_lab,
)

__all__ = ["LOSSLESS_DEFAULTS", "SAMPLERS", "build_tab", "run_lossless"]

# The run's inputs (controls, in the order the run takes them) and outputs (results).
INPUTS = ["prompt", "temperature", "top_k", "drafter", "k", "topk", "n", "seed", "samplers", "tokens"]
OUTPUTS = ["status", "plot", "table"]

LOSSLESS_PROMPTS = ["Hi!", "What colour is the sky?", "Name a colour.", "Name a planet."]
LOSSLESS_DEFAULTS = {"prompt": "Hi!", "temperature": 1.0, "top_k": 8, "drafter": "int8", "k": 2, "topk": 2, "n": 300}
LOSSLESS_DEFAULTS["tokens"] = 2  # pairs: the second position tested too
SHOWN_PAIRS = 9  # the chart shows the most likely cells (tokens or pairs), the rest pooled; the test uses all
# (10 cells of upright labels fit a histogram panel of a phone's figure side by side; 12 touched, 16 overlapped)
SAMPLERS = {
    "plain": "Plain sampling (no drafter)",
    "exact": "Speculative sampling (exact rule)",
    "block": "Block verification (exact, a chain)",
    "broken": "Broken verifier (ignores q)",
}
DEFAULT_SAMPLERS = ("plain", "exact", "broken")  # block verification is ticked by choice (N more passes)
PLAIN_SHAPE = {"k": 1, "topk": 1}  # plain sampling drafts nothing: one target pass per sample
# The verdict beside the sampler it judges: on a phone the table scrolls sideways and shows its first columns.
LOSSLESS_HEADERS = ["sampler", "verdict", "p-value", "TV distance", "N", "chi-square", "df"]
# Ranges the lab accepts. Temperature 0 would be greedy (nothing to sample); top-k keeps p to a readable
# number of bars, at least 2 so that there is something to test.
TEMPERATURE_RANGE = (0.05, 2.0)
TOP_K_RANGE = (2, 50)
MAX_K, MAX_TREE_TOPK = 4, 4

LOSSLESS_TEXT = f"""
**Is speculative sampling really lossless? Sample it and test it.** Each run draws **N real samples of the first
two tokens** of the answer (or of the first token only) from three samplers (four with block verification ticked), each sample real target passes on
this machine:
**plain sampling** (no drafter), **speculative sampling** with the exact rule (accept with min(1, p/q), else
resample from norm(max(0, p − q))), and a **deliberately broken verifier** that ignores q (accepts with
min(1, p), resamples from p itself, a tempting shortcut). The target's **exact p** is computed from its
logits with your temperature and top-k: for pairs, p(x1, x2) = p(x1) · p(x2 | x1), one forward pass per
first token. Testing pairs also checks the second draft position and the caches after an accepted or
resampled first token. A chi-square test (cells with fewer than 5 expected samples pooled) and the
total-variation distance compare each histogram with p; below p-value {TEST_LEVEL:g} a histogram is called
different from p.

Tick **block verification** to add a fourth sampler: the same drafter's chain of K drafts kept by a joint ratio
over the whole drafted prefix instead of draft by draft (Sun et al., ICLR 2025; vLLM's `block` rejection
sampling). It is exact too, so its histogram must match p like the exact rule's.

The broken verifier always uses the **int8** drafter: an n-gram draft is a point mass (q = 1 on the copied
token), so accepting with min(1, p/q) or with min(1, p) is the same thing and dropping q changes nothing
for n-gram drafts. With the int8 drafter q is close to p, so the shortcut's error is small (a total-variation
distance around 0.1): the defaults (a peaked p, 2 alternative drafts per guess) make it show at N = 300;
with other prompts raise N. K = 2 lets one pass draft both tokens of a pair.
"""


# ------------------------------------------------------------------------------------------ text
def _verdict(kind: str, test: dict | None) -> str:
    """engine.tools.exactness' verdict on one sampler (the broken verifier is the lossy control)."""
    return exactness_verdict(test, lossy=kind == "broken")


def _lossless_table(results: dict, n: int) -> list[list]:
    rows = []
    for kind, name in SAMPLERS.items():
        res = results.get(kind)
        test = res["test"] if res else None
        rows.append(
            [
                name + (f" [{res['drafter']}]" if res and res.get("drafter") not in (None, "none") else ""),
                _verdict(kind, test),
                "—" if not test else fmt_pvalue(test["pvalue"]),
                "—" if not test else f"{test['tv']:.3f}",
                n if res else "—",
                "—" if not test or test["statistic"] is None else f"{test['statistic']:.1f}",
                "—" if not test else test["df"],
            ]
        )
    return rows


def _lossless_summary(results: dict, n: int, seed: int, drafter: str, k: int, topk: int, seconds: float) -> str:
    what = {
        "exact": f"Speculative sampling ({drafter}, exact rule)",
        "plain": "Plain sampling",
        "broken": "Broken verifier (int8, ignores q)",
        "block": f"Block verification ({drafter}, a chain of K = {k})",
    }
    notes = {"plain": ": the reference, and the noise level to expect at this N"}
    lines = [
        f"**Done in {seconds:.0f} s** ({len(results) * n} real samples, seed {seed}; speculative: {drafter} drafter, "
        f"K = {k}, tree top-k {topk}).",
        "",
    ]
    for kind in ("exact", "block", "plain", "broken"):
        if kind in results:
            test = results[kind]["test"]
            lines.append(
                f"* **{what[kind]}: {_verdict(kind, test)}** (p-value {fmt_pvalue(test['pvalue'])}, "
                f"TV {test['tv']:.3f}){notes.get(kind, '')}."
            )
    lines += [
        "",
        "*Measured:* the samples (real drafts and target passes, now). *Computed:* the exact p from the target's "
        "logits, the chi-square p-values and the total-variation distances.",
    ]
    if drafter_family(drafter).kind == "copying":
        lines.append(
            f"\nWith the {drafter} drafter q is a point mass: if the prompt offers nothing to copy, nothing is drafted "
            "and the speculative sampler is plain sampling."
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- run
def _checked(prompt, temperature, top_k, drafter, k, topk, n_samples, seed, samplers, tokens) -> dict:
    """The lab's inputs, checked (gr.Error naming the field otherwise)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise gr.Error("Type a prompt (or pick one): the lab samples the token that follows it.")
    lab = {
        "prompt": prompt,
        "settings": {
            "temperature": number(temperature, "Temperature", *TEMPERATURE_RANGE),
            "top_k": number(top_k, "Top-k", *TOP_K_RANGE, integer=True),
        },
        "shape": {
            "k": number(k, "K", 1, MAX_K, integer=True),
            "topk": number(topk, "Tree top-k", 1, MAX_TREE_TOPK, integer=True),
        },
        "n": number(n_samples, "Samples N", MIN_SAMPLES, MAX_LAB_SAMPLES, integer=True),
        "seed": seed_or_random(seed),
        "drafter": (drafter or "int8").strip(),
        "tokens": number(tokens, "Tokens tested", 1, max(TOKENS_TESTED), integer=True),
    }
    if lab["drafter"] not in single_drafters():
        *most, last = single_drafters()
        raise gr.Error(f"Choose the {', '.join(most)} or {last} drafter for this lab, got {lab['drafter']!r}.")
    lab["chosen"] = list(DEFAULT_SAMPLERS) if samplers is None else [kind for kind in SAMPLERS if kind in samplers]
    if not lab["chosen"] or (samplers is not None and set(samplers) - set(SAMPLERS)):
        raise gr.Error(f"Pick at least one sampler to run ({', '.join(SAMPLERS)}).")
    return lab


def _runs(lab: dict) -> list[tuple[str, str, str, dict]]:
    """(kind, drafter, verifier, draft shape) of each chosen sampler, in panel order: the verifier is None
    for the exact rule, or the lossy negative control (engine.tools.exactness). The broken verifier
    always drafts with int8 (an n-gram draft's q is a point mass, so ignoring q changes nothing there)."""
    runs = [
        ("plain", "none", None, PLAIN_SHAPE),
        ("exact", lab["drafter"], None, lab["shape"]),
        # block verification is defined for one draft sequence: the same K as a chain
        ("block", lab["drafter"], None, {"k": lab["shape"]["k"], "topk": 1, "verify": "block"}),
        ("broken", "int8", verify_children_ignoring_q, lab["shape"]),
    ]
    return [run for run in runs if run[0] in lab["chosen"]]


def _sample(engine, lab: dict, run: tuple, tracker) -> dict:
    """N samples of one sampler and their test against p."""
    kind, spec, verifier, shape = run
    t0 = time.perf_counter()
    try:
        samples = sample_next_tokens(
            engine,
            lab["prompt"],
            spec,
            n_samples=lab["n"],
            n_tokens=lab["tokens"],
            verify_node=verifier,
            progress=tracker,
            seed=lab["seed"],
            **lab["settings"],
            **shape,
        )
    except ValueError as exc:
        raise gr.Error(str(exc)) from None
    counts = Counter(_key(s, lab["tokens"]) for s in samples)
    return {
        "counts": dict(counts),
        "test": chi_square_test(counts, lab["p"], lab["n"]),
        "drafter": spec,
        "seconds": time.perf_counter() - t0,
    }


def _key(sample: tuple[int, ...], tokens: int):
    """A sample's histogram cell: its first token, or its first two tokens as a pair."""
    return int(sample[0]) if tokens == 1 else tuple(int(t) for t in sample[:2])


def _label(engine, key) -> str:
    return engine.token_text(key) if isinstance(key, int) else " · ".join(engine.token_text(t) for t in key)


def _exact_p(engine, lab: dict) -> None:
    """The target's exact law of the first token (or pair) after the prompt, and the cells' texts, into `lab`."""
    lab["p"] = exact_law(engine, lab["prompt"], lab["tokens"], lab["seed"], lab["settings"])
    lab["labels"] = {key: _label(engine, key) for key in lab["p"]}


OTHER_PAIRS = "other"  # the chart's cell for every token or pair beyond the SHOWN_PAIRS most likely ones


def _figure(lab: dict, results: dict):
    """The histograms. The SHOWN_PAIRS most likely cells (tokens or pairs) are drawn and the rest pooled into one
    "other" cell, drawn last, so bars still sum to 1 (the test itself uses every cell)."""
    p, labels = lab["p"], lab["labels"]
    cells = "Next-token" if lab["tokens"] == 1 else "Token-pair"
    if len(p) <= SHOWN_PAIRS + 1:
        return lossless_figure(p, labels, results, lab["n"], SAMPLERS, cells)
    shown = dict(sorted(p.items(), key=lambda item: -item[1])[:SHOWN_PAIRS])
    shown[OTHER_PAIRS] = max(0.0, 1.0 - sum(shown.values()))
    pooled = {}
    for kind, res in results.items():
        counts = {key: res["counts"].get(key, 0) for key in shown if key != OTHER_PAIRS}
        counts[OTHER_PAIRS] = lab["n"] - sum(counts.values())
        pooled[kind] = {**res, "counts": counts}
    return lossless_figure(
        shown, {**labels, OTHER_PAIRS: "others"}, pooled, lab["n"], SAMPLERS, cells, pooled_key=OTHER_PAIRS
    )


def run_lossless(
    prompt,
    temperature,
    top_k,
    drafter,
    k,
    topk,
    n_samples,
    seed,
    samplers=None,
    tokens=LOSSLESS_DEFAULTS["tokens"],
    run_id: str = "",
    progress=gr.Progress(),  # noqa: B008 (gradio injects the tracker)
):
    """Generator: plain, exact speculative and broken-verifier next-token samples vs the exact p.

    samplers: the subset of SAMPLERS' keys to run (None = DEFAULT_SAMPLERS: all but block verification).
    Yields (status markdown, figure, table rows) after each sampler.
    """
    lab = _checked(prompt, temperature, top_k, drafter, k, topk, n_samples, seed, samplers, tokens)
    n = lab["n"]
    if not is_loaded("default", "auto"):
        yield "Loading the model (once per server)…", gr.skip(), gr.skip()
    engine = get_engine("default", "auto", progress)
    yield "Preparing the drafters (the int8 copy is built on first use)…", gr.skip(), gr.skip()
    use_drafter(engine, "int8")
    _exact_p(engine, lab)
    runs = _runs(lab)
    results: dict[str, dict] = {}
    started = time.perf_counter()
    for index, run in enumerate(runs):
        kind, spec = run[0], run[1]
        step = f"{index + 1}/{len(runs)} {SAMPLERS[kind]}"
        status = step + (f" ({spec} drafter)" if spec != "none" else "") + f": sampling {n}…"
        yield status, gr.skip(), gr.skip()
        tracker = ProgressReporter(progress, step, run_id, offset=index / len(runs), share=1 / len(runs))
        try:
            results[kind] = _sample(engine, lab, run, tracker)
        except Stopped:
            figure = _figure(lab, results)
            yield (
                f"■ Stopped during {SAMPLERS[kind]}. Results above cover the samplers that finished.",
                figure,
                _lossless_table(results, n),
            )
            return
        for key in results[kind]["counts"]:
            lab["labels"].setdefault(key, _label(engine, key))
        yield (
            status.replace(f": sampling {n}…", f": done in {results[kind]['seconds']:.1f} s."),
            _figure(lab, results),
            _lossless_table(results, n),
        )
    seconds = time.perf_counter() - started
    durations.record("lossless", seconds, len(results) * n)
    summary = _lossless_summary(
        results, n, lab["seed"], lab["drafter"], lab["shape"]["k"], lab["shape"]["topk"], seconds
    )
    yield summary, gr.skip(), gr.skip()


# ---------------------------------------------------------------------------------------- layout
def _controls() -> dict:
    d = LOSSLESS_DEFAULTS
    c = sampling_controls(
        "ll",
        LOSSLESS_PROMPTS,
        d,
        "The lab samples the first token of the answer.",
        "Samples N (per sampler)",
        "Each sample is one real target pass; the status says how long runs took on this server.",
    )
    c["drafter"] = gr.Radio(
        [(spec, spec) for spec in single_drafters()],
        value=d["drafter"],
        label="Drafter of the speculative sampler",
        info="The broken verifier always uses int8 (see above).",
    )
    c["temperature"] = gr.Slider(*TEMPERATURE_RANGE, d["temperature"], step=0.05, label="Temperature")
    c["top_k"] = gr.Slider(
        *TOP_K_RANGE, d["top_k"], step=1, label="Top-k", info="Tokens p may use; small keeps the chart readable."
    )
    draft_shape_controls(
        c,
        d,
        MAX_K,
        MAX_TREE_TOPK,
        topk_info="Alternative drafts per guess.",
        tokens_info="Pairs also test the second position; each cell of the chart is a pair of tokens.",
    )
    c["samplers"] = gr.CheckboxGroup(
        [(name, kind) for kind, name in SAMPLERS.items()],
        value=list(DEFAULT_SAMPLERS),
        label="Samplers to run",
        info="Each costs N target passes.",
    )
    return c


# Before any run on this server, the defaults' duration as recorded (docs/bench/2026-12-07-notes-from-app.md).
RECORDED_TIME = "36 s measured 2026-12-02 on a quiet 2-core Xeon, 7 ½ min on a busy 2-core machine"
waiting_status = WaitingStatus("lossless", len(DEFAULT_SAMPLERS) * LOSSLESS_DEFAULTS["n"], RECORDED_TIME)
refresh_status = waiting_status.refresh


def _results() -> dict:
    widths = ["22%", "35%", "10%", "12%", "6%", "10%", "5%"]
    table = results_table(_lossless_table({}, 0), LOSSLESS_HEADERS, "Tests against the exact p", widths, "ll-table")
    return sampling_results("ll", waiting_status, "Next-token histograms against the target's exact p", table)


def build_tab() -> gr.Tab:
    def wire(c: dict, out: dict) -> None:
        wire_sampling_lab(c, out, run_lossless, INPUTS, OUTPUTS, waiting_status)

    return lab_tab("Lossless lab", "lossless", LOSSLESS_TEXT, _controls, _results, wire)
