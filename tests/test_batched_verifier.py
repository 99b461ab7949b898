"""Batched chain verification (engine/kernels/batched_verifier.py): reference, Triton kernel, exactness.

(a) The torch reference agrees with ``acceptance.verify_chain`` (same uniforms: same
    number of accepted drafts, same extra-token distribution, and the drawn token
    is the module's exponential race on that distribution).
(b) The Triton kernel equals the reference exactly (counts and token ids) on CPU,
    under Triton's interpreter.
(c) The same on CUDA, compiled, when a GPU is present.
(d) Statistical exactness through the kernel (chi-square against p) with a
    negative control that the same statistic must flag.
(e) One compiled kernel whatever K: triton's own binder gives one compile key per
    vocabulary and draft kind for every K up to MAX_K (in-process, no GPU needed),
    every K equals the reference bit for bit under the interpreter, and on CUDA the
    compiled-kernel cache does not grow after ``warm_up``. The interpreter compiles
    nothing, so on CPU the compile count is shown through the key, not a cache.

Why (b) and (d) run in a subprocess: in triton 3.9, TRITON_INTERPRET is read when
``triton.jit`` decorates a function, and triton.language's own helpers (tl.sum,
tl.cumsum, ...) are decorated when triton is first imported. Other test modules
import transformers, which imports triton, so setting the variable at the top of
this module is not reliable (and would leak into every later test). The test
``test_triton_kernel_on_cpu`` therefore reruns the ``test_interp_*`` tests of this
file in a fresh ``python -m pytest`` with TRITON_INTERPRET=1; in this process
they are skipped. Running ``TRITON_INTERPRET=1 pytest tests/test_batched_verifier.py``
directly runs them in-process instead.

The race is elementwise (correctly rounded divisions) and a max, so the kernel and
the reference agree bit for bit on any input: no input is redrawn for the draw. The
accept uniforms are kept 1e-4 (relative) away from their thresholds only so that
``acceptance.verify_chain`` (float64 tests) takes the same decisions in (a).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from engine.acceptance import verify_chain
from engine.kernels import batched_verifier as kernels
from engine.kernels.batched_verifier import exponential_race, extra_distribution, verify_batch, verify_batch_reference

ROOT = Path(__file__).resolve().parent.parent
MARGIN = 1e-4  # relative distance kept between a uniform and any decision boundary

HAS_TRITON = kernels.HAS_TRITON
INTERPRETED = kernels.triton_language_interpreted()  # True only under TRITON_INTERPRET=1
HAS_CUDA = torch.cuda.is_available()

needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason="runs in the TRITON_INTERPRET=1 subprocess of test_triton_kernel_on_cpu"
    if HAS_TRITON
    else "triton is not installed",
)
needs_cuda_triton = pytest.mark.skipif(
    not (HAS_TRITON and HAS_CUDA and not INTERPRETED),
    reason="needs triton and a CUDA GPU (and TRITON_INTERPRET unset)",
)

SHAPES = [(b, k, v) for b in (1, 3, 8) for k in (1, 4) for v in (7, 50, 1000)]
CUDA_SHAPES = SHAPES + [(64, 8, 32000), (16, 4, 151936)]  # real vocabularies: many V blocks


# ------------------------------------------------------------------ inputs
def _normalise_with_zeros(x: torch.Tensor, gen: torch.Generator, frac: float) -> torch.Tensor:
    """Zero a random fraction of each row (keeping at least one entry) and renormalise."""
    if frac > 0:
        drop = torch.rand(x.shape, generator=gen) < frac
        keep_one = torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).bool()
        x = torch.where(drop & ~keep_one, torch.zeros_like(x), x)
    return x / x.sum(dim=-1, keepdim=True)


def _safe_accept_uniforms(p_draft, q_draft, gen):
    """[B, K] uniforms at least MARGIN away from every acceptance threshold."""
    accept = torch.clamp(p_draft.double() / q_draft.double().clamp_min(1e-30), max=1.0)
    u = torch.rand(p_draft.shape, generator=gen)
    for _ in range(100):
        bad = (u.double() - accept).abs() < MARGIN
        if not bool(bad.any()):
            return u
        u = torch.where(bad, torch.rand(u.shape, generator=gen), u)
    raise AssertionError("could not draw safe uniforms")


def _exponentials(b: int, v: int, gen: torch.Generator) -> torch.Tensor:
    """[B, V] Exp(1) draws for the race."""
    return torch.empty(b, v).exponential_(generator=gen)


def make_case(seed: int, b: int, k: int, v: int, with_q: bool, zeros: float = 0.0):
    """Random verification inputs: p and q correlated (a mix of accepts and rejects),
    a fraction `zeros` of zero entries in p and q, drafts drawn from q (or, for
    point-mass drafts, from a mix of p and uniform so that some have p = 0)."""
    gen = torch.Generator().manual_seed(seed)
    p = _normalise_with_zeros(torch.softmax(2.0 * torch.randn(b, k + 1, v, generator=gen), -1), gen, zeros)
    noise = torch.softmax(2.0 * torch.randn(b, k, v, generator=gen), -1)
    q = _normalise_with_zeros(0.6 * p[:, :k] + 0.4 * noise, gen, zeros) if k else p[:, :0]
    if k == 0:
        draft_ids = torch.zeros(b, 0, dtype=torch.int64)
    elif with_q:
        draft_ids = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, k)
    else:
        proposal = 0.5 * p[:, :k] + 0.5 / v
        draft_ids = torch.multinomial(proposal.reshape(-1, v), 1, generator=gen).reshape(b, k)
    draft_probs = q if with_q else None
    ids = draft_ids.unsqueeze(-1)
    p_draft = p[:, :k].gather(-1, ids).squeeze(-1)
    q_draft = q.gather(-1, ids).squeeze(-1) if with_q else torch.ones_like(p_draft)
    uniforms = _safe_accept_uniforms(p_draft, q_draft, gen)
    return p, draft_probs, draft_ids, uniforms, _exponentials(b, v, gen)


def _onehot_q(draft_ids: torch.Tensor, v: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(draft_ids, v).float()


# ------------------------------------------------ (a) reference vs verify_chain
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "point_mass"])
@pytest.mark.parametrize("zeros", [0.0, 0.3], ids=["dense", "zeros"])
@pytest.mark.parametrize(("b", "k", "v"), [(8, 1, 7), (8, 4, 50), (4, 3, 1000)])
def test_reference_matches_verify_chain(b, k, v, with_q, zeros):
    p, q, ids, u, su = make_case(100 + b * k + v, b, k, v, with_q, zeros)
    num_accepted, token, _ = verify_batch_reference(p, q, ids, u, su)
    dist_ref = extra_distribution(p, q, ids, num_accepted)
    saw = set()
    for row in range(b):
        q_row = q[row] if with_q else _onehot_q(ids[row], v)
        n, dist = verify_chain(p[row], q_row, ids[row], u[row], greedy=False)
        assert n == int(num_accepted[row])
        saw.add("bonus" if n == k else "resampled")
        torch.testing.assert_close(dist, dist_ref[row] / dist_ref[row].sum(), rtol=1e-5, atol=1e-7)
        assert int(exponential_race(dist_ref[row : row + 1], su[row : row + 1])) == int(token[row])
        assert float(dist[token[row]]) > 0, "drew a token without mass"
    assert "resampled" in saw  # the inputs exercise rejections


def test_reference_covers_accepts_rejects_and_bonus():
    p, q, ids, u, su = make_case(7, 64, 4, 50, True)
    num_accepted, _, _ = verify_batch_reference(p, q, ids, u, su)
    counts = torch.bincount(num_accepted, minlength=5)
    assert int(counts[0]) > 0 and int(counts[4]) > 0 and int(counts[1:4].sum()) > 0, counts


def test_reference_residual_zero_falls_back_to_p():
    # p <= q everywhere (p unnormalised): rejections happen, the residual is all zero,
    # and the extra token must come from p itself (what acceptance.residual returns).
    gen = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(16, 2, 7, generator=gen), -1)
    p = torch.cat([0.5 * q, torch.softmax(torch.randn(16, 1, 7, generator=gen), -1)], dim=1)
    p[:, :2, 0] = 0.0  # and p has zeros
    ids = torch.multinomial(q.reshape(-1, 7), 1, generator=gen).reshape(16, 2)
    u = torch.rand(16, 2, generator=gen)
    num_accepted, token, _ = verify_batch_reference(p, q, ids, u, _exponentials(16, 7, gen))
    rejected = num_accepted < 2
    assert bool(rejected.any())
    for row in torch.nonzero(rejected).flatten().tolist():
        n, dist = verify_chain(p[row], q[row], ids[row], u[row], greedy=False)
        torch.testing.assert_close(dist, p[row, n])
        assert int(token[row]) != 0  # p has no mass there


def test_exponential_race_definition():
    dist = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.5, 0.0, 0.0]])
    ones = torch.ones(1, 7)
    assert int(exponential_race(dist, ones)) == 4  # equal exponentials: the heaviest entry
    e = torch.tensor([[1.0, 0.1, 1.0, 1.0, 1.0, 1.0, 1.0]])
    assert int(exponential_race(dist, e)) == 1  # 0.2 / 0.1 = 2 beats 0.5
    zero_e = torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]])  # E = 0 on entries without mass: never chosen
    assert int(exponential_race(dist, zero_e)) == 4
    tie = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0]])
    assert int(exponential_race(tie, ones)) == 1  # a tie goes to the first index
    assert int(exponential_race(torch.zeros(1, 5), torch.ones(1, 5))) == 0  # degenerate: all zero


def test_exponential_race_draws_from_the_distribution():
    # Chi-square of 20000 races against the weights (unnormalised, with zeros), and a negative control:
    # the same race with uniforms instead of exponentials is biased and must be flagged.
    gen = torch.Generator().manual_seed(5)
    w = torch.tensor([0.6, 0.0, 0.3, 0.15, 0.45, 0.0, 0.1])
    n = 20000
    race = exponential_race(w.expand(n, -1), _exponentials(n, 7, gen))
    assert _p_value(torch.bincount(race, minlength=7).float(), w) > 1e-3
    biased = exponential_race(w.expand(n, -1), torch.rand(n, 7, generator=gen))
    assert _p_value(torch.bincount(biased, minlength=7).float(), w) < 1e-6


def test_reference_validates_shapes():
    p, q, ids, u, su = make_case(0, 2, 3, 7, True)
    with pytest.raises(ValueError, match="draft_ids"):
        verify_batch_reference(p, q, ids[:, :2], u, su)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_batch_reference(p, q[:, :2], ids, u, su)
    with pytest.raises(ValueError, match="exponentials"):
        verify_batch_reference(p, q, ids, u, su[:1])


def test_dispatcher_uses_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPECLENS_TRITON_INTERPRET", raising=False)
    if INTERPRETED:
        pytest.skip("triton was imported in interpreter mode")
    p, q, ids, u, su = make_case(1, 3, 4, 50, True)
    ref = verify_batch_reference(p, q, ids, u, su)
    out = verify_batch(p, q, ids, u, su)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton imported in compiled mode")
def test_dispatcher_warns_when_interpreter_requested_too_late(monkeypatch):
    # triton is already imported here (compiled mode): the request cannot take effect.
    monkeypatch.setenv("SPECLENS_TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "_warned", False)
    p, q, ids, u, su = make_case(4, 3, 2, 7, False)
    ref = verify_batch_reference(p, q, ids, u, su)
    with pytest.warns(RuntimeWarning, match="torch reference"):
        out = verify_batch(p, q, ids, u, su)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.verify_batch_triton(p, q, ids, u, su, interpret=True)


def test_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "from engine.kernels import batched_verifier as kernels\n"
        "assert not kernels.HAS_TRITON\n"
        "import torch\n"
        "p = torch.softmax(torch.randn(2, 3, 5), -1)\n"
        "ids = torch.zeros(2, 2, dtype=torch.long)\n"
        "n, t, a = kernels.verify_batch(p, None, ids, torch.rand(2, 2), torch.ones(2, 5))\n"
        "assert n.shape == (2,) and t.shape == (2,) and a.shape == (2, 2)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


# ------------------------------------- one compiled kernel whatever K (adaptive drafting)
ADAPTIVE_KS = (0, 1, 3, 7, 15, 16, 31, 32)  # K = 1 and multiples of 16 are what triton specialises on


def _keys_over_k(v: int, ks=ADAPTIVE_KS, b: int = 2) -> dict[tuple, set[int]]:
    """compile key -> the K values (both draft kinds) that would run under it."""
    keys: dict[tuple, set[int]] = {}
    for k in ks:
        for with_q in (True, False):
            p, q, ids, u, su = make_case(50 + k, b, k, v, with_q)
            keys.setdefault(kernels.compile_key(p, q, ids, u, su), set()).add(k)
    return keys


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("v", [50, 50257])  # 50257 (GPT-2): V not a multiple of 16
def test_compile_key_does_not_depend_on_k(v):
    # triton's own binder (what JITFunction.run keys its kernel cache on) over every K an
    # adaptive drafter may use: one key with q and one for point masses, nothing per K.
    keys = _keys_over_k(v)
    assert len(keys) == 2, [dict(key).get("HAS_Q") for key in keys]
    for key in keys:
        entries = {name: rest for name, *rest in key}
        assert entries["K"] == ["i32", None]  # a runtime int, not specialised (not constexpr at K = 1)
        assert entries["BLOCK_K"] == ["constexpr", kernels.MAX_K]
        assert entries["V"] == ["constexpr", v]
    assert set().union(*keys.values()) == set(ADAPTIVE_KS)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_compile_key_sees_real_specialisation():
    # Negative controls for the instrument: the key does change where triton compiles anew
    # (another vocabulary, another V block), and the same binder on this kernel WITHOUT
    # do_not_specialize puts K = 1 in as a constant and marks K = 16 divisible by 16.
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    case = make_case(1, 2, 3, 50, True)
    assert kernels.compile_key(*case) != kernels.compile_key(*make_case(1, 2, 3, 60, True))
    assert kernels.compile_key(*case) != kernels.compile_key(*case, block_v=16)
    plain = JITFunction(kernels._verify_kernel)  # specialise everything (triton's default)
    binder = create_function_from_signature(plain.signature, plain.params, BaseBackend)
    k_slot = plain.arg_names.index("K")
    seen = set()
    for k in (1, 3, 16):
        args, kwargs, _ = kernels._launch(*make_case(2, 2, k, 50, True), None)
        seen.add(binder(*args, **kwargs)[1][k_slot])
    assert seen == {("constexpr", 1), ("i32", ""), ("i32", "D")}, seen


def test_k_limit_matches_tree_shape_and_falls_back_past_it():
    from engine.drafters.base import TreeShape

    TreeShape(k=kernels.MAX_K)  # the deepest chain a drafter can ask for fits the kernel
    with pytest.raises(ValueError):
        TreeShape(k=kernels.MAX_K + 1)
    case = make_case(3, 2, kernels.MAX_K + 1, 7, True)
    if HAS_TRITON:
        with pytest.raises(ValueError, match="at most K = 32"):
            kernels.verify_batch_triton(*case, interpret=INTERPRETED)
    ref = verify_batch_reference(*case)
    out = verify_batch(*case)  # the dispatcher verifies it with the reference instead
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_warm_up_is_a_no_op_without_a_kernel_device():
    if INTERPRETED:
        pytest.skip("under the interpreter warm_up runs the kernel (test_interp_warm_up)")
    assert kernels.warm_up("cpu", 1000) == 0  # the dispatcher uses the reference on CPU
    with pytest.raises(ValueError, match="vocab"):
        kernels.warm_up("cpu", 0)


# ---------------------------------------------- (b) and (d) under the interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="already running under TRITON_INTERPRET=1")
def test_triton_kernel_on_cpu():
    """Runs the test_interp_* tests below in a fresh process with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider", "-k", "test_interp_"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    summary = [line for line in proc.stdout.splitlines() if line.strip()][-1:]
    assert proc.returncode == 0, out[-6000:]
    assert summary and " passed" in summary[0] and "skipped" not in summary[0], out[-3000:]
    print("interpreter run:", summary[0])


