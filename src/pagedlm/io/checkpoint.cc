#include "pagedlm/io/checkpoint.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "pagedlm/core/error.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/io/safetensors.h"

namespace pagedlm {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// Typed reads of one JSON object's keys. Every message names the key (with `prefix_`, e.g.
// "rope_scaling."), so no nlohmann exception ever reaches the user. A key holding JSON null
// counts as absent, as HF's configs use null for "not set".
class ConfigKeys {
 public:
  ConfigKeys(const json& object, std::string prefix)
      : object_(object), prefix_(std::move(prefix)) {}

  const json* find(const std::string& key) const {
    const auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }

  int64_t get_int(const std::string& key, std::optional<int64_t> fallback = {}) const {
    const json* v = find_or_missing(key, fallback.has_value());
    if (v == nullptr) return *fallback;
    PAGEDLM_CHECK(v->is_number_integer(), "config key \"", prefix_, key,
                  "\" must be an integer, got ", v->dump());
    return v->get<int64_t>();
  }
  int64_t get_positive_int(const std::string& key, std::optional<int64_t> fallback = {}) const {
    const int64_t n = get_int(key, fallback);
    PAGEDLM_CHECK(n > 0, "config key \"", prefix_, key, "\" must be positive, got ", n);
    return n;
  }
  double get_float(const std::string& key, std::optional<double> fallback = {}) const {
    const json* v = find_or_missing(key, fallback.has_value());
    if (v == nullptr) return *fallback;
    PAGEDLM_CHECK(v->is_number(), "config key \"", prefix_, key, "\" must be a number, got ",
                  v->dump());
    return v->get<double>();
  }
  bool get_bool(const std::string& key, bool fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    PAGEDLM_CHECK(v->is_boolean(), "config key \"", prefix_, key, "\" must be true or false, got ",
                  v->dump());
    return v->get<bool>();
  }
  std::string get_string(const std::string& key, std::optional<std::string> fallback = {}) const {
    const json* v = find_or_missing(key, fallback.has_value());
    if (v == nullptr) return *fallback;
    PAGEDLM_CHECK(v->is_string(), "config key \"", prefix_, key, "\" must be a string, got ",
                  v->dump());
    return v->get<std::string>();
  }
  // An int, or a list of ints (eos_token_id may be either); absent gives an empty list.
  std::vector<int32_t> get_token_ids(const std::string& key) const {
    std::vector<int32_t> ids;
    const json* v = find(key);
    if (v == nullptr) return ids;
    const auto add = [&](const json& id) {
      PAGEDLM_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 &&
                        id.get<int64_t>() <= std::numeric_limits<int32_t>::max(),
                    "config key \"", prefix_, key,
                    "\" must be a token id or a list of token ids, got ", v->dump());
      ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    };
    if (v->is_array()) {
      for (const json& id : *v) add(id);
    } else {
      add(*v);
    }
    return ids;
  }

 private:
  const json* find_or_missing(const std::string& key, bool optional) const {
    const json* v = find(key);
    PAGEDLM_CHECK(v != nullptr || optional, "config key \"", prefix_, key, "\" is missing");
    return v;
  }

  const json& object_;
  std::string prefix_;
};

struct ArchInfo {
  std::string_view architecture;
  std::string_view model_type;
  bool qkv_bias;  // Qwen2 hard-codes q/k/v biases in its modeling code; no config key
  bool qk_norm;
};

constexpr std::array<ArchInfo, 4> kArchitectures = {{
    {"LlamaForCausalLM", "llama", false, false},
    {"MistralForCausalLM", "mistral", false, false},
    {"Qwen2ForCausalLM", "qwen2", true, false},
    {"Qwen3ForCausalLM", "qwen3", false, true},
}};

std::string supported_architectures() {
  std::string names;
  for (const ArchInfo& a : kArchitectures) names += cat(names.empty() ? "" : ", ", a.architecture);
  return names;
}

