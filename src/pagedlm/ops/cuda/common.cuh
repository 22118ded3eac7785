// Device helpers shared by the CUDA kernels (no engine headers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda::detail {

#define PAGEDLM_CUDA_TRY(expr)            \
  do {                                    \
    cudaError_t err_ = (expr);            \
    if (err_ != cudaSuccess) return err_; \
  } while (0)

// A switch for same-binary comparisons: on unless the environment variable `name` is "0". Read
// each time it is called: callers keep the answer in a static.
inline bool env_switch_on(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::string(v) != "0";
}

// Programmatic dependent launch (sm_90 on). A decode step is hundreds of short kernels, each of
// which would otherwise start only after the one before it has drained and the next launch has
// ramped up. A kernel launched by launch_overlapped() may be scheduled while the kernel before it
// in the stream is still running; it calls wait_for_inputs() before it touches any global memory
// that an earlier kernel writes or reads (only constant data, such as weights, may be read
// before). The wait returns once the earlier kernels have completed with their writes visible,
// and then lets the next kernel in the stream be scheduled in turn. Before sm_90 it compiles to
// nothing, and the launches are plain ones (overlapped_launches()).
__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The launch configuration of launch_overlapped(): `overlap` is the attribute it points to.
inline cudaLaunchConfig_t overlapped_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                            cudaLaunchAttribute* overlap) {
  overlap->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap->val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = overlapped_launches() ? 1 : 0;
  return config;
}

// What `kernel<<<grid, block, smem, stream>>>(args...)` does, with the launch allowed to overlap
// the kernel before it where overlapped_launches() says so. Every kernel launched so calls
// wait_for_inputs() first. Returns the launch error (also left for cudaGetLastError).
template <typename... Params, typename... Args>
cudaError_t launch_overlapped(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute overlap{};
  const cudaLaunchConfig_t config = overlapped_config(grid, block, smem, stream, &overlap);
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// The same for a kernel known by its address, with its arguments as cudaLaunchKernel takes them.
inline cudaError_t launch_overlapped(const void* kernel, dim3 grid, dim3 block, void** args,
                                     size_t smem, cudaStream_t stream) {
  cudaLaunchAttribute overlap{};
  const cudaLaunchConfig_t config = overlapped_config(grid, block, smem, stream, &overlap);
  return cudaLaunchKernelExC(&config, kernel, args);
}

__host__ __device__ inline unsigned ceil_div(int64_t a, int64_t b) {
  return static_cast<unsigned>((a + b - 1) / b);
}

// A 64-bit mix of x (splitmix64's output function): the sampler's counter-based uniform and
// the GEMM tuning's pseudo-random input.
__host__ __device__ inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float bf16_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// OCP e4m3 of v / scale. The division (not a multiply by the reciprocal) keeps the quotient
// correctly rounded, which a host reference reproduces exactly; the conversion rounds to nearest
// even and saturates at +-448 (__NV_SATFINITE), as torch's float8_e4m3fn cast does after its
// clamp. In hardware from sm_89 on, in software (cuda_fp8.h) before.
__device__ __forceinline__ __nv_fp8_storage_t to_e4m3(float v, float scale) {
  return __nv_cvt_float_to_fp8(__fdiv_rn(v, scale), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

// The e4m3 range, and a row's dynamic FP8 scale from its threads' largest |x| (every thread
// calls it; a barrier inside): the block's largest, capped at scale_ub where one is given, over
// the e4m3 range, at least min_scale.
constexpr float kE4m3Max = 448.f;
__device__ __forceinline__ float dynamic_fp8_scale(float amax, float* scratch, float scale_ub,
                                                   float min_scale) {
  amax = block_max(amax, scratch);
  if (scale_ub > 0.f) amax = fminf(amax, scale_ub);
  return fmaxf(amax / kE4m3Max, min_scale);
}

// The largest of amax and the |x| of 8 bf16 (16 bytes).
__device__ __forceinline__ float max_abs8(const uint4& packed, float amax) {
  const auto* v = reinterpret_cast<const __nv_bfloat16*>(&packed);
#pragma unroll
  for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(__bfloat162float(v[e])));
  return amax;
}

// 8 bf16 (16 bytes) as their 8 e4m3 codes at `scale`.
__device__ __forceinline__ uint2 e4m3x8(const uint4& packed, float scale) {
  const auto* v = reinterpret_cast<const __nv_bfloat16*>(&packed);
  uint2 out;
  auto* o = reinterpret_cast<__nv_fp8_storage_t*>(&out);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = to_e4m3(__bfloat162float(v[e]), scale);
  return out;
}

// A row of bf16 values that a block holds in registers (each thread's kChunks chunks of 8, chunk
// c of a thread at 8 (threadIdx.x + c blockDim.x) of the row) as e4m3 codes with one scale:
// static_scale where it is > 0, else the row's own from the block's largest |x|. The quantizer
// and the kernels that write the next FP8 projection's input share this, so both give the same
// codes. Every thread calls it (a barrier inside for a dynamic scale).
template <int kChunks>
__device__ __forceinline__ void quantize_held_row_fp8(const uint4 (&held)[kChunks], int cols,
                                                      __nv_fp8_storage_t* codes, float* scale_out,
                                                      float static_scale, float scale_ub,
                                                      float min_scale, float* scratch) {
  float scale = static_scale;
  if (scale <= 0.f) {
    float amax = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if ((threadIdx.x + c * blockDim.x) * 8 < cols) amax = max_abs8(held[c], amax);
    }
    scale = dynamic_fp8_scale(amax, scratch, scale_ub, min_scale);
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i = (threadIdx.x + c * blockDim.x) * 8;
    if (i >= cols) break;
    *reinterpret_cast<uint2*>(codes + i) = e4m3x8(held[c], scale);
  }
  if (threadIdx.x == 0) *scale_out = scale;
}

// One output of an FP8 GEMM that left its scales out (sum, the unscaled bf16 sum): sum x (row
// scale x feature scale) + bias, rounded to bf16. The scale epilogue and the kernels that scale
// a GEMM's output as they read it share this, so both give the same bits.
__device__ __forceinline__ float scaled_fp8_sum(float sum, float x_scale, float w_scale,
                                                float bias) {
  return __bfloat162float(__float2bfloat16(sum * (x_scale * w_scale) + bias));
}

// The activations of the gated MLPs, in f32.
// SiLU: g * sigmoid(g).
struct Silu {
  __device__ __forceinline__ float operator()(float g) const { return g / (1.f + __expf(-g)); }
};
// HF's gelu_pytorch_tanh, 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3), as the
// equal g * sigmoid(2 y): for very negative g, 1 + tanh(y) would cancel to a few bits (or to 0)
// where g / (1 + exp(-2 y)) keeps full relative precision, and |g| too large for g^3 gives
// exp(-2 y) = 0 or inf, hence g or -0, never NaN.
struct GeluTanh {
  __device__ __forceinline__ float operator()(float g) const {
    const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.f + __expf(-2.f * y));
  }
};

}  // namespace pagedlm::cuda::detail
