// exp(x) for the CPU kernels' hot loops (attention's softmax, SiLU) in a form the compiler
// vectorizes: std::exp is an opaque libm call per element (~2 ns on a 2-core x86-64 VM), this
// is ~0.2 ns per element in a vector loop (GCC 12 vectorizes it for AVX-512 only; exp_avx2 below
// is the AVX2 form). Range reduction x = n ln2 + r (ln2 in two parts),
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pagedlm::ops::cpu {

namespace exp_constants {
constexpr float kLowest = -87.33654f, kHighest = 88.37626f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;     // ln2's leading bits: n * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;  // ln2 - kLn2Hi
constexpr float kPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_constants

inline float exp_vectorizable(float x) {
  using namespace exp_constants;
  const float xc = x < kLowest ? kLowest : (x > kHighest ? kHighest : x);
  const float n = std::nearbyint(xc * kLog2e);  // round(x / ln2)
  float r = xc - n * kLn2Hi;
  r -= n * kLn2Lo;
  float p = kPoly[0];
  p = p * r + kPoly[1];
  p = p * r + kPoly[2];
  p = p * r + kPoly[3];
  p = p * r + kPoly[4];
  p = p * r + kPoly[5];
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float y = p * scale;
  return x < kLowest ? 0.f : (x > kHighest ? std::numeric_limits<float>::infinity() : y);
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_vectorizable's steps for 8 floats in AVX2 intrinsics, every product and addition written
// out (fused where exp_vectorizable's loops on AVX-512 fuse them). GCC 12 does not vectorize
// exp_vectorizable for AVX2 (without masked stores, partial redundancy elimination folds the
// clamped inputs' branches into constants and the branches left cannot become selects, since a
// multiplication may trap), so AVX2 loops that need exp fast call this.
inline __m256 exp_avx2(__m256 x) {
  using namespace exp_constants;
  const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(kLowest), _CMP_LT_OQ);
  const __m256 above = _mm256_cmp_ps(x, _mm256_set1_ps(kHighest), _CMP_GT_OQ);
  const __m256 xc = _mm256_blendv_ps(_mm256_blendv_ps(x, _mm256_set1_ps(kHighest), above),
                                     _mm256_set1_ps(kLowest), below);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_blendv_ps(
      _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()), above),
      _mm256_setzero_ps(), below);
}
#endif

}  // namespace pagedlm::ops::cpu
