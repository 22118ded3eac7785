// The attention half of a layer over a paged KV cache, on either device: rope + the cache write
// of this step's keys/values, then causal attention of the packed token stream over every
// sequence's pages (FlashInfer's CSR page table, see sched/step_plan.h). Both read the step's
// AttentionPlan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>

#include "pagedlm/core/attention_variant.h"
#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// One step's page table on the device the cache lives on, with the launch shape the CUDA
// kernels need. Index tensors are i32. Sequence b owns rows q_indptr[b] .. q_indptr[b+1] (n_new
// tokens) and pages kv_page_indices[kv_indptr[b] .. kv_indptr[b+1]] holding
// n_kv = (num_pages_b - 1) * page_size + kv_last_page_len[b] positions; its new tokens are the
// last n_new of those.
// On the GPU the tensors are views of the engine's fixed buffers, so a captured decode graph
// sees the same pointers on every replay. The CPU reads only the six index tensors.
struct AttentionPlan {
  Tensor positions;         // [n_tokens]
  Tensor slot_mapping;      // [n_tokens]: page * page_size + offset, -1 for padding
  Tensor q_indptr;          // [num_seqs + 1]
  Tensor kv_indptr;         // [num_seqs + 1]
  Tensor kv_page_indices;   // [>= kv_indptr[num_seqs]]
  Tensor kv_last_page_len;  // [num_seqs]

  // GPU only. The largest n_new (sizes the prefill grid).
  int32_t max_q_len = 0;
  // Every sequence has at most one new token: the split-KV decode kernel, with num_splits key
  // splits and seq_order ([num_seqs], longest first) as the order blocks start in.
  bool decode = false;
  int32_t num_splits = 1;
  Tensor seq_order;
  // Other steps: the leading sequences with one new token each (the running decodes the
  // scheduler puts first), which the decode kernel takes (in the prefill kernel each would fill
  // a 64-row tile with its 1-8 rows); the prefill kernel takes the rest.
  int32_t num_leading_decodes = 0;
  // Cascade attention's shared-prefix pass (decode steps only; cuda::SharedPrefixPass in
  // ops/cuda/kernels.h), none while kv_skip is undefined.
  Tensor kv_skip;           // [num_seqs]
  Tensor shared_num_items;  // [1]
  Tensor shared_items;      // [shared_max_items, 4]
  Tensor shared_members;    // [num_seqs]
  int32_t shared_max_items = 0;
  int32_t shared_splits = 0;
  // Split-KV partial results: cuda::paged_attention_workspace_bytes for the splits in use.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Decode steps without the shared pass: a count a (sequence, kv head), zero at rest, so that the
  // last of a sequence's split blocks merges them (cuda::launch_paged_attention_decode's
  // merge_counters; null: a merge kernel after the decode kernel).
  void* merge_counters = nullptr;
};

// An e4m3 (DType::kF8E4M3) KV cache's per-tensor scales, one pair per layer: a cached key is its
// stored e4m3 value times k, a value times v (vLLM's and compressed-tensors' self_attn.k_scale
// and v_scale). Writes store the e4m3 of value / scale, rounded to nearest even and saturated at
// +-448. Caches in the compute dtype ignore them. e4m3 caches are GPU only.
struct KvCacheScales {
  float k = 1.f;
  float v = 1.f;
};

// The dtype of a KV cache whose values the ops compute in `compute`: `compute` itself, kF8E4M3
// (GPU, bf16 compute), or kBF16 under f32 compute (CPU: half the bytes a decode step reads, each
// value rounded to nearest even as it is written). An Error names `op` and says why for any
// other.
void check_kv_cache_dtype(DType cache, DType compute, Device device, std::string_view op);

// qkv: [n_tokens, (n_q_heads + 2 n_kv_heads) head_dim], each row the q heads, then the k heads,
// then the v heads (one fused projection's output); q: [n_tokens, n_q_heads, head_dim] receives
// the rotated queries; inv_freq: [head_dim / 2] f32; k_cache, v_cache:
// [num_pages, page_size, n_kv_heads, head_dim] in q's dtype or e4m3 (check_kv_cache_dtype, with
// `scales`). Rotates q and k (ops/rope.h's contract) at plan.positions and writes k and v to the
// caches at plan.slot_mapping (ops/write_kv.h's contract; e4m3: the e4m3 of the rotated bf16 k,
// and of v, divided by the scale). The GPU does it in one kernel, rotating the k part of qkv in
// place; the CPU runs rope then write_kv and leaves qkv as it was.
void rope_write_kv(const Tensor& qkv, const Tensor& inv_freq, const AttentionPlan& plan,
                   const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                   void* stream = nullptr, const KvCacheScales& scales = {});

