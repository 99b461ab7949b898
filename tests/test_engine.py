"""The decode loop, drafters, events and input validation (tiny random target, real tokenizer)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine import trace as trace_io
from engine.decode import GenerationSettings
from engine.drafters import TreeShape
from engine.drafters.base import DraftContext
from engine.drafters.ngram import NgramDrafter
from engine.run_state import DecodeState
from engine.sampling import SamplingParams

PROMPT = [1, 504, 2741, 314, 253, 1345, 28, 504, 2741, 314]


# ----------------------------------------------------------------- n-gram drafter
def test_ngram_longest_match_wins():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    #          a  b  c  X  ...  b  c  Y  ...  a  b  c
    context = [1, 2, 3, 10, 11, 2, 3, 20, 21, 1, 2, 3]
    # The 3-gram (1, 2, 3) occurred once, followed by 10: it beats the more recent 2-gram match.
    assert d.find_continuations(context, 2, 1) == [[10, 11]]


def test_ngram_most_recent_distinct_branches():
    d = NgramDrafter(max_ngram=2, min_ngram=1)
    context = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5, 6]
    branches = d.find_continuations(context, 2, 3)
    assert branches == [[7, 9], [8, 5]]  # most recent first, one branch per distinct next token


def test_ngram_no_match_proposes_nothing():
    d = NgramDrafter(max_ngram=3, min_ngram=2)
    assert d.find_continuations([1, 2, 3, 4, 5, 6], 4, 2) == []
    tree = d.propose(DraftContext([1, 2, 3, 4, 5, 6], TreeShape(4), SamplingParams()))
    assert len(tree) == 0


def test_ngram_window_limits_the_search():
    context = [7, 8, 9] + list(range(100, 140)) + [7, 8]
    assert NgramDrafter(max_ngram=2, window=1024).find_continuations(context, 1, 1) == [[9]]
    assert NgramDrafter(max_ngram=2, window=20).find_continuations(context, 1, 1) == []


def test_ngram_tree_respects_shape():
    d = NgramDrafter(max_ngram=1, min_ngram=1)
    context = [4, 1, 4, 2, 4, 3, 4]
    tree = d.propose(DraftContext(context, TreeShape(k=2, topk=3, num_draft_tokens=5), SamplingParams()))
    assert len(tree) == 5
    assert tree.children(-1) == [0, 2, 4]
    assert tree.point_mass


def test_ngram_draft_is_as_long_as_its_match_vouches_for():
    """An n-token match drafts at most per_match * n tokens; the step records why it stopped."""
    copy = list(range(100, 112))  # 12 tokens that followed the match earlier
    shape = TreeShape(k=8)
    # The suffix (7, 8) matches 2 tokens (9, 7, 8 did not occur before): 2 * 2 = 4 tokens.
    short = [1, 7, 8] + copy + [9, 7, 8]
    tree = NgramDrafter(max_ngram=6, per_match=2).propose(DraftContext(short, shape, SamplingParams()))
    assert tree.tokens == copy[:4] and tree.stop == "short-match"
    # The same match with no limit drafts the pass's K.
    tree = NgramDrafter(max_ngram=6, per_match=0).propose(DraftContext(short, shape, SamplingParams()))
    assert tree.tokens == copy[:8] and tree.stop == "depth"
    # A 4-token match vouches for 8 tokens: the pass's K.
    long = [1, 5, 6, 7, 8] + copy + [9, 5, 6, 7, 8]
    tree = NgramDrafter(max_ngram=6, per_match=2).propose(DraftContext(long, shape, SamplingParams()))
    assert tree.tokens == copy[:8] and tree.stop == "depth"
    # A continuation that ends before the limit is a lookup that found no more.
    ends = [1, 7, 8, 100, 101, 9, 7, 8]
    tree = NgramDrafter(max_ngram=6, per_match=3).propose(DraftContext(ends, shape, SamplingParams()))
    assert tree.tokens == [100, 101, 9, 7, 8] and tree.stop == "no-match"


def test_bad_ngram_sizes():
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="per_match"):
        NgramDrafter(per_match=-1)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ("", {}, "empty"),
        ("   \n", {}, "empty"),
        ("hi", {"k": 0}, "between 1 and 32"),
        ("hi", {"k": 1000}, "between 1 and 32"),
        ("hi", {"temperature": -0.5}, "temperature"),
        ("hi", {"temperature": float("nan")}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.01}, "top_p"),
        ("hi", {"max_new_tokens": 0}, "max_new_tokens"),
        ("hi", {"seed": -1}, "seed"),
        ("hi", {"topk": 0}, "topk"),
        ("x " * 600, {}, "context window"),
    ],
)
def test_bad_input_raises_clear_value_error(tiny_engine, prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        next(iter(tiny_engine.generate(prompt, "ngram", **kwargs)))


def test_unknown_drafter(tiny_engine):
    with pytest.raises(ValueError, match="unknown drafter"):
        next(iter(tiny_engine.generate("hi", "medusa")))


@pytest.mark.parametrize("spec", ["ngram:", "ngram:a", "ngram:6,2,1024,2,9", "ngram:6,2,1024,-1", "ngram:2,3"])
def test_bad_ngram_spec_says_what_it_takes(tiny_engine, spec):
    with pytest.raises(ValueError, match="ngram|n-gram|per_match"):
        tiny_engine.drafter(spec)


def test_ngram_spec_sets_the_lookup(tiny_engine):
    d = tiny_engine.drafter("ngram:4,3,512,0")
    assert (d.max_ngram, d.min_ngram, d.window, d.per_match) == (4, 3, 512, 0)
    assert tiny_engine.drafter("ngram:1").max_ngram == 1


# ------------------------------------------------------------ events and loop
@pytest.mark.parametrize("drafter", ["none", "ngram", "int8"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("chain_verifier", ["walk", "batch"])
def test_trace_round_trips_and_counts_add_up(tiny_engine, drafter, temperature, chain_verifier, monkeypatch):
    run = tiny_engine.run(
        PROMPT, drafter, max_new_tokens=24, k=3, temperature=temperature, seed=11, chain_verifier=chain_verifier
    )
    events = run["events"]
    assert events[0]["type"] == "start" and events[-1]["type"] == "finish"
    assert trace_io.loads(trace_io.dumps(events)) == json.loads(json.dumps(events))
    steps = [e for e in events if e["type"] == "step"]
    emitted = [item["token_id"] for s in steps for item in s["emitted"]]
    assert emitted == run["token_ids"]
    m = run["metrics"]
    assert m["target_passes"] == len(steps) == steps[-1]["target_passes"]
    assert m["new_tokens"] == len(emitted) == steps[-1]["tokens_total"]
    assert m["accepted"] == sum(s["accepted_len"] for s in steps)
    assert m["drafted"] == sum(len(s["nodes"]) for s in steps)
    for s in steps:
        decisions = [n["decision"] for n in s["nodes"]]
        assert decisions.count("accepted") == s["accepted_len"]
        assert [i["kind"] for i in s["emitted"]].count("accepted") <= s["accepted_len"]
        assert len(s["emitted"]) >= 1
        if not s.get("truncated"):
            assert len(s["emitted"]) == s["accepted_len"] + 1
            assert s["emitted"][-1]["kind"] == (
                "bonus" if s["nodes"] == [] or "rejected" not in decisions else "resampled"
            )
    if drafter == "none":
        assert m["tokens_per_pass"] == 1.0 and m["drafted"] == 0


def test_seeded_runs_repeat_exactly(tiny_engine):
    a = tiny_engine.run(PROMPT, "int8", max_new_tokens=20, k=3, topk=2, temperature=0.9, seed=5)
    b = tiny_engine.run(PROMPT, "int8", max_new_tokens=20, k=3, topk=2, temperature=0.9, seed=5)
    volatile = ("elapsed_s", "started_at", "metrics", "run_id")

    def strip(evs):
        return [{k: v for k, v in e.items() if not k.endswith("_ms") and k not in volatile} for e in evs]

    assert strip(a["events"]) == strip(b["events"])
    c = tiny_engine.run(PROMPT, "int8", max_new_tokens=20, k=3, topk=2, temperature=0.9, seed=6)
    assert c["token_ids"] != a["token_ids"]


def test_reduced_payload_has_no_top_lists(tiny_engine):
    run = tiny_engine.run(PROMPT, "ngram", max_new_tokens=8, payload="reduced")
    steps = [e for e in run["events"] if e["type"] == "step"]
    assert all(s["dists"] == [] for s in steps)
    assert all("text" not in i for s in steps for i in s["emitted"])


def test_generator_close_is_cancellation(tiny_engine):
    gen = tiny_engine.generate(PROMPT, "ngram", max_new_tokens=50)
    events = [next(gen), next(gen), next(gen)]
    gen.close()
    assert [e["type"] for e in events] == ["start", "step", "step"]
    # The engine is immediately usable again.
    assert tiny_engine.run(PROMPT, "ngram", max_new_tokens=5)["metrics"]["new_tokens"] == 5


def test_stops_at_eos(tiny_engine):
    eos = next(iter(tiny_engine.eos_ids))
    # Force EOS by making every emitted token EOS via a prompt whose greedy next token we read first.
    first = tiny_engine.run(PROMPT, "none", max_new_tokens=1)["token_ids"][0]
    tiny_engine.eos_ids.add(first)
    try:
        run = tiny_engine.run(PROMPT, "ngram", max_new_tokens=20)
        assert run["events"][-1]["stop_reason"] == "eos" and run["token_ids"] == [first]
    finally:
        if first != eos:
            tiny_engine.eos_ids.discard(first)


def test_cache_rollback_after_rejection_matches_recomputation(tiny_engine):
    """Drive the loop step by step; after a step with a rejection the cache must give
    the same next logits as a fresh forward over the whole committed context."""
    engine = tiny_engine
    model = engine.target.model
    settings = GenerationSettings(max_new_tokens=40, k=4, temperature=1.0, seed=3)
    params, shape = settings.validate()
    # n-gram drafts are point masses, so a draft with p(x) < 1 gets rejected often.
    drafter = engine.drafter("ngram")
    drafter.start(PROMPT, 256)
    cache = model.new_cache(256)
    model.run_pass(torch.tensor(PROMPT[:-1]), torch.arange(len(PROMPT) - 1), cache)
    gen = torch.Generator().manual_seed(3)
    context = list(PROMPT)
    state = DecodeState(context, drafter, shape, params, gen, cache)
    rejections = 0
    for _ in range(30):
        step = engine.step(state)
        context.extend(i["token_id"] for i in step.verdict.emitted(step.tree))
        if "rejected" in step.verdict.decisions:
            rejections += 1
            assert cache.length == len(context) - 1
            probe = cache.length
            got = model.run_pass(torch.tensor(context[-1:]), torch.tensor([probe]), cache).logits[0]
            cache.rollback(probe)
            fresh = model.run_pass(torch.tensor(context), torch.arange(len(context)), model.new_cache(256)).logits[-1]
            assert torch.allclose(got, fresh, rtol=1e-5, atol=1e-5)
    assert rejections > 0


def test_metrics_theory_column(tiny_engine):
    run = tiny_engine.run(PROMPT, "int8", max_new_tokens=30, k=4, temperature=1.0, seed=2)
    m = run["metrics"]
    a = m["position_acceptance"]  # α of the formula: accepted / depths tried
    steps = [e for e in run["events"] if e["type"] == "step"]
    # The theory at the depth each pass drafted (the int8 chain drafts K = 4 but where the answer's end cuts it).
    each = [(1 - a ** (s["draft_depth"] + 1)) / (1 - a) if a < 1 else s["draft_depth"] + 1 for s in steps]
    assert math.isclose(m["theoretical_tokens_per_pass"], sum(each) / len(each))
    assert m["passes_drafted"] == len(steps) and m["positions_tried"] > 0
    assert any(s["draft_depth"] == 4 for s in steps) and m["mean_drafted_depth"] <= 4
    steps = [e for e in run["events"] if e["type"] == "step"]
    tried = sum(s["accepted_len"] + (s["extra_kind"] == "resampled") for s in steps)
    assert math.isclose(a, m["accepted"] / tried)
    assert len(m["acceptance_by_position"]) == 4


def test_batch_tradeoff_measures_and_computes(tiny_engine):
    from engine.model.pass_timing import batch_tradeoff

    result = batch_tradeoff(tiny_engine.target.model, k=3, alpha=0.7, batch_sizes=(1, 2, 4), prefix_len=8, repeats=1)
    assert len(result["pass_ms_1"]) == len(result["pass_ms_k1"]) == 3
    assert all(ms > 0 for ms in result["pass_ms_1"] + result["pass_ms_k1"])
    e = (1 - 0.7**4) / 0.3
    assert math.isclose(result["expected_tokens_per_pass"], e)
    assert math.isclose(result["throughput_speculative"][1], 2 * e * 1000 / result["pass_ms_k1"][1])
    assert math.isclose(result["throughput_plain"][2], 4 * 1000 / result["pass_ms_1"][2])


def test_interleaved_runs_do_not_share_drafter_state(tiny_engine):
    other = [1, 77, 78, 79, 80, 81, 82]
    kw = dict(max_new_tokens=16, k=3, temperature=0.8)
    alone_a = tiny_engine.run(PROMPT, "int8", seed=1, **kw)["token_ids"]
    alone_b = tiny_engine.run(other, "int8", seed=2, **kw)["token_ids"]
    gens = [tiny_engine.generate(PROMPT, "int8", seed=1, **kw), tiny_engine.generate(other, "int8", seed=2, **kw)]
    finals = [None, None]
    while any(f is None for f in finals):
        for i, gen in enumerate(gens):
            if finals[i] is None:
                event = next(gen)
                if event["type"] == "finish":
                    finals[i] = event["token_ids"]
    assert finals == [alone_a, alone_b]


def test_ngram_never_drafts_special_tokens():
    d = NgramDrafter(max_ngram=2, stop_ids={99})
    context = [5, 6, 99, 7, 5, 6]
    assert d.find_continuations(context, 3, 1) == []  # the continuation starts with a special token
    context = [5, 6, 8, 99, 7, 5, 6]
    assert d.find_continuations(context, 3, 1) == [[8]]


@pytest.mark.parametrize("drafter", ["int8", "ngram"])
def test_batched_chain_verification_emits_the_same_events_as_the_walk(tiny_engine, monkeypatch, drafter):
    """The GPU path (one verify_batch call per chain) gives events of the same shape; it is
    chosen for sampled chains only (greedy and trees keep the walk)."""
    from engine import verification

    calls = []
    original = verification.verify_batch

    def counting(*args):
        calls.append(args[0].shape)  # [1, K+1, V]
        return original(*args)

    monkeypatch.setattr(verification, "verify_batch", counting)
    runs = {}
    for mode in ("walk", "batch"):
        runs[mode] = tiny_engine.run(
            PROMPT, drafter, max_new_tokens=16, k=3, temperature=1.0, seed=3, chain_verifier=mode
        )
    assert calls and all(shape[0] == 1 and shape[1] <= 4 for shape in calls)
    for mode, run in runs.items():
        steps = [e for e in run["events"] if e["type"] == "step"]
        for step in steps:
            for node in step["nodes"]:
                if node["decision"] in ("accepted", "rejected"):
                    assert {"accept_prob", "u", "p_eff", "q_eff"} <= set(node), (mode, node)
                    assert 0.0 <= node["accept_prob"] <= 1.0
                    assert (node["u"] < node["accept_prob"]) == (node["decision"] == "accepted")
            for item in step["emitted"]:
                assert item["kind"] in ("accepted", "resampled", "bonus")
            assert step["dists"] and "p_top" in step["dists"][0]
    calls.clear()
    tiny_engine.run(PROMPT, drafter, max_new_tokens=8, k=3, temperature=0.0)  # greedy: argmax, no kernel
    tiny_engine.run(PROMPT, "int8", max_new_tokens=8, k=2, topk=2, temperature=1.0, seed=1)  # tree: the walk
    assert calls == []


@pytest.mark.parametrize("drafter", ["ngram", "int8"])
def test_greedy_chains_verified_on_the_device_equal_the_walk(tiny_engine, drafter):
    # verification.verify_chain_greedy (what a CUDA run takes for greedy chains: one argmax per row, one host
    # copy) records exactly what the walk records: every node, decision, number and top entry.
    runs = {
        mode: tiny_engine.run(PROMPT, drafter, max_new_tokens=20, k=4, chain_verifier=mode, pass_graphs="off")
        for mode in ("walk", "batch")
    }
    steps = {mode: [e for e in run["events"] if e["type"] == "step"] for mode, run in runs.items()}
    assert runs["walk"]["token_ids"] == runs["batch"]["token_ids"]
    keys = ("nodes", "emitted", "dists", "accepted_len", "extra_kind")
    for a, b in zip(steps["walk"], steps["batch"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    kinds = {s["extra_kind"] for s in steps["walk"]}
    assert kinds == ({"resampled", "bonus"} if drafter == "ngram" else {"bonus"})  # (int8 is right every time here)


def test_payload_off_yields_start_and_finish_only(tiny_engine):
    events = list(tiny_engine.generate(PROMPT, "int8", max_new_tokens=12, k=3, payload="off"))
    assert [e["type"] for e in events] == ["start", "finish"]
    reduced = tiny_engine.run(PROMPT, "int8", max_new_tokens=12, k=3, payload="reduced")
    assert events[-1]["token_ids"] == reduced["token_ids"]
    assert events[-1]["metrics"]["target_passes"] == reduced["metrics"]["target_passes"]


@pytest.mark.real_model
def test_a_long_chain_projects_only_the_rows_its_walk_reads(monkeypatch):
    """A chain's pass on the CPU kernels computes the logits of its first rows and projects the
    others only when the walk reaches them (tree_pass.CHAIN_LOGITS_FIRST): the same tokens and
    events as projecting every row with the pass."""
    from conftest import tiny_hf_model

    from engine.decode import SpeculativeEngine
    from engine.kernels import cpu_build
    from engine.model import tree_pass
    from engine.model.loading import LoadedModel, load_model
    from engine.model.transformer import ModelConfig, Transformer

    if not cpu_build.available():
        pytest.skip(f"no CPU kernel here: {cpu_build.why_unavailable()}")
    hf = tiny_hf_model()
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.bfloat16)
    assert model.lm_head_on_kernel
    tokenizer = load_model("default", "float32").tokenizer
    engine = SpeculativeEngine(LoadedModel("tiny-bf16", model, tokenizer, torch.bfloat16))
    prompt = [1, 504, 2741, 314, 253, 1345, 28, 504, 2741, 314, 253, 1345, 28, 504, 2741, 314]
    chains = []

    class Counted(tree_pass._ChainLogits):
        def __init__(self, *args):
            super().__init__(*args)
            chains.append(self)

    monkeypatch.setattr(tree_pass, "_ChainLogits", Counted)
    runs = {}
    for first in (5, 100):  # lazy, then every row with the pass
        monkeypatch.setattr(tree_pass, "CHAIN_LOGITS_FIRST", first)
        for temperature in (0.0, 1.0):
            run = engine.run(prompt, "ngram", max_new_tokens=24, k=12, temperature=temperature, seed=3)
            runs[first, temperature] = [e["emitted"] for e in run["events"] if e["type"] == "step"]
    for temperature in (0.0, 1.0):
        assert runs[5, temperature] == runs[100, temperature]
    assert chains, "no pass took the lazy path"
    for chain in chains:  # a walk that stopped in the first rows never projected the rest
        assert chain.rest is None or chain.rest.shape[0] == len(chain) - 5
    assert any(chain.rest is None for chain in chains)


def test_a_run_whose_walks_read_past_the_first_rows_projects_every_row_at_once(tiny_engine):
    """Leaving a long chain's last rows unprojected pays only while walks stop early: each run counts its long
    chains and how many the walk read past CHAIN_LOGITS_FIRST, and past a quarter it projects them all at once
    (drafts accepted ~95% of the time read past them in most passes, and a second read of the projection's
    weights cost 1.65 ms where the first cost 2.03)."""
    from engine.model import tree_pass

    assert tree_pass.lazy_logits_pay(0, 0)  # the first long chain: lazy
    assert tree_pass.lazy_logits_pay(8, 2) and not tree_pass.lazy_logits_pay(8, 3)
    model, first = tiny_engine.target.model, tree_pass.CHAIN_LOGITS_FIRST

    def chain_pass(n: int) -> tree_pass.TreePass:  # what the pass over a chain of n drafts measured
        return tree_pass.target_pass(
            model, model.new_cache(32), None, 1, [1] * n, list(range(1, n + 1)), list(range(-1, n - 1))
        )

    long, short = chain_pass(first + 2), chain_pass(first - 1)
    counts = (0, 0)
    for accepted in (first + 2, first, first - 1, 0):
        counts = tree_pass.note_walk(*counts, long.long_chain, accepted)
    assert counts == (4, 2)
    assert not short.long_chain  # a chain of at most CHAIN_LOGITS_FIRST rows is not counted
    assert tree_pass.note_walk(*counts, short.long_chain, 0) == counts


def test_each_pass_records_its_kv_cache_and_the_histogram_adds_up(tiny_engine):
    """The step's kv record: the pending token and every draft node written, the pending token and the accepted
    path kept, the rest rolled back; the cache grows by what was kept. The finish metrics' histogram of drafts
    kept per drafting pass, and vLLM's mean acceptance length beside the rate."""
    run = tiny_engine.run(PROMPT, "int8", max_new_tokens=30, k=3, topk=2, temperature=1.0, seed=4)
    steps = [e for e in run["events"] if e["type"] == "step"]
    prompt_len = len(run["events"][0]["prompt_ids"])
    length = prompt_len - 1  # the prompt is prefilled but for its last token, the first pass's pending token
    for s in steps:
        kv = s["kv"]
        assert kv["written"] == 1 + s["drafted"] and kv["kept"] == 1 + s["accepted_len"]
        assert kv["kept"] + kv["rolled_back"] == kv["written"]
        length += kv["kept"]
        assert kv["length"] == length
    m = run["metrics"]
    drafting = [s for s in steps if s["drafted"]]
    assert sum(m["accepted_histogram"]) == len(drafting) == m["passes_drafted"]
    assert all(m["accepted_histogram"][j] == sum(s["accepted_len"] == j for s in drafting) for j in range(4))
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["accepted"] / len(drafting))
    # ... and the figures read those records as they are (visuals/run_charts.py).
    from visuals.run_charts import accepted_per_pass_figure, kv_cache_figure

    hist = accepted_per_pass_figure(run["events"])
    (bars,) = [t for t in hist.data if (t.meta or {}).get("role") == "histogram"]
    assert list(bars.y) == m["accepted_histogram"]
    assert f"mean acceptance length {m['mean_acceptance_length']:.2f}" in hist.layout.title.subtitle.text
    kv_fig = kv_cache_figure(run["events"])
    roles = {(t.meta or {}).get("role"): t for t in kv_fig.data}
    assert list(roles["rolled_back"].y) == [s["kv"]["rolled_back"] for s in steps]
    assert list(roles["length"].y)[-1] == steps[-1]["kv"]["length"]


