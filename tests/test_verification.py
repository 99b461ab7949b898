"""The chain verifiers of engine/verification.py against the walk, and what they read back to the host.

``verify_chain_batched`` (sampled) and ``verify_chain_greedy`` stay on the logits' device and read back one
packed copy per pass; the walk is the reference for what a Verdict holds. Tensors on the CPU here: a read back
is counted by wrapping the tensor methods that move data to Python (what a CUDA run would synchronise on).
"""

from __future__ import annotations

import pytest
import torch

from engine.drafters.base import DraftTree
from engine.sampling import SamplingParams
from engine.verification import resolve_tops, verify_chain_batched, verify_chain_greedy, walk_tree

V = 50


def _chain(seed: int, k: int, point_mass: bool, logits: torch.Tensor, params: SamplingParams) -> DraftTree:
    """A chain of k drafts: from q (a noisy p) or, as point masses, p's argmax or a random token."""
    gen = torch.Generator().manual_seed(seed)
    tree = DraftTree(point_mass=point_mass)
    for i in range(k):
        p = torch.softmax(logits[i], -1)
        q = torch.softmax(logits[i] + torch.randn(V, generator=gen), -1)
        token = int(p.argmax()) if i % 2 == 0 else int(torch.multinomial(q, 1, generator=gen))
        tree.tokens.append(token)
        tree.parents.append(i - 1)
        tree.depths.append(i + 1)
        tree.q_token.append(1.0 if point_mass else float(q[token]))
        if not point_mass:
            tree.q_dists[i - 1] = q
    return tree


