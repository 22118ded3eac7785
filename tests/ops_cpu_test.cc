// The dense CPU ops against plain double-precision references on random shapes and data.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numbers>
#include <numeric>
#include <random>
#include <vector>

#include "ops_test_util.h"
#include "pagedlm/core/parallel.h"
#include "pagedlm/ops/embedding.h"
#include "pagedlm/ops/exp_cpu.h"
#include "pagedlm/ops/gather_rows.h"
#include "pagedlm/ops/gelu_tanh_mul.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/paged_attention.h"
#include "pagedlm/ops/rms_norm.h"
#include "pagedlm/ops/rope.h"
#include "pagedlm/ops/silu_mul.h"
#include "pagedlm/ops/softcap.h"

namespace pagedlm {
namespace {

using testing::expect_close;
using testing::expect_error;
using testing::poisoned_f32;
using testing::random_f32;

std::vector<int32_t> random_ids(int64_t n, int32_t hi, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> dist(0, hi - 1);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = dist(rng);
  return ids;
}

TEST(Embedding, CopiesTableRows) {
  std::mt19937 rng(1);
  const int64_t vocab = 97, dim = 48;
  Tensor table = random_f32({vocab, dim}, rng);
  std::vector<int32_t> id_values = random_ids(23, vocab, rng);
  id_values[0] = 0;
  id_values[1] = vocab - 1;
  Tensor ids = Tensor::from_i32(id_values, {23});
  Tensor out = poisoned_f32({23, dim});
  ops::embedding(table, ids, out);
  for (int64_t t = 0; t < 23; ++t) {
    EXPECT_EQ(std::memcmp(out.data<float>() + t * dim, table.data<float>() + id_values[t] * dim,
                          dim * sizeof(float)),
              0)
        << "token " << t;
  }
}

// Gemma scales its embeddings by sqrt(hidden_size). One f32 product of two floats is the exact
// (double) product rounded once, so the result must equal that rounding bit for bit.
TEST(Embedding, ScalesRowsInF32) {
  std::mt19937 rng(21);
  const int64_t vocab = 61, dim = 40, n = 17;
  Tensor table = random_f32({vocab, dim}, rng, -2.f, 2.f);
  const std::vector<int32_t> id_values = random_ids(n, vocab, rng);
  for (const float scale : {48.f, static_cast<float>(std::sqrt(3072.0)), 0.3f}) {
    Tensor out = poisoned_f32({n, dim});
    ops::embedding(table, Tensor::from_i32(id_values, {n}), out, nullptr, scale);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < dim; ++i) {
        const double want = static_cast<double>(table.data<float>()[id_values[t] * dim + i]) *
                            static_cast<double>(scale);
        ASSERT_EQ(out.data<float>()[t * dim + i], static_cast<float>(want))
            << "scale " << scale << " token " << t << " element " << i;
      }
    }
  }
}

TEST(Embedding, RejectsOutOfRangeIdsAndBadShapes) {
  std::mt19937 rng(2);
  Tensor table = random_f32({10, 4}, rng);
  Tensor out = poisoned_f32({3, 4});
  expect_error(
      [&] {
        ops::embedding(table, Tensor::from_i32({1, 10, 2}, {3}), out);
      },
      {"embedding", "id 10", "position 1"});
  expect_error(
      [&] {
        ops::embedding(table, Tensor::from_i32({-1, 0, 2}, {3}), out);
      },
      {"embedding", "id -1"});
  expect_error(
      [&] {
        ops::embedding(table, Tensor::from_i32({1, 2, 3}, {3}), poisoned_f32({3, 5}));
      },
      {"embedding", "out"});
  expect_error(
      [&] {
        ops::embedding(table, Tensor::from_f32({1, 2, 3}, {3}), out);
      },
      {"embedding", "ids", "i32"});
}

