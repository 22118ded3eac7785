// Dense projection y = x W^T + b, the only matmul the models need.
#pragma once

#include <cstdint>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// The CPU kernel always multiplies tiles of exactly this many rows (see linear_cpu.cc for why).
inline constexpr int64_t kLinearRowTile = 16;

// x: [n_tokens, in], weight: [out_features, in] (HF layout), bias: [out_features] or an
// undefined Tensor, out: [n_tokens, out_features]. All in the compute dtype, except that out may
// be f32 (then without a bias): the logits, which need no rounding to the compute dtype.
// Batch invariant: each output row is bitwise the same whatever other rows share the call.
void linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
            void* stream = nullptr);

// The same with the weight in ggml blocks (CPU, f32 x / bias / out). With AVX-512, one
// register-blocked micro-kernel (4 rows x 4 weight rows) computes every step: a step of up to 4
// rows feeds it blocks expanded in registers, so it streams the blocks instead of float32; a
// larger one first expands panels of 8 weight rows to float32, once per step, and multiplies all
// its rows with them. Batch invariant as well: every output is defined by one arithmetic (its
// own 16-lane accumulation over the blocks in order, summed as a tree; see linear_cpu.cc) that
// every kernel and the portable loops reproduce bit for bit.
void linear(const Tensor& x, const QuantizedMatrix& weight, const Tensor& bias, const Tensor& out);

namespace cpu {
// bias may be null.
void linear(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
            int64_t out_features, int64_t in_features);
void linear(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
            int64_t rows);
// The same with the portable block kernel (plain loops), which machines without AVX2 + FMA +
// F16C run; exposed so that tests hold the SIMD kernels to it bit for bit.
void linear_portable(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
                     int64_t rows);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as cpu::linear; x, weight and bias hold `dtype` elements, out `out_dtype` ones.
void linear(const void* x, const void* weight, const void* bias, void* out, int64_t rows,
            int64_t out_features, int64_t in_features, DType dtype, DType out_dtype, void* stream);
// While on, every prefill-sized GEMM shape the process meets for the first time is timed with
// cuBLASLt's first few candidate algorithms and keeps the fastest (start-up only: see
// gemm_set_tuning).
void set_linear_tuning(bool on);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
