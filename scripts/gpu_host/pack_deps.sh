#!/usr/bin/env bash
# Run on a Debian machine with pagedlm's build dependencies (scripts/install_deps.sh): gathers
# into .gpu-deps/ what a GPU host that has only the CUDA toolkit and a compiler lacks (headers,
# static libraries, the Boost headers the server includes, GoogleTest's sources).
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
du -sh "$out"
