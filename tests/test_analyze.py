"""The analyzer (engine/tools/analyze.py, `python -m engine analyze`): bad scrapes get clear messages, and a
window of our own /metrics reads exactly what the traces of the same requests give. (Against the real vLLM
server: tests/test_vllm_backend.py, which starts it.)"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from engine.tools.analyze import AnalyzeError, analyze, parse_prometheus, snapshot

ROOT = Path(__file__).resolve().parent.parent


def _scrape(drafts, draft_tokens, accepted, per_pos, prefix="vllm") -> str:
    lines = [
        f"# TYPE {prefix}:spec_decode_num_drafts counter",
        f'{prefix}:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
        f'{prefix}:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}',
        f'{prefix}:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}',
    ]
    lines += [
        f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}'
        for i, v in enumerate(per_pos)
    ]
    return "\n".join(lines) + "\n"


def test_the_window_reads_rate_length_positions_and_alpha():
    before = _scrape(10, 40, 20, [8, 6, 4, 2])
    after = _scrape(110, 440, 260, [98, 78, 54, 30])  # 100 drafts, 400 tokens, 240 accepted
    r = analyze(before, after, 60.0)
    assert r["drafts"] == 100 and r["acceptance_rate"] == pytest.approx(0.6)
    assert r["mean_acceptance_length"] == pytest.approx(3.4)  # 1 + 240 / 100
    assert r["acceptance_by_position"] == pytest.approx([0.9, 0.72, 0.5, 0.28])
    assert 0.6 < r["alpha_fit"] < 0.9 and r["k"] == 4
    assert "pass costs" in r["recommendation"]
    cheap = analyze(before, after, 60.0, {1: 20.0, 5: 22.0})  # a wide pass almost free: speculation pays
    assert cheap["recommendation"].startswith("K = ")
    dear = analyze(before, after, 60.0, {1: 20.0, 2: 40.0})  # every extra token a whole pass: it does not
    assert dear["recommendation"].startswith("turn speculation off")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("<html><body>Not found</body></html>", "not a Prometheus sample"),
        ('{"metrics": 1}', "not a Prometheus sample"),
        ("vllm:num_requests_running 3\n", "no speculative decoding counters"),
        ("vllm:spec_decode_num_drafts_total abc\n", "not a number"),
    ],
)
def test_bad_scrapes_get_clear_messages(text, message):
    with pytest.raises(AnalyzeError, match=message):
        snapshot(text)


def test_resets_and_thin_windows_are_refused():
    with pytest.raises(AnalyzeError, match="restarted"):
        analyze(_scrape(100, 400, 200, [90]), _scrape(5, 20, 10, [4]))
    with pytest.raises(AnalyzeError, match="too few drafts"):
        analyze(_scrape(100, 400, 200, [90]), _scrape(105, 420, 210, [94]))
    assert len(parse_prometheus(_scrape(1, 2, 3, [1]))) == 4


def test_the_cli_reads_a_saved_window_and_says_what_is_wrong(tmp_path):
    saved = tmp_path / "window.json"
    saved.write_text(
        json.dumps({"before": _scrape(0, 0, 0, [0]), "after": _scrape(50, 200, 100, [40, 30]), "interval_s": 30})
    )
    run = [sys.executable, "-m", "engine", "analyze", str(saved), "--pass-ms", "1:20,3:24"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert (
        "draft acceptance rate 0.500 beside mean acceptance length 3.00" in out.stdout
        and "recommendation" in out.stdout
    )
    bad = subprocess.run(run[:4] + ["http://127.0.0.1:9/"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "cannot reach" in bad.stderr
    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2]")
    bad = subprocess.run(run[:4] + [str(junk)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "not a saved scrape" in bad.stderr


def test_our_own_metrics_read_as_the_traces_of_the_window(server):
    """Scrape the app's /metrics, serve /generate requests, scrape again: the analyzer's window equals the sums of
    the requests' own finish metrics (drafts, rate, length, acceptance by position)."""
    import gradio_client

    def text() -> str:
        with urllib.request.urlopen(server + "metrics", timeout=30) as response:
            return response.read().decode()

    client = gradio_client.Client(server, verbose=False)
    before = text()
    prompt = json.loads((ROOT / "assets" / "examples.json").read_text())[0]["prompt"]  # a code edit: n-gram drafts
    runs = [client.predict(prompt, "ngram", 2, 0.0, 1.0, 0, 0, 64, api_name="/generate") for _ in range(3)]
    result = analyze(before, text(), model=runs[0]["target"])
    metrics = [r["metrics"] for r in runs]
    drafts = sum(m["passes_drafted"] for m in metrics)
    assert result["drafts"] == drafts and result["server"] == "speclens"
    assert result["acceptance_rate"] == pytest.approx(
        sum(m["accepted"] for m in metrics) / sum(m["drafted"] for m in metrics)
    )
    assert result["mean_acceptance_length"] == pytest.approx(1 + sum(m["accepted"] for m in metrics) / drafts)
    reached = [
        sum(m["accepted_per_position"][i] for m in metrics) / drafts
        for i in range(len(result["acceptance_by_position"]))
    ]
    assert result["acceptance_by_position"] == pytest.approx(reached)


def test_a_window_recorded_from_the_real_vllm_server_reads_offline():
    """assets/scrapes/: two scrapes of the real vLLM CPU server (n-gram speculation) around a code edit and a
    chat, saved by tests/test_vllm_backend.py; read offline, as a user's saved window would be."""
    run = [
        sys.executable,
        "-m",
        "engine",
        "analyze",
        str(ROOT / "assets" / "scrapes" / "vllm-ngram-code-edit-and-chat.json"),
    ]
    out = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["server"] == "vllm" and result["requests"] == 2 and result["drafts"] >= 20
    assert result["mean_acceptance_length"] == pytest.approx(1 + result["accepted"] / result["drafts"])
    rates = result["acceptance_by_position"]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # a path that reached position i reached i - 1
    assert 0 < result["alpha_fit"] < 1
