// CPU kernel internals that have no counterpart on another backend; every op's cases, on every
// backend, are in tests/backend_ops_test.cc. Here: the vectorized exp of the softmax and SiLU
// loops, linear's and paged attention's thread-count invariance, and the portable quantized-block
// kernel (the one that builds without AVX2 + FMA + F16C, which the dispatching entry point never
// runs on machines that have them).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "ops_test_util.h"
#include "pagedlm/core/dtype.h"
#include "pagedlm/core/parallel.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/ops/exp_cpu.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/paged_attention.h"

namespace pagedlm {
namespace {

using testing::dequantized;
using testing::poisoned_f32;
using testing::random_blocks;
using testing::random_f32;

// The vectorizable exp against libm's double exp.
TEST(ExpVectorizable, MatchesDoubleExpAndItsLimits) {
  double worst = 0;
  for (float x = -87.f; x <= 88.f; x += 1.0e-3f) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(ops::cpu::exp_vectorizable(x) - want) / want);
  }
  EXPECT_LT(worst, 1e-7);
  EXPECT_EQ(ops::cpu::exp_vectorizable(0.f), 1.f);
  EXPECT_EQ(ops::cpu::exp_vectorizable(-std::numeric_limits<float>::infinity()), 0.f);
  EXPECT_EQ(ops::cpu::exp_vectorizable(-100.f), 0.f);
  EXPECT_EQ(ops::cpu::exp_vectorizable(100.f), std::numeric_limits<float>::infinity());
  const float tiny = -87.3f;  // exp: 1.2e-38, just above FLT_MIN
  EXPECT_NEAR(ops::cpu::exp_vectorizable(tiny) / std::exp(static_cast<double>(tiny)), 1.0, 1e-6);
}

// The AVX2 exp (the attention's softmax on AVX2 machines) against libm's double exp, over the
// same range and limits as exp_vectorizable, 8 inputs at a time.
TEST(ExpAvx2, MatchesDoubleExpAndItsLimits) {
#if defined(__AVX2__) && defined(__FMA__)
  auto exp8 = [](float x0, float step) {
    alignas(32) float in[8], out[8];
    for (int l = 0; l < 8; ++l) in[l] = x0 + static_cast<float>(l) * step;
    _mm256_store_ps(out, ops::cpu::exp_avx2(_mm256_load_ps(in)));
    return std::pair{std::vector<float>(in, in + 8), std::vector<float>(out, out + 8)};
  };
  double worst = 0;
  for (float x = -87.f; x <= 88.f; x += 8.0e-3f) {
    const auto [in, out] = exp8(x, 1.0e-3f);
    for (int l = 0; l < 8; ++l) {
      const double want = std::exp(static_cast<double>(in[l]));
      worst = std::max(worst, std::abs(out[l] - want) / want);
    }
  }
  EXPECT_LT(worst, 1e-7);
  const float inf = std::numeric_limits<float>::infinity();
  alignas(32) const float limits[8] = {-inf, -100.f, 100.f, inf, -87.3f, 0.f, 1.f, -1.f};
  alignas(32) float got[8];
  _mm256_store_ps(got, ops::cpu::exp_avx2(_mm256_load_ps(limits)));
  EXPECT_EQ(got[0], 0.f);
  EXPECT_EQ(got[1], 0.f);
  EXPECT_EQ(got[2], inf);
  EXPECT_EQ(got[3], inf);
  // exp(-87.3): 1.2e-38, just above FLT_MIN
  EXPECT_NEAR(got[4] / std::exp(static_cast<double>(limits[4])), 1.0, 1e-6);
  EXPECT_EQ(got[5], 1.f);
  EXPECT_NEAR(got[6] / std::exp(1.0), 1.0, 1e-7);
  EXPECT_NEAR(got[7] / std::exp(-1.0), 1.0, 1e-7);
#else
  GTEST_SKIP() << "built without AVX2 and FMA (the build's -march=native)";
#endif
}

// Fixed column chunks make the bits independent of the thread count.
TEST(Linear, ThreadCountInvariant) {
  std::mt19937 rng(13);
  Tensor x = random_f32({21, 320}, rng);
  Tensor w = random_f32({700, 320}, rng);
  const int saved = num_threads();
  Tensor one = poisoned_f32({21, 700}), two = poisoned_f32({21, 700});
  set_num_threads(1);
  ops::linear(x, w, Tensor(), one);
  set_num_threads(2);
  ops::linear(x, w, Tensor(), two);
  set_num_threads(saved);
  EXPECT_EQ(std::memcmp(one.data<float>(), two.data<float>(), one.nbytes()), 0);
}

