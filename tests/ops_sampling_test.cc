// The host sampler (sample_token): greedy, reproducibility, filters on handcrafted logits, and the
// empirical distribution against an independent computation of the filtered softmax. The batched
// op over device tensors (sample_tokens) is in tests/backend_ops_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "ops_test_util.h"
#include "pagedlm/ops/sampling.h"

namespace pagedlm {
namespace {

using testing::expect_error;

SamplerParams params(float temperature, int32_t top_k = 0, float top_p = 1.f, float min_p = 0.f) {
  return SamplerParams{temperature, top_k, top_p, min_p};
}

// Logits whose softmax is exactly proportional to `probs`.
std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> logits;
  for (double p : probs) logits.push_back(static_cast<float>(std::log(p)));
  return logits;
}

// The tokens sample_token returns over `draws` seeds.
std::set<int32_t> support(const std::vector<float>& logits, const SamplerParams& p, int draws) {
  std::set<int32_t> seen;
  for (int i = 0; i < draws; ++i) {
    seen.insert(ops::sample_token(logits.data(), static_cast<int64_t>(logits.size()), p, i, 0));
  }
  return seen;
}

TEST(Sampling, GreedyIsArgmaxWithLowestIndexOnTies) {
  const std::vector<float> logits = {0.5f, 3.f, -1.f, 3.f, 2.9f};
  EXPECT_EQ(ops::sample_token(logits.data(), 5, params(0.f), 123, 4), 1);
  // top_k == 1 keeps only the argmax whatever the temperature and seed.
  for (uint64_t seed = 0; seed < 50; ++seed) {
    EXPECT_EQ(ops::sample_token(logits.data(), 5, params(1.5f, 1), seed, seed), 1);
  }
  const std::vector<float> last = {-2.f, -1.f, 7.f};
  EXPECT_EQ(ops::sample_token(last.data(), 3, params(0.f), 0, 0), 2);
}

TEST(Sampling, SameSeedAndStepGiveSameToken) {
  std::vector<float> logits(50);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i)) * 2;
  const SamplerParams p = params(1.f);
  std::set<int32_t> across_steps;
  for (uint64_t step = 0; step < 40; ++step) {
    const int32_t first = ops::sample_token(logits.data(), 50, p, 99, step);
    EXPECT_EQ(ops::sample_token(logits.data(), 50, p, 99, step), first);
    across_steps.insert(first);
  }
  // The draws do vary from step to step (a constant u would give one token).
  EXPECT_GT(across_steps.size(), 5u);
}

