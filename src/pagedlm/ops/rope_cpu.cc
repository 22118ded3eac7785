#include <cmath>
#include <numbers>
#include <vector>

#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/rope.h"

namespace pagedlm::ops {

std::vector<float> rope_inv_freq(const ModelConfig& config) {
  const int64_t dim = config.head_dim;
  PAGEDLM_CHECK(dim > 0 && dim % 2 == 0, "rope_inv_freq: head_dim ", dim,
                " must be positive and even");
  PAGEDLM_CHECK(config.rope_theta > 0.f, "rope_inv_freq: rope_theta ", config.rope_theta,
                " must be positive");
  // HF: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), every step in float32.
  std::vector<float> inv_freq(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv_freq[i] = 1.f / std::pow(config.rope_theta, exponent);
  }
  switch (config.rope_scaling) {
    case RopeScaling::kNone:
      break;
    case RopeScaling::kLinear:
      PAGEDLM_CHECK(config.rope_factor > 0.f, "rope_inv_freq: linear rope factor ",
                    config.rope_factor, " must be positive");
      for (float& f : inv_freq) f /= config.rope_factor;
      break;
    case RopeScaling::kLlama3: {
      const float factor = config.rope_factor;
      const float low = config.rope_low_freq_factor;
      const float high = config.rope_high_freq_factor;
      const float old_context = static_cast<float>(config.rope_original_max_position);
      PAGEDLM_CHECK(factor > 0.f && high > low && old_context > 0.f,
                    "rope_inv_freq: bad llama3 rope scaling (factor ", factor, ", low_freq_factor ",
                    low, ", high_freq_factor ", high, ", original_max_position_embeddings ",
                    config.rope_original_max_position, ")");
      // Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept,
      // and the band between them interpolated smoothly (HF `_compute_llama3_parameters`).
      const float low_freq_wavelen = old_context / low;
      const float high_freq_wavelen = old_context / high;
      const float two_pi = static_cast<float>(2.0 * std::numbers::pi);
      for (float& f : inv_freq) {
        // torch evaluates `scalar / tensor` as reciprocal(tensor) * scalar; mirrored so the band
        // edges round the same way.
        const float wavelen = (1.f / f) * two_pi;
        if (wavelen > low_freq_wavelen) {
          f = f / factor;
        } else if (!(wavelen < high_freq_wavelen)) {
          const float smooth = ((1.f / wavelen) * old_context - low) / (high - low);
          f = (1.f - smooth) * f / factor + smooth * f;
        }
      }
      break;
    }
  }
  return inv_freq;
}

namespace cpu {
namespace {

inline void rotate_heads(float* x, int64_t n_heads, int64_t head_dim, const float* cos_v,
                         const float* sin_v) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * cos_v[i] - x2 * sin_v[i];
      v[i + half] = x2 * cos_v[i] + x1 * sin_v[i];
    }
  }
}

}  // namespace

void rope(float* q, float* k, const int32_t* positions, const float* inv_freq, int64_t n_tokens,
          int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel
  {
    // The angles of one token are shared by all its q and k heads.
    std::vector<float> cos_v(half), sin_v(half);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float pos = static_cast<float>(positions[t]);
      for (int64_t i = 0; i < half; ++i) {
        const float angle = pos * inv_freq[i];
        cos_v[i] = std::cos(angle);
        sin_v[i] = std::sin(angle);
      }
      rotate_heads(q + t * n_q_heads * head_dim, n_q_heads, head_dim, cos_v.data(), sin_v.data());
      rotate_heads(k + t * n_kv_heads * head_dim, n_kv_heads, head_dim, cos_v.data(), sin_v.data());
    }
  }
}

}  // namespace cpu

void rope(const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& inv_freq) {
  using detail::kAnyDim;
  constexpr const char* kOp = "rope";
  detail::expect_device(q, Device::kCpu, kOp, "q");
  detail::expect(q, kOp, "q", DType::kF32, {kAnyDim, kAnyDim, kAnyDim});
  const int64_t n_tokens = q.dim(0), n_q_heads = q.dim(1), head_dim = q.dim(2);
  PAGEDLM_CHECK(head_dim % 2 == 0, kOp, ": head_dim ", head_dim, " of q must be even");
  detail::expect(k, kOp, "k", DType::kF32, {n_tokens, kAnyDim, head_dim});
  detail::expect(positions, kOp, "positions", DType::kI32, {n_tokens});
  detail::expect(inv_freq, kOp, "inv_freq", DType::kF32, {head_dim / 2});
  detail::expect_devices(kOp, Device::kCpu,
                         {{&k, "k"}, {&positions, "positions"}, {&inv_freq, "inv_freq"}});
  cpu::rope(q.data<float>(), k.data<float>(), positions.data<int32_t>(), inv_freq.data<float>(),
            n_tokens, n_q_heads, k.dim(1), head_dim);
}

}  // namespace pagedlm::ops
