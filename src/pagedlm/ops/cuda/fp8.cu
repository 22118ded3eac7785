// The kernels around an FP8 GEMM (launch_gemm_fp8 in gemm.cu): rows quantized to e4m3 with one
// scale each (a step's input tokens, or a weight's output features once at load), and the
// epilogue that scales unscaled sums where cuBLASLt cannot.

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {
namespace {

using bf16 = __nv_bfloat16;
using detail::ceil_div;
using detail::launch_overlapped;
using detail::wait_for_inputs;

using detail::to_e4m3;

using detail::dynamic_fp8_scale;
using detail::e4m3x8;
using detail::max_abs8;
using detail::scaled_fp8_sum;

constexpr int kQuantizeThreads = 256;

// One block per row, 8 values (16 bytes in, 8 out) per load where cols % 8 == 0, each the e4m3
// of its quotient by the row's scale (detail::to_e4m3). kChunks > 0: each thread keeps its at
// most kChunks loads of 8 in registers between the row's maximum and the quantization, so the
// row is read once (a decode step's rows are a few KB: its 128 launches waited on the second
// read); kChunks == 0 reads the row twice (rows too long for the registers, or unaligned).
template <bool kVec8, int kChunks>
__global__ void __launch_bounds__(kQuantizeThreads)
    quantize_fp8_rows_kernel(const bf16* x, __nv_fp8_storage_t* q, float* scales, int cols,
                             float static_scale, float scale_ub, float min_scale) {
  wait_for_inputs();
  static_assert(kVec8 || kChunks == 0, "registers hold aligned chunks of 8");
  __shared__ float scratch[32];
  const size_t row = blockIdx.x;
  const bf16* src = x + row * cols;
  __nv_fp8_storage_t* dst = q + row * cols;
  float scale = static_scale;
  if constexpr (kChunks > 0) {
    uint4 held[kChunks];
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int i = threadIdx.x + j * kQuantizeThreads;
      held[j] = i < cols / 8 ? reinterpret_cast<const uint4*>(src)[i] : make_uint4(0, 0, 0, 0);
    }
    detail::quantize_held_row_fp8(held, cols, dst, scales + row, static_scale, scale_ub, min_scale,
                                  scratch);
    return;
  }
  if (scale <= 0.f) {
    float amax = 0.f;
    if constexpr (kVec8) {
      for (int i = threadIdx.x; i < cols / 8; i += blockDim.x) {
        amax = max_abs8(reinterpret_cast<const uint4*>(src)[i], amax);
      }
    } else {
      for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        amax = fmaxf(amax, fabsf(__bfloat162float(src[c])));
      }
    }
    scale = dynamic_fp8_scale(amax, scratch, scale_ub, min_scale);
  }
  if constexpr (kVec8) {
    for (int i = threadIdx.x; i < cols / 8; i += blockDim.x) {
      reinterpret_cast<uint2*>(dst)[i] = e4m3x8(reinterpret_cast<const uint4*>(src)[i], scale);
    }
  } else {
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      dst[c] = to_e4m3(__bfloat162float(src[c]), scale);
    }
  }
  if (threadIdx.x == 0) scales[row] = scale;
}

