// The K-quant arithmetic of the GPU's matrix-vector kernels (ops/cuda/kquant_lanes.cuh), run on
// the host: Q6_K's eight lanes must give the dot products of the blocks' weights, as the reference
// dequantization (core/quantized.h, ggml's arithmetic) gives them, with bf16 activations, and
// Q4_K's tensor-core tile on an emulated warp those with the activations rounded to 8 bits per
// 32 values as llama.cpp rounds them. Needs no GPU: the index arithmetic is what
// this checks, on every machine that builds the CUDA backend; backend_ops_test runs the kernel
// itself on a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/ops/cuda/kquant_lanes.cuh"
#include "q8_rounding.h"

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
void expect_reference_dot(QuantType type, const uint8_t* row_blocks, int num_blocks,
                          const std::vector<double>& x, float got, const std::string& what) {
  const int bytes = static_cast<int>(quant_block_bytes(type)), k = 256 * num_blocks;
  std::vector<float> w(k);
  for (int b = 0; b < num_blocks; ++b) {
    quant_format(type).dequantize_block(row_blocks + static_cast<size_t>(b) * bytes,
                                        w.data() + 256 * b);
  }
  double want = 0, magnitude = 0;  // the sum in double, and the sum of |terms|
  for (int i = 0; i < k; ++i) {
    const double term = double{w[i]} * x[i];
    want += term;
    magnitude += std::abs(term);
  }
  EXPECT_LE(std::abs(got - want), 1e-5 * magnitude) << what;
}

std::vector<double> values(const bf16* x, int k) {
  std::vector<double> v(k);
  for (int i = 0; i < k; ++i) v[i] = __bfloat162float(x[i]);
  return v;
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
    expect_reference_dot(QuantType::kQ6_K, blocks, num_blocks, values(x.data() + r * k, k), acc[r],
                         std::to_string(num_blocks) + " blocks, row " + std::to_string(r));
  }
}

TEST(KquantLanes, Q6kMatchesReferenceWeights) {
  std::mt19937 rng(12);
  for (int num_blocks : {1, 3, 18}) {
    expect_q6k_lanes_match_reference(num_blocks, rng);
  }
}

// A sub-block staged as four lanes of a warp do it (Q4kStagedX::stage_quarter), its two shuffles
// (the quarters' largest |x|, then their sums) as loops over the lanes.
void stage_by_quarters(const bf16* xs, uint32_t* sub_block) {
  float v[4][8], amax = 0.f;
  for (int q = 0; q < 4; ++q) {
    amax = std::max(amax, Q4kStagedX::quarter_values(load16(xs + 8 * q), v[q]));
  }
  const float dx = Q4kStagedX::step(amax);
  int sum = 0;
  uint2 words[4];
  for (int q = 0; q < 4; ++q) words[q] = Q4kStagedX::round_quarter(v[q], dx, sum);
  for (int q = 0; q < 4; ++q) Q4kStagedX::put_quarter(words[q], dx, sum, sub_block, q);
}