# ----------------------------------------------------------------- greedy chains in one call
def _steps_without_times(run: dict) -> list[dict]:
    """A run's step events without what a clock decides (times, and the adaptive policy's timed speeds)."""
    out = []
    for event in run["events"]:
        if event["type"] != "step":
            continue
        step = {k: v for k, v in event.items() if not k.endswith("_ms") and k not in ("t", "elapsed_s")}
        draft = dict(step.get("draft") or {})
        draft.pop("why", None)
        out.append({**step, "draft": draft})
    return out


def test_a_chain_that_a_confidence_stop_ends_runs_only_the_loops_passes(tiny_engine, monkeypatch):
    """With a confidence threshold, each greedy_chain call runs the levels the loop is sure to reach
    (TreeShape.sure_levels): the same tree and q as the pass-by-pass loop, and never a pass the loop would
    not run, whether the stop comes early, late or never and whether one call or several carry the chain."""
    from engine.kernels import cpu_build
    from engine.model import chains

    if not cpu_build.available():
        pytest.skip(f"no CPU kernel: {cpu_build.why_unavailable()}")
    target = tiny_engine.target.model
    prompt = [5, 9, 3, 7, 11, 2, 8, 4, 5, 9, 3, 7]
    cache = target.new_cache(64)
    target.prefill(prompt, cache)
    context = prompt + [11]  # the pending token
    calls = []
    chain = chains.greedy_chain

    def counted(model, token, kv, n):
        calls.append(n)
        return chain(model, token, kv, n)

    def propose(shape, fast: bool) -> tuple:
        drafter = tiny_engine.drafters.build("q4")
        drafter.start(prompt, 64, target_cache=cache)
        with monkeypatch.context() as m:
            m.setattr(chains, "greedy_chain", counted)
            if not fast:
                m.setattr(chains, "greedy_chain_ready", lambda model, kv: False)
            tree = drafter.propose(DraftContext(context, shape, SamplingParams(0.0)))
        drafter.close()
        q = [tree.q_dists[parent] for parent in [-1] + list(range(len(tree) - 1))]
        return tree.tokens, tree.q_token, tree.stop, tree.facts.get("model_passes"), q

    # the chain's confidences, raw: which tenth of q each level's token falls in
    _, q_token, *_ = propose(TreeShape(6), fast=False)
    bins = [min(9, int(q * 10)) for q in q_token]
    seen = {"stop": 0, "several": 0, "split": 0}
    for low in (0.95, 0.8, 0.6, 0.3):  # the tenths the chain lands in; every other tenth 1.0 or 0.7
        for rest in (1.0, 0.7):
            cal = tuple(low if b in bins else rest for b in range(10))
            shape = TreeShape(6, min_confidence=0.5, calibration=cal)
            calls.clear()
            fast = propose(shape, fast=True)
            loop = propose(shape, fast=False)
            assert fast[:3] == loop[:3] and fast[3] == loop[3] == sum(calls), (cal, calls)
            assert all(torch.equal(a, b) for a, b in zip(fast[4], loop[4]))
            seen["stop"] += fast[2] == "confidence"
            seen["several"] += max(calls) > 1
            seen["split"] += len(calls) > 1
    assert all(seen.values()), seen


