#!/usr/bin/env bash
# Configures and builds pagedlm into build/ (CUDA too when nvcc is present): everything, or only
# the targets named (scripts/build.sh pagedlm: the binary alone, without the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
# A CUDA build takes NCCL from its pinned wheel (tensor parallelism over GPUs).
nccl=()
if [[ " ${PAGEDLM_CMAKE_ARGS:-} " != *" -DPAGEDLM_CUDA=OFF "* ]] &&
  { command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; }; then
  nccl=(-DPAGEDLM_NCCL_ROOT="$(scripts/fetch_nccl.sh)")
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${nccl[@]}" ${PAGEDLM_CMAKE_ARGS:-} >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build -j"$(nproc)" "${targets[@]}"
