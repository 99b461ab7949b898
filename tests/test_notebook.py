"""The course material runs as written: docs/tour.ipynb top to bottom in a real Jupyter kernel (nbclient), and
README's Python API block, each on the real default model.

The notebook is kept in the repository with its outputs cleared (a test), and run here with a small token
budget (its TOUR_MAX_NEW_TOKENS and TOUR_SAMPLES variables); how long it took is printed, not bounded.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOUR = ROOT / "docs" / "tour.ipynb"


def test_the_notebook_is_kept_without_outputs():
    import nbformat

    nb = nbformat.read(TOUR, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "the tour has no code"
    for cell in code:
        assert not cell.outputs and cell.execution_count is None, cell.source[:80]


@pytest.mark.slow
@pytest.mark.real_model
def test_the_tour_runs_top_to_bottom_in_a_kernel(monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("TOUR_MAX_NEW_TOKENS", "48")
    monkeypatch.setenv("TOUR_SAMPLES", "400")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(TOUR, as_version=4)
    started = time.perf_counter()
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(TOUR.parent)}}
    ).execute()
    seconds = time.perf_counter() - started
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    titles = [f["data"]["application/vnd.plotly.v1+json"]["layout"].get("title", {}).get("text", "") for f in figures]
    assert len(figures) == 3 and all(titles), titles  # the tree, p vs q, tokens per pass
    passes = re.search(r"(\d+) tokens in (\d+) target passes: ([\d.]+) tokens per pass", text)
    assert passes and int(passes.group(1)) <= 48 and float(passes.group(3)) >= 1.0, text
    assert re.search(r"q4 against the baseline: [\d.]+x \(interval", text), text
    assert re.search(r"exact rule: chi-square p-value .* -> consistent with p", text), text
    assert re.search(r"ignores q \(broken\): chi-square p-value .* -> differs from p", text), text
    print(f"\n[tour] docs/tour.ipynb top to bottom in a kernel: {seconds:.0f} s")


def _readme_python_api() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
@pytest.mark.real_model
def test_the_readme_python_api_block_runs_as_written(tmp_path):
    """The block, unchanged, in a fresh interpreter from a scratch folder (it saves run.json there), with the
    repository on the path as a clone has it; then its results are read back."""
    code = _readme_python_api()
    script = tmp_path / "snippet.py"
    script.write_text(
        code
        + "\nimport json\n"
        + "print(json.dumps({'text': run['text'], 'samples': len(samples), 'p': float(p.sum()),"
        + " 'block': block['metrics']['tokens_per_pass'], 'q4': q4['metrics']['tokens_per_pass']}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["text"] and result["samples"] > 0 and result["p"] == pytest.approx(1.0, abs=1e-4)
    assert result["block"] >= 1.0 and result["q4"] >= 1.0
    assert (tmp_path / "run.json").is_file()
