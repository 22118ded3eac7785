#include <gtest/gtest.h>

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

class PrefixHitTest : public ::testing::Test {
 protected:
  // A 40-token prompt and one sharing only its first 33 tokens.
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

TEST_F(PrefixHitTest, SharesExactlyTheTwoCommonFullPages) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, first_prompt(), 8));
  step(scheduler);
  scheduler.add(make_request(2, second_prompt(), 8));

  const StepPlan plan = scheduler.schedule();
  ASSERT_EQ(plan.request_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(scheduler.num_cached_tokens(2), 32);
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(8, 32));
  const Ints first_pages = plan_pages(plan, 0);
  const Ints second_pages = plan_pages(plan, 1);
  ASSERT_EQ(first_pages.size(), 3u);
  ASSERT_EQ(second_pages.size(), 3u);
  EXPECT_EQ(second_pages[0], first_pages[0]);
  EXPECT_EQ(second_pages[1], first_pages[1]);
  EXPECT_NE(second_pages[2], first_pages[2]);

  const std::vector<SequenceView> views = scheduler.sequence_map();
  const SequenceView* second = find_view(views, 2);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->page_shared, (std::vector<uint8_t>{1, 1, 0}));
  EXPECT_EQ(second->num_cached_tokens, 32);
  EXPECT_EQ(find_view(views, 1)->page_shared, (std::vector<uint8_t>{1, 1, 0}));
  const SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.prefix_query_tokens, 80);
  EXPECT_EQ(stats.prefix_hit_tokens, 32);
  EXPECT_EQ(stats.pages_used, 4);
}

TEST_F(PrefixHitTest, FinishedRequestLeavesItsFullPagesCached) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, first_prompt(), 1));
  step(scheduler);
  EXPECT_FALSE(scheduler.has_unfinished());
  EXPECT_EQ(scheduler.stats().pages_cached, 2);  // the third page held only 8 tokens
  EXPECT_EQ(scheduler.stats().pages_free, 32);

  scheduler.add(make_request(2, second_prompt(), 1));
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(scheduler.num_cached_tokens(2), 32);
  EXPECT_EQ(plan_pages(plan, 0)[0], 0);
  EXPECT_EQ(plan_pages(plan, 0)[1], 1);
  EXPECT_EQ(scheduler.stats().pages_cached, 0);
}

TEST_F(PrefixHitTest, HitLeavesAtLeastOneTokenToCompute) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, iota_tokens(32, 1), 1));
  step(scheduler);
  scheduler.add(make_request(2, iota_tokens(32, 1), 1));
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(scheduler.num_cached_tokens(2), 16);
  EXPECT_EQ(plan.positions, iota_tokens(16, 16));
}

TEST_F(PrefixHitTest, PagesFilledInAStepAreSharedInThatStep) {
  Scheduler scheduler(config(true));
  scheduler.add(make_request(1, first_prompt(), 1));
  scheduler.add(make_request(2, first_prompt(), 1));
  const StepPlan plan = scheduler.schedule();
  EXPECT_EQ(scheduler.num_cached_tokens(2), 32);
  EXPECT_EQ(plan_positions(plan, 1), iota_tokens(8, 32));
  EXPECT_EQ(plan_pages(plan, 1)[0], plan_pages(plan, 0)[0]);
  EXPECT_EQ(plan_pages(plan, 1)[1], plan_pages(plan, 0)[1]);
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
  EXPECT_EQ(scheduler.num_cached_tokens(3), 32);
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
  EXPECT_EQ(scheduler.num_cached_tokens(2), 0);
  EXPECT_EQ(scheduler.num_cached_tokens(3), 32);
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
  EXPECT_THROW(scheduler.update(StepPlan{}, {}), Error);
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

TEST(Scheduler, RejectsBadConfig) {
  SchedulerConfig config;
  config.page_size = 24;
  EXPECT_THROW(Scheduler{config}, Error);
  config.page_size = 1;
  config.max_num_seqs = 0;
  EXPECT_THROW(Scheduler{config}, Error);
}

}  // namespace
}  // namespace pagedlm
