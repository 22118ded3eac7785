// The GPU's kernels for GGUF block weights (ops/linear_blocks.h): a matrix-vector product that
// expands blocks in registers (decode), and the expansion of a whole matrix to bf16 (prefill,
// before a GEMM). Both read the blocks as the file lays them out.
//
// Work unit: a quarter of a 32-weight block, 8 consecutive weights, which every format here
// yields from one 8-byte load (Q8_0: 8 int8; Q4_0 / Q4_1: the low or high nibbles of 8 bytes)
// and which meet 8 bf16 activations in one 16-byte load. The lanes of a warp take consecutive
// quarters, so a warp reads 8 whole blocks of a weight row side by side per iteration.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/linear_blocks.h"

namespace pagedlm::ops::cuda {
namespace {

using bf16 = __nv_bfloat16;
using ::pagedlm::cuda::detail::ceil_div;
using ::pagedlm::cuda::detail::warp_sum;

constexpr int kWarpsPerBlock = 4;  // output features per thread block of the matrix-vector kernel

__device__ __forceinline__ float load_f16(const uint8_t* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}

// 8 bytes from a 2-byte aligned address (a block's fields are no more aligned than that: Q8_0's
// blocks are 34 bytes, Q4_0's 18).
__device__ __forceinline__ uint2 load8(const uint8_t* p) {
  const auto* h = reinterpret_cast<const uint16_t*>(p);
  return make_uint2(h[0] | (static_cast<uint32_t>(h[1]) << 16),
                    h[2] | (static_cast<uint32_t>(h[3]) << 16));
}

__device__ __forceinline__ int byte_of(uint2 v, int j) {
  return static_cast<int>(((j < 4 ? v.x : v.y) >> (8 * (j & 3))) & 0xffu);
}

// Weights 8 * part .. 8 * part + 7 of a block, as ggml dequantizes them (ggml-quants.c).
template <QuantType kType>
__device__ __forceinline__ void dequantize_quarter(const uint8_t* block, int part, float* w) {
  if constexpr (kType == QuantType::kQ8_0) {
    const float d = load_f16(block);
    const uint2 q = load8(block + 2 + 8 * part);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = static_cast<float>(static_cast<int8_t>(byte_of(q, j))) * d;
  } else {
    // Weight j (< 16): the low nibble of byte j; weight j + 16: its high nibble.
    constexpr int kQs = kType == QuantType::kQ4_1 ? 4 : 2;
    const uint2 q = load8(block + kQs + 8 * (part & 1));
    const int shift = part < 2 ? 0 : 4;
    const float d = load_f16(block);
    if constexpr (kType == QuantType::kQ4_1) {
      const float m = load_f16(block + 2);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        w[j] = static_cast<float>((byte_of(q, j) >> shift) & 0xf) * d + m;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        w[j] = static_cast<float>(((byte_of(q, j) >> shift) & 0xf) - 8) * d;
      }
    }
  }
}

// One warp per output feature n, all kRows rows of x at once (each weight read once): lane l takes
// quarters l, l + 32, ... of row n's blocks and accumulates w * x in f32 per row, then the warp
// sums its lanes. The order of every output's additions depends on in_features only, not on
// kRows or on the other rows.
template <QuantType kType, int kRows>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    block_matvec_kernel(const bf16* x, const uint8_t* blocks, const bf16* bias, void* out,
                        bool out_f32, int out_features, int in_features, int64_t out_stride) {
  const int n = blockIdx.x * kWarpsPerBlock + static_cast<int>(threadIdx.y);
  if (n >= out_features) return;  // a whole warp: no block-wide synchronization follows
  constexpr int kBytes = static_cast<int>(quant_block_bytes(kType));
  const int quarters = in_features / 32 * 4;
  const uint8_t* row = blocks + static_cast<int64_t>(n) * (in_features / 32) * kBytes;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  for (int i = static_cast<int>(threadIdx.x); i < quarters; i += 32) {
    float w[8];
    dequantize_quarter<kType>(row + (i >> 2) * kBytes, i & 3, w);
    const int k0 = (i >> 2) * 32 + (i & 3) * 8;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const uint4 packed =
          *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r) * in_features + k0);
      const auto* xv = reinterpret_cast<const bf16*>(&packed);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[r] = fmaf(w[j], __bfloat162float(xv[j]), acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = warp_sum(acc[r]);
  if (threadIdx.x != 0) return;
  const float b = bias != nullptr ? __bfloat162float(bias[n]) : 0.f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t at = r * out_stride + n;
    if (out_f32) {
      static_cast<float*>(out)[at] = acc[r];
    } else {
      static_cast<bf16*>(out)[at] = __float2bfloat16(acc[r] + b);
    }
  }
}

