// The partial-page prefix-hit copy (ops/copy_kv.h): one block per (copy, slot), moving both
// caches' rows for that slot, 16 bytes per thread and step when rows allow it (every supported
// head size: head_dim >= 64 bf16 values is 128 bytes), byte by byte otherwise.

#include <cuda_runtime.h>

#include <cstdint>

#include "pagedlm/ops/copy_kv.h"
#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {
namespace {

template <typename Unit>
__global__ void copy_kv_slots_kernel(char* k_cache, char* v_cache, const int32_t* copies,
                                     int page_size, int64_t row_units) {
  const int32_t* copy = copies + 3 * blockIdx.x;
  const int slot = blockIdx.y;
  if (slot >= copy[2]) return;
  const int64_t src = (static_cast<int64_t>(copy[0]) * page_size + slot) * row_units;
  const int64_t dst = (static_cast<int64_t>(copy[1]) * page_size + slot) * row_units;
  Unit* k = reinterpret_cast<Unit*>(k_cache);
  Unit* v = reinterpret_cast<Unit*>(v_cache);
  for (int64_t i = threadIdx.x; i < row_units; i += blockDim.x) {
    k[dst + i] = k[src + i];
    v[dst + i] = v[src + i];
  }
}

}  // namespace

cudaError_t launch_copy_kv_slots(void* k_cache, void* v_cache, const int32_t* copies,
                                 int num_copies, int page_size, int64_t row_bytes,
                                 cudaStream_t stream) {
  if (num_copies == 0) return cudaSuccess;
  if (num_copies < 0 || page_size <= 0 || row_bytes <= 0) return cudaErrorInvalidValue;
  const dim3 grid(num_copies, page_size);
  constexpr int kThreads = 128;
  char* k = static_cast<char*>(k_cache);
  char* v = static_cast<char*>(v_cache);
  if (row_bytes % 16 == 0) {
    copy_kv_slots_kernel<uint4>
        <<<grid, kThreads, 0, stream>>>(k, v, copies, page_size, row_bytes / 16);
  } else {
    copy_kv_slots_kernel<char><<<grid, kThreads, 0, stream>>>(k, v, copies, page_size, row_bytes);
  }
  return cudaGetLastError();
}

}  // namespace pagedlm::cuda

namespace pagedlm::ops::cuda {

void copy_kv_slots(void* k_cache, void* v_cache, const int32_t* copies, int64_t num_copies,
                   int64_t page_size, int64_t row_bytes, void* stream) {
  ::pagedlm::cuda::check(
      ::pagedlm::cuda::launch_copy_kv_slots(k_cache, v_cache, copies, static_cast<int>(num_copies),
                                            static_cast<int>(page_size), row_bytes,
                                            static_cast<cudaStream_t>(stream)),
      "copy_kv_slots");
}

}  // namespace pagedlm::ops::cuda
