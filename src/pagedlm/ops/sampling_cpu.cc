#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/ops/op_check.h"
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
  const uint64_t bits = splitmix64(seed ^ (step * 0x9e3779b97f4a7c15ull));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

int32_t sample_token(const float* logits, int64_t vocab, const SamplerParams& params, uint64_t seed,
                     uint64_t step, const int32_t* mask) {
  PAGEDLM_CHECK(vocab > 0, "sample_token: empty vocabulary");
  std::vector<float> masked;
  if (mask) {
    masked.assign(logits, logits + vocab);
    bool any = false;
    for (int64_t i = 0; i < vocab; ++i) {
      if (!((static_cast<uint32_t>(mask[i >> 5]) >> (i & 31)) & 1u)) {
        masked[i] = -std::numeric_limits<float>::infinity();
      } else {
        any |= std::isfinite(masked[i]);
      }
    }
    PAGEDLM_CHECK(any, "sample_token: the mask allows no token with a finite logit");
    logits = masked.data();
  }
  PAGEDLM_CHECK(params.temperature >= 0.f, "sample_token: negative temperature ",
                params.temperature);
  PAGEDLM_CHECK(params.top_k >= 0, "sample_token: negative top_k ", params.top_k);
  PAGEDLM_CHECK(params.top_p > 0.f && params.top_p <= 1.f, "sample_token: top_p ", params.top_p,
                " is outside (0, 1]");
  PAGEDLM_CHECK(params.min_p >= 0.f && params.min_p <= 1.f, "sample_token: min_p ", params.min_p,
                " is outside [0, 1]");
  if (params.temperature == 0.f || params.top_k == 1) return argmax(logits, vocab);

  // Every filter is a logit threshold (ties at a cut are all kept), so the kept set is
  // {i : logits[i] >= cut}; the sorted candidates only serve to find the cut.
  const std::vector<int32_t> ids = sorted_candidates(logits, vocab, params.top_k);
  const double inv_temp = 1.0 / static_cast<double>(params.temperature);
  const double max_logit = logits[ids[0]];
  auto weight = [&](int32_t id) { return std::exp((logits[id] - max_logit) * inv_temp); };
  // -inf logits (masked tokens) stay out of the kept set even when no filter cuts.
  float cut = std::max(logits[ids.back()], std::numeric_limits<float>::lowest());
  if (params.top_p < 1.f) {
    double total = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (logits[i] >= cut) total += weight(static_cast<int32_t>(i));
    }
    // The largest cut whose kept mass (all tokens at or above it) reaches top_p of the total.
    const double target = static_cast<double>(params.top_p) * total;
    double cumulative = 0.0;
    for (size_t i = 0; i < ids.size(); ++i) {
      cumulative += weight(ids[i]);
      const bool last_of_value = i + 1 == ids.size() || logits[ids[i + 1]] != logits[ids[i]];
      if (last_of_value && cumulative >= target) {
        cut = logits[ids[i]];
        break;
      }
    }
  }
  if (params.min_p > 0.f) {
    // The top token has weight 1, so p >= min_p * max(p) is weight >= min_p.
    const double min_weight = static_cast<double>(params.min_p);
    for (int32_t id : ids) {
      if (logits[id] < cut) break;
      if (weight(id) < min_weight) {
        cut = std::nextafter(logits[id], std::numeric_limits<float>::infinity());
        break;
      }
    }
  }

  // Inverse-CDF walk in token order over the kept set.
  double kept_total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (logits[i] >= cut) kept_total += weight(static_cast<int32_t>(i));
  }
  const double target = sampling_uniform(seed, step) * kept_total;
  double cumulative = 0.0;
  int32_t last_kept = ids[0];
  for (int64_t i = 0; i < vocab; ++i) {
    if (logits[i] < cut) continue;
    last_kept = static_cast<int32_t>(i);
    cumulative += weight(last_kept);
    if (target < cumulative) return last_kept;
  }
  // Only reachable through rounding when target lands on kept_total.
  return last_kept;
}

