// find_shared_prefixes: which sequences of a step hold the same leading pages.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "pagedlm/sched/scheduler.h"
#include "pagedlm/sched/shared_prefix.h"

namespace pagedlm {
namespace {

using Ints = std::vector<int32_t>;

// A plan of decode-like sequences: each has the given pages, its last page holding `last`
// tokens, and `n_new` new tokens at its end.
StepPlan make_plan(const std::vector<Ints>& pages, const Ints& last, const Ints& n_new) {
  StepPlan plan;
  plan.page_size = 16;
  plan.q_indptr = {0};
  plan.kv_indptr = {0};
  for (size_t b = 0; b < pages.size(); ++b) {
    plan.kv_page_indices.insert(plan.kv_page_indices.end(), pages[b].begin(), pages[b].end());
    plan.kv_indptr.push_back(static_cast<int32_t>(plan.kv_page_indices.size()));
    plan.kv_last_page_len.push_back(last[b]);
    plan.q_indptr.push_back(plan.q_indptr.back() + n_new[b]);
    plan.request_ids.push_back(static_cast<int64_t>(b) + 1);
  }
  plan.token_ids.assign(plan.q_indptr.back(), 1);
  return plan;
}

TEST(SharedPrefix, GroupsByFirstPageAndCommonRun) {
  const StepPlan plan = make_plan({{4, 5, 6, 7, 20},   // 0: group A
                                   {9, 10, 11},        // 1: alone
                                   {4, 5, 6, 30, 31},  // 2: group A, diverges at page 3
                                   {4, 5, 6, 7, 40},   // 3: group A
                                   {9, 12, 13}},       // 4: group B with 1 (one page)
                                  {3, 16, 8, 1, 2}, {1, 1, 1, 1, 1});
  const auto groups = find_shared_prefixes(plan, 1);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].seqs, (Ints{0, 2, 3}));
  EXPECT_EQ(groups[0].num_pages, 3);
  EXPECT_EQ(groups[1].seqs, (Ints{1, 4}));
  EXPECT_EQ(groups[1].num_pages, 1);
  // A minimum run of two pages drops group B.
  const auto long_runs = find_shared_prefixes(plan, 2);
  ASSERT_EQ(long_runs.size(), 1u);
  EXPECT_EQ(long_runs[0].seqs, (Ints{0, 2, 3}));
}

TEST(SharedPrefix, OnlyPagesBeforeEveryNewToken) {
  // Sequence 1's new tokens start inside page 1 (2 pages of 16 hold 20 keys, the last 3 new):
  // only page 0 lies wholly before them. Sequence 2's single new token fills page 1 exactly
  // (32 keys): page 1 is where it is written, so only page 0 counts.
  const StepPlan plan = make_plan({{1, 2, 3}, {1, 2}, {1, 2}}, {5, 4, 16}, {1, 3, 1});
  const auto groups = find_shared_prefixes(plan, 1);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].seqs, (Ints{0, 1, 2}));
  EXPECT_EQ(groups[0].num_pages, 1);
  // With 10 new tokens sequence 1's first new token is in page 0: it shares nothing usable.
  const auto without =
      find_shared_prefixes(make_plan({{1, 2, 3}, {1, 2}, {1, 2}}, {5, 4, 16}, {1, 10, 1}), 1);
  ASSERT_EQ(without.size(), 1u);
  EXPECT_EQ(without[0].seqs, (Ints{0, 2}));
  // Alone, a sequence is no group; padding sequences (no pages) are skipped.
  EXPECT_TRUE(find_shared_prefixes(make_plan({{1, 2, 3}, {}}, {5, 0}, {1, 0}), 1).empty());
}

TEST(SharedPrefix, NeverGroupsByTheNullPage) {
  // Sequences 0 and 1 released their first two pages (entries of the null page, 99); 2 and 3
  // hold pages 4 and 5.
  StepPlan plan =
      make_plan({{99, 99, 5, 6}, {99, 99, 5, 6}, {4, 5, 7}, {4, 5, 8}}, {1, 1, 1, 1}, {1, 1, 1, 1});
  plan.null_page = 99;
  const auto groups = find_shared_prefixes(plan, 1);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].seqs, (Ints{2, 3}));
  EXPECT_EQ(groups[0].num_pages, 2);
  // Were 99 a real page, 0 and 1 would share all three of their full pages.
  plan.null_page = -1;
  const auto with_real_page = find_shared_prefixes(plan, 1);
  ASSERT_EQ(with_real_page.size(), 2u);
  EXPECT_EQ(with_real_page[0].seqs, (Ints{0, 1}));
  EXPECT_EQ(with_real_page[0].num_pages, 3);
}

// Three requests with the same 40-token prompt prefix: after the first one's prefill, the
// others hit its two full pages in the prefix cache. Returns the groups of each decode step.
std::vector<std::vector<SharedPrefixGroup>> decode_groups(int32_t window) {
  SchedulerConfig config;
  config.page_size = 16;
  config.num_pages = 64;
  config.window = window;
  Scheduler scheduler(config);
  Ints prefix(40);
  std::iota(prefix.begin(), prefix.end(), 100);
  for (int64_t id = 1; id <= 3; ++id) {
    Request r;
    r.id = id;
    r.prompt = prefix;
    r.prompt.push_back(static_cast<int32_t>(id));
    r.sampling.max_tokens = 8;
    r.sampling.ignore_eos = true;
    scheduler.add(std::move(r));
  }
  std::vector<std::vector<SharedPrefixGroup>> groups;
  while (scheduler.has_unfinished()) {
    const StepPlan plan = scheduler.schedule();
    bool decode = plan.num_seqs() == 3;
    for (int32_t b = 0; decode && b < 3; ++b) decode = plan.q_indptr[b + 1] - plan.q_indptr[b] == 1;
    if (decode) groups.push_back(find_shared_prefixes(plan, 1));
    scheduler.update(plan, Ints(plan.num_seqs(), 7));
  }
  return groups;
}

TEST(SharedPrefix, FoundInTheSchedulersDecodeSteps) {
  const auto steps = decode_groups(/*window=*/0);
  ASSERT_EQ(steps.size(), 7u);  // the first token of each comes with its prompt
  for (const std::vector<SharedPrefixGroup>& groups : steps) {
    ASSERT_EQ(groups.size(), 1u);
    EXPECT_EQ(groups[0].seqs, (Ints{0, 1, 2}));
    EXPECT_EQ(groups[0].num_pages, 2);  // 32 of the 40 shared tokens: the full pages
  }
}

TEST(SharedPrefix, NotFoundOnceTheSharedPagesAreReleased) {
  // A window of 24: the first decode query (41) sees keys 18.., so each sequence released page
  // 0 after its prompt, and all three tables begin with the null page.
  const auto steps = decode_groups(/*window=*/24);
  ASSERT_EQ(steps.size(), 7u);
  for (const std::vector<SharedPrefixGroup>& groups : steps) EXPECT_TRUE(groups.empty());
}

}  // namespace
}  // namespace pagedlm
