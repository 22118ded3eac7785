#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io_test_util.h"
#include "pagedlm/io/safetensors.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

json fixture_config(const std::string& name) {
  return json::parse(read_bytes(testing::fixture_dir(name) + "/config.json"));
}

void copy_fixture(const std::string& name, const TempDir& dir) {
  for (const auto& entry : fs::directory_iterator(testing::fixture_dir(name))) {
    fs::copy_file(entry.path(), dir.path() / entry.path().filename());
  }
}

void write_json(const fs::path& path, const json& j) { write_bytes(path, j.dump(2)); }

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.rope.theta, b.rope.theta);
  EXPECT_EQ(a.rope.type, b.rope.type);
  EXPECT_EQ(a.rope.factor, b.rope.factor);
  EXPECT_EQ(a.rope.low_freq_factor, b.rope.low_freq_factor);
  EXPECT_EQ(a.rope.high_freq_factor, b.rope.high_freq_factor);
  EXPECT_EQ(a.rope.original_max_position, b.rope.original_max_position);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
}

struct FixtureCase {
  std::string name;
  std::string architecture;
  std::string model_type;
  int64_t head_dim;
  bool tied;
  bool bias;
  bool qk_norm;
  float rope_theta;
  RopeType rope_scaling;
  DType weight_dtype;
  size_t num_tensors;
};

class FixtureLoads : public ::testing::TestWithParam<FixtureCase> {};

TEST_P(FixtureLoads, ConfigAndEveryTensor) {
  const FixtureCase& want = GetParam();
  std::vector<std::pair<size_t, size_t>> progress;
  const Checkpoint ckpt =
      load_checkpoint(testing::fixture_dir(want.name),
                      [&](size_t done, size_t total) { progress.emplace_back(done, total); });
  const ModelConfig& c = ckpt.config;
  // Shared by every fixture (see testdata/fixtures/README.md and each config.json).
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.intermediate_size, 512);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.max_position_embeddings, want.name == "qwen3-yarn" ? 512 : 1024);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(c.bos_token_id, 1);

  EXPECT_EQ(c.architecture, want.architecture);
  EXPECT_EQ(c.model_type, want.model_type);
  EXPECT_EQ(c.head_dim, want.head_dim);
  EXPECT_EQ(c.tie_word_embeddings, want.tied);
  EXPECT_EQ(c.attention_bias, want.bias);
  EXPECT_EQ(c.qk_norm, want.qk_norm);
  EXPECT_EQ(c.rope.theta, want.rope_theta);
  EXPECT_EQ(c.rope.type, want.rope_scaling);

  const auto expected = expected_tensor_shapes(c);
  EXPECT_EQ(expected.size(), want.num_tensors);
  for (const auto& [name, shape] : expected) {
    const Tensor& t = ckpt.get(name, shape);
    EXPECT_EQ(t.dtype(), want.weight_dtype) << name;
    EXPECT_EQ(t.device(), Device::kCpu) << name;
  }
  EXPECT_EQ(ckpt.has("lm_head.weight"), !want.tied);

  ASSERT_EQ(progress.size(), 1u);
  EXPECT_EQ(progress.back().first, progress.back().second);
  EXPECT_EQ(progress.back().second,
            fs::file_size(testing::fixture_dir(want.name) + "/model.safetensors"));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureLoads,
                         ::testing::Values(
                             // 1 embedding + 2 layers x 9 + final norm; tied, so no lm_head.
                             FixtureCase{"llama-gqa", "LlamaForCausalLM", "llama", 64, true, false,
                                         false, 1e4f, RopeType::kDefault, DType::kF32, 20},
                             FixtureCase{"llama3-rope", "LlamaForCausalLM", "llama", 64, false,
                                         false, false, 5e5f, RopeType::kLlama3, DType::kBF16, 21},
                             // + q/k/v biases per layer.
                             FixtureCase{"qwen2-bias", "Qwen2ForCausalLM", "qwen2", 64, true, true,
                                         false, 1e6f, RopeType::kDefault, DType::kBF16, 26},
                             // + q_norm/k_norm per layer; head_dim 128 is not hidden/heads.
                             FixtureCase{"qwen3-qknorm", "Qwen3ForCausalLM", "qwen3", 128, true,
                                         false, true, 1e6f, RopeType::kDefault, DType::kBF16, 24},
                             FixtureCase{"mistral", "MistralForCausalLM", "mistral", 64, false,
                                         false, false, 1e4f, RopeType::kDefault, DType::kBF16, 21},
                             // 11 per layer: + norms after attention and after the MLP.
                             FixtureCase{"gemma2", "Gemma2ForCausalLM", "gemma2", 64, true, false,
                                         false, 1e4f, RopeType::kDefault, DType::kBF16, 24},
                             // + q/k norms; the model's rope is the global layers' (theta 1e6).
                             FixtureCase{"gemma3", "Gemma3ForCausalLM", "gemma3", 64, true, false,
                                         true, 1e6f, RopeType::kDefault, DType::kBF16, 28},
                             // 6 per layer: fused qkv_proj and gate_up_proj; untied.
                             FixtureCase{"phi3", "Phi3ForCausalLM", "phi3", 64, false, false, false,
                                         1e4f, RopeType::kDefault, DType::kBF16, 15},
                             FixtureCase{"qwen3-yarn", "Qwen3ForCausalLM", "qwen3", 64, true, false,
                                         true, 1e6f, RopeType::kYarn, DType::kBF16, 24}),
                         [](const auto& info) {
                           std::string name = info.param.name;
                           for (char& ch : name)
                             ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return name;
                         });

