#include "pagedlm/ops/attention_planner.h"

#include <algorithm>
#include <numeric>

#include "pagedlm/core/error.h"

namespace pagedlm::ops {

AttentionPlanner::AttentionPlanner(const AttentionShape& shape, const AttentionLaunchRules& rules)
    : max_bucket_(shape.max_bucket),
      page_size_(shape.page_size),
      cascade_(shape.cascade),
      members_per_item_(rules.members_per_item(shape.num_q_heads, shape.num_kv_heads)) {
  PAGEDLM_CHECK(max_bucket_ >= 1, "the largest decode bucket must hold a sequence, got ",
                max_bucket_);
  const auto max_kv_len = static_cast<int>(shape.max_model_len);
  std::vector<int32_t> splits(max_bucket_ + 1, 1);
  if (cascade_) shared_splits_.assign(max_bucket_ + 1, 0);
  for (int32_t b = 1; b <= max_bucket_; ++b) {
    splits[b] = rules.decode_splits(b, shape.num_kv_heads, shape.head_dim, max_kv_len);
    if (cascade_) {
      const int items = (b + members_per_item_ - 1) / members_per_item_;
      shared_splits_[b] = rules.shared_splits(items, shape.num_kv_heads);
    }
  }
  // The split-KV workspace for the worst decode batch: splits shrink as the batch grows,
  // so scan every batch size at the longest context, plus the cascade's shared splits.
  for (int32_t b = 1; b <= max_bucket_; ++b) {
    workspace_bytes_ = std::max(
        workspace_bytes_,
        rules.workspace_bytes(b, shape.num_q_heads, shape.head_dim, splits[b] + shared_splits(b)));
  }
  if (workspace_bytes_ > 0) {
    merge_counter_bytes_ = static_cast<size_t>(max_bucket_) * shape.num_kv_heads * sizeof(uint32_t);
  }
  decode_splits_.assign(max_bucket_ + 1, 1);
  for (int32_t b = 1; b <= max_bucket_; ++b) {
    int s = splits[b];
    const int extra = shared_splits(b);
    while (s > 1 && rules.workspace_bytes(b, shape.num_q_heads, shape.head_dim, s + extra) >
                        workspace_bytes_) {
      --s;
    }
    decode_splits_[b] = s;
  }
}

int32_t AttentionPlanner::decode_splits(int32_t num_seqs) const {
  PAGEDLM_CHECK(num_seqs >= 1 && num_seqs <= max_bucket_, "decode batch of ", num_seqs,
                " sequences outside the planned buckets (1 to ", max_bucket_, ")");
  return decode_splits_[num_seqs];
}

int32_t AttentionPlanner::shared_splits(int32_t num_seqs) const {
  if (!cascade_) return 0;
  PAGEDLM_CHECK(num_seqs >= 1 && num_seqs <= max_bucket_, "decode batch of ", num_seqs,
                " sequences outside the planned buckets (1 to ", max_bucket_, ")");
  return shared_splits_[num_seqs];
}

bool AttentionPlanner::takes_cascade(std::span<const SharedPrefixRun> runs) const {
  if (!cascade_) return false;
  int64_t saved_keys = 0;
  for (const SharedPrefixRun& run : runs) {
    saved_keys += static_cast<int64_t>(run.seqs.size() - 1) * run.num_pages * page_size_;
  }
  return saved_keys >= kCascadeMinSavedKeys;
}

void AttentionPlanner::plan_step(std::span<const int32_t> kv_indptr, int32_t num_seqs, bool decode,
                                 std::span<const SharedPrefixRun> shared,
                                 const AttentionStepArrays& out) const {
  const auto B = static_cast<int32_t>(kv_indptr.size()) - 1;
  std::fill(out.kv_skip, out.kv_skip + num_seqs, 0);
  int32_t num_items = 0, num_members = 0;
  for (const SharedPrefixRun& g : shared) {
    const int32_t keys = g.num_pages * page_size_;
    for (size_t i = 0; i < g.seqs.size(); i += members_per_item_) {
      const auto n = static_cast<int32_t>(std::min<size_t>(members_per_item_, g.seqs.size() - i));
      int32_t* item = out.items + 4 * num_items++;
      item[0] = num_members;
      item[1] = n;
      item[2] = kv_indptr[g.seqs.front()];
      item[3] = keys;
      for (int32_t j = 0; j < n; ++j) {
        const int32_t b = g.seqs[i + j];
        out.members[num_members++] = b;
        out.kv_skip[b] = keys;
      }
    }
  }
  *out.num_items = num_items;
  // Decode attention starts the longest sequences' blocks first (padding, with no keys, last).
  if (decode) {
    int32_t* order = out.seq_order;
    std::iota(order, order + num_seqs, 0);
    auto pages = [&](int32_t b) { return b < B ? kv_indptr[b + 1] - kv_indptr[b] : 0; };
    std::stable_sort(order, order + num_seqs,
                     [&](int32_t a, int32_t b) { return pages(a) > pages(b); });
  }
}

void AttentionPlanner::plan_launch(AttentionPlan& p, int32_t num_seqs, bool cascade,
                                   void* workspace, void* merge_counters) const {
  p.num_splits = p.decode ? decode_splits(num_seqs) : 1;
  if (p.decode && cascade) p.shared_splits = shared_splits(num_seqs);
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes_;
  p.merge_counters = merge_counters;
}

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {

AttentionLaunchRules attention_launch_rules(int device) {
  AttentionLaunchRules rules;
  rules.decode_splits = [device](int num_seqs, int num_kv_heads, int head_dim, int max_kv_len) {
    return paged_attention_decode_num_splits(num_seqs, num_kv_heads, head_dim, max_kv_len, device);
  };
  rules.shared_splits = [device](int num_items, int num_kv_heads) {
    return shared_prefix_num_splits(num_items, num_kv_heads, device);
  };
  rules.workspace_bytes = paged_attention_workspace_bytes;
  rules.members_per_item = shared_prefix_members_per_item;
  return rules;
}

}  // namespace cuda
#endif

}  // namespace pagedlm::ops
