// Token selection from one row of logits (host side: the engine copies the sampled rows' logits
// to the CPU).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "pagedlm/sched/sampling_params.h"

namespace pagedlm::ops {

// logits: [vocab]. The same rules as the GPU sampler (ops/cuda/kernels.h, launch_sample), so
// both backends draw the same token from the same logits wherever rounding allows:
//   1. temperature == 0 or top_k == 1: the argmax, lowest index on ties;
//   2. x = logits / T, p = softmax(x);
//   3. top-k (k > 0): keep tokens with x >= the k-th largest x (ties at the cut all kept);
//   4. top-p (< 1): among those, keep x >= C, C the largest value whose kept mass reaches top_p
//      of the mass left by top-k (so at least the top token survives);
//   5. min-p (> 0): keep tokens with p >= min_p * max(p);
// then the first kept token, in ascending id order, where the running kept mass exceeds
// u * (kept mass), u = uniform(seed, step), a counter-based hash: the same (logits, params,
// seed, step) gives the same token whatever else is in the batch and across preemption.
int32_t sample_token(const float* logits, int64_t vocab, const SamplingParams& params,
                     uint64_t seed, uint64_t step);

// The uniform double in [0, 1) that sample_token draws with for (seed, step).
double sampling_uniform(uint64_t seed, uint64_t step);

// logits: [vocab]. The k most probable tokens (descending, ties toward the lower index) and their
// log-probabilities under log_softmax(logits), for returned logprobs.
std::vector<std::pair<int32_t, float>> log_softmax_topk(const float* logits, int64_t vocab, int k);

}  // namespace pagedlm::ops
