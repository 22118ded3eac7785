// The CPU projections with 8-bit activations (ops/linear_q8_cpu.cc) against a reference written
// here from the formats' definitions: ggml's blocks (Q4_1: w = q * d + m with q the low then high
// nibbles; Q8_0: w = q * d) read from the unpacked QuantizedMatrix, x quantized per block of 32
// with d = max |x| / 127 and q = round(x / d), the block dot products summed in integers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ops_test_util.h"
#include "pagedlm/core/dtype.h"
#include "pagedlm/ops/linear.h"

namespace pagedlm {
namespace {

using ops::cpu::Q8Kernel;
using testing::expect_error;
using testing::poisoned_f32;
using testing::quantize_block;
using testing::random_blocks;
using testing::random_f32;
using testing::XBlock;

float half_at(const uint8_t* p) { return f16_to_f32(static_cast<uint16_t>(p[0] | (p[1] << 8))); }

// Element k of block b of weight row n, as an integer quant, with the block's d and m.
struct WeightBlock {
  int32_t q[32];
  float d, m;
};
WeightBlock weight_block(const QuantizedMatrix& w, int64_t n, int64_t b) {
  WeightBlock out{};
  const uint8_t* p = w.blocks.data() + n * w.row_bytes() + b * quant_block_bytes(w.type);
  out.d = half_at(p);
  if (w.type == QuantType::kQ4_1) {
    out.m = half_at(p + 2);
    for (int k = 0; k < 16; ++k) {
      out.q[k] = p[4 + k] & 0x0F;
      out.q[k + 16] = p[4 + k] >> 4;
    }
  } else {
    out.m = 0.f;
    for (int k = 0; k < 32; ++k) out.q[k] = static_cast<int8_t>(p[2 + k]);
  }
  return out;
}

// Random x with one block of zeros (d = 0) in row 0 when there is room.
Tensor random_x(int64_t rows, int64_t cols, std::mt19937& rng) {
  Tensor x = random_f32({rows, cols}, rng, -3.f, 3.f);
  if (cols >= 64) std::fill(x.data<float>() + 32, x.data<float>() + 64, 0.f);
  return x;
}

void run(Q8Kernel kernel, const Tensor& x, const ops::Q8PackedMatrix& w, const Tensor& bias,
         const Tensor& out) {
  ops::cpu::linear_q8(x.data<float>(), w, bias.defined() ? bias.data<float>() : nullptr,
                      out.data<float>(), x.dim(0), kernel);
}

TEST(Q8Activations, QuantizeMatchesGgmlDefinition) {
  std::mt19937 rng(3);
  for (int64_t block : {32, 256}) {  // ggml's q8_0 / q8_1 and q8_K
    const int64_t rows = 23, cols = 512;
    const Tensor x = random_x(rows, cols, rng);
    ops::cpu::Q8Activations q;
    ops::cpu::quantize_q8(x.data<float>(), rows, cols, q, block);
    ASSERT_EQ(q.rows, rows);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < cols / block; ++b) {
        const float* xb = x.data<float>() + r * cols + b * block;
        const XBlock want = quantize_block(xb, block);
        const int64_t at = r * (cols / block) + b;
        ASSERT_EQ(q.scale[at], want.d) << r << " " << b;
        ASSERT_EQ(q.sum[at], want.sum) << r << " " << b;
        ASSERT_EQ(q.scaled_sum[at], want.d * static_cast<float>(want.sum));
        int32_t qmax = 0;
        for (int64_t k = 0; k < block; ++k) {
          ASSERT_EQ(q.qs[r * cols + b * block + k], want.q[k]) << r << " " << b << " " << k;
          qmax = std::max(qmax, std::abs(want.q[k]));
          // Within half a step of x (and a rounding of x / d).
          EXPECT_LE(std::fabs(xb[k] - static_cast<float>(want.q[k]) * want.d), 0.5001f * want.d);
        }
        for (int64_t h = 0; h < block / 16; ++h) {
          int32_t s16 = 0;
          for (int64_t k = 16 * h; k < 16 * h + 16; ++k) s16 += want.q[k];
          ASSERT_EQ(q.sum16[(r * cols + b * block) / 16 + h], s16) << r << " " << b << " " << h;
        }
        EXPECT_EQ(qmax, want.d != 0.f ? 127 : 0);
      }
    }
  }
  ops::cpu::Q8Activations q;
  expect_error([&] { ops::cpu::quantize_q8(nullptr, 1, 288, q, 256); },
               {"288 columns are not whole blocks of 256"});
}

