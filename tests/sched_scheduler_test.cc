#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/sched/scheduler.h"

namespace pagedlm {
namespace {

using Ints = std::vector<int32_t>;

Request make_request(int64_t id, Ints prompt, int32_t max_tokens) {
  Request request;
  request.id = id;
  request.prompt = std::move(prompt);
  request.sampling.max_tokens = max_tokens;
  return request;
}

Ints iota_tokens(int32_t count, int32_t first) {
  Ints tokens(count);
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

// The pages of sequence b in the plan.
Ints plan_pages(const StepPlan& plan, int32_t b) {
  return {plan.kv_page_indices.begin() + plan.kv_indptr[b],
          plan.kv_page_indices.begin() + plan.kv_indptr[b + 1]};
}

Ints plan_positions(const StepPlan& plan, int32_t b) {
  return {plan.positions.begin() + plan.q_indptr[b], plan.positions.begin() + plan.q_indptr[b + 1]};
}

const SequenceView* find_view(const std::vector<SequenceView>& views, int64_t id) {
  for (const SequenceView& view : views) {
    if (view.request_id == id) return &view;
  }
  return nullptr;
}

// Runs one step whose every sampled token is `token`.
std::vector<SeqUpdate> step(Scheduler& scheduler, int32_t token = 7) {
  const StepPlan plan = scheduler.schedule();
  return scheduler.update(plan, Ints(plan.num_seqs(), token));
}

TEST(Scheduler, MixedPrefillDecodePlanByHand) {
  SchedulerConfig config;
  config.page_size = 4;
  config.num_pages = 8;
  config.max_num_batched_tokens = 6;
  config.max_model_len = 32;
  Scheduler scheduler(config);
  scheduler.add(make_request(1, {10, 11, 12, 13, 14}, 3));

  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.page_size, 4);
  EXPECT_EQ(plan.token_ids, (Ints{10, 11, 12, 13, 14}));
  EXPECT_EQ(plan.positions, (Ints{0, 1, 2, 3, 4}));
  EXPECT_EQ(plan.q_indptr, (Ints{0, 5}));
  EXPECT_EQ(plan.kv_indptr, (Ints{0, 2}));
  EXPECT_EQ(plan.kv_page_indices, (Ints{0, 1}));
  EXPECT_EQ(plan.kv_last_page_len, (Ints{1}));
  EXPECT_EQ(plan.slot_mapping, (Ints{0, 1, 2, 3, 4}));
  EXPECT_EQ(plan.logits_rows, (Ints{4}));
  EXPECT_EQ(plan.logits_indptr, (Ints{0, 1}));
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1}));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{1}));
  std::vector<SeqUpdate> updates = scheduler.update(plan, {100});
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(updates[0].request_id, 1);
  EXPECT_EQ(updates[0].token, 100);
  EXPECT_FALSE(updates[0].finished);

  Request second = make_request(2, {20, 21, 22, 23, 24, 25}, 2);
  second.want_prompt_logits = true;
  scheduler.add(second);
  // Decode of 1 first, then 5 of the 6 prompt tokens of 2 fill the budget of 6.
  plan = scheduler.schedule();
  EXPECT_EQ(plan.token_ids, (Ints{100, 20, 21, 22, 23, 24}));
  EXPECT_EQ(plan.positions, (Ints{5, 0, 1, 2, 3, 4}));
  EXPECT_EQ(plan.q_indptr, (Ints{0, 1, 6}));
  EXPECT_EQ(plan.kv_indptr, (Ints{0, 2, 4}));
  EXPECT_EQ(plan.kv_page_indices, (Ints{0, 1, 2, 3}));
  EXPECT_EQ(plan.kv_last_page_len, (Ints{2, 1}));
  EXPECT_EQ(plan.slot_mapping, (Ints{5, 8, 9, 10, 11, 12}));
  EXPECT_EQ(plan.logits_rows, (Ints{0, 1, 2, 3, 4, 5}));  // every prompt row of 2
  EXPECT_EQ(plan.logits_indptr, (Ints{0, 1, 6}));
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{1, 0}));
  updates = scheduler.update(plan, {101, 999});
  ASSERT_EQ(updates.size(), 2u);
  EXPECT_EQ(updates[0].token, 101);
  EXPECT_EQ(updates[1].request_id, 2);
  EXPECT_EQ(updates[1].token, -1);
  EXPECT_FALSE(updates[1].finished);

  // The last prompt row of 2 is both a prompt-logit row and the sampled row.
  plan = scheduler.schedule();
  EXPECT_EQ(plan.token_ids, (Ints{101, 25}));
  EXPECT_EQ(plan.positions, (Ints{6, 5}));
  EXPECT_EQ(plan.q_indptr, (Ints{0, 1, 2}));
  EXPECT_EQ(plan.kv_indptr, (Ints{0, 2, 4}));
  EXPECT_EQ(plan.kv_page_indices, (Ints{0, 1, 2, 3}));
  EXPECT_EQ(plan.kv_last_page_len, (Ints{3, 2}));
  EXPECT_EQ(plan.slot_mapping, (Ints{6, 13}));
  EXPECT_EQ(plan.logits_rows, (Ints{0, 1}));
  EXPECT_EQ(plan.logits_indptr, (Ints{0, 1, 2}));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{1, 1}));
  updates = scheduler.update(plan, {102, 200});
  EXPECT_TRUE(updates[0].finished);
  EXPECT_EQ(updates[0].reason, FinishReason::kLength);
  EXPECT_EQ(updates[1].token, 200);
  EXPECT_FALSE(updates[1].finished);
  EXPECT_EQ(scheduler.stats().num_running, 1);
  EXPECT_EQ(scheduler.stats().pages_used, 2);
}

TEST(Scheduler, ChunkedPrefillUnderABudgetOf16) {
  SchedulerConfig config;
  config.page_size = 16;
  config.num_pages = 64;
  config.max_num_batched_tokens = 16;
  Scheduler scheduler(config);
  scheduler.add(make_request(1, iota_tokens(40, 1), 2));

  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.positions, iota_tokens(16, 0));
  EXPECT_EQ(plan.kv_page_indices, (Ints{0}));
  EXPECT_EQ(plan.kv_last_page_len, (Ints{16}));
  EXPECT_TRUE(plan.logits_rows.empty());  // mid-prefill, no prompt logits: nothing to compute
  EXPECT_EQ(plan.logits_indptr, (Ints{0, 0}));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{0}));
  std::vector<SeqUpdate> updates = scheduler.update(plan, {0});
  EXPECT_EQ(updates[0].token, -1);

  scheduler.add(make_request(2, iota_tokens(20, 100), 1));
  plan = scheduler.schedule();  // the running prefill takes the whole budget
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1}));
  EXPECT_EQ(plan.positions, iota_tokens(16, 16));
  EXPECT_EQ(plan.kv_page_indices, (Ints{0, 1}));
  scheduler.update(plan, {0});

  plan = scheduler.schedule();  // 8 to finish 1's prompt, 8 to start 2's
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(plan.q_indptr, (Ints{0, 8, 16}));
  EXPECT_EQ(plan_positions(plan, 0), iota_tokens(8, 32));
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(8, 0));
  EXPECT_EQ(plan.kv_last_page_len, (Ints{8, 8}));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(plan.logits_rows, (Ints{7}));
  EXPECT_EQ(plan.logits_indptr, (Ints{0, 1, 1}));
  updates = scheduler.update(plan, {500, 0});
  EXPECT_EQ(updates[0].token, 500);
  EXPECT_EQ(updates[1].token, -1);

  plan = scheduler.schedule();  // a decode and the rest of 2's prompt in one step
  EXPECT_EQ(plan.q_indptr, (Ints{0, 1, 13}));
  EXPECT_EQ(plan.token_ids[0], 500);
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(12, 8));
  EXPECT_EQ(plan.logits_rows, (Ints{0, 12}));
  updates = scheduler.update(plan, {501, 600});
  EXPECT_TRUE(updates[0].finished);
  EXPECT_TRUE(updates[1].finished);
  EXPECT_FALSE(scheduler.has_unfinished());
  EXPECT_EQ(scheduler.stats().pages_used, 0);
}