def _assert_same(got, ref, label=""):
    n_got, t_got, a_got = (x.cpu() for x in got)
    n_ref, t_ref, a_ref = ref
    assert torch.equal(n_got, n_ref), f"{label} num_accepted {n_got.tolist()} != {n_ref.tolist()}"
    assert torch.equal(t_got, t_ref), f"{label} next_token {t_got.tolist()} != {t_ref.tolist()}"
    assert torch.equal(a_got, a_ref), f"{label} accept_prob {a_got.tolist()} != {a_ref.tolist()}"


@needs_interpreter
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "point_mass"])
@pytest.mark.parametrize(("b", "k", "v"), SHAPES, ids=[f"B{b}-K{k}-V{v}" for b, k, v in SHAPES])
def test_interp_kernel_equals_reference(b, k, v, with_q):
    zeros = 0.3 if (b + k) % 2 else 0.0  # half the shapes have zeros in p and q
    case = make_case(1000 + 31 * b + 7 * k + v, b, k, v, with_q, zeros)
    _assert_same(kernels.verify_batch_triton(*case), verify_batch_reference(*case), f"B{b} K{k} V{v}")


@needs_interpreter
@pytest.mark.parametrize(("v", "block_v"), [(1000, 128), (203, 16)])
def test_interp_kernel_streams_over_blocks(v, block_v):
    # Several V blocks (V not a multiple of the block): the carried best score and index must be right.
    for seed, with_q in ((5, True), (6, False)):
        case = make_case(seed + v, 6, 3, v, with_q, zeros=0.3)
        _assert_same(kernels.verify_batch_triton(*case, block_v=block_v), verify_batch_reference(*case))