TEST(Sampling, UniformIsInUnitIntervalAndUnbiased) {
  double sum = 0;
  for (uint64_t i = 0; i < 100000; ++i) {
    const double u = ops::sampling_uniform(i % 7, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / 100000, 0.5, 0.005);
  EXPECT_NE(ops::sampling_uniform(1, 2), ops::sampling_uniform(2, 1));
}

TEST(Sampling, TopPKeepsSmallestSetReachingP) {
  const std::vector<float> logits = logits_of({0.05, 0.5, 0.15, 0.3});
  // Sorted: 0.5, 0.3, 0.15, 0.05. Mass 0.5 < 0.75 <= 0.8.
  EXPECT_EQ(support(logits, params(1.f, 0, 0.75f), 400), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(support(logits, params(1.f, 0, 0.9f), 400), (std::set<int32_t>{1, 2, 3}));
  // Below the top token's own mass only the top token survives.
  EXPECT_EQ(support(logits, params(1.f, 0, 0.3f), 400), (std::set<int32_t>{1}));
}

TEST(Sampling, MinPKeepsTokensAboveFractionOfMax) {
  const std::vector<float> logits = logits_of({0.05, 0.5, 0.15, 0.3});
  // Thresholds 0.175 and 0.125.
  EXPECT_EQ(support(logits, params(1.f, 0, 1.f, 0.35f), 400), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(support(logits, params(1.f, 0, 1.f, 0.25f), 400), (std::set<int32_t>{1, 2, 3}));
  EXPECT_EQ(support(logits, params(1.f, 0, 1.f, 0.05f), 400), (std::set<int32_t>{0, 1, 2, 3}));
}

TEST(Sampling, TopKKeepsKLargest) {
  const std::vector<float> logits = logits_of({0.05, 0.5, 0.15, 0.3});
  EXPECT_EQ(support(logits, params(2.f, 2), 400), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(support(logits, params(2.f, 10), 400), (std::set<int32_t>{0, 1, 2, 3}));
}

// softmax(logits / T), then top-k, top-p, min-p, each renormalizing, computed independently of
// the kernel's bookkeeping: filters are masks over the full vocabulary.
std::vector<double> expected_distribution(const std::vector<float>& logits,
                                          const SamplerParams& p) {
  const size_t n = logits.size();
  std::vector<double> prob(n);
  for (size_t i = 0; i < n; ++i) prob[i] = std::exp(logits[i] / double(p.temperature));
  auto normalize = [&] {
    const double total = std::accumulate(prob.begin(), prob.end(), 0.0);
    for (double& x : prob) x /= total;
  };
  normalize();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return prob[a] > prob[b]; });
  if (p.top_k > 0) {
    for (size_t r = p.top_k; r < n; ++r) prob[order[r]] = 0;
    normalize();
  }
  if (p.top_p < 1.f) {
    double before = 0;
    for (size_t r = 0; r < n; ++r) {
      const double mass = prob[order[r]];
      if (r > 0 && before >= p.top_p) prob[order[r]] = 0;
      before += mass;
    }
    normalize();
  }
  if (p.min_p > 0.f) {
    const double top = *std::max_element(prob.begin(), prob.end());
    for (double& x : prob) {
      if (x < p.min_p * top) x = 0;
    }
    normalize();
  }
  return prob;
}

TEST(Sampling, EmpiricalDistributionMatchesFilteredSoftmax) {
  const std::vector<float> logits = {2.f, 1.5f, 1.4f, 0.3f, -0.5f, 1.f, 0.9f, -1.2f, 0.1f, 1.45f};
  const int64_t vocab = static_cast<int64_t>(logits.size());
  const int draws = 20000;
  for (const SamplerParams& p : {params(1.f), params(0.7f), params(1.3f, 4), params(1.f, 0, 0.8f),
                                 params(1.f, 0, 1.f, 0.3f), params(0.9f, 6, 0.9f, 0.1f)}) {
    const std::vector<double> want = expected_distribution(logits, p);
    std::vector<int> counts(vocab, 0);
    for (int i = 0; i < draws; ++i) {
      // Half the draws vary the seed, half the step: both streams must be uniform.
      const uint64_t seed = i % 2 ? static_cast<uint64_t>(i) : 12345;
      const uint64_t step = i % 2 ? 3 : static_cast<uint64_t>(i);
      ++counts[ops::sample_token(logits.data(), vocab, p, seed, step)];
    }
    for (int64_t v = 0; v < vocab; ++v) {
      const double freq = static_cast<double>(counts[v]) / draws;
      EXPECT_NEAR(freq, want[v], 0.02) << "token " << v << " T " << p.temperature << " top_k "
                                       << p.top_k << " top_p " << p.top_p << " min_p " << p.min_p;
      if (want[v] == 0) EXPECT_EQ(counts[v], 0) << "filtered token " << v << " was drawn";
    }
  }
}

TEST(Sampling, RejectsBadParams) {
  const std::vector<float> logits = {1.f, 2.f};
  expect_error([&] { ops::sample_token(logits.data(), 2, params(-1.f), 0, 0); }, {"temperature"});
  expect_error([&] { ops::sample_token(logits.data(), 2, params(1.f, 0, 0.f), 0, 0); }, {"top_p"});
  expect_error([&] { ops::sample_token(logits.data(), 2, params(1.f, -2), 0, 0); }, {"top_k"});
}

// A token mask: the draw's frequencies are the softmax over the allowed tokens alone (a
// flat distribution over ids 1 and 3 here), greedy takes the best allowed token, and a mask
// that allows no token with a finite logit is an error, not a silent pick.
TEST(Sampling, MaskedTokensAreNeverDrawn) {
  const std::vector<float> logits = {9.f, 1.f, 8.f, 1.f, -std::numeric_limits<float>::infinity()};
  const int32_t mask = 0b01010;  // tokens 1 and 3
  EXPECT_EQ(ops::sample_token(logits.data(), 5, params(0.f), 0, 0, &mask), 1);
  std::map<int32_t, int> counts;
  const int n = 4000;
  for (int step = 0; step < n; ++step) {
    ++counts[ops::sample_token(logits.data(), 5, params(1.f), 7, step, &mask)];
  }
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_NEAR(counts[1] / double(n), 0.5, 0.03);
  EXPECT_NEAR(counts[3] / double(n), 0.5, 0.03);
  const int32_t only_inf = 0b10000;
  expect_error([&] { ops::sample_token(logits.data(), 5, params(1.f), 0, 0, &only_inf); },
               {"mask allows no token"});
}

TEST(LogSoftmaxTopK, MatchesDoubleReference) {
  const std::vector<float> logits = {0.3f, -2.f, 4.f, 4.f, 1.25f, 30.f, -30.f};
  double z = 0;
  for (float l : logits) z += std::exp(double(l) - 30.0);
  const double log_z = 30.0 + std::log(z);
  const auto top = ops::log_softmax_topk(logits.data(), 7, 4);
  ASSERT_EQ(top.size(), 4u);
  const int32_t want_ids[] = {5, 2, 3, 4};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(top[i].first, want_ids[i]);
    EXPECT_NEAR(top[i].second, logits[want_ids[i]] - log_z, 1e-5);
  }
  EXPECT_EQ(ops::log_softmax_topk(logits.data(), 7, 20).size(), 7u);
}

}  // namespace
}  // namespace pagedlm