// Whole pages are shared by reference; where the common prefix ends inside a page, its leading
// tokens are copied from the cached page into the new request's own page (StepPlan::kv_copies).
class PrefixHitTest : public ::testing::Test {
 protected:
  // A 40-token prompt and one sharing only its first 33 tokens: two whole pages and one token.
  static Ints first_prompt() { return iota_tokens(40, 1000); }
  static Ints second_prompt() {
    Ints prompt = first_prompt();
    for (size_t i = 33; i < prompt.size(); ++i) prompt[i] += 5000;
    return prompt;
  }

  static SchedulerConfig config(bool enable_prefix_cache) {
    SchedulerConfig config;
    config.page_size = 16;
    config.num_pages = 32;
    config.enable_prefix_cache = enable_prefix_cache;
    return config;
  }
};

TEST_F(PrefixHitTest, SharesTheTwoCommonFullPagesAndCopiesTheCommonToken) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, first_prompt(), 8));
  step(scheduler);
  scheduler.add(make_request(2, second_prompt(), 8));

  const StepPlan plan = scheduler.schedule();
  ASSERT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(scheduler.num_cached_tokens(2), 33);
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(7, 33));
  const Ints first_pages = plan_pages(plan, 0);
  const Ints second_pages = plan_pages(plan, 1);
  ASSERT_EQ(first_pages.size(), 3u);
  ASSERT_EQ(second_pages.size(), 3u);
  EXPECT_EQ(second_pages[0], first_pages[0]);
  EXPECT_EQ(second_pages[1], first_pages[1]);
  EXPECT_NE(second_pages[2], first_pages[2]);
  // Token 32 is slot 0 of 1's third page; 2's own third page gets it, and 2 writes from slot 1.
  EXPECT_EQ(plan.kv_copies, (Ints{first_pages[2], second_pages[2], 1}));
  EXPECT_EQ(plan.slot_mapping[plan.q_indptr[1]], second_pages[2] * 16 + 1);

  const std::vector<SequenceView> views = scheduler.sequence_map();
  const SequenceView* second = find_view(views, 2);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->page_shared, (std::vector<uint8_t>{1, 1, 0}));
  EXPECT_EQ(second->page_ref_counts, (Ints{2, 2, 1}));
  EXPECT_EQ(second->num_cached_tokens, 33);
  EXPECT_EQ(second->copy_page_index, 2);
  EXPECT_EQ(second->copy_src_page, first_pages[2]);
  EXPECT_EQ(second->num_copied_tokens, 1);
  // The copy source is held through the step, but by no sequence: 1 still holds it alone.
  EXPECT_EQ(find_view(views, 1)->page_shared, (std::vector<uint8_t>{1, 1, 0}));
  EXPECT_EQ(find_view(views, 1)->copy_page_index, -1);
  SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.prefix_query_tokens, 80);
  EXPECT_EQ(stats.prefix_hit_tokens, 33);
  EXPECT_EQ(stats.prefix_partial_hits, 1);
  EXPECT_EQ(stats.prefix_partial_hit_tokens, 1);
  EXPECT_EQ(stats.pages_used, 4);

  // The next step copies nothing: the copy happens once, in the step that admits.
  scheduler.update(plan, {7, 7});
  EXPECT_TRUE(scheduler.schedule().kv_copies.empty());
}

TEST_F(PrefixHitTest, FinishedRequestLeavesItsFullPagesCached) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, first_prompt(), 1));
  step(scheduler);
  EXPECT_FALSE(scheduler.has_unfinished());
  EXPECT_EQ(scheduler.stats().pages_cached, 2);  // the third page held only 8 tokens
  EXPECT_EQ(scheduler.stats().pages_free, 32);

  // Freed tail first: the partly filled third page (8 prompt tokens computed; the sampled token
  // never was) is reused last but one, the shared first page last.
  const std::vector<CachedPageView> cached = scheduler.cached_pages(100);
  ASSERT_EQ(cached.size(), 3u);
  EXPECT_EQ(cached[0].page, 2);
  EXPECT_EQ(cached[0].num_tokens, 8);
  EXPECT_FALSE(cached[0].full);
  EXPECT_EQ(cached[1].page, 1);
  EXPECT_EQ(cached[1].num_tokens, 16);
  EXPECT_TRUE(cached[1].full);
  EXPECT_EQ(cached[2].page, 0);
  EXPECT_EQ(scheduler.cached_pages(1).size(), 1u);

  scheduler.add(make_request(2, second_prompt(), 1));
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(scheduler.num_cached_tokens(2), 33);
  EXPECT_EQ(plan_pages(plan, 0)[0], 0);
  EXPECT_EQ(plan_pages(plan, 0)[1], 1);
  // The free third page is the copy source: held through the step, so no allocation takes it.
  EXPECT_EQ(plan.kv_copies, (Ints{2, plan_pages(plan, 0)[2], 1}));
  EXPECT_NE(plan_pages(plan, 0)[2], 2);
  EXPECT_EQ(scheduler.stats().pages_cached, 0);
  EXPECT_EQ(scheduler.stats().pages_used, 4);
  scheduler.update(plan, {7});
  // After the step the source is free again, still cached, and nothing leaked.
  EXPECT_EQ(scheduler.stats().pages_used, 0);
  EXPECT_EQ(scheduler.stats().pages_free, 32);
}

TEST_F(PrefixHitTest, HitLeavesAtLeastOneTokenToCompute) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, iota_tokens(32, 1), 1));
  step(scheduler);
  scheduler.add(make_request(2, iota_tokens(32, 1), 1));
  const StepPlan plan = scheduler.schedule();
  // The whole prompt is cached, but its last token is computed for its logits: one full page
  // is shared and the copy covers the second page up to the prompt's second-to-last token.
  EXPECT_EQ(scheduler.num_cached_tokens(2), 31);
  EXPECT_EQ(plan.positions, (Ints{31}));
  EXPECT_EQ(plan_pages(plan, 0)[0], 0);
  EXPECT_EQ(plan.kv_copies, (Ints{1, plan_pages(plan, 0)[1], 15}));
  EXPECT_EQ(plan.slot_mapping, (Ints{plan_pages(plan, 0)[1] * 16 + 15}));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{1}));
}

