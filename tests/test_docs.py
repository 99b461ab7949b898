"""Docs that cannot drift: the event schema, the architecture map and every path the docs name, held to the code.

* docs/events.md documents each record of an event in a table (first column: the keys, in backticks) under
  a heading whose first backticked token names the record: `start`, `start.settings`, `step.nodes[]` (each
  item of a step's `nodes` list), ... `vllm:<record>` tables hold what a vLLM trace adds. The tables must
  name every key that real runs of the tiny engine and the recorded traces in assets/traces/ have, and
  every key they name must be one those runs have (vLLM's: a string in the modules that write its events).
* docs/architecture.md's map (its first code block) names every module of engine/, visuals/ and app/, and
  every file and folder it names exists; so does README.md's layout block (the code block under "Project layout").
* Every repository path named in docs/*.md, docs/bench/README.md and README.md exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine import trace

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# ---------------------------------------------------------------------------------------------------------
# docs/events.md

RECORD = re.compile(r"^(vllm:)?(start|step|finish)(\.\w+(\[\])?)*$")
KEY = re.compile(r"^[a-z_][a-z0-9_]*$")
# The modules that write a vLLM run's events: the start event (backend), the steps and the finish (steps).
VLLM_EVENT_WRITERS = [ROOT / "engine" / "vllm" / "backend.py", ROOT / "engine" / "vllm" / "steps.py"]
# Documented keys that no run here can produce, and why.
ELSEWHERE = {("start.host", "gpu"): "CUDA runs only"}
# The tiny engine's runs, chosen to produce every key: sampled tree drafting that adapts (start.adaptive,
# draft.why, q_top, u), an n-gram draft of the prompt's own continuation, which the random target all but
# certainly rejects (p ≈ 1e-6: residual_top), a greedy int8 run cut at one token (dropped, truncated), and a
# sampled int8 chain by block verification (nodes' joint), and drafts of drafts (draft.copied).
PROMPT = "a b c d a b c d a b"
RUNS = [
    ("int8", dict(k=3, topk=2, temperature=1.0, seed=0, adaptive=True, max_new_tokens=12)),
    ("ngram", dict(temperature=1.0, seed=0, chat=False, max_new_tokens=4)),
    ("int8", dict(seed=0, chat=False, max_new_tokens=1)),
    ("none", dict(payload="reduced", max_new_tokens=2)),
    ("int8", dict(k=3, temperature=1.0, seed=0, verify="block", max_new_tokens=6)),
    ("int8+ngram", dict(k=3, temperature=1.0, seed=0, chat=False, max_new_tokens=6)),
    ("ngram/int8", dict(k=3, temperature=1.0, seed=0, chat=False, max_new_tokens=6)),
]


def documented_records(text: str) -> dict[str, set[str]]:
    """{record: the keys its table names}, read from events.md's headings and tables."""
    records: dict[str, set[str]] = {}
    record = None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("#"):
            names = re.findall(r"`([^`]+)`", line)
            record = names[0] if names and RECORD.match(names[0]) else None
            continue
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| key |"):
            continue
        assert record is not None, f"events.md:{number}: a table row under a heading that names no record"
        keys = re.findall(r"`([^`]+)`", line.split("|")[1])
        assert keys and all(KEY.match(k) for k in keys), f"events.md:{number}: the first cell names no keys: {line}"
        records.setdefault(record, set()).update(keys)
    return records


def event_keys(events: list[dict], into: dict[str, set[str]]) -> dict[str, set[str]]:
    """{record: keys}: every dict in the events, at its path (lists add "[]")."""

    def walk(value, path: str) -> None:
        if isinstance(value, dict):
            into.setdefault(path, set()).update(value)
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, list):
            for item in value:
                walk(item, f"{path}[]")

    for event in events:
        walk(event, event["type"])
    return into


@pytest.fixture(scope="module")
def run_keys(tiny_engine) -> dict[str, set[str]]:
    keys: dict[str, set[str]] = {}
    for drafter, settings in RUNS:
        events = tiny_engine.run(PROMPT, drafter, **settings)["events"]
        event_keys(trace.loads(trace.dumps(events)), keys)  # through the validator, as a saved trace
    return keys


