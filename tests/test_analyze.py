"""The analyzer (engine/tools/analyze.py, `python -m engine analyze`): bad scrapes get clear messages, and a
window of our own /metrics reads exactly what the traces of the same requests give. (Against the real vLLM
server: tests/test_vllm_backend.py, which starts it.)"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from engine.tools.analyze import AnalyzeError, analyze, parse_prometheus, snapshot

ROOT = Path(__file__).resolve().parent.parent


def _scrape(drafts, draft_tokens, accepted, per_pos, prefix="vllm", requests=None, tokens=None, decode_s=None) -> str:
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
    if requests is not None:
        lines += [
            f'{prefix}:request_success_total{{engine="0",model_name="m",finished_reason="length"}} {requests}',
            f'{prefix}:generation_tokens_total{{engine="0",model_name="m"}} {tokens}',
            f'{prefix}:request_decode_time_seconds_sum{{engine="0",model_name="m"}} {decode_s}',
        ]
    return "\n".join(lines) + "\n"


def _costs(decode: dict, verify: dict, k: int = 4) -> dict:
    return {"decode_ms": decode, "verify_ms": verify, "k": k, "source": "typed"}


def test_the_window_reads_rate_length_positions_and_alpha():
    before = _scrape(10, 40, 20, [8, 6, 4, 2])
    after = _scrape(110, 440, 260, [98, 78, 54, 30])  # 100 drafts, 400 tokens, 240 accepted
    r = analyze(before, after, 60.0)
    assert r["drafts"] == 100 and r["acceptance_rate"] == pytest.approx(0.6)
    assert r["mean_acceptance_length"] == pytest.approx(3.4)  # 1 + 240 / 100
    assert r["acceptance_by_position"] == pytest.approx([0.9, 0.72, 0.5, 0.28])
    assert 0.6 < r["alpha_fit"] < 0.9 and r["k"] == 4
    assert "pass costs" in r["recommendation"]
    assert r["drafting_share"] == 1.0 and r["decode_passes"] is None  # no request counters: every pass assumed to draft
    cheap = analyze(before, after, 60.0, _costs({1: 20.0}, {1: 22.0}))  # a verify pass almost free: it pays
    assert cheap["recommendation"].startswith("K = ")
    dear = analyze(before, after, 60.0, _costs({1: 20.0}, {1: 80.0}))  # 4 drafts cost 3 passes more: it does not
    assert dear["recommendation"].startswith("turn speculation off")


def test_passes_that_did_not_draft_and_batches_are_weighed():
    """vLLM's request and token counters give the window's decode passes; only a share of them drafted (an
    n-gram drafter often finds nothing), and the expected tokens per pass mix E(α, K) with 1 by that share. With
    plain and speculative pass costs by batch size, speculation pays alone and stops paying where a speculative
    pass of B requests costs more than the tokens it adds; the model is checked against the window's own ms."""
    before = _scrape(0, 0, 0, [0, 0, 0, 0], requests=0, tokens=0, decode_s=0.0)
    # 10 requests, 400 decode passes of which 100 drafted (4 tokens each, 240 accepted): 650 tokens, 30 s decoding
    after = _scrape(100, 400, 240, [90, 72, 50, 28], requests=10, tokens=650, decode_s=30.0)
    r = analyze(before, after, 40.0, _costs({1: 60.0, 4: 80.0, 16: 170.0}, {1: 80.0, 4: 130.0, 16: 700.0}, k=4))
    assert r["decode_passes"] == 400 and r["drafting_share"] == pytest.approx(0.25)
    assert r["tokens_per_pass"] == pytest.approx(640 / 400)
    assert r["window_pass_ms"] == pytest.approx(75.0) and r["concurrency"] == pytest.approx(0.75)
    e4 = (1 - r["alpha_fit"] ** 5) / (1 - r["alpha_fit"])
    assert r["expected_tokens_per_pass"][4] == pytest.approx(0.25 * e4 + 0.75)
    # at batch 1 and the probe's K: a quarter of the passes cost the speculative 80 ms, the rest the plain 60
    assert r["model_check"] == {"batch": 1, "model_ms": pytest.approx(65.0), "measured_ms": pytest.approx(75.0)}
    assert r["window_speedup"] == pytest.approx(1.6 * 60 / 75)
    assert r["speedup_by_batch"][1][4] == pytest.approx(r["expected_tokens_per_pass"][4] * 60 / 65)
    assert r["best_k_by_batch"][1] > 0 and r["best_k_by_batch"][16] == 0
    assert "turn it off from about 16 concurrent requests" in r["recommendation"]
    with pytest.raises(AnalyzeError, match="pass costs need"):
        analyze(before, after, 40.0, {"decode_ms": {1: 60.0}})
    # Probed costs carry the share of passes each case really drafted: at 16, plain 180 ms at 10%, half 300 at
    # 50%, all 420 at 90% (K = 4) lie on 150 + 300·share, so no drafting costs 150 ms and a drafted token
    # 300 / (16 · 4) ms. A server without speculation (120 ms at 16) is what speculation is weighed against.
    probed = {
        **_costs({1: 60.0, 16: 180.0}, {1: 80.0, 16: 420.0}),
        "mixed_ms": {16: 300.0},
        "decode_share": {1: 0.0, 16: 0.1},
        "mixed_share": {16: 0.5},
        "verify_share": {1: 1.0, 16: 0.9},
        "baseline_decode_ms": {1: 55.0, 16: 120.0},
    }
    mixed = analyze(before, after, 40.0, probed)
    base, token = mixed["pass_costs"]["plain_ms"][16], mixed["pass_costs"]["token_ms"][16]
    assert base == pytest.approx(150.0) and token == pytest.approx(300 / 64)
    assert mixed["pass_costs"]["against"] == "a server without speculation"
    expected = mixed["expected_tokens_per_pass"][2] * 120 / (150 + 16 * 0.25 * 2 * token)
    assert mixed["speedup_by_batch"][16][2] == pytest.approx(expected)
    # a batch without gain between batches with gain is the probe's noise: said, never "turn it off" there
    gap = analyze(before, after, 40.0, _costs({1: 60.0, 2: 60.0, 4: 70.0}, {1: 64.0, 2: 900.0, 4: 75.0}))
    assert gap["best_k_by_batch"][2] == 0 and gap["best_k_by_batch"][4] > 0
    assert (
        "turn it off" not in gap["recommendation"] and "no gain at batch 2 but did at larger" in gap["recommendation"]
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("<html><body>Not found</body></html>", "not a Prometheus sample"),
        ('{"metrics": 1}', "not a Prometheus sample"),
        ("vllm:num_requests_running 3\n", "no speculative decoding counters"),
        ("vllm:spec_decode_num_drafts_total abc\n", "not a number"),
        ("vllm:x{" + "}" * 100_000 + " 1\n", "longer than 4096 characters"),
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
    run = [sys.executable, "-m", "engine", "analyze", str(saved), "--pass-ms", "1:20/24,4:30/45"]
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
    bad = subprocess.run(run[:5] + ["--pass-ms", "1:20,3:24"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "BATCH:PLAIN_MS/SPECULATIVE_MS" in bad.stderr


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


@pytest.mark.parametrize("workload, requests", [("code-edit", 4), ("chat", 3)])
def test_a_window_recorded_from_the_real_vllm_server_reads_offline(workload, requests):
    """assets/scrapes/: two scrapes of the real vLLM CPU server (n-gram, K = 8) around one workload's prompts,
    with the pass costs probed on it (scripts/record_deployment_windows.py); read offline by the CLI, as a
    user's saved window would be, with the pass costs it carries."""
    run = [sys.executable, "-m", "engine", "analyze", str(ROOT / "assets" / "scrapes" / f"vllm-ngram-{workload}.json")]
    out = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["server"] == "vllm" and result["requests"] == requests and result["drafts"] >= 20
    assert result["mean_acceptance_length"] == pytest.approx(1 + result["accepted"] / result["drafts"])
    rates = result["acceptance_by_position"]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # a path that reached position i reached i - 1
    assert 0 < result["alpha_fit"] < 1 and result["k"] == 8  # the server's K: its per-position counters
    assert 4 <= result["pass_costs"]["k"] <= 8  # draft tokens per drafting pass in the probe (n-gram may draft fewer)
    assert result["decode_passes"] == result["tokens"] - result["requests"] - result["accepted"]
    assert 0 < result["drafting_share"] <= 1 and result["window_pass_ms"] > 0
    # the cost model, at the window's own K and load, lands within 25% of the server's own ms per pass
    check = result["model_check"]
    assert abs(check["model_ms"] / check["measured_ms"] - 1) < 0.25, check
    text = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "expected speedup (K down, batch across)" in text.stdout and "recommendation: K = " in text.stdout


def test_fuzzed_scrapes_get_a_result_or_a_clear_message():
    """Two thousand mutations of a real window (cut, bytes flipped, lines swapped or doubled, labels broken):
    the analyzer returns a reading or raises AnalyzeError with a message; nothing else escapes."""
    import random

    window = json.loads((ROOT / "assets" / "scrapes" / "vllm-ngram-chat.json").read_text())
    rng = random.Random(0)
    junk = ["", "{", "}", '"', "=", " ", "\n", "\x00", "é", "NaN", "-1", "1e309", "#", '{position="x"}']
    outcomes = {"read": 0, "refused": 0}
    for _ in range(2000):
        text = window["after"]
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(text))
            move = rng.randrange(4)
            if move == 0:
                text = text[:i]
            elif move == 1:
                text = text[:i] + rng.choice(junk) + text[i + 1 :]
            elif move == 2:
                lines = text.splitlines()
                rng.shuffle(lines)
                text = "\n".join(lines)
            else:
                text = text[:i] + text[i:][: rng.randrange(200)] + text[i:]
        try:
            result = analyze(window["before"], text, 30.0, window["pass_costs"])
            numbers = [result["acceptance_rate"], result["mean_acceptance_length"], *result["acceptance_by_position"]]
            assert all(math.isfinite(v) for v in numbers), result
            outcomes["read"] += 1
        except AnalyzeError as exc:
            assert str(exc), "an empty message"
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100, outcomes


def test_sglang_gauges_say_what_they_can_and_what_they_cannot():
    """#41: SGLang exports gauges (recent averages), not counters. The analyzer reads the second scrape's mean
    acceptance length and rate, says they are SGLang's averages, and names what cannot be derived (no window, no
    per-position acceptance or α, no draft counts); the CLI and the Your deployment tab say the same."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from app.labs import deployment
    from engine.tools.analyze import GAUGE_LIMITS, analyze, gauge_reading

    root = Path(__file__).resolve().parent.parent
    path = root / "assets" / "scrapes" / "sglang-gauges-format-example.json"
    window = json.loads(path.read_text())
    assert "not measured" in window["note"]
    result = analyze(window["before"], window["after"], window["interval_s"])
    assert result["gauges_only"] and result["server"] == "sglang"
    assert result["mean_acceptance_length"] == 2.4 and result["acceptance_rate"] == 0.42
    assert "no acceptance by position" in result["recommendation"] and GAUGE_LIMITS in result["recommendation"]
    assert gauge_reading("vllm:spec_decode_num_drafts_total 5\n") is None
    status = deployment.analyze_window(window, "")[0]
    assert "SGLang's gauges" in status and "2.40 tokens per pass" in status and "no window" in status
    out = subprocess.run(
        [sys.executable, "-m", "engine", "analyze", str(path)], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert out.returncode == 0 and "SGLang reports a mean acceptance length of 2.40" in out.stdout, out


# ------------------------------------------------------------------------------------------ what-if


def test_the_what_if_rates_are_the_windows_or_vllms_own_schedule_for_a_typed_tau():
    """engine/tools/what_if.py: the window's acceptance by position is vLLM's unconditional per-position rate;
    a typed τ gives vLLM's minimum-variance schedule, checked against vLLM's own function where it is installed."""
    from engine.tools.what_if import rates_for, serve_lines, synthetic_config

    saved = json.loads((ROOT / "assets" / "scrapes" / "vllm-ngram-chat.json").read_text())
    window = analyze(saved["before"], saved["after"], saved["interval_s"], saved["pass_costs"])
    rates = rates_for(window["k"], rates=window["acceptance_by_position"])
    assert (
        len(rates) == 8
        and rates == sorted(rates, reverse=True)
        and abs(rates[0] - window["acceptance_by_position"][0]) < 1e-4
    )
    assert rates_for(4, tau=3.3) == pytest.approx([1.0, 1.0, 0.3, 0.0])
    assert rates_for(3, rates=[0.5]) == [0.5, 0.0, 0.0]
    config = synthetic_config(rates_for(4, tau=2.5))
    assert config["rejection_sample_method"] == "synthetic" and config["num_speculative_tokens"] == 4
    line = serve_lines("HuggingFaceTB/SmolLM2-135M-Instruct", rates_for(4, tau=2.5))["what_if"]
    assert json.loads(line.split("--speculative-config ", 1)[1].strip("'")) == config
    for bad, words in (
        ({"tau": 6.0}, "between 1 and K + 1"),
        ({"rates": [0.5, 0.7]}, "must not increase"),
        ({"rates": [1.2]}, "in [0, 1]"),
        ({"rates": [0.5], "tau": 2.0}, "not both"),
    ):
        with pytest.raises(AnalyzeError, match=re.escape(words)):
            rates_for(4, **bad)
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if vllm_python.is_file():  # vLLM's own τ → rates, in its own environment
        code = (
            "import json; from vllm.config.speculative import SpeculativeConfig as S; "
            "print(json.dumps([S._acceptance_length_to_rates(t, 4) for t in (1.0, 2.5, 3.3, 5.0)]))"
        )
        env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
        out = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        theirs = json.loads(out.stdout.strip().splitlines()[-1])
        for tau, rates in zip((1.0, 2.5, 3.3, 5.0), theirs):
            assert rates_for(4, tau=tau) == pytest.approx(rates)


def test_the_what_if_requests_take_the_windows_shape():
    from engine.tools.what_if import RUN, shaped_prompts, window_shape

    saved = json.loads((ROOT / "assets" / "scrapes" / "vllm-ngram-chat.json").read_text())
    shape = window_shape(saved["before"], saved["after"])
    after = {n: v for n, _, v in parse_prometheus(saved["after"])}
    before = {n: v for n, _, v in parse_prometheus(saved["before"])}
    count = after["vllm:request_prompt_tokens_count"] - before.get("vllm:request_prompt_tokens_count", 0)
    assert shape["requests"] == count > 0
    want = (after["vllm:request_prompt_tokens_sum"] - before.get("vllm:request_prompt_tokens_sum", 0)) / count
    assert shape["prompt_tokens"] == pytest.approx(want)
    prompts = shaped_prompts(shape["prompt_tokens"], 6)
    assert all(len(p) == max(RUN, round(shape["prompt_tokens"])) for p in prompts)
    assert len({tuple(p[:RUN]) for p in prompts}) == 6  # no shared prefix: no prefix-cache hit
    assert all(p[RUN : 2 * RUN] == p[:RUN] for p in prompts if len(p) >= 2 * RUN)  # the run repeats: n-gram matches
    with pytest.raises(AnalyzeError, match="histograms"):
        window_shape(_scrape(0, 0, 0, [0]), _scrape(50, 200, 100, [40, 30]))


def test_the_cli_what_if_says_what_is_wrong(tmp_path):
    saved = tmp_path / "window.json"
    saved.write_text((ROOT / "assets" / "scrapes" / "vllm-ngram-chat.json").read_text())
    run = [sys.executable, "-m", "engine", "analyze", str(saved), "--what-if"]
    for extra, words in (
        (["--tau", "12"], "between 1 and K + 1"),
        (["--what-if-url", "http://127.0.0.1:9"], "go together"),
        (["--what-if-batches", "1,x"], "--what-if-batches"),
        (["--what-if-url", "http://127.0.0.1:9", "--baseline-url", "http://127.0.0.1:9"], "cannot reach"),
    ):
        out = subprocess.run(run + extra, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 2 and words in out.stderr, (extra, out.stderr[-800:])


def test_the_ticket_sentence_names_k_per_load_band_the_gain_and_the_line_that_turns_it_on():
    """#41 item 5: one sentence to paste into a ticket (engine.tools.analyze.ticket), from the recorded windows of
    the real vLLM server: the K per band of batch sizes as the analyzer weighed them, the expected gain labelled
    as modelled, and launch-command's line for the server's engine and the model its counters name."""
    from engine.tools.analyze import ticket
    from engine.tools.launch import launch_command

    for workload in ("chat", "code-edit"):
        saved = json.loads((ROOT / "assets" / "scrapes" / f"vllm-ngram-{workload}.json").read_text())
        result = analyze(saved["before"], saved["after"], saved["interval_s"], saved["pass_costs"])
        assert result["model_name"] == "SmolLM2-135M-Instruct"
        sentence = ticket(result)
        best = result["best_k_by_batch"]
        low = min(best)
        for b, k in best.items():  # an off batch is named, or lies in an "off from B = c" band
            off = f"B = {b}" in sentence or any(f"off from B = {c}" in sentence for c in best if c <= b)
            assert (f"K = {k} at B = " in sentence) if k else off, sentence
        assert f"{result['speedup_by_batch'][low][best[low]]:.2f}× expected at batch {low} (modelled" in sentence
        line = launch_command("vllm", "ngram", k=best[low], target="SmolLM2-135M-Instruct")["command"]
        assert sentence.endswith(f"serve with: {line}") and "\n" not in sentence
    off = analyze(_scrape(0, 0, 0, [0, 0]), _scrape(50, 200, 20, [15, 5]), 30, _costs({1: 20, 4: 30}, {1: 60, 4: 90}))
    assert ticket(off).startswith("Turn speculation off on this vllm server") and "--speculative-config" not in ticket(
        off
    )
    measured = {"speedup": [1.31], "speedup_bounds": [(1.2, 1.4)], "batch_sizes": [1], "rates": [0.9, 0.8]}
    assert "measured by a what-if at K = 2: 1.31× (1.20–1.40 over its repeats) at batch 1" in ticket(
        json.loads(json.dumps(result)) | {"best_k_by_batch": best, "speedup_by_batch": result["speedup_by_batch"]},
        what_if=measured,
    )


# ------------------------------------------------------------------------------------------ per request


def test_per_request_metrics_read_as_a_distribution_in_both_schemas():
    """#41 item 3 (engine/tools/per_request.py): real responses of the real vLLM CPU server (dense histograms,
    scripts/record_per_request.py) and the earlier sparse variant (a format example, labelled) read alike; each
    request's τ comes from its own histogram and matches what vLLM reported; the spread says which requests pay."""
    from engine.tools.per_request import read_requests, request_distribution

    real = (ROOT / "assets" / "scrapes" / "vllm-ngram-requests.jsonl").read_text()
    readings = read_requests(real)
    assert len(readings) >= 10 and {r["schema"] for r in readings} == {"dense"}
    for line, reading in zip([json.loads(x) for x in real.splitlines() if x.strip()], readings):
        spec = line["metrics"]["speculative_decoding"]
        assert (
            reading["tau"] == pytest.approx(spec["mean_acceptance_length"])
            and reading["steps"] == spec["num_spec_steps"]
        )
        assert reading["accepted"] == spec["num_accepted_draft_tokens"]
    dist = request_distribution(readings, break_even=2.0)
    taus = sorted(r["tau"] for r in readings)
    assert dist["tau_quantiles"]["min"] == taus[0] and dist["tau_quantiles"]["max"] == taus[-1]
    assert dist["paying"] == sum(t > 2.0 for t in taus) and dist["paying"] + dist["not_paying"] == len(taus)
    steps = sum(r["steps"] for r in readings)
    assert dist["tau_step_mean"] == pytest.approx(1 + sum(r["accepted"] for r in readings) / steps)
    assert sum(dist["histogram"]) == steps
    # copying workloads keep more per pass than chat: which requests pay shows by workload
    assert dist["by_label"]["code-edit"]["tau_median"] > dist["by_label"]["chat"]["tau_median"]
    sparse = read_requests((ROOT / "assets" / "scrapes" / "vllm-per-request-sparse-format-example.jsonl").read_text())
    assert {r["schema"] for r in sparse} == {"sparse"} and len(sparse) == 6  # the note line has no metrics
    dense_again = [{"acceptance_histogram": r["histogram"], "num_spec_steps": r["steps"]} for r in sparse]
    assert [r["tau"] for r in read_requests("\n".join(map(json.dumps, dense_again)))] == [r["tau"] for r in sparse]


@pytest.mark.parametrize(
    "text, words",
    [
        ("not json", "line 1 is not JSON"),
        ('{"choices": []}', "none of the 1 records"),
        ('{"acceptance_histogram": [3, -1]}', "whole counts"),
        ('{"acceptance_histogram": {"x": 2}}', "keys are draft counts"),
        ('{"acceptance_histogram": [3, 1], "mean_acceptance_length": 2.0}', "disagrees with its histogram"),
        ('{"acceptance_histogram": [3, 1], "num_spec_steps": 5}', "is not its histogram's 4 steps"),
        ('{"data": {"metrics": {"speculative_decoding": {"num_spec_steps": 2}}}}', "no acceptance_histogram"),
    ],
)
def test_bad_per_request_records_get_clear_messages(text, words):
    from engine.tools.per_request import read_requests

    with pytest.raises(AnalyzeError, match=re.escape(words)):
        read_requests("\n" + text + "\n" if "line 1" not in words else text)


def test_the_cli_reads_per_request_records_with_and_without_a_window(tmp_path):
    requests = ROOT / "assets" / "scrapes" / "vllm-ngram-requests.jsonl"
    alone = subprocess.run(
        [sys.executable, "-m", "engine", "analyze", "--requests", str(requests), "--break-even", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert alone.returncode == 0, alone.stderr
    assert "per request (" in alone.stdout and "dense histograms" in alone.stdout and "requests pay" in alone.stdout
    window = ROOT / "assets" / "scrapes" / "vllm-ngram-code-edit.json"
    both = subprocess.run(
        [sys.executable, "-m", "engine", "analyze", str(window), "--requests", str(requests), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    result = json.loads(both.stdout)
    assert result["per_request"]["break_even"] >= 1.0  # from the window's pass costs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"acceptance_histogram": [1, 2]}\n[1\n')
    out = subprocess.run(
        [sys.executable, "-m", "engine", "analyze", "--requests", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "line 2 is not JSON" in out.stderr
    none = subprocess.run(
        [sys.executable, "-m", "engine", "analyze"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert none.returncode == 2 and "--requests" in none.stderr


def test_a_llamacpp_window_reads_as_vllms_schema():
    """#41 item 3: llama.cpp's counters (llamacpp:spec_decode_*, per position included; a format example written
    from its documented names, labelled) read like vLLM's; its tokens are its tokens_predicted, its requests are
    not counted, and the ticket's line is llama-server's."""
    saved = json.loads((ROOT / "assets" / "scrapes" / "llamacpp-format-example.json").read_text())
    assert "not measured" in saved["note"]
    from engine.tools.analyze import ticket

    result = analyze(saved["before"], saved["after"], 60, _costs({1: 20, 4: 30}, {1: 26, 4: 45}, k=8))
    assert result["server"] == "llamacpp" and result["k"] == 8 and result["requests"] == 0
    assert result["tokens"] == 11540 - 9900 and result["drafts"] == 240
    assert result["acceptance_by_position"][0] == pytest.approx((1080 - 900) / 240)
    assert "llama-server -m MODEL.gguf --spec-type ngram-simple" in ticket(result) and "typed pass costs" in ticket(
        result
    )


def _timed_scrape(requests, tokens, accepted, drafts, decode_s, e2e_s, steps, prompt_tokens) -> str:
    """A vLLM scrape with the per-request histograms the request model reads (their _sum and _count)."""
    per_pos = [accepted]  # K = 1: every accepted token at position 0
    text = _scrape(drafts, drafts, accepted, per_pos, requests=requests, tokens=tokens, decode_s=decode_s)
    return text + "\n".join(
        [
            f'vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="m"}} {e2e_s}',
            f'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} {requests}',
            f'vllm:request_prompt_tokens_sum{{engine="0",model_name="m"}} {prompt_tokens}',
            f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {steps}',
            f'vllm:iteration_tokens_total_sum{{engine="0",model_name="m"}} {steps * 3}',
        ]
    )


def test_a_window_with_request_times_is_weighed_as_whole_requests():
    """#41: a request spends time outside its decode passes (e2e − decode), the same with and without
    speculation, which dilutes the gain; where vLLM counts it the speedup is of whole requests. 8 requests of
    101 tokens, 4 at a time: 8 prefill rows and 400 decode passes over 102 steps is a load of 4; 500 ms each
    outside decode;
    the probe's plain requests wait 100 ms longer per concurrent request."""
    from engine.tools.analyze import predicted_speedup, read_window, window_counts

    before = _timed_scrape(0, 0, 0, 0, 0.0, 0.0, 0, 0)
    # 800 decode tokens: 400 accepted over 400 drafting passes (K = 1), so 400 passes, 2 tokens each
    after = _timed_scrape(8, 808, 400, 400, 8 * 50 * 0.05, 8 * (50 * 0.05 + 0.5), 102, 8 * 40)
    counts = window_counts(before, after)
    assert counts["requests"] == 8 and counts["per_position"] == [400] and counts["prompt_tokens"] == 320
    costs = {
        "k": 1,
        "decode_ms": {1: 40.0, 16: 100.0},
        "verify_ms": {1: 50.0, 16: 180.0},
        "baseline_decode_ms": {1: 38.0, 16: 90.0},
        "outside_ms": {1: 300.0, 16: 1800.0},
        "baseline_outside_ms": {1: 300.0, 16: 1800.0},
    }
    result = read_window(counts, None, costs)
    assert result == analyze(before, after, None, costs)  # the stored window reads as its scrapes
    assert result["concurrency"] == pytest.approx(4.0) and result["outside_ms"] == pytest.approx(500.0)
    assert result["tokens_per_request"] == pytest.approx(101.0) and result["model"] == "requests"
    assert result["outside_per_request_ms"] == pytest.approx(100.0)
    outside16 = 500.0 + (16 - 4) * 100.0
    assert result["pass_costs"]["outside_by_batch"][16] == pytest.approx(outside16)
    tpp = result["expected_tokens_per_pass"][1]
    pass16 = 100.0 + 16 * 1.0 * 1 * (180.0 - 100.0) / 16  # every pass drafted here: d = 1
    expected = (outside16 + 100 * 90.0) / (outside16 + 100 / tpp * pass16)
    assert result["speedup_by_batch"][16][1] == pytest.approx(expected)
    assert predicted_speedup(result, 16, 1, tpp) == pytest.approx(expected)
    # where it pays, decode passes alone promise more: at batch 1 a pass costs 40 + 10 ms, 200 ms outside
    assert result["speedup_by_batch"][1][1] == pytest.approx((200 + 100 * 38.0) / (200 + 100 / tpp * 50.0))
    assert 1 < result["speedup_by_batch"][1][1] < tpp * 38.0 / 50.0
    # the fixed part of a request's decode time that the probe took out of its passes is paid per request
    fixed = read_window(counts, None, {**costs, "overhead_ms": {"baseline": {"1": 150.0, "16": 150.0}}})
    assert fixed["pass_costs"]["outside_by_batch"][16] == pytest.approx(outside16 + 150.0)
    # without vLLM's per-request times (SpecLens, llama.cpp): decode passes only, and it says so
    bare = analyze(_scrape(0, 0, 0, [0]), _scrape(400, 400, 400, [400]), None, costs)
    assert bare["model"] == "decode passes"


def test_the_probe_separates_a_requests_fixed_decode_time():
    """engine/tools/pass_costs.py: a request's decode time = a fixed part + passes × ms per pass; requests of two
    lengths give both, and the fixed part is never negative nor more than the short request's time."""
    from engine.tools.pass_costs import _overhead_ms

    def total(requests, passes_each, ms_each):
        return {
            "requests": requests,
            "tokens": requests * (passes_each + 1),
            "accepted": 0,
            "decode_s": ms_each * requests / 1000,
        }

    assert _overhead_ms(total(3, 8, 300 + 8 * 45), total(3, 32, 300 + 32 * 45)) == pytest.approx(300.0)
    assert _overhead_ms(total(3, 8, 8 * 45), total(3, 32, 32 * 45)) == pytest.approx(0.0, abs=1e-9)
    assert _overhead_ms(total(3, 8, 100), total(3, 32, 5000)) == 0.0  # a steeper long case: none, not below 0
    assert _overhead_ms(total(3, 8, 400), total(3, 8, 400)) == 0.0  # one length cannot separate it


def test_a_stored_probe_reads_again_from_its_counters():
    """engine/tools/pass_costs.py ``costs_from_cases``: a probe's readings are a pure function of its cases'
    summed counters, so a stored grid is predicted from today's reading of the same requests. The second grid
    was recorded while the probe took the plain server's fixed decode time out of both servers' passes (a
    variant since dropped): read again, the plain server's figures are unchanged, the speculating server's
    fixed part is its own pair's (kept beside it when recorded) unless that would make its plain pass cheaper
    than the plain server's, and a batch size whose cases cannot show what
    drafting costs is dropped from every table by batch size, not from the list of cases."""
    from engine.tools.pass_costs import _drop_unclear, costs_from_cases

    stored = json.loads((ROOT / "docs" / "bench" / f"{GRID.stem}-plain-overhead-for-both.json").read_text())
    costs = stored["pass_costs"]
    again = costs_from_cases(costs)
    for name in ("baseline_decode_ms", "baseline_outside_ms", "verify_share", "decode_share"):
        assert again[name] == pytest.approx({int(b): v for b, v in costs[name].items()})
    own = {int(b): v for b, v in costs["speculative_own_overhead_ms"].items()}
    taken = again["overhead_ms"]["speculative"]
    for b, ms in own.items():  # its own pair's, or less where that would make its plain pass the cheaper one
        assert taken[b] == pytest.approx(ms) or (
            taken[b] < ms and again["decode_ms"][b] == pytest.approx(again["baseline_decode_ms"][b])
        )
    assert again["decode_ms"] != pytest.approx({int(b): v for b, v in costs["decode_ms"].items()})
    assert again["cases"] == costs["cases"]
    assert costs_from_cases({**costs, "cases": []}) == {**costs, "cases": []}  # nothing stored: as it was
    with pytest.raises(AnalyzeError, match="cases need"):
        costs_from_cases({**costs, "cases": [{"batch": 1}]})
    again["verify_share"][4] = again["decode_share"][4]  # batch 4 drafted as little as its plain case
    assert _drop_unclear(again, [1, 2, 4, 8, 16]) == [4]
    assert 4 not in again["verify_ms"] and 4 not in again["overhead_ms"]["baseline"]
    assert len(again["cases"]) == len(costs["cases"])


def test_a_speculating_servers_plain_pass_is_no_cheaper_than_a_plain_servers():
    """The probe's fixed decode time per request, from requests of two lengths, is noisy: in the fourth grid it
    read 535 ms at B = 2 on the speculating server (the plain server: 248), which left that server's plain pass
    at 18 ms against the plain server's 57 and the analyzer expecting 2.6x on chat where 1.2x was measured. The
    part taken out is capped so that a pass drafting on few passes costs at least the plain server's pass."""
    from engine.tools.pass_costs import _no_cheaper_than_plain, costs_from_cases
    from engine.tools.validate import predict_grid

    costs = costs_from_cases(json.loads(GRIDS[0].read_text())["pass_costs"])
    assert costs["decode_ms"][2] == pytest.approx(costs["baseline_decode_ms"][2])
    assert costs["overhead_ms"]["speculative"][2] < 535 and all(ms > 0 for ms in costs["decode_ms"].values())
    table = predict_grid(json.loads(GRIDS[0].read_text()))
    assert max(abs(r["error"]) for r in table["rows"]) < 0.6
    alone = {(2, "decode", 0): {"tokens": 30, "requests": 2, "accepted": 0, "decode_s": 1.0}}
    assert _no_cheaper_than_plain({2: 500.0}, {}, alone) == {2: 500.0}  # no plain server probed: as measured


GRID = ROOT / "docs" / "bench" / "2026-12-05-analyzer-grid-avx512bf16.json"
TABLES = ROOT / "docs" / "bench" / "2026-12-05-analyzer-validation-tables.md"  # docs/vllm.md links it
GRIDS = [  # every validation grid that note shows, newest first
    ROOT / "docs" / "bench" / "2026-12-05-analyzer-grid-4-avx512bf16.json",
    ROOT / "docs" / "bench" / "2026-12-05-analyzer-grid-3-avx512bf16.json",
    GRID,
    ROOT / "docs" / "bench" / "2026-12-05-analyzer-grid-avx512bf16-plain-overhead-for-both.json",
]


def test_the_validation_table_is_the_models_on_the_stored_grid():
    """#41: the tables of predicted against measured speedups (TABLES) are what the analyzer's model gives on
    the stored grids (scripts/validate_analyzer.py's JSON: every server's windows and the batches' throughput,
    the probe's counters read again as the probe reads them today), and the tab and the docs quote the same
    pooled median error: change the model and the tables must be recomputed."""
    from app.labs.deployment import TEXT
    from engine.tools.validate import grid_markdown, pooled_summary, predict_grid

    docs = (ROOT / "docs" / "vllm.md").read_text()
    shown = TABLES.read_text()
    tables = []
    for path in GRIDS:
        data = json.loads(path.read_text())
        table = predict_grid(data)
        assert table["summary"]["cells"] == len(data["settings"]["ks"]) * len(data["settings"]["sizes"]) * 2
        assert grid_markdown(table) in shown, path.name
        tables.append(table)
    pooled = pooled_summary(tables)
    words = f"within {pooled['median_abs_error']:.0%} of the measured ones (median over {pooled['cells']} cells"
    assert words in " ".join(TEXT.split()) and words in " ".join(docs.split())
