// The K-quant arithmetic of the GPU's matrix-vector kernels (ops/cuda/kquant_lanes.cuh), run on
// the host: Q6_K's eight lanes, and Q4_K's tensor-core tile on an emulated warp, must give the
// dot products of the blocks' weights, as the reference dequantization (core/quantized.h,
// ggml's arithmetic) gives them, with bf16 activations. Needs no GPU: the index arithmetic is what
// this checks, on every machine that builds the CUDA backend; backend_ops_test runs the kernel
// itself on a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/ops/cuda/kquant_lanes.cuh"

namespace pagedlm::ops::cuda {
namespace {

// count blocks of `bytes` bytes each, random, with a finite f16 scale at each of `scale_at` (the
// offsets of d, and of dmin where the format has one) so that no weight is inf or NaN. 16-byte
// aligned, as the kernels' loads need.
std::vector<uint4> random_blocks(std::mt19937& rng, int count, int bytes,
                                 std::initializer_list<int> scale_at) {
  std::vector<uint4> storage((static_cast<size_t>(bytes) * count + 15) / 16);
  auto* blocks = reinterpret_cast<uint8_t*>(storage.data());
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (size_t i = 0; i < static_cast<size_t>(bytes) * count; ++i) {
    blocks[i] = static_cast<uint8_t>(byte(rng));
  }
  for (int b = 0; b < count; ++b) {
    for (int at : scale_at) {
      const __half h = __float2half(0.01f + 0.05f * std::abs(uniform(rng)));
      std::memcpy(blocks + static_cast<size_t>(b) * bytes + at, &h, sizeof(h));
    }
  }
  return storage;
}

// got against the dot product of one row's num_blocks blocks of `type` (the reference
// dequantization) with x: f32 sums over k terms in another order, so within a few f32 ulps of
// the terms' magnitude.
void expect_reference_dot(QuantType type, const uint8_t* row_blocks, int num_blocks, const bf16* x,
                          float got, const std::string& what) {
  const int bytes = static_cast<int>(quant_block_bytes(type)), k = 256 * num_blocks;
  std::vector<float> w(k);
  for (int b = 0; b < num_blocks; ++b) {
    quant_format(type).dequantize_block(row_blocks + static_cast<size_t>(b) * bytes,
                                        w.data() + 256 * b);
  }
  double want = 0, magnitude = 0;  // the sum in double, and the sum of |terms|
  for (int i = 0; i < k; ++i) {
    const double term = double{w[i]} * __bfloat162float(x[i]);
    want += term;
    magnitude += std::abs(term);
  }
  EXPECT_LE(std::abs(got - want), 1e-5 * magnitude) << what;
}

void expect_q6k_lanes_match_reference(int num_blocks, std::mt19937& rng) {
  constexpr int kRows = 3;
  const int bytes = static_cast<int>(quant_block_bytes(QuantType::kQ6_K)), k = 256 * num_blocks;
  const std::vector<uint4> storage = random_blocks(rng, num_blocks, bytes, {208});
  const auto* blocks = reinterpret_cast<const uint8_t*>(storage.data());
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::vector<bf16> x(kRows * k);
  for (bf16& v : x) v = __float2bfloat16(uniform(rng));
  float acc[kRows] = {};
  for (int b = 0; b < num_blocks; ++b) {
    for (int part = 0; part < 8; ++part) {
      Q6kLane::load(blocks + b * bytes, part).dot<kRows>(part, x.data(), k, 256 * b, acc);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    expect_reference_dot(QuantType::kQ6_K, blocks, num_blocks, x.data() + r * k, acc[r],
                         std::to_string(num_blocks) + " blocks, row " + std::to_string(r));
  }
}

TEST(KquantLanes, Q6kMatchesReferenceWeights) {
  std::mt19937 rng(12);
  for (int num_blocks : {1, 3, 18}) {
    expect_q6k_lanes_match_reference(num_blocks, rng);
  }
}

// The tensor-core tile (Q4kMmaTile, with x staged as Q4kStagedX lays it out) on an emulated warp:
// every lane's fragments go through mma.sync m16n8k16's documented layout (PTX ISA, "Matrix
// fragments for mma.m16n8k16": a0..a7 of row groupID (+8 for a2, a3, a6, a7) at column 2 threadID +
// (i & 1)
// (+8 for a4..a7); b0..b3 of column groupID at row 2 threadID + (i & 1) (+8 for b2, b3); c0..c3 of
// row groupID (+8 for c2, c3) at column 2 threadID + (i & 1)), written here from that text, not
// from the tile's code. 16 rows of 3 and 18 blocks, one row of x, against the reference weights.
float bf16_bits(uint32_t word, int half) {
  const uint32_t bits = half == 0 ? word << 16 : word & 0xffff0000u;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

TEST(KquantLanes, Q4kMmaTileMatchesReferenceWeights) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  constexpr int kRows = 16, kBytes = 144;
  for (int num_blocks : {1, 3, 18}) {
    const int k = 256 * num_blocks;
    const std::vector<uint4> storage = random_blocks(rng, num_blocks * kRows, kBytes, {0, 2});
    const auto* blocks = reinterpret_cast<const uint8_t*>(storage.data());
    std::vector<bf16> x(k);
    for (bf16& v : x) v = __float2bfloat16(uniform(rng));
    std::vector<uint32_t> staged(static_cast<size_t>(k / 32) * Q4kStagedX::kWords);
    for (int s = 0; s < k / 32; ++s) {
      Q4kStagedX::stage(x.data() + 32 * s, staged.data() + Q4kStagedX::kWords * s);
    }
    float acc[32][2] = {};
    for (int b = 0; b < num_blocks; ++b) {
      Q4kMmaTile tiles[32];
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const uint8_t* row_g = blocks + (static_cast<size_t>(g) * num_blocks + b) * kBytes;
        const uint8_t* row_g8 = blocks + (static_cast<size_t>(g + 8) * num_blocks + b) * kBytes;
        tiles[lane] = Q4kMmaTile::load(row_g, row_g8, t);
      }
      // C as the whole 16 x 8 matrix over the sixteen mmas, and the sum of each column of B
      // (sub-block n's sum(x), which the staged sums must equal).
      double c[16][8] = {}, column_sums[8] = {};
      for (int i = 0; i < 16; ++i) {
        float a[16][16], bm[16][8];
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          uint32_t ar[4], br[2], first[2], second[2];
          tiles[lane].a_fragment(i, ar);
          Q4kStagedX::b_fragments(staged.data(), b, g, t, i % 8, first, second);
          br[0] = i < 8 ? first[0] : second[0];
          br[1] = i < 8 ? first[1] : second[1];
          for (int e = 0; e < 8; ++e) {  // a_e: register e / 2, half e % 2
            const int row = g + ((e / 2) % 2 == 1 ? 8 : 0), col = 2 * t + e % 2 + (e >= 4 ? 8 : 0);
            a[row][col] = bf16_bits(ar[e / 2], e % 2);
          }
          for (int e = 0; e < 4; ++e) {
            bm[2 * t + e % 2 + (e >= 2 ? 8 : 0)][g] = bf16_bits(br[e / 2], e % 2);
          }
        }
        for (int col = 0; col < 8; ++col) {
          for (int kk = 0; kk < 16; ++kk) {
            column_sums[col] += bm[kk][col];
            for (int row = 0; row < 16; ++row) c[row][col] += double{a[row][kk]} * bm[kk][col];
          }
        }
      }
      for (int col = 0; col < 8; ++col) {
        float sx[2];
        Q4kStagedX::sums(staged.data(), b, col / 2, sx);
        EXPECT_NEAR(sx[col % 2], column_sums[col], 1e-5 * 32)
            << "block " << b << ", sub-block " << col;
      }
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const float cl[4] = {static_cast<float>(c[g][2 * t]), static_cast<float>(c[g][2 * t + 1]),
                             static_cast<float>(c[g + 8][2 * t]),
                             static_cast<float>(c[g + 8][2 * t + 1])};
        float sx[2];
        Q4kStagedX::sums(staged.data(), b, t, sx);
        tiles[lane].accumulate(t, cl, sx, acc[lane]);
      }
    }
    for (int row = 0; row < kRows; ++row) {
      float got = 0.f;  // the four lanes of the row's group
      for (int t = 0; t < 4; ++t) got += acc[4 * (row % 8) + t][row / 8];
      expect_reference_dot(
          QuantType::kQ4_K, blocks + static_cast<size_t>(row) * num_blocks * kBytes, num_blocks,
          x.data(), got, std::to_string(num_blocks) + " blocks, row " + std::to_string(row));
    }
  }
}

}  // namespace
}  // namespace pagedlm::ops::cuda