// The tensor-core tile (Q4kMmaTile, with x staged by Q4kStagedX's quarters) on an emulated warp:
// every lane's fragments go through mma.sync m16n8k32's documented layout for .s8 (PTX ISA, "Matrix
// fragments for mma.m16n8k32": A's registers a0..a3 hold 4 int8 each, of row groupID (+8 for a1,
// a3) at columns 4 threadID .. + 3 (+16 for a2, a3); B's b0, b1 of column groupID at rows
// 4 threadID .. + 3 (+16 for b1); c0..c3 of row groupID (+8 for c2, c3) at column 2 threadID + (i
// & 1)), written here from that text, not from the tile's code. 16 rows of 1, 3 and 18 blocks,
// one row of x (one sub-block of zeros): the staged values are x's 8-bit rounding, and the
// tile's sums are the dot products of the reference weights with those rounded values.
int8_t byte_at(uint32_t word, int e) { return static_cast<int8_t>((word >> (8 * e)) & 0xffu); }

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
    for (int i = 32; i < 64 && i < k; ++i) x[i] = __float2bfloat16(0.f);  // a zero sub-block
    std::vector<uint32_t> staged(static_cast<size_t>(k / 32) * Q4kStagedX::kWords);
    for (int s = 0; s < k / 32; ++s) {
      stage_by_quarters(x.data() + 32 * s, staged.data() + Q4kStagedX::kWords * s);
    }
    // x's 8-bit rounding, by q8_rounding.h's statement of ggml's rule.
    std::vector<testing::XBlock> rounded(k / 32);
    std::vector<double> x_rounded(k);
    for (int s = 0; s < k / 32; ++s) {
      float xs[32];
      for (int i = 0; i < 32; ++i) xs[i] = __bfloat162float(x[32 * s + i]);
      rounded[s] = testing::quantize_block(xs);
      for (int i = 0; i < 32; ++i) x_rounded[32 * s + i] = double{rounded[s].d} * rounded[s].q[i];
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
      // C as the whole 16 x 8 matrix over the eight mmas, exact in int64; B's columns as the
      // values of x they hold, so that column n's must be sub-block n's rounded values.
      int64_t c[16][8] = {};
      std::vector<int> column_values[8];
      for (int p = 0; p < 4; ++p) {
        for (int h = 0; h < 2; ++h) {
          int a[16][32], bm[32][8];
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane / 4, t = lane % 4;
            uint32_t ar[4], low[2], high[2];
            tiles[lane].a_fragment(h, p, ar);
            Q4kStagedX::b_fragments(staged.data(), b, g, t, p, low, high);
            const uint32_t* br = h == 0 ? low : high;
            for (int r = 0; r < 4; ++r) {
              for (int e = 0; e < 4; ++e) {
                a[g + (r % 2 == 1 ? 8 : 0)][4 * t + e + (r >= 2 ? 16 : 0)] = byte_at(ar[r], e);
              }
            }
            for (int r = 0; r < 2; ++r) {
              for (int e = 0; e < 4; ++e) bm[4 * t + e + (r == 1 ? 16 : 0)][g] = byte_at(br[r], e);
            }
          }
          for (int col = 0; col < 8; ++col) {
            for (int kk = 0; kk < 32; ++kk) {
              for (int row = 0; row < 16; ++row) c[row][col] += int64_t{a[row][kk]} * bm[kk][col];
            }
          }
          // Column n is nonzero only in the mmas of half n % 2, at the k of lane n / 2.
          for (int col = 0; col < 8; ++col) {
            for (int kk = 0; kk < 32; ++kk) {
              if (h == col % 2 && kk % 16 / 4 == col / 2) {
                column_values[col].push_back(bm[kk][col]);
              } else {
                EXPECT_EQ(bm[kk][col], 0) << "block " << b << ", column " << col << ", k " << kk;
              }
            }
          }
        }
      }
      for (int col = 0; col < 8; ++col) {
        const int s = 8 * b + col;
        std::vector<int> want(rounded[s].q, rounded[s].q + 32);
        std::vector<int> got = column_values[col];
        std::sort(got.begin(), got.end());
        std::sort(want.begin(), want.end());
        EXPECT_EQ(got, want) << "block " << b << ", sub-block " << col;
        float dx[2], x_sum[2];
        Q4kStagedX::scales(staged.data(), b, col / 2, dx, x_sum);
        EXPECT_EQ(dx[col % 2], rounded[s].d) << "sub-block " << s;
        EXPECT_EQ(x_sum[col % 2], rounded[s].d * static_cast<float>(rounded[s].sum))
            << "sub-block " << s;
      }
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const int32_t cl[4] = {
            static_cast<int32_t>(c[g][2 * t]), static_cast<int32_t>(c[g][2 * t + 1]),
            static_cast<int32_t>(c[g + 8][2 * t]), static_cast<int32_t>(c[g + 8][2 * t + 1])};
        float dx[2], x_sum[2];
        Q4kStagedX::scales(staged.data(), b, t, dx, x_sum);
        tiles[lane].accumulate(t, cl, dx, x_sum, acc[lane]);
      }
    }
    for (int row = 0; row < kRows; ++row) {
      float got = 0.f;  // the four lanes of the row's group
      for (int t = 0; t < 4; ++t) got += acc[4 * (row % 8) + t][row / 8];
      expect_reference_dot(
          QuantType::kQ4_K, blocks + static_cast<size_t>(row) * num_blocks * kBytes, num_blocks,
          x_rounded, got, std::to_string(num_blocks) + " blocks, row " + std::to_string(row));
    }
  }
}