const ArchInfo& find_architecture(const json& config) {
  const ConfigKeys keys(config, "");
  std::string name;
  if (const json* archs = keys.find("architectures")) {
    PAGEDLM_CHECK(archs->is_array() && !archs->empty() && (*archs)[0].is_string(),
                  "config key \"architectures\" must be a non-empty list of class names, got ",
                  archs->dump());
    name = (*archs)[0].get<std::string>();
  } else {
    // Some converted checkpoints omit "architectures"; model_type then names the family.
    const std::string model_type = keys.get_string("model_type");
    for (const ArchInfo& a : kArchitectures) {
      if (a.model_type == model_type) return a;
    }
    fail("unsupported model_type \"", model_type,
         "\" (supported architectures: ", supported_architectures(), ")");
  }
  for (const ArchInfo& a : kArchitectures) {
    if (a.architecture == name) return a;
  }
  fail("unsupported architecture ", name, " (supported: ", supported_architectures(), ")");
}

// Both styles: transformers 5's rope_parameters {rope_theta, rope_type, ...}, and the Hub's
// top-level rope_theta with rope_scaling {rope_type or type, ...} or null.
void parse_rope(const ConfigKeys& top, ModelConfig& c) {
  const double top_theta = top.get_float("rope_theta", 10000.0);
  std::optional<ConfigKeys> scaling;
  if (const json* params = top.find("rope_parameters")) {
    PAGEDLM_CHECK(params->is_object(), "config key \"rope_parameters\" must be an object, got ",
                  params->dump());
    scaling.emplace(*params, "rope_parameters.");
    c.rope_theta = static_cast<float>(scaling->get_float("rope_theta", top_theta));
  } else {
    c.rope_theta = static_cast<float>(top_theta);
    if (const json* rope_scaling = top.find("rope_scaling")) {
      PAGEDLM_CHECK(rope_scaling->is_object(), "config key \"rope_scaling\" must be an object or ",
                    "null, got ", rope_scaling->dump());
      scaling.emplace(*rope_scaling, "rope_scaling.");
    }
  }
  PAGEDLM_CHECK(c.rope_theta > 0, "config key \"rope_theta\" must be positive, got ", c.rope_theta);
  if (!scaling) return;

  const std::string type = scaling->has("rope_type") ? scaling->get_string("rope_type")
                                                     : scaling->get_string("type", "default");
  if (type == "default") return;
  if (type == "linear") {
    c.rope_scaling = RopeScaling::kLinear;
  } else if (type == "llama3") {
    c.rope_scaling = RopeScaling::kLlama3;
    c.rope_low_freq_factor = static_cast<float>(scaling->get_float("low_freq_factor"));
    c.rope_high_freq_factor = static_cast<float>(scaling->get_float("high_freq_factor"));
    c.rope_original_max_position = scaling->get_positive_int("original_max_position_embeddings");
    PAGEDLM_CHECK(c.rope_high_freq_factor > c.rope_low_freq_factor,
                  "llama3 rope scaling needs high_freq_factor > low_freq_factor, got ",
                  c.rope_high_freq_factor, " and ", c.rope_low_freq_factor);
  } else {
    fail("unsupported rope_type \"", type, "\" (supported: default, linear, llama3)");
  }
  c.rope_factor = static_cast<float>(scaling->get_float("factor"));
  PAGEDLM_CHECK(c.rope_factor > 0, "rope scaling factor must be positive, got ", c.rope_factor);
}

void add_unique(std::vector<int32_t>& ids, const std::vector<int32_t>& more) {
  for (int32_t id : more) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  }
}

json read_json_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  PAGEDLM_CHECK(in.good(), "cannot read ", path.string());
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(path.string(), " is not valid JSON (", e.what(), ")");
  }
}

bool has_gguf_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string_view(magic, 4) == "GGUF";
}

// One safetensors file to open and the tensors to take from it (all of them when unsharded).
struct Shard {
  std::string file;
  std::vector<std::string> names;
  bool take_all = false;
};

