// Sampling on the GPU, one block per row of logits. Filters become one logit threshold:
// top-k and top-p thresholds are found by radix selection over order-preserving float keys
// (4 passes of 8-bit digits: counts for top-k, probability mass for top-p), so nothing is
// sorted and no scratch memory is needed. The draw is an inverse-CDF walk in token order with a
// counter-based uniform (splitmix64), reproducible per request whatever the batch holds.
// Penalties are applied as each logit is read (from a per-sequence table of token counts and
// prompt bits that a tiny kernel updates from the sampled tokens), the logit bias in place and
// undone after the draw, and returned logprobs come from the raw logits: nothing leaves the
// device but tokens and a few numbers per row.

#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cmath>

#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kBins = 256;

using detail::launch_overlapped;
using detail::splitmix64;
using detail::wait_for_inputs;

__host__ __device__ inline double uniform01(uint64_t seed, int64_t step) {
  const uint64_t h = splitmix64(seed ^ (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

// Larger float <=> larger key.
__device__ __forceinline__ uint32_t float_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// The block's largest (value, lowest index on ties) of every thread's (best, best_i); valid in
// thread 0. A thread with no candidate passes (-inf, INT_MAX).
__device__ __forceinline__ void block_argmax(float& best, int& best_i) {
  __shared__ float wb[32];
  __shared__ int wi[32];
  const int tid = threadIdx.x;
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (ob > best || (ob == best && oi < best_i)) {
      best = ob;
      best_i = oi;
    }
  }
  if ((tid & 31) == 0) {
    wb[tid >> 5] = best;
    wi[tid >> 5] = best_i;
  }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x) / 32; ++w) {
      if (wb[w] > best || (wb[w] == best && wi[w] < best_i)) {
        best = wb[w];
        best_i = wi[w];
      }
    }
  }
  __syncthreads();  // wb/wi may be reused by the next call
}

// A logit with row r's penalties applied (SampleAdjust b.; the host's ops::adjust_logits does
// the same operations, hence the explicit roundings: no contraction may fuse them otherwise).
struct RowPenalty {
  const int32_t* counts = nullptr;        // the row's slot: [vocab]
  const uint32_t* prompt_seen = nullptr;  // [ceil(vocab / 32)]
  float repetition = 1.f, presence = 0.f, frequency = 0.f;

  __device__ __forceinline__ float operator()(float v, int i) const {
    const int c = counts[i];
    if (repetition != 1.f && (c > 0 || ((prompt_seen[i >> 5] >> (i & 31)) & 1u))) {
      v = v > 0.f ? __fdiv_rn(v, repetition) : __fmul_rn(v, repetition);
    }
    if ((presence != 0.f || frequency != 0.f) && c > 0) {
      v = __fsub_rn(v, fmaf(frequency, static_cast<float>(c), presence));
    }
    return v;
  }
};

