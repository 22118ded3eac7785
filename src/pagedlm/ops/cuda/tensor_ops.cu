// The ops:: CUDA entry points (declared under PAGEDLM_HAS_CUDA in each ops/*.h) on top of the raw
// launchers of kernels.h. The launchers compute in bf16, so every entry point requires bf16;
// the f32 residual stream (embedding out, norm inputs, gathered rows) and the f32 logits are the
// exceptions.
// Ops run on the stream they are given; the model passes the engine's stream so that a decode
// step can be captured as a CUDA graph.

#include <cuda_runtime.h>

#include <memory>

#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"
#include "pagedlm/ops/embedding.h"
#include "pagedlm/ops/gather_rows.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/paged_attention.h"
#include "pagedlm/ops/rms_norm.h"
#include "pagedlm/ops/rope.h"
#include "pagedlm/ops/sampling.h"
#include "pagedlm/ops/silu_mul.h"
#include "pagedlm/ops/softcap.h"
#include "pagedlm/ops/write_kv.h"

namespace pagedlm::ops::cuda {

namespace {

namespace raw = ::pagedlm::cuda;

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

void require_bf16(DType dtype, const char* op) {
  PAGEDLM_CHECK(dtype == DType::kBF16, op, ": the CUDA kernels compute in bf16, got ",
                dtype_name(dtype));
}

// cuBLASLt workspace: 32 MiB is what cuBLAS itself reserves per handle on Hopper.
constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

struct GemmHandleDeleter {
  void operator()(raw::GemmHandle* h) const { raw::gemm_destroy(h); }
};

// One handle for the process: GPU steps run from one thread at a time, not always the same one
// (the server builds its engine, and with it the start-up plans, on the main thread and steps it
// on the engine thread). Its per-shape plans are built on first use of a shape, so a warm-up
// run before graph capture leaves nothing to set up while capturing.
raw::GemmHandle* gemm_handle() {
  static std::unique_ptr<raw::GemmHandle, GemmHandleDeleter> handle = [] {
    raw::GemmHandle* h = nullptr;
    raw::check(raw::gemm_create(&h, kGemmWorkspaceBytes), "cuBLASLt handle");
    return std::unique_ptr<raw::GemmHandle, GemmHandleDeleter>(h);
  }();
  return handle.get();
}

// k, v: [n_tokens, n_kv_heads, head_dim] -> caches [num_slots, n_kv_heads, head_dim]; one block
// per token, slot -1 skips it.
__global__ void write_kv_kernel(const __nv_bfloat16* k, const __nv_bfloat16* v,
                                const int32_t* slot_mapping, __nv_bfloat16* k_cache,
                                __nv_bfloat16* v_cache, int row) {
  const int32_t slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const size_t src = static_cast<size_t>(blockIdx.x) * row, dst = static_cast<size_t>(slot) * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    k_cache[dst + i] = k[src + i];
    v_cache[dst + i] = v[src + i];
  }
}

}  // namespace

void embedding(const void* table, const int32_t* ids, float* out, int64_t n_tokens, int64_t vocab,
               int64_t dim, float scale, DType dtype, void* stream) {
  require_bf16(dtype, "embedding");
  raw::check(raw::launch_embedding(table, ids, out, static_cast<int>(n_tokens),
                                   static_cast<int>(dim), scale, as_stream(stream)),
             "embedding");
}

void gather_rows(const void* x, const int32_t* rows, void* out, int64_t n_rows, int64_t n_out,
                 int64_t dim, DType dtype, void* stream) {
  raw::check(
      raw::launch_gather_rows(x, rows, out, static_cast<int>(n_out),
                              dim * static_cast<int64_t>(dtype_size(dtype)), as_stream(stream)),
      "gather_rows");
}

void linear(const void* x, const void* weight, const void* bias, void* out, int64_t rows,
            int64_t out_features, int64_t in_features, DType dtype, DType out_dtype, void* stream) {
  require_bf16(dtype, "linear");
  if (out_dtype != DType::kF32) require_bf16(out_dtype, "linear out");
  raw::GemmHandle* h = gemm_handle();
  const cudaError_t err = raw::launch_gemm_bf16(
      h, x, weight, bias, out, out_dtype == DType::kF32, static_cast<int>(rows),
      static_cast<int>(out_features), static_cast<int>(in_features), as_stream(stream));
  PAGEDLM_CHECK(err == cudaSuccess, "linear [", rows, ", ", in_features, "] x [", out_features,
                ", ", in_features, "]^T: ", cudaGetErrorString(err), " (cuBLAS status ",
                raw::gemm_last_status(h), ")");
}

void set_linear_tuning(bool on) { raw::gemm_set_tuning(gemm_handle(), on); }

void rms_norm(const void* x, DType x_dtype, const void* weight, void* out, int64_t rows,
              int64_t dim, float eps, float weight_offset, DType dtype, void* stream) {
  require_bf16(dtype, "rms_norm");
  if (x_dtype == DType::kF32) {
    raw::check(
        raw::launch_rms_norm_f32(static_cast<const float*>(x), weight, out, static_cast<int>(rows),
                                 static_cast<int>(dim), eps, weight_offset, as_stream(stream)),
        "rms_norm");
    return;
  }
  require_bf16(x_dtype, "rms_norm x");
  raw::check(raw::launch_rms_norm(x, dim, weight, out, dim, static_cast<int>(rows), 1,
                                  static_cast<int>(dim), eps, weight_offset, as_stream(stream)),
             "rms_norm");
}

