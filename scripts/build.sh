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
# With ccache present, a rebuild or a second clone compiles only what changed (relative paths
# under the clone, so clones in different folders share the cache).
launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR=true
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "${nccl[@]}" ${PAGEDLM_CMAKE_ARGS:-} >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build -j"$(nproc)" "${targets[@]}"