@needs_interpreter
def test_interp_kernel_edge_cases():
    gen = torch.Generator().manual_seed(11)
    # residual all zero (p <= q): the draw falls back to p.
    q = torch.softmax(torch.randn(6, 2, 7, generator=gen), -1)
    p = torch.cat([0.5 * q, torch.softmax(torch.randn(6, 1, 7, generator=gen), -1)], dim=1)
    ids = torch.multinomial(q.reshape(-1, 7), 1, generator=gen).reshape(6, 2)
    u = torch.tensor([[0.9, 0.1]] * 3 + [[0.1, 0.9]] * 3)
    e = _exponentials(6, 7, gen)
    _assert_same(kernels.verify_batch_triton(p, q, ids, u, e), verify_batch_reference(p, q, ids, u, e))
    # Exponentials at the extremes (0: that entry wins if it has mass; huge: it loses): never a token without mass.
    dist = torch.tensor([0.0, 0.2, 0.0, 0.3, 0.5, 0.0, 0.0])
    p = dist.expand(4, 2, 7).contiguous()
    ids = torch.full((4, 1), 5)  # p = 0 there: always rejected
    u = torch.zeros(4, 1)
    e = torch.ones(4, 7)
    e[0, 1] = 0.0  # token 1 wins outright
    e[1, 4] = 1e30  # token 4 cannot win: token 3 does
    e[2, :] = 0.0  # every entry ties at inf (with mass) or has none: the first entry with mass
    e[3, 0] = 0.0  # E = 0 on an entry without mass: still never drawn
    for q in (None, torch.full((4, 1, 7), 1.0 / 7)):
        n, t, _ = kernels.verify_batch_triton(p, q, ids, u, e)
        assert n.tolist() == [0] * 4 and t.tolist() == [1, 3, 1, 4]
        _assert_same((n, t, _), verify_batch_reference(p, q, ids, u, e))
    # K = 0: bonus only.
    p0 = dist.expand(2, 1, 7).contiguous()
    empty = torch.zeros(2, 0)
    e0 = torch.ones(2, 7)
    e0[0, 1] = 0.01
    n, t, _ = kernels.verify_batch_triton(p0, None, empty.long(), empty, e0)
    assert n.tolist() == [0, 0] and t.tolist() == [1, 4]
    # A q that was actually used must be read at the rejected position only (not at the bonus).
    case = make_case(12, 8, 4, 50, True)
    q_bad = case[1].clone()
    n_ref, _, _ = verify_batch_reference(*case)
    for row in torch.nonzero(n_ref == 4).flatten().tolist():
        q_bad[row] = float("nan")  # all drafts accepted: q was only needed at the drafted ids
        q_bad[row, torch.arange(4), case[2][row]] = case[1][row, torch.arange(4), case[2][row]]
    _assert_same(kernels.verify_batch_triton(case[0], q_bad, *case[2:]), verify_batch_reference(*case))


