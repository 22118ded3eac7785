// Causal attention of a packed token stream over a paged KV cache (FlashInfer's CSR page table,
// see sched/step_plan.h). The cache already holds this step's keys/values (write_kv runs first).
#pragma once

#include <cstdint>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// q: [n_tokens, n_q_heads, head_dim], out: [n_tokens, n_q_heads, head_dim],
// k_cache, v_cache: [num_pages, page_size, n_kv_heads, head_dim],
// q_indptr: [num_seqs + 1], kv_indptr: [num_seqs + 1], kv_page_indices: [>= kv_indptr[num_seqs]],
// kv_last_page_len: [num_seqs]; all index tensors i32 on q's device.
//
// Sequence b owns rows q_indptr[b] .. q_indptr[b+1] (n_new tokens) and pages
// kv_page_indices[kv_indptr[b] .. kv_indptr[b+1]] holding
// n_kv = (num_pages_b - 1) * page_size + kv_last_page_len[b] positions. Its new tokens are the
// last n_new of those positions, so its j-th new token attends to kv positions
// 0 .. n_kv - n_new + j (full over cached context, causal among the new tokens).
// GQA: q head h reads kv head h / (n_q_heads / n_kv_heads). Scores are scaled by `scale`.
// Each row is batch invariant: it depends only on its own sequence's data.
// The plan is validated on the CPU (an Error names the bad sequence), not on the GPU.
void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& q_indptr, const Tensor& kv_indptr, const Tensor& kv_page_indices,
                     const Tensor& kv_last_page_len, float scale, const Tensor& out,
                     void* stream = nullptr);

// The sizes every backend's kernel needs besides the pointers.
struct PagedAttentionDims {
  int64_t num_seqs;
  int64_t n_tokens;
  int64_t n_q_heads;
  int64_t n_kv_heads;
  int64_t head_dim;
  int64_t num_pages;
  int64_t page_size;
  int64_t num_page_indices;  // length of kv_page_indices
};

namespace cpu {
void paged_attention(const float* q, const float* k_cache, const float* v_cache,
                     const int32_t* q_indptr, const int32_t* kv_indptr,
                     const int32_t* kv_page_indices, const int32_t* kv_last_page_len, float scale,
                     float* out, const PagedAttentionDims& dims);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as cpu::paged_attention; q, the caches and out hold `dtype` elements and the
// index arrays are in device memory.
void paged_attention(const void* q, const void* k_cache, const void* v_cache,
                     const int32_t* q_indptr, const int32_t* kv_indptr,
                     const int32_t* kv_page_indices, const int32_t* kv_last_page_len, float scale,
                     void* out, const PagedAttentionDims& dims, DType dtype, void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