def recorded_keys() -> dict[str, set[str]]:
    keys: dict[str, set[str]] = {}
    paths = sorted((ROOT / "assets" / "traces").rglob("*.json"))
    assert paths, "no recorded traces in assets/traces"
    for path in paths:
        event_keys(trace.load(path), keys)
    return keys


def test_events_md_names_every_key_of_real_events_and_only_those(run_keys):
    documented = documented_records((DOCS / "events.md").read_text(encoding="utf-8"))
    ours = {record: keys for record, keys in documented.items() if not record.startswith("vllm:")}
    seen = {record: set(keys) for record, keys in run_keys.items()}
    for record, keys in recorded_keys().items():
        seen.setdefault(record, set()).update(keys)
    undocumented = {r: sorted(k - ours.get(r, set())) for r, k in seen.items() if k - ours.get(r, set())}
    assert not undocumented, f"keys events.md does not name: {undocumented}"
    unreal = {
        r: sorted(extra)
        for r, k in ours.items()
        if (extra := {key for key in k - run_keys.get(r, set()) if (r, key) not in ELSEWHERE})
    }
    assert not unreal, f"keys events.md names that no run has: {unreal}"


def test_events_md_vllm_keys_are_the_backends():
    documented = documented_records((DOCS / "events.md").read_text(encoding="utf-8"))
    vllm = {record: keys for record, keys in documented.items() if record.startswith("vllm:")}
    assert vllm, "events.md has no vllm: tables"
    strings = {
        node.value
        for path in VLLM_EVENT_WRITERS
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    missing = {record: sorted(keys - strings) for record, keys in vllm.items() if keys - strings}
    assert not missing, f"vLLM keys events.md names that engine/vllm/backend.py and steps.py never write: {missing}"


def test_the_record_parser_reads_what_the_convention_says():
    text = (
        "## `step` (one pass)\n| key | meaning |\n|---|---|\n| `a`, `b` | the `c` value |\n### `step.kv`\n| `d` | x |\n"
    )
    assert documented_records(text) == {"step": {"a", "b"}, "step.kv": {"d"}}
    with pytest.raises(AssertionError, match="names no record"):
        documented_records("## Prose\n| `a` | x |\n")
    with pytest.raises(AssertionError, match="names no keys"):
        documented_records('## `start`\n| `"start"` | x |\n')


# ---------------------------------------------------------------------------------------------------------
# docs/architecture.md

TOP = {entry.name for entry in ROOT.iterdir()}
FILE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:py|md|json|sh))\b")
FOLDER = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+)(?![\w.-])")


def map_names(block: str) -> set[str]:
    """Repository paths the map names. A line at indent 0 whose first token is a folder opens it (engine/); one
    at indent 2 whose first token is a folder opens a room in it (drafters/), up to the next line at indent 2 or
    less. A name resolves from the repository root when its first part is a root entry (docs/, app.py), else
    from the open room or folder."""
    names: set[str] = set()
    top = room = ""
    for line in block.splitlines():
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        first, _, rest = stripped.partition(" ")
        opens = first.endswith("/") and indent in (0, 2)
        if indent == 0 and opens:
            top, room = first, ""
        elif indent == 2:
            room = first if opens else ""
        if opens:
            names.add((top + room).rstrip("/"))
        else:
            rest = line
        for match in [*FILE.finditer(rest), *FOLDER.finditer(rest)]:
            name = match.group(1)
            base = "" if name.split("/")[0] in TOP else top + room
            names.add((base + name).rstrip("/"))
    return names


def test_the_map_resolver_reads_rooms_and_root_names():
    block = "engine/   x\n  cli.py  (docs/cli.md)\n  tools/  bench.py\n    race.py\napp/  app.py\n  tabs/api.py\n"
    assert map_names(block) == {
        "engine",
        "engine/cli.py",
        "docs/cli.md",
        "engine/tools",
        "engine/tools/bench.py",
        "engine/tools/race.py",
        "app",
        "app.py",
        "app/tabs/api.py",
    }


