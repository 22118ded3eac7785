#!/usr/bin/env bash
# Run on a machine with network: packs the llama.cpp sources that llama-cpp-python 0.3.36 vendors
# (the version of the CPU peer, scripts/requirements-cpu-peer.txt, sha256 checked) into one
# xz tarball small enough to travel to a GPU host with the checkout, for
# scripts/gpu_host/llamacpp_peer.sh. The sdist is 77 MB; what a CUDA build of
# llama-batched-bench and llama-quantize needs is 30 MB, 4.4 MB compressed: the docs, the models'
# vocabularies, tests, examples, the web UI and the ggml backends other than the CPU, CUDA and
# BLAS ones stay behind (none is configured with the peer script's CMake options).
#   scripts/gpu_host/pack_llamacpp.sh OUT.tar.xz
# On the GPU host: tar xJf OUT.tar.xz -C DIR; LLAMACPP_SRC=DIR/llama.cpp scripts/gpu_host/llamacpp_peer.sh ...
set -euo pipefail
out=${1:?usage: pack_llamacpp.sh OUT.tar.xz}
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: --dest "$work" \
  "llama-cpp-python==$version" >&2
sdist=$work/llama_cpp_python-$version.tar.gz
echo "$sha256  $sdist" | sha256sum --check --status ||
  { echo "sha256 mismatch for $(basename "$sdist"): expected $sha256" >&2; exit 1; }
tar xzf "$sdist" -C "$work"
src=$work/llama_cpp_python-$version/vendor/llama.cpp
rm -rf "$src"/{.git,.github,.devops,docs,models,tests,examples,pocs,app,benches,media,ci,tools/ui}
for backend in cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu \
  zdnn zendnn; do
  rm -rf "$src/ggml/src/ggml-$backend"
done
tar cJf "$out" -C "$(dirname "$src")" llama.cpp
echo "$out: llama.cpp from llama-cpp-python $version, $(du -h "$out" | cut -f1)"
