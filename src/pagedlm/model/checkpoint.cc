#include "pagedlm/model/checkpoint.h"

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "pagedlm/core/error.h"
#include "pagedlm/io/config_keys.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/model/rope.h"

namespace pagedlm {

namespace fs = std::filesystem;

namespace {

void add_unique(std::vector<int32_t>& ids, const std::vector<int32_t>& more) {
  for (int32_t id : more) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  }
}

int64_t positive(const GgufFile& f, const std::string& key, int64_t v) {
  PAGEDLM_CHECK(v > 0, "GGUF file '", f.path(), "' metadata '", key, "' must be positive, got ", v);
  return v;
}

int64_t get_positive(const GgufFile& f, const std::string& key) {
  return positive(f, key, f.get_int(key));
}

// Every layer the same until the family says otherwise: HF's scale, no window, the model's rope.
void default_layers(ModelConfig& c) {
  LayerSpec layer;
  layer.attention.scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  layer.rope = c.rope;
  c.layers.assign(c.num_layers, layer);
}

// YaRN's attention factor multiplies cos and sin of q and k alike (HF), so every score grows by
// its square: folded into the scale once the family has set it.
void fold_rope_attention_factor(ModelConfig& c) {
  for (LayerSpec& l : c.layers) {
    l.attention.scale *= l.rope.attention_factor * l.rope.attention_factor;
  }
}

void check_shape(const std::string& name, const Shape& shape, const Shape& expected_shape) {
  PAGEDLM_CHECK(shape == expected_shape, "tensor ", name, " has shape ", shape_str(shape),
                " but the config implies ", shape_str(expected_shape));
}

}  // namespace

Tensor Checkpoint::get(const std::string& name, const Shape& expected_shape) const {
  if (const QuantizedMatrix* q = blocks(name, expected_shape)) {
    Tensor out = Tensor::empty(DType::kF32, {q->rows, q->cols});
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < q->rows; ++r) dequantize_row(*q, r, out.data<float>() + r * q->cols);
    return out;
  }
  if (const auto f = fp8.find(name); f != fp8.end()) {
    check_shape(name, f->second.weight.shape(), expected_shape);
    return f->second.dequantize();
  }
  const auto it = tensors.find(name);
  PAGEDLM_CHECK(it != tensors.end(), "checkpoint has no tensor ", name, " (expected shape ",
                shape_str(expected_shape), ")");
  check_shape(name, it->second.shape(), expected_shape);
  return it->second;
}

void Checkpoint::release_weights() {
  tensors.clear();
  quantized.clear();
  // The blocks below malloc's mapping threshold were freed into the heap, under the model's own
  // copies made after them, where they stay resident until trimmed: SmolLM2 Q4_0's server held
  // 169 MB for an 87 MB file without this.
  malloc_trim(0);
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
  for (const auto& [name, m] : fp8) out.emplace(name, m.weight.shape());
  return out;
}

namespace {

// GGUF per-layer names (after "blk.N.") of the family -> HF names (after "model.layers.N.").
std::string hf_name_of_gguf(const Family& family, const std::string& gguf_name,
                            const std::string& path) {
  static const std::map<std::string, std::string> kGlobal = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
      {"rope_freqs.weight", "rope_freqs"},
  };
  if (auto it = kGlobal.find(gguf_name); it != kGlobal.end()) return it->second;
  static const std::regex kLayer(R"(blk\.(\d+)\.(.+))");
  std::smatch m;
  if (std::regex_match(gguf_name, m, kLayer)) {
    for (const LayerWeightName& n : family.layer_weights) {
      if (m[2].str() == n.gguf) return cat("model.layers.", m[1].str(), ".", n.hf);
    }
  }
  fail("GGUF file '", path, "' has tensor '", gguf_name, "' that pagedlm does not know");
}