// Scales that are powers of two make every product and partial sum exact in float, so each
// kernel's output must equal the exact integer result: the integer dot products, the nibble /
// byte order, the min term and the placement of every feature and row are checked bit for bit.
TEST(Q8Linear, ExactWhenEveryProductIsExact) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> q127(-127, 127), exp_w(2, 6), exp_x(0, 4), m4(-15, 15);
  for (QuantType type : {QuantType::kQ4_1, QuantType::kQ8_0}) {
    const int64_t rows = 11, out_features = 37, in_features = 256, nb = in_features / 32;
    QuantizedMatrix w = random_blocks(type, out_features, in_features, rng);
    std::vector<int> ew(out_features), ex(rows);
    for (int64_t n = 0; n < out_features; ++n) {
      ew[n] = exp_w(rng);
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* p = w.blocks.data() + n * w.row_bytes() + b * quant_block_bytes(type);
        const uint16_t d = f32_to_f16(std::ldexp(1.f, -ew[n]));
        p[0] = static_cast<uint8_t>(d & 0xff);
        p[1] = static_cast<uint8_t>(d >> 8);
        if (type == QuantType::kQ4_1) {
          const uint16_t m = f32_to_f16(std::ldexp(static_cast<float>(m4(rng)), -ew[n]));
          p[2] = static_cast<uint8_t>(m & 0xff);
          p[3] = static_cast<uint8_t>(m >> 8);
        }
      }
    }
    // x = k * 2^-e with k in [-127, 127] and one k of each block at +-127: d = 2^-e, q = k.
    Tensor x = Tensor::empty(DType::kF32, {rows, in_features});
    for (int64_t r = 0; r < rows; ++r) {
      ex[r] = exp_x(rng);
      for (int64_t k = 0; k < in_features; ++k) {
        const int v = k % 32 == 5 ? (q127(rng) < 0 ? -127 : 127) : q127(rng);
        x.data<float>()[r * in_features + k] = std::ldexp(static_cast<float>(v), -ex[r]);
      }
    }
    const ops::Q8PackedMatrix packed = ops::pack_for_q8(w);
    for (Q8Kernel kernel : ops::cpu::q8_kernels()) {
      Tensor out = poisoned_f32({rows, out_features});
      run(kernel, x, packed, Tensor(), out);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t n = 0; n < out_features; ++n) {
          // In units of 2^-(ew + ex): below 2^24, so the float sum is exact.
          int64_t units = 0;
          for (int64_t b = 0; b < nb; ++b) {
            const WeightBlock wb = weight_block(w, n, b);
            const XBlock xb = quantize_block(x.data<float>() + r * in_features + b * 32);
            int64_t dot = 0;
            for (int k = 0; k < 32; ++k) dot += int64_t{wb.q[k]} * xb.q[k];
            units += dot + static_cast<int64_t>(std::ldexp(wb.m, ew[n])) * xb.sum;
          }
          ASSERT_LT(std::llabs(units), int64_t{1} << 24);
          const float want = std::ldexp(static_cast<float>(units), -(ew[n] + ex[r]));
          ASSERT_EQ(out.data<float>()[r * out_features + n], want)
              << ops::cpu::q8_kernel_name(kernel) << " row " << r << " feature " << n;
        }
      }
    }
  }
}

