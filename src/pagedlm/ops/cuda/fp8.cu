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

using detail::to_e4m3;

constexpr float kE4m3Max = 448.f;
constexpr int kQuantizeThreads = 256;

// One block per row, 8 values (16 bytes in, 8 out) per load where cols % 8 == 0, each the e4m3
// of its quotient by the row's scale (detail::to_e4m3).
template <bool kVec8>
__global__ void __launch_bounds__(kQuantizeThreads)
    quantize_fp8_rows_kernel(const bf16* x, __nv_fp8_storage_t* q, float* scales, int cols,
                             float static_scale, float scale_ub, float min_scale) {
  __shared__ float scratch[32];
  const size_t row = blockIdx.x;
  const bf16* src = x + row * cols;
  __nv_fp8_storage_t* dst = q + row * cols;
  float scale = static_scale;
  if (scale <= 0.f) {
    float amax = 0.f;
    if constexpr (kVec8) {
      for (int i = threadIdx.x; i < cols / 8; i += blockDim.x) {
        const uint4 packed = reinterpret_cast<const uint4*>(src)[i];
        const auto* v = reinterpret_cast<const bf16*>(&packed);
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(__bfloat162float(v[j])));
      }
    } else {
      for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        amax = fmaxf(amax, fabsf(__bfloat162float(src[c])));
      }
    }
    amax = detail::block_max(amax, scratch);
    if (scale_ub > 0.f) amax = fminf(amax, scale_ub);
    scale = fmaxf(amax / kE4m3Max, min_scale);
  }
  if constexpr (kVec8) {
    for (int i = threadIdx.x; i < cols / 8; i += blockDim.x) {
      const uint4 packed = reinterpret_cast<const uint4*>(src)[i];
      const auto* v = reinterpret_cast<const bf16*>(&packed);
      uint2 out;
      auto* o = reinterpret_cast<__nv_fp8_storage_t*>(&out);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = to_e4m3(__bfloat162float(v[j]), scale);
      reinterpret_cast<uint2*>(dst)[i] = out;
    }
  } else {
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      dst[c] = to_e4m3(__bfloat162float(src[c]), scale);
    }
  }
  if (threadIdx.x == 0) scales[row] = scale;
}

// y[m, n] = y[m, n] * x_scales[m] * w_scales[n] (+ bias[n]), each output once.
__global__ void fp8_scale_epilogue_kernel(bf16* y, const float* x_scales, const float* w_scales,
                                          const bf16* bias, int m, int n) {
  const size_t total = static_cast<size_t>(m) * n;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(i / n), col = static_cast<int>(i % n);
    float v = __bfloat162float(y[i]) * (x_scales[row] * w_scales[col]);
    if (bias != nullptr) v += __bfloat162float(bias[col]);
    y[i] = __float2bfloat16(v);
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
  const auto kernel = vec8 ? quantize_fp8_rows_kernel<true> : quantize_fp8_rows_kernel<false>;
  kernel<<<rows, kQuantizeThreads, 0, stream>>>(static_cast<const bf16*>(x),
                                                static_cast<__nv_fp8_storage_t*>(q), scales, cols,
                                                static_scale, scale_ub, min_scale);
  return cudaGetLastError();
}

cudaError_t launch_fp8_scale_epilogue(void* y, const float* x_scales, const float* w_scales,
                                      const void* bias, int m, int n, cudaStream_t stream) {
  if (m < 0 || n <= 0) return cudaErrorInvalidValue;
  if (m == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const unsigned blocks = std::min(ceil_div(static_cast<int64_t>(m) * n, kThreads), 65535u);
  fp8_scale_epilogue_kernel<<<blocks, kThreads, 0, stream>>>(
      static_cast<bf16*>(y), x_scales, w_scales, static_cast<const bf16*>(bias), m, n);
  return cudaGetLastError();
}

}  // namespace pagedlm::cuda
