#!/usr/bin/env bash
# Configures and builds pagedlm into build/ (CUDA too when nvcc is present).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${PAGEDLM_CMAKE_ARGS:-} >/dev/null
cmake --build build -j"$(nproc)"