@needs_interpreter
@pytest.mark.parametrize("v", [50, 1000])
def test_interp_kernel_equals_reference_for_every_k(v):
    # What adaptive drafting does: K changes from pass to pass. Every K must give the
    # reference's answer bit for bit, and all of them run under one compile key per draft kind.
    keys = set()
    for k in (1, 3, 7, 15, 16, 32):
        for with_q in (True, False):
            case = make_case(3000 + 7 * k + v, 3, k, v, with_q, zeros=0.3 if k % 2 else 0.0)
            _assert_same(kernels.verify_batch_triton(*case), verify_batch_reference(*case), f"K{k} V{v} q={with_q}")
            keys.add(kernels.compile_key(*case))
    assert len(keys) == 2


@needs_interpreter
def test_interp_warm_up():
    # It launches the kernel once per draft kind and checks it against the reference.
    assert kernels.warm_up("cpu", 1000) == 2
    for v in (1, 2, 3):  # tiny vocabularies
        assert kernels.warm_up("cpu", v) == 2


@needs_interpreter
def test_interp_dispatcher_uses_the_kernel(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the reference was used")

    case = make_case(2, 3, 4, 50, True)
    ref = verify_batch_reference(*case)
    monkeypatch.setattr(kernels, "verify_batch_reference", boom)
    _assert_same(kernels.verify_batch(*case), ref)


# ------------------------------------------------ (d) statistical exactness
STAT_P = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0])  # the target; token 5 is never emitted
STAT_Q = torch.tensor([0.0, 0.3, 0.25, 0.2, 0.15, 0.1])  # the drafter: never drafts token 0, drafts token 5
STAT_K = 8  # long chains: about 3.2 emitted tokens per step, fewer (slow) interpreted programs