TEST_F(PrefixHitTest, PagesFilledInAStepAreSharedInThatStep) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, first_prompt(), 1));
  scheduler.add(make_request(2, first_prompt(), 1));
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(scheduler.num_cached_tokens(2), 39);
  EXPECT_EQ(plan_positions(plan, 1), (Ints{39}));
  EXPECT_EQ(plan_pages(plan, 1)[0], plan_pages(plan, 0)[0]);
  EXPECT_EQ(plan_pages(plan, 1)[1], plan_pages(plan, 0)[1]);
  // 1's third page is being filled in this very step: the copy runs after each layer's cache
  // write, so its 7 leading slots are there when copied.
  EXPECT_EQ(plan.kv_copies, (Ints{plan_pages(plan, 0)[2], plan_pages(plan, 1)[2], 7}));
}

TEST_F(PrefixHitTest, ACopyDestinationIsNoSourceInTheSameStep) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, first_prompt(), 1));
  step(scheduler);
  // Both copy from 1's freed third page; neither from the other's fresh page, whose leading
  // slots are only being copied in this step.
  scheduler.add(make_request(2, second_prompt(), 1));
  scheduler.add(make_request(3, second_prompt(), 1));
  const StepPlan plan = scheduler.schedule();
  ASSERT_EQ(plan.num_seqs(), 2);
  ASSERT_EQ(plan.num_kv_copies(), 2);
  EXPECT_EQ(plan.kv_copies[0], 2);
  EXPECT_EQ(plan.kv_copies[3], 2);
  EXPECT_EQ(plan.kv_copies[1], plan_pages(plan, 0)[2]);
  EXPECT_EQ(plan.kv_copies[4], plan_pages(plan, 1)[2]);
  // 3 shares 2's whole pages 0-1 (1's, in fact) and copies one token; its 7 other tokens are
  // 2's too, but they are in this step's plan only from 2's page, a copy destination.
  EXPECT_EQ(scheduler.num_cached_tokens(3), 33);
  scheduler.update(plan, {7, 7});
  EXPECT_EQ(scheduler.stats().pages_used, 0);
  EXPECT_EQ(scheduler.stats().pages_free, 32);
}

TEST_F(PrefixHitTest, PreemptingASequenceWhoseFirstPageCameFromACopy) {
  SchedulerConfig small = config(true);
  small.num_pages = 4;
  small.max_model_len = 64;
  Scheduler scheduler(small);
  scheduler.add(make_request(1, iota_tokens(10, 1), 1));
  step(scheduler);  // page 0 keeps 10 computed tokens
  // 3 is admitted after 2, so it is the one preempted when they outgrow the pool.
  Ints prompt = iota_tokens(10, 1);
  for (int32_t t = 0; t < 5; ++t) prompt.push_back(500 + t);
  scheduler.add(make_request(2, iota_tokens(16, 900), 30));
  scheduler.add(make_request(3, prompt, 40));
  StepPlan plan = scheduler.schedule();
  ASSERT_EQ(plan.request_ids, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(plan.kv_copies, (Ints{0, plan_pages(plan, 1)[0], 10}));
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(5, 10));
  scheduler.update(plan, {7, 7});
  for (int i = 0; i < 200 && scheduler.stats().preemptions == 0; ++i) step(scheduler);
  ASSERT_EQ(scheduler.stats().preemptions, 1);
  // 3 gave its pages back; its copy is forgotten with them.
  EXPECT_EQ(find_view(scheduler.sequence_map(), 3), nullptr);
  EXPECT_EQ(scheduler.stats().num_waiting, 1);

  // When 3 comes back it finds its own first page again; every copy of the run reads a page
  // that no slot of its step writes.
  int32_t readmission_hits = -1;
  while (scheduler.has_unfinished()) {
    plan = scheduler.schedule();
    for (int32_t c = 0; c < plan.num_kv_copies(); ++c) {
      const int32_t src = plan.kv_copies[3 * c], dst = plan.kv_copies[3 * c + 1];
      EXPECT_NE(src, dst);
      for (const int32_t slot : plan.slot_mapping) EXPECT_NE(slot / 16, src);
    }
    for (int32_t b = 0; b < plan.num_seqs(); ++b) {
      if (plan.request_ids[b] == 3 && readmission_hits < 0) {
        readmission_hits = scheduler.num_cached_tokens(3);
        EXPECT_EQ(plan_positions(plan, b).front(), readmission_hits);
      }
    }
    scheduler.update(plan, Ints(plan.num_seqs(), 7));
  }
  // Its first page, 10 slots copied and 6 computed, was full when 3 was preempted and nothing
  // reused it while 2 finished: a whole-page hit now, whatever its slots' origin.
  EXPECT_EQ(readmission_hits, 16);
  EXPECT_EQ(scheduler.stats().pages_used, 0);
  EXPECT_EQ(scheduler.stats().pages_free, 4);
}

TEST_F(PrefixHitTest, NothingIsSharedWhenTheCacheIsDisabled) {
  Scheduler scheduler(config(false));
  scheduler.add(make_request(1, first_prompt(), 8));
  step(scheduler);
  scheduler.add(make_request(2, first_prompt(), 8));
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(scheduler.num_cached_tokens(2), 0);
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(40, 0));
  for (const SequenceView& view : scheduler.sequence_map()) {
    EXPECT_EQ(view.page_shared, (std::vector<uint8_t>{0, 0, 0}));
  }
  scheduler.cancel(1);
  scheduler.cancel(2);
  const SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.prefix_query_tokens, 0);
  EXPECT_EQ(stats.prefix_hit_tokens, 0);
  EXPECT_EQ(stats.pages_cached, 0);
  EXPECT_EQ(stats.pages_free, 32);
}

TEST_F(PrefixHitTest, OptedOutRequestDoesNotLookUpButStillRegisters) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, first_prompt(), 8));
  step(scheduler);
  Request opted_out = make_request(2, first_prompt(), 8);
  opted_out.use_prefix_cache = false;
  scheduler.add(opted_out);
  step(scheduler);
  EXPECT_EQ(scheduler.num_cached_tokens(2), 0);
  EXPECT_EQ(scheduler.stats().prefix_query_tokens, 40);

  scheduler.cancel(1);  // its pages stay cached, but so do 2's: either may serve
  scheduler.add(make_request(3, first_prompt(), 8));
  step(scheduler);
  EXPECT_EQ(scheduler.num_cached_tokens(3), 39);
}

