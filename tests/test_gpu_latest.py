"""The prepared device run (scripts/gpu_check.sh and the figures it writes, scripts/gpu_latest.py), run here
for real in its --dry-run form on the CPU: the device's few minutes are not spent discovering a broken script.

Both tests run the shell script end to end in a subprocess, on the default model, with no mock: the whole
dry run (every step's CPU-capable part), and a run killed right after its first figure, which must leave a
valid partial JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from engine.host import cpu_name

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _gpu_latest():
    spec = importlib.util.spec_from_file_location("gpu_latest", ROOT / "scripts" / "gpu_latest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dry_run(out: Path, timeout: int, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK", "GPU_LATEST", "GPU_TRAIN"))}
    environ.update(OUT=str(out), HF_HUB_OFFLINE="1", GPU_CHECK_BUDGET_S="400", **env)
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout
    )


def _heads_state() -> dict:
    return {str(p): p.stat().st_mtime_ns for p in sorted((ROOT / "assets" / "heads").rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.real_model
def test_the_dry_run_runs_every_step_on_the_cpu_and_writes_every_required_figure(tmp_path):
    script = _gpu_latest()
    heads_before = _heads_state()
    done = _dry_run(tmp_path, timeout=560)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    saved = json.loads((tmp_path / "gpu-latest.json").read_text())
    assert saved["complete"] is True and saved["failed"] == []
    assert set(script.REQUIRED) <= set(saved), set(script.REQUIRED) - set(saved)
    for key in script.REQUIRED:  # a CPU value, or None with the reason
        assert saved[key] is not None or saved["reasons"].get(key), key
    assert saved["launches_per_pass"] is None and "CUDA only" in saved["reasons"]["launches_per_pass"]
    for key in ("pass_ms_1", "pass_ms_16", "eager_pass_ms_1", "baseline_tok_s", "ngram_code_edit_speedup"):
        assert saved[key] > 0, key
    assert saved["eagle_chat_speedup"] > 0 and saved["eagle_heldout_tokens_per_pass"] >= 1
    assert saved["pass_path"] == "static"  # no GPU: the fixed-shape function, uncaptured
    # (a) on the CPU: the static strict runs give the eager strict runs' tokens.
    static = saved["parity_static"]
    assert static["ok"] and static["runs"] and all(r["identical"] for r in static["runs"])
    assert {(r["pass_path"], r["reference_path"]) for r in static["runs"]} == {("static", "eager")}
    # (b) speculative against plain greedy: identical, or a divergence with its margin and a verdict.
    spec = saved["parity_speculative"]
    assert spec["ok"] and spec["bugs"] == 0 and len(spec["runs"]) == 4
    for row in spec["runs"]:
        assert row["identical"] or row["divergence"]["verdict"].startswith("numerics"), row
    chi = saved["chi_square"]
    assert chi["ok"] and chi["n"] > 0 and (chi["pvalue"] is None or 0 <= chi["pvalue"] <= 1)
    assert set(saved["targets"]) == set(script.TARGETS)
    # The device line and where the head trained come from engine.host, not from a fixed text.
    assert cpu_name() in saved["device"] and saved["host"]["cpu"] == cpu_name()
    training = saved["head_training"]
    assert training["rc"] == 0 and cpu_name() in training["device"]
    assert (tmp_path / "head" / "eagle-head.safetensors").exists()
    assert _heads_state() == heads_before  # the dry run trains into $OUT, never over the shipped head
    markdown = (tmp_path / "gpu-latest.md").read_text()
    assert "| pass_ms_1 |" in markdown and "Trained in this run on" in markdown
    assert "CUDA only" in log and "all steps passed" in log
    # The order: every figure before the head training.
    assert log.index("figures: rc=0") < log.index("train-head (limit")


@pytest.mark.slow
@pytest.mark.real_model
def test_a_run_killed_after_its_first_figure_leaves_a_valid_partial_json(tmp_path):
    script = _gpu_latest()
    done = _dry_run(tmp_path, timeout=300, GPU_CHECK_ONLY="figures", GPU_LATEST_STOP_AFTER="1")
    log = done.stdout + done.stderr
    assert done.returncode == 1, log[-4000:]  # the killed figures step failed the check
    assert "killing this process" in log and "figures: rc=137" in log
    saved = json.loads((tmp_path / "gpu-latest.json").read_text())
    assert saved["complete"] is False
    assert set(script.REQUIRED) <= set(saved)
    assert saved["pass_ms_1"] > 0 and saved["pass_ms_16"] > 0 and saved["eager_pass_ms_1"] > 0  # the first figure
    assert saved["baseline_tok_s"] is None and saved["parity_static"] is None  # never reached
    assert list(saved["seconds_by_figure"]) == ["pass times"]
    assert not list(tmp_path.glob(".*.tmp"))  # written by rename: no half-written file left
    assert "Partial" in (tmp_path / "gpu-latest.md").read_text()
