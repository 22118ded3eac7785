// Small memory-bound kernels of a decoder layer: embedding gather (into the fp32 residual
// stream), RMSNorm (plain, per head, fused with the fp32 residual add), rotary embedding fused
// with the paged K/V cache write, gated activations (SwiGLU, GeGLU), row gather and the logits'
// soft-cap. Each reads and writes its bytes once; vectorized where rows are multiples of 16
// bytes.

#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {
namespace {

using bf16 = __nv_bfloat16;
using detail::ceil_div;
using detail::GeluTanh;
using detail::launch_overlapped;
using detail::Silu;
using detail::wait_for_inputs;

// Widens one bf16 row to f32 and scales it in f32, 8 values (16 bytes in, 32 out) at a time
// when dim % 8 == 0. table: [vocab, dim] bf16, token_ids: [num_tokens], out: [num_tokens, dim]
// f32; grid: num_tokens blocks.
__global__ void embedding_kernel(const bf16* table, const int32_t* token_ids, float* out, int dim,
                                 float scale, int vocab_begin, int vocab) {
  wait_for_inputs();
  const int t = blockIdx.x;
  float* dst = out + static_cast<size_t>(t) * dim;
  int row = token_ids[t];
  if (vocab_begin >= 0) {  // a tensor-parallel rank's rows of the vocabulary; others read 0
    row -= vocab_begin;
    if (row < 0 || row >= vocab) {
      for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = 0.f;
      return;
    }
  }
  const bf16* src = table + static_cast<size_t>(row) * dim;
  if (dim % 8 == 0) {
    for (int i = threadIdx.x; i < dim / 8; i += blockDim.x) {
      const uint4 packed = reinterpret_cast<const uint4*>(src)[i];
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
      const float2 a = __bfloat1622float2(pairs[0]), b = __bfloat1622float2(pairs[1]);
      const float2 c = __bfloat1622float2(pairs[2]), d = __bfloat1622float2(pairs[3]);
      reinterpret_cast<float4*>(dst)[2 * i] =
          make_float4(a.x * scale, a.y * scale, b.x * scale, b.y * scale);
      reinterpret_cast<float4*>(dst)[2 * i + 1] =
          make_float4(c.x * scale, c.y * scale, d.x * scale, d.y * scale);
    }
  } else {
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = __bfloat162float(src[i]) * scale;
  }
}

// One warp per row (t, h): row at x + t * x_stride + h * dim. Rows here are head_dim or a
// model width, short enough that a warp's two passes (sum of squares, then scale) hit L1.
// x: [num_tokens, (strided) num_heads * dim], weight: [dim]. Every norm kernel scales by
// weight_offset + weight in f32 (Gemma's 1 + w, which bf16 weights could not hold exactly).
__global__ void rms_norm_kernel(const bf16* x, int64_t x_stride, const bf16* weight, bf16* out,
                                int64_t out_stride, int num_tokens, int num_heads, int dim,
                                float eps, float weight_offset) {
  wait_for_inputs();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<int64_t>(num_tokens) * num_heads) return;
  const int64_t t = row / num_heads, h = row % num_heads;
  const bf16* xr = x + t * x_stride + h * dim;
  bf16* outr = out + t * out_stride + h * dim;
  float ss = 0.f;
  for (int i = lane; i < dim; i += 32) {
    const float v = __bfloat162float(xr[i]);
    ss += v * v;
  }
  ss = detail::warp_sum(ss);
  const float inv = rsqrtf(ss / dim + eps);
  for (int i = lane; i < dim; i += 32) {
    outr[i] = __float2bfloat16(__bfloat162float(xr[i]) * inv *
                               (weight_offset + __bfloat162float(weight[i])));
  }
}

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
  detail::quantize_held_row_fp8(held, dim, static_cast<__nv_fp8_storage_t*>(q.values) + row * dim,
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
  for (int j = 0; j < 8; ++j) v[j] = detail::scaled_fp8_sum(v[j], x_scale, w[j], 0.f);
}