// Random blocks and x: the portable kernel within float rounding of the reference (integer block
// sums, float64 combination), every other kernel bit for bit equal to the portable one.
TEST(Q8Linear, MatchesReferenceAndKernelsAgree) {
  std::mt19937 rng(7);
  for (QuantType type : {QuantType::kQ4_1, QuantType::kQ8_0}) {
    for (auto [rows, out_features, in_features] :
         {std::tuple{1, 1, 32}, std::tuple{5, 17, 96}, std::tuple{13, 40, 576},
          std::tuple{9, 130, 1536}}) {
      const QuantizedMatrix w = random_blocks(type, out_features, in_features, rng);
      const ops::Q8PackedMatrix packed = ops::pack_for_q8(w);
      const Tensor x = random_x(rows, in_features, rng);
      const Tensor bias = random_f32({out_features}, rng);
      Tensor portable = poisoned_f32({rows, out_features});
      run(Q8Kernel::kPortable, x, packed, bias, portable);
      const int64_t nb = in_features / 32;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t n = 0; n < out_features; ++n) {
          double ref = bias.data<float>()[n], magnitude = std::fabs(ref);
          for (int64_t b = 0; b < nb; ++b) {
            const WeightBlock wb = weight_block(w, n, b);
            const XBlock xb = quantize_block(x.data<float>() + r * in_features + b * 32);
            int64_t dot = 0;
            for (int k = 0; k < 32; ++k) dot += int64_t{wb.q[k]} * xb.q[k];
            const double t1 = static_cast<double>(wb.d) * xb.d * static_cast<double>(dot);
            const double t2 = static_cast<double>(wb.m) * xb.d * xb.sum;
            ref += t1 + t2;
            magnitude += std::fabs(t1) + std::fabs(t2);
          }
          // Float32 recursive summation of 2 nb + 1 terms, each term also carrying the rounding
          // of its scale product: |error| <= (2 nb + 4) u sum |terms|, u = 2^-24.
          const double bound = (2.0 * nb + 4) * std::ldexp(1.0, -24) * magnitude;
          const double got = portable.data<float>()[r * out_features + n];
          ASSERT_LE(std::fabs(got - ref), bound)
              << "row " << r << " feature " << n << " of " << rows << "x" << out_features << "x"
              << in_features;
        }
      }
      for (Q8Kernel kernel : ops::cpu::q8_kernels()) {
        Tensor out = poisoned_f32({rows, out_features});
        run(kernel, x, packed, bias, out);
        EXPECT_EQ(std::memcmp(out.data<float>(), portable.data<float>(), out.nbytes()), 0)
            << ops::cpu::q8_kernel_name(kernel) << " " << rows << "x" << out_features << "x"
            << in_features;
      }
    }
  }
}

// The formats packed in super-blocks, and the block of x each is computed with.
struct SuperCase {
  QuantType type;
  int64_t x_block;
  float max_min;  // the largest integer min of the format (Q5_1: its f16 m, taken as 1 x m)
};
constexpr SuperCase kSuperCases[] = {{QuantType::kQ4_0, 32, 0.f},   {QuantType::kQ5_0, 32, 0.f},
                                     {QuantType::kQ5_1, 32, 1.f},   {QuantType::kQ2_K, 256, 15.f},
                                     {QuantType::kQ3_K, 256, 0.f},  {QuantType::kQ4_K, 256, 63.f},
                                     {QuantType::kQ5_K, 256, 63.f}, {QuantType::kQ6_K, 256, 0.f},
                                     {QuantType::kIQ4_NL, 32, 0.f}, {QuantType::kIQ4_XS, 256, 0.f}};

void set_f16(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v);
  ASSERT_EQ(f16_to_f32(h), v);
  p[0] = static_cast<uint8_t>(h & 0xff);
  p[1] = static_cast<uint8_t>(h >> 8);
}

// x as its quantization gives it back, q * d per block of x_block.
std::vector<double> quantized_x(const Tensor& x, int64_t x_block) {
  const int64_t rows = x.dim(0), cols = x.dim(1);
  std::vector<double> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / x_block; ++b) {
      const XBlock xb = quantize_block(x.data<float>() + r * cols + b * x_block, x_block);
      for (int64_t k = 0; k < x_block; ++k) {
        out[r * cols + b * x_block + k] = static_cast<double>(xb.q[k]) * xb.d;
      }
    }
  }
  return out;
}

