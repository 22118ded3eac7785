// The weight seam: ops::LinearWeight (one type for every format a projection is kept in) and
// model/weights.h's WeightLoader (which format a checkpoint's projection loads into), and the
// compute dtype as an option (ModelOptions / EngineOptions::compute_dtype, --dtype).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "default_model_util.h"
#include "golden_fixture_util.h"
#include "ops_test_util.h"
#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/model.h"
#include "pagedlm/model/weights.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/linear_weight.h"

namespace pagedlm {
namespace {

using testing::expect_error;

// A CPU block projection of two formats (a Q4_K_M file's q / k / v are Q4_K and Q6_K): each part
// writes its own columns, every output the float64 product of the reference dequantization
// within the exact kernels' bound (64 float32 ulps of the sum of |terms|), the bias added.
TEST(LinearWeight, CpuBlockPartsFillTheirColumnsOfTheOutput) {
  std::mt19937 rng(11);
  const int64_t rows = 3, cols = 512;
  const std::vector<QuantizedMatrix> blocks = {
      testing::random_blocks(QuantType::kQ4_K, 24, cols, rng),
      testing::random_blocks(QuantType::kQ6_K, 8, cols, rng)};
  std::vector<ops::CpuBlockPart> parts;
  std::vector<std::vector<float>> weights;
  for (const QuantizedMatrix& q : blocks) {
    weights.push_back(testing::dequantized(q));
    ops::CpuBlockPart part;
    part.blocks = ops::repack_for_cpu(q);
    parts.push_back(std::move(part));
  }
  const ops::LinearWeight w = ops::LinearWeight::cpu_blocks(std::move(parts));
  EXPECT_EQ(w.format(), ops::WeightFormat::kCpuBlocks);
  EXPECT_EQ(w.out_features(), 32);
  EXPECT_EQ(w.in_features(), cols);
  EXPECT_EQ(w.bytes(), static_cast<int64_t>(w.cpu_parts()[0].blocks.blocks.size() +
                                            w.cpu_parts()[1].blocks.blocks.size()));
  std::map<std::string, int64_t> by_format;
  w.add_bytes(by_format);
  ASSERT_EQ(by_format.size(), 2u);
  EXPECT_EQ(by_format.begin()->second + by_format.rbegin()->second, w.bytes());

  const Tensor x = testing::random_f32({rows, cols}, rng);
  const Tensor bias = testing::random_f32({32}, rng);
  const Tensor out = testing::poisoned_f32({rows, 32});
  w.apply(x, bias, out, nullptr, nullptr, {});
  for (int64_t r = 0; r < rows; ++r) {
    int64_t col = 0;
    for (size_t p = 0; p < blocks.size(); ++p) {
      for (int64_t j = 0; j < blocks[p].rows; ++j, ++col) {
        double sum = 0, magnitude = 0;
        for (int64_t k = 0; k < cols; ++k) {
          const double term =
              static_cast<double>(x.data<float>()[r * cols + k]) * weights[p][j * cols + k];
          sum += term;
          magnitude += std::abs(term);
        }
        sum += bias.data<float>()[col];
        magnitude += std::abs(bias.data<float>()[col]);
        const double bound = 64 * magnitude * std::numeric_limits<float>::epsilon();
        EXPECT_NEAR(out.data<float>()[r * 32 + col], sum, bound) << "row " << r << " col " << col;
      }
    }
  }
}

TEST(LinearWeight, PartsOfDifferentWidthsAreRefused) {
  std::mt19937 rng(3);
  ops::CpuBlockPart a, b;
  a.blocks = testing::random_blocks(QuantType::kQ8_0, 4, 64, rng);
  b.blocks = testing::random_blocks(QuantType::kQ8_0, 4, 96, rng);
  expect_error(
      [&] {
        ops::LinearWeight::cpu_blocks({a, b});
      },
      {"parts have 64 and 96 input features"});
  expect_error([] { ops::LinearWeight::cpu_blocks({}); }, {"at least one part"});
  // No weight at all: a projection the model does not have.
  EXPECT_FALSE(ops::LinearWeight().defined());
  EXPECT_EQ(ops::LinearWeight().bytes(), 0);
}

// The loader's choice of format: dense f32 for a safetensors checkpoint on the CPU, blocks for
// the default GGUF (Q4_1 and a Q8_0 embedding), regrouped for the integer kernels when asked.
TEST(WeightLoader, PicksEachProjectionsFormatFromTheCheckpointAndOptions) {
  const Checkpoint dense = load_checkpoint(testing::fixture_dir("llama-gqa"));
  const ModelConfig& c = dense.config;
  const WeightPart o{"model.layers.0.self_attn.o_proj.weight",
                     {c.hidden_size, c.num_heads * c.head_dim},
                     Shard::kCols};
  WeightLoader loader(dense, Device::kCpu, {}, {});
  EXPECT_EQ(loader.compute_dtype(), DType::kF32);
  const ops::LinearWeight w = loader.linear({o});
  EXPECT_EQ(w.format(), ops::WeightFormat::kDense);
  EXPECT_EQ(w.dense_weight().dtype(), DType::kF32);
  EXPECT_EQ(w.out_features(), c.hidden_size);
  EXPECT_EQ(w.in_features(), c.num_heads * c.head_dim);
  // Two ranks: rank 1 holds the second half of o's input columns, the checkpoint's own values.
  WeightLoader rank1(dense, Device::kCpu, {1, 2}, {});
  const ops::LinearWeight half = rank1.linear({o});
  ASSERT_EQ(half.in_features(), c.num_heads * c.head_dim / 2);
  const Tensor full = dense.get(o.name, o.shape).to_f32();
  const int64_t in = c.num_heads * c.head_dim;
  for (int64_t r = 0; r < c.hidden_size; ++r) {
    for (int64_t k = 0; k < in / 2; ++k) {
      ASSERT_EQ(half.dense_weight().data<float>()[r * (in / 2) + k],
                full.data<float>()[r * in + in / 2 + k]);
    }
  }
  // Integer activations on a checkpoint without blocks: refused once the projections are loaded.
  ModelOptions int8;
  int8.cpu_int_activations = ops::IntActivations::kInt8;
  WeightLoader none(dense, Device::kCpu, {}, int8);
  (void)none.linear({o});
  expect_error([&] { none.check_options_used(); },
               {"--cpu-q8-activations", "in ggml's blocks", "this model has none"});
}

TEST(WeightLoader, TheDefaultGgufKeepsItsBlocks) {
  const std::string path = default_model_path();
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  const Checkpoint gguf = load_checkpoint(path);
  const ModelConfig& c = gguf.config;
  const WeightPart down{
      "model.layers.0.mlp.down_proj.weight", {c.hidden_size, c.intermediate_size}, Shard::kCols};
  WeightLoader exact(gguf, Device::kCpu, {}, {});
  const ops::LinearWeight blocks = exact.linear({down});
  ASSERT_EQ(blocks.format(), ops::WeightFormat::kCpuBlocks);
  ASSERT_EQ(blocks.cpu_parts().size(), 1u);
  EXPECT_TRUE(blocks.cpu_parts()[0].q8.empty());
  EXPECT_EQ(blocks.out_features(), c.hidden_size);
  EXPECT_EQ(blocks.in_features(), c.intermediate_size);
  ModelOptions fixed32;
  fixed32.cpu_int_activations = ops::IntActivations::kFixed32;
  WeightLoader integer(gguf, Device::kCpu, {}, fixed32);
  const ops::LinearWeight packed = integer.linear({down});
  ASSERT_EQ(packed.cpu_parts().size(), 1u);
  EXPECT_FALSE(packed.cpu_parts()[0].q8.empty());
  EXPECT_NE(packed.cpu_parts()[0].format().find("32-bit fixed-point activations"),
            std::string::npos);
  integer.check_options_used();  // a projection took them: no error
  // Three ranks split down's 1536 input columns into whole 32-weight blocks of 512.
  WeightLoader rank1(gguf, Device::kCpu, {1, 3}, {});
  EXPECT_EQ(rank1.linear({down}).in_features(), c.intermediate_size / 3);
}

// The lm_head's blocks (the default GGUF's tied Q8_0 embedding) take 32-bit fixed-point
// activations in the exact mode where the integer kernels take Q8_0 with VNNI, as exact as the
// exact kernels and faster one row at a time: packed, holding the same weights as the
// checkpoint's blocks, which the embedding also reads. The other projections keep the exact
// kernels, and integer activations asked for are the lm_head's too.
TEST(WeightLoader, TheLmHeadTakesFixedPointActivationsInTheExactMode) {
  const std::string path = default_model_path();
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  const Checkpoint gguf = load_checkpoint(path);
  const ModelConfig& c = gguf.config;
  ASSERT_TRUE(c.tie_word_embeddings);
  const std::string name = "model.embed_tokens.weight";
  const WeightPart embed{name, {c.vocab_size, c.hidden_size}, Shard::kRows};
  const QuantizedMatrix& blocks = gguf.quantized.at(name);
  ASSERT_EQ(blocks.type, QuantType::kQ8_0);
  WeightLoader exact(gguf, Device::kCpu, {}, {});
  const ops::LinearWeight head = exact.cpu_blocks({embed}, /*lm_head=*/true);
  ASSERT_EQ(head.cpu_parts().size(), 1u);
  const ops::CpuBlockPart& part = head.cpu_parts()[0];
  if (!ops::fixed32_on_vnni(QuantType::kQ8_0)) {
    EXPECT_TRUE(part.q8.empty()) << "without VNNI the lm_head keeps the exact kernels";
    return;
  }
  ASSERT_FALSE(part.q8.empty());
  EXPECT_EQ(part.q8_input, ops::IntActivations::kFixed32);
  EXPECT_NE(part.format().find("32-bit fixed-point activations"), std::string::npos);
  const std::vector<float> reference = testing::dequantized(blocks);
  std::vector<float> row(c.hidden_size);
  for (const int64_t r : {int64_t{0}, int64_t{1}, c.vocab_size / 2, c.vocab_size - 1}) {
    ops::dequantize_row(part.q8, r, row.data());
    for (int64_t k = 0; k < c.hidden_size; ++k) {
      ASSERT_EQ(row[k], reference[r * c.hidden_size + k]) << r << ", " << k;
    }
  }
  // Not the lm_head: the exact kernels.
  EXPECT_TRUE(exact.cpu_blocks({embed}).cpu_parts()[0].q8.empty());
  ModelOptions int8;
  int8.cpu_int_activations = ops::IntActivations::kInt8;
  WeightLoader q8(gguf, Device::kCpu, {}, int8);
  EXPECT_EQ(q8.cpu_blocks({embed}, /*lm_head=*/true).cpu_parts()[0].q8_input,
            ops::IntActivations::kInt8);
}

// A checkpoint of llama-gqa's config (hidden 256, intermediate 512) without tensors, for the
// random blocks a test puts in it.
Checkpoint gqa_blocks_checkpoint() {
  Checkpoint ckpt;
  ckpt.config = load_checkpoint(testing::fixture_dir("llama-gqa")).config;
  EXPECT_EQ(ckpt.config.hidden_size, 256);
  return ckpt;
}

// In the exact mode a Q2_K projection takes 32-bit fixed-point activations at every step where
// the integer kernels have VNNI (WeightLoader's exact_mode_takes_fixed32), a Q4_K one the exact
// kernels; either is the float64 product of the reference dequantization within the exact
// kernels' bound, one row and 9 rows alike.
TEST(WeightLoader, Q2KProjectionsTakeFixedPointActivationsInTheExactMode) {
  Checkpoint ckpt = gqa_blocks_checkpoint();
  ASSERT_EQ(ckpt.config.intermediate_size, 512);
  std::mt19937 rng(9);
  const std::string down = "model.layers.0.mlp.down_proj.weight";
  const std::string up = "model.layers.0.mlp.up_proj.weight";
  const QuantizedMatrix q2k = testing::random_blocks(QuantType::kQ2_K, 256, 512, rng);
  ckpt.quantized[down] = q2k;
  ckpt.quantized[up] = testing::random_blocks(QuantType::kQ4_K, 512, 256, rng);
  WeightLoader exact(ckpt, Device::kCpu, {}, {});
  const ops::LinearWeight w = exact.linear({{down, {256, 512}, Shard::kCols}});
  ASSERT_EQ(w.cpu_parts().size(), 1u);
  EXPECT_TRUE(exact.linear({{up, {512, 256}, Shard::kRows}}).cpu_parts()[0].q8.empty());
  if (!ops::fixed32_on_vnni(QuantType::kQ2_K)) {
    EXPECT_TRUE(w.cpu_parts()[0].q8.empty()) << "without VNNI Q2_K keeps the exact kernels";
  } else {
    ASSERT_FALSE(w.cpu_parts()[0].q8.empty());
    EXPECT_EQ(w.cpu_parts()[0].q8_input, ops::IntActivations::kFixed32);
  }
  const std::vector<float> weights = testing::dequantized(q2k);
  for (const int64_t rows : {int64_t{1}, int64_t{9}}) {
    const Tensor x = testing::random_f32({rows, 512}, rng);
    const Tensor out = testing::poisoned_f32({rows, 256});
    w.apply(x, Tensor(), out, nullptr, nullptr, {});
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < 256; ++j) {
        double sum = 0, magnitude = 0;
        for (int64_t k = 0; k < 512; ++k) {
          const double term =
              static_cast<double>(x.data<float>()[r * 512 + k]) * weights[j * 512 + k];
          sum += term;
          magnitude += std::abs(term);
        }
        const double bound = 64 * magnitude * std::numeric_limits<float>::epsilon();
        ASSERT_NEAR(out.data<float>()[r * 256 + j], sum, bound)
            << rows << " rows: " << r << ", " << j;
      }
    }
  }
}

