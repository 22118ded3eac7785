#!/usr/bin/env bash
# Builds pagedlm on a GPU host that has only the CUDA toolkit and g++ (no CMake packages), from
# the dependencies scripts/gpu_host/pack_deps.sh gathered into .gpu-deps/. Outputs in
# build-gpu/: pagedlm, backend_ops_test, cuda_kernels_test, cuda_e4m3_test, cuda_kquant_lanes_test,
# cuda_model_test, engine_grammar_test, cuda_decode_step_bench, cuda_gemm_bench,
# cuda_attention_bench, cuda_moe_bench, and the Python package (build-gpu/python/pagedlm:
# PYTHONPATH=build-gpu/python) where .gpu-deps/nanobind is. Then e.g.:
# build-gpu/backend_ops_test; build-gpu/pagedlm bench --dummy configs/smollm2-135m.json --device cuda.
# Run from anywhere; JOBS sets the parallelism. ARCHS sets the GPUs, in CMake's spelling (N: SASS
# and PTX, N-real: SASS, N-virtual: PTX only): by default those of the CMake build (SASS for 80,
# 86, 89, 90, 100 and 120 as far as nvcc goes, the newest's PTX too); ARCHS=90 builds for the
# H200 alone, ARCHS=80-virtual only sm_80's PTX (which any later GPU compiles at load).
# BINARY_ONLY=1 builds build-gpu/pagedlm alone (the other side of an A/B, in half the time).
set -euo pipefail
cd "$(dirname "$0")/../.."
deps=$PWD/.gpu-deps
[[ -d $deps ]] || { echo "no .gpu-deps/: run scripts/gpu_host/pack_deps.sh first" >&2; exit 1; }
cuda_home=$(dirname "$(dirname "$(which nvcc)")")
out=build-gpu obj=build-gpu/obj
mkdir -p "$obj"
xg=$deps/xgrammar
inc="-Isrc -I$deps/include -I$deps/gtest/include -I$deps/gtest -I$cuda_home/include"
inc="$inc -I$xg/include -I$xg/3rdparty/picojson -I$xg/3rdparty/dlpack/include"
def="-DPAGEDLM_HAS_CUDA=1 -DPAGEDLM_TESTDATA=\"$PWD/testdata\" -DPAGEDLM_BINARY=\"$PWD/$out/pagedlm\""
def="$def -DXGRAMMAR_ENABLE_CPPTRACE=0 -DXGRAMMAR_ENABLE_INTERNAL_CHECK=0"
# NCCL (tensor parallelism over GPUs): the pinned wheel's files if pack_deps.sh packed them
# (PACK_NCCL=1), else the nvidia-nccl package of the host's Python (PyTorch's).
nccl=$deps/nccl
if [[ ! -f $nccl/include/nccl.h ]]; then
  nccl=$(python3 -c 'import importlib.util as u
s = u.find_spec("nvidia.nccl")
print(list(s.submodule_search_locations)[0] if s else "")' 2>/dev/null || true)
fi
nccl_libs=""
if [[ -n $nccl && -f $nccl/include/nccl.h && -f $nccl/lib/libnccl.so.2 ]]; then
  echo "NCCL: $nccl"
  inc="$inc -I$nccl/include"
  def="$def -DPAGEDLM_HAS_NCCL=1"
  mkdir -p $out/nccl && ln -sf "$nccl/lib/libnccl.so.2" $out/nccl/libnccl.so
  nccl_libs="-L$out/nccl -lnccl -Wl,-rpath,$nccl/lib"
else
  echo "no NCCL found: tensor parallelism over GPUs is off in this build" >&2
fi
# Position-independent code throughout, so that the Python module (a shared object) links the
# same objects as the executables.
export CXX_CMD="g++ -std=c++20 -O2 -march=native -fopenmp -fPIC -w $inc $def"
if [[ -z ${ARCHS:-} ]]; then
  ARCHS="" known=$(nvcc --list-gpu-arch)
  for a in 80 86 89 90 100 120; do
    if grep -qx "compute_$a" <<<"$known"; then ARCHS="$ARCHS $a-real"; fi
  done
  [[ -n $ARCHS ]] || { echo "nvcc knows none of sm_80, 86, 89, 90, 100, 120" >&2; exit 1; }
  newest=${ARCHS##* }
  ARCHS="${ARCHS% *} ${newest%-real}"
fi
# One architecture's -gencode (CMake's spelling: N, N-real, N-virtual).
gencode_of() {
  case $1 in
    *-real) echo "-gencode arch=compute_${1%-real},code=sm_${1%-real}" ;;
    *-virtual) echo "-gencode arch=compute_${1%-virtual},code=compute_${1%-virtual}" ;;
    *) echo "-gencode arch=compute_$1,code=[sm_$1,compute_$1]" ;;
  esac
}
# The wgmma kernels (ops/cuda/attention_hopper.cu) take sm_90a, Hopper's own code, in place of
# sm_90 (CMakeLists.txt does the same).
gencode="" hopper_gencode="" hopper_def=""
for a in $ARCHS; do
  gencode="$gencode $(gencode_of "$a")"
  if [[ $a == 90 || $a == 90-real ]]; then
    hopper_gencode="$hopper_gencode -gencode arch=compute_90a,code=sm_90a"
    hopper_def="-DPAGEDLM_HOPPER_KERNELS=1"
  else
    hopper_gencode="$hopper_gencode $(gencode_of "$a")"
  fi