// One step of paged attention on the CPU: sequences of n_new tokens after n_ctx cached ones, on
// shuffled pages of a cache of random keys and values (random queries too).
struct AttentionStep {
  std::vector<int32_t> q_indptr{0}, kv_indptr{0}, pages, last_len;
  std::vector<float> q, k_cache, v_cache;
  ops::PagedAttentionDims dims{};

  AttentionStep(const std::vector<int32_t>& n_new, const std::vector<int32_t>& n_ctx,
                int64_t q_heads, int64_t kv_heads, int64_t head_dim, std::mt19937& rng) {
    constexpr int32_t kPageSize = 16;
    for (size_t s = 0; s < n_new.size(); ++s) {
      const int32_t n_kv = n_new[s] + n_ctx[s];
      const int32_t num_pages = (n_kv + kPageSize - 1) / kPageSize;
      for (int32_t i = 0; i < num_pages; ++i) pages.push_back(static_cast<int32_t>(pages.size()));
      kv_indptr.push_back(static_cast<int32_t>(pages.size()));
      last_len.push_back(n_kv - (num_pages - 1) * kPageSize);
      q_indptr.push_back(q_indptr.back() + n_new[s]);
    }
    std::shuffle(pages.begin(), pages.end(), rng);
    const auto num_pages = static_cast<int64_t>(pages.size());
    dims = {static_cast<int64_t>(n_new.size()),
            q_indptr.back(),
            q_heads,
            kv_heads,
            head_dim,
            num_pages,
            kPageSize,
            num_pages};
    std::uniform_real_distribution<float> uniform(-2.f, 2.f);
    for (auto* values : {&q, &k_cache, &v_cache}) {
      values->resize(values == &q ? dims.n_tokens * q_heads * head_dim
                                  : num_pages * kPageSize * kv_heads * head_dim);
      for (float& x : *values) x = uniform(rng);
    }
  }

  // Every row written, as NaNs show.
  std::vector<float> run(const AttentionVariant& variant) const {
    std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
    ops::cpu::paged_attention(q.data(), k_cache.data(), v_cache.data(), q_indptr.data(),
                              kv_indptr.data(), pages.data(), last_len.data(), variant, out.data(),
                              dims);
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); }))
        << "rows not written";
    return out;
  }
};

// The GPU's refusal of other head sizes names these, spelled out here by hand.
TEST(PagedAttention, CudaHeadSizesReadInMessages) {
  EXPECT_EQ(ops::cuda_attention_head_dims_text(), "64, 80, 96, 128 and 256");
  EXPECT_TRUE(ops::cuda_attention_runs_head_dim(80));
  EXPECT_FALSE(ops::cuda_attention_runs_head_dim(32));
}

// Paged attention's blocks depend on the thread count (a decode row's q heads share a block
// where there are blocks enough for the threads, else are split over several); each row's bits
// must not. Steps: a prefill chunk after a cached prefix, a short chunk and decode rows at long
// and short contexts, then a single decode row (split over the threads), each plain and with
// a window and soft-cap; SmolLM2's 9 q heads over 3 kv heads, and 8 q heads a kv head (as many
// rows as a prefill block needs to score from transposed keys). Accuracy against a reference is
// backend_ops_test's PagedAttention cases.
TEST(PagedAttentionCpu, ThreadCountInvariant) {
  struct Step {
    std::vector<int32_t> n_new, n_ctx;
  };
  const std::vector<Step> steps = {{{300, 20, 1, 1, 1}, {40, 0, 1000, 3, 70}}, {{1}, {1500}}};
  std::mt19937 rng(31);
  const int saved = num_threads();
  for (const auto& [q_heads, kv_heads] : {std::pair<int64_t, int64_t>{9, 3}, {16, 2}}) {
    for (const Step& step : steps) {
      const AttentionStep attn(step.n_new, step.n_ctx, q_heads, kv_heads, 64, rng);
      for (const AttentionVariant variant :
           {AttentionVariant{0.125f, 0, 0.f}, AttentionVariant{0.125f, 50, 1.5f}}) {
        std::vector<std::vector<float>> outs;
        for (int threads : {1, 2, 3, 5}) {
          set_num_threads(threads);
          outs.push_back(attn.run(variant));
        }
        for (size_t i = 1; i < outs.size(); ++i) {
          EXPECT_EQ(std::memcmp(outs[0].data(), outs[i].data(), outs[0].size() * sizeof(float)), 0)
              << q_heads << " q heads, thread count #" << i << ", window " << variant.window;
        }
      }
    }
  }
  set_num_threads(saved);
}