// Rows of random bf16 x (k values each; row 3's second sub-block zeros), staged row by row by
// StagedRowsX, and their two planes' values by q8_rounding.h's statement of the rule.
struct StagedRows {
  int subs;                                  // sub-blocks of 32 a row
  std::vector<uint32_t> staged;              // [rows][subs][StagedRowsX::kWords]
  std::vector<std::vector<double>> rounded;  // [rows][k]
  const uint32_t* sub_block(int row, int s) const {
    return staged.data() + (static_cast<size_t>(row) * subs + s) * StagedRowsX::kWords;
  }
};
StagedRows staged_rows(std::mt19937& rng, int rows, int k) {
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  StagedRows out{k / 32, {}, {}};
  std::vector<bf16> x(static_cast<size_t>(rows) * k);
  for (bf16& v : x) v = __float2bfloat16(uniform(rng));
  for (int i = 32; i < 64 && i < k && rows > 3; ++i) x[3 * k + i] = __float2bfloat16(0.f);
  out.staged.resize(static_cast<size_t>(rows) * out.subs * StagedRowsX::kWords);
  out.rounded.assign(rows, std::vector<double>(k));
  for (int r = 0; r < rows; ++r) {
    std::vector<float> values(k);
    for (int i = 0; i < k; ++i) values[i] = __bfloat162float(x[static_cast<size_t>(r) * k + i]);
    for (int s = 0; s < out.subs; ++s) {
      StagedRowsX::stage(
          x.data() + static_cast<size_t>(r) * k + 32 * s,
          out.staged.data() + (static_cast<size_t>(r) * out.subs + s) * StagedRowsX::kWords);
    }
    out.rounded[r] = testing::rounded_to_two_planes(values);
  }
  return out;
}

// Staging itself: each staged 32's planes, unit and sum are q8_rounding.h's statement of the rule,
// on values that reach every rounding case (ties of hi and of lo, zeros, the 32's largest).
TEST(KquantLanes, StagedRowsHoldTheTwoPlanes) {
  std::mt19937 rng(16);
  std::uniform_real_distribution<float> uniform(-3.f, 3.f);
  for (int trial = 0; trial < 200; ++trial) {
    alignas(16) bf16 x[32];
    float values[32];
    for (int i = 0; i < 32; ++i) {
      x[i] = __float2bfloat16(trial == 0 ? 0.f : uniform(rng));
      values[i] = __bfloat162float(x[i]);
    }
    uint32_t staged[StagedRowsX::kWords];
    StagedRowsX::stage(x, staged);
    const testing::TwoPlaneBlock q = testing::quantize_two_planes(values);
    int64_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int hi = byte_at(staged[i / 4], i % 4),
                lo = byte_at(staged[StagedRowsX::kLowWord + i / 4], i % 4);
      ASSERT_LE(std::abs(lo), 64) << "trial " << trial << ", value " << i;
      ASSERT_EQ(StagedRowsX::combine(hi, lo), q.units[i]) << "trial " << trial << ", value " << i;
      sum += q.units[i];
    }
    ASSERT_EQ(float_from_bits(staged[StagedRowsX::kScaleWord]), q.unit) << "trial " << trial;
    ASSERT_EQ(float_from_bits(staged[StagedRowsX::kScaleWord + 1]),
              q.unit * static_cast<float>(sum))
        << "trial " << trial;
  }
}

