"""The suffix drafter (engine/drafters/suffix.py): what it proposes, that sampling with it is exact, that a
session's earlier answers make a similar second answer faster on the real model, and that those answers
never reach the trace."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine.drafters.base import DraftContext, TreeShape
from engine.drafters.suffix import SuffixDrafter
from engine.sampling import SamplingParams
from engine.settings import GenerationSettings
from engine.tools.exactness import TEST_LEVEL, chi_square_test, pair_distribution
from engine.tools.parity import parity_check
from engine.tools.samples import next_token_distribution, sample_next_tokens

PARAMS = SamplingParams()
EXAMPLES = json.loads((Path(__file__).resolve().parent.parent / "assets" / "examples.json").read_text())


def _propose(drafter: SuffixDrafter, context: list[int], k: int = 4, topk: int = 1, budget: int | None = None):
    return drafter.propose(DraftContext(context, TreeShape(k, topk, budget), PARAMS))


def test_it_copies_what_followed_the_longest_match_in_an_earlier_answer():
    d = SuffixDrafter()
    d.remember([[1, 2, 3, 4, 5, 6, 7]])
    tree = _propose(d, [9, 3, 4, 5])  # "3 4 5" occurred in the earlier answer: "6 7" followed
    assert tree.tokens == [6, 7] and tree.depths == [1, 2] and tree.parents == [-1, 0]
    assert tree.point_mass and tree.q_token == [1.0, 1.0]


def test_the_context_itself_is_searched_too_and_nothing_matches_nothing():
    d = SuffixDrafter()
    assert _propose(d, [5, 6, 7, 8, 5, 6]).tokens == [7, 8, 5, 6]  # prompt lookup over the context
    empty = _propose(SuffixDrafter(), [1, 2, 3, 4])
    assert empty.tokens == [] and empty.stop == "no-match"


def test_siblings_are_ranked_by_how_often_they_followed():
    d = SuffixDrafter(min_frequency=0.0)
    d.remember([[1, 2, 7], [1, 2, 8], [1, 2, 8], [1, 2, 8]])
    tree = _propose(d, [0, 1, 2], k=1, topk=2)
    assert tree.tokens == [8, 7] and tree.parents == [-1, -1]  # 3 of 4 followed by 8, 1 by 7
    chain = _propose(d, [0, 1, 2], k=1, topk=1)
    assert chain.tokens == [8]


def test_rare_continuations_stop_the_tree():
    d = SuffixDrafter(min_frequency=0.3)
    d.remember([[1, 2, 7]] + [[1, 2, 8]] * 4)
    tree = _propose(d, [0, 1, 2], k=1, topk=2)  # 7 followed 1 of 5 occurrences: 0.2 < 0.3
    assert tree.tokens == [8] and tree.stop == "confidence"


def test_the_draft_is_as_long_as_its_match_vouches_for():
    doc = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    d = SuffixDrafter(spec_factor=1.0)
    d.remember([doc])
    short = _propose(d, [0, 1, 2], k=8)  # a 2-token match: at most 2 drafted tokens
    assert short.tokens == [3, 4] and short.stop == "short-match"
    long = _propose(d, [1, 2, 3, 4, 5], k=4)  # a 5-token match, K = 4: the pass's depth
    assert long.tokens == [6, 7, 8, 9] and long.stop == "depth"


def test_control_tokens_are_never_drafted_and_the_budget_holds():
    d = SuffixDrafter(stop_ids=[99])
    d.remember([[1, 2, 3, 99, 4]])
    assert _propose(d, [0, 1, 2], k=4).tokens == [3]
    wide = SuffixDrafter(min_frequency=0.0)
    wide.remember([[1, 2, t, t + 1] for t in range(10, 20)])
    tree = _propose(wide, [0, 1, 2], k=2, topk=4, budget=5)
    assert len(tree) == 5 and all(tree.parents[i] < i for i in range(5))


def test_bad_sizes_and_specs_say_what_they_take(tiny_engine):
    with pytest.raises(ValueError, match="suffix match lengths"):
        SuffixDrafter(max_match=2, min_match=3)
    for spec in ("suffix:", "suffix:a", "suffix:1,2,3"):
        with pytest.raises(ValueError, match=r"suffix\[:MAX\[,MIN\]\]"):
            tiny_engine.drafter(spec)
    assert tiny_engine.drafter("suffix:16,3").max_match == 16


@pytest.mark.parametrize(
    "history, message",
    [("one answer", "list of earlier answers"), ([1.5], "strings, or lists of token ids"), (["x"] * 17, "at most")],
)
def test_bad_history_gets_a_clear_message(history, message):
    with pytest.raises(ValueError, match=message):
        GenerationSettings(history=history).validate()


def test_history_token_ids_are_checked_and_texts_never_reach_the_trace(tiny_engine):
    with pytest.raises(ValueError, match="history token ids"):
        tiny_engine.run("Hi", "suffix", max_new_tokens=2, history=[[10**9]])
    secret = "a private earlier answer of this session"
    run = tiny_engine.run("Hi", "suffix", max_new_tokens=4, history=[secret])
    assert run["events"][0]["settings"]["history"] == 1
    assert secret not in str(run["events"])


def _tiny_history(engine, prompt_ids: list[int]) -> list[list[int]]:
    """Earlier 'answers' that continue the prompt's end with tokens the tiny target likes (its top 3 and, after
    each, its top 2), so that drafts are accepted as well as rejected."""
    docs = []
    first = next_token_distribution(engine, prompt_ids, [], temperature=1.0, top_k=3)
    for x1 in torch.topk(first, 3).indices.tolist():
        second = next_token_distribution(engine, prompt_ids, [x1], temperature=1.0, top_k=3)
        for x2 in torch.topk(second, 2).indices.tolist():
            docs.append(prompt_ids[-3:] + [x1, x2])
    return docs


@pytest.mark.parametrize("shape", [dict(k=2), dict(k=2, topk=2)], ids=["chain", "tree"])
def test_suffix_sampling_is_exact_on_a_tiny_target(tiny_engine, shape):
    """The first two tokens' joint law against p(x1)·p(x2|x1), with drafts copied from earlier answers."""
    prompt = tiny_engine.encode_prompt("Write a haiku about autumn leaves.", chat=False)
    history = _tiny_history(tiny_engine, prompt)
    settings = dict(temperature=1.0, top_k=3, seed=5, history=history, chat=False, **shape)
    n = 1500
    samples = sample_next_tokens(tiny_engine, prompt, "suffix", n_samples=n, n_tokens=2, **settings)

    def dist(prefix):
        p = next_token_distribution(tiny_engine, prompt, prefix, temperature=1.0, top_k=3)
        return {int(t): float(p[t]) for t in torch.nonzero(p).flatten()}

    law = pair_distribution(dist([]), lambda x1: dist([x1]))
    index = {pair: i for i, pair in enumerate(law)}
    counts = Counter(index.get(s, -1) for s in samples)
    result = chi_square_test(dict(counts), {index[pair]: p for pair, p in law.items()}, n)
    assert result["pvalue"] is not None and result["pvalue"] > TEST_LEVEL, result
    # ... and the drafts were really used: the run drafts from the history.
    run = tiny_engine.run(prompt, "suffix", max_new_tokens=2, **{**settings, "chat": False})
    assert run["metrics"]["drafted"] > 0