// logits: [num_rows, vocab] f32; out_tokens: [num_rows]; grid: num_rows blocks of kThreads.
// kMasked: rows may have token masks (mask_slot); kPenalized: rows may have penalties
// (adjust.penalty_slot). The plain instantiation, which steps without structured output or
// penalties take, reads the logits alone.
template <bool kMasked, bool kPenalized>
__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* logits, int vocab, const float* temperature, const int32_t* top_k,
                  const float* top_p, const float* min_p, const uint64_t* seed, const int64_t* step,
                  int32_t* out_tokens, const int32_t* masks, const int32_t* mask_slot,
                  int mask_words, SampleAdjust adjust) {
  wait_for_inputs();
  __shared__ float scratch[32];
  __shared__ float hist_mass[kBins];
  __shared__ int hist_count[kBins];
  __shared__ double chunk_prefix[kThreads];
  __shared__ uint32_t sel_key;
  __shared__ int sel_remaining;
  __shared__ float sel_mass_above;
  __shared__ int chosen;

  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const float* row_logits = logits + static_cast<size_t>(row) * vocab;
  const int slot = kMasked ? mask_slot[row] : -1;
  const uint32_t* row_mask =
      slot >= 0 ? reinterpret_cast<const uint32_t*>(masks) + static_cast<size_t>(slot) * mask_words
                : nullptr;
  RowPenalty penalty;
  const int pslot = kPenalized ? adjust.penalty_slot[row] : -1;
  if (pslot >= 0) {
    penalty.counts = adjust.counts + static_cast<size_t>(pslot) * vocab;
    penalty.prompt_seen = reinterpret_cast<const uint32_t*>(adjust.prompt_seen) +
                          static_cast<size_t>(pslot) * ((vocab + 31) / 32);
    penalty.repetition = adjust.repetition[row];
    penalty.presence = adjust.presence[row];
    penalty.frequency = adjust.frequency[row];
  }
  // Token i's logit, -inf where the row's grammar forbids it, penalized where the row asks.
  const auto x = [&](int i) {
    if (kMasked && row_mask && !((row_mask[i >> 5] >> (i & 31)) & 1u)) return -INFINITY;
    if (kPenalized && pslot >= 0) return penalty(row_logits[i], i);
    return row_logits[i];
  };
  const float temp = temperature[row];
  const int k = top_k[row];

  if (temp <= 0.f || k == 1) {
    float best = -INFINITY;
    int best_i = vocab;  // stays past the end only if every logit is -inf or NaN
    for (int i = tid; i < vocab; i += kThreads) {
      if (x(i) > best) {
        best = x(i);
        best_i = i;
      }
    }
    block_argmax(best, best_i);
    if (tid == 0) out_tokens[row] = best_i < vocab ? best_i : 0;
    return;
  }

  const float inv_temp = 1.f / temp;
  float local_max = -INFINITY;
  for (int i = tid; i < vocab; i += kThreads) local_max = fmaxf(local_max, x(i) * inv_temp);
  const float max_x = detail::block_max(local_max, scratch);

  float thresh = -INFINITY;
  if (k > 0 && k < vocab) {
    // Radix-select the key of the k-th largest scaled logit.
    uint32_t prefix = 0, mask = 0;
    int remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = tid; b < kBins; b += kThreads) hist_count[b] = 0;
      __syncthreads();
      for (int i = tid; i < vocab; i += kThreads) {
        const uint32_t key = float_key(x(i) * inv_temp);
        if ((key & mask) == prefix) atomicAdd(&hist_count[(key >> shift) & 0xFF], 1);
      }
      __syncthreads();
      if (tid == 0) {
        int cum = 0, bin = kBins - 1;
        for (; bin > 0; --bin) {
          if (cum + hist_count[bin] >= remaining) break;
          cum += hist_count[bin];
        }
        sel_key = prefix | (static_cast<uint32_t>(bin) << shift);
        sel_remaining = remaining - cum;
      }
      __syncthreads();
      prefix = sel_key;
      remaining = sel_remaining;
      mask |= 0xFFu << shift;
      __syncthreads();
    }
    thresh = key_float(prefix);
  }

  const float tp = top_p[row];
  if (tp < 1.f) {
    float local_mass = 0.f;
    for (int i = tid; i < vocab; i += kThreads) {
      const float xi = x(i) * inv_temp;
      if (xi >= thresh) local_mass += __expf(xi - max_x);
    }
    const float target = tp * detail::block_sum(local_mass, scratch);
    // Radix-select the largest key whose upper set holds at least `target` mass.
    uint32_t prefix = 0, mask = 0;
    float mass_above = 0.f;
    bool found = true;
    for (int shift = 24; shift >= 0 && found; shift -= 8) {
      for (int b = tid; b < kBins; b += kThreads) hist_mass[b] = 0.f;
      __syncthreads();
      for (int i = tid; i < vocab; i += kThreads) {
        const float xi = x(i) * inv_temp;
        const uint32_t key = float_key(xi);
        if (xi >= thresh && (key & mask) == prefix) {
          atomicAdd(&hist_mass[(key >> shift) & 0xFF], __expf(xi - max_x));
        }
      }
      __syncthreads();
      if (tid == 0) {
        float cum = mass_above;
        int bin = kBins - 1;
        for (; bin >= 0; --bin) {
          if (cum + hist_mass[bin] >= target) break;
          cum += hist_mass[bin];
        }
        // bin < 0: rounding left the target out of reach; keep the current threshold.
        sel_remaining = bin;
        sel_key = prefix | (static_cast<uint32_t>(bin < 0 ? 0 : bin) << shift);
        sel_mass_above = cum;
      }
      __syncthreads();
      found = sel_remaining >= 0;
      prefix = sel_key;
      mass_above = sel_mass_above;
      mask |= 0xFFu << shift;
      __syncthreads();
    }
    if (found) thresh = fmaxf(thresh, key_float(prefix));
  }

  const float mp = min_p[row];
  // p_i >= min_p * p_max  <=>  exp(x_i - max_x) >= min_p.
  const float min_e = mp > 0.f ? mp : 0.f;

  // Inverse CDF over token order: each thread owns a contiguous chunk.
  const int chunk = (vocab + kThreads - 1) / kThreads;
  const int lo = min(tid * chunk, vocab), hi = min(lo + chunk, vocab);
  double sum = 0.0;
  int last_kept = -1;
  for (int i = lo; i < hi; ++i) {
    const float xi = x(i) * inv_temp;
    const float e = __expf(xi - max_x);
    if (xi >= thresh && e >= min_e && xi > -INFINITY) {
      sum += e;
      last_kept = i;
    }
  }
  chunk_prefix[tid] = sum;
  if (tid == 0) chosen = -1;
  __syncthreads();
  __shared__ double total_s;
  if (tid == 0) {
    // Exclusive scan of the chunk sums, in the same order a CPU loop over tokens adds them.
    double run = 0.0;
    for (int w = 0; w < kThreads; ++w) {
      const double s = chunk_prefix[w];
      chunk_prefix[w] = run;
      run += s;
    }
    total_s = run;
  }
  __syncthreads();
  const double total = total_s;
  const double target = uniform01(seed[row], step[row]) * total;
  const double before = chunk_prefix[tid];
  if (sum > 0.0 && before <= target && target < before + sum) {
    double run = before;
    int pick = last_kept;
    for (int i = lo; i < hi; ++i) {
      const float xi = x(i) * inv_temp;
      const float e = __expf(xi - max_x);
      if (xi >= thresh && e >= min_e && xi > -INFINITY) {
        run += e;
        if (run > target) {
          pick = i;
          break;
        }
      }
    }
    chosen = pick;
  }
  __syncthreads();
  if (chosen < 0) {
    // Rounding put the target at the very end: take the last kept token.
    const float last = detail::block_max(static_cast<float>(last_kept), scratch);
    if (tid == 0) out_tokens[row] = last >= 0.f ? static_cast<int32_t>(last) : 0;
  } else if (tid == 0) {
    out_tokens[row] = chosen;
  }
}

