// The attention planner's host logic (ops/attention_planner.h) against hand-computed plans: split
// counts and the worst-case workspace from given launch rules (not the GPU's), the cascade's
// threshold, a step's items, members, kv_skip and decode order, and the launch shape it binds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/ops/attention_planner.h"

namespace pagedlm::ops {
namespace {

// Decode splits by batch size (1 .. 4), whatever else is asked; records what it was asked.
struct FakeRules {
  std::vector<int> decode_table = {0, 6, 5, 2, 1};
  int members = 2;
  std::vector<std::vector<int>> decode_calls;

  AttentionLaunchRules rules() {
    AttentionLaunchRules r;
    r.decode_splits = [this](int num_seqs, int num_kv_heads, int head_dim, int max_kv_len) {
      decode_calls.push_back({num_seqs, num_kv_heads, head_dim, max_kv_len});
      return decode_table.at(num_seqs);
    };
    // 16 blocks over the items' kv heads, 1 to 16 splits.
    r.shared_splits = [](int num_items, int num_kv_heads) {
      return std::clamp(16 / (num_items * num_kv_heads), 1, 16);
    };
    // One f32 per (token, q head, dim, split) beyond the first.
    r.workspace_bytes = [](int tokens, int q_heads, int head_dim, int splits) -> size_t {
      return splits <= 1 ? 0 : size_t{4} * tokens * q_heads * head_dim * splits;
    };
    r.members_per_item = [this](int, int) { return members; };
    return r;
  }
};

AttentionShape shape(bool cascade) {
  AttentionShape s;
  s.num_q_heads = 8;
  s.num_kv_heads = 2;
  s.head_dim = 64;
  s.max_model_len = 4096;
  s.max_bucket = 4;
  s.page_size = 16;
  s.cascade = cascade;
  return s;
}

TEST(AttentionPlanner, SplitsAndWorkspaceWithoutCascade) {
  FakeRules fake;
  const AttentionPlanner planner(shape(false), fake.rules());
  // Every bucket asked once, at the longest context, with the rank's kv heads and head size.
  const std::vector<std::vector<int>> asked = {
      {1, 2, 64, 4096}, {2, 2, 64, 4096}, {3, 2, 64, 4096}, {4, 2, 64, 4096}};
  EXPECT_EQ(fake.decode_calls, asked);
  // tokens x splits: 1 x 6, 2 x 5, 3 x 2, 4 x 1 (no workspace): the worst is 10, times
  // 4 bytes x 8 q heads x 64 dims.
  EXPECT_EQ(planner.workspace_bytes(), size_t{10} * 4 * 8 * 64);
  // The merge's counters: one a (sequence, kv head) of the largest bucket, 4 x 2.
  EXPECT_EQ(planner.merge_counter_bytes(), size_t{4} * 2 * 4);
  EXPECT_EQ(planner.decode_splits(1), 6);
  EXPECT_EQ(planner.decode_splits(2), 5);
  EXPECT_EQ(planner.decode_splits(3), 2);
  EXPECT_EQ(planner.decode_splits(4), 1);
  EXPECT_EQ(planner.shared_splits(4), 0);
  EXPECT_THROW(planner.decode_splits(5), Error);
  EXPECT_THROW(planner.decode_splits(0), Error);
  EXPECT_EQ(planner.members_per_item(), 2);
}

TEST(AttentionPlanner, SplitsAndWorkspaceWithCascade) {
  FakeRules fake;
  const AttentionPlanner planner(shape(true), fake.rules());
  // Items at 2 members each: 1, 1, 2, 2; shared splits 16 / (items x 2 kv heads): 8, 8, 4, 4.
  EXPECT_EQ(planner.shared_splits(1), 8);
  EXPECT_EQ(planner.shared_splits(2), 8);
  EXPECT_EQ(planner.shared_splits(3), 4);
  EXPECT_EQ(planner.shared_splits(4), 4);
  // tokens x (splits + shared): 1 x 14, 2 x 13, 3 x 6, 4 x 5: the worst is 26.
  EXPECT_EQ(planner.workspace_bytes(), size_t{26} * 4 * 8 * 64);
  // Each bucket's own sum fits that, so no split count shrinks.
  EXPECT_EQ(planner.decode_splits(1), 6);
  EXPECT_EQ(planner.decode_splits(2), 5);
  EXPECT_EQ(planner.decode_splits(3), 2);
  EXPECT_EQ(planner.decode_splits(4), 1);
}

TEST(AttentionPlanner, NoWorkspaceWhenNothingSplits) {
  FakeRules fake;
  fake.decode_table = {0, 1, 1, 1, 1};
  const AttentionPlanner planner(shape(false), fake.rules());
  EXPECT_EQ(planner.workspace_bytes(), 0U);
  EXPECT_EQ(planner.merge_counter_bytes(), 0U);
  EXPECT_EQ(planner.decode_splits(3), 1);
}

TEST(AttentionPlanner, CascadeThreshold) {
  FakeRules fake;
  const AttentionPlanner planner(shape(true), fake.rules());
  const std::vector<int32_t> three = {0, 1, 2}, two = {3, 4};
  // Saved keys: (members - 1) x pages x 16 per run.
  const std::vector<SharedPrefixRun> below = {{three, 64}};           // 2 x 64 x 16 = 2048
  const std::vector<SharedPrefixRun> at = {{three, 64}, {two, 128}};  // 2048 + 1 x 128 x 16
  const std::vector<SharedPrefixRun> above = {{two, 300}};            // 4800
  EXPECT_FALSE(planner.takes_cascade({}));
  EXPECT_FALSE(planner.takes_cascade(below));
  EXPECT_TRUE(planner.takes_cascade(at));
  EXPECT_TRUE(planner.takes_cascade(above));
  const AttentionPlanner off(shape(false), fake.rules());
  EXPECT_FALSE(off.takes_cascade(above));
}

// Host arrays for 8 sequences, filled with a value no plan writes.
struct Arrays {
  static constexpr int32_t kUnset = -7;
  std::vector<int32_t> kv_skip = std::vector<int32_t>(8, kUnset);
  int32_t num_items = kUnset;
  std::vector<int32_t> items = std::vector<int32_t>(32, kUnset);
  std::vector<int32_t> members = std::vector<int32_t>(8, kUnset);
  std::vector<int32_t> seq_order = std::vector<int32_t>(8, kUnset);

