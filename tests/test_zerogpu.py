"""ZeroGPU Spaces (app/zerogpu.py) with the real `spaces` package: off ZeroGPU its decorator leaves the function
as it is; with SPACES_ZERO_GPU set, the app's engines load on the CPU, the Playground's runs go through the GPU
worker's function, whose events are the CPU engine's (here the worker's device is this CPU), runs that are
compared with others stay on the CPU engine, and bad input is still refused before anything runs.

The variable is set here after `import spaces`, so the package's patching of torch never runs in these tests
(with it set, the real package needs a CUDA build of torch): tests/test_zerogpu_process.py serves the app in
a subprocess set up as ZeroGPU's main process and checks that nothing there initialises CUDA."""

from __future__ import annotations

import gradio as gr
import pytest

from app import zerogpu
from app.engine_access import start_generation

spaces = pytest.importorskip("spaces")


def test_off_zerogpu_nothing_changes(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert not zerogpu.active()
    assert zerogpu.gpu_events is zerogpu._run_on_gpu  # spaces.GPU returned it undecorated
    assert zerogpu.app_device() == "auto"
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    assert zerogpu.active()
    assert zerogpu.app_device() == "cpu"  # ZeroGPU's is_available() says True in a process without CUDA


def test_the_screen_says_which_device_measured():
    import torch

    assert zerogpu.measured_on(torch.device("cpu")) == "measured on the CPU"
    assert zerogpu.measured_on("cuda:0") == zerogpu.measured_on(torch.device("cuda", 0)) == "measured on the GPU"
    assert zerogpu.measured_on(None) == "measured on the CPU"  # a trace from before traces named their device


def test_the_gpu_time_asked_for_follows_the_requested_tokens():
    from engine.settings import GenerationSettings

    def seconds(n):
        return zerogpu.gpu_seconds("t", "p", "ngram", GenerationSettings(max_new_tokens=n))

    assert seconds(1) == zerogpu.GPU_LOAD_S + 1
    assert seconds(96) < seconds(400) <= zerogpu.MAX_GPU_S
    assert seconds(100_000) == zerogpu.MAX_GPU_S


@pytest.mark.slow
def test_on_zerogpu_runs_go_through_the_gpu_worker_and_match_the_cpu_engine(served_engine, monkeypatch):
    from engine.settings import GenerationSettings

    settings = GenerationSettings(max_new_tokens=12, temperature=0.0, k=4)
    prompt = "Repeat after me: the cat sat on the mat, the cat sat on the mat."
    here = served_engine.run(prompt, "ngram", settings)
    calls = []
    worker = zerogpu.gpu_events
    monkeypatch.setattr(zerogpu, "gpu_events", lambda *a: calls.append(a) or worker(*a))
    monkeypatch.setenv("SPACES_ZERO_GPU", "1")
    with start_generation(served_engine, prompt, "ngram", settings) as events:
        finish = list(events)[-1]
    assert len(calls) == 1 and calls[0][0] == served_engine.target.name
    assert finish["type"] == "finish" and finish["token_ids"] == here["token_ids"]
    # A run compared with others (the Race's) stays on the engine it was given.
    with start_generation(served_engine, prompt, "ngram", settings, worker=False) as events:
        assert list(events)[-1]["token_ids"] == here["token_ids"]
    assert len(calls) == 1
    # Checked on the CPU engine, before any GPU time is asked for.
    with pytest.raises(gr.Error, match="drafter"):
        start_generation(served_engine, prompt, "no-such-drafter", settings)
    assert len(calls) == 1