// add_rms_norm_kernel with 16-byte accesses, for dim % 8 == 0 and dim <= 8 * kChunks * blockDim:
// each thread keeps its chunks of 8 values in registers between the two passes, so the row is
// read and written once. Each element's formula is the scalar kernel's (below); the sum of
// squares adds in another order. kUnscaled: x is an FP8 GEMM's unscaled output (Fp8Unscaled);
// kFp8Out: the output is also written as e4m3 rows (Fp8RowsOut).
// Its widest launch: kNormRowChunks loads of 8 for each of kNormRowThreads threads
// (norm_fuses_fp8).
constexpr int kNormRowThreads = 256, kNormRowChunks = 4;
template <int kChunks, bool kUnscaled = false, bool kFp8Out = false>
__global__ void add_rms_norm_vec_kernel(float* residual, const bf16* x, const bf16* weight,
                                        bf16* out, int dim, float eps, float weight_offset,
                                        Fp8Unscaled x_unscaled, Fp8RowsOut fp8_out) {
  wait_for_inputs();
  __shared__ float scratch[32];
  const size_t base = static_cast<size_t>(blockIdx.x) * dim;
  float* res = residual + base;
  // Read before the first barrier: fp8_out may overwrite it (the same scratch).
  const float x_scale = kUnscaled ? x_unscaled.x_scales[blockIdx.x] : 0.f;
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
      float xf[8];
      bf16x8_to_float(*reinterpret_cast<const uint4*>(x + base + i), xf);
      if constexpr (kUnscaled) scale_unscaled8(xf, x_scale, x_unscaled.w_scales, i);
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] += xf[j];
      *reinterpret_cast<float4*>(res + i) = make_float4(r[0], r[1], r[2], r[3]);
      *reinterpret_cast<float4*>(res + i + 4) = make_float4(r[4], r[5], r[6], r[7]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += r[j] * r[j];
  }
  ss = detail::block_sum(ss, scratch);
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
  if constexpr (kFp8Out) fp8_rows_out(held, dim, fp8_out, blockIdx.x, scratch);
}

// One block per row. residual: [rows, dim] f32 in/out, x: [rows, dim] bf16 or null (nothing is
// added and the residual is not written: the plain norm of an f32 row), weight: [dim] bf16,
// out: [rows, dim] bf16
__global__ void add_rms_norm_kernel(float* residual, const bf16* x, const bf16* weight, bf16* out,
                                    int dim, float eps, float weight_offset) {
  wait_for_inputs();
  __shared__ float scratch[32];
  const size_t base = static_cast<size_t>(blockIdx.x) * dim;
  float* res = residual + base;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = res[i];
    if (x != nullptr) {
      v += __bfloat162float(x[base + i]);
      res[i] = v;
    }
    ss += v * v;
  }
  ss = detail::block_sum(ss, scratch);
  const float inv = rsqrtf(ss / dim + eps);
  // Each thread re-reads only the elements it wrote itself, so no barrier is needed.
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    out[base + i] = __float2bfloat16(res[i] * inv * (weight_offset + __bfloat162float(weight[i])));
  }
}

// kVec adjacent bf16 values, aligned so that one access moves them all.
template <int kVec>
struct alignas(2 * kVec) BfPack {
  bf16 v[kVec];
};

