#include "pagedlm/engine/paged_kv_cache.h"

#include <cmath>
#include <cstring>

#include "pagedlm/ops/paged_attention.h"
#include "pagedlm/ops/rope.h"
#include "pagedlm/ops/write_kv.h"

#ifdef PAGEDLM_HAS_CUDA
#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/cuda/kernels.h"
#endif

namespace pagedlm {

PagedKvCache::PagedKvCache(int64_t num_layers, int32_t num_pages, int32_t page_size,
                           int64_t num_kv_heads, int64_t head_dim, Device device, DType dtype)
    : device_(device), page_size_(page_size) {
  // On the GPU, zeroed so that never-written slots a kernel tile may load hold finite values.
  // The CPU kernels read only written slots, so the host pool stays untouched until used: the
  // OS maps its pages on first write, which keeps start-up fast and memory proportional to use.
  const Shape shape = {num_pages, page_size, num_kv_heads, head_dim};
  for (int64_t i = 0; i < num_layers; ++i) {
    k_cache_.push_back(device == Device::kCpu ? Tensor::empty(dtype, shape)
                                              : Tensor::zeros(dtype, shape, device));
    v_cache_.push_back(device == Device::kCpu ? Tensor::empty(dtype, shape)
                                              : Tensor::zeros(dtype, shape, device));
  }
}

int64_t PagedKvCache::bytes_per_page(int64_t num_layers, int32_t page_size, int64_t num_kv_heads,
                                     int64_t head_dim, DType dtype) {
  return 2 * num_layers * page_size * num_kv_heads * head_dim *
         static_cast<int64_t>(dtype_size(dtype));
}

void PagedKvCache::bind(const StepPlan& plan) {
  auto index_tensor = [](const std::vector<int32_t>& values) {
    return Tensor::from_i32(values, {static_cast<int64_t>(values.size())});
  };
  positions_ = index_tensor(plan.positions);
  slot_mapping_ = index_tensor(plan.slot_mapping);
  q_indptr_ = index_tensor(plan.q_indptr);
  kv_indptr_ = index_tensor(plan.kv_indptr);
  kv_page_indices_ = index_tensor(plan.kv_page_indices);
  kv_last_page_len_ = index_tensor(plan.kv_last_page_len);
}

void PagedKvCache::attend(int layer, const AttentionVariant& variant, const Tensor& qkv,
                          const Tensor& q, const Tensor& inv_freq, const Tensor& out) {
  const int64_t L = q.dim(0), Hq = q.dim(1), d = q.dim(2);
  const int64_t Hk = k_cache_[layer].dim(2), width = (Hq + 2 * Hk) * d;
  PAGEDLM_CHECK(qkv.dim(0) == L && qkv.dim(1) == width, "attend: qkv must be [", L, ", ", width,
                "]");
  if (device_ != Device::kCpu) {
    attend_cuda(layer, variant, qkv, q, inv_freq, out);
    return;
  }
  // The CPU ops take contiguous q, k and v: split the fused rows.
  Tensor k = Tensor::empty(DType::kF32, {L, Hk, d}), v = Tensor::empty(DType::kF32, {L, Hk, d});
  const float* src = qkv.data<float>();
  for (int64_t t = 0; t < L; ++t) {
    const float* row = src + t * width;
    std::memcpy(q.data<float>() + t * Hq * d, row, Hq * d * sizeof(float));
    std::memcpy(k.data<float>() + t * Hk * d, row + Hq * d, Hk * d * sizeof(float));
    std::memcpy(v.data<float>() + t * Hk * d, row + (Hq + Hk) * d, Hk * d * sizeof(float));
  }
  ops::rope(q, k, positions_, inv_freq);
  ops::write_kv(k, v, slot_mapping_, k_cache_[layer], v_cache_[layer]);
  ops::paged_attention(q, k_cache_[layer], v_cache_[layer], q_indptr_, kv_indptr_, kv_page_indices_,
                       kv_last_page_len_, variant.scale, out);
}

// qkv: [L, (Hq + 2 Hk) d] bf16 -> out: [L, Hq, d]. Rope, the split of q out of the fused rows
// and the cache write are one kernel; attention is the split-KV decode kernel when every
// sequence has one new token (its launch shape is fixed per batch bucket, so the step can be a
// graph), else the prefill kernel, with the decode kernel for the step's leading decodes (in
// the prefill kernel each would fill a 64-row tile with its 1-8 rows: a prefill step of 29
// prompts and 200 decodes took 1.09 ms against 0.75 ms for the prompts alone, docs/PERF.md).
void PagedKvCache::attend_cuda(int layer, const AttentionVariant& variant, const Tensor& qkv,
                               const Tensor& q, const Tensor& inv_freq, const Tensor& out) {
#ifdef PAGEDLM_HAS_CUDA
  const DeviceStepPlan& p = device_plan_;
  const int L = static_cast<int>(q.dim(0)), Hq = static_cast<int>(q.dim(1));
  const int Hk = static_cast<int>(k_cache_[layer].dim(2)), d = static_cast<int>(q.dim(2));
  const int64_t width = int64_t{Hq + 2 * Hk} * d;
  const auto stream = static_cast<cudaStream_t>(p.stream);
  void* kc = k_cache_[layer].raw();
  void* vc = v_cache_[layer].raw();
  auto* fused = static_cast<uint16_t*>(qkv.raw());  // bf16 elements
  cuda::check(cuda::launch_rope_kv_write(
                  fused, width, q.raw(), int64_t{Hq} * d, fused + int64_t{Hq} * d, width,
                  fused + int64_t{Hq + Hk} * d, width, p.positions, inv_freq.data<float>(),
                  p.slot_mapping, kc, vc, L, Hq, Hk, d, stream),
              "rope + KV cache write");
  if (p.decode) {
    cuda::SharedPrefixPass shared;
    shared.kv_skip = p.kv_skip;
    shared.num_items = p.shared_num_items;
    shared.items = p.shared_items;
    shared.members = p.shared_members;
    shared.max_items = p.shared_max_items;
    shared.num_splits = p.shared_splits;
    cuda::check(cuda::launch_paged_attention_decode(
                    q.raw(), kc, vc, p.q_indptr, p.kv_indptr, p.kv_page_indices, p.kv_last_page_len,
                    out.raw(), p.num_seqs, L, p.max_q_len, Hq, Hk, d, page_size_, variant,
                    p.num_splits, p.workspace, p.workspace_bytes, p.seq_order,
                    p.kv_skip != nullptr ? &shared : nullptr, stream),
                "paged attention (decode)");
  } else {
    // The index arrays hold absolute rows and page offsets, so the prefill kernel's part of the
    // batch is the same arrays from sequence n on. One split: the workspace is sized for decode
    // steps, not for the rows of a prefill step.
    const int n = p.num_leading_decodes;
    if (n > 0) {
      cuda::check(cuda::launch_paged_attention_decode(
                      q.raw(), kc, vc, p.q_indptr, p.kv_indptr, p.kv_page_indices,
                      p.kv_last_page_len, out.raw(), n, L, 1, Hq, Hk, d, page_size_, variant,
                      /*num_splits=*/1, nullptr, 0, nullptr, nullptr, stream),
                  "paged attention (a prefill step's decodes)");
    }
    if (n < p.num_seqs) {
      cuda::check(cuda::launch_paged_attention_prefill(
                      q.raw(), kc, vc, p.q_indptr + n, p.kv_indptr + n, p.kv_page_indices,
                      p.kv_last_page_len + n, out.raw(), p.num_seqs - n, L, p.max_q_len, Hq, Hk, d,
                      page_size_, variant, stream),
                  "paged attention (prefill)");
    }
  }
#else
  fail("PagedKvCache: the cache is on the GPU but this build of pagedlm has no CUDA support");
#endif
}

}  // namespace pagedlm
