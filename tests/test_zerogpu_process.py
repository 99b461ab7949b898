"""The served app in a process set up as a ZeroGPU Space's main process: nothing in it initialises CUDA.

On a ZeroGPU Space the platform sets SPACES_ZERO_GPU, and importing the ``spaces`` package then patches torch
in the app's process (spaces/zero/torch/patching.py): ``torch.cuda.is_available()`` returns True there (and
``device_count()`` 1), while the low-level CUDA initialisation raises, because the GPU exists only inside a
call decorated with ``@spaces.GPU``, which runs in a GPU worker process. Code that picks its device with
"auto" in the app process gets CUDA and fails at its first CUDA call ("CUDA must not be initialized in the
main process").

The real package cannot be used for this here: with SPACES_ZERO_GPU set, ``import spaces`` needs a CUDA
build of torch and the platform's GPU scheduler. So this test runs this file as a subprocess whose first
act, before anything imports the app, is to stand in for exactly what ``spaces`` does to that process:

- SPACES_ZERO_GPU=true, ``torch.cuda.is_available`` returns True and ``torch.cuda.device_count`` 1 (as
  ``spaces`` patches them);
- every way into CUDA raises RuntimeError("CUDA must not be initialized in the main process") and is
  recorded: ``torch.cuda._lazy_init`` / ``torch.cuda.init`` / ``torch._C._cuda_init`` (which every CUDA
  tensor, ``.to("cuda")`` and ``.cuda()`` reach), ``torch.cuda.Stream``, ``current_stream``,
  ``synchronize``, ``current_device``, CUDA graphs and events, the device queries, and ``torch.Tensor.cuda``
  / ``torch.Tensor.to`` with a CUDA device. (``spaces`` turns a few of these, ``synchronize`` and
  ``current_device`` say, into harmless stand-ins of its own; here every one counts as a failure, because
  an app process that calls them is one that thinks it runs on a GPU it does not have: a time it measured
  there would not be a GPU's);
- a module ``spaces`` whose ``GPU`` decorator is the GPU worker: it runs the decorated function in this
  process (as ``spaces.GPU`` does off ZeroGPU), and while that function runs, torch's CUDA functions are
  the real ones again for that thread, as they are in ZeroGPU's worker. This machine has no GPU, so there
  the worker's engine loads on this CPU (``device="auto"`` and the real ``is_available()``): the worker's
  runs are real runs of the real default model, on the CPU. The decorator also records each call and the
  GPU seconds the run's ``duration`` asks for.

Then the subprocess builds the app (``from app import build_demo``), serves it on a free loopback port and
drives it as a visitor would: ``/generate`` and ``/race`` through ``gradio_client``, and the events of the
page that are not public API (the Playground's Run, the Race, every lab) through Gradio's queue protocol,
which is what the browser uses (``gradio_client`` refuses private events), each with small settings. Each
must complete without an error; the Playground's runs must have gone through the GPU worker, and those of
the Race, /race and the Lossless, Batch and Parity labs must not (they compare runs, all measured on one
device: the app's CPU engine); and at the end no CUDA attempt may have been recorded. Nothing is mocked: the app, the engine and the model are the real
ones; only the platform's patching of torch is stood in for, as described.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_MESSAGE = "CUDA must not be initialized in the main process"
REPORT = "ZEROGPU-PROCESS-REPORT "  # the subprocess's last line: this prefix, then its report as JSON
SUBPROCESS_TIMEOUT_S = 420  # ~2 minutes on a quiet 2-core CPU; room for a loaded one

PROMPT = "Repeat after me: the cat sat on the mat, the cat sat on the mat."


@pytest.mark.real_model
@pytest.mark.slow
def test_the_app_never_initialises_cuda_in_zerogpus_main_process():
    env = {
        **os.environ,
        "SPACES_ZERO_GPU": "true",
        "HF_HUB_OFFLINE": "1",
        "SPECLENS_PRELOAD": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(REPORT)]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    report = json.loads(lines[-1][len(REPORT) :])
    # The stand-in was armed: "auto" would have picked CUDA here, and a CUDA tensor raised and was recorded.
    assert report["armed"] == {"auto_device": "cuda", "raised": CUDA_MESSAGE}
    assert report["cuda_attempts"] == [], report["cuda_attempts"]
    assert report["app_engines"] and set(report["app_engines"].values()) == {"cpu"}, report["app_engines"]
    steps = report["steps"]
    # What compares runs: every run of a comparison on the app's CPU engine, one device.
    one_device = ("race", "/race", "drafters lab", "lossless lab", "batch lab", "parity lab")
    one_device += ("explain lab", "deployment lab")
    assert set(steps) == {"/generate", "playground", *one_device}, steps
    failed = {name: step for name, step in steps.items() if step.get("error")}
    assert not failed, failed
    # The Playground's runs went through the GPU worker, asking for the time their tokens need (its engine
    # loaded on this machine's CPU: no GPU here). What compares runs stayed on the app's CPU engine, every run of
    # a comparison on one device.
    assert steps["/generate"]["worker_calls"] == 1 and steps["playground"]["worker_calls"] == 1, steps
    assert all(steps[name]["worker_calls"] == 0 for name in one_device), steps
    assert report["gpu_seconds"] and all(s >= 1 for s in report["gpu_seconds"]), report["gpu_seconds"]
    assert report["worker_engines"] and set(report["worker_engines"].values()) == {"cpu"}, report["worker_engines"]
    # Where a figure was measured, the screen says on which device: the app process's, the CPU.
    assert "measured on the CPU" in steps["race"]["said"], steps["race"]
    assert "measured on the CPU" in steps["parity lab"]["said"], steps["parity lab"]
    print(f"subprocess {time.monotonic() - started:.0f} s: {json.dumps(report['seconds'])}")


# ------------------------------------------------------------------------------------------- the subprocess
class CudaGuard:
    """Torch as ZeroGPU's main process sees it: CUDA "available", every way into it raising and recorded,
    except on a thread inside the stand-in GPU worker (``worker()``), which sees torch's real CUDA functions."""

    PATCHED = (
        "_lazy_init",
        "init",
        "Stream",
        "Event",
        "current_stream",
        "default_stream",
        "stream",
        "synchronize",
        "current_device",
        "set_device",
        "CUDAGraph",
        "graph",
        "graph_pool_handle",
        "get_device_name",
        "get_device_properties",
        "get_device_capability",
        "mem_get_info",
        "memory_allocated",
        "max_memory_allocated",
        "reset_peak_memory_stats",
        "empty_cache",
    )

    def __init__(self, torch) -> None:
        import threading

        self.torch = torch
        self.attempts: list[dict] = []
        self._local = threading.local()

    def in_worker(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def worker(self):
        from contextlib import contextmanager

        @contextmanager
        def scope():
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                yield
            finally:
                self._local.depth -= 1

        return scope()

    def attempt(self, what: str):
        import threading
        import traceback

        stack = [f"{f.filename.removeprefix(str(ROOT) + '/')}:{f.lineno} {f.name}" for f in traceback.extract_stack()]
        self.attempts.append({"call": what, "thread": threading.current_thread().name, "stack": stack[-14:-1]})
        raise RuntimeError(CUDA_MESSAGE)

    def install(self) -> None:
        torch, cuda = self.torch, self.torch.cuda
        real_available, real_count = cuda.is_available, cuda.device_count
        cuda.is_available = lambda: real_available() if self.in_worker() else True
        cuda.device_count = lambda: real_count() if self.in_worker() else 1
        for name in self.PATCHED:
            if hasattr(cuda, name):
                setattr(cuda, name, self._guarded(f"torch.cuda.{name}", getattr(cuda, name)))
        if hasattr(torch._C, "_cuda_init"):  # a CUDA build of torch (spaces patches it to raise)
            torch._C._cuda_init = self._guarded("torch._C._cuda_init", torch._C._cuda_init)
        real_cuda, real_to = torch.Tensor.cuda, torch.Tensor.to

        def tensor_cuda(tensor, *args, **kwargs):
            if not self.in_worker():
                self.attempt("torch.Tensor.cuda")
            return real_cuda(tensor, *args, **kwargs)

        def tensor_to(tensor, *args, **kwargs):
            if not self.in_worker() and any(self._is_cuda(a) for a in (*args, kwargs.get("device"))):
                self.attempt("torch.Tensor.to(cuda)")
            return real_to(tensor, *args, **kwargs)

        torch.Tensor.cuda, torch.Tensor.to = tensor_cuda, tensor_to

    def _guarded(self, what: str, real):
        if isinstance(real, type):  # a class stays one (libraries annotate with torch.cuda.CUDAGraph | None)
            guard = self

            def new(cls, *args, **kwargs):
                if not guard.in_worker():
                    guard.attempt(what)
                return real(*args, **kwargs)

            return type(real.__name__, (real,), {"__new__": new, "__module__": real.__module__})

        def guarded(*args, **kwargs):
            if not self.in_worker():
                self.attempt(what)
            return real(*args, **kwargs)

        return guarded

    def _is_cuda(self, value) -> bool:
        torch = self.torch
        if isinstance(value, str):
            return value.startswith("cuda")
        if isinstance(value, torch.device):
            return value.type == "cuda"
        if isinstance(value, torch.Tensor):
            return value.is_cuda
        return isinstance(value, int) and not isinstance(value, bool)  # a device index: tensor.to(0)


def stand_in_spaces(guard: CudaGuard, calls: list[str], seconds: list[int]):
    """A module ``spaces`` whose ``GPU`` runs the decorated function here, on the worker's side of the guard."""
    import functools
    import inspect
    import types

    def GPU(func=None, duration=60, **_):  # noqa: N802 (the package's name)
        def decorate(fn):
            def asked(args, kwargs) -> None:
                calls.append(fn.__name__)
                seconds.append(int(duration(*args, **kwargs) if callable(duration) else duration))

            if inspect.isgeneratorfunction(fn):

                @functools.wraps(fn)
                def run(*args, **kwargs):
                    asked(args, kwargs)
                    events = fn(*args, **kwargs)
                    try:
                        while True:
                            with guard.worker():  # each step, on whichever thread Gradio iterates it
                                try:
                                    event = next(events)
                                except StopIteration:
                                    return
                            yield event
                    finally:
                        with guard.worker():
                            events.close()

                return run

            @functools.wraps(fn)
            def call(*args, **kwargs):
                asked(args, kwargs)
                with guard.worker():
                    return fn(*args, **kwargs)

            return call

        return decorate(func) if callable(func) else decorate

    module = types.ModuleType("spaces")
    module.GPU = GPU
    module.__doc__ = "The test's stand-in for the `spaces` package on ZeroGPU (tests/test_zerogpu_process.py)."
    return module


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _event(server: str, demo, config: dict, name: str, overrides: dict, timeout: float = 240) -> dict:
    """Run the page's event whose handler is `name` as the browser does (queue/join, then its SSE stream), every
    input at the page's value but `overrides` (by the handler's parameter names). Returns {"error"} or
    {"said": the final outputs' text}."""
    import inspect
    import uuid

    import httpx

    [(fn_index, block)] = [(i, f) for i, f in demo.fns.items() if getattr(f.fn, "__name__", None) == name]
    values = {c["id"]: c.get("props", {}).get("value") for c in config["components"]}
    params = list(inspect.signature(block.fn).parameters)
    data = [overrides.get(p, values.get(comp._id)) for p, comp in zip(params, block.inputs)]
    session = uuid.uuid4().hex
    joined = httpx.post(
        server + "gradio_api/queue/join",
        json={"data": data, "fn_index": fn_index, "session_hash": session},
        timeout=30,
    )
    if joined.status_code != 200:
        return {"error": f"join {joined.status_code}: {joined.text}"}
    deadline = time.monotonic() + timeout
    url = server + f"gradio_api/queue/data?session_hash={session}"
    with httpx.stream("GET", url, timeout=httpx.Timeout(60.0, read=timeout)) as stream:
        for line in stream.iter_lines():
            if time.monotonic() > deadline:
                return {"error": f"no result within {timeout} s"}
            if not line.startswith("data:"):
                continue
            message = json.loads(line[len("data:") :])
            if message.get("msg") != "process_completed":
                continue
            output = message.get("output") or {}
            if not message.get("success"):
                return {"error": output.get("error") or json.dumps(message)[:2000]}
            texts = _texts(output.get("data"))
            refused = [t for t in texts if t.lstrip().startswith("⚠")]
            if refused:  # a lab that refuses its input says so in its status ("⚠ reason") instead of raising
                return {"error": refused[0][:2000]}
            return {"said": " ".join(texts)}
    return {"error": "the event stream ended without a result"}


def _texts(value) -> list[str]:
    """Every string in an event's output data (status lines, markdown, table cells)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _texts(v)]
    return []


def main() -> int:
    """The subprocess: arm the stand-in, then build, serve and drive the app; print the report."""
    os.environ["SPACES_ZERO_GPU"] = "true"
    import torch

    guard = CudaGuard(torch)
    guard.install()
    calls: list[str] = []
    gpu_seconds: list[int] = []
    sys.modules["spaces"] = stand_in_spaces(guard, calls, gpu_seconds)
    from engine.model.loading import resolve_device

    armed = {"auto_device": resolve_device("auto")}
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError as exc:
        armed["raised"] = str(exc)
    guard.attempts.clear()

    import gradio_client
    import httpx

    from app import build_demo, zerogpu
    from app.model_registry import REGISTRY, resolve_dtype_name

    assert zerogpu.active() and zerogpu.app_device() == "cpu"
    demo = build_demo().queue(default_concurrency_limit=2)
    port = _free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True, show_error=True)
    server = f"http://127.0.0.1:{port}/"
    steps: dict[str, dict] = {}
    engines: dict[str, str] = {}
    seconds: dict[str, float] = {}

    def step(name: str, run) -> None:
        before, started = len(calls), time.monotonic()
        try:
            result = run()
        except Exception as exc:  # reported, not raised: the parent shows every step that failed
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["worker_calls"] = len(calls) - before
        steps[name] = result
        seconds[name] = round(time.monotonic() - started, 1)

    try:
        client = gradio_client.Client(server, verbose=False)
        config = httpx.get(server + "config", timeout=30).json()
        dtype = resolve_dtype_name("auto")
        parity_dtype = dtype if dtype in ("float32", "bfloat16") else "float32"

        def api(name: str, *args):
            result = client.predict(*args, api_name=name)
            return {"said": json.dumps(result)[:500]}

        def event(name: str, **overrides):
            return lambda: _event(server, demo, config, name, overrides)

        step("/generate", lambda: api("/generate", PROMPT, "ngram", 4, 0.0, 1.0, 0, 0, 8))
        step(
            "playground",
            event("run_playground", prompt=PROMPT, drafter="ngram", k=4, temperature=0.0, seed=0, max_new_tokens=8),
        )
        step(
            "race",
            event("run_race", prompt=PROMPT, drafter="ngram", k=4, temperature=0.0, seed=0, max_new_tokens=8),
        )
        step("/race", lambda: api("/race", PROMPT, "ngram", 4, 0.0, 0, 8, 5))
        step("drafters lab", event("run_drafters", prompt=PROMPT, drafters=["ngram"], k=2, max_new=8, greedy=True))
        step(
            "lossless lab",
            event(
                "run_lossless",
                prompt="Hi!",
                drafter="ngram",
                k=2,
                topk=1,
                n_samples=100,
                seed=0,
                samplers=["exact"],
                tokens=1,
            ),
        )
        step("batch lab", event("run_batch", k=2, batch_sizes=[1, 2], repeats=1))
        step(
            "parity lab",
            event(
                "run_parity",
                prompts_text=PROMPT,
                drafter="ngram",
                dtype=parity_dtype,
                max_new_tokens=6,
                k=2,
                strict=True,
            ),
        )
        step("explain lab", event("run_toy", seed=0))
        step("deployment lab", event("from_recorded"))
        engines = {
            f"{target}/{dtype}": str(engine.target.model.device)
            for (target, dtype), engine in REGISTRY._engines.items()
        }
    finally:
        demo.close()
    report = {
        "armed": armed,
        "cuda_attempts": guard.attempts,
        "app_engines": engines,
        "worker_engines": {name: str(engine.target.model.device) for name, engine in zerogpu._ENGINES.items()},
        "steps": steps,
        "gpu_seconds": gpu_seconds,
        "seconds": seconds,
    }
    print(REPORT + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
