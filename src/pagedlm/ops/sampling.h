// Token selection from rows of logits. sample_token draws one token on the host: the CPU engine
// samples every row with it, and the GPU engine the rows whose logits it adjusts on the host
// (bias, penalties). sample_tokens draws one token per row of a logits tensor on its own
// device: on the GPU without leaving it (ops/cuda/sampling.cu), the GPU engine's path for every
// other row.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "pagedlm/core/sampler_params.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// logits: [vocab]. The same rules as the device sampler (ops/cuda/kernels.h, launch_sample), so
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
// A -inf logit is never kept. mask (structured output), when given, holds ceil(vocab / 32)
// words: a token whose bit (id % 32 of word id / 32) is clear counts as -inf, before every rule
// above, greedy included. At least one allowed token must have a finite logit.
int32_t sample_token(const float* logits, int64_t vocab, const SamplerParams& params, uint64_t seed,
                     uint64_t step, const int32_t* mask = nullptr);

// The uniform double in [0, 1) that sample_token draws with for (seed, step).
double sampling_uniform(uint64_t seed, uint64_t step);

// Per-row parameters of sample_tokens: arrays of one element per logits row, in the memory of
// the logits' device (a plain struct of pointers: there is no 64-bit Tensor dtype, and the GPU
// engine keeps them at fixed offsets of one staging block).
struct SamplerRows {
  const float* temperature = nullptr;
  const int32_t* top_k = nullptr;
  const float* top_p = nullptr;
  const float* min_p = nullptr;
  const uint64_t* seed = nullptr;
  const int64_t* step = nullptr;  // the counter of each row's random stream
  // Token bitmasks (optional): row r uses mask + mask_slot[r] * mask_words when mask_slot[r] >= 0
  // (see sample_token); null mask_slot: no row is masked.
  const int32_t* mask = nullptr;
  const int32_t* mask_slot = nullptr;
  int32_t mask_words = 0;
};

// logits: [rows, vocab] f32, out_tokens: [rows] i32 on the same device. out_tokens[r] = the
// token sample_token draws for row r with row r's parameters (on the GPU, from f32 sums: a
// draw within rounding of a boundary between two tokens may pick the other one). On the GPU it
// only enqueues work on `stream` (nothing is synchronized or allocated, so a CUDA graph can
// capture it) and treats a temperature <= 0 as greedy; on the CPU the parameters are checked as
// sample_token checks them.
void sample_tokens(const Tensor& logits, const SamplerRows& rows, const Tensor& out_tokens,
                   void* stream = nullptr);

// logits: [vocab]. The k most probable tokens (descending, ties toward the lower index) and their
// log-probabilities under log_softmax(logits), for returned logprobs.
std::vector<std::pair<int32_t, float>> log_softmax_topk(const float* logits, int64_t vocab, int k);

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as sample_tokens; every pointer is device memory.
void sample_tokens(const float* logits, int64_t rows, int64_t vocab, const SamplerRows& params,
                   int32_t* out_tokens, void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