@pytest.mark.parametrize(
    "drafter,kw",
    [("q4", {"k": 4}), ("q4", {"k": 6, "adaptive": True}), ("int8", {"k": 3}), ("int8", {"k": 5, "max_new_tokens": 7})],
)
def test_greedy_chains_in_one_call_are_the_drafters_loop(tiny_engine, monkeypatch, drafter, kw):
    """A model drafter's greedy chain runs its passes in one C call (chains.greedy_chain) where every
    matrix is on our kernels: every step event (drafted tokens, their q, decisions, passes, the stop reason)
    and the output equal the drafter's pass-by-pass loop's. q4 reads the target's keys and values (the pending
    token alone is fed), int8 catches up on its own (two tokens after a fully accepted chain); adaptive depth
    may stop a chain by confidence, and each call runs the levels the loop is sure to reach (several while the
    calibrated confidences cannot fall below the threshold: every level left at the first step)."""
    from engine.kernels import cpu_build
    from engine.model import chains

    if not cpu_build.available():
        pytest.skip(f"no CPU kernel: {cpu_build.why_unavailable()}")
    settings = {"max_new_tokens": 24, "chat": False, **kw}
    prompt = "a b c d a b c d a b c d e f"
    if kw.get("adaptive"):
        # K by the outcomes alone (transformers' schedule): the measured times differ between the two runs
        monkeypatch.setattr(tiny_engine.costs, "weighed_pass_ms", lambda *args, **kwargs: None)
    calls = []
    chain = chains.greedy_chain

    def counted(model, token, cache, n):
        calls.append(n)
        return chain(model, token, cache, n)

    monkeypatch.setattr(chains, "greedy_chain", counted)
    fast = tiny_engine.run(prompt, drafter, **settings)
    assert calls, "the chain never ran"
    if kw.get("adaptive"):
        assert max(calls) > 1  # the first step: nothing verified yet, every tenth of q trusted fully
    monkeypatch.setattr(chains, "greedy_chain_ready", lambda model, cache: False)
    loop = tiny_engine.run(prompt, drafter, **settings)
    assert fast["token_ids"] == loop["token_ids"] == tiny_engine.run(prompt, "none", **settings)["token_ids"]
    assert _steps_without_times(fast) == _steps_without_times(loop)


