// One row's residual add and RMSNorm in a thread block, held in registers between its two passes:
// the body of the add_rms_norm kernel (fused.cu) and the epilogue by which a projection's last
// thread block norms the row it has just finished (blocks.cu), so that both give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstddef>
#include <cstdint>

#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda::detail {

// 8 bf16 <-> 8 floats (one 16-byte load or store of bf16).
__device__ __forceinline__ void bf16x8_to_float(const uint4& packed, float* f) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 v = __bfloat1622float2(pairs[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}
__device__ __forceinline__ uint4 float_to_bf16x8(const float* f) {
  uint4 packed;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int j = 0; j < 4; ++j) pairs[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return packed;
}

// The next FP8 projection's input (Fp8RowsOut) from a row the block holds in registers, as
// launch_quantize_fp8_rows codes it. Every thread calls it.
template <int kChunks>
__device__ __forceinline__ void fp8_rows_out(const uint4 (&held)[kChunks], int dim,
                                             const Fp8RowsOut& q, size_t row, float* scratch) {
  quantize_held_row_fp8(held, dim, static_cast<__nv_fp8_storage_t*>(q.values) + row * dim,
                        q.scales + row, q.static_scale, q.scale_ub, q.min_scale, scratch);
}

// 8 values of an FP8 GEMM's unscaled output row (Fp8Unscaled), columns col .. col + 7, scaled in
// place as the epilogue kernel would scale them.
__device__ __forceinline__ void scale_unscaled8(float* v, float x_scale, const float* w_scales,
                                                int col) {
  const float4 w0 = *reinterpret_cast<const float4*>(w_scales + col);
  const float4 w1 = *reinterpret_cast<const float4*>(w_scales + col + 4);
  const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = scaled_fp8_sum(v[j], x_scale, w[j], 0.f);
}

// The widest row: kNormRowChunks loads of 8 for each of kNormRowThreads threads
// (norm_fuses_fp8, norm_row_fits).
constexpr int kNormRowThreads = 256, kNormRowChunks = 4;
// Whether add_rms_norm_row takes rows of dim values in kNormRowThreads threads.
__host__ __device__ constexpr bool norm_row_fits(int64_t dim) {
  return dim > 0 && dim % 8 == 0 && dim <= 8 * kNormRowChunks * kNormRowThreads;
}

// residual[row] += x[row] (x null: nothing added, the residual not written); out[row] =
// rms_norm(residual[row]) * (weight_offset + weight), for dim % 8 == 0 and dim <= 8 * kChunks *
// blockDim.x (a one-dimensional block; every thread calls it). Each thread keeps its chunks of 8
// values in registers between the two passes, so the row is read and written once. Each
// element's formula is the scalar kernel's (fused.cu); the sum of squares adds in another order.
// kUnscaled: x is an FP8 GEMM's unscaled output (Fp8Unscaled); kFp8Out: the output is also
// written as e4m3 rows (Fp8RowsOut); kXFromThisGrid: other blocks of the calling kernel wrote x,
// so it is read from L2 (ld.global.cg), past any line of it this SM's L1 might hold. scratch:
// >= 32 floats of shared memory.
template <int kChunks, bool kUnscaled = false, bool kFp8Out = false, bool kXFromThisGrid = false>
__device__ __forceinline__ void add_rms_norm_row(size_t row, float* residual,
                                                 const __nv_bfloat16* x,
                                                 const __nv_bfloat16* weight, __nv_bfloat16* out,
                                                 int dim, float eps, float weight_offset,
                                                 const Fp8Unscaled& x_unscaled,
                                                 const Fp8RowsOut& fp8_out, float* scratch) {
  const size_t base = row * dim;
  float* res = residual + base;
  // Read before the first barrier: fp8_out may overwrite it (the same scratch).
  const float x_scale = kUnscaled ? x_unscaled.x_scales[row] : 0.f;
  float v[kChunks][8];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i = (threadIdx.x + c * blockDim.x) * 8;
    if (i >= dim) break;
    const float4 lo = *reinterpret_cast<const float4*>(res + i);
    const float4 hi = *reinterpret_cast<const float4*>(res + i + 4);
    float* r = v[c];
    r[0] = lo.x;
    r[1] = lo.y;
    r[2] = lo.z;
    r[3] = lo.w;
    r[4] = hi.x;
    r[5] = hi.y;
    r[6] = hi.z;
    r[7] = hi.w;
    if (x != nullptr) {
      const auto* xi = reinterpret_cast<const uint4*>(x + base + i);
      float xf[8];
      if constexpr (kXFromThisGrid) {
        bf16x8_to_float(__ldcg(xi), xf);
      } else {
        bf16x8_to_float(*xi, xf);
      }
      if constexpr (kUnscaled) scale_unscaled8(xf, x_scale, x_unscaled.w_scales, i);
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] += xf[j];
      *reinterpret_cast<float4*>(res + i) = make_float4(r[0], r[1], r[2], r[3]);
      *reinterpret_cast<float4*>(res + i + 4) = make_float4(r[4], r[5], r[6], r[7]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += r[j] * r[j];
  }
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / dim + eps);
  uint4 held[kFp8Out ? kChunks : 1];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i = (threadIdx.x + c * blockDim.x) * 8;
    if (i >= dim) break;
    float w[8], y[8];
    bf16x8_to_float(*reinterpret_cast<const uint4*>(weight + i), w);
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = v[c][j] * inv * (weight_offset + w[j]);
    const uint4 packed = float_to_bf16x8(y);
    *reinterpret_cast<uint4*>(out + base + i) = packed;
    if constexpr (kFp8Out) held[c] = packed;
  }
  if constexpr (kFp8Out) fp8_rows_out(held, dim, fp8_out, row, scratch);
}

}  // namespace pagedlm::cuda::detail
