#!/usr/bin/env bash
# ============================================================================
# GPU check: MEANT FOR THE DEVICE MACHINE (Linux x86-64 + an NVIDIA GPU, 15 device minutes in all).
# Not part of CI or `make test`. `--dry-run` runs every step's CPU-capable part here, on the CPU.
# ============================================================================
# The figures first, training last; the whole run fits in 7 minutes including installs
# (GPU_CHECK_BUDGET_S, default 420 s; every step is capped by what is left of it):
#   1. probe      ~20 s  the GPU (nvidia-smi), a Python whose torch sees it with triton, pytest, scipy,
#                        transformers: $SPECLENS_PYTHON, .venv/bin/python, python3 (the device image's
#                        python3 has them). Only if none has them: scripts/setup.sh with CUDA torch from PyPI
#                        (needs the network), capped at 150 s, taken from the training step's share.
#   2. figures    210 s  ONE Python process, one model load: scripts/gpu_latest.py --device cuda --out $OUT
#                        (pass ms with and without graphs, launches per pass, parity (a) graph replay ==
#                        the uncaptured static strict pass and (b) speculative vs plain greedy with the
#                        top-2 margin at any divergence, baseline tok/s, n-gram and EAGLE speedups, the
#                        head's held-out tokens per pass, a chi-square of sampled EAGLE on the GPU).
#                        $OUT/gpu-latest.json / .md are rewritten after EVERY figure (atomically; a cut-off
#                        run leaves valid JSON with "complete": false).
#   3. graph test  45 s  pytest tests/test_static_pass.py -k cuda_graph (replays == uncaptured, tiny model)
#   4. train-head 110 s  LAST, time-boxed (GPU_TRAIN_S): python -m engine train-head --device cuda
#                        $GPU_TRAIN_ARGS (resumable; the shipped head is replaced only by a better one);
#                        the head and decision.json copied to $OUT/head, and the outcome (where it trained,
#                        per engine.host, rc, seconds) added to gpu-latest.json.
#   slack          35 s  process start-ups, copies, the summary.
# The checks that passed on 2026-11-30 (kernel tests and timing, parity/generate CLIs, bench --quick;
# docs/bench/2026-11-30-gpu-check-h200.md) are no longer run here: run them by hand with device time left.
#
# --dry-run: the same steps on the CPU with tiny sizes (gpu_latest.py --device cpu --quick, the graph test
# file's selection on the CPU, train-head --device cpu --quick into $OUT/head, never assets/heads);
# CUDA-only parts are reported as skipped with the reason. Exit non-zero if any step fails.
# GPU_CHECK_ONLY='regex' runs only the steps whose names match (figures|graph test|train-head|record).
# $OUT is the device tool's output folder (default ./gpu-out); the log goes to $OUT/gpu_check.log.
# Exit status: 0 when every step that ran passed, 1 otherwise, 2 if no usable Python.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    -h | --help)
      sed -n '2,/^set -uo/p' "$0" | sed '$d'
      exit 0
      ;;
    *)
      echo "gpu_check.sh: unknown argument $arg (use --dry-run or --help)" >&2
      exit 2
      ;;
  esac
done

BUDGET=${GPU_CHECK_BUDGET_S:-420}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
unset TRITON_INTERPRET SPECLENS_TRITON_INTERPRET # the compiled kernel needs them unset
FAILED=()
SKIPPED=()
if [ "$DRY" = 1 ]; then DEVICE=cpu; else DEVICE=cuda; fi

say() { printf '\n[gpu_check %3ds] %s\n' "$SECONDS" "$*" >&2; }

# wanted NAME: false when GPU_CHECK_ONLY (an extended regex over step names) leaves NAME out.
wanted() { [ -z "${GPU_CHECK_ONLY:-}" ] || [[ $1 =~ ${GPU_CHECK_ONLY} ]]; }

# run_step NAME LIMIT CMD...: runs CMD with min(LIMIT, budget left); records failures. STEP_RC, STEP_S: its outcome.
STEP_RC=0
STEP_S=0
run_step() {
  local name=$1 limit=$2
  shift 2
  STEP_RC=0
  STEP_S=0
  if ! wanted "$name"; then
    say "SKIP $name: not in GPU_CHECK_ONLY"
    SKIPPED+=("$name (GPU_CHECK_ONLY)")
    STEP_RC=-1
    return 0
  fi
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then
    say "SKIP $name: time budget spent (${BUDGET}s)"
    FAILED+=("$name (no time left: rerun it with GPU_CHECK_ONLY)")
    STEP_RC=-1
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "$name (limit ${limit}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  STEP_RC=$?
  STEP_S=$((SECONDS - t0))
  say "$name: rc=$STEP_RC in ${STEP_S}s"
  [ "$STEP_RC" -eq 0 ] || FAILED+=("$name (rc=$STEP_RC)")
  return "$STEP_RC"
}

