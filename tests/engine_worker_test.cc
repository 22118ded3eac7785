// The worker seam (engine/worker.h) on the CPU, below the engine: one rank built by build_rank
// runs a plan through launch and collect, its logits and greedy token against a golden
// fixture's float64 reference; at most two steps in flight, collected in order; a pending row
// (asynchronous scheduling) taking the step before's token; a step left midway.

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "golden_fixture_util.h"
#include "ops_test_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/worker.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

using testing::expect_error;
using testing::fixture_dir;
using testing::load_expected;
using testing::relative_error;

// One sequence's whole prompt in one step, from page 0 on, every position's logits, the last
// one sampled.
StepPlan prefill_plan(const std::vector<int32_t>& prompt, int32_t page_size) {
  StepPlan plan;
  plan.page_size = page_size;
  const auto n = static_cast<int32_t>(prompt.size());
  plan.token_ids = prompt;
  for (int32_t i = 0; i < n; ++i) {
    plan.positions.push_back(i);
    plan.slot_mapping.push_back(i);  // pages 0, 1, ... in order
    plan.logits_rows.push_back(i);
  }
  const int32_t pages = (n + page_size - 1) / page_size;
  for (int32_t p = 0; p < pages; ++p) plan.kv_page_indices.push_back(p);
  plan.q_indptr = {0, n};
  plan.kv_indptr = {0, pages};
  plan.kv_last_page_len = {n - (pages - 1) * page_size};
  plan.logits_indptr = {0, n};
  plan.request_ids = {1};
  plan.samples = {1};
  return plan;
}

class CpuWorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    checkpoint_ = load_checkpoint(fixture_dir("llama-gqa"));
    EngineOptions o;
    o.num_pages = 32;
    options_ = resolve_options(o);
    worker_ = make_worker(build_rank(checkpoint_, options_, {}, nullptr));
    greedy_.temperature = 0.f;
  }

  StepInputs greedy_inputs(bool want_logits) {
    StepInputs inputs;
    inputs.sampling = {SeqSampling{&greedy_, 0, 0}};
    inputs.want_logits = want_logits;
    return inputs;
  }

  Checkpoint checkpoint_;
  EngineOptions options_;
  std::unique_ptr<Worker> worker_;
  SamplingParams greedy_;
};

TEST_F(CpuWorkerTest, APrefillStepGivesTheReferenceLogitsAndGreedyToken) {
  const testing::Expected expected = load_expected("llama-gqa");
  EXPECT_EQ(worker_->num_pages(), 32);
  for (int c = 0; c < testing::kNumCases; ++c) {
    const StepPlan plan = prefill_plan(expected.prompts[c], options_.page_size);
    const StepHandle handle = worker_->launch(plan, greedy_inputs(/*want_logits=*/true));
    const StepResult result = worker_->collect(handle);
    ASSERT_TRUE(result.completed);
    ASSERT_EQ(result.sampled.size(), 1u);
    EXPECT_LT(relative_error(result.logits, expected.logits[c]), 1e-4) << "case " << c;
    // Only where the reference's top two logits are apart: rounding may swap a near tie.
    if (expected.margins[c][0] > 1e-3f) {
      EXPECT_EQ(result.sampled[0], expected.greedy[c][0]) << "case " << c;
    }
  }
}

TEST_F(CpuWorkerTest, TwoStepsAreInFlightAtMostCollectedInOrder) {
  const StepPlan plan = prefill_plan({1, 2, 3}, options_.page_size);
  const StepHandle first = worker_->launch(plan, greedy_inputs(false));
  const StepHandle second = worker_->launch(plan, greedy_inputs(false));
  expect_error([&] { worker_->launch(plan, greedy_inputs(false)); }, {"two steps are in flight"});
  expect_error([&] { worker_->collect(second); }, {"is not the oldest in flight"});
  EXPECT_TRUE(worker_->collect(first).completed);
  expect_error([&] { worker_->collect(first); }, {"is not the oldest in flight"});
  EXPECT_TRUE(worker_->collect(second).completed);
  // The worker goes on after its errors.
  EXPECT_TRUE(worker_->collect(worker_->launch(plan, greedy_inputs(false))).completed);
}

