// StepCostFit: the step-time model the engine learns from its measured steps, checked on steps
// whose times are drawn from known coefficients.
#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <limits>
#include <utility>

#include "pagedlm/sched/step_cost.h"

namespace pagedlm {
namespace {

// Prefill chunks of a prompt as an engine measures them: n tokens from `start` on see
// n * start + n (n + 1) / 2 (query, key) pairs.
int64_t pairs_of(int64_t start, int64_t n) { return n * start + n * (n + 1) / 2; }

TEST(StepCostFit, NothingObservedIsAllZero) {
  const StepCostFit fit;
  EXPECT_EQ(fit.num_observations(), 0);
  const StepCost cost = fit.estimate();
  EXPECT_EQ(cost.fixed_ms, 0);
  EXPECT_EQ(cost.per_token_ms, 0);
  EXPECT_EQ(cost.per_pair_ms, 0);
}

TEST(StepCostFit, OneStepIsReadAsAPerTokenCost) {
  StepCostFit fit;
  fit.observe(500, pairs_of(0, 500), 1200.0);
  const StepCost cost = fit.estimate();
  EXPECT_EQ(cost.fixed_ms, 0);
  EXPECT_DOUBLE_EQ(cost.per_token_ms, 1200.0 / 500);
  EXPECT_EQ(cost.per_pair_ms, 0);
}

TEST(StepCostFit, RecoversTheCoefficientsOfExactSteps) {
  // 12 ms a step, 2.5 ms a token, 40 ns a pair.
  const double fixed = 12, per_token = 2.5, per_pair = 4e-5;
  StepCostFit fit;
  for (const auto [start, n] : {std::pair<int64_t, int64_t>{0, 2048},
                                {2048, 512},
                                {0, 64},
                                {300, 33},
                                {1000, 100},
                                {4000, 17}}) {
    const int64_t tokens = n + 3;  // three decodes beside the chunk
    const int64_t pairs = pairs_of(start, n) + 3 * 200;
    fit.observe(tokens, pairs, fixed + per_token * tokens + per_pair * pairs);
  }
  const StepCost cost = fit.estimate();
  EXPECT_NEAR(cost.fixed_ms, fixed, 1e-6);
  EXPECT_NEAR(cost.per_token_ms, per_token, 1e-9);
  EXPECT_NEAR(cost.per_pair_ms, per_pair, 1e-12);
  EXPECT_NEAR(cost.ms(100, pairs_of(50, 100)), 12 + 250 + 4e-5 * 10050, 1e-6);
}

TEST(StepCostFit, NoCoefficientGoesNegative) {
  // Steps that cost exactly 2 ms a token: an unconstrained fit of all three terms could trade
  // a negative fixed cost against the others on noise; this one keeps the terms the steps need.
  StepCostFit fit;
  for (const int64_t n : {16, 100, 700, 2048, 33}) fit.observe(n, pairs_of(0, n), 2.0 * n);
  const StepCost cost = fit.estimate();
  EXPECT_GE(cost.fixed_ms, 0);
  EXPECT_GE(cost.per_pair_ms, 0);
  EXPECT_NEAR(cost.per_token_ms, 2.0, 1e-9);
  EXPECT_NEAR(cost.ms(256, pairs_of(0, 256)), 512, 1e-6);
}

TEST(StepCostFit, RecentStepsWeighMore) {
  // The machine slows down (another load starts): the estimate follows the recent steps.
  StepCostFit fit(0.5);
  for (int i = 0; i < 40; ++i) fit.observe(100, pairs_of(0, 100), 100.0);
  for (int i = 0; i < 40; ++i) fit.observe(100, pairs_of(0, 100), 300.0);
  EXPECT_NEAR(fit.estimate().ms(100, pairs_of(0, 100)), 300.0, 1e-6);
}

TEST(StepCostFit, IgnoresMeaninglessSamplesAndRefusesABadDecay) {
  StepCostFit fit;
  fit.observe(10, 55, -1.0);
  fit.observe(10, 55, std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ(fit.num_observations(), 0);
  EXPECT_THROW(StepCostFit(0.0), std::exception);
  EXPECT_THROW(StepCostFit(1.5), std::exception);
}

}  // namespace
}  // namespace pagedlm
