// FP8 checkpoints as the loader keeps them (model/fp8_weights.h): the fixtures' e4m3 weights and
// scales, and every malformed variant refused with the tensor or key named. The logits of the
// four FP8 fixtures are checked against their float64 references in golden_fixtures_test.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "io_test_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/io/safetensors.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/model.h"

namespace pagedlm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

// Values from the OCP 8-bit floating point specification (E4M3: bias 7, no infinities).
TEST(Fp8, E4m3DecodesPerTheSpecification) {
  EXPECT_EQ(f8e4m3_to_f32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(f8e4m3_to_f32(0x80)));
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);  // 0.0111.000
  EXPECT_EQ(f8e4m3_to_f32(0xb8), -1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);     // largest normal: 0.1111.110
  EXPECT_EQ(f8e4m3_to_f32(0x08), 0x1p-6f);    // smallest normal
  EXPECT_EQ(f8e4m3_to_f32(0x07), 0x1.cp-7f);  // largest subnormal: 7/8 x 2^-6
  EXPECT_EQ(f8e4m3_to_f32(0x01), 0x1p-9f);    // smallest subnormal
  EXPECT_EQ(f8e4m3_to_f32(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0xff)));
}

struct Fp8FixtureCase {
  const char* name;
  size_t fp8_matrices;  // projections per layer x 2 layers
  WeightScaleLayout down_proj_layout;
  ActivationQuant down_proj_inputs;
  size_t kv_scales;
};

class Fp8Fixture : public ::testing::TestWithParam<Fp8FixtureCase> {};

