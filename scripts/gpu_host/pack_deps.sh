#!/usr/bin/env bash
# Run on a Debian machine with pagedlm's build dependencies (scripts/install_deps.sh): gathers
# into .gpu-deps/ what a GPU host that has only the CUDA toolkit and a compiler lacks (headers,
# static libraries, the Boost headers the server includes, GoogleTest's sources, xgrammar's
# sources, Llama 3's tokenizer, nanobind).
# Copy the checkout with .gpu-deps/ to the GPU host and run scripts/gpu_host/build.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.gpu-deps
rm -rf "$out" && mkdir -p "$out/include" "$out/lib" "$out/gtest"
arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
cp -r /usr/include/nlohmann /usr/include/CLI "$out/include/"
cp /usr/include/xxhash.h /usr/include/pcre2.h "$out/include/"
# Boost.Beast and Asio are header-only: the Boost headers the server's sources reach (a few MB of
# the 160 MB tree).
g++ -std=c++20 -Isrc -M src/pagedlm/server/*.cc | tr ' \\' '\n\n' | grep '^/usr/include/boost/' |
  sort -u | while read -r h; do
  mkdir -p "$out/include/$(dirname "${h#/usr/include/}")"
  cp "$h" "$out/include/${h#/usr/include/}"
done
blas=/usr/include/"$arch"/openblas-pthread
cp "$blas/cblas.h" "$blas/openblas_config.h" "$out/include/"
cp /usr/lib/"$arch"/libxxhash.a /usr/lib/"$arch"/libpcre2-8.a "$out/lib/"
cp -r /usr/src/googletest/googletest/include /usr/src/googletest/googletest/src "$out/gtest/"
# NCCL from its pinned wheel (330 MB) only when asked: build.sh otherwise takes the GPU host's
# own Python package (PyTorch ships one).
if [[ ${PACK_NCCL:-0} == 1 ]]; then cp -r "$(scripts/fetch_nccl.sh)" "$out/nccl"; fi
# xgrammar's checked sdist (structured output), and Llama 3's 128k tokenizer for
# structured_bench.py: the GPU host reaches no package index.
xg=$(scripts/fetch_xgrammar.sh)
mkdir -p "$out/xgrammar/3rdparty/dlpack"
cp -r "$xg/cpp" "$xg/include" "$out/xgrammar/"
cp -r "$xg/3rdparty/picojson" "$out/xgrammar/3rdparty/"
cp -r "$xg/3rdparty/dlpack/include" "$out/xgrammar/3rdparty/dlpack/"
python3 scripts/gpu_host/structured_bench.py --fetch-tokenizer "$out/llama3-tokenizer.json"
# nanobind (its pinned wheel, scripts/requirements-python.txt) for the Python package's native
# module: its headers and sources, which build.sh compiles beside the module.
nb=$(python3 -c 'import nanobind, os; print(os.path.dirname(nanobind.__file__))' 2>/dev/null ||
  PYTHONPATH=${PAGEDLM_CACHE:-$HOME/.cache/pagedlm}/python-deps python3 -c \
    'import nanobind, os; print(os.path.dirname(nanobind.__file__))')
mkdir -p "$out/nanobind/ext"
cp -r "$nb/include" "$nb/src" "$out/nanobind/"
cp -r "$nb/ext/robin_map" "$out/nanobind/ext/"
du -sh "$out"