std::vector<Shard> list_shards(const fs::path& dir) {
  const fs::path index_path = dir / "model.safetensors.index.json";
  if (!fs::exists(index_path)) {
    PAGEDLM_CHECK(fs::is_regular_file(dir / "model.safetensors"), dir.string(),
                  " holds neither model.safetensors nor model.safetensors.index.json");
    return {Shard{"model.safetensors", {}, true}};
  }
  const json index = read_json_file(index_path);
  const auto weight_map = index.find("weight_map");
  PAGEDLM_CHECK(index.is_object() && weight_map != index.end() && weight_map->is_object() &&
                    !weight_map->empty(),
                index_path.string(), ": \"weight_map\" is missing, empty or not an object");
  std::vector<Shard> shards;
  for (const auto& [name, file_json] : weight_map->items()) {
    PAGEDLM_CHECK(file_json.is_string(), index_path.string(), ": weight_map entry for ", name,
                  " is not a file name");
    const std::string file = file_json.get<std::string>();
    // Shards live beside the index; a path here could reach files outside the checkpoint.
    PAGEDLM_CHECK(!file.empty() && fs::path(file).filename() == file && file != "..",
                  index_path.string(), ": shard name \"", file, "\" for tensor ", name,
                  " is not a plain file name");
    auto it =
        std::find_if(shards.begin(), shards.end(), [&](const Shard& s) { return s.file == file; });
    if (it == shards.end()) it = shards.insert(shards.end(), Shard{file, {}, false});
    it->names.push_back(name);
  }
  for (const Shard& s : shards) {
    PAGEDLM_CHECK(fs::is_regular_file(dir / s.file), index_path.string(), " lists shard ", s.file,
                  " (for tensor ", s.names.front(), ") which is missing from ", dir.string());
  }
  return shards;
}

}  // namespace

namespace {

void check_shape(const std::string& name, const Shape& shape, const Shape& expected_shape) {
  PAGEDLM_CHECK(shape == expected_shape, "tensor ", name, " has shape ", shape_str(shape),
                " but the config implies ", shape_str(expected_shape));
}

}  // namespace

Tensor Checkpoint::get(const std::string& name, const Shape& expected_shape) const {
  if (const QuantizedMatrix* q = blocks(name, expected_shape)) {
    Tensor out = Tensor::empty(DType::kF32, {q->rows, q->cols});
    const GgmlType type = q->type == QuantType::kQ4_1 ? GgmlType::kQ4_1 : GgmlType::kQ8_0;
    const int64_t row_bytes = q->row_bytes();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < q->rows; ++r) {
      dequantize_row(type, q->blocks.data() + r * row_bytes, out.data<float>() + r * q->cols,
                     q->cols);
    }
    return out;
  }
  const auto it = tensors.find(name);
  PAGEDLM_CHECK(it != tensors.end(), "checkpoint has no tensor ", name, " (expected shape ",
                shape_str(expected_shape), ")");
  check_shape(name, it->second.shape(), expected_shape);
  return it->second;
}

const QuantizedMatrix* Checkpoint::blocks(const std::string& name,
                                          const Shape& expected_shape) const {
  const auto it = quantized.find(name);
  if (it == quantized.end()) return nullptr;
  check_shape(name, {it->second.rows, it->second.cols}, expected_shape);
  return &it->second;
}

std::map<std::string, Shape> Checkpoint::shapes() const {
  std::map<std::string, Shape> out;
  for (const auto& [name, t] : tensors) out.emplace(name, t.shape());
  for (const auto& [name, q] : quantized) out.emplace(name, Shape{q.rows, q.cols});
  return out;
}