// One thread per quarter block: 8 weights, one 16-byte store.
template <QuantType kType>
__global__ void dequantize_blocks_kernel(const uint8_t* blocks, bf16* dense, int64_t quarters) {
  constexpr int kBytes = static_cast<int>(quant_block_bytes(kType));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < quarters;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float w[8];
    dequantize_quarter<kType>(blocks + (i >> 2) * kBytes, static_cast<int>(i & 3), w);
    uint4 packed;
    auto* o = reinterpret_cast<bf16*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = __float2bfloat16(w[j]);
    reinterpret_cast<uint4*>(dense)[i] = packed;  // quarter i is weights 8i .. 8i + 7 of dense
  }
}

template <QuantType kType, int kRows>
cudaError_t launch_matvec_rows(const void* x, const void* blocks, const void* bias, void* out,
                               bool out_f32, int rows, int out_features, int in_features,
                               int64_t out_stride, cudaStream_t stream) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      return launch_matvec_rows<kType, kRows - 1>(x, blocks, bias, out, out_f32, rows, out_features,
                                                  in_features, out_stride, stream);
    }
  }
  const dim3 threads(32, kWarpsPerBlock);
  block_matvec_kernel<kType, kRows><<<ceil_div(out_features, kWarpsPerBlock), threads, 0, stream>>>(
      static_cast<const bf16*>(x), static_cast<const uint8_t*>(blocks),
      static_cast<const bf16*>(bias), out, out_f32, out_features, in_features, out_stride);
  return cudaGetLastError();
}

template <QuantType kType>
cudaError_t launch_matvec(const void* x, const void* blocks, const void* bias, void* out,
                          bool out_f32, int rows, int out_features, int in_features,
                          int64_t out_stride, cudaStream_t stream) {
  static_assert(kBlockMatvecMaxRows == 8, "launch_matvec_rows starts at kBlockMatvecMaxRows");
  return launch_matvec_rows<kType, 8>(x, blocks, bias, out, out_f32, rows, out_features,
                                      in_features, out_stride, stream);
}

template <QuantType kType>
cudaError_t launch_dequantize(const void* blocks, void* dense, int64_t quarters,
                              cudaStream_t stream) {
  constexpr int kThreads = 256;
  const unsigned grid = std::min<unsigned>(ceil_div(quarters, kThreads), 65535u * 16);
  dequantize_blocks_kernel<kType><<<grid, kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(blocks), static_cast<bf16*>(dense), quarters);
  return cudaGetLastError();
}

}  // namespace

void linear_blocks(const void* x, const void* blocks, QuantType type, const void* bias, void* out,
                   bool out_f32, int64_t rows, int64_t out_features, int64_t in_features,
                   int64_t out_stride, void* stream) {
  if (rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const auto r = static_cast<int>(rows), n = static_cast<int>(out_features),
             k = static_cast<int>(in_features);
  cudaError_t err = cudaErrorInvalidValue;
  switch (type) {
    case QuantType::kQ8_0:
      err = launch_matvec<QuantType::kQ8_0>(x, blocks, bias, out, out_f32, r, n, k, out_stride, s);
      break;
    case QuantType::kQ4_0:
      err = launch_matvec<QuantType::kQ4_0>(x, blocks, bias, out, out_f32, r, n, k, out_stride, s);
      break;
    case QuantType::kQ4_1:
      err = launch_matvec<QuantType::kQ4_1>(x, blocks, bias, out, out_f32, r, n, k, out_stride, s);
      break;
    default:
      break;
  }
  ::pagedlm::cuda::check(err, "linear (GGUF blocks)");
}

void dequantize_blocks(const void* blocks, QuantType type, void* dense, int64_t out_features,
                       int64_t in_features, void* stream) {
  const int64_t quarters = out_features * in_features / 8;
  if (quarters == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaErrorInvalidValue;
  switch (type) {
    case QuantType::kQ8_0:
      err = launch_dequantize<QuantType::kQ8_0>(blocks, dense, quarters, s);
      break;
    case QuantType::kQ4_0:
      err = launch_dequantize<QuantType::kQ4_0>(blocks, dense, quarters, s);
      break;
    case QuantType::kQ4_1:
      err = launch_dequantize<QuantType::kQ4_1>(blocks, dense, quarters, s);
      break;
    default:
      break;
  }
  ::pagedlm::cuda::check(err, "dequantize_blocks");
}

}  // namespace pagedlm::ops::cuda