def _p_value(counts: torch.Tensor, p: torch.Tensor) -> float:
    support = p > 0
    if bool((counts[~support] > 0).any()):
        return 0.0  # a token the target never emits was emitted
    observed = counts[support].double()
    expected = p[support].double() / p[support].double().sum() * observed.sum()
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def _emitted_counts(verify, rows: int, seed: int, lie_about_q: bool = False, device: str = "cpu") -> torch.Tensor:
    """Histogram of every token emitted by `rows` independent speculative steps.

    Every position uses the same target p and drafter q, drafts are drawn i.i.d.
    from q. Exactness says: given that a step reaches position i, the token
    emitted there (accepted draft, resampled or bonus) is distributed as p, and
    whether the step continues depends only on earlier positions. The pooled
    counts minus p * (their total) are then a martingale with the multinomial
    covariance, so Pearson's chi-square against p applies to the pooled
    histogram (about 3.2 tokens per step here).
    `lie_about_q` is the negative control: the drafter reports q = p while its
    drafts really come from q, so every draft looks perfect and is accepted.
    """
    gen = torch.Generator().manual_seed(seed)
    v = STAT_P.numel()
    p = STAT_P.expand(rows, STAT_K + 1, v).contiguous()
    q = STAT_Q.expand(rows, STAT_K, v).contiguous()
    ids = torch.multinomial(STAT_Q, rows * STAT_K, replacement=True, generator=gen).reshape(rows, STAT_K)
    u = torch.rand(rows, STAT_K, generator=gen)
    su = _exponentials(rows, v, gen)
    reported_q = p[:, :STAT_K].contiguous() if lie_about_q else q
    args = (p, reported_q, ids, u, su)
    n, token, _ = verify(*(a.to(device) for a in args))
    n, token = n.cpu(), token.cpu()
    keep = torch.arange(STAT_K)[None, :] < n[:, None]  # [rows, K] accepted drafts
    emitted = torch.cat([ids[keep], token])
    return torch.bincount(emitted, minlength=v).float()