// Q5_0, Q5_1, the K-quants and IQ4, with every scale a power of two and every x a small integer
// times one (its block's largest +-127): each output is then a sum of exact products below 2^24
// units, and every kernel must give exactly sum_k w_k q_k d_x, w_k from the format's reference
// dequantization (held to gguf-py's bit for bit by ops_quant_formats_test). Checks every bit
// plane, scale, min and offset of the super-block layouts, and each feature's and row's place.
TEST(Q8Linear, SuperBlocksExactWhenEveryProductIsExact) {
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> small(-3, 3), sign(0, 1), exp_w(2, 6), exp_x(0, 4),
      m4(-15, 15);
  for (const SuperCase& sc : kSuperCases) {
    const int64_t rows = 9, out_features = 37, in_features = 512;
    QuantizedMatrix w = random_blocks(sc.type, out_features, in_features, rng);
    const int64_t block_bytes = quant_block_bytes(sc.type);
    std::vector<int> ew(out_features);  // one scale exponent per feature
    for (int& e : ew) e = exp_w(rng);
    for (size_t at = 0; at < w.blocks.size(); at += block_bytes) {
      const float d = std::ldexp(1.f, -ew[static_cast<int64_t>(at) / w.row_bytes()]);
      const std::vector<int> offsets = testing::f16_scale_offsets(sc.type);
      set_f16(w.blocks.data() + at + offsets[0], sign(rng) ? d : -d);
      if (offsets.size() > 1) {  // Q5_1's m, a K-quant's dmin
        set_f16(w.blocks.data() + at + offsets[1],
                sc.type == QuantType::kQ5_1 ? d * static_cast<float>(m4(rng)) : d);
      }
    }
    Tensor x = Tensor::empty(DType::kF32, {rows, in_features});
    std::vector<int> ex(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int e = ex[r] = exp_x(rng);
      for (int64_t k = 0; k < in_features; ++k) {
        const int v = k % 32 == 5 ? (sign(rng) ? -127 : 127) : small(rng);
        x.data<float>()[r * in_features + k] = std::ldexp(static_cast<float>(v), -e);
      }
    }
    const std::vector<float> wf = testing::dequantized(w);
    const std::vector<double> xq = quantized_x(x, sc.x_block);
    const ops::Q8PackedMatrix packed = ops::pack_for_q8(w);
    EXPECT_EQ(packed.type, sc.type);
    for (Q8Kernel kernel : ops::cpu::q8_kernels()) {
      Tensor out = poisoned_f32({rows, out_features});
      run(kernel, x, packed, Tensor(), out);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t n = 0; n < out_features; ++n) {
          // Every product and partial sum is a multiple of the feature's smallest d times the
          // row's d_x; exact while the sum of their magnitudes, integer scales times u - offset
          // (|w_k| + |dmin| max_min) and mins (|dmin| max_min), stays below 2^24 such units.
          double want = 0, magnitude = 0, unit = 1;
          for (int64_t k = 0; k < in_features; ++k) {
            const uint8_t* blk =
                w.blocks.data() + n * w.row_bytes() + k / quant_block_elems(sc.type) * block_bytes;
            const std::vector<int> offsets = testing::f16_scale_offsets(sc.type);
            const double d = std::fabs(half_at(blk + offsets[0]));
            const double dmin =
                offsets.size() > 1 ? std::fabs(half_at(blk + offsets[1])) * sc.max_min : 0.0;
            unit = std::min(unit, d);
            const double xk = xq[r * in_features + k];
            want += static_cast<double>(wf[n * in_features + k]) * xk;
            magnitude += (std::fabs(wf[n * in_features + k]) + 2 * dmin) * std::fabs(xk);
          }
          ASSERT_LT(magnitude / std::ldexp(unit, -ex[r]), std::ldexp(1.0, 24));
          ASSERT_EQ(out.data<float>()[r * out_features + n], static_cast<float>(want))
              << quant_format(sc.type).name << " " << ops::cpu::q8_kernel_name(kernel) << " row "
              << r << " feature " << n;
        }
      }
    }
  }
}