TEST(Checkpoint, Llama3RopeParameters) {
  const ModelConfig c = load_hf_checkpoint(testing::fixture_dir("llama3-rope")).config;
  EXPECT_EQ(c.rope.type, RopeType::kLlama3);
  EXPECT_EQ(c.rope.factor, 8.f);
  EXPECT_EQ(c.rope.low_freq_factor, 1.f);
  EXPECT_EQ(c.rope.high_freq_factor, 4.f);
  EXPECT_EQ(c.rope.original_max_position, 64);
  EXPECT_EQ(c.rope.theta, 5e5f);
}

TEST(Checkpoint, Qwen3ShapesUseExplicitHeadDim) {
  const Checkpoint ckpt = load_hf_checkpoint(testing::fixture_dir("qwen3-qknorm"));
  EXPECT_EQ(ckpt.get("model.layers.1.self_attn.q_proj.weight", {512, 256}).dim(0), 512);
  EXPECT_EQ(ckpt.get("model.layers.1.self_attn.o_proj.weight", {256, 512}).dim(1), 512);
  EXPECT_EQ(ckpt.get("model.layers.0.self_attn.k_norm.weight", {128}).numel(), 128);
  const Checkpoint qwen2 = load_hf_checkpoint(testing::fixture_dir("qwen2-bias"));
  EXPECT_EQ(qwen2.get("model.layers.0.self_attn.k_proj.bias", {128}).dtype(), DType::kBF16);
}

