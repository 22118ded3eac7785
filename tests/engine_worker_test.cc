// The worker seam (engine/worker.h) on the CPU, below the engine: one rank built by build_rank
// runs a plan through launch and collect, its logits and greedy token against a golden
// fixture's float64 reference; one step in flight at a time; a step left midway.

#include <gtest/gtest.h>

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
    worker_ = make_worker(build_rank(checkpoint_, options_, {}, nullptr), options_);
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

TEST_F(CpuWorkerTest, OneStepIsInFlightAtATime) {
  const StepPlan plan = prefill_plan({1, 2, 3}, options_.page_size);
  const StepHandle first = worker_->launch(plan, greedy_inputs(false));
  expect_error([&] { worker_->launch(plan, greedy_inputs(false)); }, {"a step is in flight"});
  expect_error([&] { worker_->collect(StepHandle{first.id + 1}); }, {"is not in flight"});
  EXPECT_TRUE(worker_->collect(first).completed);
  expect_error([&] { worker_->collect(first); }, {"is not in flight"});
  // The worker goes on after its errors.
  EXPECT_TRUE(worker_->collect(worker_->launch(plan, greedy_inputs(false))).completed);
}

TEST_F(CpuWorkerTest, AStepLeftMidwayIsCollectedAsNotCompleted) {
  const StepPlan plan = prefill_plan({1, 2, 3, 4, 5}, options_.page_size);
  ForwardStop stop([] { return true; });
  StepInputs inputs = greedy_inputs(true);
  inputs.stop = &stop;
  bool masks_filled = false;
  inputs.finish_masks = [&] { masks_filled = true; };
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
  const int32_t row = options_.max_num_seqs;  // a row of those filled during a step
  inputs.sampling[0].mask_row = row;
  int32_t* mask = worker_->mask_rows() + int64_t{row} * words;
  inputs.finish_masks = [&] {
    std::fill(mask, mask + words, 0);
    mask[allowed / 32] = static_cast<int32_t>(1u << (allowed % 32));
  };
  const StepResult masked = worker_->collect(worker_->launch(plan, std::move(inputs)));
  EXPECT_EQ(masked.sampled[0], allowed);
}

}  // namespace
}  // namespace pagedlm
