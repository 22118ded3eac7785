// The engine's paged K/V storage and the Attention the model calls: each layer's new K/V go
// into the pages named by the step's slot mapping, then the step's partial-page prefix hits are
// copied (StepPlan::kv_copies), then attention reads every sequence's pages through the step's
// page table. The model never sees pages: they are known here and, on the GPU, in the CUDA
// runner (cuda_runner.cc), which stages each step's page table for the device.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "pagedlm/core/tensor.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/model.h"
#include "pagedlm/ops/paged_attention.h"
#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

class PagedKvCache final : public Attention {
 public:
  // k and v of each layer: [num_pages, page_size, num_kv_heads, head_dim] in `dtype`
  // (f32 on the CPU, bf16 or f8_e4m3 on the GPU). scales: an e4m3 cache's, one pair per layer
  // (empty: 1.0 for every layer).
  PagedKvCache(int64_t num_layers, int32_t num_pages, int32_t page_size, int64_t num_kv_heads,
               int64_t head_dim, Device device, DType dtype,
               std::vector<ops::KvCacheScales> scales = {});

  // The e4m3 cache's scales of each layer from the checkpoint's self_attn.k_scale and v_scale
  // (Checkpoint::kv_scales), 1.0 where it has none. An Error names a scale of no layer, or one
  // not positive and finite.
  static std::vector<ops::KvCacheScales> checkpoint_scales(const Checkpoint& checkpoint,
                                                           int64_t num_layers);

  static int64_t bytes_per_page(int64_t num_layers, int32_t page_size, int64_t num_kv_heads,
                                int64_t head_dim, DType dtype);

  // CPU: makes the step's page table and copies current for the following attend() calls.
  void bind(const StepPlan& plan);
  // GPU: the same, from arrays the engine has already copied to the device; the ops run on
  // `stream` (cudaStream_t). kv_copies: [num_copies, 3] i32 on the device, or undefined for
  // none (a captured decode graph must have none: the copies are launched only when present).
  void bind(const ops::AttentionPlan& plan, void* stream, Tensor kv_copies = {}) {
    plan_ = plan;
    stream_ = stream;
    kv_copies_ = std::move(kv_copies);
  }

  void attend(int layer, const AttentionVariant& variant, const Tensor& qkv, const Tensor& q,
              const Tensor& inv_freq, const Tensor& out) override;

 private:
  std::vector<Tensor> k_cache_, v_cache_;
  std::vector<ops::KvCacheScales> scales_;  // per layer
  ops::AttentionPlan plan_;
  Tensor kv_copies_;  // the step's partial-page copies; no storage when there are none
  void* stream_ = nullptr;
};

}  // namespace pagedlm