// The tensor's bytes are the file's bytes, and BF16 widens by a 16-bit shift.
TEST(Checkpoint, Bf16ValuesMatchTheFileBytes) {
  const std::string path = testing::fixture_dir("llama3-rope") + "/model.safetensors";
  const std::string name = "model.layers.1.post_attention_layernorm.weight";
  const Checkpoint ckpt = load_hf_checkpoint(testing::fixture_dir("llama3-rope"));
  const Tensor& t = ckpt.get(name, {256});
  ASSERT_EQ(t.dtype(), DType::kBF16);

  const std::string bytes = read_bytes(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  const json header = json::parse(bytes.substr(8, header_len));
  const size_t begin = 8 + header_len + header[name]["data_offsets"][0].get<size_t>();
  ASSERT_EQ(std::memcmp(t.raw(), bytes.data() + begin, 512), 0);

  const Tensor f32 = t.to_f32();
  for (int i : {0, 17, 255}) {
    const auto lo = static_cast<uint8_t>(bytes[begin + 2 * i]);
    const auto hi = static_cast<uint8_t>(bytes[begin + 2 * i + 1]);
    const uint32_t bits = (static_cast<uint32_t>(hi) << 24) | (static_cast<uint32_t>(lo) << 16);
    float want;
    std::memcpy(&want, &bits, 4);
    EXPECT_EQ(f32.data<float>()[i], want) << i;
    EXPECT_NEAR(want, 1.f, 0.5f) << "norm weights are 1 +/- 0.2 in the fixtures";
  }
}

TEST(Checkpoint, HubStyleConfigParsesTheSame) {
  const ModelConfig want = parse_hf_config(fixture_config("llama3-rope"));
  json hub = fixture_config("llama3-rope");
  json scaling = hub["rope_parameters"];
  hub.erase("rope_parameters");
  scaling.erase("rope_theta");
  hub["rope_theta"] = 500000.0;
  scaling.erase("rope_type");
  scaling["type"] = "llama3";
  hub["rope_scaling"] = scaling;
  expect_same_config(parse_hf_config(hub), want);

  scaling.erase("type");
  scaling["rope_type"] = "llama3";
  hub["rope_scaling"] = scaling;
  expect_same_config(parse_hf_config(hub), want);

  // Qwen2 the way the Hub writes it: no head_dim, top-level theta, rope_scaling null, a
  // sliding_window that is present but switched off, eos as a list.
  const ModelConfig qwen_want = parse_hf_config(fixture_config("qwen2-bias"));
  json qwen = fixture_config("qwen2-bias");
  qwen.erase("rope_parameters");
  qwen["rope_theta"] = 1000000.0;
  qwen["rope_scaling"] = nullptr;
  qwen["sliding_window"] = 4;
  qwen["eos_token_id"] = json::array({2});
  qwen["head_dim"] = nullptr;
  expect_same_config(parse_hf_config(qwen), qwen_want);

  // Absent keys take HF's defaults.
  json bare = fixture_config("mistral");
  bare.erase("num_key_value_heads");
  bare.erase("rope_parameters");
  bare.erase("head_dim");
  bare.erase("architectures");
  const ModelConfig c = parse_hf_config(bare);
  EXPECT_EQ(c.architecture, "MistralForCausalLM");
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rope.theta, 10000.f);
}

TEST(Checkpoint, LinearRopeScaling) {
  json j = fixture_config("llama-gqa");
  j["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 1e4}};
  const ModelConfig c = parse_hf_config(j);
  EXPECT_EQ(c.rope.type, RopeType::kLinear);
  EXPECT_EQ(c.rope.factor, 2.f);
}

TEST(Checkpoint, GenerationConfigAddsStopTokens) {
  TempDir dir;
  copy_fixture("llama-gqa", dir);
  json config = fixture_config("llama-gqa");
  config["eos_token_id"] = {2, 3};
  config.erase("bos_token_id");
  write_json(dir.path() / "config.json", config);
  write_json(dir.path() / "generation_config.json",
             {{"bos_token_id", 7}, {"eos_token_id", {3, 9}}});
  const ModelConfig c = load_checkpoint(dir.path().string()).config;
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{2, 3, 9}));
  EXPECT_EQ(c.bos_token_id, 7);
}

