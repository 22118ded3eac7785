// The K-quant lane policies of the GPU's matrix-vector kernel (ops/cuda/kquant_lanes.cuh), run
// on the host: a block's eight lanes together must give the dot product of the block's weights,
// as the reference dequantization (core/quantized.h, ggml's arithmetic) gives them, with rows of
// bf16 activations. Needs no GPU: the index arithmetic is what this checks, on every machine that
// builds the CUDA backend; backend_ops_test runs the kernel itself on a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/ops/cuda/kquant_lanes.cuh"

namespace pagedlm::ops::cuda {
namespace {

template <typename Lane>
void expect_lanes_match_reference(QuantType type, int num_blocks, std::mt19937& rng) {
  constexpr int kRows = 3;
  const int bytes = static_cast<int>(quant_block_bytes(type)), k = 256 * num_blocks;
  // 16-byte aligned, as the kernel asks of Q4_K's matrices.
  std::vector<uint4> storage((static_cast<size_t>(bytes) * num_blocks + 15) / 16);
  auto* blocks = reinterpret_cast<uint8_t*>(storage.data());
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (int i = 0; i < bytes * num_blocks; ++i) blocks[i] = static_cast<uint8_t>(byte(rng));
  for (int b = 0; b < num_blocks; ++b) {  // finite f16 scales: d and dmin, or Q6_K's d
    for (int at : type == QuantType::kQ4_K ? std::vector<int>{0, 2} : std::vector<int>{208}) {
      const __half h = __float2half(0.01f + 0.05f * std::abs(uniform(rng)));
      std::memcpy(blocks + b * bytes + at, &h, sizeof(h));
    }
  }
  std::vector<bf16> x(kRows * k);
  for (bf16& v : x) v = __float2bfloat16(uniform(rng));
  std::vector<float> w(k);
  for (int b = 0; b < num_blocks; ++b) {
    quant_format(type).dequantize_block(blocks + b * bytes, w.data() + 256 * b);
  }
  float acc[kRows] = {};
  for (int b = 0; b < num_blocks; ++b) {
    for (int part = 0; part < 8; ++part) {
      Lane::load(blocks + b * bytes, part).template dot<kRows>(part, x.data(), k, 256 * b, acc);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    double want = 0, magnitude = 0;  // the sum in double, and the sum of |terms|
    for (int i = 0; i < k; ++i) {
      const double term = double{w[i]} * __bfloat162float(x[r * k + i]);
      want += term;
      magnitude += std::abs(term);
    }
    // f32 sums over k terms in another order: a few f32 ulps of the terms' magnitude.
    EXPECT_LE(std::abs(acc[r] - want), 1e-5 * magnitude)
        << quant_format(type).name << ", " << num_blocks << " blocks, row " << r;
  }
}

TEST(KquantLanes, Q4kMatchesReferenceWeights) {
  std::mt19937 rng(11);
  for (int num_blocks : {1, 3, 18}) {
    expect_lanes_match_reference<Q4kLane>(QuantType::kQ4_K, num_blocks, rng);
  }
}

TEST(KquantLanes, Q6kMatchesReferenceWeights) {
  std::mt19937 rng(12);
  for (int num_blocks : {1, 3, 18}) {
    expect_lanes_match_reference<Q6kLane>(QuantType::kQ6_K, num_blocks, rng);
  }
}

}  // namespace
}  // namespace pagedlm::ops::cuda
