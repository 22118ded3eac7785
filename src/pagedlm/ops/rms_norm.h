// RMSNorm, plain and fused with the residual add that precedes it in every pre-norm block.
#pragma once

#include <cstdint>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/linear_fp8.h"

namespace pagedlm::ops {

// Every norm here multiplies by (weight_offset + weight), the sum computed in f32: 0 for the
// Llama-style norms, 1 for Gemma's, whose RMSNorm scales by 1 + w in float32 (folding 1 into
// bf16 weights would round it).

// x: [rows, dim], weight: [dim], out: [rows, dim] (may alias x); weight and out in the compute
// dtype, x in the compute dtype or f32 (the residual stream, f32 on every device).
// out = x / sqrt(mean(x^2) + eps) * (weight_offset + weight). For Qwen3's per-head q/k norm the
// caller reshapes [n_tokens, n_heads * head_dim] to [n_tokens * n_heads, head_dim].
// fp8_out (GPU, f32 x, norm_fuses_fp8(dim)): out's rows also as an FP8 projection's input.
void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out,
              void* stream = nullptr, float weight_offset = 0.f, const Fp8RowsOut& fp8_out = {});

// residual: [rows, dim] f32 in/out, x: [rows, dim], weight: [dim], out: [rows, dim] in the
// compute dtype. residual += x; out = rms_norm(residual). Fused so the residual stream is read
// once. The residual is f32 on every device: in bf16 the running sum would be rounded at every
// add, the largest avoidable error of bf16 compute.
// x_unscaled and fp8_out (GPU, norm_fuses_fp8(dim)): x is an FP8 projection's unscaled output,
// and out's rows are also written as the next FP8 projection's input (ops/linear_fp8.h).
void add_rms_norm(const Tensor& residual, const Tensor& x, const Tensor& weight, float eps,
                  const Tensor& out, void* stream = nullptr, float weight_offset = 0.f,
                  const Fp8Unscaled& x_unscaled = {}, const Fp8RowsOut& fp8_out = {});

// Qwen3's per-head q/k norm inside a fused projection: x: [rows, width] in the compute dtype;
// in every row, heads first_head .. first_head + num_heads - 1 (head_dim wide each, counted from
// the row's start) are normalized in place with weight: [head_dim].
void head_rms_norm(const Tensor& x, int64_t first_head, int64_t num_heads, int64_t head_dim,
                   const Tensor& weight, float eps, void* stream = nullptr,
                   float weight_offset = 0.f);

namespace cpu {
void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps,
              float weight_offset);
void head_rms_norm(float* x, int64_t rows, int64_t width, int64_t first_head, int64_t num_heads,
                   int64_t head_dim, const float* weight, float eps, float weight_offset);
void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows,
                  int64_t dim, float eps, float weight_offset);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contracts as the cpu:: functions; weight, out and add_rms_norm's x hold `dtype`
// elements, rms_norm's x holds `x_dtype` ones (`dtype` or f32).
void rms_norm(const void* x, DType x_dtype, const void* weight, void* out, int64_t rows,
              int64_t dim, float eps, float weight_offset, DType dtype, void* stream,
              const Fp8RowsOut& fp8_out = {});
void add_rms_norm(float* residual, const void* x, const void* weight, void* out, int64_t rows,
                  int64_t dim, float eps, float weight_offset, DType dtype, void* stream,
                  const Fp8Unscaled& x_unscaled = {}, const Fp8RowsOut& fp8_out = {});
void head_rms_norm(void* x, int64_t rows, int64_t width, int64_t first_head, int64_t num_heads,
                   int64_t head_dim, const void* weight, float eps, float weight_offset,
                   DType dtype, void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
