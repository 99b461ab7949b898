"""The graph-ready fixed-shape pass (engine/model/static_pass.py) against today's eager pass.

On the CPU the fixed-shape function runs eagerly; it must give the eager strict pass's logits, features and
KV cache bit for bit (torch's ops on both sides), and a whole decode through it the same tokens, sampled
or greedy. On a CUDA GPU the same function is recorded as graphs and replayed: the replays must equal the
uncaptured function bit for bit (skipped without a GPU)."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import tiny_transformer
from test_eagle import random_head

from engine.decode import SpeculativeEngine
from engine.model.loading import LoadedModel
from engine.model.static_pass import StaticPasses, capture_available

PROMPT = "Write a Python function that returns the squares of a list of numbers."


def _torch_ops_target(seed: int = 0):
    """A tiny random float32 target on torch's ops only (our kernels' attention is not the static path's)."""
    _, model = tiny_transformer(seed=seed)
    model.use_torch_ops()
    return model


def _tree_mask(width: int, start: int, span: int, parents: list[int]) -> torch.Tensor:
    """[width, span] bool, as the strict pass builds it: row 0 the pending token at slot start, row 1 + i a
    draft node whose parent row is parents[i] (-1 = the pending token), padding rows on slot 0."""
    mask = torch.zeros(width, span, dtype=torch.bool)
    mask[: 1 + len(parents), : start + 1] = True
    for i, parent in enumerate(parents):
        mask[1 + i, start + 1 + i] = True
        row = parent
        while row >= 0:
            mask[1 + i, start + 1 + row] = True
            row = parents[row]
    mask[1 + len(parents) :, 0] = True
    return mask


