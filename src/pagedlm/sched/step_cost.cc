#include "pagedlm/sched/step_cost.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "pagedlm/core/error.h"

namespace pagedlm {

namespace {

// Features are scaled to be near 1 for a typical prefill step, so that the normal equations
// stay well conditioned: pairs run to millions where tokens run to thousands.
constexpr double kTokenScale = 1024.0;
constexpr double kPairScale = 1024.0 * 1024.0;
constexpr std::array<double, 3> kScale = {1.0, kTokenScale, kPairScale};

// Term subsets (bit 0: fixed, 1: per token, 2: per pair), simplest first. Among fits that
// explain the steps equally well the earlier wins: one step alone is read as a per-token cost.
constexpr std::array<int, 7> kSubsets = {0b010, 0b011, 0b110, 0b111, 0b001, 0b100, 0b101};

// Solves a x = b in place for a small system (Gaussian elimination, partial pivoting); false
// when the system is (nearly) singular: its terms cannot be told apart from the data.
bool solve(std::vector<std::vector<double>>& a, std::vector<double>& b) {
  const size_t n = b.size();
  double scale = 0;
  for (size_t i = 0; i < n; ++i) scale = std::max(scale, std::abs(a[i][i]));
  if (scale <= 0) return false;
  for (size_t col = 0; col < n; ++col) {
    size_t pivot = col;
    for (size_t row = col + 1; row < n; ++row) {
      if (std::abs(a[row][col]) > std::abs(a[pivot][col])) pivot = row;
    }
    if (std::abs(a[pivot][col]) <= 1e-9 * scale) return false;
    std::swap(a[pivot], a[col]);
    std::swap(b[pivot], b[col]);
    for (size_t row = col + 1; row < n; ++row) {
      const double f = a[row][col] / a[col][col];
      for (size_t k = col; k < n; ++k) a[row][k] -= f * a[col][k];
      b[row] -= f * b[col];
    }
  }
  for (size_t col = n; col-- > 0;) {
    double v = b[col];
    for (size_t k = col + 1; k < n; ++k) v -= a[col][k] * b[k];
    b[col] = v / a[col][col];
  }
  return true;
}

}  // namespace

StepCostFit::StepCostFit(double decay) : decay_(decay) {
  PAGEDLM_CHECK(decay > 0 && decay <= 1, "StepCostFit: decay must be in (0, 1], got ", decay);
}

void StepCostFit::observe(int64_t tokens, int64_t attention_pairs, double ms) {
  if (!std::isfinite(ms) || ms < 0 || tokens < 0 || attention_pairs < 0) return;
  const std::array<double, 3> x = {1.0, static_cast<double>(tokens) / kTokenScale,
                                   static_cast<double>(attention_pairs) / kPairScale};
  for (size_t i = 0; i < 3; ++i) {
    for (size_t j = 0; j < 3; ++j) xx_[i][j] = decay_ * xx_[i][j] + x[i] * x[j];
    xy_[i] = decay_ * xy_[i] + x[i] * ms;
  }
  yy_ = decay_ * yy_ + ms * ms;
  ++num_observations_;
}

StepCost StepCostFit::estimate() const {
  std::array<double, 3> best{};
  double best_sse = 0;
  bool found = false;
  for (const int subset : kSubsets) {
    std::vector<size_t> terms;
    for (size_t i = 0; i < 3; ++i) {
      if (subset & (1 << i)) terms.push_back(i);
    }
    std::vector<std::vector<double>> a(terms.size(), std::vector<double>(terms.size()));
    std::vector<double> b(terms.size());
    for (size_t i = 0; i < terms.size(); ++i) {
      for (size_t j = 0; j < terms.size(); ++j) a[i][j] = xx_[terms[i]][terms[j]];
      b[i] = xy_[terms[i]];
    }
    if (!solve(a, b)) continue;
    std::array<double, 3> beta{};
    bool non_negative = true;
    for (size_t i = 0; i < terms.size(); ++i) {
      beta[terms[i]] = b[i];
      non_negative &= b[i] >= 0;
    }
    if (!non_negative) continue;
    // Weighted squared error: sum (y - x.beta)^2 = yy - 2 beta.xy + beta^T xx beta.
    double sse = yy_;
    for (size_t i = 0; i < 3; ++i) {
      sse -= 2 * beta[i] * xy_[i];
      for (size_t j = 0; j < 3; ++j) sse += beta[i] * xx_[i][j] * beta[j];
    }
    if (!found || sse < best_sse - 1e-9 * yy_) {
      best = beta;
      best_sse = sse;
      found = true;
    }
  }
  return {best[0] / kScale[0], best[1] / kScale[1], best[2] / kScale[2]};
}

}  // namespace pagedlm
