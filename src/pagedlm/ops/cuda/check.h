// Turns a CUDA launcher's error into a pagedlm::Error, for host code above the raw kernels.
#pragma once

#include <cuda_runtime.h>

#include <string_view>

#include "pagedlm/core/error.h"

namespace pagedlm::cuda {

inline void check(cudaError_t err, std::string_view what) {
  if (err != cudaSuccess)
    fail(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

}  // namespace pagedlm::cuda
