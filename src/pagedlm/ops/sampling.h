// Token selection from one row of logits (host side: the engine copies the sampled rows' logits
// to the CPU).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "pagedlm/sched/sampling_params.h"

namespace pagedlm::ops {

// logits: [vocab]. temperature == 0 means greedy: the argmax, lowest index on ties.
// Otherwise the filters run in the order of HF transformers' logits warpers (vLLM uses the same
// order for temperature, top-k and top-p):
//   1. temperature: logits / T;
//   2. top-k (k > 0): keep the k largest (ties broken toward the lower index);
//   3. top-p (< 1): keep the smallest most-probable set whose probability (renormalized after
//      top-k) reaches top_p, always at least the top token;
//   4. min-p (> 0): keep tokens whose probability is >= min_p * the largest probability;
// then draw from the renormalized survivors with u = uniform(seed, step), a counter-based hash:
// the same (logits, params, seed, step) gives the same token whatever else is in the batch and
// across preemption and recomputation.
int32_t sample_token(const float* logits, int64_t vocab, const SamplingParams& params,
                     uint64_t seed, uint64_t step);

// The uniform double in [0, 1) that sample_token draws with for (seed, step).
double sampling_uniform(uint64_t seed, uint64_t step);

// logits: [vocab]. The k most probable tokens (descending, ties toward the lower index) and their
// log-probabilities under log_softmax(logits), for returned logprobs.
std::vector<std::pair<int32_t, float>> log_softmax_topk(const float* logits, int64_t vocab, int k);

}  // namespace pagedlm::ops
