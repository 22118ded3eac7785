// GGUF -> Checkpoint: llama.cpp metadata to ModelConfig, GGUF tensor names to Hugging Face
// names, dequantization to F32 and the undoing of the converter's Q/K row permutation.
#include <algorithm>
#include <cstring>
#include <optional>
#include <regex>

#include "pagedlm/core/error.h"
#include "pagedlm/io/checkpoint.h"
#include "pagedlm/io/gguf.h"

namespace pagedlm {
namespace {

struct ArchInfo {
  const char* gguf_name;
  const char* hf_architecture;
};

constexpr ArchInfo kArchs[] = {
    {"llama", "LlamaForCausalLM"},
    {"qwen2", "Qwen2ForCausalLM"},
    {"qwen3", "Qwen3ForCausalLM"},
};

int64_t positive(const GgufFile& f, const std::string& key, int64_t v) {
  PAGEDLM_CHECK(v > 0, "GGUF file '", f.path(), "' metadata '", key, "' must be positive, got ", v);
  return v;
}

int64_t get_positive(const GgufFile& f, const std::string& key) {
  return positive(f, key, f.get_int(key));
}

// GGUF per-layer names (after "blk.N.") -> HF names (after "model.layers.N.").
const std::map<std::string, std::string>& layer_names() {
  static const std::map<std::string, std::string> kNames = {
      {"attn_norm", "input_layernorm"},    {"attn_q", "self_attn.q_proj"},
      {"attn_k", "self_attn.k_proj"},      {"attn_v", "self_attn.v_proj"},
      {"attn_output", "self_attn.o_proj"}, {"attn_q_norm", "self_attn.q_norm"},
      {"attn_k_norm", "self_attn.k_norm"}, {"ffn_norm", "post_attention_layernorm"},
      {"ffn_gate", "mlp.gate_proj"},       {"ffn_up", "mlp.up_proj"},
      {"ffn_down", "mlp.down_proj"},
  };
  return kNames;
}

std::string hf_name(const std::string& gguf_name, const std::string& path) {
  static const std::map<std::string, std::string> kGlobal = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
      {"rope_freqs.weight", "rope_freqs"},
  };
  if (auto it = kGlobal.find(gguf_name); it != kGlobal.end()) return it->second;
  static const std::regex kLayer(R"(blk\.(\d+)\.(\w+)\.(weight|bias))");
  std::smatch m;
  if (std::regex_match(gguf_name, m, kLayer)) {
    if (auto it = layer_names().find(m[2].str()); it != layer_names().end()) {
      return cat("model.layers.", m[1].str(), ".", it->second, ".", m[3].str());
    }
  }
  fail("GGUF file '", path, "' has tensor '", gguf_name, "' that pagedlm does not know");
}

// The number of heads whose rows convert_hf_to_gguf.py permuted for llama, or 0 if none.
int64_t permuted_heads(const std::string& gguf_name, const ModelConfig& c) {
  if (c.model_type != "llama") return 0;
  static const std::regex kQ(R"(blk\.\d+\.attn_q\.(weight|bias))");
  static const std::regex kK(R"(blk\.\d+\.attn_k\.(weight|bias))");
  if (std::regex_match(gguf_name, kQ)) return c.num_heads;
  if (std::regex_match(gguf_name, kK)) return c.num_kv_heads;
  return 0;
}

// The GGUF row that holds HF row `r`. The converter interleaved each head's two rope halves
// (GGUF row h*d + 2j + s = HF row h*d + s*d/2 + j), so HF's rotate_half rope needs them split
// back.
int64_t gguf_row_of_hf_row(int64_t r, int64_t head_rows) {
  const int64_t h = r / head_rows;
  const int64_t i = r % head_rows;
  const int64_t half = head_rows / 2;
  return h * head_rows + (i < half ? 2 * i : 2 * (i - half) + 1);
}

// The rows of one head of a Q/K tensor the converter permuted (0: not permuted); throws unless
// the rows split into n_heads heads of even size. A 1-D bias is permuted element-wise: each
// element is a row of one value.
int64_t head_rows_of(const GgufTensorInfo& t, int64_t n_heads, const std::string& path) {
  if (n_heads <= 0) return 0;
  const int64_t row_elems = t.dims.empty() ? 1 : t.dims[0];
  const int64_t perm_rows =
      t.dims.size() == 1 ? row_elems : (row_elems == 0 ? 0 : t.numel() / row_elems);
  PAGEDLM_CHECK(perm_rows % n_heads == 0 && (perm_rows / n_heads) % 2 == 0, "GGUF file '", path,
                "' tensor '", t.name, "' has ", perm_rows, " rows, which do not split into ",
                n_heads, " heads of even size");
  return perm_rows / n_heads;
}

Tensor dequantize(const GgufTensorInfo& t, int64_t n_heads, const std::string& path) {
  Shape shape(t.dims.rbegin(), t.dims.rend());
  const int64_t row_elems = t.dims.empty() ? 1 : t.dims[0];
  const int64_t n_rows = row_elems == 0 ? 0 : t.numel() / row_elems;
  const bool bias = t.dims.size() == 1;
  const int64_t head_rows = head_rows_of(t, n_heads, path);
  Tensor out = Tensor::empty(DType::kF32, shape);
  float* dst = out.data<float>();
  const size_t row_bytes = t.row_bytes();
  if (bias) {
    dequantize_row(t.type, t.data, dst, row_elems);
    if (head_rows > 0) {
      std::vector<float> src(dst, dst + row_elems);
      for (int64_t r = 0; r < row_elems; ++r) dst[r] = src[gguf_row_of_hf_row(r, head_rows)];
    }
    return out;
  }
  // GgufFile::open checked ne0 against the block size, so nothing below throws: an exception
  // escaping an OpenMP region would terminate the process.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t src_row = head_rows > 0 ? gguf_row_of_hf_row(r, head_rows) : r;
    dequantize_row(t.type, t.data + src_row * row_bytes, dst + r * row_elems, row_elems);
  }
  return out;
}

