"""visuals/: plotly figures from traces. Fast, no model: recorded traces plus three edge cases.

The checks look at the data inside each figure (trace meta, x/y values, colours), not only that it built.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import visuals
from visuals import (
    LABELS,
    PALETTE,
    TraceError,
    acceptance_figure,
    all_figures,
    batch_figure,
    pq_figure,
    run_summary,
    speedup_figure,
    step_events,
    timeline_figure,
    tokens_per_pass_figure,
    tree_figure,
    validate_events,
)
from visuals.steps import default_position, extra_token
from visuals.style import fmt_prob, fmt_uniform, show_token

ROOT = Path(__file__).resolve().parents[1]
TRACES_DIR = ROOT / "assets" / "traces"
# Loaded through the engine's trace model, as the app and the CLI do (it fills in fields older traces lack).
RECORDED = {p.stem: visuals.load_trace(p) for p in sorted(TRACES_DIR.glob("*.json"))}
CHAT = "chat-int8-tree-sampling"
BASELINE = "code-edit-baseline-greedy"
NGRAM_GREEDY = "code-edit-ngram-greedy"
NGRAM_SAMPLING = "summarize-ngram-sampling"


def plain(text: str | None) -> str:
    """A figure's title or subtitle as one line (titles are wrapped with <br> to fit phone screens)."""
    return (text or "").replace("<br>", " ")


def _all_rejected(events: list[dict]) -> list[dict]:
    """Every drafted token rejected; each pass emits one resampled token; no finish event."""
    out = [copy.deepcopy(events[0])]
    total = 0
    for step in step_events(events):
        step = copy.deepcopy(step)
        if step["nodes"]:
            for node in step["nodes"]:
                node["decision"] = "rejected"
                node.setdefault("accept_prob", 0.0)
                node.setdefault("u", 0.99)
            step["accepted_len"] = 0
            first = step["emitted"][0]
            p_top = step["dists"][0]["p_top"] if step.get("dists") else []
            step["emitted"] = [
                {
                    "token_id": first["token_id"],
                    "text": first["text"],
                    "kind": "resampled",
                    "node": None,
                    "from_node": -1,
                    "p": 0.1,
                    "residual_top": copy.deepcopy(p_top),
                }
            ]
            step["dists"] = step["dists"][:1]
        total += len(step["emitted"])
        step["tokens_total"] = total
        out.append(step)
    return out


# Edge cases: a partial trace (start + 2 steps, no finish), only rejections (built here), and no rejections
# at all, which is the recorded greedy baseline (steps without draft nodes) already in RECORDED.
EDGE = {
    "partial": copy.deepcopy(RECORDED[CHAT][:3]),
    "only-rejections": _all_rejected(RECORDED[CHAT]),
}
ALL = {**RECORDED, **EDGE}


def _pq_steps(events: list[dict]) -> list[int]:
    """Steps worth a p/q check: the first three and every one with a rejection or a resampled token."""
    out = []
    for i, step in enumerate(step_events(events)):
        extra = extra_token(step)
        if i < 3 or any(n["decision"] == "rejected" for n in step["nodes"]) or (extra or {}).get("kind") == "resampled":
            out.append(i)
    return out


def by_role(fig, role: str, **match) -> list:
    out = []
    for tr in fig.data:
        meta = tr.meta if isinstance(tr.meta, dict) else {}
        if meta.get("role") == role and all(meta.get(k) == v for k, v in match.items()):
            out.append(tr)
    return out


def running_mean(events: list[dict]) -> list[float]:
    out, total = [], 0
    for i, step in enumerate(step_events(events), start=1):
        total += len(step["emitted"])
        out.append(total / i)
    return out


def e_formula(alpha: float, k: int) -> float:
    return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


# ------------------------------------------------------------------------------------------ basics


def test_recorded_traces_present():
    assert {CHAT, BASELINE, NGRAM_GREEDY, NGRAM_SAMPLING} <= set(RECORDED)