TEST_F(PrefixHitTest, DifferentSaltsNeverShare) {
  Scheduler scheduler(config(true));
  Request first = make_request(1, first_prompt(), 8);
  first.cache_salt = "tenant-a";
  scheduler.add(first);
  step(scheduler);
  Request second = make_request(2, first_prompt(), 8);
  second.cache_salt = "tenant-b";
  scheduler.add(second);
  Request same_tenant = make_request(3, first_prompt(), 8);
  same_tenant.cache_salt = "tenant-a";
  scheduler.add(same_tenant);
  step(scheduler);
  // Not even a partial hit on the first page, whose parent is the same root for every tenant.
  EXPECT_EQ(scheduler.num_cached_tokens(2), 0);
  EXPECT_EQ(scheduler.num_cached_tokens(3), 39);
}

TEST_F(PrefixHitTest, PartialHitsNeedTheSameSalt) {
  // A prompt shorter than a page is only ever a partial hit.
  Scheduler scheduler(config(true));
  Request first = make_request(1, iota_tokens(10, 1), 1);
  first.cache_salt = "tenant-a";
  scheduler.add(first);
  step(scheduler);
  Request other_tenant = make_request(2, iota_tokens(10, 1), 1);
  other_tenant.cache_salt = "tenant-b";
  Request no_salt = make_request(3, iota_tokens(10, 1), 1);
  Request same_tenant = make_request(4, iota_tokens(10, 1), 1);
  same_tenant.cache_salt = "tenant-a";
  scheduler.add(other_tenant);
  scheduler.add(no_salt);
  scheduler.add(same_tenant);
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(scheduler.num_cached_tokens(2), 0);
  EXPECT_EQ(scheduler.num_cached_tokens(3), 0);
  EXPECT_EQ(scheduler.num_cached_tokens(4), 9);
  EXPECT_EQ(plan.kv_copies, (Ints{0, plan_pages(plan, 2)[0], 9}));
}

TEST(Scheduler, RespectsMaxNumSeqs) {
  SchedulerConfig config;
  config.max_num_seqs = 2;
  Scheduler scheduler(config);
  for (int64_t id = 1; id <= 3; ++id) scheduler.add(make_request(id, iota_tokens(5, 1), 2));
  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(scheduler.stats().num_running, 2);
  EXPECT_EQ(scheduler.stats().num_waiting, 1);
  scheduler.update(plan, {7, 7});
  plan = scheduler.schedule();  // still full
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
  scheduler.update(plan, {7, 7});  // both reach max_tokens
  plan = scheduler.schedule();
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{3}));
}

TEST(Scheduler, FinishReasons) {
  SchedulerConfig config;
  config.eos_token_ids = {2};
  config.max_model_len = 8;
  Scheduler scheduler(config);
  scheduler.add(make_request(1, {5, 5}, 5));  // stops at eos
  Request ignores_eos = make_request(2, {5, 5}, 5);
  ignores_eos.sampling.ignore_eos = true;
  ignores_eos.sampling.stop_token_ids = {9};
  scheduler.add(ignores_eos);                               // ignores eos, stops at 9
  scheduler.add(make_request(3, {5, 5}, 2));                // reaches max_tokens
  scheduler.add(make_request(4, {5, 5, 5, 5, 5, 5}, 100));  // reaches max_model_len

  StepPlan plan = scheduler.schedule();
  std::vector<SeqUpdate> updates = scheduler.update(plan, {2, 2, 2, 3});
  EXPECT_TRUE(updates[0].finished);
  EXPECT_EQ(updates[0].reason, FinishReason::kStop);
  EXPECT_EQ(updates[0].token, 2);
  EXPECT_FALSE(updates[1].finished);
  EXPECT_TRUE(updates[2].finished);  // eos also stops one with room left
  EXPECT_EQ(updates[2].reason, FinishReason::kStop);
  EXPECT_FALSE(updates[3].finished);

  plan = scheduler.schedule();
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{2, 4}));
  updates = scheduler.update(plan, {9, 3});
  EXPECT_TRUE(updates[0].finished);
  EXPECT_EQ(updates[0].reason, FinishReason::kStop);
  EXPECT_TRUE(updates[1].finished);  // 6 prompt + 2 outputs == max_model_len
  EXPECT_EQ(updates[1].reason, FinishReason::kLength);
  EXPECT_FALSE(scheduler.has_unfinished());
  EXPECT_EQ(scheduler.stats().pages_used, 0);
}

TEST(Scheduler, MaxTokensFinishesWithLength) {
  Scheduler scheduler(SchedulerConfig{});
  scheduler.add(make_request(1, {5, 5}, 2));
  EXPECT_FALSE(step(scheduler)[0].finished);
  const std::vector<SeqUpdate> updates = step(scheduler);
  EXPECT_TRUE(updates[0].finished);
  EXPECT_EQ(updates[0].reason, FinishReason::kLength);
  EXPECT_EQ(updates[0].token, 7);
}

TEST(Scheduler, ZeroMaxTokensFinishesWhenThePromptIsDone) {
  SchedulerConfig config;
  config.max_num_batched_tokens = 16;
  Scheduler scheduler(config);
  Request logits_only = make_request(1, iota_tokens(20, 1), 0);
  logits_only.want_prompt_logits = true;
  scheduler.add(logits_only);

  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.logits_rows, iota_tokens(16, 0));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{0}));
  EXPECT_FALSE(scheduler.update(plan, {0})[0].finished);

  plan = scheduler.schedule();
  EXPECT_EQ(plan.logits_rows, iota_tokens(4, 0));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{0}));
  const std::vector<SeqUpdate> updates = scheduler.update(plan, {0});
  EXPECT_TRUE(updates[0].finished);
  EXPECT_EQ(updates[0].reason, FinishReason::kLength);
  EXPECT_EQ(updates[0].token, -1);
  EXPECT_FALSE(scheduler.has_unfinished());
}

TEST(Scheduler, CancelFreesPagesAndReportsInFlightSequences) {
  Scheduler scheduler(SchedulerConfig{});
  scheduler.add(make_request(1, iota_tokens(40, 1), 4));
  scheduler.add(make_request(2, iota_tokens(40, 100), 4));
  EXPECT_TRUE(scheduler.cancel(2));
  EXPECT_FALSE(scheduler.cancel(2));
  EXPECT_FALSE(scheduler.cancel(99));

  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1}));
  EXPECT_TRUE(scheduler.cancel(1));
  EXPECT_EQ(scheduler.stats().pages_used, 0);
  const std::vector<SeqUpdate> updates = scheduler.update(plan, {7});
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_TRUE(updates[0].finished);
  EXPECT_EQ(updates[0].reason, FinishReason::kCancelled);
  EXPECT_EQ(updates[0].token, -1);
  EXPECT_FALSE(scheduler.has_unfinished());
  EXPECT_TRUE(scheduler.schedule().empty());
}