// A Q4_1 or Q8_0 matrix's blocks, rows reordered as dequantize() reorders them.
std::optional<QuantizedMatrix> keep_blocks(const GgufTensorInfo& t, int64_t n_heads,
                                           const std::string& path) {
  if (t.dims.size() != 2 || (t.type != GgmlType::kQ4_1 && t.type != GgmlType::kQ8_0)) return {};
  QuantizedMatrix q;
  q.type = t.type == GgmlType::kQ4_1 ? QuantType::kQ4_1 : QuantType::kQ8_0;
  q.cols = t.dims[0];
  q.rows = t.dims[1];
  const size_t row_bytes = t.row_bytes();
  q.blocks.resize(row_bytes * q.rows);
  const int64_t head_rows = head_rows_of(t, n_heads, path);
  for (int64_t r = 0; r < q.rows; ++r) {
    const int64_t src_row = head_rows > 0 ? gguf_row_of_hf_row(r, head_rows) : r;
    std::memcpy(q.blocks.data() + r * row_bytes, t.data + src_row * row_bytes, row_bytes);
  }
  return q;
}

}  // namespace

ModelConfig config_from_gguf(const GgufFile& f) {
  const std::string& arch = f.get_string("general.architecture");
  const ArchInfo* info = nullptr;
  for (const ArchInfo& a : kArchs) {
    if (arch == a.gguf_name) info = &a;
  }
  PAGEDLM_CHECK(info != nullptr, "GGUF file '", f.path(), "' has architecture '", arch,
                "', which pagedlm does not support (supported: llama, qwen2, qwen3)");
  const std::string p = arch + ".";
  auto opt_int = [&](const std::string& key, int64_t fallback) {
    return f.find(key) ? f.get_int(key) : fallback;
  };
  auto opt_float = [&](const std::string& key, double fallback) {
    return f.find(key) ? f.get_float(key) : fallback;
  };

  ModelConfig c;
  c.architecture = info->hf_architecture;
  c.model_type = arch;
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
  c.max_position_embeddings = get_positive(f, p + "context_length");
  c.rope_theta = static_cast<float>(opt_float(p + "rope.freq_base", 10000.0));
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
  // Qwen2 always has q/k/v biases and Qwen3 always has q/k norms; reading the tensors rather
  // than the architecture also covers llama-architecture files that carry them.
  c.attention_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.qk_norm = f.find_tensor("blk.0.attn_q_norm.weight") != nullptr;

  if (const GgufValue* type = f.find(p + "rope.scaling.type")) {
    const std::string& kind = type->as_string();
    if (kind == "linear") {
      c.rope_scaling = RopeScaling::kLinear;
      c.rope_factor = static_cast<float>(f.get_float(p + "rope.scaling.factor"));
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
  return c;
}

Checkpoint load_gguf_checkpoint(const std::string& path, const LoadProgress& progress) {
  const GgufFile f = GgufFile::open(path);
  Checkpoint ckpt;
  ckpt.config = config_from_gguf(f);
  const size_t total = f.tensors().size();
  size_t done = 0;
  for (const GgufTensorInfo& t : f.tensors()) {
    std::string name = hf_name(t.name, path);
    const int64_t heads = permuted_heads(t.name, ckpt.config);
    if (auto blocks = keep_blocks(t, heads, path)) {
      ckpt.quantized.emplace(std::move(name), std::move(*blocks));
      if (progress) progress(++done, total);
      continue;
    }
    Tensor value = dequantize(t, heads, path);
    if (name == "rope_freqs") {
      check_tensor(value, DType::kF32, {ckpt.config.head_dim / 2},
                   cat("GGUF file '", path, "' tensor rope_freqs.weight"));
    }
    ckpt.tensors.emplace(std::move(name), std::move(value));
    if (progress) progress(++done, total);
  }
  return ckpt;
}

}  // namespace pagedlm