TEST(Checkpoint, ShardedLoadsIdenticalTensors) {
  const Checkpoint whole = load_hf_checkpoint(testing::fixture_dir("llama3-rope"));
  TempDir dir;
  fs::copy_file(testing::fixture_dir("llama3-rope") + "/config.json", dir.path() / "config.json");
  std::map<std::string, Tensor> shards[2];
  json weight_map = json::object();
  int i = 0;
  for (const auto& [name, t] : whole.tensors) {
    const int shard = i++ % 2;
    shards[shard][name] = t;
    weight_map[name] =
        shard == 0 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  write_safetensors(dir.file("model-00001-of-00002.safetensors"), shards[0]);
  write_safetensors(dir.file("model-00002-of-00002.safetensors"), shards[1]);
  write_json(dir.path() / "model.safetensors.index.json",
             {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}});

  std::vector<std::pair<size_t, size_t>> progress;
  const Checkpoint sharded = load_hf_checkpoint(
      dir.path().string(), [&](size_t done, size_t total) { progress.emplace_back(done, total); });
  ASSERT_EQ(sharded.tensors.size(), whole.tensors.size());
  for (const auto& [name, t] : whole.tensors) {
    const Tensor& s = sharded.get(name, t.shape());
    EXPECT_EQ(s.dtype(), t.dtype()) << name;
    EXPECT_EQ(std::memcmp(s.raw(), t.raw(), t.nbytes()), 0) << name;
  }
  ASSERT_EQ(progress.size(), 2u);
  EXPECT_LT(progress[0].first, progress[1].first);
  EXPECT_EQ(progress[1].first, progress[1].second);

  // Every tensor the index names must be in the shard it names.
  weight_map["model.norm.weight"] =
      weight_map["model.norm.weight"] == "model-00001-of-00002.safetensors"
          ? "model-00002-of-00002.safetensors"
          : "model-00001-of-00002.safetensors";
  write_json(dir.path() / "model.safetensors.index.json", {{"weight_map", weight_map}});
  const std::string misplaced = error_of([&] { load_hf_checkpoint(dir.path().string()); });
  EXPECT_CONTAINS(misplaced, "tensor model.norm.weight is listed");

  weight_map["model.norm.weight"] = "model-00003-of-00002.safetensors";
  write_json(dir.path() / "model.safetensors.index.json", {{"weight_map", weight_map}});
  const std::string missing_shard = error_of([&] { load_hf_checkpoint(dir.path().string()); });
  EXPECT_CONTAINS(missing_shard, "lists shard model-00003-of-00002.safetensors");

  weight_map["model.norm.weight"] = "../model.safetensors";
  write_json(dir.path() / "model.safetensors.index.json", {{"weight_map", weight_map}});
  EXPECT_CONTAINS(error_of([&] { load_hf_checkpoint(dir.path().string()); }),
                  "not a plain file name");
}

// Each mutation of a valid config must fail with a message naming the culprit.
TEST(Checkpoint, BadConfigsNameTheProblem) {
  const json base = fixture_config("llama3-rope");
  const auto message_for = [&](auto&& mutate) {
    json j = base;
    mutate(j);
    return error_of([&] { parse_hf_config(j); });
  };
  EXPECT_CONTAINS(message_for([](json& j) { j.erase("hidden_size"); }),
                  "\"hidden_size\" is missing");
  EXPECT_CONTAINS(message_for([](json& j) { j["hidden_size"] = "256"; }),
                  "\"hidden_size\" must be an integer");
  EXPECT_CONTAINS(message_for([](json& j) { j["num_attention_heads"] = 0; }),
                  "\"num_attention_heads\" must be positive");
  EXPECT_CONTAINS(message_for([](json& j) { j["num_key_value_heads"] = 3; }),
                  "num_key_value_heads (3)");
  EXPECT_CONTAINS(message_for([](json& j) { j["head_dim"] = 31; }),
                  "head_dim must be even for rope, got 31");
  EXPECT_CONTAINS(message_for([](json& j) { j["architectures"] = {"GPT2LMHeadModel"}; }),
                  "unsupported architecture GPT2LMHeadModel");
  EXPECT_CONTAINS(message_for([](json& j) { j["architectures"] = "LlamaForCausalLM"; }),
                  "\"architectures\"");
  EXPECT_CONTAINS(message_for([](json& j) { j["rope_parameters"]["rope_type"] = "longrope"; }),
                  "unsupported rope_type \"longrope\"");
  EXPECT_CONTAINS(message_for([](json& j) { j["rope_parameters"].erase("factor"); }),
                  "\"rope_parameters.factor\" is missing");
  EXPECT_CONTAINS(message_for([](json& j) { j["rope_parameters"]["low_freq_factor"] = "1"; }),
                  "\"rope_parameters.low_freq_factor\" must be a number");
  EXPECT_CONTAINS(message_for([](json& j) { j["rope_parameters"] = 5; }), "\"rope_parameters\"");
  EXPECT_CONTAINS(message_for([](json& j) { j["hidden_act"] = "gelu"; }),
                  "unsupported hidden_act \"gelu\"");
  EXPECT_CONTAINS(message_for([](json& j) { j["attention_bias"] = true; }), "attention_bias=true");
  EXPECT_CONTAINS(message_for([](json& j) { j["tie_word_embeddings"] = 1; }),
                  "\"tie_word_embeddings\" must be true or false");
  EXPECT_CONTAINS(message_for([](json& j) { j["eos_token_id"] = {2, "x"}; }), "\"eos_token_id\"");
  EXPECT_CONTAINS(message_for([](json& j) { j = json::array(); }), "not a JSON object");

  json gemma = fixture_config("gemma2");
  gemma["layer_types"] = {"full_attention"};
  EXPECT_CONTAINS(error_of([&] { parse_hf_config(gemma); }),
                  "\"layer_types\" has 1 entries for 2 layers");
  gemma["layer_types"] = {"full_attention", "chunked_attention"};
  EXPECT_CONTAINS(error_of([&] { parse_hf_config(gemma); }),
                  "unsupported layer type \"chunked_attention\"");
}