std::vector<std::pair<std::string, Shape>> expected_tensor_shapes(const ModelConfig& c) {
  const int64_t d = c.hidden_size;
  const int64_t q_dim = c.num_heads * c.head_dim;
  const int64_t kv_dim = c.num_kv_heads * c.head_dim;
  const int64_t f = c.intermediate_size;
  std::vector<std::pair<std::string, Shape>> shapes;
  shapes.emplace_back("model.embed_tokens.weight", Shape{c.vocab_size, d});
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const std::string p = cat("model.layers.", layer, ".");
    shapes.emplace_back(p + "input_layernorm.weight", Shape{d});
    shapes.emplace_back(p + "self_attn.q_proj.weight", Shape{q_dim, d});
    shapes.emplace_back(p + "self_attn.k_proj.weight", Shape{kv_dim, d});
    shapes.emplace_back(p + "self_attn.v_proj.weight", Shape{kv_dim, d});
    if (c.attention_bias) {
      shapes.emplace_back(p + "self_attn.q_proj.bias", Shape{q_dim});
      shapes.emplace_back(p + "self_attn.k_proj.bias", Shape{kv_dim});
      shapes.emplace_back(p + "self_attn.v_proj.bias", Shape{kv_dim});
    }
    if (c.qk_norm) {
      shapes.emplace_back(p + "self_attn.q_norm.weight", Shape{c.head_dim});
      shapes.emplace_back(p + "self_attn.k_norm.weight", Shape{c.head_dim});
    }
    shapes.emplace_back(p + "self_attn.o_proj.weight", Shape{d, q_dim});
    shapes.emplace_back(p + "post_attention_layernorm.weight", Shape{d});
    shapes.emplace_back(p + "mlp.gate_proj.weight", Shape{f, d});
    shapes.emplace_back(p + "mlp.up_proj.weight", Shape{f, d});
    shapes.emplace_back(p + "mlp.down_proj.weight", Shape{d, f});
  }
  shapes.emplace_back("model.norm.weight", Shape{d});
  if (!c.tie_word_embeddings) shapes.emplace_back("lm_head.weight", Shape{c.vocab_size, d});
  return shapes;
}

ModelConfig parse_hf_config(const json& config) {
  PAGEDLM_CHECK(config.is_object(), "config is not a JSON object");
  const ConfigKeys keys(config, "");
  const ArchInfo& arch = find_architecture(config);

  ModelConfig c;
  c.architecture = arch.architecture;
  c.model_type = arch.model_type;
  c.vocab_size = keys.get_positive_int("vocab_size");
  c.hidden_size = keys.get_positive_int("hidden_size");
  c.intermediate_size = keys.get_positive_int("intermediate_size");
  c.num_layers = keys.get_positive_int("num_hidden_layers");
  c.num_heads = keys.get_positive_int("num_attention_heads");
  c.num_kv_heads = keys.get_positive_int("num_key_value_heads", c.num_heads);
  PAGEDLM_CHECK(c.num_heads % c.num_kv_heads == 0, "num_attention_heads (", c.num_heads,
                ") is not a multiple of num_key_value_heads (", c.num_kv_heads, ")");
  if (keys.has("head_dim")) {
    c.head_dim = keys.get_positive_int("head_dim");
  } else {
    PAGEDLM_CHECK(c.hidden_size % c.num_heads == 0, "hidden_size (", c.hidden_size,
                  ") is not a multiple of num_attention_heads (", c.num_heads,
                  ") and the config gives no head_dim");
    c.head_dim = c.hidden_size / c.num_heads;
  }
  PAGEDLM_CHECK(c.head_dim % 2 == 0, "head_dim must be even for rope, got ", c.head_dim);
  c.max_position_embeddings = keys.get_positive_int("max_position_embeddings");
  c.rms_norm_eps = static_cast<float>(keys.get_float("rms_norm_eps", 1e-6));
  PAGEDLM_CHECK(c.rms_norm_eps > 0, "config key \"rms_norm_eps\" must be positive");
  c.tie_word_embeddings = keys.get_bool("tie_word_embeddings", false);
  c.attention_bias = arch.qkv_bias;
  c.qk_norm = arch.qk_norm;

  // Llama and Qwen3's attention_bias also adds an o_proj bias, which no model code here reads.
  PAGEDLM_CHECK(arch.qkv_bias || !keys.get_bool("attention_bias", false), "attention_bias=true ",
                "(biases on q/k/v/o projections) is unsupported for ", arch.architecture);
  PAGEDLM_CHECK(!keys.get_bool("mlp_bias", false), "mlp_bias=true is unsupported for ",
                arch.architecture);
  const std::string act = keys.get_string("hidden_act", "silu");
  PAGEDLM_CHECK(act == "silu", "unsupported hidden_act \"", act, "\" (only silu is supported)");

  // Mistral applies sliding_window whenever it is set; Qwen only with use_sliding_window.
  const bool sliding = arch.model_type == "mistral" || keys.get_bool("use_sliding_window", false);
  if (sliding && keys.has("sliding_window")) {
    const int64_t window = keys.get_int("sliding_window");
    PAGEDLM_CHECK(window >= c.max_position_embeddings,
                  "sliding window attention (sliding_window=", window,
                  " < max_position_embeddings=", c.max_position_embeddings, ") is unsupported");
  }

  parse_rope(keys, c);

  c.eos_token_ids = keys.get_token_ids("eos_token_id");
  const std::vector<int32_t> bos = keys.get_token_ids("bos_token_id");
  if (!bos.empty()) c.bos_token_id = bos.front();
  return c;
}

