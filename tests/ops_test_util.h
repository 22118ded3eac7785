// Helpers shared by the op tests: random data, poisoned outputs, float32-scale comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::testing {

// Uniform in [lo, hi) with |x| >= 1e-3, so no element is (near) zero and a missed write or a
// dropped term cannot hide behind a zero.
inline Tensor random_f32(const Shape& shape, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  Tensor t = Tensor::empty(DType::kF32, shape);
  std::uniform_real_distribution<float> dist(lo, hi);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    float x;
    do {
      x = dist(rng);
    } while (std::abs(x) < 1e-3f);
    p[i] = x;
  }
  return t;
}

// An output buffer full of NaN: any element the op forgets to write fails the comparison.
inline Tensor poisoned_f32(const Shape& shape) {
  Tensor t = Tensor::empty(DType::kF32, shape);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = std::numeric_limits<float>::quiet_NaN();
  return t;
}

// Expects every element of `got` to be finite and ||got - want|| / ||want|| < tol.
inline void expect_close(const Tensor& got, const std::vector<double>& want, double tol,
                         const std::string& what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  const float* g = got.data<float>();
  double diff = 0.0, norm = 0.0;
  int64_t not_finite = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(g[i])) {
      ++not_finite;
      continue;
    }
    diff += (g[i] - want[i]) * (g[i] - want[i]);
    norm += want[i] * want[i];
  }
  EXPECT_EQ(not_finite, 0) << what << ": elements not written or not finite";
  ASSERT_GT(norm, 0.0) << what;
  EXPECT_LT(std::sqrt(diff / norm), tol) << what;
}

// Expects `fn` to throw a pagedlm::Error whose message contains every one of `parts`.
template <typename Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& part : parts) {
      EXPECT_NE(msg.find(part), std::string::npos) << "'" << msg << "' lacks '" << part << "'";
    }
    return;
  }
  ADD_FAILURE() << "no pagedlm::Error thrown";
}

}  // namespace pagedlm::testing