// x * rsqrt(mean(x^2) + eps) * (weight_offset + w), all in double.
std::vector<double> rms_norm_ref(const float* x, const float* w, int64_t rows, int64_t dim,
                                 double eps, double weight_offset = 0.0) {
  std::vector<double> out(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    double sum_sq = 0;
    for (int64_t i = 0; i < dim; ++i) sum_sq += double(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(sum_sq / dim + eps);
    for (int64_t i = 0; i < dim; ++i) {
      out[r * dim + i] = x[r * dim + i] * inv * (weight_offset + w[i]);
    }
  }
  return out;
}

TEST(RmsNorm, MatchesDoubleReference) {
  std::mt19937 rng(3);
  for (auto [rows, dim] : {std::pair<int64_t, int64_t>{1, 8}, {5, 64}, {37, 257}, {64, 128}}) {
    Tensor x = random_f32({rows, dim}, rng, -3.f, 3.f);
    Tensor w = random_f32({dim}, rng, 0.8f, 1.2f);
    Tensor out = poisoned_f32({rows, dim});
    ops::rms_norm(x, w, 1e-5f, out);
    expect_close(out, rms_norm_ref(x.data<float>(), w.data<float>(), rows, dim, 1e-5), 1e-6,
                 "rms_norm");
  }
}

TEST(RmsNorm, FusedResidualAdd) {
  std::mt19937 rng(4);
  const int64_t rows = 19, dim = 96;
  Tensor residual = random_f32({rows, dim}, rng);
  Tensor x = random_f32({rows, dim}, rng);
  Tensor w = random_f32({dim}, rng, 0.8f, 1.2f);
  std::vector<float> sum(rows * dim);
  std::vector<double> sum_ref(rows * dim);
  for (int64_t i = 0; i < rows * dim; ++i) {
    sum[i] = residual.data<float>()[i] + x.data<float>()[i];
    sum_ref[i] = sum[i];
  }
  Tensor out = poisoned_f32({rows, dim});
  ops::add_rms_norm(residual, x, w, 1e-6f, out);
  expect_close(residual, sum_ref, 1e-7, "add_rms_norm residual");
  expect_close(out, rms_norm_ref(sum.data(), w.data<float>(), rows, dim, 1e-6), 1e-6,
               "add_rms_norm out");
}

// Gemma's norms scale by 1 + w with w near 0; the reference adds the offset to w in double.
TEST(RmsNorm, WeightOffsetOnEveryNorm) {
  std::mt19937 rng(22);
  const float eps = 1e-6f, offset = 1.f;
  const int64_t rows = 13, dim = 160;
  Tensor w = random_f32({dim}, rng, -0.3f, 0.3f);
  {
    Tensor x = random_f32({rows, dim}, rng, -3.f, 3.f);
    Tensor out = poisoned_f32({rows, dim});
    ops::rms_norm(x, w, eps, out, nullptr, offset);
    expect_close(out, rms_norm_ref(x.data<float>(), w.data<float>(), rows, dim, eps, offset), 1e-6,
                 "rms_norm + offset");
  }
  {
    Tensor residual = random_f32({rows, dim}, rng);
    Tensor x = random_f32({rows, dim}, rng);
    std::vector<float> sum(rows * dim);
    for (int64_t i = 0; i < rows * dim; ++i) {
      sum[i] = residual.data<float>()[i] + x.data<float>()[i];
    }
    Tensor out = poisoned_f32({rows, dim});
    ops::add_rms_norm(residual, x, w, eps, out, nullptr, offset);
    expect_close(out, rms_norm_ref(sum.data(), w.data<float>(), rows, dim, eps, offset), 1e-6,
                 "add_rms_norm + offset");
  }
  {  // heads 1 and 2 of 4 (head_dim 32) in every row normalized in place, the rest untouched
    const int64_t head_dim = 32, width = 4 * head_dim;
    Tensor hw = random_f32({head_dim}, rng, -0.3f, 0.3f);
    Tensor x = random_f32({rows, width}, rng, -3.f, 3.f);
    const std::vector<float> before(x.data<float>(), x.data<float>() + rows * width);
    ops::head_rms_norm(x, 1, 2, head_dim, hw, eps, nullptr, offset);
    std::vector<double> want(before.begin(), before.end());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 1; h < 3; ++h) {
        const int64_t at = r * width + h * head_dim;
        const std::vector<double> head =
            rms_norm_ref(before.data() + at, hw.data<float>(), 1, head_dim, eps, offset);
        std::copy(head.begin(), head.end(), want.begin() + at);
      }
    }
    expect_close(x, want, 1e-6, "head_rms_norm + offset");
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i : {int64_t{0}, head_dim - 1, 3 * head_dim, width - 1}) {
        EXPECT_EQ(x.data<float>()[r * width + i], before[r * width + i]) << "row " << r << " " << i;
      }
    }
  }
}

