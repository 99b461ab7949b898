"""Drafts of drafts (engine/drafters/multilevel.py): the model drafter's own chain proposed by n-gram and
verified by the model with the exact rule hands the target exact draws from the model's q.

* On a tiny model (vocabulary 32), the first two drafted tokens follow the model's own joint law q(x1) q(x2 | x1)
  by chi-square, and a negative control (a rejection that does not remove the proposed token from the
  residual) is detected.
* The q handed on is the model's own conditional at each position.
* On the real model, greedy drafts of drafts are the plain q4 drafter's drafts, token for token, and the run's
  output is the baseline's; the step events record the drafter's passes and the copied tokens.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine.drafters.base import DraftContext, TreeShape
from engine.drafters.multilevel import MultiLevelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.sampling import SamplingParams, probs_from_logits
from tests.conftest import tiny_transformer

VOCAB = 32
N = 4000
SAMPLED = SamplingParams(temperature=3.0)  # the tiny model is sharp: soften q so both outcomes are common


class _ResidualKeepsTheProposal(MultiLevelDrafter):
    """The negative control: after a rejection it draws from q itself, the proposed token not removed."""

    @staticmethod
    def _draw(q, rejected, params, gen):
        return MultiLevelDrafter._draw(q, None, params, gen)


def _exact_q(model, tokens: list[int]) -> torch.Tensor:
    """The model's q after `tokens`, from a fresh cache: [V]."""
    cache = model.new_cache(64)
    return probs_from_logits(model.prefill(tokens, cache), SAMPLED)