// gridDim.y blocks per token (blockIdx.x the token). Each block computes the token's cos/sin
// pairs into shared memory, then the blocks' threads walk the (head, pair) grid of q then k, kVec
// adjacent pairs (bf16x2 accesses when 2), then copy v (16 bytes at a time when v_vec).
// q: [num_tokens, Hq, d] strided, k/v: [num_tokens, Hk, d] strided,
// k_cache/v_cache: [num_slots, Hk, d] of CacheT: bf16, or e4m3 (__nv_fp8_storage_t) quantized
// with k_scale / v_scale; dynamic shared memory: d floats.
template <int kVec, typename CacheT>
__global__ void rope_kv_write_kernel(const bf16* q, int64_t q_stride, bf16* q_out,
                                     int64_t q_out_stride, bf16* k, int64_t k_stride, const bf16* v,
                                     int64_t v_stride, const int32_t* positions,
                                     const float* inv_freq, const int32_t* slot_mapping,
                                     CacheT* k_cache, CacheT* v_cache, int num_q_heads,
                                     int num_kv_heads, int head_dim, bool v_vec, float k_scale,
                                     float v_scale) {
  wait_for_inputs();
  constexpr bool kE4m3 = std::is_same_v<CacheT, __nv_fp8_storage_t>;
  static_assert(kE4m3 || std::is_same_v<CacheT, bf16>, "bf16 or e4m3 caches");
  extern __shared__ float rope_cs[];  // [half] cos, then [half] sin
  const int t = blockIdx.x;
  const int half = head_dim / 2;
  const float pos = static_cast<float>(positions[t]);
  const int32_t slot = slot_mapping[t];
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    sincosf(pos * inv_freq[i], &rope_cs[half + i], &rope_cs[i]);
  }
  __syncthreads();
  const bf16* qt = q + t * q_stride;
  bf16* qt_out = q_out + t * q_out_stride;
  bf16* kt = k + t * k_stride;
  const bf16* vt = v + t * v_stride;
  const int steps = half / kVec;
  const int total = (num_q_heads + num_kv_heads) * steps;
  const int first = threadIdx.x + blockIdx.y * blockDim.x, stride = blockDim.x * gridDim.y;
  for (int idx = first; idx < total; idx += stride) {
    const int head = idx / steps, i = (idx % steps) * kVec;
    const bool is_q = head < num_q_heads;
    const bf16* x = is_q ? qt + head * head_dim : kt + (head - num_q_heads) * head_dim;
    bf16* y = is_q ? qt_out + head * head_dim : kt + (head - num_q_heads) * head_dim;
    CacheT* dst =
        !is_q && slot >= 0
            ? k_cache + (static_cast<size_t>(slot) * num_kv_heads + head - num_q_heads) * head_dim
            : nullptr;
    // kVec values of each half in one access (bf16x2 when kVec == 2).
    using Pack = BfPack<kVec>;
    const Pack a = *reinterpret_cast<const Pack*>(x + i);
    const Pack b = *reinterpret_cast<const Pack*>(x + i + half);
    Pack lo, hi;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x1 = __bfloat162float(a.v[j]), x2 = __bfloat162float(b.v[j]);
      const float cs = rope_cs[i + j], sn = rope_cs[half + i + j];
      lo.v[j] = __float2bfloat16(x1 * cs - x2 * sn);
      hi.v[j] = __float2bfloat16(x2 * cs + x1 * sn);
    }
    *reinterpret_cast<Pack*>(y + i) = lo;
    *reinterpret_cast<Pack*>(y + i + half) = hi;
    if (dst != nullptr) {
      if constexpr (kE4m3) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          dst[i + j] = detail::to_e4m3(__bfloat162float(lo.v[j]), k_scale);
          dst[i + j + half] = detail::to_e4m3(__bfloat162float(hi.v[j]), k_scale);
        }
      } else {
        *reinterpret_cast<Pack*>(dst + i) = lo;
        *reinterpret_cast<Pack*>(dst + i + half) = hi;
      }
    }
  }
  if (slot < 0) return;
  const int row = num_kv_heads * head_dim;
  CacheT* v_dst = v_cache + static_cast<size_t>(slot) * row;
  if constexpr (kE4m3) {
    if (v_vec) {  // 16 bytes in, 8 out
      for (int i = first; i < row / 8; i += stride) {
        const uint4 in = reinterpret_cast<const uint4*>(vt)[i];
        const auto* x = reinterpret_cast<const bf16*>(&in);
        uint2 out;
        auto* o = reinterpret_cast<__nv_fp8_storage_t*>(&out);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = detail::to_e4m3(__bfloat162float(x[j]), v_scale);
        reinterpret_cast<uint2*>(v_dst)[i] = out;
      }
    } else {
      for (int i = first; i < row; i += stride) {
        v_dst[i] = detail::to_e4m3(__bfloat162float(vt[i]), v_scale);
      }
    }
  } else if (v_vec) {
    for (int i = first; i < row / 8; i += stride) {
      reinterpret_cast<uint4*>(v_dst)[i] = reinterpret_cast<const uint4*>(vt)[i];
    }
  } else {
    for (int i = first; i < row; i += stride) v_dst[i] = vt[i];
  }
}

// gated_mul_kernel 8 values at a time, for dim % 8 == 0; grid: (ceil(dim / 8 / 256), rows).
template <typename Act>
__global__ void gated_mul_vec_kernel(const bf16* gate_up, bf16* out, int dim) {
  wait_for_inputs();
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (i >= dim) return;
  const size_t r = blockIdx.y;
  float gt[8], up[8], y[8];
  bf16x8_to_float(*reinterpret_cast<const uint4*>(gate_up + r * 2 * dim + i), gt);
  bf16x8_to_float(*reinterpret_cast<const uint4*>(gate_up + r * 2 * dim + dim + i), up);
  const Act act{};
#pragma unroll
  for (int j = 0; j < 8; ++j) y[j] = act(gt[j]) * up[j];
  *reinterpret_cast<uint4*>(out + r * dim + i) = float_to_bf16x8(y);
}