// Logit bias in place (undo false: each replaced value kept in saved[j]) or undone (undo true,
// in reverse order, so a token listed twice gets its first value back). One thread per row:
// the additions of a row are made in list order, as the host makes them.
__global__ void logit_bias_kernel(float* logits, int num_rows, int vocab, const int32_t* indptr,
                                  const int32_t* tokens, const float* values, float* saved,
                                  bool undo) {
  wait_for_inputs();
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= num_rows) return;
  float* x = logits + static_cast<size_t>(row) * vocab;
  const int begin = indptr[row], end = indptr[row + 1];
  if (!undo) {
    for (int j = begin; j < end; ++j) {
      const int t = tokens[j];
      if (t < 0 || t >= vocab) continue;
      saved[j] = x[t];
      x[t] = __fadd_rn(x[t], values[j]);
    }
  } else {
    for (int j = end - 1; j >= begin; --j) {
      const int t = tokens[j];
      if (t >= 0 && t < vocab) x[t] = saved[j];
    }
  }
}

__global__ void count_tokens_kernel(int32_t* counts, uint32_t* prompt_seen, int vocab,
                                    int num_slots, const int32_t* tokens, const int32_t* slots,
                                    int n, bool prompt) {
  wait_for_inputs();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int slot = slots[i], t = tokens[i];
  if (slot < 0 || slot >= num_slots || t < 0 || t >= vocab) return;
  if (prompt) {
    atomicOr(prompt_seen + static_cast<size_t>(slot) * ((vocab + 31) / 32) + (t >> 5),
             1u << (t & 31));
  } else {
    atomicAdd(counts + static_cast<size_t>(slot) * vocab + t, 1);
  }
}

// One block per row: log_z, then the top tokens one at a time (each the block's best among the
// tokens ordered after the previous one: lower logit, or the same logit and a higher index).
__global__ void __launch_bounds__(kThreads)
    sampled_logprobs_kernel(const float* logits, int vocab, const int32_t* tokens,
                            const int32_t* top_k, int max_top, float* logprob, int32_t* top_ids,
                            float* top_logprobs) {
  wait_for_inputs();
  __shared__ float scratch[32];
  __shared__ float prev_s;
  __shared__ int prev_i_s;
  const int row = blockIdx.x, tid = threadIdx.x;
  const int k = top_k[row];
  if (k < 0) return;
  const int n = min(max(k, 1), max_top);
  const float* x = logits + static_cast<size_t>(row) * vocab;
  float local = -INFINITY;
  for (int i = tid; i < vocab; i += kThreads) local = fmaxf(local, x[i]);
  const float max_x = detail::block_max(local, scratch);
  float sum = 0.f;
  for (int i = tid; i < vocab; i += kThreads) sum += expf(x[i] - max_x);
  const float log_z = max_x + logf(detail::block_sum(sum, scratch));
  float prev = INFINITY;
  int prev_i = -1, found = 0;
  for (int j = 0; j < n; ++j) {
    float best = -INFINITY;
    int best_i = INT_MAX;
    for (int i = tid; i < vocab; i += kThreads) {
      const float v = x[i];
      const bool after = v < prev || (v == prev && i > prev_i);
      if (after && (v > best || (v == best && i < best_i))) {
        best = v;
        best_i = i;
      }
    }
    block_argmax(best, best_i);
    if (tid == 0) {
      prev_s = best;
      prev_i_s = best_i;
      if (best_i < vocab) {
        top_ids[row * max_top + j] = best_i;
        top_logprobs[row * max_top + j] = best - log_z;
      }
    }
    __syncthreads();
    prev = prev_s;
    prev_i = prev_i_s;
    if (prev_i >= vocab) break;  // fewer tokens than asked for
    found = j + 1;
  }
  if (tid == 0) {
    const int t = tokens[row];
    float lp = t >= 0 && t < vocab ? x[t] - log_z : -INFINITY;
    for (int j = 0; j < found; ++j) {
      if (top_ids[row * max_top + j] == t) lp = top_logprobs[row * max_top + j];
    }
    logprob[row] = lp;
  }
}

}  // namespace

