#!/usr/bin/env bash
# The CPU benchmark tables of docs/bench/2026-11-30-cpu-hosts.md, in one go (~40 min on 2 cores).
# An AVX2-only host is approximated on an AVX512 host by forcing our avx2 kernel variant
# (SPECLENS_CPU_KERNEL=avx2) and building llama.cpp without AVX-512:
#   CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
#     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF" .venv/bin/pip install llama-cpp-python
# torch is capped to AVX2 as well (its own kernels, oneDNN and MKL), so that transformers' rows and
# "today's float32 path" run what they would run there (oneDNN's bf16 product has no AVX2 fast path:
# ~10x float32's time, so the hf rows pick float32; see engine/tools/bench.py hf_dtype).
# On a real AVX2-only host `auto` picks avx2 by itself and a native llama.cpp build is AVX2 anyway.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-docs/bench}
day=$(date +%F)
avx2="env SPECLENS_CPU_KERNEL=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"
engine_rows=engine-baseline,engine-ngram,engine-int8,engine-eagle,engine-ngram-adaptive,engine-int8-adaptive,engine-eagle-adaptive
# engine-torch-float32 is "today's float32 path" of issue #16 (float32 weights on torch's own
# products and attention, no kernel of ours), measured in the same run as the rows it is compared with.
$avx2 .venv/bin/python -m engine bench --repeats 2 --json \
  --systems $engine_rows,engine-torch-float32,hf-generate,hf-prompt-lookup,llamacpp > "$out/$day-avx2-bf16.json"
$avx2 .venv/bin/python -m engine bench --repeats 2 --json --dtype q4_1 --no-events-check \
  --systems engine-baseline,engine-ngram,engine-eagle,llamacpp > "$out/$day-avx2-q4_1.json"
.venv/bin/python -m engine bench --repeats 2 --json --no-events-check \
  --systems $engine_rows,engine-torch-float32,hf-generate,hf-prompt-lookup,llamacpp > "$out/$day-avx512bf16-bf16.json"
# vLLM's CPU build uses AVX-512 where the CPU has it: its rows belong with the host's own best kernels.
# Its own run: the servers stay up for the whole bench and, on 2 cores, slowed every other system
# measured beside them (engine-baseline 50.7 against 87.4 tok/s on chat in a run without them), so only the vLLM rows
# of this run are read.
.venv/bin/python -m engine bench --repeats 2 --json --no-events-check \
  --systems engine-baseline,vllm-baseline,vllm-ngram > "$out/$day-avx512bf16-vllm.json"