// The number of heads whose rows llama.cpp's converter interleaved, or 0 if none.
int64_t interleaved_heads(const Family& family, const std::string& gguf_name,
                          const ModelConfig& c) {
  if (!family.gguf_interleaves_qk) return 0;
  static const std::regex kQ(R"(blk\.\d+\.attn_q\.(weight|bias))");
  static const std::regex kK(R"(blk\.\d+\.attn_k\.(weight|bias))");
  if (std::regex_match(gguf_name, kQ)) return c.num_heads;
  if (std::regex_match(gguf_name, kK)) return c.num_kv_heads;
  return 0;
}

// Stores a GGUF 3-D expert tensor [experts, rows, cols] as one HF tensor per expert, the
// expert's index in place of the name's '*': quantized ones keep their blocks.
void add_experts(Checkpoint& ckpt, const GgufTensorInfo& t, const std::string& name_pattern,
                 const std::string& path) {
  PAGEDLM_CHECK(t.dims.size() == 3 && t.dims[2] > 0, "GGUF file '", path, "' tensor '", t.name,
                "' must be 3-D [experts, rows, cols], got ", t.dims.size(), " dims");
  const int64_t experts = t.dims[2], rows = t.dims[1];
  const size_t star = name_pattern.find('*');
  auto name_of = [&](int64_t e) {
    std::string name = name_pattern;
    return name.replace(star, 1, std::to_string(e));
  };
  if (std::optional<QuantizedMatrix> blocks = gguf_tensor_blocks(t, 0, path)) {
    const size_t expert_bytes = static_cast<size_t>(rows * blocks->row_bytes());
    for (int64_t e = 0; e < experts; ++e) {
      QuantizedMatrix q;
      q.type = blocks->type;
      q.rows = rows;
      q.cols = blocks->cols;
      const auto first = blocks->blocks.begin() + static_cast<ptrdiff_t>(e * expert_bytes);
      q.blocks.assign(first, first + static_cast<ptrdiff_t>(expert_bytes));
      ckpt.quantized.emplace(name_of(e), std::move(q));
    }
    return;
  }
  const Tensor all = gguf_tensor_f32(t, 0, path).reshape({experts * rows, t.dims[0]});
  for (int64_t e = 0; e < experts; ++e) {
    ckpt.tensors.emplace(name_of(e), all.rows(e * rows, (e + 1) * rows));
  }
}

// Rope rotates pairs of a head's features: both config readers refuse an odd head size.
void require_even_head_dim(int64_t head_dim) {
  PAGEDLM_CHECK(head_dim % 2 == 0, "head_dim must be even for rope, got ", head_dim);
}

}  // namespace

ModelConfig parse_hf_config(const nlohmann::json& config) {
  PAGEDLM_CHECK(config.is_object(), "config is not a JSON object");
  const ConfigKeys keys(config, "");
  std::string architecture;
  const Family* family = nullptr;
  if (const nlohmann::json* archs = keys.find("architectures")) {
    PAGEDLM_CHECK(archs->is_array() && !archs->empty() && (*archs)[0].is_string(),
                  "config key \"architectures\" must be a non-empty list of class names, got ",
                  archs->dump());
    architecture = (*archs)[0].get<std::string>();
    family = &family_for_hf_architecture(architecture);
  } else {
    // Some converted checkpoints omit "architectures"; model_type then names the family.
    family = &family_for_hf_model_type(keys.get_string("model_type"));
    architecture = family->hf_architectures.front();
  }

  // The keys every family shares.
  ModelConfig c;
  c.architecture = architecture;
  c.model_type = family->name;
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
  require_even_head_dim(c.head_dim);
  c.max_position_embeddings = keys.get_positive_int("max_position_embeddings");
  c.rms_norm_eps = static_cast<float>(keys.get_float("rms_norm_eps", 1e-6));
  PAGEDLM_CHECK(c.rms_norm_eps > 0, "config key \"rms_norm_eps\" must be positive");
  c.tie_word_embeddings = keys.get_bool("tie_word_embeddings", false);
  // transformers 5's rope_parameters, or the Hub's top-level rope_theta and rope_scaling.
  const double theta = keys.get_float("rope_theta", 10000.0);
  const std::optional<ConfigKeys> rope = keys.has("rope_parameters")
                                             ? keys.get_object("rope_parameters")
                                             : keys.get_object("rope_scaling");
  c.rope = read_rope(rope ? &*rope : nullptr, theta);
  c.eos_token_ids = keys.get_token_ids("eos_token_id");
  const std::vector<int32_t> bos = keys.get_token_ids("bos_token_id");
  if (!bos.empty()) c.bos_token_id = bos.front();

  default_layers(c);
  family->read_hf_config(keys, c);
  fold_rope_attention_factor(c);
  return c;
}

