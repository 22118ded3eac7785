// CPU kernel internals that have no counterpart on another backend; every op's cases, on every
// backend, are in tests/backend_ops_test.cc. Here: the vectorized exp of the softmax and SiLU
// loops, linear's thread-count invariance, and the portable quantized-block kernel (the one that
// builds without AVX2 + FMA + F16C, which the dispatching entry point never runs on machines that
// have them).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ops_test_util.h"
#include "pagedlm/core/dtype.h"
#include "pagedlm/core/parallel.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/ops/exp_cpu.h"
#include "pagedlm/ops/linear.h"

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

}  // namespace
}  // namespace pagedlm