std::vector<int32_t> windows_of(const ModelConfig& c) {
  std::vector<int32_t> w;
  for (const LayerSpec& l : c.layers) w.push_back(l.attention.window);
  return w;
}

// Which layers slide, per family: Mistral all of them whenever sliding_window is set, Qwen only
// with use_sliding_window and from max_window_layers on; a window as long as the context is none.
TEST(Checkpoint, SlidingWindowLayers) {
  json mistral = fixture_config("mistral");
  EXPECT_EQ(windows_of(parse_hf_config(mistral)), (std::vector<int32_t>{0, 0}));
  mistral["sliding_window"] = 512;
  EXPECT_EQ(windows_of(parse_hf_config(mistral)), (std::vector<int32_t>{512, 512}));
  EXPECT_EQ(parse_hf_config(mistral).window_of_all_layers(), 512);
  mistral["sliding_window"] = 4096;
  EXPECT_EQ(windows_of(parse_hf_config(mistral)), (std::vector<int32_t>{0, 0}));
  json qwen = fixture_config("qwen2-bias");
  // transformers 5 saves layer_types, which then decide alone (as in HF); the Hub's older configs
  // have none, and use_sliding_window with max_window_layers decide.
  qwen.erase("layer_types");
  qwen["sliding_window"] = 128;
  EXPECT_EQ(windows_of(parse_hf_config(qwen)), (std::vector<int32_t>{0, 0}));
  qwen["use_sliding_window"] = true;
  qwen["max_window_layers"] = 1;
  EXPECT_EQ(windows_of(parse_hf_config(qwen)), (std::vector<int32_t>{0, 128}));
  EXPECT_EQ(parse_hf_config(qwen).window_of_all_layers(), 0);
}

// Gemma 2's fixture: every per-layer and block setting its config.json asks for.
TEST(Checkpoint, Gemma2AttentionAndBlock) {
  const ModelConfig c = parse_hf_config(fixture_config("gemma2"));
  ASSERT_EQ(c.layers.size(), 2u);
  EXPECT_EQ(windows_of(c), (std::vector<int32_t>{32, 0}));
  for (const LayerSpec& l : c.layers) {
    EXPECT_FLOAT_EQ(l.attention.scale, 1.f / 8.f);  // query_pre_attn_scalar 64
    EXPECT_EQ(l.attention.softcap, 50.f);
    EXPECT_EQ(l.rope.theta, 1e4f);
  }
  EXPECT_EQ(c.final_logit_softcap, 30.f);
  EXPECT_EQ(c.activation, Activation::kGeluTanh);
  EXPECT_EQ(c.norm_weight_offset, 1.f);
  EXPECT_TRUE(c.sandwich_norms);
  EXPECT_EQ(c.embedding_scale, 16.f);
}