Checkpoint load_hf_checkpoint(const std::string& dir, const LoadProgress& progress) {
  const fs::path root(dir);
  const fs::path config_path = root / "config.json";
  PAGEDLM_CHECK(fs::is_regular_file(config_path), dir, " has no config.json");
  const nlohmann::json config = read_json_file(config_path.string());
  Checkpoint ckpt;
  try {
    ckpt.config = parse_hf_config(config);
    ckpt.quantization = parse_quant_config(config);
  } catch (const Error& e) {
    fail(config_path.string(), ": ", e.what());
  }

  // generation_config.json often lists more stop tokens than config.json (Llama 3.1).
  const fs::path generation_path = root / "generation_config.json";
  if (fs::is_regular_file(generation_path)) {
    const nlohmann::json generation = read_json_file(generation_path.string());
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

  ckpt.tensors = read_safetensors_folder(dir, progress);
  try {
    take_fp8_weights(ckpt.quantization, ckpt.tensors, ckpt.fp8, ckpt.kv_scales);
  } catch (const Error& e) {
    fail(dir, ": ", e.what());
  }
  for (const auto& [name, shape] : expected_tensor_shapes(ckpt.config)) {
    try {
      if (const auto f = ckpt.fp8.find(name); f != ckpt.fp8.end()) {
        check_shape(name, f->second.weight.shape(), shape);  // f32 once dequantized
        continue;
      }
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

ModelConfig config_from_gguf(const GgufFile& f) {
  const std::string& arch = f.get_string("general.architecture");
  const Family* family = nullptr;
  try {
    family = &family_for_gguf_architecture(
        arch, f.find(arch + ".expert_count") != nullptr && f.get_int(arch + ".expert_count") > 0);
  } catch (const Error& e) {
    fail("GGUF file '", f.path(), "': ", e.what());
  }
  const std::string p = arch + ".";
  auto opt_int = [&](const std::string& key, int64_t fallback) {
    return f.find(key) ? f.get_int(key) : fallback;
  };
  auto opt_float = [&](const std::string& key, double fallback) {
    return f.find(key) ? f.get_float(key) : fallback;
  };

  ModelConfig c;
  c.architecture = family->hf_architectures.front();
  c.model_type = family->name;
  c.hidden_size = get_positive(f, p + "embedding_length");
  c.intermediate_size = get_positive(f, p + "feed_forward_length");
  c.num_layers = get_positive(f, p + "block_count");
  c.num_heads = get_positive(f, p + "attention.head_count");
  c.num_kv_heads = positive(f, p + "attention.head_count_kv",
                            opt_int(p + "attention.head_count_kv", c.num_heads));
  PAGEDLM_CHECK(c.num_heads % c.num_kv_heads == 0, "GGUF file '", f.path(), "': head_count ",
                c.num_heads, " is not a multiple of head_count_kv ", c.num_kv_heads);
  if (f.find(p + "attention.key_length")) {
    c.head_dim = get_positive(f, p + "attention.key_length");
  } else if (f.find(p + "rope.dimension_count")) {
    c.head_dim = get_positive(f, p + "rope.dimension_count");
  } else {
    c.head_dim = c.hidden_size / c.num_heads;
  }
  require_even_head_dim(c.head_dim);
  c.max_position_embeddings = get_positive(f, p + "context_length");
  c.rope.theta = static_cast<float>(opt_float(p + "rope.freq_base", 10000.0));
  c.rms_norm_eps = static_cast<float>(opt_float(p + "attention.layer_norm_rms_epsilon", 1e-5));

  if (f.find(p + "vocab_size")) {
    c.vocab_size = get_positive(f, p + "vocab_size");
  } else if (f.find("tokenizer.ggml.tokens")) {
    c.vocab_size =
        positive(f, "tokenizer.ggml.tokens",
                 static_cast<int64_t>(f.get_string_array("tokenizer.ggml.tokens").size()));
  } else {
    fail("GGUF file '", f.path(), "' has neither ", p, "vocab_size nor tokenizer.ggml.tokens");
  }

  c.tie_word_embeddings = f.find_tensor("output.weight") == nullptr;

  if (const GgufValue* type = f.find(p + "rope.scaling.type")) {
    const std::string& kind = type->as_string();
    if (kind == "linear") {
      c.rope.type = RopeType::kLinear;
      c.rope.factor = static_cast<float>(f.get_float(p + "rope.scaling.factor"));
    } else if (kind == "yarn") {
      // llama.cpp's yarn keys; beta and the attention factor default as in HF and llama.cpp.
      c.rope.type = RopeType::kYarn;
      c.rope.factor = static_cast<float>(f.get_float(p + "rope.scaling.factor"));
      PAGEDLM_CHECK(c.rope.factor > 0, "GGUF file '", f.path(), "' rope.scaling.factor must be ",
                    "positive, got ", c.rope.factor);
      c.rope.original_max_position = get_positive(f, p + "rope.scaling.original_context_length");
      c.rope.beta_fast = static_cast<float>(opt_float(p + "rope.scaling.yarn_beta_fast", 32.0));
      c.rope.beta_slow = static_cast<float>(opt_float(p + "rope.scaling.yarn_beta_slow", 1.0));
      c.rope.attention_factor = static_cast<float>(
          opt_float(p + "rope.scaling.yarn_attn_factor", yarn_attention_factor(c.rope.factor)));
    } else {
      PAGEDLM_CHECK(kind == "none", "GGUF file '", f.path(), "' uses rope scaling '", kind,
                    "', which pagedlm does not support");
    }
  }

  // Llama 3 instruct files name their end-of-turn tokens separately from eos; generation must
  // stop on all of them, as HF's generation_config eos list does.
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                          "tokenizer.ggml.eom_token_id"}) {
    if (!f.find(key)) continue;
    const auto id = static_cast<int32_t>(f.get_int(key));
    if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end()) {
      c.eos_token_ids.push_back(id);
    }
  }
  if (f.find("tokenizer.ggml.bos_token_id")) {
    c.bos_token_id = static_cast<int32_t>(f.get_int("tokenizer.ggml.bos_token_id"));
  }
  default_layers(c);
  family->read_gguf_config(f, p, c);
  fold_rope_attention_factor(c);
  return c;
}

Checkpoint load_gguf_checkpoint(const std::string& path, const LoadProgress& progress) {
  const GgufFile f = GgufFile::open(path);
  Checkpoint ckpt;
  ckpt.config = config_from_gguf(f);
  const Family& family = family_of(ckpt.config);
  const size_t total = f.tensors().size();
  size_t done = 0;
  for (const GgufTensorInfo& t : f.tensors()) {
    std::string name = hf_name_of_gguf(family, t.name, path);
    const int64_t heads = interleaved_heads(family, t.name, ckpt.config);
    if (name.find('*') != std::string::npos) {  // all experts in one 3-D tensor: one per expert
      add_experts(ckpt, t, name, path);
      if (progress) progress(++done, total);
      continue;
    }
    if (auto blocks = gguf_tensor_blocks(t, heads, path)) {
      ckpt.quantized.emplace(std::move(name), std::move(*blocks));
      if (progress) progress(++done, total);
      continue;
    }
    Tensor value = gguf_tensor_f32(t, heads, path);
    if (name == "rope_freqs") {
      check_tensor(value, DType::kF32, {ckpt.config.head_dim / 2},
                   cat("GGUF file '", path, "' tensor rope_freqs.weight"));
    }
    ckpt.tensors.emplace(std::move(name), std::move(value));
    if (progress) progress(++done, total);
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
