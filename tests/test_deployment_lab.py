""" "Your deployment" (app/labs/deployment.py): the windows recorded on the real vLLM CPU server read as the
analyzer reads them, bad files and bad costs get messages, and a public Space fetches no visitor's URL.
(The probe and the scrape against the real vLLM server: tests/test_vllm_backend.py.)"""

from __future__ import annotations

import json

import pytest

from app import config
from app.labs import deployment
from engine.tools.analyze import AnalyzeError, analyze
from engine.tools.pass_costs import parse_pass_costs


@pytest.mark.parametrize("label", list(deployment.RECORDED))
def test_a_recorded_window_shows_rate_and_length_side_by_side_and_a_recommendation(label):
    window, costs_text, message = deployment.load_saved(deployment.RECORDED[label])
    assert window and not message and costs_text.startswith("1:")
    status, acceptance, speedup = deployment.analyze_window(window, costs_text)
    expected = analyze(window["before"], window["after"], window["interval_s"], window["pass_costs"])
    assert f"| {expected['acceptance_rate']:.3f} | {expected['mean_acceptance_length']:.2f} tokens per pass |" in status
    assert expected["recommendation"] in status and "expected" in status.lower()
    assert f"{expected['window_speedup']:.2f}x" in status  # the window's own, from the server's decode time
    assert "Acceptance rate" in acceptance.layout.title.text
    heat = speedup.data[0]
    assert heat.type == "heatmap" and len(heat.y) == 8
    assert [int(b) for b in heat.x] == sorted(int(b) for b in window["pass_costs"]["decode_ms"])
    assert "expected, not measured" in speedup.layout.title.subtitle.text
    # the same advice as one sentence for a ticket, with the line that turns it on for the model the counters name
    assert "**For a ticket**" in status and "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in status


def test_typed_costs_replace_the_probed_ones_and_bad_ones_get_a_message():
    window, _, _ = deployment.load_saved(next(iter(deployment.RECORDED.values())))
    dear = deployment.analyze_window(window, "1:60/900")[0]  # 8 drafts cost 14 plain passes: never pays
    assert "turn speculation off" in dear
    # costs typed far from this server's (30 ms where its passes took 60 to 90): the window says the model misses
    off = deployment.analyze_window(window, "1:30/36")[0]
    assert "The cost model misses this window's passes by" in off and "race the server" in off
    for bad, words in [
        ("1:60", "BATCH:PLAIN_MS/SPECULATIVE_MS"),
        ("1:6/7/8/9", "PLAIN/HALF/ALL"),
        ("4:60/80", "at batch 1"),
        ("1:-5/3", "positive"),
    ]:
        status = deployment.analyze_window(window, bad)[0]
        assert status.startswith("**Cannot analyse this window:**") and words in status, status
    typed = parse_pass_costs("1:60/81, 4:77/110/128")
    assert typed["verify_ms"] == {1: 81.0, 4: 128.0} and typed["mixed_ms"] == {4: 110.0}


def test_bad_files_get_messages_and_nothing_is_kept(tmp_path):
    cases = {"junk.json": "{not json", "list.json": "[1, 2]", "text.json": json.dumps({"before": 1, "after": 2})}
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        window, costs, message = deployment.load_saved(str(path))
        assert window is None and costs == "" and message.startswith("**Not a saved window:**"), message
    html = tmp_path / "page.json"
    html.write_text(json.dumps({"before": "<html>no</html>", "after": "<html>no</html>"}))
    window, _, _ = deployment.load_saved(str(html))
    status = deployment.analyze_window(window, "")[0]
    assert "not a Prometheus sample" in status
    assert deployment.analyze_window(None, "")[0] == deployment.WAITING