// A prompt's rows are bitwise the same whatever chunks its prefill was split into: a chunk of
// a few tokens is scored key by key (as decode is), a long one from transposed keys, and both
// must sum every score in the same order. Chunks of 1, 5, 16, 23 and 50 tokens against the
// whole prompt in one step, plain and with a window and soft-cap, at a head size of whole
// vectors and one of part vectors.
TEST(PagedAttentionCpu, ChunkingInvariant) {
  const std::vector<int32_t> chunks = {5, 1, 16, 23, 50, 3};
  int32_t prompt = 0;
  for (int32_t c : chunks) prompt += c;
  const int saved = num_threads();
  set_num_threads(2);
  for (const auto& [q_heads, kv_heads] : {std::pair<int64_t, int64_t>{9, 3}, {16, 2}}) {
    for (const int64_t head_dim : {64, 40}) {
      std::mt19937 rng(37);
      const AttentionStep whole({prompt}, {0}, q_heads, kv_heads, head_dim, rng);
      const int64_t row = q_heads * head_dim;
      for (const AttentionVariant variant :
           {AttentionVariant{0.125f, 0, 0.f}, AttentionVariant{0.125f, 21, 1.5f}}) {
        const std::vector<float> want = whole.run(variant);
        int32_t done = 0;
        for (int32_t c : chunks) {
          // The chunk's queries after `done` cached positions, on the whole prompt's pages.
          AttentionStep chunk = whole;
          chunk.q.assign(whole.q.begin() + done * row, whole.q.begin() + (done + c) * row);
          chunk.q_indptr = {0, c};
          const int32_t n_kv = done + c;
          const int32_t num_pages = (n_kv + 15) / 16;
          chunk.kv_indptr = {0, num_pages};
          chunk.pages.resize(num_pages);
          chunk.last_len = {n_kv - (num_pages - 1) * 16};
          chunk.dims.n_tokens = c;
          chunk.dims.num_page_indices = num_pages;
          const std::vector<float> got = chunk.run(variant);
          EXPECT_EQ(std::memcmp(got.data(), want.data() + done * row, got.size() * sizeof(float)),
                    0)
              << "chunk of " << c << " after " << done << ", " << q_heads << " q heads, head dim "
              << head_dim << ", window " << variant.window;
          done += c;
        }
      }
    }
  }
  set_num_threads(saved);
}

void portable(const Tensor& x, const QuantizedMatrix& w, const Tensor& bias, const Tensor& out) {
  ops::cpu::linear_portable(x.data<float>(), w, bias.defined() ? bias.data<float>() : nullptr,
                            out.data<float>(), x.dim(0));
}

// The portable kernel against float64 over the dequantized weights (NMSE, the relative
// Frobenius bound 1e-6 squared).
TEST(QuantizedLinearPortable, MatchesFloat64OverDequantizedWeights) {
  std::mt19937 rng(5);
  for (QuantType type : {QuantType::kQ4_1, QuantType::kQ8_0}) {
    for (auto [rows, out_features, in_features] :
         {std::tuple{1, 3, 32}, std::tuple{7, 70, 96}, std::tuple{19, 130, 576}}) {
      const QuantizedMatrix w = random_blocks(type, out_features, in_features, rng);
      const std::vector<float> wf = dequantized(w);
      const Tensor x = random_f32({rows, in_features}, rng);
      const Tensor bias = random_f32({out_features}, rng);
      Tensor out = poisoned_f32({rows, out_features});
      portable(x, w, bias, out);
      double diff2 = 0, ref2 = 0;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t n = 0; n < out_features; ++n) {
          double ref = bias.data<float>()[n];
          for (int64_t k = 0; k < in_features; ++k) {
            ref +=
                static_cast<double>(x.data<float>()[i * in_features + k]) * wf[n * in_features + k];
          }
          const double got = out.data<float>()[i * out_features + n];
          ASSERT_TRUE(std::isfinite(got));
          diff2 += (got - ref) * (got - ref);
          ref2 += ref * ref;
        }
      }
      EXPECT_LT(diff2 / ref2, 1e-12) << rows << "x" << out_features << "x" << in_features;
    }
  }
}

