// core/device_memory.h for builds without CUDA: there is no device memory to hand out.
// Builds that compile every source with one command line and PAGEDLM_HAS_CUDA
// (scripts/gpu_host/build.sh) also compile this file, and take ops/cuda/device_memory.cu instead.
#ifndef PAGEDLM_HAS_CUDA

#include "pagedlm/core/device_memory.h"
#include "pagedlm/core/error.h"

namespace pagedlm::device_memory {

namespace {
[[noreturn]] void no_cuda() { fail("this build of pagedlm has no CUDA support"); }
}  // namespace

void* allocate(size_t) { no_cuda(); }
void release(void*) noexcept {}
void zero(void*, size_t) { no_cuda(); }
void copy(void*, const void*, size_t) { no_cuda(); }

}  // namespace pagedlm::device_memory

#endif  // PAGEDLM_HAS_CUDA