def test_a_public_space_fetches_no_url_a_visitor_types(monkeypatch):
    monkeypatch.setenv("SPACE_ID", "someone/speclens")
    monkeypatch.delenv("SPECLENS_ALLOW_SCRAPE", raising=False)
    assert not config.scrape_allowed()
    window, message = deployment.scrape_window("http://169.254.169.254/latest/meta-data", 5)
    assert window is None and "does not fetch addresses" in message and "--save" in message
    costs, _, message = deployment.probe("http://10.0.0.1:8000", None)
    assert "does not fetch addresses" in message
    monkeypatch.setenv("SPECLENS_ALLOW_SCRAPE", "1")
    assert config.scrape_allowed()
    monkeypatch.delenv("SPACE_ID")
    monkeypatch.delenv("SPECLENS_ALLOW_SCRAPE")
    assert config.scrape_allowed()  # a local app fetches what its user types
    window, message = deployment.scrape_window("ftp://example", 5)
    assert window is None and "not an http(s) URL" in message
    window, message = deployment.scrape_window("http://127.0.0.1:9/", 5000)
    assert window is None and "between 1 and" in message
    with pytest.raises(AnalyzeError):
        parse_pass_costs("")


def test_pass_costs_stay_with_the_window_they_were_timed_for(monkeypatch):
    """#40: timing a server while another server's window is shown (a recorded one) attaches nothing and says
    why; a fresh scrape starts without the box's old costs; typed costs are called typed."""
    monkeypatch.setenv("SPECLENS_ALLOW_SCRAPE", "1")
    recorded, costs_text, _ = deployment.load_saved(deployment.RECORDED[deployment.FIRST])
    costs, window, message = deployment.probe("http://127.0.0.1:9", recorded)
    assert window is recorded and "scrape this server first" in message and not isinstance(costs, str)
    status = deployment.analyze_window(recorded, "1:50/60, 4:90/110/130")[0]
    assert "Pass costs typed" in status, status


def test_the_speedup_colour_scale_starts_at_zero_and_is_white_at_one():
    from visuals.deployment import expected_speedup_figure

    window, costs, _ = deployment.load_saved(deployment.RECORDED[deployment.FIRST])
    result = analyze(window["before"], window["after"], window.get("interval_s"), parse_pass_costs(costs))
    heat = expected_speedup_figure(result).data[0]
    assert heat.zmin == 0.0 and heat.zmax >= 2.0
    white = [pos for pos, colour in heat.colorscale if colour.upper() == "#FFFFFF"]
    assert white == [pytest.approx(1.0 / heat.zmax)]


def test_per_request_responses_read_as_which_requests_pay(tmp_path):
    """#41 item 3 in the tab: the recorded responses of the real vLLM CPU server read as a distribution of τ, with
    the break-even from the window's pass costs; a bad log gets a message and an empty figure."""
    window, costs, _ = deployment.load_saved(deployment.RECORDED[deployment.FIRST])
    text, figure = deployment.read_requests_file(str(deployment.RECORDED_REQUESTS), window, costs)
    bars = figure.data[0]
    assert "**16 requests**" in text and len(bars.y) == 16 and list(bars.y) == sorted(bars.y)
    assert "Break-even τ" in text and "requests pay" in text and "code-edit median τ" in text
    assert "break-even" in figure.layout.title.subtitle.text
    alone, _ = deployment.read_requests_file(str(deployment.RECORDED_REQUESTS), None, "")
    assert "needs a break-even" in alone
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"acceptance_histogram": "x"}\n')
    message, empty = deployment.read_requests_file(str(bad), window, costs)
    assert message.startswith("**Cannot read the log:**") and not empty.data


def test_the_analyze_metrics_api_reads_recorded_and_saved_windows_alike():
    """/analyze_metrics (also an MCP tool): a recorded window by name and the same window sent as JSON text read
    the same; text that is not a saved window, and an unknown name, get clear errors."""
    import gradio as gr

    from app.labs.deployment import RECORDED
    from app.tabs.api import analyze_metrics

    path = next(p for p in RECORDED.values() if p.stem.endswith("code-edit"))
    by_name = analyze_metrics("code-edit")
    by_text = analyze_metrics(path.read_text())
    for key in ("acceptance_rate", "mean_acceptance_length", "acceptance_by_position", "recommendation", "ticket"):
        assert by_name[key] == by_text[key], key
    assert by_name["recorded_on"] and "recorded" in by_name["source"]
    for bad, says in (
        ("{not json", "source is not JSON"),
        ('{"before": 1}', "not a saved scrape"),
        ("nope", "none of"),
    ):
        with pytest.raises(gr.Error, match=says):
            analyze_metrics(bad)
