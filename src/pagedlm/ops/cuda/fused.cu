// Small memory-bound kernels of a decoder layer: embedding gather (into the fp32 residual
// stream), RMSNorm (plain, per head, fused with the fp32 residual add), rotary embedding fused
// with the paged K/V cache write, SiLU-and-mul and row gather. Each reads and writes its bytes
// once; vectorized where rows are multiples of 16 bytes.

#include <cuda_bf16.h>

#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {
namespace {

using bf16 = __nv_bfloat16;
using detail::ceil_div;

// Widens one bf16 row to f32, 8 values (16 bytes in, 32 out) at a time when dim % 8 == 0.
// table: [vocab, dim] bf16, token_ids: [num_tokens], out: [num_tokens, dim] f32;
// grid: num_tokens blocks.
__global__ void embedding_kernel(const bf16* table, const int32_t* token_ids, float* out, int dim) {
  const int t = blockIdx.x;
  const bf16* src = table + static_cast<size_t>(token_ids[t]) * dim;
  float* dst = out + static_cast<size_t>(t) * dim;
  if (dim % 8 == 0) {
    for (int i = threadIdx.x; i < dim / 8; i += blockDim.x) {
      const uint4 packed = reinterpret_cast<const uint4*>(src)[i];
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
      const float2 a = __bfloat1622float2(pairs[0]), b = __bfloat1622float2(pairs[1]);
      const float2 c = __bfloat1622float2(pairs[2]), d = __bfloat1622float2(pairs[3]);
      reinterpret_cast<float4*>(dst)[2 * i] = make_float4(a.x, a.y, b.x, b.y);
      reinterpret_cast<float4*>(dst)[2 * i + 1] = make_float4(c.x, c.y, d.x, d.y);
    }
  } else {
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = __bfloat162float(src[i]);
  }
}

// One warp per row (t, h): row at x + t * x_stride + h * dim. Rows here are head_dim or a
// model width, short enough that a warp's two passes (sum of squares, then scale) hit L1.
// x: [num_tokens, (strided) num_heads * dim], weight: [dim]
__global__ void rms_norm_kernel(const bf16* x, int64_t x_stride, const bf16* weight, bf16* out,
                                int64_t out_stride, int num_tokens, int num_heads, int dim,
                                float eps) {
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
    outr[i] = __float2bfloat16(__bfloat162float(xr[i]) * inv * __bfloat162float(weight[i]));
  }
}

// One block per row. residual: [rows, dim] f32 in/out, x: [rows, dim] bf16 or null (nothing is
// added and the residual is not written: the plain norm of an f32 row), weight: [dim] bf16,
// out: [rows, dim] bf16
__global__ void add_rms_norm_kernel(float* residual, const bf16* x, const bf16* weight, bf16* out,
                                    int dim, float eps) {
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
    out[base + i] = __float2bfloat16(res[i] * inv * __bfloat162float(weight[i]));
  }
}

// One block per token; threads walk the (head, pair) grid of q then k, then copy v.
// q: [num_tokens, Hq, d] strided, k/v: [num_tokens, Hk, d] strided,
// k_cache/v_cache: [num_slots, Hk, d]
__global__ void rope_kv_write_kernel(const bf16* q, int64_t q_stride, bf16* q_out,
                                     int64_t q_out_stride, bf16* k, int64_t k_stride, const bf16* v,
                                     int64_t v_stride, const int32_t* positions,
                                     const float* inv_freq, const int32_t* slot_mapping,
                                     bf16* k_cache, bf16* v_cache, int num_q_heads,
                                     int num_kv_heads, int head_dim) {
  const int t = blockIdx.x;
  const int half = head_dim / 2;
  const float pos = static_cast<float>(positions[t]);
  const int32_t slot = slot_mapping[t];
  const bf16* qt = q + t * q_stride;
  bf16* qt_out = q_out + t * q_out_stride;
  bf16* kt = k + t * k_stride;
  const bf16* vt = v + t * v_stride;
  const int total = (num_q_heads + num_kv_heads) * half;
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int head = idx / half, i = idx % half;
    float sn, cs;
    sincosf(pos * inv_freq[i], &sn, &cs);
    const bool is_q = head < num_q_heads;
    const bf16* x = is_q ? qt + head * head_dim : kt + (head - num_q_heads) * head_dim;
    bf16* y = is_q ? qt_out + head * head_dim : kt + (head - num_q_heads) * head_dim;
    const float x1 = __bfloat162float(x[i]), x2 = __bfloat162float(x[i + half]);
    const bf16 y1 = __float2bfloat16(x1 * cs - x2 * sn);
    const bf16 y2 = __float2bfloat16(x2 * cs + x1 * sn);
    y[i] = y1;
    y[i + half] = y2;
    if (!is_q && slot >= 0) {
      bf16* dst =
          k_cache + (static_cast<size_t>(slot) * num_kv_heads + head - num_q_heads) * head_dim;
      dst[i] = y1;
      dst[i + half] = y2;
    }
  }
  if (slot < 0) return;
  for (int idx = threadIdx.x; idx < num_kv_heads * head_dim; idx += blockDim.x) {
    const int head = idx / head_dim, i = idx % head_dim;
    v_cache[(static_cast<size_t>(slot) * num_kv_heads + head) * head_dim + i] =
        vt[head * head_dim + i];
  }
}