void sample_tokens(const Tensor& logits, const SamplerRows& rows, const Tensor& out_tokens,
                   void* stream) {
  constexpr const char* kOp = "sample_tokens";
  detail::expect(logits, kOp, "logits", DType::kF32, {detail::kAnyDim, detail::kAnyDim});
  const int64_t num_rows = logits.dim(0), vocab = logits.dim(1);
  detail::expect(out_tokens, kOp, "out_tokens", DType::kI32, {num_rows});
  detail::expect_device(out_tokens, logits.device(), kOp, "out_tokens");
  PAGEDLM_CHECK(num_rows == 0 || (rows.temperature && rows.top_k && rows.top_p && rows.min_p &&
                                  rows.seed && rows.step),
                kOp, ": a per-row parameter array is null");
  PAGEDLM_CHECK(!rows.mask_slot || (rows.mask && rows.mask_words == (vocab + 31) / 32), kOp,
                ": masks need ", (vocab + 31) / 32, " words per row, got ", rows.mask_words);
  PAGEDLM_CHECK(!rows.bias_indptr || (rows.bias_tokens && rows.bias_values && rows.bias_saved), kOp,
                ": logit bias needs its tokens, values and scratch");
  PAGEDLM_CHECK(
      !rows.penalty_slot || (rows.repetition_penalty && rows.presence_penalty &&
                             rows.frequency_penalty && rows.token_counts && rows.prompt_seen),
      kOp, ": penalties need their per-row values and a token state");
  if (logits.device() == Device::kCpu) {
    const float* x = logits.data<float>();
    int32_t* out = out_tokens.data<int32_t>();
    const int64_t words = (vocab + 31) / 32;
    std::vector<float> adjusted;
    for (int64_t r = 0; r < num_rows; ++r) {
      const SamplerParams params{rows.temperature[r], rows.top_k[r], rows.top_p[r], rows.min_p[r]};
      const int32_t slot = rows.mask_slot ? rows.mask_slot[r] : -1;
      const float* row = x + r * vocab;
      const int64_t bias_begin = rows.bias_indptr ? rows.bias_indptr[r] : 0;
      const int64_t num_bias = rows.bias_indptr ? rows.bias_indptr[r + 1] - bias_begin : 0;
      const int32_t penalty_slot = rows.penalty_slot ? rows.penalty_slot[r] : -1;
      if (num_bias > 0 || penalty_slot >= 0) {
        adjusted.assign(row, row + vocab);
        adjust_logits(adjusted.data(), vocab, rows.bias_tokens + bias_begin,
                      rows.bias_values + bias_begin, num_bias,
                      penalty_slot >= 0 ? rows.repetition_penalty[r] : 1.f,
                      penalty_slot >= 0 ? rows.presence_penalty[r] : 0.f,
                      penalty_slot >= 0 ? rows.frequency_penalty[r] : 0.f,
                      penalty_slot >= 0 ? rows.token_counts + penalty_slot * vocab : nullptr,
                      penalty_slot >= 0 ? rows.prompt_seen + penalty_slot * words : nullptr);
        row = adjusted.data();
      }
      out[r] = sample_token(row, vocab, params, rows.seed[r], static_cast<uint64_t>(rows.step[r]),
                            slot >= 0 ? rows.mask + int64_t{slot} * rows.mask_words : nullptr);
    }
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::sample_tokens(logits.data<float>(), num_rows, vocab, rows, out_tokens.data<int32_t>(),
                      stream);
#else
  detail::fail_no_cuda(kOp);
#endif
}

void adjust_logits(float* row, int64_t vocab, const int32_t* bias_tokens, const float* bias_values,
                   int64_t num_bias, float repetition_penalty, float presence_penalty,
                   float frequency_penalty, const int32_t* counts, const int32_t* prompt_seen) {
  for (int64_t j = 0; j < num_bias; ++j) {
    PAGEDLM_CHECK(bias_tokens[j] >= 0 && bias_tokens[j] < vocab, "adjust_logits: bias token ",
                  bias_tokens[j], " is outside a vocabulary of ", vocab);
    row[bias_tokens[j]] += bias_values[j];
  }
  if (counts == nullptr) return;
  const bool repetition = repetition_penalty != 1.f;
  const bool counted = presence_penalty != 0.f || frequency_penalty != 0.f;
  for (int64_t t = 0; t < vocab; ++t) {
    const int32_t count = counts[t];
    const bool in_prompt = (static_cast<uint32_t>(prompt_seen[t >> 5]) >> (t & 31)) & 1u;
    float v = row[t];
    if (repetition && (count > 0 || in_prompt)) {
      v = v > 0.f ? v / repetition_penalty : v * repetition_penalty;
    }
    // One fused multiply-add, written out so that the device's fmaf and this line round alike
    // whatever the compiler contracts.
    if (counted && count > 0) {
      v -= std::fma(frequency_penalty, static_cast<float>(count), presence_penalty);
    }
    row[t] = v;
  }
}

void count_tokens(const TokenState& state, const int32_t* tokens, const int32_t* slots, int64_t n,
                  bool prompt, void* stream) {
  constexpr const char* kOp = "count_tokens";
  PAGEDLM_CHECK(n >= 0 && state.vocab > 0 && state.counts && state.prompt_seen, kOp,
                ": no token state or a negative count");
  PAGEDLM_CHECK(n == 0 || (tokens && slots), kOp, ": null tokens or slots");
  if (state.device == Device::kCpu) {
    const int64_t words = (state.vocab + 31) / 32;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t slot = slots[i], token = tokens[i];
      if (slot < 0) continue;
      PAGEDLM_CHECK(slot < state.num_slots, kOp, ": slot ", slot, " of ", state.num_slots);
      PAGEDLM_CHECK(token >= 0 && token < state.vocab, kOp, ": token ", token,
                    " is outside a vocabulary of ", state.vocab);
      if (prompt) {
        state.prompt_seen[slot * words + (token >> 5)] |=
            static_cast<int32_t>(1u << (static_cast<uint32_t>(token) & 31));
      } else {
        ++state.counts[slot * state.vocab + token];
      }
    }
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::count_tokens(state, tokens, slots, n, prompt, stream);
#else
  static_cast<void>(stream);
  detail::fail_no_cuda(kOp);
#endif
}

void sampled_logprobs(const Tensor& logits, const LogprobRows& rows, void* stream) {
  constexpr const char* kOp = "sampled_logprobs";
  detail::expect(logits, kOp, "logits", DType::kF32, {detail::kAnyDim, detail::kAnyDim});
  const int64_t num_rows = logits.dim(0), vocab = logits.dim(1);
  PAGEDLM_CHECK(num_rows == 0 || (rows.tokens && rows.top_k && rows.logprob && rows.top_ids &&
                                  rows.top_logprobs),
                kOp, ": a per-row array is null");
  if (logits.device() == Device::kCpu) {
    for (int64_t r = 0; r < num_rows; ++r) {
      const int32_t k = rows.top_k[r];
      if (k < 0) continue;
      PAGEDLM_CHECK(k <= kMaxTopLogprobs, kOp, ": top_k ", k, " exceeds ", kMaxTopLogprobs);
      const int32_t token = rows.tokens[r];
      PAGEDLM_CHECK(token >= 0 && token < vocab, kOp, ": token ", token,
                    " is outside a vocabulary of ", vocab);
      const float* row = logits.data<float>() + r * vocab;
      const auto best = log_softmax_topk(row, vocab, std::max(k, 1));
      // best[0] is logit - log_z of the top token, which gives log_z for any other token.
      const float log_z = row[best[0].first] - best[0].second;
      rows.logprob[r] = row[token] - log_z;
      for (size_t j = 0; j < best.size(); ++j) {
        rows.top_ids[r * kMaxTopLogprobs + j] = best[j].first;
        rows.top_logprobs[r * kMaxTopLogprobs + j] = best[j].second;
        if (best[j].first == token) rows.logprob[r] = best[j].second;
      }
    }
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::sampled_logprobs(logits.data<float>(), num_rows, vocab, rows, stream);
#else
  static_cast<void>(stream);
  detail::fail_no_cuda(kOp);
#endif
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
