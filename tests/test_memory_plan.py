"""Memory planning (engine/tools/memory_plan.py): sizes from a config on the meta device agree with
what the real default model allocates, and a run that cannot fit is refused with numbers."""

from __future__ import annotations

import pytest

from engine.tools.memory_plan import MemoryPlanError, available_memory, check_memory, plan_memory


@pytest.mark.slow
def test_plan_matches_the_loaded_default_model(real_engine):
    model = real_engine.target.model
    plan = plan_memory("default", "ngram", dtype="float32", device="cpu", k=4, max_new_tokens=64, prompt_tokens=100)
    # Weights: the meta-device count at float32 equals the bytes our model holds (tied head once).
    assert plan.target_bytes == pytest.approx(model.weight_bytes + model.embed.nbytes - model.lm_head.nbytes, rel=0.01)
    # KV cache: the plan's bytes per token are what a real cache allocates per slot.
    cache = model.new_cache(10)
    per_token = (cache.k.nbytes + cache.v.nbytes) // 10
    assert plan.kv_bytes == per_token * plan.context_tokens
    assert plan.context_tokens >= 100 + 64 + 5  # prompt, new tokens and one pass of K + 1
    assert plan.drafter_bytes == 0 and plan.fits
    int8 = plan_memory("default", "int8", dtype="float32", device="cpu", k=4, prompt_tokens=100)
    assert 0 < int8.drafter_bytes < plan.target_bytes and int8.drafter_kv_bytes == int8.kv_bytes
    q4 = plan_memory("default", "q4+ngram", dtype="bfloat16", device="cpu", k=4, prompt_tokens=100)
    assert 0 < q4.drafter_bytes < plan_memory("default", "int8", dtype="bfloat16", device="cpu", k=4).drafter_bytes
    for hybrid in ("suffix/q4", "ngram/q4:4"):  # a hybrid holds its model's weights
        assert plan_memory("default", hybrid, dtype="bfloat16", device="cpu", k=4, prompt_tokens=100).drafter_bytes == (
            q4.drafter_bytes
        )
    bigger = plan_memory(
        "default", "ngram", dtype="float32", device="cpu", k=4, max_new_tokens=64, prompt_tokens=100, concurrent_runs=3
    )
    assert bigger.kv_bytes == 3 * plan.kv_bytes and bigger.target_bytes == plan.target_bytes


def test_a_run_that_cannot_fit_is_refused_with_numbers(tmp_path):
    small = 300 * 2**20
    with pytest.raises(MemoryPlanError, match=r"needs .* GiB .* available") as info:
        check_memory("default", "int8", dtype="float32", device="cpu", available_bytes=small)
    assert isinstance(info.value, ValueError) and "vLLM" in str(info.value)
    # A 70B-class config (no weights anywhere): sized on the meta device, refused on this machine.
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
    ).save_pretrained(tmp_path)
    plan = plan_memory(str(tmp_path), "none", dtype="bfloat16", device="cpu", available_bytes=64 * 2**30)
    assert 130 * 2**30 < plan.target_bytes < 135 * 2**30  # ~70.6 B parameters in bf16
    assert not plan.fits and "needs" in plan.describe()
    assert available_memory("cpu") > 0
    with pytest.raises(ValueError, match="unknown drafter"):
        plan_memory("default", "warp", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="max_new_tokens"):
        plan_memory("default", "ngram", dtype="float32", device="cpu", max_new_tokens=0)


def test_the_plan_counts_fixed_shape_runners_and_graph_pools():
    from engine.model.runners import run_bucket

    args = dict(dtype="bfloat16", k=4, max_new_tokens=64, prompt_tokens=100, available_bytes=64 * 2**30)
    eager = plan_memory("default", "int8", device="cpu", **args)
    assert eager.runner_bytes == 0  # eager passes: no runner
    static = plan_memory("default", "int8", device="cpu", pass_graphs="static", strict=True, **args)
    graphs = plan_memory("default", "int8", device="cuda", **args)
    slots = run_bucket(eager.context_tokens, 10**9)
    assert slots == 256 and eager.context_tokens < slots
    # The runner's cache is the bucket's, for the target and the int8 drafter alike.
    assert static.kv_bytes == eager.kv_bytes // eager.context_tokens * slots
    assert static.drafter_kv_bytes == static.kv_bytes
    assert 0 < static.runner_bytes < graphs.runner_bytes  # graph pools add the recorded widths' outputs
    assert static.steady_bytes - eager.steady_bytes >= static.runner_bytes
    assert "fixed-shape runners" in graphs.describe() and any("graph pools" in n for n in graphs.notes)
    two = plan_memory("default", "int8", device="cuda", concurrent_runs=2, **args)
    assert two.runner_bytes == 2 * graphs.runner_bytes  # one runner per concurrent run
    wide = plan_memory("default", "int8", device="cuda", **{**args, "k": 40})
    assert wide.runner_bytes == 0  # wider than any runner: eager passes
