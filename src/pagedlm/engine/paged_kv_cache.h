// The engine's paged K/V storage and the Attention the model calls: each layer's new K/V go
// into the pages named by the step's slot mapping, then attention reads every sequence's
// pages through the step's page table. This is the only place that knows about pages.
#pragma once

#include <vector>

#include "pagedlm/core/tensor.h"
#include "pagedlm/model/model.h"
#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

class PagedKvCache final : public Attention {
 public:
  // k and v of each layer: [num_pages, page_size, num_kv_heads, head_dim]
  PagedKvCache(int64_t num_layers, int32_t num_pages, int32_t page_size, int64_t num_kv_heads,
               int64_t head_dim, Device device);

  static int64_t bytes_per_page(int64_t num_layers, int32_t page_size, int64_t num_kv_heads,
                                int64_t head_dim);

  // Makes the step's page table current for the following attend() calls.
  void bind(const StepPlan& plan);

  void attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& inv_freq,
              const Tensor& out) override;

 private:
  Device device_;
  float scale_;
  std::vector<Tensor> k_cache_, v_cache_;
  Tensor positions_, slot_mapping_, q_indptr_, kv_indptr_, kv_page_indices_, kv_last_page_len_;
};

}  // namespace pagedlm
