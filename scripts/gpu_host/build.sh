#!/usr/bin/env bash
# Builds pagedlm on a GPU host that has only the CUDA toolkit and g++ (no CMake packages), from
# the dependencies scripts/gpu_host/pack_deps.sh gathered into .gpu-deps/. Outputs in
# build-gpu/: pagedlm, backend_ops_test, cuda_kernels_test, cuda_model_test,
# cuda_decode_step_bench, cuda_gemm_bench, cuda_attention_bench. Then e.g.:
# build-gpu/backend_ops_test; build-gpu/pagedlm bench --dummy configs/smollm2-135m.json --device cuda.
# Run from anywhere; JOBS sets the parallelism.
set -euo pipefail
cd "$(dirname "$0")/../.."
deps=$PWD/.gpu-deps
[[ -d $deps ]] || { echo "no .gpu-deps/: run scripts/gpu_host/pack_deps.sh first" >&2; exit 1; }
cuda_home=$(dirname "$(dirname "$(which nvcc)")")
out=build-gpu obj=build-gpu/obj
mkdir -p "$obj"
inc="-Isrc -I$deps/include -I$deps/gtest/include -I$deps/gtest -I$cuda_home/include"
def="-DPAGEDLM_HAS_CUDA=1 -DPAGEDLM_TESTDATA=\"$PWD/testdata\" -DPAGEDLM_BINARY=\"$PWD/$out/pagedlm\""
export CXX_CMD="g++ -std=c++20 -O2 -march=native -fopenmp -w $inc $def"
export NVCC_CMD="nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -lineinfo -w $inc $def"
export OBJ=$obj
compile() {
  local o=$OBJ/$(echo "$1" | tr / _).o
  case $1 in
    *.cu) $NVCC_CMD -c "$1" -o "$o" ;;
    *) $CXX_CMD -c "$1" -o "$o" ;;
  esac || echo "COMPILE FAILED $1"
}
export -f compile
objof() { echo "$obj/$(echo "$1" | tr / _).o"; }
lib_srcs=$(find src/pagedlm -name '*.cc' -o -name '*.cu' | grep -v "src/pagedlm/cli/" | sort)
cli_srcs=$(ls src/pagedlm/cli/*.cc)
extra="scripts/gpu_host/blas_stub.cc tests/backend_ops_test.cc tests/cuda_model_test.cc
  tests/cuda_kernels_test.cu
  bench/cuda_decode_step_bench.cc bench/cuda_attention_bench.cu bench/cuda_gemm_bench.cc
  $deps/gtest/src/gtest-all.cc $deps/gtest/src/gtest_main.cc"
printf '%s\n' $lib_srcs $cli_srcs $extra | xargs -P "${JOBS:-$(nproc)}" -I{} bash -c 'compile {}' |
  grep -v '^$' || true
lib=""
for f in $lib_srcs scripts/gpu_host/blas_stub.cc; do lib="$lib $(objof "$f")"; done
cli=""
for f in $cli_srcs; do cli="$cli $(objof "$f")"; done
gtest="$(objof "$deps/gtest/src/gtest-all.cc") $(objof "$deps/gtest/src/gtest_main.cc")"
libs="$deps/lib/libpcre2-8.a $deps/lib/libxxhash.a -L$cuda_home/lib64
  -L$cuda_home/targets/x86_64-linux/lib -lcudart -lcublasLt -lcublas -fopenmp -lpthread"
g++ -o $out/pagedlm $cli $lib $libs
g++ -o $out/backend_ops_test "$(objof tests/backend_ops_test.cc)" $lib $gtest $libs
g++ -o $out/cuda_model_test "$(objof tests/cuda_model_test.cc)" $lib $gtest $libs
g++ -o $out/cuda_kernels_test "$(objof tests/cuda_kernels_test.cu)" $lib $gtest $libs
g++ -o $out/cuda_decode_step_bench "$(objof bench/cuda_decode_step_bench.cc)" $lib $libs
g++ -o $out/cuda_attention_bench "$(objof bench/cuda_attention_bench.cu)" $lib $libs
g++ -o $out/cuda_gemm_bench "$(objof bench/cuda_gemm_bench.cc)" $lib $libs
echo "built $out/{pagedlm,backend_ops_test,cuda_model_test,cuda_kernels_test,cuda_decode_step_bench,cuda_attention_bench,cuda_gemm_bench}"