def test_layering_no_model_or_ui_imports():
    # visuals reads traces through the engine's plain-Python trace model (engine.trace, engine.metrics) and
    # nothing else of the engine: no model code, no UI code.
    pattern = re.compile(r"^\s*(import|from)\s+(torch|transformers|gradio)\b", re.M)
    engine_import = re.compile(r"^\s*(?:import|from)\s+(engine\S*)", re.M)
    for path in (ROOT / "visuals").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not pattern.search(text), path
        assert not re.search(r"import torch|transformers|gradio", text), path
        assert set(engine_import.findall(text)) <= {"engine.trace", "engine.metrics"}, path
    code = (
        "import sys, visuals; mods = set(sys.modules); "
        "bad = {'torch', 'transformers', 'gradio'} & mods; "
        "bad |= {m for m in mods if m.startswith('engine') and m not in ('engine', 'engine.trace', 'engine.metrics')}; "
        "print(bad)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "set()"


def test_palette_is_okabe_ito_and_labels_have_marks():
    assert PALETTE["accepted"] == "#009E73"
    assert PALETTE["rejected"] == "#D55E00"
    assert PALETTE["resampled"] == "#E69F00"
    assert PALETTE["bonus"] == "#0072B2"
    assert PALETTE["not_reached"] == "#999999"
    assert len({PALETTE[k] for k in ("accepted", "rejected", "resampled", "bonus", "not_reached")}) == 5
    for key, mark in (("accepted", "✓"), ("rejected", "✗"), ("resampled", "↻"), ("bonus", "+"), ("not_reached", "·")):
        assert LABELS[key].startswith(mark)


def test_show_token_makes_whitespace_visible_and_escapes_tags():
    assert show_token(" a\n") == "␣a⏎"
    assert show_token("\t") == "⇥"
    assert show_token("") == "∅"
    assert show_token("<|im_end|>") == "&lt;|im_end|&gt;"
    assert show_token("\ufe0f") == "⟨U+FE0F⟩"
    assert show_token("abcdefghij", 5) == "abcd…"
    assert fmt_prob(0.88109) == "0.881"
    assert fmt_prob(6e-06) == "6.00e-06"
    assert fmt_prob(None) == "—"
    # #40: three significant digits below 0.1, so 0.00213 / 0.00238 = 0.896 can be checked by eye
    assert (fmt_prob(0.00213), fmt_prob(0.0412)) == ("0.00213", "0.0412")
    assert fmt_uniform(0.99996) == "0.9999" and fmt_uniform(0.25) == "0.2500"  # u is in [0, 1): never 1.000


def test_validate_events_errors():
    good = RECORDED[CHAT]
    assert validate_events({"events": good}) is good
    assert validate_events(good) is good
    for bad, msg in (
        (42, "events"),
        ({"foo": 1}, "events"),
        ({"events": []}, "no events"),
        ([{"type": "step", "nodes": [], "emitted": []}], "start"),
        ([good[0], {"type": "weird"}], "unknown"),
        ([good[0], good[-1], good[1]], "finish"),
        ([good[0], {"type": "step", "emitted": []}], "nodes"),
    ):
        with pytest.raises(TraceError, match=msg):
            validate_events(bad)


@pytest.mark.parametrize("name", sorted(ALL))
def test_run_summary(name):
    events = ALL[name]
    steps = step_events(events)
    s = run_summary(events)
    assert s["target_passes"] == len(steps)
    assert s["new_tokens"] == sum(len(st["emitted"]) for st in steps)
    # K is the run's draft depth: 0 for a baseline, which drafts nothing (its start event still lists a tree).
    assert s["k"] == (0 if events[0]["mode"] == "baseline" else events[0]["tree"]["k"])
    finish = events[-1] if events[-1]["type"] == "finish" else None
    drafted = sum(st["drafted"] for st in steps)
    accepted = sum(st["accepted_len"] for st in steps)
    if finish:
        m = finish["metrics"]
        assert s["acceptance_rate"] == pytest.approx(m["acceptance_rate"])
        assert s["wall_s"] == pytest.approx(m["wall_s"])
        assert s["tokens_per_pass"] == pytest.approx(m["tokens_per_pass"])
        if "passes_drafted" in m:
            assert s["theoretical_tokens_per_pass"] == pytest.approx(m["theoretical_tokens_per_pass"])
        else:  # recorded before the theory took each pass's drafted depth: the steps give it
            from engine.metrics import summarize_steps

            redone = summarize_steps(steps, s["k"], 0.0)
            assert s["theoretical_tokens_per_pass"] == pytest.approx(redone["theoretical_tokens_per_pass"])
            assert s["passes_drafted"] == sum(1 for st in steps if st["drafted"])
    else:
        assert not s["finished"]
        assert s["acceptance_rate"] == pytest.approx(accepted / drafted if drafted else 0.0)
        assert s["wall_s"] == pytest.approx(steps[-1]["elapsed_s"])
        assert s["tokens_per_s"] == pytest.approx(s["new_tokens"] / steps[-1]["elapsed_s"])
        assert s["tokens_per_pass"] == pytest.approx(s["new_tokens"] / len(steps))


# -------------------------------------------------------------------------------------------- tree


@pytest.mark.parametrize("name", sorted(ALL))
def test_tree_figure_every_step(name):
    events = ALL[name]
    for i, step in enumerate(step_events(events)):
        fig = tree_figure(events, i)
        nodes = step["nodes"]
        extra = extra_token(step)
        markers = sum(len(tr.x) for role in ("nodes", "root", "extra") for tr in by_role(fig, role))
        assert markers == len(nodes) + 1 + (extra is not None), (name, i)
        if extra is not None:
            assert markers == len(nodes) + 2  # root + the target's own token
        # One marker trace per decision, coloured from PALETTE, with the step's counts.
        decisions = {n["decision"] for n in nodes}
        assert {tr.meta["decision"] for tr in by_role(fig, "nodes")} == decisions
        for tr in by_role(fig, "nodes"):
            d = tr.meta["decision"]
            assert tr.marker.color == PALETTE[d]
            expected_ids = [n["id"] for n in nodes if n["decision"] == d]
            assert list(tr.meta["node_ids"]) == expected_ids
            assert len(tr.x) == len(expected_ids)
            assert tr.name.startswith(LABELS[d])
            assert all(t.startswith(LABELS[d][0]) for t in tr.text)  # a text mark next to the colour
        # The target's own token hangs off from_node in the resampled / bonus colour.
        extras = by_role(fig, "extra")
        if extra is None:
            assert extras == []
        else:
            (tr,) = extras
            assert tr.meta["decision"] == extra["kind"]
            assert tr.marker.color == PALETTE[extra["kind"]]
            assert tr.meta["from_node"] == extra["from_node"]
            depth = {n["id"]: n["depth"] for n in nodes}
            assert tr.x[0] == depth.get(extra["from_node"], 0) + 1
            assert show_token(extra["text"], 16) in tr.text[0]
        # Accepted path edges are the thick ones.
        edges = {tr.meta["kind"]: tr for tr in by_role(fig, "edges")}
        accepted_pairs = [[n["parent"], n["id"]] for n in nodes if n["decision"] == "accepted"]
        if accepted_pairs:
            assert [list(p) for p in edges["kept"].meta["pairs"]] == accepted_pairs
            thick = edges["kept"].line.width
            for kind, tr in edges.items():
                if kind in ("untried", "rejected"):
                    assert tr.line.width < thick / 2
        else:
            assert "kept" not in edges
        all_pairs = sum((len(tr.meta["pairs"]) for tr in edges.values()), 0)
        assert all_pairs == len(nodes) + (extra is not None)
        # Depth on x: root at 0, every node at its depth.
        (root,) = by_role(fig, "root")
        assert root.x[0] == 0
        for tr in by_role(fig, "nodes"):
            ids = tr.meta["node_ids"]
            assert list(tr.x) == [next(n["depth"] for n in nodes if n["id"] == nid) for nid in ids]


def _step_where(events, wanted) -> int:
    """Index of the first step for which wanted(step) holds (the recorded traces are re-recorded
    with each engine version, so tests find the pass they need by what happened in it)."""
    return next(i for i, step in enumerate(step_events(events)) if wanted(step))


def _rejected_then_a_sibling_tried(step) -> bool:
    return any(n["decision"] == "rejected" and n.get("adjusted") is False for n in step["nodes"]) and any(
        n.get("adjusted") for n in step["nodes"]
    )


def _hover_of(fig, step, node) -> str:
    """The hover text of one node: its decision's trace holds its decision's nodes in id order."""
    same = [n["id"] for n in step["nodes"] if n["decision"] == node["decision"]]
    (trace,) = by_role(fig, "nodes", decision=node["decision"])
    return trace.hovertext[same.index(node["id"])]


def test_tree_hover_shows_p_q_accept_prob_u():
    events = RECORDED[CHAT]
    index = _step_where(events, _rejected_then_a_sibling_tried)
    step = step_events(events)[index]
    fig = tree_figure(events, index)
    first = next(n for n in step["nodes"] if n["decision"] == "rejected" and not n["adjusted"])
    second = next(n for n in step["nodes"] if n.get("adjusted") and n["parent"] == first["parent"])
    hover = _hover_of(fig, step, first).replace("<br>", " ")  # lines wrapped for a phone
    assert f"p (target) = {fmt_prob(first['p'])}" in hover and f"q (drafter) = {fmt_prob(first['q'])}" in hover
    assert f"min(1, p/q) = {fmt_prob(first['accept_prob'])}" in hover and f"u = {fmt_uniform(first['u'])}" in hover
    assert "p_eff" in hover and "q_eff" in hover
    later = _hover_of(fig, step, second).replace("<br>", " ")
    assert "after an earlier sibling's rejection" in later
    assert f"min(1, p_eff/q_eff) = {fmt_prob(second['accept_prob'])}" in later
    index = _step_where(events, lambda st: st["extra_kind"] == "resampled" and not st.get("truncated"))
    step = step_events(events)[index]
    (extra,) = by_role(tree_figure(events, index), "extra")
    assert "residual" in extra.hovertext[0]
    assert show_token(step["emitted"][-1]["text"], 16) in extra.text[0] and extra.text[0].startswith("↻")


def test_tree_baseline_is_root_plus_bonus_and_chain_is_one_branch():
    fig = tree_figure(RECORDED[BASELINE], 0)
    assert by_role(fig, "nodes") == []
    (extra,) = by_role(fig, "extra")
    assert extra.meta["decision"] == "bonus" and list(extra.x) == [1]
    index = _step_where(RECORDED[NGRAM_GREEDY], lambda st: st["accepted_len"] >= 2)
    chain = tree_figure(RECORDED[NGRAM_GREEDY], index)  # a chain of accepted drafts
    ys = [y for tr in by_role(chain, "nodes", decision="accepted") for y in tr.y]
    assert len(set(ys)) == 1  # one straight branch
    assert "chain" in plain(chain.layout.title.subtitle.text)


def test_tree_big_tree_is_laid_out_without_overlap():
    events = copy.deepcopy(RECORDED[CHAT][:2])
    step = events[1]
    nodes, frontier, nid = [], [(-1, 0)], 0
    while frontier and nid < 64:
        parent, depth = frontier.pop(0)
        for _ in range(2):
            if nid < 64:
                nodes.append(
                    {"id": nid, "parent": parent, "depth": depth + 1, "token_id": nid, "text": f"t{nid}", "q": 0.5}
                    | {"p": None, "decision": "not_reached"}
                )
                frontier.append((nid, depth + 1))
                nid += 1
    step["nodes"], step["emitted"] = nodes, [{"token_id": 1, "kind": "bonus", "from_node": -1, "p": 0.5, "text": "x"}]
    fig = tree_figure(events, 0)
    points = {
        (x, y) for tr in fig.data if tr.meta.get("role") in ("nodes", "root", "extra") for x, y in zip(tr.x, tr.y)
    }
    assert len(points) == 64 + 2  # every node has its own place
    assert fig.layout.height >= 64 * 15


def test_tree_step_out_of_range():
    with pytest.raises(IndexError):
        tree_figure(RECORDED[CHAT], 99)
    with pytest.raises(IndexError):
        tree_figure(RECORDED[CHAT][:1], 0)


# ---------------------------------------------------------------------------------------------- pq


@pytest.mark.parametrize("name", sorted(ALL))
def test_pq_figure_every_position(name):
    events = ALL[name]
    greedy = events[0]["greedy"]
    steps = step_events(events)
    for i in _pq_steps(events):
        step = steps[i]
        for pos, dist in enumerate(step["dists"]):
            fig = pq_figure(events, i, pos)
            (p,) = by_role(fig, "p")
            p_by_id = dict(zip(p.meta["token_ids"], p.x))
            for tid, text, prob in dist["p_top"]:
                assert p_by_id[tid] == pytest.approx(prob)
                label = p.y[p.meta["token_ids"].index(tid)]
                assert show_token(text, 18) in label
            qs = by_role(fig, "q")
            if dist["q_top"] is not None:
                (q,) = qs
                q_by_id = dict(zip(q.meta["token_ids"], q.x))
                for tid, _text, prob in dist["q_top"]:
                    assert q_by_id[tid] == pytest.approx(prob)
            elif step["point_mass"]:
                (q,) = qs
                q_by_id = dict(zip(q.meta["token_ids"], q.x))
                for child in (n for n in step["nodes"] if n["parent"] == dist["node"]):
                    assert q_by_id[child["token_id"]] == pytest.approx(child["q"])
            if step["point_mass"]:
                assert "point mass" in plain(fig.layout.title.text)
            children = [n for n in step["nodes"] if n["parent"] == dist["node"]]
            extra = extra_token(step)
            extra_here = extra is not None and extra["from_node"] == dist["node"]
            residual = by_role(fig, "residual")
            if extra_here and extra["kind"] == "resampled" and extra.get("residual_top"):
                (res,) = residual
                assert "residual" in res.name and "max(0, p − q)" in res.name
                r_by_id = dict(zip(res.meta["token_ids"], res.x))
                for tid, _text, prob in extra["residual_top"]:
                    assert r_by_id[tid] == pytest.approx(prob)
            else:
                assert residual == []
            texts = [a.text for a in fig.layout.annotations]
            for child in children:
                label = LABELS[child["decision"]]
                assert any(label in t for t in texts), (name, i, pos, label)
                if child["decision"] != "not_reached" and not greedy:
                    assert any(fmt_prob(child["accept_prob"]) in t and label in t for t in texts)
            if extra_here:
                assert any(LABELS[extra["kind"]] in t for t in texts)
            _assert_notes_fit(fig)


def _assert_notes_fit(fig) -> None:
    """Each note's widest line, started right of its bar, ends inside the plot at the chart's narrowest width
    (a phone's, NOTE_PLOT_PX; the browser layout test measures the real text)."""
    from visuals.distributions import NOTE_CHAR_PX, NOTE_PAD_PX, NOTE_PLOT_PX

    span = fig.layout.xaxis.range[1]
    for note in fig.layout.annotations:
        widest = max(len(line) for line in note.text.split("<br>")) * NOTE_CHAR_PX + NOTE_PAD_PX
        assert note.x / span * NOTE_PLOT_PX + widest <= NOTE_PLOT_PX + 1, note.text


def test_pq_default_position_is_the_first_rejection():
    chat = RECORDED[CHAT]
    at_root = _step_where(chat, lambda st: any(n["decision"] == "rejected" and n["parent"] == -1 for n in st["nodes"]))
    assert default_position(step_events(chat)[at_root]) == 0
    greedy = RECORDED[NGRAM_GREEDY]
    index = _step_where(greedy, lambda st: st["extra_kind"] == "resampled")
    step = step_events(greedy)[index]  # a greedy pass that ended on a rejected draft
    pos = default_position(step)
    rejected = next(n for n in step["nodes"] if n["decision"] == "rejected")
    assert step["dists"][pos]["node"] == rejected["parent"]
    fig = pq_figure(greedy, index)
    if rejected["parent"] != -1:
        parent_text = next(n["text"] for n in step["nodes"] if n["id"] == rejected["parent"])
        assert f"after '{show_token(parent_text)}'" in plain(fig.layout.title.text)
    assert any("✗ rejected" in a.text and "greedy" in a.text for a in fig.layout.annotations)
    # No rejection in the step: the first position.
    clean = _step_where(chat, lambda st: not any(n["decision"] == "rejected" for n in st["nodes"]))
    assert default_position(step_events(chat)[clean]) == 0


def test_pq_resampled_rejection_has_residual_and_accept_prob_text():
    events = RECORDED[CHAT]
    index = _step_where(events, lambda st: st["extra_kind"] == "resampled" and st["emitted"][-1].get("residual_top"))
    step = step_events(events)[index]
    fig = pq_figure(events, index, default_position(step))
    texts = [a.text for a in fig.layout.annotations]
    first = next(n for n in step["nodes"] if n["decision"] == "rejected")
    assert any("✗ rejected" in t and f"min(1, p/q) = {fmt_prob(first['accept_prob'])}" in t for t in texts)
    assert any("↻ resampled" in t for t in texts)
    assert len(by_role(fig, "residual")) == 1


def test_pq_position_out_of_range_and_empty_dists():
    with pytest.raises(IndexError):
        pq_figure(RECORDED[CHAT], 0, 17)
    events = copy.deepcopy(RECORDED[CHAT][:2])
    events[1]["dists"] = []
    fig = pq_figure(events, 0)
    assert "reduced payload" in fig.layout.annotations[0].text.replace("<br>", " ")


# ---------------------------------------------------------------------------------------- timeline


@pytest.mark.parametrize("name", sorted(ALL))
def test_timeline_boxes(name):
    events = ALL[name]
    steps = step_events(events)
    fig = timeline_figure(events)
    boxes = by_role(fig, "tokens")
    emitted = [(i, tok) for i, st in enumerate(steps) for tok in st["emitted"]]
    assert sum(len(tr.x) for tr in boxes) == len(emitted)
    for tr in boxes:
        kind = tr.meta["kind"]
        assert tr.marker.color == PALETTE[kind]
        mine = [(i, tok) for i, tok in emitted if tok["kind"] == kind]
        assert len(tr.x) == len(mine)
        assert list(tr.y) == [i for i, _ in mine]  # one row per pass
        assert all(show_token(tok["text"], 24) in text for (_, tok), text in zip(mine, tr.text))
        assert all(f"pass {steps[i]['step']}" in h for (i, _), h in zip(mine, tr.hovertext))
    positions = sorted(p for tr in boxes for p in tr.meta["output_positions"])
    assert positions == list(range(1, len(emitted) + 1))
    # Row labels carry the count of tokens per pass.
    assert list(fig.layout.yaxis.ticktext) == [
        f"pass {st['step']}: {len(st['emitted'])} tok" + (" ✂" if st.get("truncated") else "") for st in steps
    ]
    # Boxes of a row do not overlap and follow the output order.
    for tr in boxes:
        for b, w in zip(tr.base, tr.x):
            assert w > 0 and b >= 0


# --------------------------------------------------------------------------------- tokens per pass


@pytest.mark.parametrize("name", sorted(ALL))
def test_tokens_per_pass_values(name):
    events = ALL[name]
    fig = tokens_per_pass_figure(events)
    (measured,) = by_role(fig, "measured")
    assert list(measured.y) == pytest.approx(running_mean(events))
    assert "measured" in measured.name
    (base,) = by_role(fig, "baseline")
    assert list(base.y) == [1.0, 1.0]
    (theory,) = by_role(fig, "theory")
    s = run_summary(events)
    # The theory at the depth each pass drafted (1 for a pass that drafted nothing), averaged over the passes.
    depths = [st["draft_depth"] if st["drafted"] else 0 for st in step_events(events)]
    each = [e_formula(s["position_acceptance"], d) if d else 1.0 for d in depths]
    want = sum(each) / len(each) if s["drafted"] else 1.0
    assert list(theory.y) == pytest.approx([want, want])
    assert "theory" in theory.name and theory.line.dash == "dash"
    (per_pass,) = by_role(fig, "per_pass")
    assert list(per_pass.y) == [len(st["emitted"]) for st in step_events(events)]


def test_tokens_per_pass_measured_speedup_vs_baseline():
    spec, base = RECORDED[NGRAM_GREEDY], RECORDED[BASELINE]
    fig = tokens_per_pass_figure(spec, base)
    # The one definition (engine.metrics.measured_speedup): tokens per second over the baseline's.
    speed = spec[-1]["metrics"]["tokens_per_s"] / base[-1]["metrics"]["tokens_per_s"]
    assert f"measured speedup vs baseline {speed:.2f}×" in plain(fig.layout.title.text)
    # A partial spec trace: its tokens so far over its last step's elapsed_s.
    partial = spec[:4]
    fig = tokens_per_pass_figure(partial, base)
    tokens = sum(len(s["emitted"]) for s in step_events(partial))
    speed = tokens / partial[-1]["elapsed_s"] / base[-1]["metrics"]["tokens_per_s"]
    assert f"{speed:.2f}×" in plain(fig.layout.title.text)


# -------------------------------------------------------------------------------------- acceptance


@pytest.mark.parametrize("name", sorted(ALL))
def test_acceptance_bars(name):
    events = ALL[name]
    fig = acceptance_figure(events)
    finish = events[-1] if events[-1]["type"] == "finish" else None
    steps = step_events(events)
    if finish is not None:
        want = finish["metrics"]["acceptance_by_position"]
    else:
        k = max([events[0]["tree"]["k"]] + [st["draft_depth"] for st in steps])
        want = []
        for i in range(1, k + 1):
            drafted = sum(1 for st in steps if st["draft_depth"] >= i)
            reached = sum(1 for st in steps if st["accepted_len"] >= i)
            want.append(reached / drafted if drafted else None)
    bars = by_role(fig, "measured")
    if not want or not any(st["drafted"] for st in steps):
        assert bars == []  # a message figure
        assert fig.layout.annotations
        return
    (bar,) = bars
    assert list(bar.y) == pytest.approx(want)
    assert list(bar.x) == list(range(1, len(want) + 1))
    (theory,) = by_role(fig, "theory")
    alpha = run_summary(events)["position_acceptance"]
    assert list(theory.y) == pytest.approx([alpha**i for i in range(1, len(want) + 1)])
    if finish is not None:
        m = finish["metrics"]
        assert [c[0] for c in bar.customdata] == m["accepted_per_position"]
        assert [c[1] for c in bar.customdata] == m["drafted_per_position"]


def test_acceptance_only_rejections_is_all_zero():
    fig = acceptance_figure(EDGE["only-rejections"])
    (bar,) = by_role(fig, "measured")
    assert all(v == 0 for v in bar.y)


# ----------------------------------------------------------------------------------------- speedup


@pytest.mark.parametrize(("alpha", "k", "c"), [(0.7, 4, 0.05), (0.0, 1, 0.0), (1.0, 5, 0.1), (0.439, 3, 0.36)])
def test_speedup_formula(alpha, k, c):
    fig = speedup_figure(alpha, k, c, {"alpha": alpha, "k": k, "tokens_per_pass": 2.5, "speedup": 1.4})
    e_k = e_formula(alpha, k)
    (e_chosen,) = [tr for tr in by_role(fig, "chosen_k") if tr.xaxis in (None, "x")]
    assert list(e_chosen.x) == [k] and e_chosen.y[0] == pytest.approx(e_k)
    (e_curve,) = by_role(fig, "E", chosen=True)
    assert list(e_curve.x)[:12] == list(range(1, 13))
    assert list(e_curve.y) == pytest.approx([e_formula(alpha, kk) for kk in e_curve.x])
    (s_curve,) = by_role(fig, "speedup", chosen=True)
    assert list(s_curve.y) == pytest.approx([e_formula(alpha, kk) / (kk * c + 1) for kk in s_curve.x])
    chosen = by_role(fig, "chosen_k")
    assert sorted(tr.y[0] for tr in chosen) == pytest.approx(sorted([e_k, e_k / (k * c + 1)]))
    measured = by_role(fig, "measured")
    assert {tr.meta["panel"] for tr in measured} == {"E", "speedup"}
    assert all(tr.name == "your run (measured)" for tr in measured)
    assert "theory" in plain(fig.layout.title.text) and "K·c + 1" in plain(fig.layout.title.subtitle.text)


def test_speedup_rejects_bad_input():
    with pytest.raises(ValueError):
        speedup_figure(1.5, 3, 0.1)
    with pytest.raises(ValueError):
        speedup_figure(0.5, 0, 0.1)
    with pytest.raises(ValueError):
        speedup_figure(0.5, 3, -1)


# ------------------------------------------------------------------------------------------- batch


def _batch(**over):
    m = {
        "batch_sizes": [1, 2, 4, 8, 16, 32],
        "k": 4,
        "alpha": 0.7,
        "pass_ms_1": [20.0, 20.5, 21.0, 23.0, 28.0, 40.0],
        "pass_ms_k1": [21.0, 22.0, 25.0, 40.0, 80.0, 160.0],
        "draft_ms_per_token": 1.0,
    }
    m.update(over)
    return m


def test_batch_throughputs_and_crossover():
    m = _batch()
    fig = batch_figure(m)
    e = e_formula(m["alpha"], m["k"])
    (without,) = by_role(fig, "without")
    (with_spec,) = by_role(fig, "with")
    want_without = [b / t * 1000 for b, t in zip(m["batch_sizes"], m["pass_ms_1"])]
    want_with = [b * e / (t + m["k"] * 1.0) * 1000 for b, t in zip(m["batch_sizes"], m["pass_ms_k1"])]
    assert list(without.y) == pytest.approx(want_without)
    assert list(with_spec.y) == pytest.approx(want_with)
    ratios = [w / o for w, o in zip(want_with, want_without)]
    stop = next(b for b, r in zip(m["batch_sizes"], ratios) if r <= 1)
    assert f"stops paying at batch size {stop}" in plain(fig.layout.title.text)
    assert any(sh.x0 == stop for sh in fig.layout.shapes)
    assert "measured" in plain(fig.layout.title.subtitle.text) and "computed" in plain(fig.layout.title.subtitle.text)


def test_batch_verdict_reads_the_repeats_spread():
    """A batch size whose repeats' spread lets the ratio fall on either side of 1 gets no verdict: the median
    alone never says "stops paying" there (a busy machine's noise), and a clear loss further on still does."""
    from engine.metrics import batch_throughputs, expected_tokens_per_pass

    m = _batch()
    e = expected_tokens_per_pass(m["alpha"], m["k"])
    draft = m["k"] * m["draft_ms_per_token"]
    base = batch_throughputs(m, m["alpha"], m["draft_ms_per_token"])
    stop = base["stops_paying_at"]
    i = m["batch_sizes"].index(stop)
    wide = [[t * 0.5, t * 2.0] for t in m["pass_ms_1"]]  # a busy machine: every repeat range spans 4x
    noisy = batch_throughputs({**m, "spread_ms_1": wide, "spread_ms_k1": wide}, m["alpha"], m["draft_ms_per_token"])
    low, high = noisy["speedup_bounds"][i]
    assert low == pytest.approx(e * m["pass_ms_1"][i] * 0.5 / (m["pass_ms_1"][i] * 2.0 + draft))
    assert low < 1.0 < high and stop in noisy["unclear_at"]
    assert noisy["stops_paying_at"] != stop and "no verdict there" in noisy["verdict"]
    tight = [[t, t] for t in m["pass_ms_1"]], [[t, t] for t in m["pass_ms_k1"]]
    quiet = batch_throughputs(
        {**m, "spread_ms_1": tight[0], "spread_ms_k1": tight[1]}, m["alpha"], m["draft_ms_per_token"]
    )
    assert quiet["stops_paying_at"] == stop and quiet["verdict"] == base["verdict"]


def test_batch_speedup_never_above_its_ceiling():
    """A wide pass measured quicker than a one-token pass (a CPU's matrix library with a few rows) is counted at
    the one-token pass's time: the speedup and its bounds stay at most E × t1 ÷ (t1 + K·d), the B is named, and
    the lab's table shows each speedup with its spread and its status names the ceiling."""
    from app.labs.batch import _batch_table, _status
    from engine.metrics import batch_throughputs, expected_tokens_per_pass

    m = {"batch_sizes": [1, 2], "k": 4, "pass_ms_1": [20.0, 22.0], "pass_ms_k1": [15.0, 30.0]}
    m |= {"spread_ms_1": [[19.0, 24.0], [21.0, 23.0]], "spread_ms_k1": [[14.0, 16.0], [29.0, 31.0]]}
    e = expected_tokens_per_pass(0.7, 4)
    for draft in (0.0, 1.0):
        r = batch_throughputs(m, 0.7, draft)
        ceiling = e * 20.0 / (20.0 + 4 * draft)
        assert r["capped_at"] == [1] and r["speedup_ceiling"][0] == pytest.approx(ceiling)
        assert r["speedup"][0] == pytest.approx(ceiling) and max(r["speedup_bounds"][0]) <= ceiling + 1e-9
        assert r["speedup"][1] == pytest.approx(e * 22.0 / (30.0 + 4 * draft))  # not capped: as measured
    r = {**batch_throughputs(m, 0.7, 0.0), "measured_on": "here", "repeats": 3, "draft_ms": 0.0}
    assert f"at most {e:.2f}×" in _status(r) and "At B = 1 the wider pass was measured quicker" in _status(r)
    low, high = r["speedup_bounds"][1]
    assert _batch_table(r)[1][1] == f"{r['speedup'][1]:.2f}× [{low:.2f}–{high:.2f}]"
    # the median below the ceiling, the spread's best pairing above it: the status says where the top stops
    spread_only = {**m, "pass_ms_k1": [21.0, 30.0], "spread_ms_k1": [[14.0, 22.0], [29.0, 31.0]]}
    r = {**batch_throughputs(spread_only, 0.7, 0.0), "measured_on": "here", "repeats": 3, "draft_ms": 0.0}
    assert r["capped_at"] == [] and r["bound_capped_at"] == [1] and r["speedup_bounds"][0][1] == pytest.approx(e)
    assert "where the spread's top stops" in _status(r)


def test_batch_always_pays_and_bad_input():
    fig = batch_figure(_batch(pass_ms_k1=[21.0] * 6, draft_ms_per_token=None))
    assert "pays at every batch size" in plain(fig.layout.title.text)
    with pytest.raises(ValueError):
        batch_figure(_batch(pass_ms_1=[1.0]))
    with pytest.raises(ValueError):
        batch_figure({"batch_sizes": [1]})


# --------------------------------------------------------------------------------------------- all


@pytest.mark.parametrize("name", sorted(ALL))
def test_all_figures(name):
    events = ALL[name]
    figs = all_figures(events)
    assert set(figs) == {"tree", "pq", "timeline", "tokens_per_pass", "acceptance", "speedup"}
    steps = step_events(events)
    first_rej = next(
        (i for i, st in enumerate(steps) if any(n["decision"] == "rejected" for n in st["nodes"])), len(steps) - 1
    )
    assert f"pass {steps[first_rej]['step']}" in plain(figs["tree"].layout.title.text).lower()
    s = run_summary(events)
    (e_chosen,) = [tr for tr in by_role(figs["speedup"], "chosen_k") if tr.xaxis in (None, "x")]
    assert e_chosen.y[0] == pytest.approx(e_formula(s["position_acceptance"], max(1, s["k"])))
    assert "estimated" in plain(figs["speedup"].layout.title.subtitle.text)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_all_figures_on_partial_prefixes(name):
    events = RECORDED[name]
    for n in (1, 3):
        figs = all_figures(copy.deepcopy(events[:n]))
        assert len(figs) == 6
    figs = all_figures(events, RECORDED[BASELINE])
    measured = by_role(figs["speedup"], "measured")
    if events[0]["mode"] != "baseline":
        assert {tr.meta["panel"] for tr in measured} == {"E", "speedup"}


# --------------------------------------------------------------------------------------------- CLI


def _cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "visuals", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_cli_writes_one_html_per_figure(tmp_path):
    trace = TRACES_DIR / f"{CHAT}.json"
    res = _cli(trace, "--out", tmp_path / "out", "--baseline", TRACES_DIR / f"{BASELINE}.json")
    assert res.returncode == 0, res.stderr
    paths = [Path(line) for line in res.stdout.split()]
    assert len(paths) == 6
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in paths)
    for path in paths:
        html = path.read_text(encoding="utf-8")
        assert 'src="https://cdn.plot.ly' not in html and "plotly.js v" in html  # inline: opens offline
        assert path.stat().st_size > 1_000_000


