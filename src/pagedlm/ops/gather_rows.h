// Row gather, e.g. the stream rows that produce logits (StepPlan::logits_rows).
#pragma once

#include <cstdint>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// x: [n_rows, dim], rows: [n_out] i32 (x's device), out: [n_out, dim]; out[i] = x[rows[i]].
// x and out share a dtype: the compute dtype or f32 (the residual stream).
// Throws an Error naming the first row index outside [0, n_rows) (checked on the CPU only).
void gather_rows(const Tensor& x, const Tensor& rows, const Tensor& out, void* stream = nullptr);

namespace cpu {
void gather_rows(const float* x, const int32_t* rows, float* out, int64_t n_rows, int64_t n_out,
                 int64_t dim);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as cpu::gather_rows; x and out hold `dtype` elements. Rows were not checked.
void gather_rows(const void* x, const int32_t* rows, void* out, int64_t n_rows, int64_t n_out,
                 int64_t dim, DType dtype, void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