  AttentionStepArrays view() {
    return {kv_skip.data(), &num_items, items.data(), members.data(), seq_order.data()};
  }
};

TEST(AttentionPlanner, StepItemsAndDecodeOrder) {
  FakeRules fake;  // 2 members per item
  const AttentionPlanner planner(shape(true), fake.rules());
  // Five sequences of 3, 5, 5, 2 and 7 pages, padded to 8.
  const std::vector<int32_t> kv_indptr = {0, 3, 8, 13, 15, 22};
  const std::vector<int32_t> run_a = {0, 1, 4}, run_b = {2, 3};
  const std::vector<SharedPrefixRun> shared = {{run_a, 2}, {run_b, 1}};
  Arrays a;
  planner.plan_step(kv_indptr, 8, /*decode=*/true, shared, a.view());
  // Run a (2 pages, 32 keys, pages from kv_indptr[0]) as items {0, 1} and {4}; run b (16 keys,
  // pages from kv_indptr[2] = 8) as one item.
  EXPECT_EQ(a.num_items, 3);
  const std::vector<int32_t> items = {0, 2, 0, 32, 2, 1, 0, 32, 3, 2, 8, 16};
  EXPECT_EQ(std::vector<int32_t>(a.items.begin(), a.items.begin() + 12), items);
  EXPECT_EQ(a.items[12], Arrays::kUnset);
  const std::vector<int32_t> members = {
      0, 1, 4, 2, 3, Arrays::kUnset, Arrays::kUnset, Arrays::kUnset};
  EXPECT_EQ(a.members, members);
  const std::vector<int32_t> kv_skip = {32, 32, 16, 16, 32, 0, 0, 0};
  EXPECT_EQ(a.kv_skip, kv_skip);
  // Longest first, ties in index order, padding (no pages) last.
  const std::vector<int32_t> order = {4, 1, 2, 0, 3, 5, 6, 7};
  EXPECT_EQ(a.seq_order, order);
}

TEST(AttentionPlanner, StepWithoutSharedPass) {
  FakeRules fake;
  const AttentionPlanner planner(shape(true), fake.rules());
  const std::vector<int32_t> kv_indptr = {0, 3, 8, 13};
  Arrays a;
  // A prefill step: no items, kv_skip zero for its 4 sequences, no decode order.
  planner.plan_step(kv_indptr, 4, /*decode=*/false, {}, a.view());
  EXPECT_EQ(a.num_items, 0);
  const std::vector<int32_t> kv_skip = {
      0, 0, 0, 0, Arrays::kUnset, Arrays::kUnset, Arrays::kUnset, Arrays::kUnset};
  EXPECT_EQ(a.kv_skip, kv_skip);
  EXPECT_EQ(a.seq_order, std::vector<int32_t>(8, Arrays::kUnset));
  EXPECT_EQ(a.members, std::vector<int32_t>(8, Arrays::kUnset));
  // The warm-up's empty plan as a decode bucket of 4: all padding, in index order.
  Arrays w;
  planner.plan_step(std::vector<int32_t>{0}, 4, /*decode=*/true, {}, w.view());
  EXPECT_EQ(w.num_items, 0);
  const std::vector<int32_t> order = {
      0, 1, 2, 3, Arrays::kUnset, Arrays::kUnset, Arrays::kUnset, Arrays::kUnset};
  EXPECT_EQ(w.seq_order, order);
}

TEST(AttentionPlanner, LaunchShape) {
  FakeRules fake;
  const AttentionPlanner planner(shape(true), fake.rules());
  int workspace = 0;
  unsigned counters[8] = {};
  AttentionPlan decode;
  decode.decode = true;
  planner.plan_launch(decode, 2, /*cascade=*/true, &workspace);
  EXPECT_EQ(decode.num_splits, 5);
  EXPECT_EQ(decode.shared_splits, 8);
  EXPECT_EQ(decode.workspace, &workspace);
  EXPECT_EQ(decode.workspace_bytes, size_t{26} * 4 * 8 * 64);
  EXPECT_EQ(decode.merge_counters, nullptr);
  AttentionPlan plain;
  plain.decode = true;
  planner.plan_launch(plain, 3, /*cascade=*/false, &workspace, counters);
  EXPECT_EQ(plain.num_splits, 2);
  EXPECT_EQ(plain.shared_splits, 0);
  EXPECT_EQ(plain.merge_counters, counters);
  // Prefill: one split, whatever its sequence count (beyond the decode buckets too).
  AttentionPlan prefill;
  planner.plan_launch(prefill, 64, /*cascade=*/false, &workspace);
  EXPECT_EQ(prefill.num_splits, 1);
  EXPECT_EQ(prefill.shared_splits, 0);
  EXPECT_EQ(prefill.workspace, &workspace);
}

}  // namespace
}  // namespace pagedlm::ops