// Gemma 3 the way the Hub writes it (rope_theta, rope_local_base_freq, sliding_window_pattern,
// no layer_types) reads the same as transformers 5's per-layer-type rope_parameters.
TEST(Checkpoint, Gemma3HubKeysMatchTransformers5Keys) {
  const json t5 = fixture_config("gemma3");
  const ModelConfig want = parse_hf_config(t5);
  ASSERT_EQ(want.layers.size(), 2u);
  EXPECT_EQ(windows_of(want), (std::vector<int32_t>{32, 0}));
  EXPECT_EQ(want.layers[0].rope.theta, 1e4f);
  EXPECT_EQ(want.layers[1].rope.theta, 1e6f);
  EXPECT_TRUE(want.qk_norm);
  EXPECT_EQ(want.layers[0].attention.softcap, 0.f);
  EXPECT_EQ(want.final_logit_softcap, 0.f);

  json hub = t5;
  hub.erase("rope_parameters");
  hub.erase("layer_types");
  hub.erase("_sliding_window_pattern");
  hub["rope_theta"] = 1e6;
  hub["rope_local_base_freq"] = 1e4;
  hub["sliding_window_pattern"] = 2;  // layer 0 slides, layer 1 is global, as the fixture's list
  const ModelConfig got = parse_hf_config(hub);
  expect_same_config(got, want);
  for (size_t i = 0; i < want.layers.size(); ++i) {
    EXPECT_EQ(got.layers[i].attention, want.layers[i].attention) << i;
    EXPECT_EQ(got.layers[i].rope, want.layers[i].rope) << i;
  }
  // The Hub's rope_scaling belongs to the global layers only.
  hub["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  const ModelConfig scaled = parse_hf_config(hub);
  EXPECT_EQ(scaled.layers[0].rope.type, RopeType::kDefault);
  EXPECT_EQ(scaled.layers[1].rope.type, RopeType::kLinear);
  EXPECT_EQ(scaled.layers[1].rope.factor, 8.f);
}

// YaRN's attention factor (0.1 ln 8 + 1 by default) scales both q and k in HF, so the scores
// grow by its square.
TEST(Checkpoint, YarnAttentionFactorFoldsIntoScale) {
  json j = fixture_config("qwen3-yarn");
  const ModelConfig c = parse_hf_config(j);
  const double factor = 0.1 * std::log(8.0) + 1;
  EXPECT_NEAR(c.layers[0].attention.scale, factor * factor / 8.0, 1e-6);  // head_dim 64
  j["rope_parameters"]["attention_factor"] = 1.0;
  EXPECT_FLOAT_EQ(parse_hf_config(j).layers[1].attention.scale, 1.f / 8.f);
}

// Phi-3's fused projections and its all-layer window.
TEST(Checkpoint, Phi3) {
  json j = fixture_config("phi3");
  EXPECT_EQ(windows_of(parse_hf_config(j)), (std::vector<int32_t>{0, 0}));
  j["sliding_window"] = 16;
  EXPECT_EQ(windows_of(parse_hf_config(j)), (std::vector<int32_t>{16, 16}));
  j["rope_parameters"]["partial_rotary_factor"] = 0.75;
  EXPECT_CONTAINS(error_of([&] { parse_hf_config(j); }), "partial_rotary_factor=0.75");
}

std::vector<bool> sparse_of(const ModelConfig& c) {
  std::vector<bool> out;
  for (const LayerSpec& l : c.layers) out.push_back(l.sparse_mlp);
  return out;
}

// Qwen3-MoE: both spellings of the expert count, HF's norm_topk_prob default, which layers are
// sparse (decoder_sparse_step, mlp_only_layers), and what is refused.
TEST(Checkpoint, Qwen3MoeExpertsAndSparseLayers) {
  json j = fixture_config("qwen3-moe");
  ModelConfig c = parse_hf_config(j);
  EXPECT_EQ(c.moe.num_experts, 8);
  EXPECT_EQ(c.moe.experts_per_token, 2);
  EXPECT_EQ(c.moe.expert_intermediate_size, 128);
  EXPECT_TRUE(c.moe.normalize_top_k);
  EXPECT_EQ(sparse_of(c), (std::vector<bool>{true, true}));
  j.erase("num_local_experts");
  j["num_experts"] = 6;  // the Hub's key
  j.erase("norm_topk_prob");
  j["num_hidden_layers"] = 4;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  c = parse_hf_config(j);
  EXPECT_EQ(c.moe.num_experts, 6);
  EXPECT_FALSE(c.moe.normalize_top_k);  // HF's default
  EXPECT_EQ(sparse_of(c), (std::vector<bool>{false, true, false, false}));
  // The dense layers read the dense MLP's names and shapes, the sparse one the experts'.
  std::map<std::string, Shape> shapes;
  for (const auto& [name, shape] : expected_tensor_shapes(c)) shapes.emplace(name, shape);
  EXPECT_EQ(shapes.at("model.layers.0.mlp.down_proj.weight"), (Shape{256, 512}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.gate.weight"), (Shape{6, 256}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.experts.5.down_proj.weight"), (Shape{256, 128}));
  EXPECT_EQ(shapes.count("model.layers.1.mlp.down_proj.weight"), 0u);
  EXPECT_EQ(shapes.count("model.layers.1.mlp.experts.6.up_proj.weight"), 0u);

  json bad = fixture_config("qwen3-moe");
  bad["num_experts_per_tok"] = 9;
  EXPECT_CONTAINS(error_of([&] { parse_hf_config(bad); }), "experts per token (9)");
  bad = fixture_config("qwen3-moe");
  bad["num_local_experts"] = 1000;
  EXPECT_CONTAINS(error_of([&] { parse_hf_config(bad); }), "1000 experts");
  bad = fixture_config("qwen3-moe");
  bad["mlp_only_layers"] = {7};
  EXPECT_CONTAINS(error_of([&] { parse_hf_config(bad); }), "mlp_only_layers");
  bad = fixture_config("qwen3-moe");
  bad["shared_expert_intermediate_size"] = 64;
  EXPECT_CONTAINS(error_of([&] { parse_hf_config(bad); }), "shared experts");
}

// Mixtral: every layer sparse, intermediate_size is the experts', always renormalized.
TEST(Checkpoint, MixtralExperts) {
  const ModelConfig c = parse_hf_config(fixture_config("mixtral"));
  EXPECT_EQ(c.model_type, "mixtral");
  EXPECT_EQ(c.moe.num_experts, 4);
  EXPECT_EQ(c.moe.experts_per_token, 2);
  EXPECT_EQ(c.moe.expert_intermediate_size, 128);
  EXPECT_TRUE(c.moe.normalize_top_k);
  EXPECT_EQ(sparse_of(c), (std::vector<bool>{true, true}));
  EXPECT_EQ(hf_weight_name(family_of(c), 1, LayerWeight::kExpertDown, 3),
            "model.layers.1.block_sparse_moe.experts.3.w2.weight");
  EXPECT_CONTAINS(error_of([&] { hf_weight_name(family_of(c), 1, LayerWeight::kExpertDown); }),
                  "needs an expert index");
}

class BrokenCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override { copy_fixture("llama3-rope", dir_); }
  std::string load_error() const {
    return error_of([&] { load_checkpoint(dir_.path().string()); });
  }
  // Rewrites model.safetensors after `edit` changes its tensor map.
  template <typename Fn>
  void rewrite_weights(Fn&& edit) {
    std::map<std::string, Tensor> tensors =
        SafetensorsFile::open(testing::fixture_dir("llama3-rope") + "/model.safetensors").tensors();
    edit(tensors);
    write_safetensors(dir_.file("model.safetensors"), tensors);
  }

  TempDir dir_;
};