// y[m, n] = y[m, n] * x_scales[m] * w_scales[n] (+ bias[n]), each output once. Rows along the
// grid's y (strided past 65535 rows); kVec8 (n % 8 == 0, 16-byte aligned y and bias): 8 outputs
// a thread, so that no thread divides an index (a scalar version spent most of its time in
// 64-bit divisions and ran at a quarter of copy bandwidth on decode steps).
template <bool kVec8>
__global__ void fp8_scale_epilogue_kernel(bf16* y, const float* x_scales, const float* w_scales,
                                          const bf16* bias, int m, int n) {
  wait_for_inputs();
  const int col = (blockIdx.x * blockDim.x + threadIdx.x) * (kVec8 ? 8 : 1);
  if (col >= n) return;
  float ws[kVec8 ? 8 : 1], b[kVec8 ? 8 : 1];
  if constexpr (kVec8) {
    const float4 w0 = *reinterpret_cast<const float4*>(w_scales + col);
    const float4 w1 = *reinterpret_cast<const float4*>(w_scales + col + 4);
    ws[0] = w0.x, ws[1] = w0.y, ws[2] = w0.z, ws[3] = w0.w;
    ws[4] = w1.x, ws[5] = w1.y, ws[6] = w1.z, ws[7] = w1.w;
    uint4 bias8 = make_uint4(0, 0, 0, 0);
    if (bias != nullptr) bias8 = *reinterpret_cast<const uint4*>(bias + col);
    const auto* bv = reinterpret_cast<const bf16*>(&bias8);
#pragma unroll
    for (int e = 0; e < 8; ++e) b[e] = __bfloat162float(bv[e]);
  } else {
    ws[0] = w_scales[col];
    b[0] = bias != nullptr ? __bfloat162float(bias[col]) : 0.f;
  }
  for (int row = blockIdx.y; row < m; row += gridDim.y) {
    const float xs = x_scales[row];
    bf16* out = y + static_cast<size_t>(row) * n + col;
    if constexpr (kVec8) {
      uint4 packed = *reinterpret_cast<const uint4*>(out);
      auto* v = reinterpret_cast<bf16*>(&packed);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[e] = __float2bfloat16(scaled_fp8_sum(__bfloat162float(v[e]), xs, ws[e], b[e]));
      }
      *reinterpret_cast<uint4*>(out) = packed;
    } else {
      *out = __float2bfloat16(scaled_fp8_sum(__bfloat162float(*out), xs, ws[0], b[0]));
    }
  }
}

}  // namespace

cudaError_t launch_quantize_fp8_rows(const void* x, void* q, float* scales, int rows, int cols,
                                     float static_scale, float scale_ub, float min_scale,
                                     cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || !(min_scale > 0.f)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool vec8 = cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(q) % 8 == 0;
  // The fewest registers that hold a thread's share of the row (a Llama-3.1-8B down projection's
  // 14336 columns: 7 loads of 8).
  const int chunks = vec8 ? ceil_div(cols / 8, kQuantizeThreads) : 0;
  const auto kernel = !vec8          ? quantize_fp8_rows_kernel<false, 0>
                      : chunks <= 2  ? quantize_fp8_rows_kernel<true, 2>
                      : chunks <= 4  ? quantize_fp8_rows_kernel<true, 4>
                      : chunks <= 8  ? quantize_fp8_rows_kernel<true, 8>
                      : chunks <= 16 ? quantize_fp8_rows_kernel<true, 16>
                                     : quantize_fp8_rows_kernel<true, 0>;
  launch_overlapped(kernel, rows, kQuantizeThreads, 0, stream, static_cast<const bf16*>(x),
                    static_cast<__nv_fp8_storage_t*>(q), scales, cols, static_scale, scale_ub,
                    min_scale);
  return cudaGetLastError();
}

cudaError_t launch_fp8_scale_epilogue(void* y, const float* x_scales, const float* w_scales,
                                      const void* bias, int m, int n, cudaStream_t stream) {
  if (m < 0 || n <= 0) return cudaErrorInvalidValue;
  if (m == 0) return cudaSuccess;
  constexpr int kThreads = 128;
  const bool vec8 = n % 8 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(w_scales) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(bias) % 16 == 0;
  const dim3 grid(ceil_div(ceil_div(n, vec8 ? 8 : 1), kThreads), std::min(m, 65535));
  const auto kernel = vec8 ? fp8_scale_epilogue_kernel<true> : fp8_scale_epilogue_kernel<false>;
  launch_overlapped(kernel, grid, kThreads, 0, stream, static_cast<bf16*>(y), x_scales, w_scales,
                    static_cast<const bf16*>(bias), m, n);
  return cudaGetLastError();
}

}  // namespace pagedlm::cuda