TEST(Scheduler, PreemptsTheNewestAndRecomputesItsOutputs) {
  SchedulerConfig config;
  config.page_size = 4;
  config.num_pages = 4;
  config.max_model_len = 16;
  config.enable_prefix_cache = false;
  Scheduler scheduler(config);
  scheduler.add(make_request(1, iota_tokens(6, 1), 6));
  scheduler.add(make_request(2, iota_tokens(6, 50), 6));
  step(scheduler);  // both prompts: 2 pages each, the pool is full
  step(scheduler);  // positions 6
  step(scheduler);  // positions 7
  EXPECT_EQ(scheduler.stats().preemptions, 0);

  // Position 8 needs a third page: 2, admitted last, gives its pages to 1.
  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1}));
  EXPECT_EQ(plan.positions, (Ints{8}));
  SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.preemptions, 1);
  EXPECT_EQ(stats.num_waiting, 1);
  EXPECT_EQ(scheduler.output_tokens(2), (Ints{7, 7, 7}));
  scheduler.update(plan, {7});

  for (int32_t num_outputs = 5; num_outputs <= 6; ++num_outputs) {
    plan = scheduler.schedule();
    ASSERT_EQ(plan.request_ids, (std::vector<int64_t>{1}));
    const std::vector<SeqUpdate> updates = scheduler.update(plan, {7});
    EXPECT_EQ(updates[0].finished, num_outputs == 6);
  }
  // Back in: prompt and the three outputs recomputed, then it samples its fourth token.
  plan = scheduler.schedule();
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{2}));
  EXPECT_EQ(plan.token_ids, (Ints{50, 51, 52, 53, 54, 55, 7, 7, 7}));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{1}));
  scheduler.update(plan, {8});
  EXPECT_EQ(scheduler.output_tokens(2), (Ints{7, 7, 7, 8}));
}

TEST(Scheduler, UpdateRejectsAPlanItDidNotMake) {
  Scheduler scheduler(SchedulerConfig{});
  scheduler.add(make_request(1, {5, 6}, 2));
  scheduler.add(make_request(2, {5, 6}, 2));
  const StepPlan plan = scheduler.schedule();
  EXPECT_THROW(scheduler.update(StepPlan{}, std::vector<int32_t>{}), Error);
  StepPlan reordered = plan;
  std::swap(reordered.request_ids[0], reordered.request_ids[1]);
  EXPECT_THROW(scheduler.update(reordered, {7, 7}), Error);
  EXPECT_THROW(scheduler.update(plan, {7}), Error);
  // Nothing changed: the real plan still applies.
  const std::vector<SeqUpdate> updates = scheduler.update(plan, {7, 8});
  EXPECT_EQ(updates[1].token, 8);
  EXPECT_EQ(scheduler.output_tokens(1), (Ints{7}));
}

TEST(Scheduler, AddRejectsInvalidRequests) {
  SchedulerConfig config;
  config.page_size = 16;
  config.num_pages = 4;
  config.max_model_len = 100;
  Scheduler scheduler(config);
  const auto message_of = [&scheduler](Request request) -> std::string {
    try {
      scheduler.add(std::move(request));
    } catch (const Error& error) {
      return error.what();
    }
    return "";
  };
  EXPECT_NE(message_of(make_request(1, {}, 4)).find("empty prompt"), std::string::npos);
  EXPECT_NE(message_of(make_request(1, iota_tokens(100, 0), 4)).find("max_model_len"),
            std::string::npos);
  EXPECT_NE(message_of(make_request(1, {1}, -1)).find("negative max_tokens"), std::string::npos);
  EXPECT_NE(message_of(make_request(1, iota_tokens(60, 0), 5)).find("KV pool"), std::string::npos);
  EXPECT_EQ(message_of(make_request(1, iota_tokens(60, 0), 4)), "");  // exactly 64 tokens
  EXPECT_NE(message_of(make_request(1, {1}, 1)).find("already in use"), std::string::npos);
}

// Every layer slides with a window of 6 over pages of 4: a query at position p sees keys
// p - 5 .. p, so after a step whose sequence next computes position q, its pages wholly below
// q - 5 go back to the pool. The pool has 16 pages, the last (15) being the null page.
class WindowTest : public ::testing::Test {
 protected:
  static constexpr int32_t kNullPage = 15;
  WindowTest() {
    config.page_size = 4;
    config.num_pages = 16;
    config.window = 6;
    config.max_model_len = 64;
  }

  Ints table(const Scheduler& scheduler, int64_t id) const {
    const std::vector<SequenceView> views = scheduler.sequence_map();
    const SequenceView* view = find_view(views, id);
    return view == nullptr ? Ints{} : view->pages;
  }

  static constexpr int32_t R = SequenceView::kReleasedPage;
  SchedulerConfig config;
};

TEST_F(WindowTest, ReleasesPagesWhollyBehindTheNextQuerysWindow) {
  Scheduler scheduler(config);
  EXPECT_EQ(scheduler.stats().pages_reserved, 1);
  EXPECT_EQ(scheduler.stats().pages_free, 15);
  scheduler.add(make_request(1, iota_tokens(20, 1), 8));

  // The prompt fills pages 0-4; the next query (position 20) sees keys 15.., so pages 0-2
  // (positions 0-11) go, and page 3 (12-15) stays for key 15.
  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.null_page, kNullPage);
  EXPECT_EQ(plan.kv_page_indices, (Ints{0, 1, 2, 3, 4}));
  scheduler.update(plan, {7});
  EXPECT_EQ(table(scheduler, 1), (Ints{R, R, R, 3, 4}));
  SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.pages_used, 2);
  EXPECT_EQ(stats.pages_free, 13);
  EXPECT_EQ(stats.pages_cached, 3);  // full released pages stay findable

  // Position 20 reads keys 15-20 through a table of unchanged length; page 5 takes its K/V.
  plan = scheduler.schedule();
  EXPECT_EQ(plan.positions, (Ints{20}));
  EXPECT_EQ(plan.kv_page_indices, (Ints{kNullPage, kNullPage, kNullPage, 3, 4, 5}));
  EXPECT_EQ(plan.kv_last_page_len, (Ints{1}));
  EXPECT_EQ(plan.slot_mapping, (Ints{20}));
  scheduler.update(plan, {7});
  EXPECT_EQ(table(scheduler, 1), (Ints{R, R, R, R, 4, 5}));  // next query 21 sees 16..
  EXPECT_EQ(scheduler.stats().pages_free, 13);
  EXPECT_EQ(scheduler.stats().pages_cached, 4);

  // Queries 21-24: page 4 (16-19) lasts until the next query is 25, which sees keys 20...
  const Ints released_after = {4, 4, 4, 5, 5};
  for (size_t i = 0; i < released_after.size(); ++i) {
    plan = scheduler.schedule();
    EXPECT_EQ(plan.positions, (Ints{21 + static_cast<int32_t>(i)}));
    scheduler.update(plan, {7});
    const Ints pages = table(scheduler, 1);
    EXPECT_EQ(std::count(pages.begin(), pages.end(), R), released_after[i]) << "query " << 21 + i;
    EXPECT_EQ(scheduler.stats().pages_used, static_cast<int32_t>(pages.size()) - released_after[i]);
    EXPECT_EQ(scheduler.stats().pages_free, 15 - scheduler.stats().pages_used);
  }
  EXPECT_EQ(table(scheduler, 1), (Ints{R, R, R, R, R, 5, 6}));

  // The eighth token finishes it: exactly the pages still held go back.
  plan = scheduler.schedule();
  EXPECT_TRUE(scheduler.update(plan, {7})[0].finished);
  stats = scheduler.stats();
  EXPECT_EQ(stats.pages_used, 0);
  EXPECT_EQ(stats.pages_free, stats.pages_total - stats.pages_reserved);
  EXPECT_EQ(stats.pages_cached, 6);  // pages 0-5 are full; page 6 holds 3 of 4 tokens
}