TEST_P(Fp8Fixture, WeightsStayE4m3WithTheirScales) {
  const Fp8FixtureCase& want = GetParam();
  const Checkpoint ckpt = load_checkpoint(testing::fixture_dir(want.name));
  EXPECT_TRUE(ckpt.quantization.quantized());
  EXPECT_EQ(ckpt.fp8.size(), want.fp8_matrices);
  EXPECT_EQ(ckpt.kv_scales.size(), want.kv_scales);
  const Fp8Matrix& down = ckpt.fp8.at("model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(down.weight.dtype(), DType::kF8E4M3);
  EXPECT_EQ(down.spec.layout, want.down_proj_layout);
  EXPECT_EQ(down.inputs, want.down_proj_inputs);
  // No scale is left among the plain tensors; the lm_head stays bf16.
  for (const auto& [name, t] : ckpt.tensors) {
    EXPECT_EQ(name.find("scale"), std::string::npos) << name;
    EXPECT_NE(t.dtype(), DType::kF8E4M3) << name;
  }
  // get() dequantizes: element (0, 0) is the file's e4m3 byte times the file's first scale
  // (each layout's first scale covers it).
  const SafetensorsFile file =
      SafetensorsFile::open(testing::fixture_dir(want.name) + "/model.safetensors");
  const Tensor& raw = file.tensors().at("model.layers.1.mlp.down_proj.weight");
  const Tensor got = ckpt.get("model.layers.1.mlp.down_proj.weight", {128, 256});
  EXPECT_EQ(got.dtype(), DType::kF32);
  const float scale = down.scale.to_f32().data<float>()[0];
  EXPECT_EQ(got.data<float>()[0], f8e4m3_to_f32(raw.data<uint8_t>()[0]) * scale);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, Fp8Fixture,
    ::testing::Values(Fp8FixtureCase{"fp8-tensor", 14, WeightScaleLayout::kTensor,
                                     ActivationQuant::kStaticTensor, 0},
                      Fp8FixtureCase{"fp8-block", 14, WeightScaleLayout::kBlock,
                                     ActivationQuant::kDynamicToken, 0},
                      Fp8FixtureCase{"ct-mixed", 14, WeightScaleLayout::kBlock,
                                     ActivationQuant::kDynamicToken, 4},
                      // Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj.
                      Fp8FixtureCase{"fbgemm", 8, WeightScaleLayout::kChannel,
                                     ActivationQuant::kDynamicToken, 0}),
    [](const auto& info) {
      std::string n = info.param.name;
      for (char& c : n) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
      return n;
    });

// fbgemm_fp8's clamp of per-token input scales travels with each weight to its GEMM.
TEST(Fp8, FbgemmWeightsCarryTheActivationScaleBound) {
  const Checkpoint ckpt = load_checkpoint(testing::fixture_dir("fbgemm"));
  EXPECT_EQ(ckpt.fp8.at("model.layers.0.self_attn.qkv_proj.weight").activation_scale_ub, 1200.0);
  const Checkpoint tensor = load_checkpoint(testing::fixture_dir("fp8-tensor"));
  EXPECT_EQ(tensor.fp8.at("model.layers.0.self_attn.q_proj.weight").activation_scale_ub, 0.0);
}

// W8A8 GEMMs are a GPU path: asking for them on the CPU is refused by name; the CPU computes an
// FP8 checkpoint from its dequantized float32 weights.
TEST(Fp8, QuantizationFp8OnTheCpuIsRefused) {
  const Checkpoint ckpt = load_checkpoint(testing::fixture_dir("fp8-tensor"));
  ModelOptions options;
  options.fp8_weights = Fp8Weights::kAll;
  try {
    create_model(ckpt, Device::kCpu, {}, nullptr, options);
    ADD_FAILURE() << "--quantization fp8 was accepted on the CPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FP8 weights (--quantization fp8) are a GPU option"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(create_model(ckpt, Device::kCpu));
}

TEST(Fp8, CompressedTensorsKvScalesAreKept) {
  const Checkpoint ckpt = load_checkpoint(testing::fixture_dir("ct-mixed"));
  EXPECT_TRUE(ckpt.quantization.kv_cache_scales);
  // The generator stores 0.02 and 0.01 in bf16.
  EXPECT_NEAR(ckpt.kv_scales.at("model.layers.0.self_attn.k_scale").to_f32().data<float>()[0], 0.02,
              1e-4);
  EXPECT_NEAR(ckpt.kv_scales.at("model.layers.1.self_attn.v_scale").to_f32().data<float>()[0], 0.01,
              1e-4);
}

// A copy of an FP8 fixture with its config or tensors changed.
class BrokenFp8 : public ::testing::Test {
 protected:
  void use(const std::string& name) {
    name_ = name;
    for (const auto& entry : fs::directory_iterator(testing::fixture_dir(name))) {
      fs::copy_file(entry.path(), dir_.path() / entry.path().filename());
    }
  }
  void edit_config(const std::function<void(json&)>& edit) {
    json config = json::parse(read_bytes(testing::fixture_dir(name_) + "/config.json"));
    edit(config);
    write_bytes(dir_.path() / "config.json", config.dump(2));
  }
  void edit_tensors(const std::function<void(std::map<std::string, Tensor>&)>& edit) {
    std::map<std::string, Tensor> tensors =
        SafetensorsFile::open(testing::fixture_dir(name_) + "/model.safetensors").tensors();
    edit(tensors);
    write_safetensors(dir_.file("model.safetensors"), tensors);
  }
  std::string load_error() const {
    try {
      load_checkpoint(dir_.path().string());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  std::string name_;
  TempDir dir_;
};

const std::string kQ = "model.layers.0.self_attn.q_proj";

TEST_F(BrokenFp8, UnknownQuantMethodNamesTheKey) {
  use("fp8-block");
  edit_config([](json& c) { c["quantization_config"]["quant_method"] = "bitsandbytes"; });
  const std::string message = load_error();
  EXPECT_CONTAINS(message, "config.json");
  EXPECT_CONTAINS(message, "\"quantization_config.quant_method\" is 'bitsandbytes'");
}

TEST_F(BrokenFp8, Fp8WeightsWithoutQuantizationConfig) {
  use("fp8-block");
  edit_config([](json& c) { c.erase("quantization_config"); });
  EXPECT_CONTAINS(load_error(), "has dtype f8_e4m3 but config.json has no quantization_config");
}

TEST_F(BrokenFp8, BlockScaleShapeMustMatchTheWeight) {
  use("fp8-block");
  edit_tensors([](auto& t) { t[kQ + ".weight_scale_inv"] = Tensor::zeros(DType::kF32, {4, 2}); });
  EXPECT_CONTAINS(load_error(), "scale tensor " + kQ +
                                    ".weight_scale_inv has shape [4, 2] but FP8 tensor " + kQ +
                                    ".weight [256, 128] with per-block 32x32 scales needs [8, 4]");
}

TEST_F(BrokenFp8, PerChannelScaleShapeMustMatchTheWeight) {
  use("fbgemm");
  const std::string qkv = "model.layers.1.self_attn.qkv_proj";
  edit_tensors([&](auto& t) { t[qkv + ".weight_scale"] = Tensor::zeros(DType::kF32, {128, 1}); });
  EXPECT_CONTAINS(load_error(), "scale tensor " + qkv + ".weight_scale has shape [128, 1]");
}

TEST_F(BrokenFp8, BlockSizeMustDivideTheWeight) {
  use("fp8-block");
  edit_config([](json& c) { c["quantization_config"]["weight_block_size"] = {48, 32}; });
  EXPECT_CONTAINS(load_error(),
                  "FP8 tensor model.layers.0.mlp.down_proj.weight [128, 256] does not "
                  "divide into quantization_config's 48x32 blocks");
}

TEST_F(BrokenFp8, MissingScaleTensorIsNamed) {
  use("fp8-block");
  edit_tensors([](auto& t) { t.erase(kQ + ".weight_scale_inv"); });
  EXPECT_CONTAINS(load_error(), "scale tensor " + kQ + ".weight_scale_inv of FP8 tensor " + kQ +
                                    ".weight is missing");
}

TEST_F(BrokenFp8, MissingStaticInputScaleIsNamed) {
  use("fp8-tensor");
  edit_tensors([](auto& t) { t.erase(kQ + ".input_scale"); });
  EXPECT_CONTAINS(load_error(), "tensor " + kQ + ".input_scale is missing");
}

TEST_F(BrokenFp8, ScaleDtypeMustBeAFloat) {
  use("ct-mixed");
  edit_tensors([](auto& t) { t[kQ + ".weight_scale"] = Tensor::zeros(DType::kI32, {1}); });
  EXPECT_CONTAINS(load_error(), "scale tensor " + kQ + ".weight_scale has dtype i32");
}

TEST_F(BrokenFp8, ScaledWeightMustBeFp8) {
  use("ct-mixed");
  edit_tensors([](auto& t) { t[kQ + ".weight"] = Tensor::zeros(DType::kBF16, {128, 128}); });
  EXPECT_CONTAINS(load_error(), "tensor " + kQ + ".input_scale scales " + kQ +
                                    ".weight, which has dtype bf16; quantized weights must be "
                                    "f8_e4m3");
}

TEST_F(BrokenFp8, ScaleOfAMissingWeightIsNamed) {
  use("fp8-block");
  edit_tensors([](auto& t) {
    t["model.layers.0.mlp.extra_proj.weight_scale_inv"] = t.at(kQ + ".weight_scale_inv");
  });
  EXPECT_CONTAINS(load_error(),
                  "tensor model.layers.0.mlp.extra_proj.weight_scale_inv is the "
                  "scale of model.layers.0.mlp.extra_proj.weight, which the "
                  "checkpoint lacks");
}

TEST_F(BrokenFp8, Fp8WeightOfAnIgnoredModule) {
  use("ct-mixed");
  edit_config([](json& c) { c["quantization_config"]["ignore"].push_back(kQ); });
  EXPECT_CONTAINS(load_error(), "tensor " + kQ +
                                    ".weight has dtype f8_e4m3 but "
                                    "quantization_config (compressed-tensors) leaves module " +
                                    kQ + " unquantized");
}

TEST_F(BrokenFp8, OnlyProjectionWeightsMayBeFp8) {
  use("fp8-block");
  edit_tensors([](auto& t) {
    t["model.norm.weight"] = Tensor::zeros(DType::kF8E4M3, {128});
    t["model.norm.bias"] = Tensor::zeros(DType::kF8E4M3, {128});
  });
  EXPECT_CONTAINS(load_error(),
                  "tensor model.norm.bias has dtype f8_e4m3; only projection "
                  "weights (<module>.weight) may be FP8");
}

TEST_F(BrokenFp8, KvScaleMustBeOneValue) {
  use("ct-mixed");
  edit_tensors(
      [](auto& t) { t["model.layers.1.self_attn.k_scale"] = Tensor::zeros(DType::kF32, {2}); });
  EXPECT_CONTAINS(load_error(), "tensor model.layers.1.self_attn.k_scale must hold one value");
}

}  // namespace
}  // namespace pagedlm
