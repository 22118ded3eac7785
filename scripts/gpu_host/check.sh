#!/usr/bin/env bash
# Every check of a GPU host in one command, logs under LOG_DIR (default /tmp/pagedlm-check):
# build (scripts/gpu_host/build.sh), the op tests on both backends, the CUDA kernel and model
# tests (attention and models again under PAGEDLM_CUDA_SMEM_CAP_KB 163 and 99), compute-sanitizer memcheck on the CUDA op cases of attention, rope and the norms and on
# the graph replay, then the benchmark table (scripts/gpu_host/bench.sh; MODELS, default
# "smollm2-135m llama-3.1-8b", and its REPEAT / WORKLOADS / FLAGS env). Prints a short summary.
#   JOBS=16 scripts/gpu_host/check.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
logs=${1:-/tmp/pagedlm-check}
mkdir -p "$logs/bench"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$logs/gpu.txt"
scripts/gpu_host/build.sh >"$logs/build.log" 2>&1 || { tail -30 "$logs/build.log"; exit 1; }
status=0
for t in backend_ops_test cuda_kernels_test cuda_kquant_lanes_test cuda_model_test; do
  timeout 300 "build-gpu/$t" >"$logs/$t.log" 2>&1 || status=1
  echo "$t: $(grep -E '^\[  (PASSED|FAILED)' "$logs/$t.log" | tr '\n' ' ')"
done
# The attention configurations and MoE tiles of GPUs with less shared memory per block: 163 KB
# (A100), 99 KB (RTX 30xx / 40xx / 50xx).
for cap in 163 99; do
  for t in backend_ops_test cuda_model_test; do
    filter=$([[ $t == backend_ops_test ]] && echo 'Cuda/*PagedAttention*:Cuda/*MoeExperts*' || echo '*')
    PAGEDLM_CUDA_SMEM_CAP_KB=$cap timeout 300 "build-gpu/$t" --gtest_filter="$filter" \
      >"$logs/$t.cap$cap.log" 2>&1 || status=1
    echo "$t (${cap} KB): $(grep -E '^\[  (PASSED|FAILED)' "$logs/$t.cap$cap.log" | tr '\n' ' ')"
  done
done
timeout 300 compute-sanitizer --tool memcheck build-gpu/backend_ops_test \
  --gtest_filter='Cuda/*Cascade*:Cuda/*PagedAttentionDecode/*:Cuda/*HeadDims80And96*:Cuda/*RopeWriteKv*:Cuda/*RmsNorm*:Cuda/*SiluMul*' \
  >"$logs/memcheck.log" 2>&1 || status=1
# head_dim 256's one-stage decode and 16-key tiles (99 KB).
PAGEDLM_CUDA_SMEM_CAP_KB=99 timeout 300 compute-sanitizer --tool memcheck build-gpu/backend_ops_test \
  --gtest_filter='Cuda/*PagedAttentionHeadDim256*' >>"$logs/memcheck.log" 2>&1 || status=1
timeout 300 compute-sanitizer --tool memcheck build-gpu/cuda_kernels_test \
  --gtest_filter='*GraphReplay*:*SeveralTokens*' >>"$logs/memcheck.log" 2>&1 || status=1
echo "memcheck: $(grep -E 'ERROR SUMMARY' "$logs/memcheck.log" | tr '\n' ' ')"
# shellcheck disable=SC2086  # MODELS is a list
scripts/gpu_host/bench.sh "$logs/bench" ${MODELS:-smollm2-135m llama-3.1-8b}
exit $status