double sampling_uniform(uint64_t seed, int64_t step) { return uniform01(seed, step); }

cudaError_t launch_sample(const float* logits, int num_rows, int vocab, const float* temperature,
                          const int32_t* top_k, const float* top_p, const float* min_p,
                          const uint64_t* seed, const int64_t* step, int32_t* out_tokens,
                          cudaStream_t stream, const int32_t* mask, const int32_t* mask_slot,
                          int mask_words, const SampleAdjust& adjust) {
  if (num_rows <= 0) return cudaSuccess;
  if (vocab <= 0) return cudaErrorInvalidValue;
  const bool masked = mask != nullptr && mask_slot != nullptr;
  const bool penalized = adjust.penalty_slot != nullptr;
  if (penalized && (!adjust.repetition || !adjust.presence || !adjust.frequency || !adjust.counts ||
                    !adjust.prompt_seen)) {
    return cudaErrorInvalidValue;
  }
  const bool biased = adjust.bias_indptr != nullptr;
  if (biased && (!adjust.bias_tokens || !adjust.bias_values || !adjust.bias_saved)) {
    return cudaErrorInvalidValue;
  }
  constexpr int kBiasThreads = 128;
  const int bias_blocks = (num_rows + kBiasThreads - 1) / kBiasThreads;
  // In place and undone below: the caller's logits read the same after the call.
  auto* biased_logits =
      const_cast<float*>(logits);  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  if (biased) {
    launch_overlapped(logit_bias_kernel, bias_blocks, kBiasThreads, 0, stream, biased_logits,
                      num_rows, vocab, adjust.bias_indptr, adjust.bias_tokens, adjust.bias_values,
                      adjust.bias_saved, /*undo=*/false);
  }
  const auto launch = [&](auto kernel) {
    launch_overlapped(kernel, num_rows, kThreads, 0, stream, logits, vocab, temperature, top_k,
                      top_p, min_p, seed, step, out_tokens, masked ? mask : nullptr,
                      masked ? mask_slot : nullptr, masked ? mask_words : 0, adjust);
  };
  if (masked && penalized) {
    launch(sample_kernel<true, true>);
  } else if (masked) {
    launch(sample_kernel<true, false>);
  } else if (penalized) {
    launch(sample_kernel<false, true>);
  } else {
    launch(sample_kernel<false, false>);
  }
  if (biased) {
    launch_overlapped(logit_bias_kernel, bias_blocks, kBiasThreads, 0, stream, biased_logits,
                      num_rows, vocab, adjust.bias_indptr, adjust.bias_tokens, adjust.bias_values,
                      adjust.bias_saved, /*undo=*/true);
  }
  return cudaGetLastError();
}

cudaError_t launch_count_tokens(int32_t* counts, int32_t* prompt_seen, int vocab, int num_slots,
                                const int32_t* tokens, const int32_t* slots, int n, bool prompt,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (vocab <= 0 || !counts || !prompt_seen || !tokens || !slots) return cudaErrorInvalidValue;
  constexpr int kCountThreads = 256;
  launch_overlapped(count_tokens_kernel, (n + kCountThreads - 1) / kCountThreads, kCountThreads, 0,
                    stream, counts, reinterpret_cast<uint32_t*>(prompt_seen), vocab, num_slots,
                    tokens, slots, n, prompt);
  return cudaGetLastError();
}

cudaError_t launch_sampled_logprobs(const float* logits, int num_rows, int vocab,
                                    const int32_t* tokens, const int32_t* top_k, int max_top,
                                    float* logprob, int32_t* top_ids, float* top_logprobs,
                                    cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  if (vocab <= 0 || max_top <= 0) return cudaErrorInvalidValue;
  launch_overlapped(sampled_logprobs_kernel, num_rows, kThreads, 0, stream, logits, vocab, tokens,
                    top_k, max_top, logprob, top_ids, top_logprobs);
  return cudaGetLastError();
}

}  // namespace pagedlm::cuda