TEST(RmsNorm, ErrorsNameOpAndTensor) {
  std::mt19937 rng(5);
  Tensor x = random_f32({4, 8}, rng);
  expect_error(
      [&] {
        ops::rms_norm(x, random_f32({7}, rng), 1e-5f, poisoned_f32({4, 8}));
      },
      {"rms_norm", "weight", "[8]", "[7]"});
  expect_error(
      [&] {
        ops::add_rms_norm(random_f32({3, 8}, rng), x, random_f32({8}, rng), 1e-5f, x);
      },
      {"add_rms_norm", "residual"});
  Tensor bf16 = Tensor::empty(DType::kBF16, {4, 8});
  expect_error([&] { ops::rms_norm(bf16, random_f32({8}, rng), 1e-5f, x); },
               {"rms_norm", "x", "bf16"});
}

std::vector<double> linear_ref(const Tensor& x, const Tensor& w, const float* bias) {
  const int64_t rows = x.dim(0), k = x.dim(1), n = w.dim(0);
  std::vector<double> out(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = bias ? bias[j] : 0.0;
      for (int64_t i = 0; i < k; ++i)
        acc += double(x.data<float>()[r * k + i]) * w.data<float>()[j * k + i];
      out[r * n + j] = acc;
    }
  }
  return out;
}

TEST(Linear, MatchesDoubleReference) {
  std::mt19937 rng(6);
  for (int64_t rows : {1, 15, 16, 17, 40}) {
    for (bool with_bias : {false, true}) {
      std::uniform_int_distribution<int64_t> dim(1, 300);
      const int64_t k = dim(rng), n = dim(rng);
      Tensor x = random_f32({rows, k}, rng);
      Tensor w = random_f32({n, k}, rng);
      Tensor bias = with_bias ? random_f32({n}, rng) : Tensor();
      Tensor out = poisoned_f32({rows, n});
      ops::linear(x, w, bias, out);
      expect_close(out, linear_ref(x, w, with_bias ? bias.data<float>() : nullptr), 1e-5,
                   cat("linear rows=", rows, " k=", k, " n=", n, " bias=", with_bias));
    }
  }
}

// The requirement: a row's output bits do not depend on the batch around it. The shapes include
// ones where plain OpenBLAS calls give a row different bits at different places in a batch.
TEST(Linear, BatchInvariant) {
  std::mt19937 rng(7);
  for (auto [k, n] : {std::pair<int64_t, int64_t>{576, 1536}, {256, 512}, {64, 96}, {300, 13}}) {
    Tensor w = random_f32({n, k}, rng);
    Tensor bias = random_f32({n}, rng);
    Tensor row = random_f32({1, k}, rng);
    Tensor alone = poisoned_f32({1, n});
    ops::linear(row, w, bias, alone);
    std::vector<std::pair<int64_t, int64_t>> placements = {{1, 0}, {3, 2}, {17, 16}, {17, 5}};
    for (int64_t offset = 0; offset < 40; ++offset) placements.push_back({40, offset});
    for (auto [batch, offset] : placements) {
      Tensor x = random_f32({batch, k}, rng);
      std::memcpy(x.data<float>() + offset * k, row.data<float>(), k * sizeof(float));
      Tensor out = poisoned_f32({batch, n});
      ops::linear(x, w, bias, out);
      EXPECT_EQ(std::memcmp(out.data<float>() + offset * n, alone.data<float>(), n * sizeof(float)),
                0)
          << "k " << k << " n " << n << " batch " << batch << " offset " << offset;
    }
  }
}

// Fixed column chunks make the bits independent of the thread count as well.
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

TEST(Linear, ErrorsNameTensor) {
  std::mt19937 rng(8);
  Tensor x = random_f32({2, 8}, rng);
  expect_error(
      [&] {
        ops::linear(x, random_f32({4, 9}, rng), Tensor(), poisoned_f32({2, 4}));
      },
      {"linear", "weight"});
  expect_error(
      [&] {
        ops::linear(x, random_f32({4, 8}, rng), random_f32({5}, rng), poisoned_f32({2, 4}));
      },
      {"linear", "bias"});
}