void add_rms_norm(float* residual, const void* x, const void* weight, void* out, int64_t rows,
                  int64_t dim, float eps, float weight_offset, DType dtype, void* stream) {
  require_bf16(dtype, "add_rms_norm");
  raw::check(raw::launch_add_rms_norm(residual, x, weight, out, static_cast<int>(rows),
                                      static_cast<int>(dim), eps, weight_offset, as_stream(stream)),
             "add_rms_norm");
}

void head_rms_norm(void* x, int64_t rows, int64_t width, int64_t first_head, int64_t num_heads,
                   int64_t head_dim, const void* weight, float eps, float weight_offset,
                   DType dtype, void* stream) {
  require_bf16(dtype, "head_rms_norm");
  void* heads = static_cast<__nv_bfloat16*>(x) + first_head * head_dim;
  raw::check(raw::launch_rms_norm(heads, width, weight, heads, width, static_cast<int>(rows),
                                  static_cast<int>(num_heads), static_cast<int>(head_dim), eps,
                                  weight_offset, as_stream(stream)),
             "head_rms_norm");
}

void gated_mul(GatedActivation act, const void* gate_up, void* out, int64_t n_tokens, int64_t ffn,
               DType dtype, void* stream) {
  const char* op = gated_mul_name(act);
  require_bf16(dtype, op);
  const auto launch =
      act == GatedActivation::kSilu ? raw::launch_silu_mul : raw::launch_gelu_tanh_mul;
  raw::check(
      launch(gate_up, out, static_cast<int>(n_tokens), static_cast<int>(ffn), as_stream(stream)),
      op);
}

void softcap(void* x, int64_t n, float cap, DType dtype, void* stream) {
  if (dtype != DType::kF32) require_bf16(dtype, "softcap");
  raw::check(raw::launch_softcap(x, dtype == DType::kF32, n, cap, as_stream(stream)), "softcap");
}

void sample_tokens(const float* logits, int64_t rows, int64_t vocab, const SamplerRows& params,
                   int32_t* out_tokens, void* stream) {
  raw::check(raw::launch_sample(logits, static_cast<int>(rows), static_cast<int>(vocab),
                                params.temperature, params.top_k, params.top_p, params.min_p,
                                params.seed, params.step, out_tokens, as_stream(stream)),
             "sampling");
}

// Rope alone is the fused rope + cache write with every slot -1 (nothing written); the engine's
// own path fuses both (engine/paged_kv_cache.cc).
void rope(void* q, void* k, const int32_t* positions, const float* inv_freq, int64_t n_tokens,
          int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim, DType dtype, void* stream) {
  require_bf16(dtype, "rope");
  if (n_tokens == 0) return;
  const cudaStream_t s = as_stream(stream);
  int32_t* no_slots = nullptr;
  raw::check(cudaMallocAsync(&no_slots, n_tokens * sizeof(int32_t), s), "rope: slot buffer");
  raw::check(cudaMemsetAsync(no_slots, 0xff, n_tokens * sizeof(int32_t), s), "rope: slot buffer");
  const cudaError_t err = raw::launch_rope_kv_write(
      q, n_q_heads * head_dim, q, n_q_heads * head_dim, k, n_kv_heads * head_dim, k,
      n_kv_heads * head_dim, positions, inv_freq, no_slots, nullptr, nullptr,
      static_cast<int>(n_tokens), static_cast<int>(n_q_heads), static_cast<int>(n_kv_heads),
      static_cast<int>(head_dim), s);
  raw::check(cudaFreeAsync(no_slots, s), "rope: slot buffer");
  raw::check(err, "rope");
}

void write_kv(const void* k, const void* v, const int32_t* slot_mapping, void* k_cache,
              void* v_cache, int64_t n_tokens, int64_t n_kv_heads, int64_t head_dim,
              int64_t num_slots, DType dtype, void* stream) {
  require_bf16(dtype, "write_kv");
  if (n_tokens == 0) return;
  write_kv_kernel<<<static_cast<unsigned>(n_tokens), 128, 0, as_stream(stream)>>>(
      static_cast<const __nv_bfloat16*>(k), static_cast<const __nv_bfloat16*>(v), slot_mapping,
      static_cast<__nv_bfloat16*>(k_cache), static_cast<__nv_bfloat16*>(v_cache),
      static_cast<int>(n_kv_heads * head_dim));
  raw::check(cudaGetLastError(), "write_kv");
}

// Without the plan on the host, the longest sequence is bounded by the whole stream.
void paged_attention(const void* q, const void* k_cache, const void* v_cache,
                     const int32_t* q_indptr, const int32_t* kv_indptr,
                     const int32_t* kv_page_indices, const int32_t* kv_last_page_len, float scale,
                     void* out, const PagedAttentionDims& dims, DType dtype, void* stream) {
  require_bf16(dtype, "paged_attention");
  raw::check(raw::launch_paged_attention_prefill(
                 q, k_cache, v_cache, q_indptr, kv_indptr, kv_page_indices, kv_last_page_len, out,
                 static_cast<int>(dims.num_seqs), static_cast<int>(dims.n_tokens),
                 static_cast<int>(dims.n_tokens), static_cast<int>(dims.n_q_heads),
                 static_cast<int>(dims.n_kv_heads), static_cast<int>(dims.head_dim),
                 static_cast<int>(dims.page_size), AttentionVariant{scale},
                 as_stream(stream)),
             "paged_attention");
}

}  // namespace pagedlm::ops::cuda
