// The CPU's block formats held to gguf-py (testdata/gguf/reference.*, written by
// scripts/make_gguf_reference.py): each ggml format the CPU keeps in blocks, and its repacking,
// dequantizes to gguf-py's floats bit for bit; the exact linear over them is the float64 product
// of gguf-py's weights to float32 rounding, whichever kernel computes it (decode micro-kernel,
// prefill panels, portable loops; all bit for bit alike); 8-bit activations are within their
// quantization error of it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gguf_reference_util.h"
#include "ops_test_util.h"
#include "pagedlm/core/quantized.h"
#include "pagedlm/ops/linear.h"

namespace pagedlm {
namespace {

using testing::GgufReference;
using testing::poisoned_f32;
using testing::random_f32;

struct Case {
  QuantType type;
  const char* reference;  // the reference.json entry
};

// Every ggml format the CPU keeps in blocks (io/gguf.h: cpu_block_format).
const Case kCases[] = {
    {QuantType::kQ4_0, "random_Q4_0"},     {QuantType::kQ4_1, "random_Q4_1"},
    {QuantType::kQ5_0, "random_Q5_0"},     {QuantType::kQ5_1, "random_Q5_1"},
    {QuantType::kQ8_0, "random_Q8_0"},     {QuantType::kQ4_K, "random_Q4_K"},
    {QuantType::kQ6_K, "random_Q6_K"},     {QuantType::kQ5_K, "random_Q5_K"},
    {QuantType::kQ3_K, "random_Q3_K"},     {QuantType::kQ2_K, "random_Q2_K"},
    {QuantType::kIQ4_NL, "random_IQ4_NL"}, {QuantType::kIQ4_XS, "random_IQ4_XS"},
};

// The reference's rows, repeated to `rows` rows (so that the kernels' column tiles and groups
// have tails), with gguf-py's floats for them.
struct Weights {
  QuantizedMatrix blocks;
  std::vector<float> floats;
};

Weights reference_weights(const Case& c, int64_t rows) {
  const GgufReference& ref = GgufReference::get();
  const nlohmann::json& entry = ref.block(c.reference);
  const int64_t ref_rows = entry.at("rows"), cols = entry.at("cols");
  Weights w;
  w.blocks.type = c.type;
  w.blocks.rows = rows;
  w.blocks.cols = cols;
  const int64_t row_bytes = w.blocks.row_bytes();
  EXPECT_EQ(entry.at("bytes").at("length").get<int64_t>(), ref_rows * row_bytes) << c.reference;
  const uint8_t* bytes = ref.bytes(entry.at("bytes"));
  const float* floats = ref.floats(entry.at("floats"));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t src = r % ref_rows;
    w.blocks.blocks.insert(w.blocks.blocks.end(), bytes + src * row_bytes,
                           bytes + (src + 1) * row_bytes);
    w.floats.insert(w.floats.end(), floats + src * cols, floats + (src + 1) * cols);
  }
  return w;
}

void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ < 5) {
      ADD_FAILURE() << what << " element " << i << ": " << got[i] << " vs " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

TEST(QuantFormats, DequantizeAndRepackMatchGgufPy) {
  for (const Case& c : kCases) {
    const Weights w = reference_weights(c, 3);
    expect_same_bits(testing::dequantized(w.blocks), w.floats, quant_format(c.type).name);
    const QuantizedMatrix repacked = ops::repack_for_cpu(w.blocks);
    EXPECT_EQ(repacked.type, quant_format(c.type).cpu_form);
    EXPECT_EQ(quant_format(repacked.type).ggml_type, c.type);
    expect_same_bits(
        testing::dequantized(repacked), w.floats,
        std::string(quant_format(repacked.type).name) + " from " + quant_format(c.type).name);
  }
}

// y = x W^T + b in float64 from gguf-py's weights, and the bound on float32 rounding: the sum of
// |terms| times 64 ulps at 1 (each lane adds up to in_features / 16 products, then 4 tree levels).
struct Product {
  std::vector<double> y, bound;
};

Product reference_product(const Tensor& x, const std::vector<float>& w, const float* bias,
                          int64_t out_features, int64_t in_features) {
  const int64_t rows = x.dim(0);
  Product p;
  p.y.resize(rows * out_features);
  p.bound.resize(rows * out_features);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t n = 0; n < out_features; ++n) {
      double sum = bias != nullptr ? bias[n] : 0.0, abs_sum = std::abs(sum);
      for (int64_t k = 0; k < in_features; ++k) {
        const double term =
            static_cast<double>(x.data<float>()[r * in_features + k]) * w[n * in_features + k];
        sum += term;
        abs_sum += std::abs(term);
      }
      p.y[r * out_features + n] = sum;
      p.bound[r * out_features + n] = abs_sum * 64 * 0x1p-24;
    }
  }
  return p;
}