// Reference rope: the angle is rounded to float32 exactly as HF (and the contract) do it, the
// rest runs in double.
void rope_ref(std::vector<double>& x, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
              const std::vector<int32_t>& positions, const std::vector<float>& inv_freq) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < n_heads; ++h) {
      double* v = x.data() + (t * n_heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<float>(positions[t]) * inv_freq[i];
        const double x1 = v[i], x2 = v[i + half];
        v[i] = x1 * std::cos(angle) - x2 * std::sin(angle);
        v[i + half] = x2 * std::cos(angle) + x1 * std::sin(angle);
      }
    }
  }
}

TEST(Rope, MatchesDoubleReference) {
  std::mt19937 rng(9);
  for (auto [n_tokens, n_q, n_kv, head_dim] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 4, 2, 64},
        {13, 9, 3, 64},
        {40, 16, 8, 128},
        {7, 2, 1, 32}}) {
    std::vector<float> inv_freq(head_dim / 2);
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / head_dim));
    }
    std::vector<int32_t> positions = random_ids(n_tokens, 5000, rng);
    Tensor q = random_f32({n_tokens, n_q, head_dim}, rng);
    Tensor k = random_f32({n_tokens, n_kv, head_dim}, rng);
    std::vector<double> q_ref(q.data<float>(), q.data<float>() + q.numel());
    std::vector<double> k_ref(k.data<float>(), k.data<float>() + k.numel());
    rope_ref(q_ref, n_tokens, n_q, head_dim, positions, inv_freq);
    rope_ref(k_ref, n_tokens, n_kv, head_dim, positions, inv_freq);
    ops::rope(q, k, Tensor::from_i32(positions, {n_tokens}),
              Tensor::from_f32(inv_freq, {head_dim / 2}));
    expect_close(q, q_ref, 1e-6, "rope q");
    expect_close(k, k_ref, 1e-6, "rope k");
  }
}

TEST(Rope, PositionZeroIsIdentityAndErrors) {
  std::mt19937 rng(10);
  Tensor q = random_f32({1, 2, 8}, rng);
  Tensor k = random_f32({1, 1, 8}, rng);
  const std::vector<float> q0(q.data<float>(), q.data<float>() + q.numel());
  ops::rope(q, k, Tensor::from_i32({0}, {1}), Tensor::from_f32({1.f, .1f, .01f, .001f}, {4}));
  EXPECT_EQ(std::memcmp(q.data<float>(), q0.data(), q0.size() * sizeof(float)), 0);
  expect_error([&] { ops::rope(q, k, Tensor::from_i32({0}, {1}), Tensor::from_f32({1.f}, {1})); },
               {"rope", "inv_freq"});
  expect_error(
      [&] {
        ops::rope(q, random_f32({1, 1, 6}, rng), Tensor::from_i32({0}, {1}),
                  Tensor::from_f32({1.f, .1f, .01f, .001f}, {4}));
      },
      {"rope", "k"});
}