// out = Act(gate) * up. gate_up: [rows, 2 * dim], out: [rows, dim]; grid: (ceil(dim / 256), rows)
template <typename Act>
__global__ void gated_mul_kernel(const bf16* gate_up, bf16* out, int dim) {
  wait_for_inputs();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= dim) return;
  const size_t r = blockIdx.y;
  const float gt = __bfloat162float(gate_up[r * 2 * dim + i]);
  const float up = __bfloat162float(gate_up[r * 2 * dim + dim + i]);
  const Act act{};
  out[r * dim + i] = __float2bfloat16(act(gt) * up);
}

// gated_mul_vec_kernel a row a block (dim % 8 == 0, dim <= 8 kChunks blockDim), for the FP8
// forms: gate_up an FP8 GEMM's unscaled output (kUnscaled), and the output written also as e4m3
// rows (fp8_out.values set), which needs the whole row's largest |x|.
template <typename Act, int kChunks, bool kUnscaled>
__global__ void gated_mul_rows_kernel(const bf16* gate_up, bf16* out, int dim,
                                      Fp8Unscaled gate_up_unscaled, Fp8RowsOut fp8_out) {
  wait_for_inputs();
  __shared__ float scratch[32];
  const size_t r = blockIdx.x;
  // Read before the first barrier: fp8_out may overwrite it (the same scratch).
  const float x_scale = kUnscaled ? gate_up_unscaled.x_scales[r] : 0.f;
  const Act act{};
  uint4 held[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i = (threadIdx.x + c * blockDim.x) * 8;
    if (i >= dim) break;
    float gt[8], up[8], y[8];
    bf16x8_to_float(*reinterpret_cast<const uint4*>(gate_up + r * 2 * dim + i), gt);
    bf16x8_to_float(*reinterpret_cast<const uint4*>(gate_up + r * 2 * dim + dim + i), up);
    if constexpr (kUnscaled) {
      scale_unscaled8(gt, x_scale, gate_up_unscaled.w_scales, i);
      scale_unscaled8(up, x_scale, gate_up_unscaled.w_scales, dim + i);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = act(gt[j]) * up[j];
    held[c] = float_to_bf16x8(y);
    *reinterpret_cast<uint4*>(out + r * dim + i) = held[c];
  }
  if (fp8_out.values != nullptr) fp8_rows_out(held, dim, fp8_out, r, scratch);
}

// The row-per-block gated product's shape: kGatedRowChunks loads of 8 a thread at most, so rows
// up to 8 kGatedRowChunks kGatedRowThreads values (gated_mul_fuses_fp8).
constexpr int kGatedRowThreads = 256, kGatedRowChunks = 16;

template <typename Act, int kChunks>
void launch_gated_mul_rows(const void* gate_up, void* out, int rows, int dim,
                           const Fp8Unscaled& unscaled, const Fp8RowsOut& fp8_out,
                           cudaStream_t stream) {
  const auto kernel = unscaled.x_scales != nullptr ? gated_mul_rows_kernel<Act, kChunks, true>
                                                   : gated_mul_rows_kernel<Act, kChunks, false>;
  launch_overlapped(kernel, rows, kGatedRowThreads, 0, stream, static_cast<const bf16*>(gate_up),
                    static_cast<bf16*>(out), dim, unscaled, fp8_out);
}

template <typename Act>
cudaError_t launch_gated_mul(const void* gate_up, void* out, int rows, int dim, cudaStream_t stream,
                             const Fp8Unscaled& unscaled, const Fp8RowsOut& fp8_out) {
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  if (unscaled.x_scales != nullptr || fp8_out.values != nullptr) {
    if (!gated_mul_fuses_fp8(dim)) return cudaErrorInvalidValue;
    const int chunks = static_cast<int>(ceil_div(dim / 8, kGatedRowThreads));
    if (chunks <= 2) {
      launch_gated_mul_rows<Act, 2>(gate_up, out, rows, dim, unscaled, fp8_out, stream);
    } else if (chunks <= 4) {
      launch_gated_mul_rows<Act, 4>(gate_up, out, rows, dim, unscaled, fp8_out, stream);
    } else if (chunks <= 8) {
      launch_gated_mul_rows<Act, 8>(gate_up, out, rows, dim, unscaled, fp8_out, stream);
    } else {
      static_assert(kGatedRowChunks == 16, "the widest instantiation");
      launch_gated_mul_rows<Act, kGatedRowChunks>(gate_up, out, rows, dim, unscaled, fp8_out,
                                                  stream);
    }
    return cudaGetLastError();
  }
  if (dim % 8 == 0) {
    launch_overlapped(gated_mul_vec_kernel<Act>, dim3(ceil_div(dim / 8, 256), rows), 256, 0, stream,
                      static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), dim);
    return cudaGetLastError();
  }
  launch_overlapped(gated_mul_kernel<Act>, dim3(ceil_div(dim, 256), rows), 256, 0, stream,
                    static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), dim);
  return cudaGetLastError();
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) {
  return __float2bfloat16(v);
}