Checkpoint load_hf_checkpoint(const std::string& dir, const LoadProgress& progress) {
  const fs::path root(dir);
  const fs::path config_path = root / "config.json";
  PAGEDLM_CHECK(fs::is_regular_file(config_path), dir, " has no config.json");
  const json config = read_json_file(config_path);
  Checkpoint ckpt;
  try {
    ckpt.config = parse_hf_config(config);
  } catch (const Error& e) {
    fail(config_path.string(), ": ", e.what());
  }

  // generation_config.json often lists more stop tokens than config.json (Llama 3.1).
  const fs::path generation_path = root / "generation_config.json";
  if (fs::is_regular_file(generation_path)) {
    const json generation = read_json_file(generation_path);
    try {
      PAGEDLM_CHECK(generation.is_object(), "not a JSON object");
      const ConfigKeys keys(generation, "");
      add_unique(ckpt.config.eos_token_ids, keys.get_token_ids("eos_token_id"));
      const std::vector<int32_t> bos = keys.get_token_ids("bos_token_id");
      if (ckpt.config.bos_token_id < 0 && !bos.empty()) ckpt.config.bos_token_id = bos.front();
    } catch (const Error& e) {
      fail(generation_path.string(), ": ", e.what());
    }
  }

  const std::vector<Shard> shards = list_shards(root);
  size_t total_bytes = 0;
  for (const Shard& s : shards) total_bytes += fs::file_size(root / s.file);
  size_t done_bytes = 0;
  for (const Shard& s : shards) {
    const fs::path path = root / s.file;
    const SafetensorsFile file = SafetensorsFile::open(path.string());
    if (s.take_all) {
      ckpt.tensors.insert(file.tensors().begin(), file.tensors().end());
    }
    for (const std::string& name : s.names) {
      const auto it = file.tensors().find(name);
      PAGEDLM_CHECK(it != file.tensors().end(), "tensor ", name,
                    " is listed in model.safetensors.index.json but missing from shard ",
                    path.string());
      ckpt.tensors.emplace(name, it->second);
    }
    done_bytes += fs::file_size(path);
    if (progress) progress(done_bytes, total_bytes);
  }

  for (const auto& [name, shape] : expected_tensor_shapes(ckpt.config)) {
    try {
      const DType dtype = ckpt.get(name, shape).dtype();
      PAGEDLM_CHECK(dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16,
                    "tensor ", name, " has dtype ", dtype_name(dtype),
                    "; weights must be f32, f16 or bf16");
    } catch (const Error& e) {
      fail(dir, ": ", e.what());
    }
  }
  return ckpt;
}

Checkpoint load_checkpoint(const std::string& path, const LoadProgress& progress) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  PAGEDLM_CHECK(fs::exists(status), "checkpoint path ", path, " does not exist");
  if (fs::is_directory(status)) return load_hf_checkpoint(path, progress);
  if (fs::path(path).extension() == ".gguf" || has_gguf_magic(path)) {
    return load_gguf_checkpoint(path, progress);
  }
  fail(path, " is neither a Hugging Face checkpoint folder nor a GGUF file");
}

}  // namespace pagedlm
