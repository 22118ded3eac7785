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
#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/io/gguf.h"
#include "q8_rounding.h"

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

// Where a ggml block keeps its f16 scales (d, and m or dmin), in bytes from its start.
inline std::vector<int> f16_scale_offsets(QuantType type) {
  switch (type) {
    case QuantType::kQ4_1:
    case QuantType::kQ5_1:
    case QuantType::kQ4_K:
    case QuantType::kQ5_K:
      return {0, 2};
    case QuantType::kQ6_K:
      return {208};
    case QuantType::kQ3_K:
      return {108};
    case QuantType::kQ2_K:
      return {80, 82};
    default:
      return {0};
  }
}

// Random ggml blocks: f16 scales of either sign and magnitude 1e-3..1e-1, random quants (and
// random K-quant sub-block scales).
inline QuantizedMatrix random_blocks(QuantType type, int64_t rows, int64_t cols,
                                     std::mt19937& rng) {
  QuantizedMatrix q;
  q.type = type;
  q.rows = rows;
  q.cols = cols;
  q.blocks.resize(rows * q.row_bytes());
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(1e-3f, 1e-1f);
  const int64_t block_bytes = quant_block_bytes(type);
  for (size_t at = 0; at < q.blocks.size(); at += block_bytes) {
    for (int64_t i = 0; i < block_bytes; ++i) q.blocks[at + i] = static_cast<uint8_t>(byte(rng));
    for (int offset : f16_scale_offsets(type)) {
      const uint16_t h = f32_to_f16((byte(rng) % 2 ? 1.f : -1.f) * scale(rng));
      q.blocks[at + offset] = static_cast<uint8_t>(h & 0xff);
      q.blocks[at + offset + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
  return q;
}

// The weights the blocks stand for, expanded by the format's reference dequantization.
inline std::vector<float> dequantized(const QuantizedMatrix& q) {
  std::vector<float> w(q.rows * q.cols);
  for (int64_t r = 0; r < q.rows; ++r) dequantize_row(q, r, w.data() + r * q.cols);
  return w;
}

}  // namespace pagedlm::testing