// Random blocks and x: every kernel bit for bit equal to the portable one, and the portable one
// within float rounding of sum_k w_k q_k d_x (w_k by the reference dequantization, x as its
// quantization gives it back, float64). The rounding: the integer dot product of a super-block
// (exact) converted to float and scaled (3 roundings), its min term likewise, and the float32
// recursive sum of 2 nsb such terms, each at most (|w_k| + 2 |dmin| max_min) |x_k| summed over
// the super-block (w = d sc (u - offset) - dmin mn), plus w_k's own rounding in the reference.
TEST(Q8Linear, SuperBlocksMatchReferenceAndKernelsAgree) {
  std::mt19937 rng(23);
  for (const SuperCase& sc : kSuperCases) {
    for (auto [rows, out_features, in_features] :
         {std::tuple{1, 1, 256}, std::tuple{5, 17, 512}, std::tuple{10, 40, 1536}}) {
      const QuantizedMatrix w = random_blocks(sc.type, out_features, in_features, rng);
      const ops::Q8PackedMatrix packed = ops::pack_for_q8(w);
      const Tensor x = random_x(rows, in_features, rng);
      const Tensor bias = random_f32({out_features}, rng);
      const std::vector<float> wf = testing::dequantized(w);
      const std::vector<double> xq = quantized_x(x, sc.x_block);
      Tensor portable = poisoned_f32({rows, out_features});
      run(Q8Kernel::kPortable, x, packed, bias, portable);
      const std::vector<int> offsets = testing::f16_scale_offsets(sc.type);
      const int64_t block_elems = quant_block_elems(sc.type),
                    block_bytes = quant_block_bytes(sc.type);
      const int64_t nsb = in_features / sc.x_block;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t n = 0; n < out_features; ++n) {
          double ref = bias.data<float>()[n], magnitude = std::fabs(ref);
          for (int64_t k = 0; k < in_features; ++k) {
            const uint8_t* blk =
                w.blocks.data() + n * w.row_bytes() + k / block_elems * block_bytes;
            const double dmin =
                offsets.size() > 1 ? std::fabs(half_at(blk + offsets[1])) * sc.max_min : 0.0;
            const double xk = xq[r * in_features + k];
            ref += static_cast<double>(wf[n * in_features + k]) * xk;
            magnitude += (std::fabs(wf[n * in_features + k]) + 2 * dmin) * std::fabs(xk);
          }
          const double bound = (2.0 * nsb + 6) * std::ldexp(1.0, -24) * magnitude;
          const double got = portable.data<float>()[r * out_features + n];
          ASSERT_LE(std::fabs(got - ref), bound)
              << quant_format(sc.type).name << " row " << r << " feature " << n << " of " << rows
              << "x" << out_features << "x" << in_features;
        }
      }
      for (Q8Kernel kernel : ops::cpu::q8_kernels()) {
        Tensor out = poisoned_f32({rows, out_features});
        run(kernel, x, packed, bias, out);
        EXPECT_EQ(std::memcmp(out.data<float>(), portable.data<float>(), out.nbytes()), 0)
            << quant_format(sc.type).name << " " << ops::cpu::q8_kernel_name(kernel) << " " << rows
            << "x" << out_features << "x" << in_features;
      }
    }
  }
}

