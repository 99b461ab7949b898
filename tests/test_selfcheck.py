"""``python -m engine selfcheck``: what its report must hold (the command runs once end to end, on the real default
model, in the clean Space build: tests/test_space_build.py), and its refusals of bad arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tools.exactness import TEST_LEVEL
from engine.tools.selfcheck import EXACTNESS, PARITY, format_report

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, timeout=600):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "engine", "selfcheck", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_selfcheck_report(result: dict, stderr: str) -> None:
    """What `python -m engine selfcheck --json` must report: both checks passed with every case and figure, the
    same as its text report prints them, and its progress lines on stderr. The command itself runs once, in
    the clean Space build (tests/test_space_build.py), where it has requirements.txt alone."""
    assert result["passed"] is True and result["target"] == "SmolLM2-135M-Instruct"
    for key in ("seconds", "load_seconds", "int8_build_seconds", "check_seconds"):
        assert result[key] >= 0.0, key
    parity, exact = result["checks"]
    assert [parity["name"], exact["name"]] == ["greedy parity", "exact sampling"]

    # 1. Greedy parity: each drafter on each prompt, token for token, and the int8 drafts were accepted.
    assert parity["passed"] is True
    cases = {(c["drafter"], c["prompt"]) for c in parity["cases"]}
    assert cases == {(d, p) for d in PARITY["drafters"] for p in PARITY["prompts"]}
    for case in parity["cases"]:
        assert case["passed"] and (case["identical"] or case["strict_identical"]), case
        assert case["tokens"] > 0
    assert parity["int8_tokens_per_pass"] > 1.0

    # 2. The exact rule consistent with p, the control that ignores q detected, at the same n.
    assert exact["passed"] is True and exact["level"] == TEST_LEVEL
    for kind in ("exact", "control"):
        test = exact[kind]
        assert test["n"] == EXACTNESS["n_samples"] and test["outside"] == 0
        assert test["df"] >= 1 and test["statistic"] is not None and 0.0 <= test["tv"] <= 1.0
    assert exact["exact"]["pvalue"] >= TEST_LEVEL, exact["exact"]
    assert exact["control"]["pvalue"] < TEST_LEVEL, exact["control"]
    assert exact["exact"]["verdict"] == "consistent with p"
    assert exact["control"]["verdict"] == "differs from p: the shortcut is lossy"

    # The same result as the text report prints it: one PASS line per check, then the time.
    lines = format_report(result).splitlines()
    assert lines[0].startswith("PASS greedy parity: ")
    assert lines[1].startswith("PASS exact sampling")
    assert lines[-1].startswith("selfcheck passed in ")
    assert "selfcheck: " in stderr  # the stages' progress lines


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", "-1"], "--seed must be between 0 and 2**63 - 1"),
        (["--seed", "x"], "invalid int value"),
        (["--dtype", "float64"], "invalid choice"),
    ],
)
def test_selfcheck_bad_arguments_exit_2_with_one_line(args, message):
    out = _cli(*args, timeout=120)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], out.stderr
