// Device (GPU) memory for Tensor. core/ only declares these functions; the ops layer defines
// them: with the CUDA runtime in ops/cuda/device_memory.cu, or, in builds without CUDA, as
// functions that fail (ops/device_memory_none.cc). That keeps core/ and the other layers below
// ops/ free of CUDA headers and of PAGEDLM_HAS_CUDA. The definitions are plain functions found by
// the linker (CMake puts their object file on each link line), not an implementation registered
// by a static initialiser, which a static library's unreferenced object would never run.
#pragma once

#include <cstddef>

namespace pagedlm::device_memory {

// Returns `bytes` of device memory (a minimal allocation when bytes is 0); throws pagedlm::Error
// when the device is out of memory or the build has no CUDA support.
void* allocate(size_t bytes);

// Frees memory from allocate(). Never throws: it runs in Tensor owners' deleters.
void release(void* p) noexcept;

// Sets `bytes` bytes of device memory to zero.
void zero(void* p, size_t bytes);

// Copies `bytes` bytes between any two of host and device memory (unified addressing tells the
// runtime which is which); returns once the copy is complete.
void copy(void* dst, const void* src, size_t bytes);

}  // namespace pagedlm::device_memory
