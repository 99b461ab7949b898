"""Every example shows, live on the default model, what its label promises.

assets/examples.json holds what scripts/record_traces.py measured for each example (tokens
per target pass, α, speedup, with the CPU and dtype). Greedy runs are deterministic, so the
tokens-per-pass claims are checked here on the real model (float32 here, bf16 when recorded
on our CPU kernels: a tolerance covers the few tokens where the two differ). Speed claims
depend on the machine; the examples' notes say so and the benchmark measures them.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

EXAMPLES = json.loads((Path(__file__).resolve().parent.parent / "assets" / "examples.json").read_text())
TOLERANCE = 0.75  # a live greedy run keeps at least this share of the recorded tokens per pass
COPY_FLOOR = 3.0  # what "n-gram copies" means: at least 3 tokens per target pass


def _by_lesson(lesson: str) -> list[dict]:
    return [e for e in EXAMPLES if e.get("lesson") == lesson]


def _tokens_per_pass(engine, example: dict, drafter: str | None = None) -> float:
    run = engine.run(example["prompt"], drafter or example["drafter"], payload="reduced", **example["settings"])
    return run["metrics"]["tokens_per_pass"]


def test_every_example_is_complete_and_measured():
    assert len(EXAMPLES) >= 5
    lessons = {e["lesson"] for e in EXAMPLES}
    assert {"copy", "model-drafter", "does-not-pay"} <= lessons
    for e in EXAMPLES:
        assert e["prompt"].strip() and e["drafter"] and e["explain"] and isinstance(e["settings"], dict)
        m = e["measured"]
        assert m["tokens_per_pass"] >= 1.0 and m["speedup"] > 0 and m["cpu"] and m["dtype"] and m["recorded"]


@pytest.mark.parametrize("example", _by_lesson("copy"), ids=lambda e: e["name"])
def test_ngram_examples_copy_several_tokens_per_pass(real_engine, example):
    assert example["drafter"] == "ngram" and example["settings"]["temperature"] == 0
    recorded = example["measured"]["tokens_per_pass"]
    assert recorded >= COPY_FLOOR
    live = _tokens_per_pass(real_engine, example)
    assert live >= max(COPY_FLOOR, TOLERANCE * recorded), (live, recorded)


@pytest.mark.parametrize("example", _by_lesson("model-drafter"), ids=lambda e: e["name"])
def test_model_drafter_example_beats_ngram_per_pass(real_engine, example):
    live = _tokens_per_pass(real_engine, example)
    ngram = _tokens_per_pass(real_engine, example, "ngram")
    assert live >= TOLERANCE * example["measured"]["tokens_per_pass"]
    assert live > 2 * ngram, (live, ngram)


def test_the_lesson_example_was_measured_slower_than_the_baseline():
    """The example labelled as not paying was recorded below 1× while lifting tokens per pass."""
    for example in _by_lesson("does-not-pay"):
        m = example["measured"]
        assert m["speedup"] < 1.0 and m["tokens_per_pass"] > 1.5, m


def _cost_from_steps(run: dict, k: int) -> float:
    """c recomputed from the run's own step events: mean drafting ms ÷ (K × mean target pass ms) over the passes
    that drafted (engine.metrics.summarize_steps' definition)."""
    drafting = [e for e in run["events"] if e.get("type") == "step" and e["drafted"]]
    return statistics.mean(e["draft_ms"] for e in drafting) / (k * statistics.mean(e["verify_ms"] for e in drafting))


@pytest.mark.parametrize("example", _by_lesson("learned-head"), ids=lambda e: e["name"])
def test_the_learned_head_costs_a_fraction_of_int8_and_accepts_less(real_engine, example):
    """The EAGLE example's claim, live: a head's draft token costs a small fraction of a target pass and less
    than the int8 copy's, and int8, a near copy, gets more accepted.

    The cost is asserted where it does not depend on the host: a guess of the head reads one layer and the
    reduced vocabulary's rows, a fraction of the weights a target pass reads and fewer than the int8 copy, which
    runs the whole network per guess (a decode pass on the CPU is bound by the weight bytes it reads: the
    benchmark's roofline). Each run's measured c is the host's (0.06 against 0.41 on the Xeon that recorded it,
    0.06 against 0.12 on a CI host), so it is checked for what it is: a positive figure computed from the same
    run's step timings."""
    assert example["drafter"] == "eagle" and example["compare_drafter"] == "int8"
    k = example["settings"]["k"]
    full = {
        d: real_engine.run(example["prompt"], d, payload="reduced", **example["settings"]) for d in ("eagle", "int8")
    }
    runs = {d: run["metrics"] for d, run in full.items()}
    for d, run in full.items():
        c = runs[d]["draft_cost_ratio"]
        assert c is not None and 0 < c < math.inf, runs
        assert c == pytest.approx(_cost_from_steps(run, k), rel=1e-3), runs
    head, int8, target = real_engine.drafter("eagle").model, real_engine.drafter("int8").model, real_engine.target.model
    assert len(head.layers) == 1 and len(int8.layers) == len(target.layers)
    assert head.weight_bytes < 0.25 * target.weight_bytes and head.weight_bytes < int8.weight_bytes
    assert runs["eagle"]["tokens_per_pass"] < runs["int8"]["tokens_per_pass"], runs
    m = example["measured"]
    assert m["draft_cost_ratio"] < m["compare"]["draft_cost_ratio"]
