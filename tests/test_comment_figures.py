"""Comments and docstrings say what the code does and why; measurements live in dated notes under docs/bench/.

A figure with a unit of time, bandwidth or speedup ("17-19 ms", "1.43x", "62 GB/s") or a host's name ("EPYC",
"Xeon", "Zen 4") in a comment or docstring of engine/, app/ or visuals/ is a measurement that rots: this test
flags each one. The few that define a unit or a limit stand in ALLOWED with the reason. Strings the program
shows (a recorded figure with its machine and date, say) are not comments and are not read here.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("engine", "app", "visuals")
FIGURE = re.compile(
    r"[0-9]\.[0-9]+ ?[x×]([^0-9a-zA-Z_]|$)|[0-9] ?(ms|us|µs|GB/s)\b|EPYC|Zen 4|Xeon|AVX2 proxy", re.IGNORECASE
)
# (file, words of the line) -> why the figure belongs in the code.
ALLOWED: dict[tuple[str, str], str] = {}
MAX_MODULE_DOCSTRING_LINES = 40


def _python_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    first = body[0].lineno
                    found += [(first + i, line) for i, line in enumerate(body[0].value.value.splitlines())]
    return found


def _c_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every // and /* */ comment of a C source (string literals in our kernels hold no slashes)."""
    found = []
    for match in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
        first = text.count("\n", 0, match.start()) + 1
        found += [(first + i, line) for i, line in enumerate(match.group(0).splitlines())]
    return found


def comment_figures(root: Path = ROOT) -> list[str]:
    """ "path:line: text" of each comment or docstring line with a figure, less the allowed ones."""
    flagged = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*")):
            if path.suffix == ".py":
                lines = _python_comments(path.read_text())
            elif path.suffix in (".c", ".h"):
                lines = _c_comments(path.read_text())
            else:
                continue
            name = str(path.relative_to(root))
            for number, line in lines:
                if FIGURE.search(line) and not any(f == name and words in line for f, words in ALLOWED):
                    flagged.append(f"{name}:{number}: {line.strip()}")
    return flagged


def test_no_measurement_in_comments_or_docstrings():
    flagged = comment_figures()
    assert not flagged, "measurements belong in a dated note under docs/bench/:\n" + "\n".join(flagged)


def test_the_check_flags_a_planted_figure(tmp_path):
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "engine" / "planted.py").write_text(
        '"""A module."""\n\nX = 1  # a pass costs 17-19 ms on a 2-core EPYC\n\n\ndef f():\n    """1.43x faster."""\n'
    )
    (tmp_path / "engine" / "planted.c").write_text("int x; /* read at 62 GB/s */\n// plain words\n")
    flagged = comment_figures(tmp_path)
    assert [line.split(": ", 1)[0] for line in flagged] == [
        "engine/planted.c:1",
        "engine/planted.py:3",
        "engine/planted.py:7",
    ], flagged


@pytest.mark.parametrize("layer", LAYERS)
def test_module_docstrings_stay_short(layer):
    long = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (say what the module is for):\n" + (
        "\n".join(long)
    )


def test_no_docstring_states_its_own_size():
    """A module's size in its own docstring ("~620 lines") is wrong after the next change."""
    stale = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            if re.search(r"~?\d[\d,]* lines\b", doc):
                stale.append(str(path.relative_to(ROOT)))
    assert not stale, stale
