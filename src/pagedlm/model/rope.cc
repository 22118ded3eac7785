#include "pagedlm/model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "pagedlm/core/error.h"

namespace pagedlm {

std::vector<float> rope_inv_freq(const RopeSpec& spec, int64_t head_dim) {
  const int64_t dim = head_dim;
  PAGEDLM_CHECK(dim > 0 && dim % 2 == 0, "rope_inv_freq: head_dim ", dim,
                " must be positive and even");
  PAGEDLM_CHECK(spec.theta > 0.f, "rope_inv_freq: rope_theta ", spec.theta, " must be positive");
  // HF: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), every step in float32.
  std::vector<float> inv_freq(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv_freq[i] = 1.f / std::pow(spec.theta, exponent);
  }
  switch (spec.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kLinear:
      PAGEDLM_CHECK(spec.factor > 0.f, "rope_inv_freq: linear rope factor ", spec.factor,
                    " must be positive");
      for (float& f : inv_freq) f /= spec.factor;
      break;
    case RopeType::kLlama3: {
      const float factor = spec.factor;
      const float low = spec.low_freq_factor;
      const float high = spec.high_freq_factor;
      const float old_context = static_cast<float>(spec.original_max_position);
      PAGEDLM_CHECK(factor > 0.f && high > low && old_context > 0.f,
                    "rope_inv_freq: bad llama3 rope scaling (factor ", factor, ", low_freq_factor ",
                    low, ", high_freq_factor ", high, ", original_max_position_embeddings ",
                    spec.original_max_position, ")");
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
    case RopeType::kYarn: {
      // Frequencies that turn fewer than beta_slow times over the original context are
      // interpolated (divided by the factor), those turning more than beta_fast times kept, and
      // a linear ramp over the dimensions between blends the two.
      const double base = spec.theta;
      const double old_context = static_cast<double>(spec.original_max_position);
      PAGEDLM_CHECK(
          spec.factor > 0.f && old_context > 0 && spec.beta_fast > 0.f && spec.beta_slow > 0.f,
          "rope_inv_freq: bad yarn rope scaling (factor ", spec.factor,
          ", original_max_position_embeddings ", spec.original_max_position, ", beta_fast ",
          spec.beta_fast, ", beta_slow ", spec.beta_slow, ")");
      // HF's find_correction_dim, in Python floats (double).
      const auto correction_dim = [&](double rotations) {
        return static_cast<double>(dim) *
               std::log(old_context / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
      };
      double low = correction_dim(spec.beta_fast), high = correction_dim(spec.beta_slow);
      if (spec.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(dim - 1));
      if (low == high) high += 0.001;  // HF: prevents a division by zero
      for (int64_t i = 0; i < dim / 2; ++i) {
        // torch: (arange(dim // 2, float32) - low) / (high - low), clamped, all in float32.
        const float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) /
                                          (static_cast<float>(high) - static_cast<float>(low)),
                                      0.f, 1.f);
        const float extrapolation_factor = 1.f - ramp;
        // HF's pos_freqs: theta^(2i/dim) in float32.
        const float pos_freq =
            std::pow(spec.theta, static_cast<float>(2 * i) / static_cast<float>(dim));
        const float interpolation = 1.f / (spec.factor * pos_freq);
        const float extrapolation = 1.f / pos_freq;
        inv_freq[i] =
            interpolation * (1.f - extrapolation_factor) + extrapolation * extrapolation_factor;
      }
      break;
    }
  }
  return inv_freq;
}

float yarn_attention_factor(float factor) {
  return factor <= 1.f ? 1.f
                       : static_cast<float>(0.1 * std::log(static_cast<double>(factor)) + 1.0);
}

}  // namespace pagedlm