def test_architecture_map_names_every_module_and_only_real_paths():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    block = text.split("```")[1]
    names = map_names(block)
    dead = sorted(name for name in names if not (ROOT / name).exists())
    assert not dead, f"docs/architecture.md's map names what does not exist: {dead}"
    named = names | {name.rstrip(".") for name in PATH.findall(text)}  # the map, or a full path anywhere
    unnamed = [m for m in modules() if m not in named]
    assert not unnamed, f"modules docs/architecture.md does not name: {unnamed}"


def modules() -> list[str]:
    """Every module of engine/, visuals/ and app/ (each .py file but __init__.py), as a repository path."""
    return sorted(
        str(path.relative_to(ROOT))
        for folder in ("engine", "visuals", "app")
        for path in (ROOT / folder).rglob("*.py")
        if path.name != "__init__.py"
    )


def readme_layout() -> str:
    """README.md's layout block: the first code block after its "Project layout" heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    heading = re.search(r"^## Project layout$", text, re.M)
    assert heading, "README.md has no '## Project layout' section"
    return text[heading.end() :].split("```")[1]


def test_the_readme_and_the_bench_index_stay_short():
    """The README is a product page (at most 200 lines, the two commands in its first 40); docs/bench/README.md
    says how to run the bench, the current table and an index of the dated notes (at most 150 lines)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= 200, len(readme)
    assert any("make demo" in line for line in readme[:40]) and any("make test" in line for line in readme[:40])
    assert len((DOCS / "bench" / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


def test_readme_layout_names_every_module_and_only_real_paths():
    names = map_names(readme_layout())
    dead = sorted(name for name in names if not (ROOT / name).exists())
    assert not dead, f"README.md's layout names what does not exist: {dead}"
    unnamed = [m for m in modules() if m not in names]
    assert not unnamed, f"modules README.md's layout does not name: {unnamed}"


# ---------------------------------------------------------------------------------------------------------
# Paths in the docs

PATH = re.compile(r"(?<![\w/.~-])((?:engine|app|visuals|scripts|tests|assets|docs|\.ci)/[\w./<>*-]*)")
LINK = re.compile(r"\]\(([^)\s#]+)")


def doc_files() -> list[Path]:
    """docs/*.md, docs/bench/README.md and README.md. The dated notes in docs/bench/ are records of what was
    measured at their commit and name files as they were then."""
    return [*sorted(DOCS.glob("*.md")), DOCS / "bench" / "README.md", ROOT / "README.md"]


def dead_paths(text: str, here: Path) -> list[str]:
    """The repository paths (engine/..., app/..., scripts/..., ...) and relative links in text that do not
    exist. A path with a placeholder (assets/heads/<target>/) must exist up to the placeholder; a glob
    (tests/test_*.py) must match something."""
    dead = []
    for match in PATH.finditer(text):
        name = match.group(1).rstrip(".")
        if "<" in name:
            exists = (ROOT / name.split("<", 1)[0]).is_dir()
        elif "*" in name:
            exists = any(ROOT.glob(name))
        else:
            exists = (ROOT / name).exists()
        if not exists:
            dead.append(name)
    for match in LINK.finditer(text):
        target = match.group(1)
        if "://" not in target and not target.startswith("mailto:") and not (here / target).exists():
            dead.append(target)
    return dead


def test_dead_path_rules():
    text = "`engine/trace.py`, engine/nothing.py. [x](events.md) [y](gone.md) `assets/heads/<t>/` tests/test_*.py"
    assert dead_paths(text, DOCS) == ["engine/nothing.py", "gone.md"]
    assert dead_paths("assets/nothing/<t>/ and tests/nothing_*.py", DOCS) == [
        "assets/nothing/<t>/",
        "tests/nothing_*.py",
    ]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_the_docs_name_exists(path):
    dead = dead_paths(path.read_text(encoding="utf-8"), path.parent)
    assert not dead, f"{path.relative_to(ROOT)} names paths that do not exist: {dead}"