def _context(model) -> tuple[list[int], int, float]:
    """A context whose n-gram proposal c1 has a q between 0.15 and 0.8 (the inner rule then both keeps and
    rejects it often); (context, c1, q(c1))."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(400):
        a, b, c = torch.randint(0, VOCAB, (3,), generator=gen).tolist()
        filler = torch.randint(0, VOCAB, (3,), generator=gen).tolist()
        context = [a, b, c, *filler, a, b]  # n-gram proposes c after the repeated (a, b)
        q = _exact_q(model, context)
        if 0.15 < float(q[c]) < 0.8:
            return context, c, float(q[c])
    raise AssertionError("no context with a proposal of moderate q")


def _draws(drafter_cls, model, context: list[int], n: int) -> tuple[list[tuple[int, int]], list]:
    drafter = drafter_cls(model, "tiny+ngram", NgramDrafter(2, 1))
    drafter.start(context, 64)
    gen = torch.Generator().manual_seed(0)
    pairs, trees = [], []
    for _ in range(n):
        drafter.rewind(len(context) - 1)  # the pending token is fed again: the same root every draw
        tree = drafter.propose(DraftContext(context, TreeShape(k=2), SAMPLED, gen))
        pairs.append((tree.tokens[0], tree.tokens[1]))
        trees.append(tree)
    return pairs, trees


def _pvalue(observed: list[int], probs: torch.Tensor, n: int) -> float:
    counts = torch.bincount(torch.tensor(observed, dtype=torch.long), minlength=VOCAB).double()
    expected = probs.double() * n
    keep = expected >= 5  # pool the rare tokens into one bin (where there are any)
    f_obs, f_exp = counts[keep], expected[keep]
    if bool((~keep).any()):
        f_obs = torch.cat([f_obs, counts[~keep].sum(0, keepdim=True)])
        f_exp = torch.cat([f_exp, expected[~keep].sum(0, keepdim=True)])
    f_exp = f_exp * (f_obs.sum() / f_exp.sum())
    return float(chisquare(f_obs.numpy(), f_exp.numpy()).pvalue)


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_transformer(vocab_size=VOCAB, seed=3)[1]


def test_drafts_of_drafts_are_draws_from_the_models_own_law(tiny_model):
    context, c1, q_c1 = _context(tiny_model)
    pairs, trees = _draws(MultiLevelDrafter, tiny_model, context, N)
    q1 = _exact_q(tiny_model, context)
    assert _pvalue([x1 for x1, _ in pairs], q1, N) > 1e-3
    # the second token after a kept proposal (the model's row after c1) and after another first token
    after_c1 = [x2 for x1, x2 in pairs if x1 == c1]
    assert len(after_c1) > 0.15 * N
    assert _pvalue(after_c1, _exact_q(tiny_model, context + [c1]), len(after_c1)) > 1e-3
    other = max((x for x, _ in pairs if x != c1), key=[x for x, _ in pairs].count)
    after_other = [x2 for x1, x2 in pairs if x1 == other]
    assert _pvalue(after_other, _exact_q(tiny_model, context + [other]), len(after_other)) > 1e-3
    # the q handed to the target are the model's conditionals at each position
    tree = next(t for t in trees if t.tokens[0] == c1)
    assert torch.allclose(tree.q_dists[-1], q1, atol=1e-6)
    assert torch.allclose(tree.q_dists[0], _exact_q(tiny_model, context + [c1]), atol=1e-6)
    # a kept proposal rode on the catch-up pass (one pass for two drafts); a rejected one cost nothing extra
    assert {(t.facts["copied"], t.facts["model_passes"]) for t in trees} == {(1, 1), (0, 2)}


def test_a_residual_that_keeps_the_proposal_is_detected(tiny_model):
    context, c1, q_c1 = _context(tiny_model)
    pairs, _ = _draws(_ResidualKeepsTheProposal, tiny_model, context, N)
    assert _pvalue([x1 for x1, _ in pairs], _exact_q(tiny_model, context), N) < 1e-6


def test_only_a_copying_drafter_drafts_for_a_model(tiny_engine):
    for spec in ("eagle+ngram", "ngram+int8", "int8+eagle", "q4+none"):
        with pytest.raises(ValueError, match="drafts of drafts"):
            tiny_engine.drafter(spec)


@pytest.mark.real_model
def test_greedy_drafts_of_drafts_are_the_q4_drafts_and_the_baseline_output(served_engine):
    prompt = "Rewrite in the past tense: The cat sits on the mat and watches the birds in the garden."
    base = served_engine.run(prompt, "none", max_new_tokens=40)
    plain = served_engine.run(prompt, "q4", k=5, max_new_tokens=40)
    multi = served_engine.run(prompt, "q4+ngram", k=5, max_new_tokens=40)
    assert plain["token_ids"] == base["token_ids"] == multi["token_ids"]
    steps = lambda run: [e for e in run["events"] if e["type"] == "step"]  # noqa: E731
    assert [[n["token_id"] for n in s["nodes"]] for s in steps(plain)] == [
        [n["token_id"] for n in s["nodes"]] for s in steps(multi)
    ]
    drafts = [s["draft"] for s in steps(multi)]
    assert all(d["model_passes"] >= 1 and 0 <= d["copied"] <= d["k"] for d in drafts)
    assert sum(d["model_passes"] for d in drafts) < sum(s["draft"]["model_passes"] for s in steps(plain))


@pytest.mark.real_model
def test_q4_reads_the_committed_keys_and_values_from_the_target(served_engine, monkeypatch):
    """q4 shares the target's KV cache (DrafterNeeds.target_kv): it never prefills the prompt nor catches up
    more than the pending token (every pass it runs is one row wide), and its cache holds the target's keys and
    values for the committed positions it did not feed itself (rounded to its bf16 cache); greedy output is still
    the baseline's."""
    from engine.drafters.model import ModelDrafter
    from engine.model import chains

    widths, seen = [], {}
    original_pass, original_accept = ModelDrafter.model_pass, ModelDrafter.accept
    original_chain = chains.greedy_chain

    def recording_pass(self, tokens, *args, **kwargs):
        widths.append(int(tokens.shape[0]))
        return original_pass(self, tokens, *args, **kwargs)

    def recording_chain(model, token, cache, n):  # n one-token passes in one call (greedy chains)
        widths.extend([1] * n)
        return original_chain(model, token, cache, n)

    def recording_accept(self, verified):
        original_accept(self, verified)
        seen["drafter"], seen["target"] = self.cache, self.target_cache

    monkeypatch.setattr(ModelDrafter, "model_pass", recording_pass)
    monkeypatch.setattr(ModelDrafter, "accept", recording_accept)
    monkeypatch.setattr(chains, "greedy_chain", recording_chain)
    prompt = "Why do cats purr? Answer in a short paragraph."
    run = served_engine.run(prompt, "q4", k=4, max_new_tokens=24)
    assert run["token_ids"] == served_engine.run(prompt, "none", max_new_tokens=24)["token_ids"]
    assert widths and set(widths) == {1}, widths
    prompt_len = run["events"][0]["prompt_tokens"]
    drafter, target = seen["drafter"], seen["target"]
    assert target is not None and drafter.length >= prompt_len - 1
    assert drafter.k.dtype == torch.bfloat16 and target.k.dtype == torch.float32
    assert torch.equal(drafter.k[:, :, : prompt_len - 1], target.k[:, :, : prompt_len - 1].to(torch.bfloat16))
    assert torch.equal(drafter.v[:, :, : prompt_len - 1], target.v[:, :, : prompt_len - 1].to(torch.bfloat16))
    int8 = served_engine.drafter("int8")
    assert not int8.needs.target_kv  # int8 computes its own (its recorded traces stay reproducible)
    # its weights: the GGUF's nibbles in Q4_1B blocks (scales in bytes), the head too: 0.28 of the target's bytes
    from engine.kernels import cpu_packed

    model = served_engine.drafter("q4").model
    mats = [getattr(layer, attr) for layer in model.layers for attr in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(m.packed, cpu_packed.PackedQ4_1BWeight) for m in mats)
    assert isinstance(model.lm_head.head.q4, cpu_packed.PackedQ4_1BWeight)
    read = sum(m.nbytes for m in mats) + model.lm_head.nbytes
    assert 0.27 < read / served_engine.target.model.weight_bytes < 0.29, read


