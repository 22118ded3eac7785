// core/device_memory.h on the CUDA runtime.

#include <cuda_runtime.h>

#include "pagedlm/core/device_memory.h"
#include "pagedlm/core/error.h"
#include "pagedlm/ops/cuda/check.h"

namespace pagedlm::device_memory {

void* allocate(size_t bytes) {
  void* p = nullptr;
  // cudaMalloc(0) returns a null pointer, which Tensor would take for "no data".
  const cudaError_t err = cudaMalloc(&p, bytes == 0 ? 256 : bytes);
  PAGEDLM_CHECK(err == cudaSuccess, "cudaMalloc of ", bytes,
                " bytes failed: ", cudaGetErrorString(err));
  return p;
}

void release(void* p) noexcept { cudaFree(p); }

void zero(void* p, size_t bytes) { cuda::check(cudaMemset(p, 0, bytes), "cudaMemset"); }

void copy(void* dst, const void* src, size_t bytes) {
  cuda::check(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
}

}  // namespace pagedlm::device_memory