TEST_F(WindowTest, ReleasedPagesAreHitsForNewRequestsAndSharedOnesLoseOneHolder) {
  Scheduler scheduler(config);
  scheduler.add(make_request(1, iota_tokens(20, 1), 8));
  step(scheduler);
  ASSERT_EQ(table(scheduler, 1), (Ints{R, R, R, 3, 4}));

  // The same prompt finds the released pages 0-2 (free, still hashed) and page 3 (held by 1),
  // as it would without a window.
  scheduler.add(make_request(2, iota_tokens(20, 1), 8));
  const StepPlan plan = scheduler.schedule();
  ASSERT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(plan_pages(plan, 0), (Ints{kNullPage, kNullPage, kNullPage, 3, 4, 5}));
  // Page 4, full and held by 1, serves 16-18 as a partial hit (copied into 2's page 6);
  // position 19 is computed for its logits.
  EXPECT_EQ(plan_pages(plan, 1), (Ints{0, 1, 2, 3, 6}));
  EXPECT_EQ(plan_positions(plan, 1), (Ints{19}));
  EXPECT_EQ(plan.kv_copies, (Ints{4, 6, 3}));
  EXPECT_EQ(scheduler.num_cached_tokens(2), 19);
  scheduler.update(plan, {7, 7});

  // 1 lets go of page 3, which 2 still holds; 2 lets go of 0-2 again.
  EXPECT_EQ(table(scheduler, 1), (Ints{R, R, R, R, 4, 5}));
  EXPECT_EQ(table(scheduler, 2), (Ints{R, R, R, 3, 6}));
  const SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.pages_used, 4);  // 4, 5 and 3, 6
  EXPECT_EQ(stats.pages_free, 11);
  while (scheduler.has_unfinished()) step(scheduler);
  EXPECT_EQ(scheduler.stats().pages_free, 15);
}

TEST_F(WindowTest, ChunkedPrefillKeepsWhatTheNextChunksFirstQuerySees) {
  config.max_num_batched_tokens = 8;
  Scheduler scheduler(config);
  scheduler.add(make_request(1, iota_tokens(20, 1), 2));
  // Chunk 0-7; the next chunk's first query (8) sees keys 3.., so page 0 (0-3) stays.
  step(scheduler);
  EXPECT_EQ(table(scheduler, 1), (Ints{0, 1}));
  // Chunk 8-15 reads page 0; then query 16 sees keys 11..: pages 0 and 1 go.
  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan_pages(plan, 0), (Ints{0, 1, 2, 3}));
  scheduler.update(plan, {7});
  EXPECT_EQ(table(scheduler, 1), (Ints{R, R, 2, 3}));
  EXPECT_EQ(scheduler.stats().pages_used, 2);
  // Chunk 16-19 and the first sample; query 20 sees keys 15..: page 2 goes.
  plan = scheduler.schedule();
  EXPECT_EQ(plan_positions(plan, 0), (Ints{16, 17, 18, 19}));
  EXPECT_EQ(plan_pages(plan, 0), (Ints{kNullPage, kNullPage, 2, 3, 4}));
  scheduler.update(plan, {7});
  EXPECT_EQ(table(scheduler, 1), (Ints{R, R, R, 3, 4}));
  step(scheduler);
  EXPECT_FALSE(scheduler.has_unfinished());
  EXPECT_EQ(scheduler.stats().pages_free, 15);
}

TEST_F(WindowTest, PreemptionFreesOnlyThePagesStillHeld) {
  config.num_pages = 6;  // 5 to use, page 5 is the null page
  config.enable_prefix_cache = false;
  Scheduler scheduler(config);
  // A request must fit the pool whole (20 tokens), window or not.
  scheduler.add(make_request(1, iota_tokens(4, 1), 16));
  scheduler.add(make_request(2, iota_tokens(12, 50), 8));
  // 1 takes page 0 and 2 pages 1-3; 1 then grows into page 4, 2 into page 1 (released after
  // step 1: its next query, 12, sees keys 7..) and page 2 goes after step 2 (query 13 sees 8..).
  for (int32_t i = 0; i < 5; ++i) step(scheduler);
  EXPECT_EQ(table(scheduler, 1), (Ints{0, 4}));
  EXPECT_EQ(table(scheduler, 2), (Ints{R, R, 3, 1}));
  EXPECT_EQ(scheduler.stats().pages_free, 1);

  // Position 8 of 1 takes the last free page; position 16 of 2 finds none, and 2, the newest,
  // is preempted: its two held pages go back, its released entries do not.
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1}));
  SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.preemptions, 1);
  EXPECT_EQ(stats.num_waiting, 1);
  EXPECT_EQ(stats.pages_used, 3);
  EXPECT_EQ(stats.pages_free, 2);
  scheduler.update(plan, {7});
  EXPECT_EQ(table(scheduler, 1), (Ints{R, 4, 2}));  // query 9 sees keys 4..

  // 2 recomputes its 17 tokens once 1 is done (5 pages at once) and finishes too.
  while (scheduler.has_unfinished()) step(scheduler);
  stats = scheduler.stats();
  EXPECT_EQ(stats.pages_used, 0);
  EXPECT_EQ(stats.pages_free, stats.pages_total - stats.pages_reserved);
}

TEST_F(WindowTest, CancelFreesOnlyThePagesStillHeld) {
  Scheduler scheduler(config);
  scheduler.add(make_request(1, iota_tokens(20, 1), 8));
  scheduler.add(make_request(2, iota_tokens(20, 100), 8));
  step(scheduler);
  EXPECT_EQ(table(scheduler, 1), (Ints{R, R, R, 3, 4}));
  EXPECT_EQ(table(scheduler, 2), (Ints{R, R, R, 8, 9}));
  EXPECT_EQ(scheduler.stats().pages_used, 4);

  EXPECT_TRUE(scheduler.cancel(1));
  EXPECT_EQ(scheduler.stats().pages_used, 2);
  // 2 in flight: its next page is taken, then everything it holds goes at the cancel.
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(scheduler.stats().pages_used, 3);
  EXPECT_TRUE(scheduler.cancel(2));
  EXPECT_EQ(scheduler.stats().pages_used, 0);
  EXPECT_TRUE(scheduler.update(plan, {7})[0].finished);
  EXPECT_EQ(scheduler.stats().pages_free, 15);
  EXPECT_FALSE(scheduler.has_unfinished());
}

TEST_F(WindowTest, NoNullPageWithoutAWindow) {
  config.window = 0;
  Scheduler scheduler(config);
  scheduler.add(make_request(1, iota_tokens(20, 1), 2));
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.null_page, -1);
  scheduler.update(plan, {7});
  EXPECT_EQ(table(scheduler, 1), (Ints{0, 1, 2, 3, 4}));
  const SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.pages_reserved, 0);
  EXPECT_EQ(stats.pages_free, 11);
}