def test_q4_of_a_target_without_a_gguf_quantises_it_and_keeps_greedy_parity(tiny_engine):
    """A target that does not come from a Q4_1 GGUF (here the tiny random one) gets its layers quantised by
    Q4_1B's rule (PackedQ4_1BWeight.quantize) for the q4 drafter; greedy output is the baseline's; without our CPU kernels q4 is
    refused with a message that says why."""
    from engine.kernels import cpu_build
    from engine.model.weights import Q4Linear

    if not cpu_build.available():
        with pytest.raises(ValueError, match="CPU kernels"):
            tiny_engine.drafter("q4")
        return
    prompt = "a b c d a b c d a b"
    run = tiny_engine.run(prompt, "q4", k=3, max_new_tokens=12, chat=False)
    assert run["token_ids"] == tiny_engine.run(prompt, "none", max_new_tokens=12, chat=False)["token_ids"]
    model = tiny_engine.drafter("q4").model
    assert all(isinstance(layer.gate_up, Q4Linear) for layer in model.layers)


@pytest.mark.real_model
def test_dry_stretches_chain_in_one_call_with_the_same_drafts(served_engine, greedy_chain_calls):
    """Open chat, where n-gram rarely proposes: after DRY_ROUNDS rounds without a proposal, q4+ngram drafts the
    rest of a chain in one greedy_chain call (not a Python pass per token). Its drafts are the plain q4
    drafter's, token for token, its passes never more, and the output is the baseline's."""
    from engine.drafters.multilevel import DRY_ROUNDS

    calls = greedy_chain_calls
    prompt = "Explain in simple words how a refrigerator keeps food cold."
    base = served_engine.run(prompt, "none", max_new_tokens=48)
    plain = served_engine.run(prompt, "q4", k=5, max_new_tokens=48)
    calls.clear()
    multi = served_engine.run(prompt, "q4+ngram", k=5, max_new_tokens=48)
    assert DRY_ROUNDS >= 1 and calls and max(calls) >= 2, calls
    assert plain["token_ids"] == base["token_ids"] == multi["token_ids"]
    steps = lambda run: [e for e in run["events"] if e["type"] == "step"]  # noqa: E731
    assert [[n["token_id"] for n in s["nodes"]] for s in steps(plain)] == [
        [n["token_id"] for n in s["nodes"]] for s in steps(multi)
    ]
    assert [[n["q"] for n in s["nodes"]] for s in steps(plain)] == [[n["q"] for n in s["nodes"]] for s in steps(multi)]
    passes = lambda run: sum(s["draft"]["model_passes"] for s in steps(run))  # noqa: E731
    assert passes(multi) <= passes(plain)


