"""The benchmark harness in --quick mode on the real default model: every system and workload is
reported (or said to be unavailable), the JSON has the documented shape, and the greedy outputs of
all engine systems agree. Speed targets are the benchmark's business, not a timed test's: a measured figure
is checked to be there, positive and computed from the report's own timings, never against a host's speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tools.bench import ENGINE_SYSTEMS, SYSTEMS, format_table, run_bench

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = {
    "system",
    "workload",
    "tok_per_s",
    "tokens_per_pass",
    "acceptance_rate",
    "speedup_vs_engine_baseline",
    "speedup_vs_hf_generate",
}


@pytest.mark.slow
def test_quick_bench_reports_every_system_and_workload(served_engine):
    report = run_bench(served_engine, quick=True, progress=False)
    report = json.loads(json.dumps(report))  # plain JSON all the way down
    workloads = set(json.loads((ROOT / "assets" / "workloads.json").read_text()))
    assert {"chat", "code-edit", "summarize"} <= workloads
    rows = {(r["system"], r["workload"]): r for r in report["rows"]}
    for system in SYSTEMS:
        unavailable = [n for n in report["notes"] if n.startswith(system + ":")]
        if unavailable:  # optional reference points say why they are missing
            assert not any(s == system for s, _ in rows), system
            continue
        assert system not in ("engine-baseline", "hf-generate") or not unavailable
        for workload in workloads:
            row = rows[(system, workload)]
            assert ROW_KEYS <= set(row), row
            assert row["tok_per_s"] > 0
    # Every engine row runs on the default target: its EAGLE head ships in assets/heads.
    noted = {n.split(":", 1)[0] for n in report["notes"]}
    assert not noted & set(ENGINE_SYSTEMS), report["notes"]
    for workload in workloads:  # drafting time per drafted token, in plain target passes (c): this host's figure
        base_pass_ms = rows[("engine-baseline", workload)]["pass_ms"]
        assert 0 < base_pass_ms < math.inf
        for system in ("engine-int8", "engine-q4", "engine-eagle"):
            row = rows[(system, workload)]
            assert 0 < row["draft_cost"] < math.inf, row
            assert row["draft_cost"] == pytest.approx(row["draft_ms_per_token"] / base_pass_ms), row
    for system in [s for s in ENGINE_SYSTEMS if s not in noted] + ["hf-generate", "hf-prompt-lookup"]:
        assert all((system, w) in rows for w in workloads), system
    for (system, _), row in rows.items():
        if system in ENGINE_SYSTEMS:
            assert row["tokens_per_pass"] >= 1.0
    for workload in workloads:  # today's float32 path on torch's ops, measured in the same run
        assert rows[("engine-torch-float32", workload)]["roofline_fraction"] > 0
    assert rows[("engine-baseline", "chat")]["speedup_vs_engine_baseline"] == pytest.approx(1.0)
    assert rows[("hf-generate", "chat")]["speedup_vs_hf_generate"] == pytest.approx(1.0)
    engine_mismatches = [m for m in report["greedy_mismatches"] if m["system"] in ENGINE_SYSTEMS]
    assert not engine_mismatches, f"engine systems disagree in greedy decoding: {engine_mismatches}"
    machine = report["machine"]
    for key in ("cpu", "threads", "dtype", "weights", "torch", "transformers", "copy_bandwidth_gbs"):
        assert machine[key], key
    assert machine["roofline_passes_per_s"] > 0 and "cpu_kernel" in machine and "cpu_flags" in machine
    assert machine["copy_bandwidth_gbs_after"] > 0  # measured again after the runs: the drift during them
    assert f"copy {machine['copy_bandwidth_gbs_after']:.1f} GB/s after the runs" in format_table(report)
    events = report["event_overhead"]
    assert set(events["tok_per_s"]) == {"off", "reduced", "full"}
    costs = report["pass_cost_ms"]
    assert set(costs) >= {"1", "5", "9"} and all(ms > 0 for ms in costs.values())
    rules = report["verify_rules"]
    assert rules["system"] == "engine-int8" and set(rules["by_temperature"]) == {"0.7", "1.0"}
    for r in rules["by_temperature"].values():  # a model drafter at T > 0 on chat: block passes were verified
        assert r["passes"] > 0 and r["token_tokens_per_pass"] >= 1.0 and r["block_tokens_per_pass"] >= 1.0
    table = format_table(report)
    assert "engine-ngram" in table and "roofline" in table and "event stream" in table
    assert "acceptance rules on the same drafts" in table


def test_bench_cli_rejects_bad_arguments_before_loading_anything():
    for args in (["--systems", "engine-warp"], ["--repeats", "0"], ["--max-new-tokens", "0"]):
        proc = subprocess.run(
            [sys.executable, "-m", "engine", "bench", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith("error:"), proc.stderr