void expect_within(const Tensor& out, const Product& want, const std::string& what) {
  int64_t bad = 0;
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double got = out.data<float>()[i];
    if (!(std::abs(got - want.y[i]) <= want.bound[i]) && bad++ < 5) {
      ADD_FAILURE() << what << " output " << i << ": " << got << " vs " << want.y[i] << " (bound "
                    << want.bound[i] << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// Decode-sized steps (AVX-512: 1-4 rows through the micro-kernel; AVX2: up to 8 through the row
// kernels), prefill-sized ones (the panels, with short last tiles of every size: 11 and 13 rows
// are 6 + 5 and 6 + 6 + 1 on AVX-512, 3 + 3 + 3 + 2 and 4 x 3 + 1 on AVX2) and the portable
// loops, on the format as loaded and as repacked.
TEST(QuantFormats, ExactLinearMatchesGgufPyWeights) {
  std::mt19937 rng(7);
  const int64_t out_features = 37;  // a partial 32-column chunk and 4-column tile
  for (const Case& c : kCases) {
    const Weights w = reference_weights(c, out_features);
    const int64_t in_features = w.blocks.cols;
    const QuantizedMatrix repacked = ops::repack_for_cpu(w.blocks);
    const Tensor bias = random_f32({out_features}, rng);
    for (int64_t rows : {1, 2, 3, 4, 5, 7, 11, 13}) {
      const std::string what =
          std::string(quant_format(c.type).name) + " rows " + std::to_string(rows);
      const Tensor x = random_f32({rows, in_features}, rng);
      const Product want =
          reference_product(x, w.floats, bias.data<float>(), out_features, in_features);
      Tensor out = poisoned_f32({rows, out_features});
      ops::linear(x, repacked, bias, out);
      expect_within(out, want, what);
      // Every kernel and layout gives the same bits.
      for (const QuantizedMatrix* m : {&w.blocks, &repacked}) {
        Tensor other = poisoned_f32({rows, out_features});
        ops::cpu::linear_portable(x.data<float>(), *m, bias.data<float>(), other.data<float>(),
                                  rows);
        ASSERT_EQ(std::memcmp(out.raw(), other.raw(), out.nbytes()), 0)
            << what << ": portable kernel on " << quant_format(m->type).name;
        ops::linear(x, *m, bias, other);
        ASSERT_EQ(std::memcmp(out.raw(), other.raw(), out.nbytes()), 0)
            << what << ": linear on " << quant_format(m->type).name;
      }
      // A row's output does not depend on the rows beside it.
      Tensor alone = poisoned_f32({1, out_features});
      ops::linear(x.rows(rows - 1, rows), repacked, bias, alone);
      EXPECT_EQ(
          std::memcmp(alone.raw(), out.data<float>() + (rows - 1) * out_features, alone.nbytes()),
          0)
          << what << ": last row alone";
    }
  }
}

// 8-bit activations for every format (ops::q8_packs): within the error of quantizing x (half a
// step of max|x_block| / 127 per element, times |w|; blocks of 256 for the K-quants and IQ4_XS,
// as ggml's q8_K, of 32 for the others) of the exact product with gguf-py's weights.
TEST(QuantFormats, Q8ActivationsMatchGgufPyWeights) {
  std::mt19937 rng(9);
  const int64_t out_features = 37, rows = 5;
  int packed = 0;
  for (const Case& c : kCases) {
    if (!ops::q8_packs(c.type)) continue;
    ++packed;
    const Weights w = reference_weights(c, out_features);
    const int64_t in_features = w.blocks.cols;
    const Tensor x = random_f32({rows, in_features}, rng);
    Product want = reference_product(x, w.floats, nullptr, out_features, in_features);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t n = 0; n < out_features; ++n) {
        double err = 0;
        const int64_t xb = quant_block_elems(c.type);
        for (int64_t b = 0; b < in_features / xb; ++b) {
          double amax = 0;
          for (int64_t k = 0; k < xb; ++k) {
            amax = std::max(amax, std::abs(double{x.data<float>()[r * in_features + b * xb + k]}));
          }
          for (int64_t k = 0; k < xb; ++k) {
            err += 0.5001 * amax / 127 * std::abs(w.floats[n * in_features + b * xb + k]);
          }
        }
        want.bound[r * out_features + n] += err;
      }
    }
    const ops::Q8PackedMatrix q8 = ops::pack_for_q8(w.blocks);
    for (ops::cpu::Q8Kernel kernel : ops::cpu::q8_kernels()) {
      Tensor out = poisoned_f32({rows, out_features});
      ops::cpu::linear_q8(x.data<float>(), q8, nullptr, out.data<float>(), rows, kernel);
      expect_within(
          out, want,
          std::string(quant_format(c.type).name) + " " + ops::cpu::q8_kernel_name(kernel));
    }
  }
  EXPECT_EQ(packed, static_cast<int>(std::size(kCases)));
}