def _same_steps(a, b, path: str = "steps") -> None:
    """Assert two runs' step events are the same, numbers to 2e-6 (a sampled chain's q is its C softmax, the
    loop's torch's: the same to float32 rounding, which the events' 6 decimals may show)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _same_steps(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_steps(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, abs=2e-6), path
    else:
        assert a == b, path


@pytest.mark.parametrize(
    "drafter,kw",
    [("q4", {"k": 4}), ("q4", {"k": 6, "adaptive": True}), ("q4", {"k": 5, "verify": "block"}), ("int8", {"k": 3})],
)
def test_sampled_chains_in_one_call_are_the_drafters_loop(tiny_engine, monkeypatch, sampled_chain_calls, drafter, kw):
    """A q4 or int8 chain sampled with a temperature alone runs its passes in one C call (chains.sampled_chain),
    each token drawn in C from q = softmax(logits / T) at a uniform from the run's generator, one per pass, as
    the loop draws them: with the same seed every step event (drafted tokens, decisions, passes, stops) equals
    the drafter's pass-by-pass loop's and its q to float32 rounding, and so does the output; with top-p set
    the loop runs (the chain knows only a temperature)."""
    from engine.kernels import cpu_build
    from engine.model import chains

    if not cpu_build.available():
        pytest.skip(f"no CPU kernel: {cpu_build.why_unavailable()}")
    settings = {"max_new_tokens": 24, "chat": False, "temperature": 0.9, "seed": 3, **kw}
    prompt = "a b c d a b c d a b c d e f"
    if kw.get("adaptive"):
        monkeypatch.setattr(tiny_engine.costs, "weighed_pass_ms", lambda *args, **kwargs: None)
    calls = sampled_chain_calls
    fast = tiny_engine.run(prompt, drafter, **settings)
    assert calls, "the chain never ran"
    calls.clear()
    tiny_engine.run(prompt, drafter, **{**settings, "top_p": 0.9})
    assert not calls  # top-p: the loop
    monkeypatch.setattr(chains, "greedy_chain_ready", lambda model, cache: False)
    loop = tiny_engine.run(prompt, drafter, **settings)
    assert fast["token_ids"] == loop["token_ids"]
    _same_steps(_steps_without_times(fast), _steps_without_times(loop))


# ----------------------------------------------------------------- the heap
def test_an_engine_sets_the_heap_aside_and_frees_a_dropped_one(default_tokenizer):
    """freeze_heap: the objects alive when an engine is built are left out of the collector's full walks
    (CPython walked ~310,000 of them per full collection in a loaded process: 17-19 ms a stall), and an engine
    dropped in a reference cycle, which only the collector can free, is freed when the next one is built."""
    import gc
    import weakref

    from conftest import tiny_transformer

    from engine.decode import SpeculativeEngine
    from engine.model.loading import LoadedModel

    def build():
        _, model = tiny_transformer()
        return SpeculativeEngine(LoadedModel("tiny-random", model, default_tokenizer, torch.float32))

    first = build()
    assert gc.get_freeze_count() > 0
    first.itself = first  # dropped, it is garbage only the collector finds
    gone = weakref.ref(first)
    del first
    second = build()
    assert gone() is None
    assert second.target.model is not None
