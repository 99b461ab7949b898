"""Every environment variable the engine reads, with its default and meaning, read here and nowhere else.

The app's own variables are in ``app/config.py``; docs/configuration.md lists both. Each accessor
reads the environment when it is called (a test's ``monkeypatch.setenv`` or a child process's
environment takes effect), and each variable is read through exactly one accessor.
"""

from __future__ import annotations

import os
from pathlib import Path

# name -> (default, what it does). docs/configuration.md is this table; a test keeps them equal.
VARIABLES: dict[str, tuple[str, str]] = {
    "SPECLENS_CACHE": ("~/.cache/speclens", "model cache, compiled kernels, vLLM's model folder"),
    "SPECLENS_CPU_KERNEL": ("auto", "our C kernels: auto (best variant for this CPU), a variant name, or 0 (torch)"),
    "SPECLENS_HUGE_PAGES": (
        "1",
        "1: our kernels' packed weights and KV caches on 2 MB transparent huge pages where Linux allows; 0: not",
    ),
    "SPECLENS_PREFER_HUB": ("0", "1: load the default model from the Hub when it answers, else the GGUF package"),
    "SPECLENS_TRITON_INTERPRET": ("0", "1: run the Triton verifier in Triton's interpreter (CPU tests)"),
    "TRITON_INTERPRET": ("0", "Triton's own switch for the same; read as a synonym"),
    "SPECLENS_VLLM_URL": (
        "",
        "a running vLLM server for the vllm backend (bench rows; the CLI's --vllm-url without a value)",
    ),
    "SPECLENS_VLLM_PYTHON": (".venv-vllm/bin/python", "the interpreter of vLLM's own environment"),
    "HF_HUB_OFFLINE": ("0", "1: never try the Hugging Face Hub"),
    "HF_ENDPOINT": ("https://huggingface.co", "the Hub's address, for the reachability probe"),
    "CC": ("cc", "the C compiler that builds our kernels"),
    # torch's own instruction-set caps (how the AVX2-only host is approximated); read only to record
    # them in benchmark reports
    "ATEN_CPU_CAPABILITY": ("", "torch's CPU instruction set cap (recorded in bench reports)"),
    "ONEDNN_MAX_CPU_ISA": ("", "oneDNN's instruction set cap (recorded in bench reports)"),
    "MKL_ENABLE_INSTRUCTIONS": ("", "MKL's instruction set cap (recorded in bench reports)"),
}
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "SPECLENS_CPU_KERNEL")

_TRUE = ("1", "true", "yes")


def _get(name: str) -> str:
    assert name in VARIABLES, name  # every variable is declared above, with its default
    return os.environ.get(name, "").strip()


def cache_root() -> Path:
    raw = _get("SPECLENS_CACHE")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "speclens"


def cpu_kernel_setting() -> str:
    return (_get("SPECLENS_CPU_KERNEL") or "auto").lower()


def huge_pages() -> bool:
    return _get("SPECLENS_HUGE_PAGES") != "0"


def prefer_hub() -> bool:
    return _get("SPECLENS_PREFER_HUB") == "1"


def triton_interpret() -> bool:
    return _get("SPECLENS_TRITON_INTERPRET") == "1" or _get("TRITON_INTERPRET") == "1"


def vllm_url() -> str:
    return _get("SPECLENS_VLLM_URL")


def vllm_python_override() -> str:
    return _get("SPECLENS_VLLM_PYTHON")


def hub_offline() -> bool:
    return _get("HF_HUB_OFFLINE").lower() in _TRUE


def hub_endpoint() -> str:
    return _get("HF_ENDPOINT") or VARIABLES["HF_ENDPOINT"][0]


def c_compiler() -> str:
    return _get("CC")


def isa_caps() -> dict[str, str] | None:
    """The instruction-set caps set for this process (torch's and our kernels'), None when none is."""
    return {name: _get(name) for name in ISA_CAPS if _get(name)} or None