// 32-bit fixed-point activations (IntActivations::kFixed32) for every format: held to the exact
// linear's own bound, the float64 product of gguf-py's weights to float32 rounding, with decode-
// and prefill-sized steps; every kernel gives the same bits, and a row alone the same as in its
// batch.
TEST(QuantFormats, Fixed32ActivationsAreExactToFloat32Rounding) {
  std::mt19937 rng(13);
  const int64_t out_features = 37;
  for (const Case& c : kCases) {
    if (!ops::q8_packs(c.type)) continue;
    const Weights w = reference_weights(c, out_features);
    const int64_t in_features = w.blocks.cols;
    const ops::Q8PackedMatrix q8 = ops::pack_for_q8(w.blocks);
    const Tensor bias = random_f32({out_features}, rng);
    for (int64_t rows : {1, 2, 3, 4, 5, 11}) {
      const std::string what = std::string(quant_format(c.type).name) + " rows " +
                               std::to_string(rows) + " (32-bit fixed point)";
      const Tensor x = random_f32({rows, in_features}, rng);
      const Product want =
          reference_product(x, w.floats, bias.data<float>(), out_features, in_features);
      Tensor out = poisoned_f32({rows, out_features});
      ops::linear_q8(x, q8, bias, out, 0, ops::IntActivations::kFixed32);
      expect_within(out, want, what);
      for (ops::cpu::Q8Kernel kernel : ops::cpu::q8_kernels()) {
        Tensor other = poisoned_f32({rows, out_features});
        ops::cpu::linear_q8(x.data<float>(), q8, bias.data<float>(), other.data<float>(), rows,
                            kernel, -1, ops::IntActivations::kFixed32);
        ASSERT_EQ(std::memcmp(out.raw(), other.raw(), out.nbytes()), 0)
            << what << ": " << ops::cpu::q8_kernel_name(kernel);
      }
      Tensor alone = poisoned_f32({1, out_features});
      ops::linear_q8(x.rows(rows - 1, rows), q8, bias, alone, 0, ops::IntActivations::kFixed32);
      EXPECT_EQ(
          std::memcmp(alone.raw(), out.data<float>() + (rows - 1) * out_features, alone.nbytes()),
          0)
          << what << ": last row alone";
    }
  }
}

// A projection stacked from matrices in different formats (a Q4_K_M file's q, k and v): each
// part writes its own columns of one output, the same values as alone, the bias over all.
TEST(QuantFormats, PartsFillTheirColumns) {
  std::mt19937 rng(5);
  const Weights a = reference_weights(kCases[2], 20);  // Q5_0
  const Weights b = reference_weights(kCases[3], 12);  // Q5_1
  const int64_t rows = 3, in_features = a.blocks.cols;
  ASSERT_EQ(b.blocks.cols, in_features);
  const Tensor x = random_f32({rows, in_features}, rng);
  const Tensor bias = random_f32({32}, rng);
  Tensor out = poisoned_f32({rows, 32});
  const QuantizedMatrix ra = ops::repack_for_cpu(a.blocks), rb = ops::repack_for_cpu(b.blocks);
  ops::linear(x, ra, bias, out, 0);
  ops::linear(x, rb, bias, out, 20);
  std::vector<float> w = a.floats;
  w.insert(w.end(), b.floats.begin(), b.floats.end());
  expect_within(out, reference_product(x, w, bias.data<float>(), 32, in_features), "Q5_0 + Q5_1");
  testing::expect_error([&] { ops::linear(x, rb, bias, out, 21); }, {"out must be f32"});
}

}  // namespace
}  // namespace pagedlm
