// The engine's paged K/V storage and the Attention the model calls: each layer's new K/V go
// into the pages named by the step's slot mapping, then attention reads every sequence's
// pages through the step's page table. This is the only place that knows about pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pagedlm/core/tensor.h"
#include "pagedlm/model/model.h"
#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

// One step's page table already in device memory (the engine's fixed buffers, so a captured
// decode graph sees the same pointers every replay), with the sizes the kernels launch with.
struct DeviceStepPlan {
  const int32_t* positions = nullptr;         // [num_tokens]
  const int32_t* slot_mapping = nullptr;      // [num_tokens], -1 for padding
  const int32_t* q_indptr = nullptr;          // [num_seqs + 1]
  const int32_t* kv_indptr = nullptr;         // [num_seqs + 1]
  const int32_t* kv_page_indices = nullptr;   // [kv_indptr[num_seqs]]
  const int32_t* kv_last_page_len = nullptr;  // [num_seqs]
  int32_t num_seqs = 0;                       // including padded (empty) sequences
  int32_t max_q_len = 0;
  bool decode = false;  // every sequence has at most one new token: the split-KV decode kernel
  // Other steps: the leading sequences with one new token each (the running decodes the
  // scheduler puts first), which the decode kernel takes; the prefill kernel takes the rest.
  int32_t num_leading_decodes = 0;
  int32_t num_splits = 1;
  const int32_t* seq_order = nullptr;  // decode: sequences by length, longest first
  // Cascade attention's shared-prefix pass (decode steps only; cuda::SharedPrefixPass):
  // kv_skip null means none.
  const int32_t* kv_skip = nullptr;           // [num_seqs]
  const int32_t* shared_num_items = nullptr;  // [1]
  const int32_t* shared_items = nullptr;      // [shared_max_items][4]
  const int32_t* shared_members = nullptr;    // [num_seqs]
  int32_t shared_max_items = 0;
  int32_t shared_splits = 0;
  void* workspace = nullptr;  // split-KV partial results
  size_t workspace_bytes = 0;
  void* stream = nullptr;  // cudaStream_t
};

class PagedKvCache final : public Attention {
 public:
  // k and v of each layer: [num_pages, page_size, num_kv_heads, head_dim] in `dtype`
  // (f32 on the CPU, bf16 on the GPU).
  PagedKvCache(int64_t num_layers, int32_t num_pages, int32_t page_size, int64_t num_kv_heads,
               int64_t head_dim, Device device, DType dtype);

  static int64_t bytes_per_page(int64_t num_layers, int32_t page_size, int64_t num_kv_heads,
                                int64_t head_dim, DType dtype);

  // CPU: makes the step's page table current for the following attend() calls.
  void bind(const StepPlan& plan);
  // GPU: the same, from arrays the engine has already copied to the device.
  void bind(const DeviceStepPlan& plan) { device_plan_ = plan; }

  void attend(int layer, const AttentionVariant& variant, const Tensor& qkv, const Tensor& q,
              const Tensor& inv_freq, const Tensor& out) override;

 private:
  void attend_cuda(int layer, const AttentionVariant& variant, const Tensor& qkv, const Tensor& q,
                   const Tensor& inv_freq, const Tensor& out);

  Device device_;
  int32_t page_size_;
  std::vector<Tensor> k_cache_, v_cache_;
  Tensor positions_, slot_mapping_, q_indptr_, kv_indptr_, kv_page_indices_, kv_last_page_len_;
  DeviceStepPlan device_plan_;
};

}  // namespace pagedlm