// The engine's CPU path from one fused projection row per token: q rotated into its own buffer,
// k rotated and v as is into the cache slots the plan maps them to, and the fused rows untouched.
TEST(RopeWriteKv, RotatesAndWritesFusedRows) {
  std::mt19937 rng(11);
  const int64_t n_tokens = 11, n_q = 4, n_kv = 2, head_dim = 64, num_pages = 5, page_size = 4;
  const int64_t q_width = n_q * head_dim, kv_width = n_kv * head_dim;
  const int64_t width = q_width + 2 * kv_width, num_slots = num_pages * page_size;
  std::vector<float> inv_freq(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / head_dim));
  }
  const Tensor qkv = random_f32({n_tokens, width}, rng);
  const std::vector<float> qkv_before(qkv.data<float>(), qkv.data<float>() + qkv.numel());
  Tensor k_cache = random_f32({num_pages, page_size, n_kv, head_dim}, rng);
  Tensor v_cache = random_f32({num_pages, page_size, n_kv, head_dim}, rng);
  std::vector<double> k_want(k_cache.data<float>(), k_cache.data<float>() + k_cache.numel());
  std::vector<float> v_want(v_cache.data<float>(), v_cache.data<float>() + v_cache.numel());
  const std::vector<int32_t> positions = random_ids(n_tokens, 4000, rng);
  std::vector<int32_t> slots(num_slots);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(n_tokens);
  slots[2] = -1;  // padding: not written
  ops::AttentionPlan plan;
  plan.positions = Tensor::from_i32(positions, {n_tokens});
  plan.slot_mapping = Tensor::from_i32(slots, {n_tokens});
  const Tensor inv_freq_t = Tensor::from_f32(inv_freq, {head_dim / 2});

  std::vector<double> q_want, k_rows;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* row = qkv.data<float>() + t * width;
    q_want.insert(q_want.end(), row, row + q_width);
    k_rows.insert(k_rows.end(), row + q_width, row + q_width + kv_width);
  }
  rope_ref(q_want, n_tokens, n_q, head_dim, positions, inv_freq);
  rope_ref(k_rows, n_tokens, n_kv, head_dim, positions, inv_freq);
  for (int64_t t = 0; t < n_tokens; ++t) {
    if (slots[t] < 0) continue;
    const float* v_row = qkv.data<float>() + t * width + q_width + kv_width;
    std::copy_n(&k_rows[t * kv_width], kv_width, &k_want[slots[t] * kv_width]);
    std::copy_n(v_row, kv_width, &v_want[slots[t] * kv_width]);
  }

  Tensor q = poisoned_f32({n_tokens, n_q, head_dim});
  ops::rope_write_kv(qkv, inv_freq_t, plan, q, k_cache, v_cache);
  expect_close(q, q_want, 1e-6, "q");
  expect_close(k_cache, k_want, 1e-6, "k cache");
  EXPECT_EQ(std::memcmp(v_cache.data<float>(), v_want.data(), v_cache.nbytes()), 0);
  EXPECT_EQ(std::memcmp(qkv.data<float>(), qkv_before.data(), qkv.nbytes()), 0);

  expect_error(
      [&] {
        ops::rope_write_kv(random_f32({n_tokens, width - head_dim}, rng), inv_freq_t, plan, q,
                           k_cache, v_cache);
      },
      {"rope_write_kv", "qkv"});
  slots[0] = static_cast<int32_t>(num_slots);
  plan.slot_mapping = Tensor::from_i32(slots, {n_tokens});
  expect_error([&] { ops::rope_write_kv(qkv, inv_freq_t, plan, q, k_cache, v_cache); },
               {"write_kv", "slot 20", "token 0"});
}

// The vectorizable exp of the softmax and SiLU loops against libm's double exp.
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

TEST(SiluMul, MatchesDoubleReference) {
  std::mt19937 rng(11);
  for (auto [n_tokens, ffn] : {std::pair<int64_t, int64_t>{1, 64}, {9, 333}, {33, 512}}) {
    Tensor gate_up = random_f32({n_tokens, 2 * ffn}, rng, -6.f, 6.f);
    Tensor out = poisoned_f32({n_tokens, ffn});
    ops::silu_mul(gate_up, out);
    std::vector<double> want(n_tokens * ffn);
    for (int64_t t = 0; t < n_tokens; ++t) {
      for (int64_t i = 0; i < ffn; ++i) {
        const double g = gate_up.data<float>()[t * 2 * ffn + i];
        const double u = gate_up.data<float>()[t * 2 * ffn + ffn + i];
        want[t * ffn + i] = g / (1 + std::exp(-g)) * u;
      }
    }
    expect_close(out, want, 1e-6, "silu_mul");
  }
  expect_error(
      [&] {
        ops::silu_mul(random_f32({2, 7}, rng), poisoned_f32({2, 3}));
      },
      {"silu_mul", "odd"});
}

// HF's gelu_pytorch_tanh in double: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
double gelu_tanh_ref(double g) {
  return 0.5 * g *
         (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (g + 0.044715 * g * g * g)));
}

TEST(GeluTanhMul, MatchesDoubleReference) {
  std::mt19937 rng(23);
  for (auto [n_tokens, ffn] : {std::pair<int64_t, int64_t>{1, 64}, {9, 333}, {33, 512}}) {
    Tensor gate_up = random_f32({n_tokens, 2 * ffn}, rng, -8.f, 8.f);
    Tensor out = poisoned_f32({n_tokens, ffn});
    ops::gelu_tanh_mul(gate_up, out);
    std::vector<double> want(n_tokens * ffn);
    for (int64_t t = 0; t < n_tokens; ++t) {
      for (int64_t i = 0; i < ffn; ++i) {
        const double g = gate_up.data<float>()[t * 2 * ffn + i];
        const double u = gate_up.data<float>()[t * 2 * ffn + ffn + i];
        want[t * ffn + i] = gelu_tanh_ref(g) * u;
      }
    }
    expect_close(out, want, 1e-6, "gelu_tanh_mul");
  }
  expect_error(
      [&] {
        ops::gelu_tanh_mul(random_f32({2, 7}, rng), poisoned_f32({2, 3}));
      },
      {"gelu_tanh_mul", "odd"});
}

