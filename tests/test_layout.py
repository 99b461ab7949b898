"""The house's rules, checked on the source: engine/'s rooms, who may import whom, no import circles,
and every environment variable read in one place.

Imports are read with ``ast`` (module-level and inside functions alike), so a lazy import that closes
a circle counts as much as a top-level one.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"

# The top level is the one-token path in reading order; everything else lives in a room.
TOP_LEVEL = {
    "__init__",
    "__main__",
    "settings",
    "config",
    "paths",
    "decode",
    "run_state",
    "prompts",
    "sampling",
    "acceptance",
    "verification",
    "events",
    "trace",
    "metrics",
    "host",
    "cli",
}
ROOMS = {"drafters", "model", "kernels", "vllm", "training", "tools"}
# Leaves: they import nothing of the engine (but each other), so any room may use them.
LEAVES = ("engine.paths", "engine.config", "engine.host")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every engine module this file imports (`from engine.x import y` also counts engine.x.y when
    that is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("engine")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
            assert node.level == 0, f"{path}: relative import (engine uses absolute imports)"
            found.add(node.module)
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if (ROOT / sub.replace(".", "/")).with_suffix(".py").is_file() or (
                    ROOT / sub.replace(".", "/") / "__init__.py"
                ).is_file():
                    found.add(sub)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) - {_module(p)} for p in ENGINE.rglob("*.py")}


def test_engine_top_level_is_the_one_token_path_and_rooms():
    files = {p.stem for p in ENGINE.glob("*.py")}
    assert files == TOP_LEVEL, files ^ TOP_LEVEL
    rooms = {p.name for p in ENGINE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert rooms == ROOMS


def test_no_import_circles():
    graph = _graph()
    # A package's __init__ re-exporting its modules is not a circle of code: drop the package -> member edge.
    edges = {m: {d for d in deps if d in graph and not d.startswith(m + ".")} for m, deps in graph.items()}
    seen: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for dep in edges[node]:
            if seen.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join([*stack[stack.index(dep) :], dep]))
            if dep not in seen:
                visit(dep, [*stack, dep])
        seen[node] = 2

    for module in sorted(edges):
        if module not in seen:
            visit(module, [module])


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOMS) else "top"


def test_who_imports_whom():
    graph = _graph()
    for leaf in LEAVES:
        assert graph[leaf] <= set(LEAVES) | {"engine"}, (leaf, graph[leaf])
    for module, deps in graph.items():
        room = _room(module)
        for dep in deps:
            if dep == "engine":
                continue
            dep_room = _room(dep)
            if room == "kernels":
                # The kernels are a leaf room: the leaves, plus the rule's constant (Q_FLOOR) the batched
                # verifier mirrors.
                assert dep_room == "kernels" or dep in (*LEAVES, "engine.acceptance"), (
                    module,
                    dep,
                )
            if room == "vllm":
                assert dep_room == "vllm" or dep in (*LEAVES, "engine.events", "engine.trace", "engine.metrics"), (
                    module,
                    dep,
                )
            if dep_room in ("tools", "training"):
                assert room == dep_room or module == "engine.cli" or room in ("tools", "training"), (module, dep)


def test_the_model_room_imports_neither_the_drafters_nor_the_loop():
    """engine/model/ runs passes over what it is handed (plain lists, a cache, a runner) and returns what it
    measured: none of its modules imports engine.drafters or engine.decode (TYPE_CHECKING imports included),
    so the loop's state and the drafters' types stay theirs."""
    for module, deps in _graph().items():
        if _room(module) == "model":
            bad = {d for d in deps if d in ("engine.decode", "engine.drafters") or d.startswith("engine.drafters.")}
            assert not bad, (module, sorted(bad))


def test_engine_imports_no_ui_and_visuals_no_torch():
    ui = re.compile(r"^\s*(import|from)\s+(gradio|plotly)\b", re.M)
    for path in ENGINE.rglob("*.py"):
        assert not ui.search(path.read_text(encoding="utf-8")), path
    heavy = re.compile(r"^\s*(import|from)\s+(torch|transformers|gradio)\b", re.M)
    for path in (ROOT / "visuals").rglob("*.py"):
        assert not heavy.search(path.read_text(encoding="utf-8")), path


def test_environment_read_in_one_place():
    """The engine reads its environment in engine/config.py only; the app in app/config.py only; and
    docs/configuration.md lists every variable either declares."""
    reads = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[^\]]+\](?!\s*=)")
    for folder, allowed in ((ENGINE, ENGINE / "config.py"), (ROOT / "app", ROOT / "app" / "config.py")):
        for path in folder.rglob("*.py"):
            if path != allowed:
                assert not reads.search(path.read_text(encoding="utf-8")), f"{path} reads the environment"
    from engine.config import VARIABLES

    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    app_vars = set(re.findall(r"\b(?:SPECLENS|GRADIO)_[A-Z_]+", (ROOT / "app" / "config.py").read_text()))
    for name in set(VARIABLES) | app_vars:
        assert f"`{name}`" in doc, f"docs/configuration.md does not document {name}"


def test_cpuinfo_read_only_in_host():
    for path in ENGINE.rglob("*.py"):
        if path.name != "host.py":
            assert '/proc/cpuinfo")' not in path.read_text(encoding="utf-8"), path


def test_the_vllm_backend_imports_no_triton():
    """A client of a vLLM server runs none of our kernels: importing engine.vllm and engine.vllm.backend (in a
    fresh process) loads neither triton nor the batched verifier (directly or through engine.verification)."""
    code = "import json, sys, engine.vllm, engine.vllm.backend; print(json.dumps(list(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    # The engine's modules in the order they finished loading: the chain that led there ends the list, innermost first.
    chain = "engine modules loaded: " + ", ".join(m for m in loaded if m.split(".")[0] == "engine")
    assert "triton" not in loaded, chain
    assert "engine.kernels.batched_verifier" not in loaded, chain


LAB_SHARED = {"panels", "durations", "last_run"}  # app/labs/ modules every lab may use
MAX_APP_FILE_LINES = 600


def test_no_lab_imports_another_lab():
    """A lab is one module; what two labs share lives in panels, durations or last_run."""
    labs = ROOT / "app" / "labs"
    names = {path.stem for path in labs.glob("*.py")} - {"__init__"} - LAB_SHARED
    for name in sorted(names):
        tree = ast.parse((labs / f"{name}.py").read_text(encoding="utf-8"))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module} if node.module else {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("app.labs."):
                imported.add(node.module.split(".")[2])
        assert not imported & (names - {name}), (name, sorted(imported & names))


def test_no_app_file_is_too_big_to_hold_in_ones_head():
    big = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "app").rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_APP_FILE_LINES
    }
    assert not big, big


MAX_FILE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 800, 300, 80
KERNELS = {"_verify_kernel"}  # engine/kernels/batched_verifier.py: a Triton kernel is one launch


def _sources():
    for folder in ("engine", "app", "visuals"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT), path.read_text(encoding="utf-8")


def test_no_file_class_or_function_is_too_big_to_hold_in_ones_head():
    """Files of at most 800 lines, classes of at most 300 and functions of at most 80 in engine/, app/ and
    visuals/ (the Triton kernel aside; the C sources are not Python)."""
    big = []
    for name, text in _sources():
        if len(text.splitlines()) > MAX_FILE_LINES:
            big.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            lines = (getattr(node, "end_lineno", 0) or 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                big.append(f"{name}:{node.lineno} class {node.name} ({lines} lines)")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                if node.name not in KERNELS:
                    big.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert not big, big


def test_no_drafter_class_is_named_outside_the_drafters_room():
    """Everything outside engine/drafters/ reaches a drafter through its spec, its family and the Drafter
    interface: no isinstance on, import of or call to a particular drafter class."""
    named = []
    classes = {
        node.name
        for path in (ROOT / "engine" / "drafters").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
        and node.name.endswith("Drafter")
        and node.name not in ("Drafter", "NoDrafter")
    }
    for name, text in _sources():
        if name.parts[:2] == ("engine", "drafters"):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Name) and node.id in classes:
                named.append(f"{name}:{node.lineno} {node.id}")
            elif isinstance(node, ast.alias) and node.name in classes:
                named.append(f"{name} imports {node.name}")
    assert not named, named