// A packed row read back (a tied embedding's lookup) is the reference dequantization of the
// blocks it was packed from, for every format and for rows in every lane of a group: bit for bit,
// the sign of a zero included.
TEST(Q8Linear, PackedRowsDequantizeAsTheirBlocks) {
  std::mt19937 rng(27);
  for (QuantType type :
       {QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ8_0, QuantType::kQ5_0, QuantType::kQ5_1,
        QuantType::kQ2_K, QuantType::kQ3_K, QuantType::kQ4_K, QuantType::kQ5_K, QuantType::kQ6_K,
        QuantType::kIQ4_NL, QuantType::kIQ4_XS}) {
    const int64_t rows = 37, cols = 512;
    const QuantizedMatrix w = random_blocks(type, rows, cols, rng);
    const ops::Q8PackedMatrix packed = ops::pack_for_q8(w);
    std::vector<float> want(cols), got(cols);
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row(w, r, want.data());
      ops::dequantize_row(packed, r, got.data());
      for (int64_t k = 0; k < cols; ++k) {
        ASSERT_EQ(got[k], want[k]) << quant_format(type).name << " row " << r << " column " << k;
        ASSERT_EQ(std::signbit(got[k]), std::signbit(want[k])) << quant_format(type).name;
      }
    }
    expect_error([&] { ops::dequantize_row(packed, rows, got.data()); }, {"row 37 of 37"});
  }
}

// Every row again inside calls of 1, 3 and 10 rows, at every offset, gives the same bits as in
// the whole batch (row tiles of 4 and 8 meet every tail).
TEST(Q8Linear, RowsAreBatchInvariant) {
  std::mt19937 rng(9);
  for (QuantType type :
       {QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ8_0, QuantType::kQ5_0, QuantType::kQ5_1,
        QuantType::kQ2_K, QuantType::kQ3_K, QuantType::kQ4_K, QuantType::kQ5_K, QuantType::kQ6_K,
        QuantType::kIQ4_NL, QuantType::kIQ4_XS}) {
    const int64_t out_features = 150, in_features = 512, rows = 21;
    const ops::Q8PackedMatrix w =
        ops::pack_for_q8(random_blocks(type, out_features, in_features, rng));
    const Tensor x = random_x(rows, in_features, rng);
    for (Q8Kernel kernel : ops::cpu::q8_kernels()) {
      Tensor all = poisoned_f32({rows, out_features});
      run(kernel, x, w, Tensor(), all);
      for (int64_t batch : {1, 3, 10}) {
        for (int64_t start = 0; start + batch <= rows; ++start) {
          Tensor part = poisoned_f32({batch, out_features});
          run(kernel, x.rows(start, start + batch), w, Tensor(), part);
          EXPECT_EQ(std::memcmp(part.data<float>(), all.data<float>() + start * out_features,
                                batch * out_features * sizeof(float)),
                    0)
              << ops::cpu::q8_kernel_name(kernel) << " rows " << start << ".." << start + batch;
        }
      }
    }
  }
}

