// Activations rounded to 8 bits as ggml rounds them, for tests of the kernels that take them (the
// CPU's 8-bit mode, the GPU's one-row Q4_K kernel), and to two 8-bit planes (the GPU's several-row
// K-quant kernels): host C++17 alone, so that CUDA tests include
// it too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace pagedlm::testing {

// ggml's quantization of one block of x to 8 bits (32 values, or q8_K's 256): d = max |x| / 127,
// q = x * (1 / d) rounded to nearest with ties to even, zeros where max |x| is 0; the
// activations of the CPU's 8-bit mode and of the GPU's one-row Q4_K kernel.
struct XBlock {
  int32_t q[256];
  float d;
  int32_t sum;
};
inline XBlock quantize_block(const float* x, int64_t block = 32) {
  XBlock out{};
  float amax = 0.f;
  for (int64_t k = 0; k < block; ++k) amax = std::max(amax, std::fabs(x[k]));
  out.d = amax / 127.f;
  const float id = out.d != 0.f ? 1.f / out.d : 0.f;
  for (int64_t k = 0; k < block; ++k) {
    out.q[k] = static_cast<int32_t>(std::nearbyint(x[k] * id));
    out.sum += out.q[k];
  }
  return out;
}

// x with each block of 32 replaced by its 8-bit values times d.
inline std::vector<float> rounded_to_q8(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (size_t b = 0; b + 32 <= x.size(); b += 32) {
    const XBlock q = quantize_block(x.data() + b);
    for (int k = 0; k < 32; ++k) out[b + k] = static_cast<float>(q.q[k]) * q.d;
  }
  return out;
}

// The GPU's several-row K-quant kernels take x in two 8-bit planes (ops::stage_rows): per 32,
// with d and 1 / d as quantize_block's, p = x * (1 / d) rounded to float, hi = p to nearest even,
// lo = (p - hi) * 128 to nearest even; x is taken as unit (128 hi + lo), unit = d / 128.
struct TwoPlaneBlock {
  int32_t units[32];  // 128 hi + lo
  float unit;
};
inline TwoPlaneBlock quantize_two_planes(const float* x) {
  TwoPlaneBlock out{};
  float amax = 0.f;
  for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  for (int k = 0; k < 32; ++k) {
    // The float product, rounded once (a double holds the product of two floats exactly).
    const auto p = static_cast<float>(static_cast<double>(x[k]) * static_cast<double>(id));
    const double hi = std::nearbyint(static_cast<double>(p));
    const double lo = std::nearbyint((static_cast<double>(p) - hi) * 128.0);
    out.units[k] = static_cast<int32_t>(128.0 * hi + lo);
  }
  out.unit = d / 128.f;
  return out;
}

// x with each block of 32 replaced by its two planes' value, unit (128 hi + lo), in double.
inline std::vector<double> rounded_to_two_planes(const std::vector<float>& x) {
  std::vector<double> out(x.size());
  for (size_t b = 0; b + 32 <= x.size(); b += 32) {
    const TwoPlaneBlock q = quantize_two_planes(x.data() + b);
    for (int k = 0; k < 32; ++k) out[b + k] = static_cast<double>(q.unit) * q.units[k];
  }
  return out;
}

}  // namespace pagedlm::testing
