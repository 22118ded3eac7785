// exp(x) for the CPU kernels' hot loops (attention's softmax, SiLU) in a form the compiler
// vectorizes: std::exp is an opaque libm call per element (~2 ns on a 2-core x86-64 VM), this
// is ~0.2 ns per element in an AVX2 loop. Range reduction x = n ln2 + r (ln2 in two parts),
// exp(r) by a degree-7 polynomial (the Cephes single-precision coefficients), 2^n put into the
// exponent bits. Largest relative error against double exp over [-87, 88]: below 1e-7 (tested);
// below -87.34 it returns 0 (exp(-inf) = 0, which the online softmax relies on) and above 88.37
// infinity (float overflows at 88.72; no caller needs that last bit of range, and 2^n stays a
// normal float). NaN inputs are not expected (they would give a finite result).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace pagedlm::ops::cpu {

inline float exp_vectorizable(float x) {
  constexpr float kLowest = -87.33654f, kHighest = 88.37626f;
  const float xc = x < kLowest ? kLowest : (x > kHighest ? kHighest : x);
  const float n = std::nearbyint(xc * 1.44269504088896341f);  // round(x / ln2)
  float r = xc - n * 0.693359375f;                            // ln2's leading bits, exact
  r -= n * -2.12194440e-4f;                                   // and the rest of ln2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float y = p * scale;
  return x < kLowest ? 0.f : (x > kHighest ? std::numeric_limits<float>::infinity() : y);
}

}  // namespace pagedlm::ops::cpu
