#include "pagedlm/engine/paged_kv_cache.h"

#include <cmath>

#include "pagedlm/ops/paged_attention.h"
#include "pagedlm/ops/rope.h"
#include "pagedlm/ops/write_kv.h"

namespace pagedlm {

namespace {

Tensor index_tensor(const std::vector<int32_t>& values, Device device) {
  Tensor t = Tensor::from_i32(values, {static_cast<int64_t>(values.size())});
  return device == Device::kCpu ? t : t.to(device);
}

}  // namespace

PagedKvCache::PagedKvCache(int64_t num_layers, int32_t num_pages, int32_t page_size,
                           int64_t num_kv_heads, int64_t head_dim, Device device)
    : device_(device), scale_(1.f / std::sqrt(static_cast<float>(head_dim))) {
  for (int64_t i = 0; i < num_layers; ++i) {
    k_cache_.push_back(Tensor::zeros(DType::kF32, {num_pages, page_size, num_kv_heads, head_dim},
                                     device));
    v_cache_.push_back(Tensor::zeros(DType::kF32, {num_pages, page_size, num_kv_heads, head_dim},
                                     device));
  }
}

int64_t PagedKvCache::bytes_per_page(int64_t num_layers, int32_t page_size, int64_t num_kv_heads,
                                     int64_t head_dim) {
  return 2 * num_layers * page_size * num_kv_heads * head_dim *
         static_cast<int64_t>(sizeof(float));
}

void PagedKvCache::bind(const StepPlan& plan) {
  positions_ = index_tensor(plan.positions, device_);
  slot_mapping_ = index_tensor(plan.slot_mapping, device_);
  q_indptr_ = index_tensor(plan.q_indptr, device_);
  kv_indptr_ = index_tensor(plan.kv_indptr, device_);
  kv_page_indices_ = index_tensor(plan.kv_page_indices, device_);
  kv_last_page_len_ = index_tensor(plan.kv_last_page_len, device_);
}

void PagedKvCache::attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& inv_freq, const Tensor& out) {
  ops::rope(q, k, positions_, inv_freq);
  ops::write_kv(k, v, slot_mapping_, k_cache_[layer], v_cache_[layer]);
  ops::paged_attention(q, k_cache_[layer], v_cache_[layer], q_indptr_, kv_indptr_,
                       kv_page_indices_, kv_last_page_len_, scale_, out);
}

}  // namespace pagedlm
