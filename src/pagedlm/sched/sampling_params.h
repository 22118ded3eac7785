// Per-request sampling and stopping parameters.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "pagedlm/core/sampler_params.h"

namespace pagedlm {

// The sampler's own parameters (temperature, top_k, top_p, min_p) come from the base, so a
// SamplingParams passes to ops::sample_token as it is.
struct SamplingParams : SamplerParams {
  // OpenAI's penalties over the tokens generated so far: logit -= presence * (count > 0) +
  // frequency * count, before temperature and the filters. 0 means off; range [-2, 2].
  float presence_penalty = 0.f;
  float frequency_penalty = 0.f;
  // vLLM's (and HF's) repetition penalty over the prompt and the generated tokens: a seen
  // token's logit is divided by it when positive, multiplied when negative. 1 means off; > 0.
  float repetition_penalty = 1.f;
  // OpenAI's logit_bias: (token id, bias in [-100, 100]) added to those logits before the
  // penalties.
  std::vector<std::pair<int32_t, float>> logit_bias;
  std::optional<uint64_t> seed;  // fixed seed: reproducible whatever else is in the batch
  int32_t max_tokens = 16;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
};

}  // namespace pagedlm