// 32-bit fixed point (IntActivations::kFixed32), from its definition: a block's e is ilogb of its
// largest |x|, its unit 2^(e - 29); m = x / unit rounded to nearest even is four digits in
// [-128, 127], most significant first, plane p's scale 2^(e - 5 - 8 p). So the digits times the
// scales give x back exactly where |x| >= 2^(e - 6), and within half a unit elsewhere. Blocks of
// zeros, of values below 2^-96 and with a NaN or an infinity are the documented edge cases.
TEST(Fixed32Activations, DigitsGiveEachValueBack) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> mantissa(-1.f, 1.f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  for (int64_t block : {32, 256}) {
    const int64_t rows = 5, cols = 1024, nb = cols / block;
    Tensor x = random_f32({rows, cols}, rng);
    for (int64_t i = 0; i < rows * cols; ++i) {  // magnitudes over 2^40 within a block
      x.data<float>()[i] = std::ldexp(mantissa(rng), exponent(rng));
    }
    float* x0 = x.data<float>();
    std::fill(x0, x0 + block, 0.f);                               // row 0, block 0: zeros
    std::fill(x0 + block, x0 + 2 * block, 0x1p-100f);             // block 1: below 2^-96
    x0[2 * block + 3] = std::numeric_limits<float>::quiet_NaN();  // block 2: a NaN
    x0[3 * block] = 0x1p100f;  // block 3: one huge value beside small ones
    ops::cpu::Q8Activations q;
    ops::cpu::quantize_fixed32(x.data<float>(), rows, cols, q, block);
    ASSERT_EQ(q.rows, 4 * rows);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x.data<float>() + r * cols + b * block;
        float amax = 0.f;
        bool nan = false;
        for (int64_t k = 0; k < block; ++k) {
          nan |= std::isnan(xb[k]);
          amax = std::max(amax, std::fabs(xb[k]));
        }
        const std::string at = "block " + std::to_string(block) + " row " + std::to_string(r) +
                               " block " + std::to_string(b);
        const int e = std::ilogb(amax);
        const bool zero = amax == 0.f || e < -96;
        for (int p = 0; p < 4; ++p) {
          const int64_t plane = 4 * r + p;
          const float scale = q.scale[plane * nb + b];
          if (nan) {
            EXPECT_TRUE(std::isnan(scale)) << at;
          } else {
            EXPECT_EQ(scale, zero ? 0.f : std::ldexp(1.f, e - 5 - 8 * p)) << at << " plane " << p;
          }
          int32_t sum = 0;
          for (int64_t k = 0; k < block; ++k) sum += q.qs[plane * cols + b * block + k];
          EXPECT_EQ(q.sum[plane * nb + b], sum) << at;
          if (!nan) EXPECT_EQ(q.scaled_sum[plane * nb + b], scale * static_cast<float>(sum)) << at;
          for (int64_t h = 0; h < block / 16; ++h) {
            int32_t s16 = 0;
            for (int64_t k = 16 * h; k < 16 * h + 16; ++k)
              s16 += q.qs[plane * cols + b * block + k];
            EXPECT_EQ(q.sum16[(plane * cols + b * block) / 16 + h], s16) << at;
          }
        }
        if (nan || zero) {
          for (int p = 0; p < 4; ++p) {
            for (int64_t k = 0; k < block; ++k) {
              ASSERT_EQ(q.qs[(4 * r + p) * cols + b * block + k], 0) << at;
            }
          }
          continue;
        }
        const double unit = std::ldexp(1.0, e - 29);
        for (int64_t k = 0; k < block; ++k) {
          double value = 0;  // exact in double: 32 bits of digits
          for (int p = 0; p < 4; ++p) {
            value += static_cast<double>(q.qs[(4 * r + p) * cols + b * block + k]) *
                     std::ldexp(1.0, e - 5 - 8 * p);
          }
          if (std::fabs(xb[k]) >= std::ldexp(1.0, e - 6)) {
            ASSERT_EQ(value, static_cast<double>(xb[k])) << at << " element " << k;
          } else {
            ASSERT_LE(std::fabs(value - xb[k]), 0.5 * unit) << at << " element " << k;
          }
        }
      }
    }
  }
  ops::cpu::Q8Activations q;
  expect_error([&] { ops::cpu::quantize_fixed32(nullptr, 1, 288, q, 256); },
               {"288 columns are not whole blocks of 256"});
}

