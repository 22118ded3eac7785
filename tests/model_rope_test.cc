// The rope frequencies of every rope type, against formulas written out here in double from the
// papers / reference code (not from the implementation under test).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <vector>

#include "pagedlm/model/rope.h"

namespace pagedlm {
namespace {

double default_inv_freq(double theta, int64_t i, int64_t head_dim) {
  return std::pow(theta, -2.0 * i / head_dim);
}

TEST(RopeInvFreq, DefaultAndLinear) {
  RopeSpec spec;
  spec.theta = 1e6f;
  const std::vector<float> plain = rope_inv_freq(spec, 128);
  spec.type = RopeType::kLinear;
  spec.factor = 4.f;
  const std::vector<float> linear = rope_inv_freq(spec, 128);
  ASSERT_EQ(plain.size(), 64u);
  ASSERT_EQ(linear.size(), 64u);
  for (int64_t i = 0; i < 64; ++i) {
    const double want = default_inv_freq(1e6, i, 128);
    EXPECT_NEAR(plain[i], want, want * 2e-6) << i;
    EXPECT_NEAR(linear[i], want / 4, want / 4 * 2e-6) << i;
  }
}

// Llama 3 scaling with the parameters of the llama3-rope fixture, against the formula of the
// Llama 3.1 reference code evaluated in double.
TEST(RopeInvFreq, Llama3MatchesFixtureConfig) {
  std::ifstream file(PAGEDLM_TESTDATA "/fixtures/llama3-rope/config.json");
  ASSERT_TRUE(file) << "missing llama3-rope fixture";
  const nlohmann::json json = nlohmann::json::parse(file);
  const nlohmann::json& rope = json.at("rope_parameters");
  ASSERT_EQ(rope.at("rope_type"), "llama3");
  const int64_t head_dim = json.at("head_dim");
  RopeSpec spec;
  spec.theta = rope.at("rope_theta");
  spec.type = RopeType::kLlama3;
  spec.factor = rope.at("factor");
  spec.low_freq_factor = rope.at("low_freq_factor");
  spec.high_freq_factor = rope.at("high_freq_factor");
  spec.original_max_position = rope.at("original_max_position_embeddings");
  const std::vector<float> got = rope_inv_freq(spec, head_dim);
  ASSERT_EQ(static_cast<int64_t>(got.size()), head_dim / 2);

  const double theta = rope.at("rope_theta"), factor = rope.at("factor");
  const double low = rope.at("low_freq_factor"), high = rope.at("high_freq_factor");
  const double old_context = rope.at("original_max_position_embeddings");
  int n_kept = 0, n_scaled = 0, n_smoothed = 0;
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const double f = default_inv_freq(theta, i, head_dim);
    const double wavelen = 2 * std::numbers::pi / f;
    double want;
    if (wavelen < old_context / high) {
      want = f;
      ++n_kept;
    } else if (wavelen > old_context / low) {
      want = f / factor;
      ++n_scaled;
    } else {
      const double s = (old_context / wavelen - low) / (high - low);
      want = (1 - s) * f / factor + s * f;
      ++n_smoothed;
    }
    EXPECT_NEAR(got[i], want, want * 2e-6) << "frequency " << i;
  }
  // The fixture (original context 64, head_dim 64) covers all three regimes.
  EXPECT_GT(n_kept, 0);
  EXPECT_GT(n_scaled, 0);
  EXPECT_GT(n_smoothed, 0);
}

// YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as the qwen3-yarn fixture
// configures it: dimension pairs whose wavelength is long against the original context (fewer
// than beta_slow turns over it) are interpolated by the factor, short ones (more than beta_fast
// turns) kept, a linear ramp between the two correction dimensions; the attention factor
// 0.1 ln(factor) + 1.
TEST(RopeInvFreq, YarnMatchesPaperFormula) {
  std::ifstream file(PAGEDLM_TESTDATA "/fixtures/qwen3-yarn/config.json");
  ASSERT_TRUE(file) << "missing qwen3-yarn fixture";
  const nlohmann::json json = nlohmann::json::parse(file);
  const nlohmann::json& rope = json.at("rope_parameters");
  ASSERT_EQ(rope.at("rope_type"), "yarn");
  const int64_t head_dim = json.at("head_dim");
  RopeSpec spec;
  spec.type = RopeType::kYarn;
  spec.theta = rope.at("rope_theta");
  spec.factor = rope.at("factor");
  spec.original_max_position = rope.at("original_max_position_embeddings");
  const std::vector<float> got = rope_inv_freq(spec, head_dim);
  ASSERT_EQ(static_cast<int64_t>(got.size()), head_dim / 2);

  const double theta = spec.theta, factor = spec.factor;
  const double old_context = static_cast<double>(spec.original_max_position);
  // The dimension d at which a frequency turns r times over the original context:
  // old_context / (2 pi theta^(d/dim)) = r.
  const auto dim_of = [&](double turns) {
    return head_dim * std::log(old_context / (turns * 2 * std::numbers::pi)) /
           (2 * std::log(theta));
  };
  const double low = std::max(0.0, std::floor(dim_of(32))),
               high = std::min(static_cast<double>(head_dim - 1), std::ceil(dim_of(1)));
  int n_kept = 0, n_interpolated = 0, n_blended = 0;
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const double f = default_inv_freq(theta, i, head_dim);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double want = f / factor * ramp + f * (1 - ramp);
    (ramp == 0 ? n_kept : ramp == 1 ? n_interpolated : n_blended)++;
    EXPECT_NEAR(got[i], want, want * 2e-6) << "frequency " << i;
  }
  EXPECT_GT(n_kept, 0);
  EXPECT_GT(n_interpolated, 0);
  EXPECT_GT(n_blended, 0);
  EXPECT_NEAR(yarn_attention_factor(8.f), 0.1 * std::log(8.0) + 1, 1e-6);
  EXPECT_EQ(yarn_attention_factor(1.f), 1.f);
}

}  // namespace
}  // namespace pagedlm
