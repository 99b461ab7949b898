"""A public demo under odd input and many users: fuzzed API calls, concurrent clients, memory, limits."""

from __future__ import annotations

import gc
import math
import random
import threading

import pytest
from conftest import assert_run_stopped

gradio_client = pytest.importorskip("gradio_client")

pytestmark = pytest.mark.slow

API_DEFAULTS = dict(drafter="ngram", k=3, temperature=0.0, top_p=1.0, top_k=0, seed=0, max_new_tokens=4)


def _call(client, prompt, **overrides):
    args = {**API_DEFAULTS, **overrides}
    return client.predict(prompt, *args.values(), api_name="/generate")


def _random_value(rng: random.Random):
    return rng.choice(
        [
            None,
            "",
            "abc",
            "nan",
            -1,
            0,
            1,
            3,
            10**9,
            -(10**9),
            2.5,
            1e308,
            -0.0,
            True,
            [1, 2],
            {"a": 1},
            "∞",
        ]
    )


def test_fuzzed_generate_calls_succeed_or_fail_clearly(server):
    rng = random.Random(1234)
    client = gradio_client.Client(server, verbose=False)
    keys = list(API_DEFAULTS)
    prompts = ["", "   ", "Hi", "x" * 5000, "\x00\x01", "名前は?", "<|im_end|>", None, 42]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(40):
        overrides = {}
        for key in rng.sample(keys, rng.randint(1, 3)):
            overrides[key] = _random_value(rng)
        if rng.random() < 0.3:
            overrides["drafter"] = rng.choice(
                ["none", "ngram", "int8", "medusa", "model:", "model:nope/nope", "", None]
            )
        prompt = rng.choice(prompts)
        try:
            result = _call(client, prompt, **overrides)
        except Exception as exc:  # gradio_client raises AppError carrying the gr.Error message
            message = str(exc)
            assert message and "Traceback" not in message, message
            assert len(message.splitlines()) <= 3, message
            outcomes["error"] += 1
        else:
            assert isinstance(result, dict) and isinstance(result["text"], str), result
            assert result["metrics"]["new_tokens"] >= 1
            outcomes["ok"] += 1
    assert outcomes["error"] >= 10  # the generator produced plenty of bad input
    # The server still serves a valid request afterwards.
    result = _call(client, "What is the capital of France?", max_new_tokens=6)
    assert "Paris" in result["text"]


def test_eight_concurrent_clients_get_exactly_their_own_results(server):
    prompts = [
        f"Give me one word that rhymes with {w}." for w in ("cat", "tree", "sun", "rain", "car", "book", "light", "sea")
    ]
    settings = [
        dict(drafter=("ngram", "int8")[i % 2], temperature=0.8, seed=100 + i, max_new_tokens=8) for i in range(8)
    ]
    alone = [_call(gradio_client.Client(server, verbose=False), p, **s) for p, s in zip(prompts, settings)]
    results: list = [None] * 8
    errors: list = []

    def worker(i):
        try:
            results[i] = _call(gradio_client.Client(server, verbose=False), prompts[i], **settings[i])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for i in range(8):
        assert results[i]["text"] == alone[i]["text"], (i, results[i]["text"], alone[i]["text"])
        assert results[i]["seed"] == 100 + i


def test_memory_stays_flat_across_many_runs(real_engine):
    import psutil

    proc = psutil.Process()
    for _ in range(5):  # warm-up: allocator pools, token text cache, int8 weights
        real_engine.run("Say hi.", "int8", max_new_tokens=4, temperature=0.7)
    gc.collect()
    before = proc.memory_info().rss
    for i in range(50):
        real_engine.run("Say hi.", ("ngram", "int8", "none")[i % 3], max_new_tokens=4, temperature=0.7, seed=i)
    gc.collect()
    grown_mb = (proc.memory_info().rss - before) / 2**20
    assert grown_mb < 64, f"RSS grew by {grown_mb:.1f} MiB over 50 runs"


def test_limits_refuse_disallowed_models_and_long_prompts(monkeypatch):
    import gradio as gr

    from app import config
    from app.tabs.api import generate as api_generate

    with pytest.raises(ValueError, match="not allowed"):
        config.check_model_allowed("someone/huge-model")
    config.check_model_allowed("Qwen/Qwen2.5-1.5B-Instruct")  # a preset is allowed
    monkeypatch.setenv("SPECLENS_ALLOW_ANY_MODEL", "1")
    config.check_model_allowed("someone/huge-model")
    monkeypatch.delenv("SPECLENS_ALLOW_ANY_MODEL")
    with pytest.raises(gr.Error, match="not allowed"):
        next(api_generate("hi", drafter="model:someone/huge-model"))
    with pytest.raises(gr.Error, match="limit is"):
        next(api_generate("word " * (config.MAX_PROMPT_TOKENS + 10), max_new_tokens=2))
    assert not math.isnan(config.MAX_NEW_TOKENS)


def test_dropped_api_connection_ends_the_run_within_a_pass(server, target_pass_times):
    """A client that goes away mid-run (here: the raw SSE stream is closed) stops the run at the next
    target pass, and its slot serves the next request."""
    import time
    import uuid

    import httpx

    stamps = target_pass_times
    config = httpx.get(server + "config", timeout=30).json()
    fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
    session = uuid.uuid4().hex
    data = ["Write a long story about a lighthouse keeper.", "int8", 3, 0.0, 1.0, 0, 0, 250, False]  # adaptive off
    joined = httpx.post(
        server + "gradio_api/queue/join",
        json={"data": data, "fn_index": fn_index, "session_hash": session},
        timeout=30,
    )
    assert joined.status_code == 200, joined.text
    partial_updates = 0
    with httpx.stream("GET", server + f"gradio_api/queue/data?session_hash={session}", timeout=120) as stream:
        for line in stream.iter_lines():
            if '"process_generating"' in line:
                partial_updates += 1
                if len(stamps) >= 5:
                    break
    closed_at = time.monotonic()  # the connection is gone
    assert partial_updates >= 1
    assert_run_stopped(stamps, closed_at)
    client = gradio_client.Client(server, verbose=False)
    result = _call(client, "What is the capital of France?", max_new_tokens=6)
    assert result["partial"] is False and "Paris" in result["text"]