// Element by element over a dense sweep of gates and up = 1, including |g| so large that g^3
// overflows: no NaN, and each value within 3e-6 of the reference relatively. That is a few ulps
// more than elsewhere because the negative tail is g e^(-2|y|) (y ~ -g^3): the rounding of y in
// f32 becomes a relative error of |2y| ulps (2.3e-6 at g = -5), whatever form computes it. Plus
// an absolute 1e-12 |g| for the far tail, where the double reference's 1 + tanh(y) keeps only
// ~1e-16 of absolute precision and so no relative one.
TEST(GeluTanhMul, ElementwiseOverAWideRange) {
  std::vector<float> gates;
  for (float g = -20.f; g <= 20.f; g += 1.0e-3f) gates.push_back(g);
  for (float g : {50.f, 1e3f, 1e6f, 1e13f, 3e38f}) {
    gates.push_back(g);
    gates.push_back(-g);
  }
  const auto n = static_cast<int64_t>(gates.size());
  std::vector<float> gate_up(2 * n);
  for (int64_t i = 0; i < n; ++i) {
    gate_up[i] = gates[i];
    gate_up[n + i] = 1.f;
  }
  Tensor out = poisoned_f32({1, n});
  ops::gelu_tanh_mul(Tensor::from_f32(gate_up, {1, 2 * n}), out);
  for (int64_t i = 0; i < n; ++i) {
    const double g = gates[i], want = gelu_tanh_ref(g), got = out.data<float>()[i];
    ASSERT_TRUE(std::isfinite(got)) << "g " << g;
    ASSERT_LE(std::abs(got - want), 3e-6 * std::abs(want) + 1e-12 * std::abs(g)) << "g " << g;
  }
}

// Gemma 2's final logit soft-cap against the double formula, element by element: tanh in f32
// keeps a few ulps of relative precision over the whole range, small logits included.
TEST(Softcap, MatchesDoubleReference) {
  std::mt19937 rng(24);
  for (const float cap : {30.f, 50.f}) {
    Tensor x = random_f32({7, 1001}, rng, -400.f, 400.f);
    // Small logits, where tanh(x / cap) ~ x / cap, and exact zeros.
    for (int64_t i = 0; i < 1001; ++i) x.data<float>()[1001 + i] *= 1e-4f;
    x.data<float>()[5] = 0.f;
    const std::vector<float> before(x.data<float>(), x.data<float>() + x.numel());
    ops::softcap(x, cap);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double want = cap * std::tanh(static_cast<double>(before[i]) / cap);
      const double got = x.data<float>()[i];
      ASSERT_LE(std::abs(got - want), 5e-7 * std::abs(want)) << "x " << before[i];
      ASSERT_LE(std::abs(got), cap);
    }
  }
  Tensor x = Tensor::from_f32({1.f, 2.f}, {2});
  expect_error([&] { ops::softcap(x, 0.f); }, {"softcap", "cap"});
  expect_error([&] { ops::softcap(Tensor::empty(DType::kBF16, {2}), 30.f); }, {"softcap", "bf16"});
}

TEST(GatherRows, CopiesRowsAndChecksIndices) {
  std::mt19937 rng(12);
  Tensor x = random_f32({30, 17}, rng);
  const std::vector<int32_t> rows = {29, 0, 5, 5, 12};
  Tensor out = poisoned_f32({5, 17});
  ops::gather_rows(x, Tensor::from_i32(rows, {5}), out);
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(
        std::memcmp(out.data<float>() + i * 17, x.data<float>() + rows[i] * 17, 17 * sizeof(float)),
        0);
  }
  expect_error(
      [&] {
        ops::gather_rows(x, Tensor::from_i32({3, 30}, {2}), poisoned_f32({2, 17}));
      },
      {"gather_rows", "30"});
}

}  // namespace
}  // namespace pagedlm
