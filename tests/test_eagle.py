"""The EAGLE-style drafter: feature hand-off, exactness (greedy parity, chi-square with a negative
control) on a tiny random target with a random head, the training recipe end to end (--quick), and the
shipped head on the real default model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from engine.drafters.eagle import EagleHead, head_dir, head_state_names, load_head
from engine.kernels import cpu_build
from engine.metrics import draft_token_cost
from engine.tools.exactness import TEST_LEVEL, chi_square_test, pair_distribution, verify_children_ignoring_q
from engine.tools.parity import parity_check
from engine.tools.samples import next_token_distribution, sample_next_tokens

# the exact rule, or the lossy negative control passed to the tree walk in its place
VERIFIERS = {"exact": None, "drop_q": verify_children_ignoring_q}

PROMPT = "Write a haiku about autumn leaves."


def random_head(engine, vocab: int = 4096, seed: int = 0) -> EagleHead:
    """An untrained head of the right shapes: drafting is then poor but must still be exact."""
    state, vocab_ids = random_head_state(engine, vocab, seed)
    return EagleHead(engine.target.model, state, vocab_ids, {"target": engine.target.name})


def random_head_state(engine, vocab: int = 4096, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """(an untrained last-layer head's tensors, its reduced vocabulary) for the engine's target."""
    model = engine.target.model
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    E, H, Hkv, D, inter = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {
        "fuse.weight": (E, 2 * E),
        "feature_norm.weight": (E,),
        "model.layers.0.input_layernorm.weight": (E,),
        "model.layers.0.self_attn.q_proj.weight": (H * D, E),
        "model.layers.0.self_attn.k_proj.weight": (Hkv * D, E),
        "model.layers.0.self_attn.v_proj.weight": (Hkv * D, E),
        "model.layers.0.self_attn.o_proj.weight": (E, H * D),
        "model.layers.0.post_attention_layernorm.weight": (E,),
        "model.layers.0.mlp.gate_proj.weight": (inter, E),
        "model.layers.0.mlp.up_proj.weight": (inter, E),
        "model.layers.0.mlp.down_proj.weight": (E, inter),
    }
    assert sorted(shapes) == sorted(head_state_names())
    state = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) * 0.3) for n, s in shapes.items()}
    # The reduced vocabulary: the most likely tokens of a real run are in it, some are not.
    vocab_ids = torch.randperm(cfg.vocab_size, generator=gen)[:vocab].sort().values
    return state, vocab_ids


@pytest.fixture(scope="module")
def tiny_eagle(tiny_engine):
    tiny_engine.use_eagle_head(random_head(tiny_engine))
    yield tiny_engine
    tiny_engine.use_eagle_head(None)


def test_head_reads_exactly_the_targets_features_of_committed_positions(tiny_eagle):
    """After a few speculative steps the drafter holds, for every committed position, the target's own
    last-layer row: the same rows a single prefill of the whole committed text computes."""
    engine = tiny_eagle
    run = engine.run(PROMPT, "eagle", max_new_tokens=20, k=3)
    drafter = engine.drafter("eagle")
    prompt_ids = engine.encode_prompt(PROMPT)
    ids = prompt_ids + run["token_ids"]
    from engine.decode import GenerationSettings

    settings = GenerationSettings(k=3, max_new_tokens=20)
    params, shape = settings.validate()
    with engine.running(prompt_ids, drafter, settings, shape, params, 0, 40) as state:
        for _ in range(4):
            result = engine.step(state)
            state.context.extend(item["token_id"] for item in result.verdict.emitted(result.tree))
        known = drafter.known
        assert known == len(state.context) - 1
        cache = engine.target.model.new_cache(len(state.context) + 1)
        hidden = engine.target.model.prefill_features(state.context[:-1], cache).hidden
        features = drafter.features[:known]
        torch.testing.assert_close(features, hidden.to(drafter.features.dtype), rtol=1e-4, atol=1e-4)
    assert ids[: len(state.context)] == state.context  # the same greedy text as the run


@pytest.mark.parametrize("shape", [dict(k=4), dict(k=3, topk=2, num_draft_tokens=5)], ids=["chain", "tree"])
def test_greedy_eagle_equals_the_baseline(tiny_eagle, shape):
    prompts = [PROMPT, "Explain recursion.", "List three fruits."]
    results = list(parity_check(tiny_eagle, prompts, "eagle", max_new_tokens=24, **shape))
    assert all(r["identical"] for r in results), results


def test_one_token_prompt_drafts_nothing_first_then_drafts(tiny_eagle):
    run = tiny_eagle.run([42], "eagle", max_new_tokens=6, k=2, chat=False)
    steps = [e for e in run["events"] if e["type"] == "step"]
    assert steps[0]["drafted"] == 0 and any(s["drafted"] for s in steps[1:])


def _pair_test(engine, drafter: str, shape: dict, verifier: str, n: int = 1500) -> dict:
    settings = dict(temperature=1.0, top_k=3, seed=7, **shape)
    samples = sample_next_tokens(
        engine, PROMPT, drafter, n_samples=n, n_tokens=2, verify_node=VERIFIERS[verifier], **settings
    )

    def dist(prefix):
        p = next_token_distribution(engine, PROMPT, prefix, temperature=1.0, top_k=3)
        return {int(t): float(p[t]) for t in torch.nonzero(p).flatten()}

    law = pair_distribution(dist([]), lambda x1: dist([x1]))
    index = {pair: i for i, pair in enumerate(law)}
    counts = Counter(index.get(s, -1) for s in samples)
    return chi_square_test(dict(counts), {index[pair]: p for pair, p in law.items()}, n)


@pytest.mark.parametrize("shape", [dict(k=2), dict(k=2, topk=2)], ids=["chain", "tree"])
def test_eagle_sampling_is_exact_on_a_tiny_target(tiny_eagle, shape):
    """The first two tokens' joint law against p(x1)·p(x2|x1). A random head seldom drafts the tiny
    target's top tokens, so here this checks the rejection/residual path; the negative control needs
    drafts that overlap p and runs on the real model with the trained head (below)."""
    exact = _pair_test(tiny_eagle, "eagle", shape, "exact")
    assert exact["pvalue"] is not None and exact["pvalue"] > TEST_LEVEL, exact


def test_missing_head_names_the_target_and_the_command(tiny_engine, tmp_path):
    with pytest.raises(ValueError, match="train-head"):
        load_head(tiny_engine.target.model, "some/other-model", tmp_path)


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory, tiny_engine):
    """One head trained once for the module, through the CLI, into a folder that already holds a head: an untrained
    last-layer one (format 1, what --feature-layers last writes). train-head --quick on the tiny random target,
    three of its prompts written by the target itself; the new head (the default: a mix of layers) is written
    aside and replaces the installed one only if it drafts more tokens per pass. Returns (out, work, a copy of
    the untrained head's folder, stdout)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("head")
    out, work, untrained = root / "head", root / "w", root / "untrained"
    state, vocab_ids = random_head_state(tiny_engine, vocab=512)
    meta = {"format": "1", "target": "tiny-random", "hidden_size": str(tiny_engine.target.model.cfg.hidden_size)}
    for folder in (out, untrained):
        folder.mkdir()
        save_file({**state, "vocab_ids": vocab_ids}, str(folder / "eagle-head.safetensors"), metadata=meta)
        (folder / "README.md").write_text("an untrained head\n")
    args = ["train-head", "--quick", "--written", "3", "--out", str(out), "--work", str(work)]
    proc = subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, work, untrained, proc.stdout


def test_train_head_quick_writes_a_head_the_engine_drafts_with(trained_head, tiny_engine):
    """The whole recipe (prompts, some written by the target, self-distilled answers, features, vocabulary,
    training with unrolling, export, held-out check, curves HTML, the keep-or-replace decision) on a tiny random
    target; the engine drafts with the head it wrote and with the head it found, each fed the layers its file
    names, and greedy decoding with either is the target's own."""
    out, work, untrained, stdout = trained_head
    candidate = work / "candidate"
    assert "held-out greedy K=4" in stdout
    assert {"eagle-head.safetensors", "README.md", "training-curves.json"} <= {p.name for p in candidate.iterdir()}
    curves = json.loads((candidate / "training-curves.json").read_text())
    assert len(curves["ce"][0]) == 3 and len(curves["step"]) >= 2
    new = load_head(tiny_engine.target.model, "tiny-random", candidate)
    assert new.vocab_ids.numel() == 512 and int(new.meta["hidden_size"]) == 64

    # Every answer row is for its own prompt; three of the prompts are written by the target itself.
    prompts = json.loads((work / "prompts.json").read_text())
    rows = {}
    for line in (work / "answers.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["index"]] = row  # the last row written for an index is the one the run used
    for i, row in rows.items():
        assert row["prompt_ids"] == tiny_engine.encode_prompt(prompts[i]["prompt"]), i
    written = [p for p in prompts if p["kind"] == "written"]
    assert 0 < len(written) <= 3 and all(12 <= len(p["prompt"]) <= 300 for p in written), written

    # The head already there was weighed against the new one on the same held-out prompts.
    decision = json.loads((work / "decision.json").read_text())
    assert decision["new"]["prompts"] == decision["current"]["prompts"] >= 10
    replaced = decision["replaced"]
    assert replaced == (decision["new"]["tokens_per_pass"] > decision["current"]["tokens_per_pass"])
    kept = (out / "eagle-head.safetensors").read_bytes()
    assert (kept == (candidate / "eagle-head.safetensors").read_bytes()) == replaced
    assert ("untrained" in (out / "README.md").read_text()) == (not replaced)
    assert (out / "training-curves.html").exists() == replaced  # drawn beside the installed head's curves

    # The new head reads a mix of the target's layers (EAGLE-3 style; both of the tiny target's two), the
    # untrained one the last layer alone (EAGLE-1): each file says which, the engine hands it those rows.
    for folder, layers in ((candidate, (0, 1)), (untrained, None)):
        head = load_head(tiny_engine.target.model, "tiny-random", folder)
        assert head.feature_layers == layers and (head.fc is not None) == bool(layers)
        tiny_engine.use_eagle_head(head)
        try:
            results = list(parity_check(tiny_engine, [PROMPT, "List three fruits."], "eagle", max_new_tokens=16, k=3))
            assert all(r["identical"] for r in results), results
            assert tiny_engine.drafter("eagle").needs.feature_layers == layers
        finally:
            tiny_engine.use_eagle_head(None)
    assert "layers 0, 1" in (candidate / "README.md").read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "engine", "train-head", "--quick", "--feature-layers", "1,0", "--work", str(work)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and "feature layers must be increasing" in bad.stderr, bad.stderr[-2000:]


def test_features_are_reused_only_for_the_sequences_they_were_computed_from(tmp_path):
    """Another seed in the same work folder draws other prompts: train-head's features (stage 3) are kept with
    the digest of the sequences they were computed from and recomputed for any others."""
    from conftest import tiny_hf_model

    from engine.training.train_head import TrainConfig, _cached_features

    hf, cfg = tiny_hf_model("llama", 512, 0), TrainConfig(feature_layers=())
    first = _cached_features(cfg, hf, [[1, 2, 3], [4, 5]], tmp_path)
    digest = (tmp_path / "features.sha256").read_text()
    again = _cached_features(cfg, hf, [[1, 2, 3], [4, 5]], tmp_path)
    assert (tmp_path / "features.sha256").read_text() == digest
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = _cached_features(cfg, hf, [[1, 2, 3], [4, 6]], tmp_path)
    assert (tmp_path / "features.sha256").read_text() != digest and not torch.equal(first[1], other[1])


def test_training_features_are_the_rows_the_engine_hands_the_head():
    """The recipe's teacher-forced features (transformers, hooks on the layers) and the engine's
    forward(feature_layers) are the same rows: the head is trained on what it drafts from."""
    from conftest import tiny_hf_model

    from engine.model.transformer import ModelConfig, Transformer
    from engine.training.train_head import _features

    hf = tiny_hf_model("llama", 512, 0)
    model = Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.float32)
    last = len(model.layers) - 1
    layers = tuple(sorted({0, last}))
    seq = list(range(3, 40))
    trained_on = _features(hf, [seq], 4096, layers)[0].float()  # float16 rows, as stored
    rows = model.prefill_features(seq, model.new_cache(48), layers).hidden
    torch.testing.assert_close(rows, trained_on, rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------ real model
REAL_HEAD = head_dir("SmolLM2-135M-Instruct")


@pytest.mark.slow
def test_shipped_head_loads_with_its_card(real_engine):
    head = load_head(real_engine.target.model, real_engine.target.name)
    assert 3_000_000 < head.parameters < 6_000_000
    card = (REAL_HEAD / "README.md").read_text()
    assert "Held-out acceptance" in card and "python -m engine train-head" in card


@pytest.mark.slow
def test_eagle_on_the_real_model_accepts_and_is_cheap(real_engine):
    """Greedy parity on the real model, and the head's drafts are mostly accepted at depth 1."""
    prompts = ["Give me three tips for learning to cook.", "Explain what a hash table is."]
    for shape in (dict(k=4), dict(k=3, topk=2, num_draft_tokens=6)):
        results = list(parity_check(real_engine, prompts, "eagle", max_new_tokens=24, **shape))
        assert all(r["identical"] for r in results), (shape, results)
    run = real_engine.run(prompts[1], "eagle", max_new_tokens=48, k=4)
    baseline = real_engine.run(prompts[1], "none", max_new_tokens=48)
    steps = lambda r: [e for e in r["events"] if e["type"] == "step"]  # noqa: E731
    # The shipped head is weak (its card: ~30% top-1) but its drafts are accepted at times, and a
    # drafted token costs a small fraction of a target pass: the point of reading the target's features.
    assert run["metrics"]["tokens_per_pass"] > 1.1 and run["metrics"]["accepted"] > 0, run["metrics"]
    assert draft_token_cost(steps(run), steps(baseline)) < 0.35


def test_eagle_never_drafts_through_the_token_chain(served_engine, monkeypatch):
    """EAGLE's passes feed fused features, not token embeddings: its greedy chains never go through
    chains.greedy_chain (which knows only token passes; once they did, and its drafts were the head's
    guesses from the wrong rows: 1.00 tokens per pass in the bench), even on our bf16 CPU kernels, where the
    head's matrices are."""
    from engine.model import chains

    def refuse(model, token, cache, n):
        raise AssertionError("EAGLE went through greedy_chain")

    monkeypatch.setattr(chains, "greedy_chain", refuse)
    run = served_engine.run("Explain what a hash table is.", "eagle", max_new_tokens=48, k=4)
    assert run["metrics"]["tokens_per_pass"] > 1.1 and run["metrics"]["accepted"] > 0, run["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [dict(k=2), dict(k=2, topk=2)], ids=["chain", "tree"])
def test_eagle_sampling_is_exact_on_the_real_model(served_engine, shape):
    exact = _pair_test(served_engine, "eagle", shape, "exact", n=600)
    assert exact["pvalue"] is not None and exact["pvalue"] > TEST_LEVEL, exact
    broken = _pair_test(served_engine, "eagle", shape, "drop_q", n=600)
    assert broken["pvalue"] < TEST_LEVEL, broken


@pytest.mark.slow
@pytest.mark.skipif(not cpu_build.available(), reason=f"CPU kernel unavailable: {cpu_build.why_unavailable()}")
def test_bfloat16_eagle_parity_is_bitwise_on_our_cpu_kernels():
    from engine import SpeculativeEngine

    engine = SpeculativeEngine.load(dtype="bfloat16")
    prompts = ["Summarize why sleep matters.", "Write a short poem about rivers.", "What is recursion?"]
    for shape in (dict(k=4), dict(k=3, topk=2, num_draft_tokens=6)):
        results = list(parity_check(engine, prompts, "eagle", max_new_tokens=32, **shape))
        assert all(r["identical"] for r in results), (shape, results)


def test_training_prompts_are_reproducible_and_hold_out_what_the_head_is_measured_on():
    from engine.training.head_data import build_prompts, held_out_texts

    first, again = build_prompts(300, seed=3), build_prompts(300, seed=3)
    assert first == again and len(first) == 300
    assert {p["kind"] for p in first} == {"chat", "code", "summarize"}
    held = held_out_texts()
    assert len(held) >= 10 and not held & {p["prompt"].strip() for p in first}