// A tensor-parallel share of a block matrix is cut in whole blocks: rank 1 of 2 holds the second
// 256-weight Q4_K block of each row of down (512 input columns), the same weights; a share that
// would end inside a block (4 ranks: 128 columns) is refused by the tensor's name.
TEST(WeightLoader, SharesOfBlocksAreWholeBlocks) {
  Checkpoint ckpt = gqa_blocks_checkpoint();
  ASSERT_EQ(ckpt.config.intermediate_size, 512);
  std::mt19937 rng(5);
  const std::string name = "model.layers.0.mlp.down_proj.weight";
  const QuantizedMatrix blocks = testing::random_blocks(QuantType::kQ4_K, 256, 512, rng);
  ckpt.quantized[name] = blocks;
  const WeightPart down{name, {256, 512}, Shard::kCols};
  WeightLoader rank1(ckpt, Device::kCpu, {1, 2}, {});
  const ops::LinearWeight half = rank1.linear({down});
  ASSERT_EQ(half.format(), ops::WeightFormat::kCpuBlocks);
  ASSERT_EQ(half.in_features(), 256);
  const std::vector<float> full = testing::dequantized(blocks);
  const std::vector<float> share = testing::dequantized(half.cpu_parts()[0].blocks);
  for (int64_t r = 0; r < 256; ++r) {
    for (int64_t k = 0; k < 256; ++k) {
      ASSERT_EQ(share[r * 256 + k], full[r * 512 + 256 + k]) << r << ", " << k;
    }
  }
  WeightLoader quarter(ckpt, Device::kCpu, {1, 4}, {});
  expect_error([&] { quarter.linear({down}); }, {name, "256-weight blocks", "inside a block"});
}

// The compute dtype is an option; the kernels take the device's own only, and the model refuses
// another before it loads a weight (the engine's and the command line's refusals:
// engine_compute_dtype_test.cc).
TEST(WeightLoader, OnlyTheDevicesComputeDtypeIsTaken) {
  const Checkpoint checkpoint = load_checkpoint(testing::fixture_dir("llama-gqa"));
  ModelOptions model;
  model.compute_dtype = DType::kF16;
  expect_error([&] { create_model(checkpoint, Device::kCpu, {}, nullptr, model); },
               {"the CPU computes in f32, not in f16"});
  model.compute_dtype = DType::kF32;
  EXPECT_EQ(create_model(checkpoint, Device::kCpu, {}, nullptr, model)->compute_dtype(),
            DType::kF32);
}

}  // namespace
}  // namespace pagedlm