// Both block kernels: every row again inside calls of 1, 3, 10, 17 and 40 rows (the blocks kernel
// of decode steps and the panel GEMM of prefill-sized ones), at every offset, gives the same bits
// as in the whole batch.
TEST(QuantizedLinear, RowsAreBatchInvariant) {
  for (const bool use_portable : {false, true}) {
    std::mt19937 rng(9);
    for (QuantType type : {QuantType::kQ4_1, QuantType::kQ8_0}) {
      const int64_t out_features = 150, in_features = 192, rows = 45;
      const QuantizedMatrix w = random_blocks(type, out_features, in_features, rng);
      const Tensor x = random_f32({rows, in_features}, rng);
      auto run = [&](const Tensor& in, const Tensor& out) {
        if (use_portable) {
          portable(in, w, Tensor(), out);
        } else {
          ops::linear(in, w, Tensor(), out);
        }
      };
      Tensor all = poisoned_f32({rows, out_features});
      run(x, all);
      for (int64_t batch : {1, 3, 10, 17, 40}) {
        for (int64_t start = 0; start + batch <= rows; ++start) {
          Tensor part = poisoned_f32({batch, out_features});
          run(x.rows(start, start + batch), part);
          EXPECT_EQ(std::memcmp(part.data<float>(), all.data<float>() + start * out_features,
                                batch * out_features * sizeof(float)),
                    0)
              << "rows " << start << ".." << start + batch << (use_portable ? " portable" : "");
        }
      }
    }
  }
}

// The SIMD kernels (blocks expanded in registers or in panels) give the portable loops' bits: one
// arithmetic per output, whichever kernel computes it; shapes with ragged panels, micro-tiles and
// thread splits.
TEST(QuantizedLinear, SimdMatchesPortableBitForBit) {
  std::mt19937 rng(21);
  const int saved = num_threads();
  for (QuantType type : {QuantType::kQ4_1, QuantType::kQ8_0}) {
    for (auto [rows, out_features, in_features] : {std::tuple<int64_t, int64_t, int64_t>{1, 3, 32},
                                                   {4, 9, 64},
                                                   {5, 17, 64},
                                                   {7, 70, 96},
                                                   {37, 150, 576},
                                                   {300, 45, 1536}}) {
      const QuantizedMatrix w = random_blocks(type, out_features, in_features, rng);
      const Tensor x = random_f32({rows, in_features}, rng);
      const Tensor bias = random_f32({out_features}, rng);
      Tensor want = poisoned_f32({rows, out_features});
      portable(x, w, bias, want);
      for (int threads : {1, 2, 3}) {
        set_num_threads(threads);
        Tensor got = poisoned_f32({rows, out_features});
        ops::linear(x, w, bias, got);
        EXPECT_EQ(std::memcmp(got.data<float>(), want.data<float>(), got.nbytes()), 0)
            << rows << "x" << out_features << "x" << in_features << ", " << threads << " threads";
      }
    }
  }
  set_num_threads(saved);
}

// Q4_1 repacked with f32 scales (what the CPU backend multiplies by) holds the same weights: every
// kernel, the portable loops included, gives the bits of the original blocks' portable loops, on
// decode-sized and panel-sized steps; other formats pass through unchanged.
TEST(QuantizedLinear, RepackedForCpuGivesTheSameBits) {
  std::mt19937 rng(33);
  const int saved = num_threads();
  for (auto [rows, out_features, in_features] : {std::tuple<int64_t, int64_t, int64_t>{1, 3, 32},
                                                 {2, 9, 64},
                                                 {4, 130, 576},
                                                 {5, 17, 64},
                                                 {37, 150, 576},
                                                 {300, 45, 1536}}) {
    const QuantizedMatrix w = random_blocks(QuantType::kQ4_1, out_features, in_features, rng);
    const QuantizedMatrix repacked = ops::repack_for_cpu(w);
    ASSERT_EQ(repacked.type, QuantType::kQ4_1F32);
    ASSERT_EQ(repacked.rows, out_features);
    ASSERT_EQ(repacked.cols, in_features);
    ASSERT_EQ(static_cast<int64_t>(repacked.blocks.size()), out_features * in_features / 32 * 24);
    const Tensor x = random_f32({rows, in_features}, rng);
    const Tensor bias = random_f32({out_features}, rng);
    Tensor want = poisoned_f32({rows, out_features});
    portable(x, w, bias, want);
    Tensor got = poisoned_f32({rows, out_features});
    portable(x, repacked, bias, got);
    EXPECT_EQ(std::memcmp(got.data<float>(), want.data<float>(), got.nbytes()), 0)
        << rows << "x" << out_features << "x" << in_features << ", portable";
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      got = poisoned_f32({rows, out_features});
      ops::linear(x, repacked, bias, got);
      EXPECT_EQ(std::memcmp(got.data<float>(), want.data<float>(), got.nbytes()), 0)
          << rows << "x" << out_features << "x" << in_features << ", " << threads << " threads";
    }
  }
  set_num_threads(saved);
  const QuantizedMatrix q8 = random_blocks(QuantType::kQ8_0, 5, 64, rng);
  const QuantizedMatrix same = ops::repack_for_cpu(q8);
  EXPECT_EQ(same.type, QuantType::kQ8_0);
  EXPECT_EQ(same.blocks, q8.blocks);
}

}  // namespace
}  // namespace pagedlm
