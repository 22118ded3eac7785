#include "pagedlm/engine/paged_kv_cache.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/ops/copy_kv.h"

namespace pagedlm {

PagedKvCache::PagedKvCache(int64_t num_layers, int32_t num_pages, int32_t page_size,
                           int64_t num_kv_heads, int64_t head_dim, Device device, DType dtype,
                           std::vector<ops::KvCacheScales> scales)
    : scales_(std::move(scales)) {
  if (scales_.empty()) scales_.resize(num_layers);
  PAGEDLM_CHECK(static_cast<int64_t>(scales_.size()) == num_layers, "KV cache: ", scales_.size(),
                " layers' scales for ", num_layers, " layers");
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

std::vector<ops::KvCacheScales> PagedKvCache::checkpoint_scales(const Checkpoint& checkpoint,
                                                                int64_t num_layers) {
  std::vector<ops::KvCacheScales> scales(num_layers);
  for (const auto& [name, t] : checkpoint.kv_scales) {
    // "<prefix>layers.<i>.self_attn.k_scale" (or v_scale).
    const size_t at = name.find("layers.");
    int64_t layer = -1;
    if (at != std::string::npos) {
      const char* digits = name.c_str() + at + 7;
      char* end = nullptr;
      const long parsed = std::strtol(digits, &end, 10);
      if (end != digits && *end == '.') layer = parsed;
    }
    PAGEDLM_CHECK(layer >= 0 && layer < num_layers, "KV cache scale ", name,
                  " names no layer of the model's ", num_layers);
    const float value = t.to_f32().data<float>()[0];
    PAGEDLM_CHECK(std::isfinite(value) && value > 0.f, "KV cache scale ", name, " is ", value,
                  "; an e4m3 cache's scales must be positive and finite");
    (name.ends_with(".k_scale") ? scales[layer].k : scales[layer].v) = value;
  }
  return scales;
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
  plan_ = ops::AttentionPlan{};
  plan_.positions = index_tensor(plan.positions);
  plan_.slot_mapping = index_tensor(plan.slot_mapping);
  plan_.q_indptr = index_tensor(plan.q_indptr);
  plan_.kv_indptr = index_tensor(plan.kv_indptr);
  plan_.kv_page_indices = index_tensor(plan.kv_page_indices);
  plan_.kv_last_page_len = index_tensor(plan.kv_last_page_len);
  kv_copies_ = plan.kv_copies.empty() ? Tensor()
                                      : Tensor::from_i32(plan.kv_copies, {plan.num_kv_copies(), 3});
  stream_ = nullptr;
}

void PagedKvCache::attend(int layer, const AttentionVariant& variant, const Tensor& qkv,
                          const Tensor& q, const Tensor& inv_freq, const Tensor& out) {
  const ops::KvCacheScales& scales = scales_[layer];
  ops::rope_write_kv(qkv, inv_freq, plan_, q, k_cache_[layer], v_cache_[layer], stream_, scales);
  // After the write, so that a source page filled in this step is complete; before attention,
  // which reads the copied slots. Per layer, as each layer has its own cache.
  if (kv_copies_.raw() != nullptr) {
    ops::copy_kv_slots(k_cache_[layer], v_cache_[layer], kv_copies_, stream_);
  }
  ops::paged_attention(q, k_cache_[layer], v_cache_[layer], plan_, variant, out, stream_, scales);
}

}  // namespace pagedlm