def test_sampled_dry_stretches_chain_in_one_call_with_the_plain_drafters_draws(served_engine, sampled_chain_calls):
    """The same at T = 0.7: a dry stretch draws the rest of the chain in one sampled_chain call. A round without
    a proposal draws one uniform per token, as the call does, so with the same seed q4+ngram's steps are the
    plain q4 drafter's (drafted tokens, decisions; q to float32 rounding: the rounds' torch softmax against the
    call's) for as long as n-gram proposes nothing, with no more passes (a proposal's walk draws uniforms of its
    own: from there the two runs' draws part)."""
    prompt = "Explain in simple words how a refrigerator keeps food cold."
    settings = {"k": 5, "max_new_tokens": 48, "temperature": 0.7, "seed": 2}
    plain = served_engine.run(prompt, "q4", **settings)
    sampled_chain_calls.clear()
    multi = served_engine.run(prompt, "q4+ngram", **settings)
    assert sampled_chain_calls and max(sampled_chain_calls) >= 2, sampled_chain_calls
    steps = lambda run: [e for e in run["events"] if e["type"] == "step"]  # noqa: E731
    dry = []
    for a, b in zip(steps(plain), steps(multi)):
        if b["draft"].get("copied"):
            break
        dry.append((a, b))
    assert len(dry) >= 3, "the prompt's first steps are dry"
    for a, b in dry:
        assert [(n["token_id"], n["decision"]) for n in a["nodes"]] == [
            (n["token_id"], n["decision"]) for n in b["nodes"]
        ]
        assert [n["q"] for n in a["nodes"]] == pytest.approx([n["q"] for n in b["nodes"]], abs=2e-6)
        assert b["draft"]["model_passes"] <= a["draft"]["model_passes"]


@pytest.mark.parametrize("wet_inside", [False, True])
def test_dry_rounds_count_up_and_a_proposal_inside_a_chain_ends_the_stretch(
    tiny_model, monkeypatch, greedy_chain_calls, wet_inside
):
    """The dry-stretch bookkeeping, with the copying drafter's answers fixed: DRY_ROUNDS rounds without a
    proposal run one pass each, the next round chains the rest in one call, the drafts are the plain model
    drafter's greedy chain; a proposal the copying drafter would have made at a position the chain passed
    sets the count back to 0, none adds the chain's rounds to it."""
    from engine.drafters.model import ModelDrafter, q4_weights
    from engine.drafters.multilevel import DRY_ROUNDS
    from engine.kernels import cpu_build
    from engine.model import chains

    if not cpu_build.available():
        pytest.skip(f"greedy_chain needs our CPU kernels: {cpu_build.why_unavailable()}")
    tiny_model = q4_weights(tiny_model)  # its layers in Q4_1: all on our kernels, as the q4 drafter's
    assert chains.greedy_chain_ready(tiny_model, tiny_model.new_cache(8))
    context, k = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], DRY_ROUNDS + 3
    greedy = SamplingParams(temperature=0.0)
    plain = ModelDrafter(tiny_model, "tiny")
    plain.start(context, 64)
    expected = plain.propose(DraftContext(context, TreeShape(k=k), greedy, torch.Generator())).tokens
    calls = greedy_chain_calls
    calls.clear()  # (the plain drafter's chain above)
    drafter = MultiLevelDrafter(tiny_model, "tiny+ngram", NgramDrafter(2, 1))
    # no proposal in the rounds; where wet_inside, one at the positions inside the chain (checked afterwards)
    monkeypatch.setattr(
        drafter, "_proposal", lambda tokens, room: [0] if wet_inside and len(tokens) > len(context) + DRY_ROUNDS else []
    )
    drafter.start(context, 64)
    tree = drafter.propose(DraftContext(context, TreeShape(k=k), greedy, torch.Generator()))
    assert tree.tokens == expected
    assert tree.facts["model_passes"] == k and calls == [k - DRY_ROUNDS]  # DRY_ROUNDS Python passes, then one chain
    assert drafter._dry == (0 if wet_inside else k)