def test_greedy_suffix_equals_the_baseline(tiny_engine):
    prompts = ["Write a haiku about autumn leaves.", "List three fruits."]
    first = [tiny_engine.run(p, "none", max_new_tokens=24)["text"] for p in prompts]
    results = list(parity_check(tiny_engine, prompts, "suffix", max_new_tokens=24, k=4, history=first))
    assert all(r["identical"] for r in results), results


def test_a_similar_second_question_is_answered_with_more_tokens_per_pass(real_engine):
    """The lesson's example, on the real model: the first answer, remembered, drafts much of the similar second
    one. Without the history, suffix sees only the second prompt (as n-gram does)."""
    example = next(e for e in EXAMPLES if e["lesson"] == "suffix")
    greedy = {**example["settings"], "payload": "off"}
    first = real_engine.run(example["prompt"], "none", **greedy)["text"]
    alone = real_engine.run(example["then_ask"], "suffix", **greedy)["metrics"]
    remembered = real_engine.run(example["then_ask"], "suffix", history=[first], **greedy)
    baseline = real_engine.run(example["then_ask"], "none", **greedy)
    assert remembered["token_ids"] == baseline["token_ids"]  # greedy: the same text, exactly
    assert remembered["metrics"]["tokens_per_pass"] > alone["tokens_per_pass"] + 0.3, (remembered["metrics"], alone)
    recorded = example["measured"]
    assert recorded["tokens_per_pass"] > recorded["first_tokens_per_pass"]
    assert remembered["metrics"]["tokens_per_pass"] >= 0.75 * recorded["tokens_per_pass"]
