// Sampling on the GPU, one block per row of logits. Filters become one logit threshold:
// top-k and top-p thresholds are found by radix selection over order-preserving float keys
// (4 passes of 8-bit digits: counts for top-k, probability mass for top-p), so nothing is
// sorted and no scratch memory is needed. The draw is an inverse-CDF walk in token order with a
// counter-based uniform (splitmix64), reproducible per request whatever the batch holds.

#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>

#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kBins = 256;

using detail::splitmix64;

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

// logits: [num_rows, vocab] f32; out_tokens: [num_rows]; grid: num_rows blocks of kThreads.
// kMasked: rows may have token masks (mask_slot); the unmasked instantiation, which steps
// without structured output take, reads the logits alone.
template <bool kMasked>
__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* logits, int vocab, const float* temperature, const int32_t* top_k,
                  const float* top_p, const float* min_p, const uint64_t* seed, const int64_t* step,
                  int32_t* out_tokens, const int32_t* masks, const int32_t* mask_slot,
                  int mask_words) {
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
  // Token i's logit, -inf where the row's grammar forbids it.
  const auto x = [&](int i) {
    if (!kMasked) return row_logits[i];
    return (!row_mask || ((row_mask[i >> 5] >> (i & 31)) & 1u)) ? row_logits[i] : -INFINITY;
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
    // Warp then block argmax with the lowest index on ties.
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (ob > best || (ob == best && oi < best_i)) {
        best = ob;
        best_i = oi;
      }
    }
    __shared__ float wb[32];
    __shared__ int wi[32];
    if ((tid & 31) == 0) {
      wb[tid >> 5] = best;
      wi[tid >> 5] = best_i;
    }
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < kThreads / 32; ++w) {
        if (wb[w] > best || (wb[w] == best && wi[w] < best_i)) {
          best = wb[w];
          best_i = wi[w];
        }
      }
      out_tokens[row] = best_i < vocab ? best_i : 0;
    }
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

}  // namespace

double sampling_uniform(uint64_t seed, int64_t step) { return uniform01(seed, step); }

cudaError_t launch_sample(const float* logits, int num_rows, int vocab, const float* temperature,
                          const int32_t* top_k, const float* top_p, const float* min_p,
                          const uint64_t* seed, const int64_t* step, int32_t* out_tokens,
                          cudaStream_t stream, const int32_t* mask, const int32_t* mask_slot,
                          int mask_words) {
  if (num_rows <= 0) return cudaSuccess;
  if (vocab <= 0) return cudaErrorInvalidValue;
  if (mask != nullptr && mask_slot != nullptr) {
    sample_kernel<true><<<num_rows, kThreads, 0, stream>>>(logits, vocab, temperature, top_k, top_p,
                                                           min_p, seed, step, out_tokens, mask,
                                                           mask_slot, mask_words);
  } else {
    sample_kernel<false><<<num_rows, kThreads, 0, stream>>>(logits, vocab, temperature, top_k,
                                                            top_p, min_p, seed, step, out_tokens,
                                                            nullptr, nullptr, 0);
  }
  return cudaGetLastError();
}

}  // namespace pagedlm::cuda