// x = cap * tanh(x / cap) in place, in f32 (tanhf: within 2 ulp; x / cap as HF divides);
// x: [n]; grid-stride.
template <typename T>
__global__ void softcap_kernel(T* x, int64_t n, float cap) {
  wait_for_inputs();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = from_float<T>(cap * tanhf(to_float(x[i]) / cap));
  }
}

// Copies rows of `words` Word-sized units: Word = uint4 when rows are multiples of 16 bytes,
// else uint16_t. in: [*, words], rows: [num_rows], out: [num_rows, words]; grid: num_rows blocks
template <typename Word>
__global__ void gather_rows_kernel(const Word* in, const int32_t* rows, Word* out, int64_t words) {
  wait_for_inputs();
  const Word* src = in + static_cast<size_t>(rows[blockIdx.x]) * words;
  Word* dst = out + static_cast<size_t>(blockIdx.x) * words;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

cudaError_t launch_embedding(const void* table, const int32_t* token_ids, float* out,
                             int num_tokens, int dim, float scale, cudaStream_t stream,
                             int vocab_begin, int vocab) {
  if (num_tokens <= 0) return cudaSuccess;
  launch_overlapped(embedding_kernel, num_tokens, 128, 0, stream, static_cast<const bf16*>(table),
                    token_ids, out, dim, scale, vocab_begin, vocab);
  return cudaGetLastError();
}

cudaError_t launch_rms_norm(const void* x, int64_t x_token_stride, const void* weight, void* out,
                            int64_t out_token_stride, int num_tokens, int num_heads, int dim,
                            float eps, float weight_offset, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(num_tokens) * num_heads;
  if (rows <= 0) return cudaSuccess;
  launch_overlapped(rms_norm_kernel, ceil_div(rows, 4), 128, 0, stream, static_cast<const bf16*>(x),
                    x_token_stride, static_cast<const bf16*>(weight), static_cast<bf16*>(out),
                    out_token_stride, num_tokens, num_heads, dim, eps, weight_offset);
  return cudaGetLastError();
}

namespace {

// One block per row, 16-byte accesses held in registers where the row allows (widths up to
// 8 kNormRowChunks kNormRowThreads = 8192), else the scalar kernel (which takes no FP8 form:
// norm_fuses_fp8).
template <bool kUnscaled, bool kFp8Out>
cudaError_t add_rms_norm_vec(float* residual, const bf16* x, const bf16* w, bf16* y, int rows,
                             int dim, float eps, float weight_offset, const Fp8Unscaled& unscaled,
                             const Fp8RowsOut& fp8_out, cudaStream_t stream) {
  constexpr int kThreads = kNormRowThreads;
  const int chunks = static_cast<int>(ceil_div(dim, 8 * kThreads));
  // Fewer threads for narrow rows (SmolLM2's 576 is 72 chunks of 8), so none sits idle.
  const int threads = chunks == 1 ? static_cast<int>(ceil_div(dim / 8, 32)) * 32 : kThreads;
  if (chunks == 1) {
    launch_overlapped(add_rms_norm_vec_kernel<1, kUnscaled, kFp8Out>, rows, threads, 0, stream,
                      residual, x, w, y, dim, eps, weight_offset, unscaled, fp8_out);
  } else if (chunks == 2) {
    launch_overlapped(add_rms_norm_vec_kernel<2, kUnscaled, kFp8Out>, rows, kThreads, 0, stream,
                      residual, x, w, y, dim, eps, weight_offset, unscaled, fp8_out);
  } else {
    static_assert(kNormRowChunks == 4, "the widest instantiation");
    launch_overlapped(add_rms_norm_vec_kernel<kNormRowChunks, kUnscaled, kFp8Out>, rows, kThreads,
                      0, stream, residual, x, w, y, dim, eps, weight_offset, unscaled, fp8_out);
  }
  return cudaGetLastError();
}

cudaError_t add_rms_norm(float* residual, const bf16* x, const void* weight, void* out, int rows,
                         int dim, float eps, float weight_offset, cudaStream_t stream,
                         const Fp8Unscaled& unscaled, const Fp8RowsOut& fp8_out) {
  if (rows <= 0) return cudaSuccess;
  const auto* w = static_cast<const bf16*>(weight);
  auto* y = static_cast<bf16*>(out);
  const bool scale_x = unscaled.x_scales != nullptr && x != nullptr;
  const bool quantize = fp8_out.values != nullptr;
  if (scale_x || quantize) {
    if (!norm_fuses_fp8(dim)) return cudaErrorInvalidValue;
    const auto launch =
        scale_x ? (quantize ? add_rms_norm_vec<true, true> : add_rms_norm_vec<true, false>)
                : add_rms_norm_vec<false, true>;
    return launch(residual, x, w, y, rows, dim, eps, weight_offset, unscaled, fp8_out, stream);
  }
  if (norm_fuses_fp8(dim)) {
    return add_rms_norm_vec<false, false>(residual, x, w, y, rows, dim, eps, weight_offset, {}, {},
                                          stream);
  }
  constexpr int kThreads = 256;
  launch_overlapped(add_rms_norm_kernel, rows, kThreads, 0, stream, residual, x, w, y, dim, eps,
                    weight_offset);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm_f32(const float* x, const void* weight, void* out, int rows, int dim,
                                float eps, float weight_offset, cudaStream_t stream,
                                const Fp8RowsOut& fp8_out) {
  // With no x to add the kernel only reads the residual, so dropping const is safe.
  return add_rms_norm(const_cast<float*>(x), nullptr, weight, out, rows, dim, eps, weight_offset,
                      stream, {}, fp8_out);
}

cudaError_t launch_add_rms_norm(float* residual, const void* x, const void* weight, void* out,
                                int rows, int dim, float eps, float weight_offset,
                                cudaStream_t stream, const Fp8Unscaled& x_unscaled,
                                const Fp8RowsOut& fp8_out) {
  return add_rms_norm(residual, static_cast<const bf16*>(x), weight, out, rows, dim, eps,
                      weight_offset, stream, x_unscaled, fp8_out);
}

cudaError_t launch_rope_kv_write(const void* q, int64_t q_token_stride, void* q_out,
                                 int64_t q_out_token_stride, void* k, int64_t k_token_stride,
                                 const void* v, int64_t v_token_stride, const int32_t* positions,
                                 const float* inv_freq, const int32_t* slot_mapping, void* k_cache,
                                 void* v_cache, int num_tokens, int num_q_heads, int num_kv_heads,
                                 int head_dim, cudaStream_t stream, const KvCacheFormat& kv) {
  if (num_tokens <= 0) return cudaSuccess;
  if (head_dim % 2 != 0) return cudaErrorInvalidValue;
  auto aligned = [](const void* p, int64_t stride, int64_t elems) {
    return reinterpret_cast<uintptr_t>(p) % (2 * elems) == 0 && stride % elems == 0;
  };
  // bf16x2 rotation needs even half-dims and 4-byte aligned rows; the v copy, 16-byte rows.
  const bool pairs = head_dim % 4 == 0 && aligned(q, q_token_stride, 2) &&
                     aligned(q_out, q_out_token_stride, 2) && aligned(k, k_token_stride, 2) &&
                     aligned(k_cache, 2, 2);
  const bool v_vec = (int64_t{num_kv_heads} * head_dim) % 8 == 0 && aligned(v, v_token_stride, 8) &&
                     aligned(v_cache, 8, 8);
  const size_t smem = sizeof(float) * head_dim;
  auto* q_in = static_cast<const bf16*>(q);
  auto* q_o = static_cast<bf16*>(q_out);
  auto* k_io = static_cast<bf16*>(k);
  auto* v_in = static_cast<const bf16*>(v);
  // A step of few tokens (one-stream decode: one) spreads each token over the blocks its heads
  // fill, instead of one block walking them all in several dependent rounds.
  const int per_token =
      num_tokens >= 32 ? 1 : std::max(1, (num_q_heads + num_kv_heads) * (head_dim / 4) / 256);
  auto launch = [&](auto kernel, auto* kc, auto* vc) {
    launch_overlapped(kernel, dim3(num_tokens, per_token), 256, smem, stream, q_in, q_token_stride,
                      q_o, q_out_token_stride, k_io, k_token_stride, v_in, v_token_stride,
                      positions, inv_freq, slot_mapping, kc, vc, num_q_heads, num_kv_heads,
                      head_dim, v_vec, kv.k_scale, kv.v_scale);
  };
  if (kv.e4m3) {
    if (!(kv.k_scale > 0.f && kv.v_scale > 0.f)) return cudaErrorInvalidValue;
    auto* kc = static_cast<__nv_fp8_storage_t*>(k_cache);
    auto* vc = static_cast<__nv_fp8_storage_t*>(v_cache);
    if (pairs) {
      launch(rope_kv_write_kernel<2, __nv_fp8_storage_t>, kc, vc);
    } else {
      launch(rope_kv_write_kernel<1, __nv_fp8_storage_t>, kc, vc);
    }
  } else {
    auto* kc = static_cast<bf16*>(k_cache);
    auto* vc = static_cast<bf16*>(v_cache);
    if (pairs) {
      launch(rope_kv_write_kernel<2, bf16>, kc, vc);
    } else {
      launch(rope_kv_write_kernel<1, bf16>, kc, vc);
    }
  }
  return cudaGetLastError();
}

cudaError_t launch_silu_mul(const void* gate_up, void* out, int rows, int dim, cudaStream_t stream,
                            const Fp8Unscaled& gate_up_unscaled, const Fp8RowsOut& fp8_out) {
  return launch_gated_mul<Silu>(gate_up, out, rows, dim, stream, gate_up_unscaled, fp8_out);
}

cudaError_t launch_gelu_tanh_mul(const void* gate_up, void* out, int rows, int dim,
                                 cudaStream_t stream, const Fp8Unscaled& gate_up_unscaled,
                                 const Fp8RowsOut& fp8_out) {
  return launch_gated_mul<GeluTanh>(gate_up, out, rows, dim, stream, gate_up_unscaled, fp8_out);
}

bool norm_fuses_fp8(int dim) {
  return dim > 0 && dim % 8 == 0 && dim <= 8 * kNormRowChunks * kNormRowThreads;
}
bool gated_mul_fuses_fp8(int dim) {
  return dim > 0 && dim % 8 == 0 && dim <= 8 * kGatedRowChunks * kGatedRowThreads;
}

cudaError_t launch_gather_rows(const void* in, const int32_t* rows, void* out, int num_rows,
                               int64_t row_bytes, cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  if (row_bytes % 2 != 0) return cudaErrorInvalidValue;
  if (row_bytes % 16 == 0) {
    launch_overlapped(gather_rows_kernel<uint4>, num_rows, 128, 0, stream,
                      static_cast<const uint4*>(in), rows, static_cast<uint4*>(out),
                      row_bytes / 16);
  } else {
    launch_overlapped(gather_rows_kernel<uint16_t>, num_rows, 128, 0, stream,
                      static_cast<const uint16_t*>(in), rows, static_cast<uint16_t*>(out),
                      row_bytes / 2);
  }
  return cudaGetLastError();
}

cudaError_t launch_softcap(void* x, bool f32, int64_t n, float cap, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (!(cap > 0.f)) return cudaErrorInvalidValue;
  // Enough blocks to fill the GPU several times over; each thread strides over the rest.
  const unsigned blocks = std::min<unsigned>(ceil_div(n, 256), 4096);
  if (f32) {
    launch_overlapped(softcap_kernel<float>, blocks, 256, 0, stream, static_cast<float*>(x), n,
                      cap);
  } else {
    launch_overlapped(softcap_kernel<bf16>, blocks, 256, 0, stream, static_cast<bf16*>(x), n, cap);
  }
  return cudaGetLastError();
}

}  // namespace pagedlm::cuda
