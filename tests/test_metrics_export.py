"""/metrics (app/metrics_export.py): vLLM's speculation counters under our prefix, adding up exactly with
the traces served."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.metrics_export import metrics_text, record_run
from app.traces import load_recorded
from engine.trace import step_events


def _samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_a_recorded_trace_adds_its_own_counts():
    trace = load_recorded("chat-int8-tree-sampling.json")
    steps = step_events(trace)
    labels = {"model_name": trace[0]["target"], "drafter": trace[0]["drafter"]}
    before = _samples(metrics_text().decode())
    assert record_run(trace)
    after = _samples(metrics_text().decode())
    drafting = [s for s in steps if s["drafted"]]
    assert _delta(before, after, "speclens:spec_decode_num_drafts_total", **labels) == len(drafting)
    assert _delta(before, after, "speclens:spec_decode_num_draft_tokens_total", **labels) == sum(
        s["drafted"] for s in steps
    )
    accepted = sum(s["accepted_len"] for s in steps)
    assert _delta(before, after, "speclens:spec_decode_num_accepted_tokens_total", **labels) == accepted
    assert _delta(before, after, "speclens:spec_decode_num_verify_passes_total", **labels) == len(steps)
    first = sum(1 for s in steps if s["accepted_len"] >= 1)
    pos0 = _delta(before, after, "speclens:spec_decode_num_accepted_tokens_per_pos_total", **labels, position="0")
    assert pos0 == first
    assert _delta(before, after, "speclens:spec_decode_accepted_per_pass_count", **labels) == len(drafting)
    assert not record_run(trace[:-1])  # an unfinished run is not counted


def test_metrics_served_add_up_with_the_api_runs(server):
    """N /generate requests: the scrape's deltas equal the sums of their finish metrics."""
    import gradio_client

    def scrape() -> dict:
        with urllib.request.urlopen(server + "metrics", timeout=30) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            return _samples(response.read().decode())

    client = gradio_client.Client(server, verbose=False)
    before = scrape()
    runs = [
        client.predict(prompt, "ngram", 4, 0.0, 1.0, 0, 0, 24, api_name="/generate")
        for prompt in ("Repeat: the cat sat on the mat. The cat sat on the mat.", "Name three colours.")
    ]
    after = scrape()
    labels = {"model_name": runs[0]["target"], "drafter": "ngram"}
    metrics = [r["metrics"] for r in runs]
    name = "speclens:spec_decode_num_{}_total"
    assert _delta(before, after, name.format("drafts"), **labels) == sum(m["passes_drafted"] for m in metrics)
    assert _delta(before, after, name.format("draft_tokens"), **labels) == sum(m["drafted"] for m in metrics)
    assert _delta(before, after, name.format("accepted_tokens"), **labels) == sum(m["accepted"] for m in metrics)
    assert _delta(before, after, name.format("verify_passes"), **labels) == sum(m["target_passes"] for m in metrics)
    for position in range(4):
        want = sum(m["accepted_per_position"][position] for m in metrics if len(m["accepted_per_position"]) > position)
        got = _delta(before, after, name.format("accepted_tokens_per_pos"), **labels, position=str(position))
        assert got == want, position
    assert sum(m["drafted"] for m in metrics) > 0  # the first prompt repeats itself: n-gram drafted


@pytest.mark.parametrize("bad", ["POST"])
def test_metrics_is_read_only(server, bad):
    request = urllib.request.Request(server + "metrics", method=bad, data=b"")
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(request, timeout=30)


def test_the_grafana_dashboard_reads_names_both_servers_export():
    """docs/grafana-speculation.json's five panels use only counters vLLM exports (its spec_decode schema) and
    our /metrics exports under the same names, so one board reads either by its prefix variable."""
    import json
    import re
    from pathlib import Path

    board = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana-speculation.json").read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"\$\{prefix\}:(\w+)", e)}
    vllm = {
        f"spec_decode_num_{n}_total" for n in ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos")
    }
    assert used and used <= vllm, used - vllm
    record_run(load_recorded("chat-int8-tree-sampling.json"))
    ours = {name.split(":", 1)[1] for name, _ in _samples(metrics_text().decode())}
    assert used <= ours, used - ours
    assert len(board["panels"]) == 5