TEST_F(BrokenCheckpoint, MalformedConfigJson) {
  write_bytes(dir_.path() / "config.json", "{\"architectures\": [\"LlamaForCausalLM\",");
  const std::string message = load_error();
  EXPECT_CONTAINS(message, "config.json");
  EXPECT_CONTAINS(message, "not valid JSON");
}

TEST_F(BrokenCheckpoint, ConfigErrorsNameTheFile) {
  json config = fixture_config("llama3-rope");
  config.erase("hidden_size");
  write_json(dir_.path() / "config.json", config);
  const std::string message = load_error();
  EXPECT_CONTAINS(message, "config.json: config key \"hidden_size\" is missing");

  fs::remove(dir_.path() / "config.json");
  EXPECT_CONTAINS(load_error(), "has no config.json");
}

TEST_F(BrokenCheckpoint, MissingTensorIsNamed) {
  rewrite_weights([](auto& t) { t.erase("model.layers.1.mlp.up_proj.weight"); });
  EXPECT_CONTAINS(load_error(), "no tensor model.layers.1.mlp.up_proj.weight");
}

TEST_F(BrokenCheckpoint, UntiedWithoutLmHeadIsAnError) {
  rewrite_weights([](auto& t) { t.erase("lm_head.weight"); });
  EXPECT_CONTAINS(load_error(), "no tensor lm_head.weight");
}

