// The CPU linear over ggml blocks (Q4_1, Q8_0): against a float64 dot product over the weights
// as the GGUF reader dequantizes them, and batch invariant (a row's bits do not depend on the
// other rows of the call). Both kernels: the one this build dispatches to (AVX2 where the
// machine has it) and the portable one that builds without AVX2 + FMA + F16C run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "ops_test_util.h"
#include "pagedlm/core/dtype.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/ops/linear.h"

namespace pagedlm {
namespace {

using testing::random_f32;

// Random blocks: f16 scales of either sign and magnitude 1e-3..1e-1, random quants.
QuantizedMatrix random_blocks(QuantType type, int64_t rows, int64_t cols, std::mt19937& rng) {
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
    const int num_scales = type == QuantType::kQ4_1 ? 2 : 1;  // d (and m) are f16
    for (int s = 0; s < num_scales; ++s) {
      const uint16_t h = f32_to_f16((byte(rng) % 2 ? 1.f : -1.f) * scale(rng));
      q.blocks[at + 2 * s] = static_cast<uint8_t>(h & 0xff);
      q.blocks[at + 2 * s + 1] = static_cast<uint8_t>(h >> 8);
    }
  }
  return q;
}

// y = x W^T + b through the dispatching kernel (portable = false) or the portable one.
void quantized_linear(bool portable, const Tensor& x, const QuantizedMatrix& w, const Tensor& bias,
                      const Tensor& out) {
  if (!portable) {
    ops::linear(x, w, bias, out);
    return;
  }
  ops::cpu::linear_portable(x.data<float>(), w, bias.defined() ? bias.data<float>() : nullptr,
                            out.data<float>(), x.dim(0));
}

std::vector<float> dequantized(const QuantizedMatrix& q) {
  std::vector<float> w(q.rows * q.cols);
  const GgmlType type = q.type == QuantType::kQ4_1 ? GgmlType::kQ4_1 : GgmlType::kQ8_0;
  for (int64_t r = 0; r < q.rows; ++r) {
    dequantize_row(type, q.blocks.data() + r * q.row_bytes(), w.data() + r * q.cols, q.cols);
  }
  return w;
}

TEST(QuantizedLinear, MatchesFloat64OverDequantizedWeights) {
  for (const bool portable : {false, true}) {
    std::mt19937 rng(5);
    for (QuantType type : {QuantType::kQ4_1, QuantType::kQ8_0}) {
      for (auto [rows, out_features, in_features] :
           {std::tuple{1, 3, 32}, std::tuple{7, 70, 96}, std::tuple{19, 130, 576}}) {
        const QuantizedMatrix w = random_blocks(type, out_features, in_features, rng);
        const std::vector<float> wf = dequantized(w);
        const Tensor x = random_f32({rows, in_features}, rng);
        const Tensor bias = random_f32({out_features}, rng);
        Tensor out = Tensor::empty(DType::kF32, {rows, out_features});
        quantized_linear(portable, x, w, bias, out);
        double diff2 = 0, ref2 = 0;
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t n = 0; n < out_features; ++n) {
            double ref = bias.data<float>()[n];
            for (int64_t k = 0; k < in_features; ++k) {
              ref += static_cast<double>(x.data<float>()[i * in_features + k]) *
                     wf[n * in_features + k];
            }
            const double got = out.data<float>()[i * out_features + n];
            diff2 += (got - ref) * (got - ref);
            ref2 += ref * ref;
          }
        }
        EXPECT_LT(std::sqrt(diff2 / ref2), 1e-6)
            << rows << "x" << out_features << "x" << in_features << (portable ? " portable" : "");
      }
    }
  }
}

TEST(QuantizedLinear, RowsAreBatchInvariant) {
  for (const bool portable : {false, true}) {
    std::mt19937 rng(9);
    for (QuantType type : {QuantType::kQ4_1, QuantType::kQ8_0}) {
      const int64_t out_features = 150, in_features = 192, rows = 21;
      const QuantizedMatrix w = random_blocks(type, out_features, in_features, rng);
      const Tensor x = random_f32({rows, in_features}, rng);
      Tensor all = Tensor::empty(DType::kF32, {rows, out_features});
      quantized_linear(portable, x, w, Tensor(), all);
      // Every row again inside calls of 1, 3 and 10 rows, at every offset.
      for (int64_t batch : {1, 3, 10}) {
        for (int64_t start = 0; start + batch <= rows; ++start) {
          Tensor part = Tensor::empty(DType::kF32, {batch, out_features});
          quantized_linear(portable, x.rows(start, start + batch), w, Tensor(), part);
          EXPECT_EQ(std::memcmp(part.data<float>(), all.data<float>() + start * out_features,
                                batch * out_features * sizeof(float)),
                    0)
              << "rows " << start << ".." << start + batch << (portable ? " portable" : "");
        }
      }
    }
  }
}

TEST(QuantizedLinear, BadShapesAreErrors) {
  std::mt19937 rng(1);
  QuantizedMatrix w = random_blocks(QuantType::kQ4_1, 4, 64, rng);
  const Tensor x = random_f32({2, 32}, rng);
  Tensor out = Tensor::empty(DType::kF32, {2, 4});
  EXPECT_THROW(ops::linear(x, w, Tensor(), out), Error);
  w.blocks.pop_back();
  EXPECT_THROW(ops::linear(random_f32({2, 64}, rng), w, Tensor(), out), Error);
}

}  // namespace
}  // namespace pagedlm