TEST_F(WindowTest, TheNullPageHoldsNoTokensOfAPool) {
  config.num_pages = 5;  // 4 to use: 16 tokens
  Scheduler scheduler(config);
  EXPECT_THROW(scheduler.add(make_request(1, iota_tokens(10, 1), 7)), Error);
  EXPECT_NO_THROW(scheduler.add(make_request(2, iota_tokens(10, 1), 6)));
  config.num_pages = 1;
  EXPECT_THROW(Scheduler{config}, Error);
  config.num_pages = 2;
  config.window = -1;
  EXPECT_THROW(Scheduler{config}, Error);
}

TEST(Scheduler, RejectsBadConfig) {
  SchedulerConfig config;
  config.page_size = 24;
  EXPECT_THROW(Scheduler{config}, Error);
  config.page_size = 1;
  config.max_num_seqs = 0;
  EXPECT_THROW(Scheduler{config}, Error);
}

// A scheduler for the StepTimeLimit tests: room for long prompts, no prefix cache (so that a
// prompt's chunks start where the last one ended), a minimum chunk of 8.
SchedulerConfig limit_config() {
  SchedulerConfig config;
  config.page_size = 16;
  config.num_pages = 256;
  config.max_num_batched_tokens = 2048;
  config.max_model_len = 4096;
  config.enable_prefix_cache = false;
  config.min_prefill_chunk = 8;
  return config;
}

StepTimeLimit limit_of(double max_ms, StepCost cost) {
  StepTimeLimit limit;
  limit.max_ms = max_ms;
  limit.cost = cost;
  return limit;
}

TEST(SchedulerStepTimeLimit, PrefillGetsWhatTheDecodesLeaveOfTheTarget) {
  Scheduler scheduler(limit_config());
  // 10 ms a step and 1 ms a token: a 50 ms step holds one decode (11 ms) and 39 prefill tokens.
  const StepTimeLimit limit = limit_of(50, {10, 1, 0});
  scheduler.add(make_request(1, iota_tokens(10, 1), 50));
  StepPlan plan = scheduler.schedule(limit);  // nothing decodes yet: the whole prompt
  EXPECT_EQ(plan.num_tokens(), 10);
  scheduler.update(plan, Ints(plan.num_seqs(), 7));

  scheduler.add(make_request(2, iota_tokens(1000, 100), 5));
  plan = scheduler.schedule(limit);
  ASSERT_EQ(plan.num_seqs(), 2);
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(plan.q_indptr, (Ints{0, 1, 40}));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{1, 0}));
  scheduler.update(plan, Ints(plan.num_seqs(), 7));

  plan = scheduler.schedule(limit);  // the running prompt goes on where it stopped
  ASSERT_EQ(plan.num_seqs(), 2);
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(39, 39));
}

TEST(SchedulerStepTimeLimit, AttentionPairsCountByHand) {
  Scheduler scheduler(limit_config());
  // 1 ms a (query, key) pair and nothing else, 221 ms a step.
  const StepTimeLimit limit = limit_of(221, {0, 0, 1});
  scheduler.add(make_request(1, iota_tokens(10, 1), 50));
  scheduler.update(scheduler.schedule(limit), {7});
  scheduler.add(make_request(2, iota_tokens(1000, 100), 5));
  // The decode's query sees 11 keys: 11 ms. 20 tokens from position 0 see 1 + ... + 20 = 210
  // keys: 221 ms in all, and a 21st token would see 21 more.
  StepPlan plan = scheduler.schedule(limit);
  EXPECT_EQ(plan.q_indptr, (Ints{0, 1, 21}));
  scheduler.update(plan, Ints(plan.num_seqs(), 7));
  // The decode sees 12 keys (209 ms left); 8 tokens from position 20 see 8 * 20 + 36 = 196
  // keys, 9 would see 225.
  plan = scheduler.schedule(limit);
  EXPECT_EQ(plan.q_indptr, (Ints{0, 1, 9}));
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(8, 20));
}

TEST(SchedulerStepTimeLimit, APromptAlwaysProgressesAndOneWaitingPromptStartsBesideIt) {
  Scheduler scheduler(limit_config());
  // The decode alone fills the 1 ms target: the first prompt still gets the minimum chunk (8),
  // the second is not admitted in that step.
  const StepTimeLimit limit = limit_of(1, {0, 1, 0});
  scheduler.add(make_request(1, iota_tokens(10, 1), 50));
  scheduler.update(scheduler.schedule(limit), {7});
  scheduler.add(make_request(2, iota_tokens(100, 100), 5));
  scheduler.add(make_request(3, iota_tokens(100, 300), 5));
  StepPlan plan = scheduler.schedule(limit);
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(plan.q_indptr, (Ints{0, 1, 9}));
  EXPECT_EQ(scheduler.stats().num_waiting, 1);
  scheduler.update(plan, Ints(plan.num_seqs(), 7));
  // Next step the running prompt continues, and the waiting one gets its minimum chunk beside
  // it rather than waiting for the whole of the first: a short prompt would be done.
  plan = scheduler.schedule(limit);
  EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(plan.q_indptr, (Ints{0, 1, 9, 17}));
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(8, 8));
  EXPECT_EQ(plan_positions(plan, 2), iota_tokens(8, 0));
  EXPECT_EQ(scheduler.stats().num_waiting, 0);
  scheduler.update(plan, Ints(plan.num_seqs(), 7));
  // Then the time goes to the first prompt again; the second waits for it.
  for (int step = 2; step < 4; ++step) {
    plan = scheduler.schedule(limit);
    EXPECT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(plan.q_indptr, (Ints{0, 1, 9}));
    EXPECT_EQ(plan_positions(plan, 1), iota_tokens(8, 8 * step));
    scheduler.update(plan, Ints(plan.num_seqs(), 7));
  }
}

TEST(SchedulerStepTimeLimit, WithoutDecodesThePrefillKeepsTheWholeBudgetUnlessAsked) {
  const StepTimeLimit limit = limit_of(1, {0, 1, 0});
  {
    Scheduler scheduler(limit_config());
    scheduler.add(make_request(1, iota_tokens(1000, 1), 5));
    EXPECT_EQ(scheduler.schedule(limit).num_tokens(), 1000);
  }
  {
    Scheduler scheduler(limit_config());
    scheduler.add(make_request(1, iota_tokens(1000, 1), 5));
    StepTimeLimit always = limit;
    always.without_decodes = true;
    const StepPlan plan = scheduler.schedule(always);
    EXPECT_EQ(plan.num_tokens(), 8);  // 1 token fits; the minimum is 8
    scheduler.update(plan, Ints(plan.num_seqs(), 7));
    always.max_ms = 20;
    EXPECT_EQ(scheduler.schedule(always).num_tokens(), 20);
  }
  SchedulerConfig bad = limit_config();
  bad.min_prefill_chunk = 0;
  EXPECT_THROW(Scheduler{bad}, Error);
}