// q: [n_tokens, n_q_heads, head_dim], out: [n_tokens, n_q_heads, head_dim], k_cache, v_cache:
// [num_pages, page_size, n_kv_heads, head_dim] already holding this step's keys/values, in q's
// dtype or e4m3 (check_kv_cache_dtype: keys and values are the stored values times `scales`).
// Sequence b's j-th new token, at position p = n_kv - n_new + j, attends to kv positions
// max(0, p - window + 1) .. p (0 .. p without a window), scored as variant says
// (core/attention_variant.h: scale, then soft-cap, then the mask).
// GQA: q head h reads kv head h / (n_q_heads / n_kv_heads).
// Each row is batch invariant: it depends only on its own sequence's data.
// The plan is validated on the CPU (an Error names the bad sequence), not on the GPU.
void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const AttentionPlan& plan, const AttentionVariant& variant, const Tensor& out,
                     void* stream = nullptr, const KvCacheScales& scales = {});

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

// The head sizes the CUDA kernels are compiled for (ops/cuda/attention_d<D>.cu). The CPU's
// attention runs any even head size, so the check belongs to the GPU path alone.
inline constexpr int64_t kCudaAttentionHeadDims[] = {64, 80, 96, 128, 256};
inline bool cuda_attention_runs_head_dim(int64_t head_dim) {
  for (const int64_t d : kCudaAttentionHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}
// The list for messages: "64, 80, 96, 128 and 256".
inline std::string cuda_attention_head_dims_text() {
  std::string text;
  const size_t n = std::size(kCudaAttentionHeadDims);
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) text += i + 1 == n ? " and " : ", ";
    text += std::to_string(kCudaAttentionHeadDims[i]);
  }
  return text;
}

namespace cpu {
// Kv: float (an f32 cache) or uint16_t (a bf16 cache's bits), the two it is built for. Both run
// the same arithmetic on the stored values, a bf16 cache's widened to f32 as they are loaded.
template <typename Kv>
void paged_attention(const float* q, const Kv* k_cache, const Kv* v_cache, const int32_t* q_indptr,
                     const int32_t* kv_indptr, const int32_t* kv_page_indices,
                     const int32_t* kv_last_page_len, const AttentionVariant& variant, float* out,
                     const PagedAttentionDims& dims);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contracts as the Tensor-level ops; q, qkv and out hold `dtype` elements, the caches
// `cache_dtype` ones (dtype or kF8E4M3), the plan's tensors are in device memory. qkv's k part
// is rotated in place.
void rope_write_kv(void* qkv, void* q, const float* inv_freq, const AttentionPlan& plan,
                   void* k_cache, void* v_cache, int64_t n_tokens, int64_t n_q_heads,
                   int64_t n_kv_heads, int64_t head_dim, DType dtype, DType cache_dtype,
                   const KvCacheScales& scales, void* stream);
void paged_attention(const void* q, const void* k_cache, const void* v_cache,
                     const AttentionPlan& plan, const AttentionVariant& variant, void* out,
                     const PagedAttentionDims& dims, DType dtype, DType cache_dtype,
                     const KvCacheScales& scales, void* stream);

// Fails unless `device` runs pagedlm's kernels: compute capability 8.0 or later (the message
// names the GPU and its capability and points to --device cpu), and a valid
// PAGEDLM_CUDA_SMEM_CAP_KB when set.
void require_supported_device(int device);

// The decode launch shape, chosen once per batch bucket by ops::AttentionPlanner
// (ops/attention_planner.h; ops/cuda/kernels.h says how): key splits that fill `device` (the
// current one) for sequences up to max_kv_len keys, the workspace bytes that num_splits (plus the
// shared pass's) need for max_num_tokens rows, and the cascade pass's members per item and splits
// for num_items items.
int paged_attention_decode_num_splits(int num_seqs, int num_kv_heads, int head_dim, int max_kv_len,
                                      int device);
size_t paged_attention_workspace_bytes(int max_num_tokens, int num_q_heads, int head_dim,
                                       int max_num_splits);
int shared_prefix_members_per_item(int num_q_heads, int num_kv_heads);
int shared_prefix_num_splits(int num_items, int num_kv_heads, int device);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