# 1. probe
say "probe: GPU and Python (dry run: $DRY)"
if [ "$DRY" = 1 ]; then
  SKIPPED+=("nvidia-smi, CUDA graphs, launch counts, the Triton chain verifier: CUDA only (dry run on the CPU)")
  CHECK_PY='import torch, pytest, scipy, transformers, safetensors'
elif command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || nvidia-smi -L
  CHECK_PY='import torch, triton, pytest, scipy, transformers, safetensors; assert torch.cuda.is_available()'
else
  echo "nvidia-smi not found: this script is meant for a machine with an NVIDIA GPU (or use --dry-run)"
  CHECK_PY='import torch, triton, pytest, scipy, transformers, safetensors; assert torch.cuda.is_available()'
fi

PY=""
pick_python() {
  local cand
  for cand in "${SPECLENS_PYTHON:-}" .venv/bin/python python3; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c "$CHECK_PY" >/dev/null 2>&1; then
      PY=$cand
      return 0
    fi
  done
  return 1
}

if ! pick_python; then
  if [ "$DRY" = 1 ] || [ -x .venv/bin/python ]; then
    echo "no Python here has: $CHECK_PY"
    [ "$DRY" = 1 ] || echo "(.venv exists but its torch cannot see a GPU? Move it aside or set SPECLENS_PYTHON.)"
    exit 2
  fi
  say "installing into .venv: CUDA torch from PyPI via scripts/setup.sh (needs the network; at most 150 s)"
  SPECLENS_TORCH_SPEC="torch>=2.5,<2.14" timeout 150 scripts/setup.sh || echo "[gpu_check] setup.sh failed (rc=$?)"
  [ -x .venv/bin/pip ] && timeout 60 .venv/bin/pip install -q "pytest>=8" "scipy>=1.11"
  if ! pick_python; then
    echo "no Python with torch (CUDA), triton, pytest, scipy and transformers: giving up"
    exit 2
  fi
fi
say "Python: $(command -v "$PY")"
"$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}")'

# 2. The figures: one process, one model load, a file after every figure.
if [ "$DRY" = 1 ]; then FIG_ARGS=(--device cpu --quick); else FIG_ARGS=(--device cuda); fi
run_step "figures" "${GPU_FIGURES_S:-210}" "$PY" scripts/gpu_latest.py "${FIG_ARGS[@]}" --out "$OUT"

# 3. CUDA graph replays against the uncaptured pass, on a tiny model (on the CPU: reported as skipped).
run_step "graph test" 45 "$PY" -m pytest tests/test_static_pass.py -k cuda_graph -q -rs -p no:cacheprovider
[ "$STEP_RC" -eq 5 ] && { unset 'FAILED[-1]'; SKIPPED+=("graph test: nothing collected"); }

# 4. train-head, last and time-boxed: what is left of the budget, at most GPU_TRAIN_S.
if [ "$DRY" = 1 ]; then
  TRAIN=(--device cpu --quick --out "$OUT/head" --work "$OUT/head-work")
  HEAD_WORK="$OUT/head-work"
else
  # shellcheck disable=SC2206 # GPU_TRAIN_ARGS is a list of options
  TRAIN=(--device cuda ${GPU_TRAIN_ARGS:---prompts 6000 --written 2000 --epochs 6})
  HEAD_WORK="${SPECLENS_CACHE:-$HOME/.cache/speclens}/train-head/default"
fi
LEFT=$((BUDGET - SECONDS - 15)) # keep 15 s for the copies and the record
TRAIN_S=${GPU_TRAIN_S:-110}
[ "$TRAIN_S" -gt "$LEFT" ] && TRAIN_S=$LEFT
[ "$TRAIN_S" -lt 20 ] && TRAIN_S=20 # run_step then skips it as out of budget
run_step "train-head" "$TRAIN_S" "$PY" -m engine train-head "${TRAIN[@]}"
TRAIN_RC=$STEP_RC
TRAIN_SECONDS=$STEP_S
if [ "$TRAIN_RC" -ne -1 ]; then
  # A time box reached is the expected end of a short run (resumable): not a failure of the check.
  if [ "$TRAIN_RC" -eq 124 ] || [ "$TRAIN_RC" -eq 137 ]; then
    unset 'FAILED[-1]'
    SKIPPED+=("train-head: stopped by its ${TRAIN_S}s time box (resumable)")
  fi
  if [ "$DRY" = 0 ]; then
    mkdir -p "$OUT/head" && cp -r assets/heads/. "$OUT/head/" 2>/dev/null
  fi
  cp "$HEAD_WORK/decision.json" "$OUT/head/" 2>/dev/null
  run_step "record" 30 "$PY" scripts/gpu_latest.py --record-training "$TRAIN_RC" "$TRAIN_SECONDS" \
    --decision "$HEAD_WORK/decision.json" --device "$DEVICE" --out "$OUT"
fi

say "done in ${SECONDS}s (budget ${BUDGET}s); figures: $OUT/gpu-latest.json; log: $LOG"
[ "${#SKIPPED[@]}" -gt 0 ] && printf 'SKIPPED: %s\n' "${SKIPPED[@]}"
if [ "${#FAILED[@]}" -gt 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all steps passed"