def test_cli_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    no_start = tmp_path / "nostart.json"
    no_start.write_text(json.dumps({"events": [{"type": "step", "nodes": [], "emitted": []}]}), encoding="utf-8")
    for path in (bad, no_start, tmp_path / "missing.json"):
        res = _cli(path, "--out", tmp_path / "out")
        assert res.returncode == 2, (path, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert not (tmp_path / "out").exists()
    res = _cli(TRACES_DIR / f"{CHAT}.json", "--out", tmp_path / "out2", "--baseline", bad)
    assert res.returncode == 2 and res.stderr.startswith("error: ")


def test_a_batch_verdict_never_names_a_crossover_it_did_not_measure():
    """#40: "stops paying at batch size 16" beside speedups of 0.57-0.69× at every batch size contradicted the
    table. A clear loss after nothing but noise says "never clearly pays", marks no crossover, and the
    headline agrees with every speedup shown."""
    from engine.metrics import batch_throughputs

    m = _batch()
    sizes = m["batch_sizes"]
    slow = {**m, "pass_ms_k1": [t * 3.0 for t in m["pass_ms_1"]]}  # every speedup well below 1
    wide = [[t * 0.3, t * 3.0] if i < len(sizes) - 1 else [t, t] for i, t in enumerate(slow["pass_ms_1"])]
    wide_k1 = [[t * 0.3, t * 3.0] if i < len(sizes) - 1 else [t, t] for i, t in enumerate(slow["pass_ms_k1"])]
    result = batch_throughputs({**slow, "spread_ms_1": wide, "spread_ms_k1": wide_k1}, m["alpha"], 1.0)
    assert all(s < 1 for s in result["speedup"]) and not result["pays_at"]
    assert (
        result["verdict"].startswith("speculation never clearly pays here") and "stops paying" not in result["verdict"]
    )
    assert result["stops_paying_at"] is None
    fig = batch_figure(result)
    assert "stops paying" not in plain(fig.layout.title.text) and not fig.layout.shapes


@pytest.mark.parametrize("name", ["code-edit-ngram-greedy", "chat-int8-tree-sampling"])
def test_every_chart_of_a_run_names_the_drafter_that_ran(name):
    """#40: a suffix run's p-vs-q chart once said "n-gram drafter". Relabel a recorded run's drafter and every
    chart drawn from it names the new one (title or subtitle), none the old."""
    from visuals.run_charts import accepted_per_pass_figure, kv_cache_figure

    trace = copy.deepcopy(RECORDED[name])
    old = trace[0]["drafter"]
    new = "suffix" if old == "ngram" else "q4"
    trace[0]["drafter"] = new
    index = next(i for i, e in enumerate(visuals.step_events(trace)) if e.get("drafted"))
    figures = {
        "tree": visuals.tree_figure(trace, index),
        "p vs q": visuals.pq_figure(trace, index),
        "timeline": visuals.timeline_figure(trace),
        "tokens per pass": visuals.tokens_per_pass_figure(trace),
        "acceptance": visuals.acceptance_figure(trace),
        "accepted per pass": accepted_per_pass_figure(trace),
        "kv cache": kv_cache_figure(trace),
    }
    for what, fig in figures.items():
        if not fig.data:  # a message ("this trace records no KV cache"), no chart
            continue
        words = f"{fig.layout.title.text} {fig.layout.title.subtitle.text or ''}"
        assert f"{new} drafter" in words or f"on the {new} draft" in words, (what, words)
        assert f"{old} drafter" not in words and "n-gram drafter" not in words, (what, words)


def test_every_title_carries_its_raw_text_for_the_page_to_rewrap():
    """#40: titles are wrapped for a phone here (plotly does not wrap); the page re-wraps them to the figure's
    real width (assets/titles.js, checked in the browser layout test). It needs the raw texts and the line
    sizes, and a new subtitle keeps the plot area's height."""
    from visuals.speedup import speedup_figure
    from visuals.style import SUBTITLE_CHARS, TITLE_CHARS, TITLE_PAD, set_subtitle

    fig = speedup_figure(0.7, 4, 0.1)
    wrap = fig.layout.meta["wrap"]
    assert "<br>" not in wrap["title"] and wrap["title"].replace(" ", "") == fig.layout.title.text.replace(
        "<br>", ""
    ).replace(" ", "")
    assert (wrap["title_chars"], wrap["subtitle_chars"]) == (TITLE_CHARS, SUBTITLE_CHARS)
    assert (wrap["top"], wrap["height"]) == (fig.layout.margin.t, fig.layout.height)
    plot_area = fig.layout.height - fig.layout.margin.t
    long = "a subtitle long enough to take several lines on a phone's figure " * 3
    set_subtitle(fig, f"{wrap['subtitle']}<br>{long}")
    again = fig.layout.meta["wrap"]
    assert again["subtitle"] == f"{wrap['subtitle']}<br>{long}" and again["top"] == fig.layout.margin.t > wrap["top"]
    assert fig.layout.height - fig.layout.margin.t == plot_area
    assert abs(fig.layout.title.y - (1 - TITLE_PAD / fig.layout.height)) < 1e-9


@pytest.mark.parametrize("name", sorted(ALL))
def test_tree_hover_lines_fit_a_phone(name):
    """#40: a tapped node's box on a phone ran past the chart ("compared: p_eff = …, q_eff = … (after an earlier
    sibling's rejection)"): every hover line of every pass is at most HOVER_CHARS characters."""
    import re

    from visuals.tree import HOVER_CHARS

    events = ALL[name]
    for i in range(len(step_events(events))):
        for trace in tree_figure(events, i).data:
            for hover in trace.hovertext or []:
                for line in hover.split("<br>"):
                    assert len(re.sub(r"</?b>", "", line)) <= HOVER_CHARS, (name, i, line)
