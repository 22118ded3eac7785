// config.json's quantization_config as the Hub's FP8 writers emit it (the key sets below are
// those of published configs: AutoFP8, Qwen3-FP8 / DeepSeek-V3, llm-compressor, fbgemm).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "io_test_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/io/quant_config.h"

namespace pagedlm {
namespace {

using nlohmann::json;

QuantConfig parse(const json& quantization_config) {
  return parse_quant_config(json{{"quantization_config", quantization_config}});
}

std::string error_of(const json& quantization_config) {
  try {
    parse(quantization_config);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

json float8(const std::string& strategy, bool dynamic) {
  return {{"num_bits", 8},
          {"type", "float"},
          {"strategy", strategy},
          {"symmetric", true},
          {"dynamic", dynamic},
          {"group_size", nullptr},
          {"block_structure", nullptr}};
}

TEST(QuantConfig, NoneWithoutTheKey) {
  EXPECT_FALSE(parse_quant_config(json{{"hidden_size", 8}}).quantized());
  EXPECT_FALSE(parse_quant_config(json{{"quantization_config", nullptr}}).quantized());
}

TEST(QuantConfig, AutoFp8PerTensorStatic) {
  const QuantConfig c = parse(
      {{"quant_method", "fp8"}, {"activation_scheme", "static"}, {"ignored_layers", {"lm_head"}}});
  EXPECT_EQ(c.method, QuantMethod::kFp8);
  const QuantScheme* s = c.scheme_for("model.layers.3.self_attn.q_proj");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->weights.layout, WeightScaleLayout::kTensor);
  EXPECT_EQ(s->weights.scale_suffix, "weight_scale");
  EXPECT_EQ(s->inputs, ActivationQuant::kStaticTensor);
  EXPECT_EQ(c.scheme_for("lm_head"), nullptr);
}

TEST(QuantConfig, Qwen3Fp8Blocks) {
  const QuantConfig c = parse({{"quant_method", "fp8"},
                               {"activation_scheme", "dynamic"},
                               {"fmt", "e4m3"},
                               {"weight_block_size", {128, 128}},
                               {"modules_to_not_convert", {"lm_head", "mlp.gate"}}});
  const QuantScheme* s = c.scheme_for("model.layers.0.mlp.experts.5.up_proj");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->weights.layout, WeightScaleLayout::kBlock);
  EXPECT_EQ(s->weights.block_rows, 128);
  EXPECT_EQ(s->weights.block_cols, 128);
  EXPECT_EQ(s->weights.scale_suffix, "weight_scale_inv");
  EXPECT_EQ(s->inputs, ActivationQuant::kDynamicToken);
  // Whole dotted components: the MoE router is ignored, gate_proj is not.
  EXPECT_EQ(c.scheme_for("model.layers.0.mlp.gate"), nullptr);
  EXPECT_NE(c.scheme_for("model.layers.0.mlp.gate_proj"), nullptr);
  EXPECT_CONTAINS(c.describe(),
                  "fp8: weights e4m3 per-block 128x128, activations dynamic per-token");
}

TEST(QuantConfig, CompressedTensorsGroupsTakeNameThenRegexThenLinear) {
  json blocks = float8("block", false);
  blocks["block_structure"] = {64, 32};
  const QuantConfig c = parse(
      {{"quant_method", "compressed-tensors"},
       {"format", "float-quantized"},
       {"ignore", {"lm_head", "re:.*layers\\.1\\..*"}},
       {"kv_cache_scheme", float8("tensor", false)},
       {"config_groups",
        {{"group_0",
          {{"targets", {"Linear"}},
           {"weights", float8("channel", false)},
           {"input_activations", float8("token", true)}}},
         {"group_1",
          {{"targets", {"re:.*self_attn\\.(q|k|v)_proj$"}},
           {"weights", float8("tensor", false)},
           {"input_activations", float8("tensor", false)}}},
         {"group_2", {{"targets", {"model.layers.0.self_attn.k_proj"}}, {"weights", blocks}}}}}});
  EXPECT_EQ(c.method, QuantMethod::kCompressedTensors);
  EXPECT_TRUE(c.kv_cache_scales);
  const QuantScheme* linear = c.scheme_for("model.layers.0.mlp.down_proj");
  ASSERT_NE(linear, nullptr);
  EXPECT_EQ(linear->weights.layout, WeightScaleLayout::kChannel);
  EXPECT_EQ(linear->inputs, ActivationQuant::kDynamicToken);
  const QuantScheme* regex = c.scheme_for("model.layers.0.self_attn.q_proj");
  ASSERT_NE(regex, nullptr);
  EXPECT_EQ(regex->weights.layout, WeightScaleLayout::kTensor);
  EXPECT_EQ(regex->inputs, ActivationQuant::kStaticTensor);
  const QuantScheme* named = c.scheme_for("model.layers.0.self_attn.k_proj");
  ASSERT_NE(named, nullptr);
  EXPECT_EQ(named->weights.layout, WeightScaleLayout::kBlock);
  EXPECT_EQ(named->weights.block_rows, 64);
  EXPECT_EQ(named->weights.block_cols, 32);
  EXPECT_EQ(named->inputs, ActivationQuant::kNone);
  // re: matches from the start of the name, as Python's re.match.
  EXPECT_EQ(c.scheme_for("model.layers.1.mlp.up_proj"), nullptr);
  EXPECT_EQ(c.scheme_for("lm_head"), nullptr);
}

TEST(QuantConfig, FbgemmPerChannelDynamicPerToken) {
  const QuantConfig c = parse({{"quant_method", "fbgemm_fp8"},
                               {"activation_scale_ub", 1200.0},
                               {"modules_to_not_convert", {"lm_head"}}});
  const QuantScheme* s = c.scheme_for("model.layers.0.mlp.gate_up_proj");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->weights.layout, WeightScaleLayout::kChannel);
  EXPECT_EQ(s->inputs, ActivationQuant::kDynamicToken);
  EXPECT_EQ(s->activation_scale_ub, 1200.0);
  EXPECT_EQ(c.scheme_for("lm_head"), nullptr);
}

TEST(QuantConfig, BadConfigsNameTheKey) {
  EXPECT_CONTAINS(error_of({{"quant_method", "awq"}}),
                  "\"quantization_config.quant_method\" is 'awq'");
  EXPECT_CONTAINS(error_of({{"bits", 4}}), "\"quantization_config.quant_method\" is missing");
  EXPECT_CONTAINS(error_of({{"quant_method", "fp8"}, {"weight_block_size", {0, 128}}}),
                  "\"quantization_config.weight_block_size\" must be two positive integers");
  EXPECT_CONTAINS(error_of({{"quant_method", "fp8"}, {"weight_block_size", {128}}}),
                  "weight_block_size");
  EXPECT_CONTAINS(error_of({{"quant_method", "fp8"}, {"fmt", "e5m2"}}), "e5m2");
  EXPECT_CONTAINS(error_of({{"quant_method", "fp8"}, {"activation_scheme", "sometimes"}}),
                  "activation_scheme");
  EXPECT_CONTAINS(error_of({{"quant_method", "fp8"}, {"modules_to_not_convert", "lm_head"}}),
                  "\"quantization_config.modules_to_not_convert\" must be a list of strings");
  EXPECT_CONTAINS(error_of({{"quant_method", "fbgemm_fp8"}, {"activation_scale_ub", -1}}),
                  "activation_scale_ub");

  json int4 = float8("group", false);
  int4["type"] = "int";
  int4["num_bits"] = 4;
  const json group = {{"targets", {"Linear"}}, {"weights", int4}};
  EXPECT_CONTAINS(error_of({{"quant_method", "compressed-tensors"},
                            {"format", "pack-quantized"},
                            {"config_groups", {{"group_0", group}}}}),
                  "\"quantization_config.format\" is 'pack-quantized'");
  EXPECT_CONTAINS(
      error_of({{"quant_method", "compressed-tensors"}, {"config_groups", {{"group_0", group}}}}),
      "\"quantization_config.config_groups.group_0.weights\" asks for 4-bit int");
  EXPECT_CONTAINS(
      error_of({{"quant_method", "compressed-tensors"}, {"config_groups", json::object()}}),
      "holds no group");
  EXPECT_CONTAINS(
      error_of({{"quant_method", "compressed-tensors"},
                {"config_groups",
                 {{"g", {{"targets", {"re:(unclosed"}}, {"weights", float8("tensor", false)}}}}}}),
      "bad regular expression 're:(unclosed'");
  json asymmetric = float8("channel", false);
  asymmetric["symmetric"] = false;
  EXPECT_CONTAINS(
      error_of({{"quant_method", "compressed-tensors"},
                {"config_groups", {{"g", {{"targets", {"Linear"}}, {"weights", asymmetric}}}}}}),
      "asymmetric");
  EXPECT_CONTAINS(error_of({{"quant_method", "compressed-tensors"},
                            {"config_groups",
                             {{"g",
                               {{"targets", {"Linear"}},
                                {"weights", float8("tensor", false)},
                                {"input_activations", float8("token", false)}}}}}}),
                  "static token scales");
  EXPECT_CONTAINS(
      error_of({{"quant_method", "compressed-tensors"},
                {"config_groups",
                 {{"g", {{"targets", {"Linear"}}, {"weights", float8("block", false)}}}}}}),
      "\"quantization_config.config_groups.g.weights.block_structure\" must be two "
      "positive integers");
}

}  // namespace
}  // namespace pagedlm
