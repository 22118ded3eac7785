// What a step costs in wall time, as a linear model of its shape, and the running fit that
// learns the model from the steps an engine has measured. The scheduler uses it to hold a
// step's prefill to a time target, so that sequences already decoding keep a bounded
// inter-token latency while a long prompt is prefilled (Scheduler::schedule).
#pragma once

#include <array>
#include <cstdint>

namespace pagedlm {

// ms = fixed_ms + per_token_ms * tokens + per_pair_ms * attention pairs, where tokens are the
// rows of the packed stream and attention pairs the (query, visible key) pairs of the step.
struct StepCost {
  double fixed_ms = 0;
  double per_token_ms = 0;
  double per_pair_ms = 0;

  double ms(int64_t tokens, int64_t attention_pairs) const {
    return fixed_ms + per_token_ms * static_cast<double>(tokens) +
           per_pair_ms * static_cast<double>(attention_pairs);
  }
};

// A least-squares fit of StepCost to measured steps, recent steps weighing more (each new step
// multiplies the weight of all earlier ones by `decay`), every coefficient held non-negative:
// a step never gets cheaper with more work. Feed it the steps that prefill (more tokens than
// sequences); decode steps alone cannot tell the per-token cost from the fixed one.
class StepCostFit {
 public:
  explicit StepCostFit(double decay = 0.98);

  void observe(int64_t tokens, int64_t attention_pairs, double ms);
  int64_t num_observations() const { return num_observations_; }
  // The fit so far; all zero before the first observation. With too few distinct shapes to
  // separate the terms, the simplest model that explains them (one per-token cost first).
  StepCost estimate() const;

 private:
  double decay_;
  int64_t num_observations_ = 0;
  // Weighted sums over observations of x x^T, x y and y^2, x = (1, tokens, pairs) scaled.
  std::array<std::array<double, 3>, 3> xx_{};
  std::array<double, 3> xy_{};
  double yy_ = 0;
};

}  // namespace pagedlm