// gate_up: [rows, 2 * dim], out: [rows, dim]; grid: (ceil(dim / 256), rows)
__global__ void silu_mul_kernel(const bf16* gate_up, bf16* out, int dim) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= dim) return;
  const size_t r = blockIdx.y;
  const float gt = __bfloat162float(gate_up[r * 2 * dim + i]);
  const float up = __bfloat162float(gate_up[r * 2 * dim + dim + i]);
  out[r * dim + i] = __float2bfloat16(gt / (1.f + __expf(-gt)) * up);
}

// Copies rows of `words` Word-sized units: Word = uint4 when rows are multiples of 16 bytes,
// else uint16_t. in: [*, words], rows: [num_rows], out: [num_rows, words]; grid: num_rows blocks
template <typename Word>
__global__ void gather_rows_kernel(const Word* in, const int32_t* rows, Word* out, int64_t words) {
  const Word* src = in + static_cast<size_t>(rows[blockIdx.x]) * words;
  Word* dst = out + static_cast<size_t>(blockIdx.x) * words;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

cudaError_t launch_embedding(const void* table, const int32_t* token_ids, float* out,
                             int num_tokens, int dim, cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  embedding_kernel<<<num_tokens, 128, 0, stream>>>(static_cast<const bf16*>(table), token_ids, out,
                                                   dim);
  return cudaGetLastError();
}

cudaError_t launch_rms_norm(const void* x, int64_t x_token_stride, const void* weight, void* out,
                            int64_t out_token_stride, int num_tokens, int num_heads, int dim,
                            float eps, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(num_tokens) * num_heads;
  if (rows <= 0) return cudaSuccess;
  rms_norm_kernel<<<ceil_div(rows, 4), 128, 0, stream>>>(
      static_cast<const bf16*>(x), x_token_stride, static_cast<const bf16*>(weight),
      static_cast<bf16*>(out), out_token_stride, num_tokens, num_heads, dim, eps);
  return cudaGetLastError();
}

cudaError_t launch_rms_norm_f32(const float* x, const void* weight, void* out, int rows, int dim,
                                float eps, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  // With no x to add the kernel only reads the residual, so dropping const is safe.
  add_rms_norm_kernel<<<rows, 256, 0, stream>>>(const_cast<float*>(x), nullptr,
                                                static_cast<const bf16*>(weight),
                                                static_cast<bf16*>(out), dim, eps);
  return cudaGetLastError();
}

cudaError_t launch_add_rms_norm(float* residual, const void* x, const void* weight, void* out,
                                int rows, int dim, float eps, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  add_rms_norm_kernel<<<rows, 256, 0, stream>>>(residual, static_cast<const bf16*>(x),
                                                static_cast<const bf16*>(weight),
                                                static_cast<bf16*>(out), dim, eps);
  return cudaGetLastError();
}

cudaError_t launch_rope_kv_write(const void* q, int64_t q_token_stride, void* q_out,
                                 int64_t q_out_token_stride, void* k, int64_t k_token_stride,
                                 const void* v, int64_t v_token_stride, const int32_t* positions,
                                 const float* inv_freq, const int32_t* slot_mapping, void* k_cache,
                                 void* v_cache, int num_tokens, int num_q_heads, int num_kv_heads,
                                 int head_dim, cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  if (head_dim % 2 != 0) return cudaErrorInvalidValue;
  rope_kv_write_kernel<<<num_tokens, 256, 0, stream>>>(
      static_cast<const bf16*>(q), q_token_stride, static_cast<bf16*>(q_out), q_out_token_stride,
      static_cast<bf16*>(k), k_token_stride, static_cast<const bf16*>(v), v_token_stride, positions,
      inv_freq, slot_mapping, static_cast<bf16*>(k_cache), static_cast<bf16*>(v_cache), num_q_heads,
      num_kv_heads, head_dim);
  return cudaGetLastError();
}

cudaError_t launch_silu_mul(const void* gate_up, void* out, int rows, int dim,
                            cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  silu_mul_kernel<<<dim3(ceil_div(dim, 256), rows), 256, 0, stream>>>(
      static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), dim);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const void* in, const int32_t* rows, void* out, int num_rows,
                               int64_t row_bytes, cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  if (row_bytes % 2 != 0) return cudaErrorInvalidValue;
  if (row_bytes % 16 == 0) {
    gather_rows_kernel<<<num_rows, 128, 0, stream>>>(static_cast<const uint4*>(in), rows,
                                                     static_cast<uint4*>(out), row_bytes / 16);
  } else {
    gather_rows_kernel<<<num_rows, 128, 0, stream>>>(static_cast<const uint16_t*>(in), rows,
                                                     static_cast<uint16_t*>(out), row_bytes / 2);
  }
  return cudaGetLastError();
}

}  // namespace pagedlm::cuda