// Pages of 4 tokens, 8 of them: small enough to work out a plan by hand.
SchedulerConfig four_token_pages() {
  SchedulerConfig config;
  config.page_size = 4;
  config.num_pages = 8;
  return config;
}

// Several tokens per sequence in one update, then a rollback of a rejected one, as a speculative
// step would commit: worked out with page size 4 and a pool of 8 pages.
TEST(Scheduler, UpdateAppendsSeveralTokensAndRollsBackRejectedOnes) {
  SchedulerConfig config = four_token_pages();
  config.max_model_len = 32;
  Scheduler scheduler(config);
  const auto tokens = scheduler.add(make_request(1, {5, 6, 7}, 10));
  EXPECT_EQ(Ints(tokens->prompt().begin(), tokens->prompt().end()), (Ints{5, 6, 7}));

  StepPlan plan = scheduler.schedule();  // the prompt, in page 0
  std::vector<SeqUpdate> updates = scheduler.update(plan, StepTokens{{8, 9}, {0, 2}, {}});
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(updates[0].token, 9);
  EXPECT_EQ(updates[0].num_appended, 2);
  EXPECT_EQ(tokens->all, (Ints{5, 6, 7, 8, 9}));

  // Both new tokens are computed in one step, positions 3 and 4: page 0's last slot, then a
  // new page 1.
  plan = scheduler.schedule();
  EXPECT_EQ(plan.token_ids, (Ints{8, 9}));
  EXPECT_EQ(plan_positions(plan, 0), (Ints{3, 4}));
  EXPECT_EQ(plan.slot_mapping, (Ints{3, 4}));
  EXPECT_EQ(plan_pages(plan, 0), (Ints{0, 1}));
  // Token 9 is rejected: it leaves the sequence with its K/V, and 20 follows 8.
  updates = scheduler.update(plan, StepTokens{{20}, {0, 1}, {1}});
  EXPECT_EQ(updates[0].token, 20);
  EXPECT_EQ(tokens->all, (Ints{5, 6, 7, 8, 20}));
  EXPECT_EQ(scheduler.output_tokens(1), (Ints{8, 20}));

  // 20 goes to position 4 again. Page 1 went back to the pool, behind pages 2 .. 7 that were
  // never used, so position 4 now lies in page 2.
  plan = scheduler.schedule();
  EXPECT_EQ(plan.token_ids, (Ints{20}));
  EXPECT_EQ(plan_positions(plan, 0), (Ints{4}));
  EXPECT_EQ(plan_pages(plan, 0), (Ints{0, 2}));
  EXPECT_EQ(plan.slot_mapping, (Ints{8}));
  updates = scheduler.update(plan, StepTokens{{21, 22}, {0, 2}, {}});
  EXPECT_EQ(updates[0].num_appended, 2);
  EXPECT_FALSE(updates[0].finished);
  plan = scheduler.schedule();
  EXPECT_EQ(plan.token_ids, (Ints{21, 22}));
  updates = scheduler.update(plan, StepTokens{{23, 24, 25, 26, 27, 28, 29}, {0, 7}, {}});
  // max_tokens 10: outputs 8, 20, 21, 22 and six more end the output; the seventh is dropped.
  EXPECT_EQ(updates[0].num_appended, 6);
  EXPECT_EQ(updates[0].token, 28);
  EXPECT_TRUE(updates[0].finished);
  EXPECT_EQ(updates[0].reason, FinishReason::kLength);
  EXPECT_EQ(tokens->all, (Ints{5, 6, 7, 8, 20, 21, 22, 23, 24, 25, 26, 27, 28}));
  EXPECT_FALSE(scheduler.has_unfinished());
  EXPECT_EQ(scheduler.stats().pages_used, 0);
}

TEST(Scheduler, UpdateStopsAtAStopTokenAmongSeveral) {
  SchedulerConfig config = four_token_pages();
  config.eos_token_ids = {2};
  Scheduler scheduler(config);
  const auto tokens = scheduler.add(make_request(1, {5, 6, 7}, 10));
  const StepPlan plan = scheduler.schedule();
  const std::vector<SeqUpdate> updates = scheduler.update(plan, StepTokens{{8, 2, 9}, {0, 3}, {}});
  EXPECT_EQ(updates[0].num_appended, 2);
  EXPECT_EQ(updates[0].token, 2);
  EXPECT_TRUE(updates[0].finished);
  EXPECT_EQ(updates[0].reason, FinishReason::kStop);
  EXPECT_EQ(tokens->all, (Ints{5, 6, 7, 8, 2}));
}

TEST(Scheduler, UpdateRejectsTokensThatCannotApply) {
  SchedulerConfig config = four_token_pages();
  config.max_num_batched_tokens = 4;
  Scheduler scheduler(config);
  scheduler.add(make_request(1, {5, 6, 7}, 10));
  scheduler.add(make_request(2, iota_tokens(6, 30), 10));  // 1 of its 6 fits this step
  const StepPlan plan = scheduler.schedule();
  ASSERT_EQ(plan.num_seqs(), 2);
  // Request 1 computed its whole prompt: it needs a token. Request 2 is mid-prefill: it takes none.
  EXPECT_THROW(scheduler.update(plan, StepTokens{{}, {0, 0, 0}, {}}), Error);
  EXPECT_THROW(scheduler.update(plan, StepTokens{{8, 9}, {0, 1, 2}, {}}), Error);
  EXPECT_THROW(scheduler.update(plan, StepTokens{{8}, {0, 1}, {}}), Error);  // indptr too short
  EXPECT_THROW(scheduler.update(plan, StepTokens{{8}, {0, 1, 1}, {4, 0}}), Error);  // > computed
  EXPECT_THROW(scheduler.update(plan, StepTokens{{8}, {0, 1, 2}, {}}), Error);      // past tokens
  // None of that changed anything: the right update goes through.
  const std::vector<SeqUpdate> updates = scheduler.update(plan, StepTokens{{8}, {0, 1, 1}, {}});
  EXPECT_EQ(updates[0].token, 8);
  EXPECT_EQ(updates[1].token, -1);
  EXPECT_EQ(scheduler.output_tokens(1), (Ints{8}));
}

// Rolling back a prompt token keeps it (it is computed again); the sequence then takes no token.
TEST(Scheduler, RolledBackPromptTokensAreComputedAgain) {
  SchedulerConfig config = four_token_pages();
  Scheduler scheduler(config);
  const auto tokens = scheduler.add(make_request(1, {5, 6, 7, 8, 9}, 4));
  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.token_ids, (Ints{5, 6, 7, 8, 9}));
  scheduler.update(plan, StepTokens{{}, {0, 0}, {2}});  // positions 3 and 4 again
  EXPECT_EQ(tokens->all, (Ints{5, 6, 7, 8, 9}));
  plan = scheduler.schedule();
  EXPECT_EQ(plan.token_ids, (Ints{8, 9}));
  EXPECT_EQ(plan_positions(plan, 0), (Ints{3, 4}));
  EXPECT_EQ(plan.samples, (std::vector<uint8_t>{1}));
}

}  // namespace
}  // namespace pagedlm