// A decode whose token is pending (kPendingToken) takes the token the step launched before it
// sampled, before that step is collected: the same logits as a decode given the token itself.
TEST_F(CpuWorkerTest, APendingRowTakesThePreviousStepsToken) {
  const std::vector<int32_t> prompt = {5, 9, 17, 33};
  const StepPlan prefill = prefill_plan(prompt, options_.page_size);
  const auto decode_plan = [&](int32_t token) {
    StepPlan plan = prefill_plan({token}, options_.page_size);
    const auto n = static_cast<int32_t>(prompt.size());
    plan.positions = {n};
    plan.slot_mapping = {n};
    plan.kv_page_indices.clear();
    const int32_t pages = (n + 1 + options_.page_size - 1) / options_.page_size;
    for (int32_t p = 0; p < pages; ++p) plan.kv_page_indices.push_back(p);
    plan.kv_indptr = {0, pages};
    plan.kv_last_page_len = {n + 1 - (pages - 1) * options_.page_size};
    return plan;
  };
  const StepHandle first = worker_->launch(prefill, greedy_inputs(false));
  StepInputs pending = greedy_inputs(true);
  // The prefill's last logits row is its sampled one.
  pending.pending_rows = {{0, static_cast<int32_t>(prompt.size()) - 1}};
  const StepHandle second = worker_->launch(decode_plan(kPendingToken), std::move(pending));
  const StepResult prefilled = worker_->collect(first);
  const StepResult ahead = worker_->collect(second);
  ASSERT_TRUE(prefilled.completed && ahead.completed);
  const StepResult given =
      worker_->collect(worker_->launch(decode_plan(prefilled.sampled[0]), greedy_inputs(true)));
  ASSERT_TRUE(given.completed);
  EXPECT_EQ(ahead.sampled, given.sampled);
  ASSERT_EQ(ahead.logits.numel(), given.logits.numel());
  EXPECT_EQ(0, std::memcmp(ahead.logits.raw(), given.logits.raw(), ahead.logits.nbytes()));
  // A pending row with no token to take is refused.
  StepInputs wrong = greedy_inputs(false);
  wrong.pending_rows = {{0, 99}};
  expect_error([&] { worker_->launch(decode_plan(kPendingToken), std::move(wrong)); },
               {"has no token of the last step's row 99"});
}

TEST_F(CpuWorkerTest, AStepLeftMidwayIsCollectedAsNotCompleted) {
  const StepPlan plan = prefill_plan({1, 2, 3, 4, 5}, options_.page_size);
  ForwardStop stop([] { return true; });
  StepInputs inputs = greedy_inputs(true);
  inputs.stop = &stop;
  bool masks_filled = false;
  inputs.masks = {std::make_shared<MaskRows>(1, 1), [&] { masks_filled = true; }};
  const StepResult result = worker_->collect(worker_->launch(plan, std::move(inputs)));
  EXPECT_FALSE(result.completed);
  EXPECT_TRUE(result.sampled.empty());
  EXPECT_FALSE(masks_filled);
}

TEST_F(CpuWorkerTest, AMaskedRowIsFilledThenSampledUnderItsMask) {
  const StepPlan plan = prefill_plan({1, 2, 3}, options_.page_size);
  const int64_t vocab = checkpoint_.config.vocab_size;
  const int32_t words = static_cast<int32_t>((vocab + 31) / 32);
  // The one token the mask allows: the last id, which greedy would not pick unmasked here.
  const int32_t allowed = static_cast<int32_t>(vocab - 1);
  const StepResult unmasked = worker_->collect(worker_->launch(plan, greedy_inputs(false)));
  ASSERT_NE(unmasked.sampled[0], allowed);
  StepInputs inputs = greedy_inputs(false);
  const int32_t row = 2;  // any row of the batch's
  inputs.sampling[0].mask_row = row;
  auto rows = std::make_shared<MaskRows>(3, words);
  int32_t* mask = rows->row(row);
  inputs.masks = {rows, [&] {
                    std::fill(mask, mask + words, 0);
                    mask[allowed / 32] = static_cast<int32_t>(1u << (allowed % 32));
                  }};
  const StepResult masked = worker_->collect(worker_->launch(plan, std::move(inputs)));
  EXPECT_EQ(masked.sampled[0], allowed);
}

}  // namespace
}  // namespace pagedlm