// The several-row tile (Q4kRowsTile, x staged row by row by StagedRowsX) on an emulated warp, by
// the same statement of mma.sync m16n8k32's fragments: each sub-block's mma has column n = row n
// of x, A's k the sub-block's 32 weights in order, one mma a plane. 16 features of 1, 3 and 18
// blocks against 8 rows of x (one sub-block of zeros), summed as the kernel sums them: each lane's
// four outputs over blocks and sub-blocks, the planes' sums joined, scaled by its features' d sc,
// dmin m and the rows' unit and unit sum.
TEST(KquantLanes, Q4kRowsTileMatchesReferenceWeights) {
  std::mt19937 rng(14);
  constexpr int kRows = 16, kBytes = 144, kXRows = 8;
  for (int num_blocks : {1, 3, 18}) {
    const std::vector<uint4> storage = random_blocks(rng, num_blocks * kRows, kBytes, {0, 2});
    const auto* blocks = reinterpret_cast<const uint8_t*>(storage.data());
    const StagedRows x = staged_rows(rng, kXRows, 256 * num_blocks);
    float acc[32][4] = {};
    for (int b = 0; b < num_blocks; ++b) {
      Q4kRowsTile tiles[32];
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        tiles[lane] =
            Q4kRowsTile::load(blocks + (static_cast<size_t>(g) * num_blocks + b) * kBytes,
                              blocks + (static_cast<size_t>(g + 8) * num_blocks + b) * kBytes, t);
      }
      for (int sb = 0; sb < 8; ++sb) {
        int a[16][32], bm[2][32][8];  // bm: the planes hi, lo
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          uint32_t ar[4];
          tiles[lane].a_fragment(sb, ar);
          const uint32_t* x_g = x.sub_block(g, 8 * b + sb);
          for (int r = 0; r < 4; ++r) {
            for (int e = 0; e < 4; ++e) {
              a[g + (r % 2 == 1 ? 8 : 0)][4 * t + e + (r >= 2 ? 16 : 0)] = byte_at(ar[r], e);
            }
          }
          for (int plane = 0; plane < 2; ++plane) {
            const uint32_t* words = x_g + (plane == 1 ? StagedRowsX::kLowWord : 0);
            const uint32_t br[2] = {words[t], words[4 + t]};
            for (int r = 0; r < 2; ++r) {
              for (int e = 0; e < 4; ++e) {
                bm[plane][4 * t + e + (r == 1 ? 16 : 0)][g] = byte_at(br[r], e);
              }
            }
          }
        }
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          float scale[2], min[2];
          tiles[lane].sub_block_scales(sb, scale, min);
          for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
            int32_t c[2] = {0, 0};
            for (int plane = 0; plane < 2; ++plane) {
              for (int kk = 0; kk < 32; ++kk) c[plane] += a[row][kk] * bm[plane][kk][col];
            }
            const uint32_t* sc = x.sub_block(col, 8 * b + sb) + StagedRowsX::kScaleWord;
            const float unit = float_from_bits(sc[0]), x_sum = float_from_bits(sc[1]);
            acc[lane][i] =
                std::fma(scale[i >> 1] * unit, static_cast<float>(StagedRowsX::combine(c[0], c[1])),
                         acc[lane][i]);
            acc[lane][i] = std::fma(-min[i >> 1], x_sum, acc[lane][i]);
          }
        }
      }
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        expect_reference_dot(QuantType::kQ4_K,
                             blocks + static_cast<size_t>(row) * num_blocks * kBytes, num_blocks,
                             x.rounded[col], acc[lane][i],
                             std::to_string(num_blocks) + " blocks, feature " +
                                 std::to_string(row) + ", x row " + std::to_string(col));
      }
    }
  }
}