class _ReadBacks:
    """Counts the calls that bring tensor data to Python while active."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        self.active = False
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def wrapped(tensor, *args, _name=name, _original=original, **kwargs):
                if self.active:
                    self.calls.append(_name)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, wrapped)


@pytest.mark.parametrize("point_mass", [False, True], ids=["q", "point_mass"])
@pytest.mark.parametrize("tops", [False, True], ids=["reduced", "full"])
def test_a_chain_verifier_reads_back_once_per_pass(monkeypatch, point_mass, tops):
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1)) * 3  # [K+1, V]
    sampled, greedy = SamplingParams(temperature=1.0), SamplingParams()
    trees = {name: _chain(2, 4, point_mass, logits, prm) for name, prm in (("s", sampled), ("g", greedy))}
    counter = _ReadBacks(monkeypatch)
    counter.active = True
    verify_chain_batched(logits, trees["s"], sampled, torch.Generator().manual_seed(3), tops=tops)
    sampled_calls, counter.calls = counter.calls, []
    verify_chain_greedy(logits, trees["g"], greedy, tops=tops)
    counter.active = False
    assert sampled_calls == ["tolist"] and counter.calls == ["tolist"]


@pytest.mark.parametrize("point_mass", [False, True], ids=["q", "point_mass"])
@pytest.mark.parametrize("seed", range(6))
def test_the_greedy_chain_verdict_is_the_walks(seed, point_mass):
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(seed)) * 2  # [K+1, V]
    params = SamplingParams()
    tree = _chain(seed, 5, point_mass, logits, params)
    walk = resolve_tops(walk_tree(logits, tree, params, torch.Generator(), tops=True))
    fast = resolve_tops(verify_chain_greedy(logits, tree, params, tops=True))
    assert fast.decisions == walk.decisions and fast.path == walk.path and fast.extra == walk.extra
    assert fast.records == walk.records and fast.p_token == walk.p_token
    assert fast.tops["p"].keys() == walk.tops["p"].keys()
    for node in walk.tops["p"]:
        assert [i for i, _ in fast.tops["p"][node]] == [i for i, _ in walk.tops["p"][node]]
        assert [v for _, v in fast.tops["p"][node]] == pytest.approx([v for _, v in walk.tops["p"][node]])
        assert (fast.tops["q"][node] is None) == (walk.tops["q"][node] is None)


def test_the_sampled_chain_verdict_records_what_it_tested():
    # Same numbers the walk would compare for the tested drafts: p and q of each, accept = min(1, p/q), u < accept
    # exactly for the accepted ones; the residual's top entries are a distribution without the rejected draft's
    # excess; a bonus has none.
    kinds = set()
    for seed in range(30):
        logits = torch.randn(4, V, generator=torch.Generator().manual_seed(seed)) * 2
        params = SamplingParams(temperature=1.0)
        tree = _chain(seed, 3, False, logits, params)
        verdict = resolve_tops(
            verify_chain_batched(logits, tree, params, torch.Generator().manual_seed(seed), tops=True)
        )
        p = torch.softmax(logits, -1)
        kinds.add(verdict.extra["kind"])
        for i, rec in enumerate(verdict.records):
            if rec is None:
                assert verdict.decisions[i] == "not_reached"
                continue
            x = tree.tokens[i]
            assert rec["p_eff"] == pytest.approx(float(p[i, x])) and rec["q_eff"] == pytest.approx(tree.q_token[i])
            assert rec["accept_prob"] == pytest.approx(min(1.0, rec["p_eff"] / rec["q_eff"]), rel=1e-5)
            assert (rec["u"] < rec["accept_prob"]) == (verdict.decisions[i] == "accepted")
        accepted = len(verdict.path)
        assert verdict.extra["p"] == pytest.approx(float(p[accepted, verdict.extra["token_id"]]))
        residual = verdict.tops["residual"]
        if verdict.extra["kind"] == "bonus":
            assert residual is None
        else:
            assert residual and sum(v for _, v in residual) <= 1.0 + 1e-6
            assert verdict.extra["token_id"] in {i for i, _ in residual} or len(residual) == 10
    assert kinds == {"bonus", "resampled"}


@pytest.mark.parametrize("payload", ["full", "reduced"])
def test_a_run_asks_for_top_entries_only_for_full_payloads(tiny_engine, payload):
    from engine.settings import GenerationSettings

    settings = GenerationSettings(payload=payload, temperature=1.0, verify="block", k=2)
    params, shape = settings.validate()
    drafter = tiny_engine.run_drafter("int8", settings)
    ids = tiny_engine.prompts.ids("a b c", False)
    with tiny_engine.running(ids, drafter, settings, shape, params, 0, 8) as state:
        assert state.tops is (payload == "full") and state.verify == "block"
        assert isinstance(state.pass_path_reason, str) and state.pass_path_reason
        verdict = tiny_engine.step(state).verdict
        assert (verdict.tops is not None) == (payload == "full") and verdict.rule == "block"
    run = tiny_engine.run("a b c", "int8", max_new_tokens=4, payload=payload)
    assert isinstance(run["metrics"]["pass_path_reason"], str)


def test_the_packed_top_entries_unpack_to_the_rows_top_entries():
    # What a CUDA pass packs into its one host copy (_tops_on_device) and unpacks (_unpack_tops) lists exactly
    # the top entries that the CPU lists from the rows themselves (_row_tops, then resolve_tops).
    from engine.verification import Verdict, _row_tops, _tops_on_device, _unpack_tops

    gen = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(4, V, generator=gen), -1)  # [K+1, V]
    q = torch.softmax(torch.randn(3, V, generator=gen), -1)  # [K, V]
    dist = torch.softmax(torch.randn(V, generator=gen), -1)
    for q_rows, residual in ((q, dist), (None, dist), (q, None)):
        tail = torch.cat(_tops_on_device(p, q_rows, residual)).tolist()
        packed = _unpack_tops(tail, 3, 10, q_rows is not None, residual is not None)
        rows = resolve_tops(Verdict([], [], [], {}, [], _row_tops(p, q_rows, residual))).tops
        assert packed["p"].keys() == rows["p"].keys() and packed["q"].keys() == rows["q"].keys()
        for part in ("p", "q"):
            for node, top in rows[part].items():
                assert (top is None) == (packed[part][node] is None)
                if top is not None:
                    assert [i for i, _ in top] == [i for i, _ in packed[part][node]]
                    assert [v for _, v in top] == pytest.approx([v for _, v in packed[part][node]])
        assert (rows["residual"] is None) == (packed["residual"] is None)


def test_top_entries_of_a_pass_list_each_rows_best_positive_entries():
    """The events' top entries of a pass's rows (resolve_tops lists them in one call): each row's TOP_N best
    positive entries, most likely first, the lower token id first among equal probabilities; rows of other
    lengths or dtypes (a draft model with a padded vocabulary, float64) listed by torch.topk alike."""
    from engine.trace import TOP_N
    from engine.verification import top_entries_of

    gen = torch.Generator().manual_seed(3)
    rows = [torch.softmax(torch.randn(500, generator=gen) * 3, -1) for _ in range(3)]
    tied = torch.zeros(500)
    tied[[300, 7, 8]] = 1 / 3
    for group in (rows + [tied], [rows[0], torch.softmax(torch.randn(520, generator=gen), -1)], [rows[1].double()]):
        for row, top in zip(group, top_entries_of(group)):
            values, ids = torch.topk(row, TOP_N)
            if row is tied:
                assert top == [(7, values[0].item()), (8, values[0].item()), (300, values[0].item())]
            else:
                assert top == [(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist())]
    assert top_entries_of([]) == []