@needs_interpreter
def test_interp_statistical_exactness_and_negative_control():
    # ~1900 tokens: each interpreted program costs ~20 ms. The reference, which the kernel
    # matches exactly (above), gets the larger-N version in-process (test_reference_statistics_*).
    counts = _emitted_counts(kernels.verify_batch_triton, rows=600, seed=21)
    assert counts.sum() > 1700
    assert _p_value(counts, STAT_P) > 1e-3, (counts / counts.sum()).tolist()
    bad = _emitted_counts(kernels.verify_batch_triton, rows=80, seed=22, lie_about_q=True)
    assert _p_value(bad, STAT_P) < 1e-6, (bad / bad.sum()).tolist()


def test_reference_statistics_point_mass_is_exact_for_any_proposal():
    # Point-mass verification (draft_probs=None) stays exact even when the drafts
    # were really drawn from a non-degenerate q: conditioned on each proposal x,
    # accept with p(x), else draw from p without x, which is p again. So passing
    # None for a sampling drafter is NOT a usable negative control (it is only
    # wasteful); the mislabelled-q control above is.
    counts = _emitted_counts(lambda p, q, *rest: verify_batch_reference(p, None, *rest), rows=4000, seed=23)
    assert _p_value(counts, STAT_P) > 1e-3
    counts = _emitted_counts(verify_batch_reference, rows=4000, seed=24)
    assert _p_value(counts, STAT_P) > 1e-3
    bad = _emitted_counts(verify_batch_reference, rows=4000, seed=25, lie_about_q=True)
    assert _p_value(bad, STAT_P) < 1e-6


