// Attention planning beside the kernels, plan then run as FlashInfer separates them: the launch
// shape of the paged attention (key splits per decode bucket, the split-KV workspace for the
// worst of them, whether a decode step takes cascade attention's shared-prefix pass) and the
// host side of a step's plan (the cascade's items, the order in which decode blocks start),
// written into host arrays the caller then uploads and binds (AttentionPlan) before the kernels
// run. Host code only: the CUDA build gives it the kernels' own heuristics
// (cuda::attention_launch_rules); tests give it their own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "pagedlm/ops/paged_attention.h"

namespace pagedlm::ops {

// The attention one runner plans for: one rank's heads (all of them without tensor
// parallelism), the longest context, and the largest decode batch it pads steps to.
struct AttentionShape {
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t max_model_len = 0;
  int32_t max_bucket = 1;  // sequences of the largest decode bucket (padding included)
  int32_t page_size = 0;
  bool cascade = false;  // cascade attention's shared-prefix pass on
};

// The kernels' launch heuristics the planner sizes by, with ops/cuda's arguments (see
// paged_attention.h's cuda:: functions for what each means).
struct AttentionLaunchRules {
  std::function<int(int num_seqs, int num_kv_heads, int head_dim, int max_kv_len)> decode_splits;
  std::function<int(int num_items, int num_kv_heads)> shared_splits;
  std::function<size_t(int max_num_tokens, int num_q_heads, int head_dim, int max_num_splits)>
      workspace_bytes;
  std::function<int(int num_q_heads, int num_kv_heads)> members_per_item;
};

// A run of leading pages several sequences of a step hold in common (sched/shared_prefix.h finds
// them): the sequences' indices in the step, ascending, and the run's length in pages.
struct SharedPrefixRun {
  std::span<const int32_t> seqs;
  int32_t num_pages = 0;
};

// A step's attention arrays in host memory, the caller's to upload, each with room for the
// step's num_seqs sequences (padding included); layouts as cuda::SharedPrefixPass
// (ops/cuda/kernels.h) and AttentionPlan::seq_order.
struct AttentionStepArrays {
  int32_t* kv_skip = nullptr;    // [num_seqs]
  int32_t* num_items = nullptr;  // [1]
  int32_t* items = nullptr;      // [num_seqs, 4]
  int32_t* members = nullptr;    // [num_seqs]
  int32_t* seq_order = nullptr;  // [num_seqs], written for decode steps only
};

class AttentionPlanner {
 public:
  // A decode step takes the cascade's shared-prefix pass when it saves reading at least this
  // many keys (per layer and kv head): below that its extra launches and merge cost more than
  // they save.
  static constexpr int64_t kCascadeMinSavedKeys = 4096;

  // Asks `rules` for every decode bucket's splits now (1 .. shape.max_bucket sequences), so that
  // a step only looks them up.
  AttentionPlanner(const AttentionShape& shape, const AttentionLaunchRules& rules);

  // The split-KV workspace a step needs at most (0: none); the caller allocates it. The runner,
  // not the planner, owns the buffer: it owns every device buffer its CUDA graphs capture
  // pointers to (and frees them after the graphs), and the planner stays host code that runs,
  // and is tested, without a GPU, as FlashInfer's plan() takes the caller's workspace buffer.
  size_t workspace_bytes() const { return workspace_bytes_; }
  // The decode merge's counters (AttentionPlan::merge_counters) for the largest bucket: the
  // caller allocates and zeroes them once, beside the workspace.
  size_t merge_counter_bytes() const { return merge_counter_bytes_; }
  // Members of one cascade item at most.
  int32_t members_per_item() const { return members_per_item_; }

  // The split count of a decode bucket of num_seqs (1 .. max_bucket) sequences, for the longest
  // context the model allows (the kernel caps each sequence's splits by its own length), shrunk
  // if the workspace cannot hold it. A function of the bucket alone, so one graph per bucket
  // serves every step.
  int32_t decode_splits(int32_t num_seqs) const;
  // Shared-pass splits of a decode bucket: enough blocks when one group holds the whole batch.
  // 0 with cascade attention off.
  int32_t shared_splits(int32_t num_seqs) const;

  // Whether a decode step whose shared runs are `runs` takes the shared-prefix pass: cascade
  // attention is on and they save at least kCascadeMinSavedKeys keys.
  bool takes_cascade(std::span<const SharedPrefixRun> runs) const;

  // Writes a step's attention arrays for num_seqs sequences (padding after the plan's
  // kv_indptr.size() - 1): `shared` (empty: no shared pass) as items of at most
  // members_per_item() members each, their members, kv_skip and num_items; decode steps also
  // get seq_order.
  void plan_step(std::span<const int32_t> kv_indptr, int32_t num_seqs, bool decode,
                 std::span<const SharedPrefixRun> shared, const AttentionStepArrays& out) const;

  // The launch shape of a step bound as `p` (p.decode set) for num_seqs sequences: its key
  // splits, its shared-pass splits when `cascade`, the caller's workspace of workspace_bytes()
  // and its merge_counter_bytes() of zeroed counters (null: the merge in a kernel of its own).
  void plan_launch(AttentionPlan& p, int32_t num_seqs, bool cascade, void* workspace,
                   void* merge_counters = nullptr) const;

 private:
  int32_t max_bucket_;
  int32_t page_size_;
  bool cascade_;
  int32_t members_per_item_;
  size_t workspace_bytes_ = 0;
  size_t merge_counter_bytes_ = 0;
  std::vector<int32_t> decode_splits_;  // [max_bucket + 1], by num_seqs
  std::vector<int32_t> shared_splits_;  // [max_bucket + 1], by num_seqs; empty with cascade off
};

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// The CUDA kernels' heuristics for `device` (paged_attention.h's cuda:: functions).
AttentionLaunchRules attention_launch_rules(int device);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