// 32-bit fixed point on the AVX2 kernels without VNNI, whose maddubs wants one side unsigned:
// Q8_0 and IQ4_NL give x's digits of -128 (two in every block here) their signs through the
// weights, and a Q8_0 quant of -128 (which ggml's quantizer does not write) sends the matrix to
// the portable kernel; either way the bits are the portable kernel's.
TEST(Fixed32Activations, Avx2KernelsCarryEverySign) {
  const std::vector<Q8Kernel> kernels = ops::cpu::q8_kernels();
  if (std::find(kernels.begin(), kernels.end(), Q8Kernel::kAvx2) == kernels.end()) {
    GTEST_SKIP() << "this build has no AVX2 kernel";
  }
  std::mt19937 rng(41);
  const int64_t rows = 5, out_features = 40, cols = 256;
  for (const QuantType type : {QuantType::kQ8_0, QuantType::kIQ4_NL}) {
    for (const bool minus_128 : {false, true}) {
      if (type != QuantType::kQ8_0 && minus_128) continue;
      QuantizedMatrix w = random_blocks(type, out_features, cols, rng);
      if (type == QuantType::kQ8_0) {
        for (size_t at = 0; at < w.blocks.size(); at += 34) {  // d, then 32 int8 quants
          for (size_t j = 2; j < 34; ++j) {
            uint8_t& q = w.blocks[at + j];
            if (j % 4 == 3) q |= 0x80;          // negative quants beside x's -128 digits
            if (q == 0x80) q = 0x81;            // -128 -> -127
            if (minus_128 && j == 5) q = 0x80;  // one -128 a block
          }
        }
      }
      const ops::Q8PackedMatrix packed = ops::pack_for_q8(w);
      EXPECT_EQ(packed.has_q_minus_128, minus_128);
      Tensor x = random_x(rows, cols, rng);
      for (int64_t i = 0; i < rows * cols; i += 32) {
        // |x| < 1 with 0.75 the largest: a unit of 2^-30, so -2^-23 is one digit of -128.
        float* b = x.data<float>() + i;
        for (int64_t k = 0; k < 32; ++k) b[k] = std::clamp(b[k] / 4.f, -0.7f, 0.7f);
        b[0] = 0.75f;
        b[7] = b[11] = -0x1p-23f;
      }
      Tensor want = poisoned_f32({rows, out_features}), got = poisoned_f32({rows, out_features});
      ops::cpu::linear_q8(x.data<float>(), packed, nullptr, want.data<float>(), rows,
                          Q8Kernel::kPortable, -1, ops::IntActivations::kFixed32);
      ops::cpu::linear_q8(x.data<float>(), packed, nullptr, got.data<float>(), rows,
                          Q8Kernel::kAvx2, -1, ops::IntActivations::kFixed32);
      EXPECT_EQ(std::memcmp(want.raw(), got.raw(), want.nbytes()), 0)
          << quant_format(type).name << (minus_128 ? " with quants of -128" : "");
    }
  }
}

TEST(Q8Linear, TensorEntryUsesTheFirstKernelAndChecksItsArguments) {
  std::mt19937 rng(1);
  const QuantizedMatrix q = random_blocks(QuantType::kQ4_1, 20, 64, rng);
  const ops::Q8PackedMatrix w = ops::pack_for_q8(q);
  const Tensor x = random_x(3, 64, rng);
  Tensor out = poisoned_f32({3, 20}), want = poisoned_f32({3, 20});
  ops::linear_q8(x, w, Tensor(), out);
  run(ops::cpu::q8_kernels().front(), x, w, Tensor(), want);
  EXPECT_EQ(std::memcmp(out.data<float>(), want.data<float>(), out.nbytes()), 0);
  expect_error([&] { ops::linear_q8(random_x(3, 96, rng), w, Tensor(), out); },
               {"linear (8-bit activations)", "x"});
  expect_error(
      [&] {
        ops::linear_q8(random_x(3, 96, rng), w, Tensor(), out, 0, ops::IntActivations::kFixed32);
      },
      {"linear (32-bit fixed-point activations)", "x"});
  expect_error([&] { ops::linear_q8(x, w, Tensor(), poisoned_f32({3, 19})); }, {"out"});
  // A wider out takes the weight's outputs at out_col0 (a projection's part): not past its end.
  expect_error(
      [&] {
        ops::linear_q8(x, w, Tensor(), poisoned_f32({3, 21}), 2);
      },
      {"out must be f32 [3, >= 22]"});
  expect_error([&] { ops::linear_q8(x, w, random_f32({19}, rng), out); }, {"bias"});
  ops::Q8PackedMatrix short_w = w;
  short_w.data.resize(short_w.data.size() - 1);
  expect_error([&] { ops::linear_q8(x, short_w, Tensor(), out); },
               {"packed weight does not match its shape [20, 64]"});
  QuantizedMatrix bad = q;
  bad.blocks.pop_back();
  expect_error([&] { (void)ops::pack_for_q8(bad); }, {"pack_for_q8", "[20, 64]"});
}

}  // namespace
}  // namespace pagedlm