@pytest.mark.parametrize("width,parents", [(1, []), (3, [-1, 0]), (6, [-1, -1, 0, 1, 2]), (16, [-1, 0, 1, 0])])
def test_static_pass_equals_the_eager_strict_pass_bit_for_bit(width, parents):
    model = _torch_ops_target()
    span = 96
    runner = StaticPasses(model, span, max_width=16, capture=False)
    eager = model.new_cache(span)
    prompt = torch.randint(0, model.cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    assert runner.acquire(span) is runner.cache
    for cache in (eager, runner.cache):
        model.prefill(prompt[:-1], cache)
    start = eager.length
    tokens = [prompt[-1]] + [(7 * i + 3) % model.cfg.vocab_size for i in range(len(parents))]
    depth = [0]
    for parent in parents:
        depth.append(depth[parent + 1] + 1)
    positions = [start + d for d in depth]
    pad = width - len(tokens)
    tokens, positions = tokens + [0] * pad, positions + [start] * pad
    mask = _tree_mask(width, start, span, parents)
    layers = (0, 1)  # both layers of the tiny target: a feature mix, as an EAGLE-3-style head reads
    want = model.run_pass(
        torch.tensor(tokens), torch.tensor(positions), eager, mask=mask, attend_len=span, features=True,
        feature_layers=layers,
    )  # fmt: skip
    got = runner.run(tokens, positions, mask, layers, features=True)
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(got.hidden, want.hidden)
    assert runner.cache.length == eager.length == start + width
    used = slice(0, start + width)
    assert torch.equal(runner.cache.k[:, :, used], eager.k[:, :, used])
    assert torch.equal(runner.cache.v[:, :, used], eager.v[:, :, used])
    runner.release()


def test_static_pass_refuses_what_it_cannot_run():
    model = _torch_ops_target()
    runner = StaticPasses(model, 32, max_width=4, capture=False)
    runner.acquire(32)
    ok = _tree_mask(2, 0, 32, [-1])
    with pytest.raises(ValueError, match="1 to 4 rows"):
        runner.run([1] * 5, [0] * 5, _tree_mask(5, 0, 32, [-1]))
    with pytest.raises(ValueError, match=r"mask be \[2, 32\]"):
        runner.run([1, 2], [0, 1], ok[:, :16])
    with pytest.raises(ValueError, match="at least one slot"):
        runner.run([1, 2], [0, 1], torch.zeros(2, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match="positions"):
        runner.run([1, 2], [0, 40], ok)
    runner.cache.length = 31
    with pytest.raises(ValueError, match="capacity 32"):
        runner.run([1, 2], [0, 1], ok)
    assert runner.passes == 0
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StaticPasses(model, 32, capture=True) if not capture_available(model.device) else pytest.skip("has CUDA")


@pytest.mark.skipif(capture_available(torch.device("cuda")), reason="a capture here would succeed")
def test_a_failed_capture_leaves_the_runner_uncaptured_for_good_with_the_reason():
    """Where recording a graph fails (here: no CUDA at all, so the capture's first CUDA call raises), the pass
    still runs, uncaptured and with the same bits, the runner never tries again, and it says why (the finish
    metrics' pass_path_reason reads capture_error)."""
    model = _torch_ops_target()
    plain = StaticPasses(model, 32, max_width=4, capture=False)
    failing = StaticPasses(model, 32, max_width=4, capture=False)
    failing.capture = True  # a runner set to capture on a device where capturing then fails
    mask = _tree_mask(2, 0, 32, [-1])
    outs = []
    for runner in (plain, failing):
        runner.acquire(32)
        outs.append(runner.run([1, 2], [0, 1], mask).logits)
    assert torch.equal(outs[0], outs[1])
    assert failing.capture is False and failing.captured == 0
    assert failing.capture_error and failing.capture_error.startswith("CUDA graph capture failed")
    failing.cache.length = 0
    failing.run([1, 2], [0, 1], mask)  # no second attempt: still uncaptured, still the same reason
    assert failing.captured == 0 and failing.capture is False


def test_the_pool_keeps_a_runner_whose_capture_failed_and_builds_no_more_than_its_size():
    from engine.model.runners import RunnerPool

    model = _torch_ops_target()
    pool = RunnerPool(context_window=30, size=1)
    runner = pool.acquire(model, False, 8)
    runner.capture = True  # set to capture on a device where capturing then fails (no CUDA here)
    runner.run([1, 2], [0, 1], _tree_mask(2, 0, runner.capacity, [-1]))
    runner.release()
    assert runner.capture_error
    # A run that asks for graphs gets the same runner, uncaptured for good, never a new one to try again.
    assert pool.acquire(model, True, 8) is runner and pool.acquire(model, True, 8) is None
    runner.release()
    assert pool.held(model) == [runner]


@pytest.fixture(scope="module")
def torch_ops_engine(default_tokenizer):
    engine = SpeculativeEngine(LoadedModel("tiny-torch-ops", _torch_ops_target(), default_tokenizer, torch.float32))
    engine.use_eagle_head(random_head(engine))
    return engine


@pytest.mark.parametrize(
    "drafter,shape,temperature",
    [
        ("ngram", dict(k=4), 0.0),
        ("ngram", dict(k=3, topk=2, num_draft_tokens=5), 0.9),
        ("int8", dict(k=3), 0.8),
        ("int8", dict(k=3, topk=2, num_draft_tokens=5), 0.0),
        ("eagle", dict(k=3), 0.8),
        ("eagle", dict(k=2, topk=2, num_draft_tokens=4), 0.0),
    ],
    ids=["greedy-chain", "sampled-tree", "sampled-int8", "greedy-int8-tree", "sampled-eagle", "greedy-eagle-tree"],
)
def test_a_decode_through_the_static_passes_gives_the_eager_tokens(torch_ops_engine, drafter, shape, temperature):
    """The whole loop, strict: eager passes against the fixed-shape ones, same seed, same tokens (the
    target's logits are the same bits); the finish metrics say which path ran. A model drafter's own passes
    (int8, the EAGLE head) run on its fixed-shape runner too."""
    engine = torch_ops_engine
    settings = dict(max_new_tokens=24, temperature=temperature, seed=5, strict=True, **shape)
    eager = engine.run(PROMPT, drafter, pass_graphs="off", **settings)
    static = engine.run(PROMPT, drafter, pass_graphs="static", **settings)
    again = engine.run(PROMPT, drafter, pass_graphs="static", **settings)  # the runner was released and is reused
    assert eager["metrics"]["pass_path"] == "eager"
    assert static["metrics"]["pass_path"] == again["metrics"]["pass_path"] == "static"
    assert static["token_ids"] == eager["token_ids"] == again["token_ids"]
    assert static["metrics"]["target_passes"] == eager["metrics"]["target_passes"]
    if temperature == 0.0:  # greedy: the baseline's tokens too
        assert static["token_ids"] == engine.run(PROMPT, "none", max_new_tokens=24)["token_ids"]
    if drafter != "ngram":
        runners = engine.runners.held(engine.drafter(drafter).needs.model)
        assert runners and sum(r.passes for r in runners) > 0  # used...
        assert not any(r._lock.locked() for r in runners)  # ... and released at the run's end


def test_a_run_that_finds_the_static_passes_busy_takes_the_eager_path(torch_ops_engine):
    engine = torch_ops_engine
    static = dict(max_new_tokens=4, pass_graphs="static")
    first = engine.run(PROMPT, "ngram", strict=True, **static)  # builds the runner
    assert first["metrics"]["pass_path"] == "static"
    # Other runs hold every runner the pool may have: this one takes the eager path.
    held = [engine.runners.acquire(engine.target.model, False, 8) for _ in range(engine.runners.size)]
    assert all(held) and engine.runners.acquire(engine.target.model, False, 8) is None
    try:
        busy = engine.run(PROMPT, "ngram", strict=True, **static)
    finally:
        for runner in held:
            runner.release()
    assert busy["metrics"]["pass_path"] == "eager" and busy["token_ids"] == first["token_ids"]
    plain = engine.run(PROMPT, "ngram", **static)  # not strict: "static" leaves it eager
    assert plain["metrics"]["pass_path"] == "eager"
    with pytest.raises(ValueError, match="pass_graphs must be auto, static or off"):
        engine.run(PROMPT, "ngram", max_new_tokens=4, strict=True, pass_graphs="sometimes")


@pytest.mark.parametrize("pass_graphs", ["static", "off"])
def test_two_concurrent_seeded_runs_give_the_bits_they_give_alone(torch_ops_engine, pass_graphs):
    """A seeded run gives the same tokens alone or beside another (a Space serves two at once): each run
    holds its own runner from the pool, its own caches and its own generator. Greedy and sampled, a model
    drafter (its own passes on its own runner too) and n-gram, on two threads at once."""
    engine = torch_ops_engine
    runs = [
        ("int8", dict(max_new_tokens=20, k=3, temperature=0.8, seed=11)),
        ("ngram", dict(max_new_tokens=20, k=4, temperature=0.0, seed=0)),
    ]
    common = dict(strict=True, pass_graphs=pass_graphs)
    alone = [engine.run(PROMPT, drafter, **settings, **common)["token_ids"] for drafter, settings in runs]
    together: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            drafter, settings = runs[i]
            together[i] = engine.run(PROMPT, drafter, **settings, **common)["token_ids"]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert [together[i] for i in range(len(runs))] == alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("width", [1, 5, 16])
def test_cuda_graph_replays_equal_the_uncaptured_pass(width):
    """Recorded once, replayed three times (the cache rolled back between): the same bits as the same
    fixed-shape function run without capture on the same GPU."""
    from engine.model.transformer import ModelConfig, Transformer

    hf, _ = tiny_transformer(seed=0)
    model = Transformer(ModelConfig.from_hf(hf.config), hf.state_dict(), torch.float32, device="cuda")
    graphs = StaticPasses(model, 128, capture=True)
    plain = StaticPasses(model, 128, capture=False)
    mask = _tree_mask(width, 10, 128, list(range(-1, width - 2)))
    tokens, positions = list(range(3, 3 + width)), [10 + i for i in range(width)]
    for runner in (graphs, plain):
        runner.acquire(128)
        model.prefill(list(range(20, 30)), runner.cache)
    for _ in range(3):
        for runner in (graphs, plain):
            runner.cache.length = 10
        got, want = graphs.run(tokens, positions, mask), plain.run(tokens, positions, mask)
        assert torch.equal(got.logits, want.logits)
    assert graphs.captured == 1 and graphs.passes == 3


def test_runners_are_sized_to_the_run_in_buckets():
    from engine.model.runners import RUN_BUCKET_MIN, RunnerPool, run_bucket

    assert [run_bucket(n, 10_000) for n in (1, 256, 257, 600, 1024, 1025)] == [256, 256, 512, 1024, 1024, 2048]
    assert run_bucket(5000, 4130) == 5000  # past the pool's room: no runner (acquire refuses), the eager cache
    assert run_bucket(4100, 4130) == 4130  # the last bucket is the context window's room, not the next power
    with pytest.raises(ValueError):
        run_bucket(0, 100)
    model = _torch_ops_target()
    pool = RunnerPool(context_window=2000, size=1)
    short = pool.acquire(model, False, 40)
    long = pool.acquire(model, False, 700)
    assert (short.capacity, long.capacity) == (RUN_BUCKET_MIN, 1024)
    # A run of a held bucket never takes a runner of another (its span would round differently): eager instead.
    assert pool.acquire(model, False, 100) is None and pool.acquire(model, False, 900) is None
    short.release()
    assert pool.acquire(model, False, 100) is short
    assert pool.acquire(model, False, pool.max_slots + 1) is None


def test_a_run_attends_over_its_bucket_not_the_context_window(torch_ops_engine):
    engine = torch_ops_engine
    run = engine.run(PROMPT, "int8", max_new_tokens=12, k=3, pass_graphs="static", strict=True)
    assert run["metrics"]["pass_path"] == "static"
    target_runners = engine.runners.held(engine.target.model)
    assert target_runners and {r.capacity for r in target_runners} == {256}
    assert engine.target.context_window + 34 > 256  # (what every runner held before: the whole window)