done
echo "CUDA architectures:$gencode"
nvcc_flags="-std=c++17 -O3 -Xfatbin=-compress-all --expt-relaxed-constexpr -lineinfo -Xcompiler -fPIC -w $inc $def"
export NVCC_CMD="nvcc $gencode $nvcc_flags"
export NVCC_HOPPER_CMD="nvcc $hopper_gencode $hopper_def $nvcc_flags"
export OBJ=$obj
compile() {
  local o=$OBJ/$(echo "$1" | tr / _).o
  case $1 in
    */attention_hopper.cu) $NVCC_HOPPER_CMD -c "$1" -o "$o" ;;
    *.cu) $NVCC_CMD -c "$1" -o "$o" ;;
    */xgrammar/cpp/*) $CXX_CMD -std=c++17 -c "$1" -o "$o" ;;
    *) $CXX_CMD -c "$1" -o "$o" ;;
  esac || echo "COMPILE FAILED $1"
}
export -f compile
objof() { echo "$obj/$(echo "$1" | tr / _).o"; }
lib_srcs=$(find src/pagedlm -name '*.cc' -o -name '*.cu' | grep -v "src/pagedlm/cli/" | sort)
lib_srcs="$lib_srcs $(find "$xg/cpp" -name '*.cc' -not -path '*/tvm_ffi/*' | sort)"
cli_srcs=$(ls src/pagedlm/cli/*.cc)
extra="scripts/gpu_host/blas_stub.cc tests/backend_ops_test.cc tests/cuda_model_test.cc
  tests/engine_grammar_test.cc
  tests/cuda_kernels_test.cu tests/cuda_e4m3_test.cu tests/cuda_kquant_lanes_test.cu
  bench/cuda_decode_step_bench.cc bench/cuda_attention_bench.cu bench/cuda_gemm_bench.cc
  bench/cuda_moe_bench.cc
  $deps/gtest/src/gtest-all.cc $deps/gtest/src/gtest_main.cc"
[[ ${BINARY_ONLY:-0} == 1 ]] && extra="scripts/gpu_host/blas_stub.cc"
printf '%s\n' $lib_srcs $cli_srcs $extra | xargs -P "${JOBS:-$(nproc)}" -I{} bash -c 'compile {}' |
  grep -v '^$' || true
lib=""
for f in $lib_srcs scripts/gpu_host/blas_stub.cc; do lib="$lib $(objof "$f")"; done
cli=""
for f in $cli_srcs; do cli="$cli $(objof "$f")"; done
gtest="$(objof "$deps/gtest/src/gtest-all.cc") $(objof "$deps/gtest/src/gtest_main.cc")"
libs="$deps/lib/libpcre2-8.a $deps/lib/libxxhash.a -L$cuda_home/lib64
  -L$cuda_home/targets/x86_64-linux/lib -lcudart -lcublasLt -lcublas -fopenmp -lpthread $nccl_libs"
g++ -o $out/pagedlm $cli $lib $libs
if [[ ${BINARY_ONLY:-0} == 1 ]]; then
  echo "built $out/pagedlm"
  exit 0
fi
g++ -o $out/backend_ops_test "$(objof tests/backend_ops_test.cc)" $lib $gtest $libs
g++ -o $out/cuda_model_test "$(objof tests/cuda_model_test.cc)" $lib $gtest $libs
g++ -o $out/engine_grammar_test "$(objof tests/engine_grammar_test.cc)" $lib $gtest $libs
g++ -o $out/cuda_kernels_test "$(objof tests/cuda_kernels_test.cu)" $lib $gtest $libs
g++ -o $out/cuda_e4m3_test "$(objof tests/cuda_e4m3_test.cu)" $lib $gtest $libs
g++ -o $out/cuda_kquant_lanes_test "$(objof tests/cuda_kquant_lanes_test.cu)" $lib $gtest $libs
g++ -o $out/cuda_decode_step_bench "$(objof bench/cuda_decode_step_bench.cc)" $lib $libs
g++ -o $out/cuda_attention_bench "$(objof bench/cuda_attention_bench.cu)" $lib $libs
g++ -o $out/cuda_gemm_bench "$(objof bench/cuda_gemm_bench.cc)" $lib $libs
g++ -o $out/cuda_moe_bench "$(objof bench/cuda_moe_bench.cc)" $lib $libs
nb=$deps/nanobind
py_inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
if [[ -d $nb/src && ! -f $py_inc/Python.h ]]; then
  echo "no Python.h under '$py_inc': the Python module is not built" >&2
elif [[ -d $nb/src ]]; then
  ext=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  nb_cmd="$CXX_CMD -fvisibility=hidden -fno-strict-aliasing -I$nb/include
    -I$nb/ext/robin_map/include -I$py_inc"
  $nb_cmd -c "$nb/src/nb_combined.cpp" -o $obj/nanobind.o &
  $nb_cmd -c python/src/module.cc -o $obj/python_module.o
  wait
  mkdir -p $out/python/pagedlm
  cp python/pagedlm/*.py python/pagedlm/py.typed $out/python/pagedlm/
  g++ -shared -o "$out/python/pagedlm/_pagedlm$ext" $obj/python_module.o $obj/nanobind.o $lib $libs
  echo "built $out/python/pagedlm (PYTHONPATH=$out/python)"
fi
echo "built $out/{pagedlm,backend_ops_test,cuda_model_test,engine_grammar_test,cuda_kernels_test,cuda_e4m3_test,cuda_decode_step_bench,cuda_attention_bench,cuda_gemm_bench,cuda_moe_bench}"