TEST_F(BrokenCheckpoint, MisShapedTensorIsNamed) {
  rewrite_weights([](auto& t) {
    t["model.layers.0.self_attn.k_proj.weight"] = Tensor::zeros(DType::kBF16, {256, 256});
  });
  EXPECT_CONTAINS(load_error(),
                  "tensor model.layers.0.self_attn.k_proj.weight has shape [256, 256] but the "
                  "config implies [128, 256]");
}

TEST_F(BrokenCheckpoint, IntegerWeightsAreRejected) {
  rewrite_weights([](auto& t) { t["model.norm.weight"] = Tensor::zeros(DType::kI32, {256}); });
  EXPECT_CONTAINS(load_error(), "tensor model.norm.weight has dtype i32");
}

TEST_F(BrokenCheckpoint, CorruptWeightsFileIsNamed) {
  const std::string bytes = read_bytes(dir_.path() / "model.safetensors");
  write_bytes(dir_.path() / "model.safetensors", bytes.substr(0, bytes.size() / 2));
  EXPECT_CONTAINS(load_error(), "model.safetensors");
  fs::remove(dir_.path() / "model.safetensors");
  EXPECT_CONTAINS(load_error(), "neither model.safetensors nor model.safetensors.index.json");
}

TEST(Checkpoint, GetNamesTensorAndBothShapes) {
  Checkpoint ckpt;
  ckpt.tensors["w"] = Tensor::zeros(DType::kF32, {2, 3});
  EXPECT_EQ(ckpt.get("w", {2, 3}).numel(), 6);
  EXPECT_CONTAINS(error_of([&] {
                    ckpt.get("w", {3, 2});
                  }),
                  "tensor w has shape [2, 3] but the config implies [3, 2]");
  EXPECT_CONTAINS(error_of([&] { ckpt.get("v", {1}); }), "no tensor v");
}

TEST(Checkpoint, LoadCheckpointDispatchesOnPath) {
  TempDir dir;
  EXPECT_CONTAINS(error_of([&] { load_checkpoint(dir.file("nowhere")); }),
                  dir.file("nowhere") + " does not exist");
  write_bytes(dir.file("model.gguf"), "GGUF\x03");
  EXPECT_CONTAINS(error_of([&] { load_checkpoint(dir.file("model.gguf")); }), "GGUF");
  write_bytes(dir.file("weights"), std::string("GGUF\x03\0\0\0", 8));
  EXPECT_CONTAINS(error_of([&] { load_checkpoint(dir.file("weights")); }), "GGUF");
  write_bytes(dir.file("notes.txt"), "hello");
  EXPECT_CONTAINS(error_of([&] { load_checkpoint(dir.file("notes.txt")); }),
                  "neither a Hugging Face checkpoint folder nor a GGUF file");
}

}  // namespace
}  // namespace pagedlm
