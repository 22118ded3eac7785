// Helpers shared by the CPU op tests: random data, poisoned outputs, expected errors.
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
