// Token selection from rows of logits. sample_token draws one token on the host: the CPU engine
// samples every row with it. sample_tokens draws one token per row of a logits tensor on its own
// device, logit bias and penalties included: on the GPU without leaving it
// (ops/cuda/sampling.cu), the GPU engine's path for every row. count_tokens keeps the
// per-sequence token counts the penalties read, and sampled_logprobs computes returned
// logprobs, on the logits' device too.
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
  // Logit bias (optional): row r adds bias_values[j] to the logit of bias_tokens[j], j in
  // [bias_indptr[r], bias_indptr[r + 1]), in that order (a token may repeat). On the GPU the
  // additions are made in the logits in place and undone after the draw (exactly: the values
  // they replaced are kept in bias_saved, one float per entry, device scratch), so the logits
  // read the same before and after; on the CPU they are made in a copy. Null bias_indptr: no
  // row is biased.
  const int32_t* bias_indptr = nullptr;
  const int32_t* bias_tokens = nullptr;
  const float* bias_values = nullptr;
  float* bias_saved = nullptr;
  // Penalties (optional): row r with penalty_slot[r] >= 0 reads the token state of that slot of
  // a TokenState (its output-token counts and prompt bits, see count_tokens) and applies, after
  // the bias, the repetition penalty to every token of the prompt or the output (a positive
  // logit divided by it, a negative one multiplied) and then presence + frequency * count to
  // every output token (subtracted). Null penalty_slot: no row is penalized.
  const int32_t* penalty_slot = nullptr;
  const float* repetition_penalty = nullptr;
  const float* presence_penalty = nullptr;
  const float* frequency_penalty = nullptr;
  const int32_t* token_counts = nullptr;  // [slots, vocab]
  const int32_t* prompt_seen = nullptr;   // [slots, ceil(vocab / 32)] bits
};

// The token state penalties read, per slot (one sequence each): how often each token occurs in
// its output so far, and one bit per token that occurs in its prompt.
// count_tokens(state, tokens, slots, n, prompt): for every i < n with slots[i] >= 0, token
// tokens[i] of slot slots[i] is counted once more (prompt false) or marked as a prompt token
// (prompt true). The GPU engine calls it after each draw with the sampled tokens (so the state
// follows the device's own tokens) and to fill a slot from a sequence's tokens. On the GPU it
// only enqueues work on `stream`; tokens and slots are device arrays of n; a token outside
// [0, vocab) is skipped (the GPU) or refused (the CPU).
struct TokenState {
  int32_t* counts = nullptr;       // [slots, vocab]
  int32_t* prompt_seen = nullptr;  // [slots, ceil(vocab / 32)]
  int64_t vocab = 0;
  int32_t num_slots = 0;
  Device device = Device::kCpu;
};
void count_tokens(const TokenState& state, const int32_t* tokens, const int32_t* slots, int64_t n,
                  bool prompt, void* stream = nullptr);

// One row's logit adjustments in vLLM's order: bias (in list order), then the repetition
// penalty over prompt and output tokens, then presence and frequency over output tokens.
// counts: [vocab] output-token counts; prompt_seen: [ceil(vocab / 32)] bits. The host's
// reference of what the device sampler applies in its read (same float operations, the
// frequency term as one fused multiply-add).
void adjust_logits(float* row, int64_t vocab, const int32_t* bias_tokens, const float* bias_values,
                   int64_t num_bias, float repetition_penalty, float presence_penalty,
                   float frequency_penalty, const int32_t* counts, const int32_t* prompt_seen);

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

// Returned logprobs of sampled tokens, on the logits' device. logits: [rows, vocab] f32; per
// row r (arrays of `rows` on the same device): top_k[r] < 0 skips the row, else
// top_ids/top_logprobs[r * kMaxTopLogprobs + j], j < max(top_k[r], 1), receive
// log_softmax_topk(row, vocab, max(top_k[r], 1)), and logprob[r] the log-probability of
// tokens[r] (top_logprobs' number where the token is among them, so both read the same).
// top_k[r] <= kMaxTopLogprobs. On the GPU it only enqueues work on `stream`.
constexpr int32_t kMaxTopLogprobs = 20;
struct LogprobRows {
  const int32_t* tokens = nullptr;
  const int32_t* top_k = nullptr;
  float* logprob = nullptr;
  int32_t* top_ids = nullptr;     // [rows, kMaxTopLogprobs]
  float* top_logprobs = nullptr;  // [rows, kMaxTopLogprobs]
};
void sampled_logprobs(const Tensor& logits, const LogprobRows& rows, void* stream = nullptr);

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as sample_tokens; every pointer is device memory.
void sample_tokens(const float* logits, int64_t rows, int64_t vocab, const SamplerRows& params,
                   int32_t* out_tokens, void* stream);
void count_tokens(const TokenState& state, const int32_t* tokens, const int32_t* slots, int64_t n,
                  bool prompt, void* stream);
void sampled_logprobs(const float* logits, int64_t rows, int64_t vocab, const LogprobRows& params,
                      void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
