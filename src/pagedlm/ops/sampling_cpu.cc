#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/ops/sampling.h"

namespace pagedlm::ops {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int32_t argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

// Higher logit first, lower index first among equal logits: a total order, so every filter and
// the draw are deterministic.
struct ByLogitDesc {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  }
};

// The candidate token ids sorted by ByLogitDesc: all of them, or only the top `k` when k > 0.
std::vector<int32_t> sorted_candidates(const float* logits, int64_t vocab, int64_t k) {
  std::vector<int32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0);
  const ByLogitDesc order{logits};
  if (k > 0 && k < vocab) {
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), order);
    ids.resize(k);
  } else {
    std::sort(ids.begin(), ids.end(), order);
  }
  return ids;
}

}  // namespace

double sampling_uniform(uint64_t seed, uint64_t step) {
  const uint64_t bits = splitmix64(splitmix64(seed) ^ step);
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

int32_t sample_token(const float* logits, int64_t vocab, const SamplingParams& params,
                     uint64_t seed, uint64_t step) {
  PAGEDLM_CHECK(vocab > 0, "sample_token: empty vocabulary");
  PAGEDLM_CHECK(params.temperature >= 0.f, "sample_token: negative temperature ",
                params.temperature);
  PAGEDLM_CHECK(params.top_k >= 0, "sample_token: negative top_k ", params.top_k);
  PAGEDLM_CHECK(params.top_p > 0.f && params.top_p <= 1.f, "sample_token: top_p ", params.top_p,
                " is outside (0, 1]");
  PAGEDLM_CHECK(params.min_p >= 0.f && params.min_p <= 1.f, "sample_token: min_p ", params.min_p,
                " is outside [0, 1]");
  if (params.temperature == 0.f || params.top_k == 1) return argmax(logits, vocab);

  // Candidates in descending probability; temperature does not change that order.
  const std::vector<int32_t> ids = sorted_candidates(logits, vocab, params.top_k);
  const double inv_temp = 1.0 / static_cast<double>(params.temperature);
  const double max_logit = logits[ids[0]];
  std::vector<double> weights(ids.size());
  double total = 0.0;
  for (size_t i = 0; i < ids.size(); ++i) {
    weights[i] = std::exp((logits[ids[i]] - max_logit) * inv_temp);
    total += weights[i];
  }

  size_t kept = ids.size();
  if (params.top_p < 1.f) {
    const double target = static_cast<double>(params.top_p) * total;
    double cumulative = 0.0;
    for (size_t i = 0; i < ids.size(); ++i) {
      cumulative += weights[i];
      if (cumulative >= target) {
        kept = i + 1;
        break;
      }
    }
  }
  if (params.min_p > 0.f) {
    // weights[0] is the largest probability (unnormalized); renormalizing does not move the cut.
    const double threshold = static_cast<double>(params.min_p) * weights[0];
    size_t n = 1;
    while (n < kept && weights[n] >= threshold) ++n;
    kept = n;
  }

  const double kept_total = std::accumulate(weights.begin(), weights.begin() + kept, 0.0);
  const double target = sampling_uniform(seed, step) * kept_total;
  double cumulative = 0.0;
  for (size_t i = 0; i < kept; ++i) {
    cumulative += weights[i];
    if (target < cumulative) return ids[i];
  }
  // Only reachable through rounding when target lands on kept_total.
  return ids[kept - 1];
}

std::vector<std::pair<int32_t, float>> log_softmax_topk(const float* logits, int64_t vocab, int k) {
  PAGEDLM_CHECK(vocab > 0 && k >= 0, "log_softmax_topk: vocab ", vocab, ", k ", k);
  const int64_t n = std::min<int64_t>(k, vocab);
  const float max_logit = logits[argmax(logits, vocab)];
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - max_logit);
  const double log_z = max_logit + std::log(sum);
  std::vector<std::pair<int32_t, float>> top;
  if (n == 0) return top;
  for (int32_t id : sorted_candidates(logits, vocab, n)) {
    top.emplace_back(id, static_cast<float>(logits[id] - log_z));
  }
  return top;
}

}  // namespace pagedlm::ops