# ---------------------------------------------------------------- (c) CUDA
@needs_cuda_triton
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "point_mass"])
@pytest.mark.parametrize(("b", "k", "v"), CUDA_SHAPES, ids=[f"B{b}-K{k}-V{v}" for b, k, v in CUDA_SHAPES])
def test_cuda_kernel_equals_reference(b, k, v, with_q):
    zeros = 0.3 if (b + k) % 2 else 0.0
    case = make_case(2000 + 31 * b + 7 * k + v, b, k, v, with_q, zeros)
    ref = verify_batch_reference(*case)
    cuda_case = [None if x is None else x.cuda() for x in case]
    got = kernels.verify_batch_triton(*cuda_case, interpret=False)
    assert got[0].is_cuda and got[1].is_cuda
    _assert_same(got, ref, f"B{b} K{k} V{v}")
    _assert_same(verify_batch(*cuda_case), ref, "dispatch")  # the dispatcher picks the kernel on CUDA


@needs_cuda_triton
@pytest.mark.parametrize("v", [32000, 151936])
def test_cuda_one_compiled_kernel_for_every_k(v):
    # warm_up compiles the two variants (q / point masses); no K afterwards compiles again.
    device = torch.device("cuda", torch.cuda.current_device())
    assert kernels.warm_up(device, v) == 2
    kernel = kernels._kernel(False)
    compiled = kernel.device_caches[device.index][0]  # triton's kernel cache for this device
    after_warm_up = len(compiled)
    for k in list(range(0, 17)) + [31, 32]:
        for with_q in (True, False):
            case = make_case(4000 + k, 2, k, v, with_q)
            got = kernels.verify_batch_triton(*[None if x is None else x.cuda() for x in case], interpret=False)
            _assert_same(got, verify_batch_reference(*case), f"K{k} V{v} q={with_q}")
    assert len(compiled) == after_warm_up, f"K recompiled the kernel: {after_warm_up} -> {len(compiled)} variants"


@needs_cuda_triton
def test_cuda_statistical_exactness_and_negative_control():
    def run(*args):
        return kernels.verify_batch_triton(*args, interpret=False)

    counts = _emitted_counts(run, rows=100_000, seed=31, device="cuda")
    assert _p_value(counts, STAT_P) > 1e-3, (counts / counts.sum()).tolist()
    bad = _emitted_counts(run, rows=2000, seed=32, lie_about_q=True, device="cuda")
    assert _p_value(bad, STAT_P) < 1e-6
