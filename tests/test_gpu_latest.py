"""scripts/gpu_latest.py, the figures the prepared device run writes, run here on the CPU in its quick form:
the device's minutes are not spent discovering a broken script."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.real_model
def test_the_gpu_figures_script_runs_and_writes_every_figure(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_latest", ROOT / "scripts" / "gpu_latest.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    report = script.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu-latest.json").read_text())
    assert saved == json.loads(json.dumps(report))
    for key in ("device", "date", "pass_ms_1", "pass_ms_16", "eager_pass_ms_1", "baseline_tok_s"):
        assert saved[key], key
    for key in ("ngram_code_edit_speedup", "eagle_chat_speedup", "eagle_heldout_tokens_per_pass"):
        assert saved[key] > 0, key
    assert saved["pass_path"] == "static"  # no GPU here: the fixed-shape function, uncaptured
    assert saved["graph_parity"] and all(r["identical"] and r["pass_path"] == "static" for r in saved["graph_parity"])
    assert set(saved["targets"]) == set(script.TARGETS)
    assert "| pass_ms_1 |" in (tmp_path / "gpu-latest.md").read_text()