// Q6_K's several-row tile (Q6kRowsTile) on an emulated warp, by mma.sync m16n8k16's fragments
// for .s8 (PTX ISA: a0 row groupID, a1 row groupID + 8, at columns 4 threadID .. + 3; b0 column
// groupID at rows 4 threadID .. + 3; C as m16n8k32's): each 16-weight sub-block one mma, its
// columns the rows of x. 16 features of 1, 3 and 11 blocks of 210 bytes, rows back to back (so
// that blocks start at every even offset), against 8 rows of x.
TEST(KquantLanes, Q6kRowsTileMatchesReferenceWeights) {
  std::mt19937 rng(15);
  constexpr int kRows = 16, kBytes = 210, kXRows = 8;
  for (int num_blocks : {1, 3, 11}) {
    const std::vector<uint4> storage = random_blocks(rng, num_blocks * kRows, kBytes, {208});
    const auto* blocks = reinterpret_cast<const uint8_t*>(storage.data());
    const StagedRows x = staged_rows(rng, kXRows, 256 * num_blocks);
    float acc[32][4] = {};
    for (int b = 0; b < num_blocks; ++b) {
      Q6kRowsTile tiles[32];
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        tiles[lane] =
            Q6kRowsTile::load(blocks + (static_cast<size_t>(g) * num_blocks + b) * kBytes,
                              blocks + (static_cast<size_t>(g + 8) * num_blocks + b) * kBytes, t);
      }
      for (int h = 0; h < 2; ++h) {
        for (int grp = 0; grp < 4; ++grp) {
          const int sub = 8 * b + 4 * h + grp;  // the staged 32 that holds the sub-block
          for (int s = 0; s < 2; ++s) {
            int a[16][16], bm[2][16][8];  // bm: the planes hi, lo
            for (int lane = 0; lane < 32; ++lane) {
              const int g = lane / 4, t = lane % 4;
              uint32_t ar[2];
              tiles[lane].a_fragment(h, grp, s, ar);
              for (int e = 0; e < 4; ++e) {
                a[g][4 * t + e] = byte_at(ar[0], e);
                a[g + 8][4 * t + e] = byte_at(ar[1], e);
              }
              for (int plane = 0; plane < 2; ++plane) {
                const uint32_t br =
                    x.sub_block(g, sub)[(plane == 1 ? StagedRowsX::kLowWord : 0) + 4 * s + t];
                for (int e = 0; e < 4; ++e) bm[plane][4 * t + e][g] = byte_at(br, e);
              }
            }
            for (int lane = 0; lane < 32; ++lane) {
              const int g = lane / 4, t = lane % 4;
              float scale[2];
              tiles[lane].sub_block_scales(h, grp, s, scale);
              for (int i = 0; i < 4; ++i) {
                const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
                int32_t c[2] = {0, 0};
                for (int plane = 0; plane < 2; ++plane) {
                  for (int kk = 0; kk < 16; ++kk) c[plane] += a[row][kk] * bm[plane][kk][col];
                }
                const float unit = float_from_bits(x.sub_block(col, sub)[StagedRowsX::kScaleWord]);
                acc[lane][i] =
                    std::fma(scale[i >> 1] * unit,
                             static_cast<float>(StagedRowsX::combine(c[0], c[1])), acc[lane][i]);
              }
            }
          }
        }
      }
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        expect_reference_dot(QuantType::kQ6_K,
                             blocks + static_cast<size_t>(row) * num_blocks * kBytes, num_blocks,
                             x.rounded[col], acc[lane][i],
                             std::to_string(num_blocks) + " blocks, feature " +
                                 std::to_string(row) + ", x row " + std::to_string(col));
      }
    }
  }
}

}  // namespace
}  // namespace pagedlm::ops::cuda
