#!/usr/bin/env bash
# CPU side-by-side of pagedlm and llama.cpp (llama-cpp-python, built from source) on the same
# GGUF with the same thread count: prefill at 125-4000 tokens, single-stream decode and 8/32
# parallel prompts, pair by pair, as a markdown table for docs/PERF.md. The rows, the counting
# and the options are described in scripts/cpu_peer_bench.py (--help).
#
#   CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS=-mno-amx-int8 \
#     -DCMAKE_CXX_FLAGS=-mno-amx-int8" pip install --no-cache-dir --require-hashes --no-binary llama-cpp-python \
#     -r scripts/requirements-cpu-peer.txt                                       # the peer, once
#   cmake -S . -B build -DPAGEDLM_CUDA=OFF -DPAGEDLM_TESTS=OFF && cmake --build build -j2 --target pagedlm
#   scripts/cpu_peer_bench.sh [--threads 2] [--pairs 5] [--quick] [--pagedlm-args "..."]
set -euo pipefail
exec python3 "$(dirname "$0")/cpu_peer_bench.py" "$@"
