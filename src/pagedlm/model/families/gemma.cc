// The Gemma family: Gemma 2 and Gemma 3 (text). Beside Llama's block they have GeGLU (tanh
// GELU), RMSNorm weights stored as w - 1, norms after attention and after the MLP too,
// embeddings scaled by sqrt(hidden), query_pre_attn_scalar for the attention scale, and layers
// alternating between a sliding window and global attention. Gemma 2 soft-caps attention logits
// and the final logits; Gemma 3 has q/k norms and a rope of its own per layer type.
#include <cmath>
#include <variant>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/io/config_keys.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/model/family.h"

namespace pagedlm {
namespace {

const std::vector<LayerWeightName> kGemmaNames = {
    {LayerWeight::kAttnNorm, "input_layernorm.weight", "attn_norm.weight", Shard::kReplicated},
    {LayerWeight::kQ, "self_attn.q_proj.weight", "attn_q.weight", Shard::kRows},
    {LayerWeight::kK, "self_attn.k_proj.weight", "attn_k.weight", Shard::kKvHeadRows},
    {LayerWeight::kV, "self_attn.v_proj.weight", "attn_v.weight", Shard::kKvHeadRows},
    {LayerWeight::kQNorm, "self_attn.q_norm.weight", "attn_q_norm.weight", Shard::kReplicated},
    {LayerWeight::kKNorm, "self_attn.k_norm.weight", "attn_k_norm.weight", Shard::kReplicated},
    {LayerWeight::kO, "self_attn.o_proj.weight", "attn_output.weight", Shard::kCols},
    // Gemma's "post_attention_layernorm" normalizes the attention output, unlike Llama's.
    {LayerWeight::kAttnOutNorm, "post_attention_layernorm.weight", "post_attention_norm.weight",
     Shard::kReplicated},
    {LayerWeight::kFfnNorm, "pre_feedforward_layernorm.weight", "ffn_norm.weight",
     Shard::kReplicated},
    {LayerWeight::kGate, "mlp.gate_proj.weight", "ffn_gate.weight", Shard::kRows},
    {LayerWeight::kUp, "mlp.up_proj.weight", "ffn_up.weight", Shard::kRows},
    {LayerWeight::kDown, "mlp.down_proj.weight", "ffn_down.weight", Shard::kCols},
    {LayerWeight::kFfnOutNorm, "post_feedforward_layernorm.weight", "post_ffw_norm.weight",
     Shard::kReplicated},
};

// A soft-cap key: null or absent is none.
float read_softcap(const ConfigKeys& keys, const char* key) {
  const float cap = static_cast<float>(keys.get_float(key, 0.0));
  PAGEDLM_CHECK(cap >= 0, "config key \"", key, "\" must be positive or null, got ", cap);
  return cap;
}

// What Gemma 2 and 3 share in config.json.
void read_gemma_block(const ConfigKeys& keys, ModelConfig& c) {
  c.activation = Activation::kGeluTanh;
  // Gemma 1 configs named it hidden_act; both must be the tanh GELU Gemma is trained with.
  const std::string act = keys.has("hidden_activation")
                              ? keys.get_string("hidden_activation")
                              : keys.get_string("hidden_act", "gelu_pytorch_tanh");
  PAGEDLM_CHECK(act == "gelu_pytorch_tanh", "unsupported hidden_activation \"", act, "\" for ",
                c.architecture, " (only gelu_pytorch_tanh is supported)");
  PAGEDLM_CHECK(!keys.get_bool("attention_bias", false), "attention_bias=true is unsupported for ",
                c.architecture);
  c.norm_weight_offset = 1.f;
  c.sandwich_norms = true;
  c.embedding_scale = std::sqrt(static_cast<float>(c.hidden_size));
  c.tie_word_embeddings = keys.get_bool("tie_word_embeddings", true);
  const double scalar = keys.get_float("query_pre_attn_scalar", 256.0);
  PAGEDLM_CHECK(scalar > 0, "config key \"query_pre_attn_scalar\" must be positive, got ", scalar);
  const float softcap = read_softcap(keys, "attn_logit_softcapping");
  for (LayerSpec& l : c.layers) {
    l.attention.scale = static_cast<float>(1.0 / std::sqrt(scalar));
    l.attention.softcap = softcap;
  }
  c.final_logit_softcap = read_softcap(keys, "final_logit_softcapping");
}

void read_gemma2(const ConfigKeys& keys, ModelConfig& c) {
  read_gemma_block(keys, c);
  read_layer_types(keys, c, [](int64_t i) { return i % 2 == 0; });
}

// Gemma 3: rope per layer type. transformers 5 writes rope_parameters {full_attention: {...},
// sliding_attention: {...}}; the Hub's configs have rope_theta (global layers, default 1e6),
// rope_local_base_freq (sliding layers, default 1e4) and rope_scaling (global layers only).
void read_gemma3(const ConfigKeys& keys, ModelConfig& c) {
  read_gemma_block(keys, c);
  c.qk_norm = true;
  RopeSpec global, local;
  const std::optional<ConfigKeys> params = keys.get_object("rope_parameters");
  if (params && (params->has("full_attention") || params->has("sliding_attention"))) {
    const std::optional<ConfigKeys> full = params->get_object("full_attention");
    const std::optional<ConfigKeys> sliding = params->get_object("sliding_attention");
    global = read_rope(full ? &*full : nullptr, 1e6);
    local = read_rope(sliding ? &*sliding : nullptr, 1e4);
  } else {
    const std::optional<ConfigKeys> scaling = params ? params : keys.get_object("rope_scaling");
    global = read_rope(scaling ? &*scaling : nullptr, keys.get_float("rope_theta", 1e6));
    local = read_rope(nullptr, keys.get_float("rope_local_base_freq", 1e4));
  }
  c.rope = global;
  for (LayerSpec& l : c.layers) l.rope = global;
  const int64_t pattern = keys.has("sliding_window_pattern")
                              ? keys.get_positive_int("sliding_window_pattern")
                              : keys.get_positive_int("_sliding_window_pattern", 6);
  read_layer_types(
      keys, c, [&](int64_t i) { return (i + 1) % pattern != 0; }, &local);
}

// GGUF: llama.cpp's converter stores the norms as 1 + w already, and llama.cpp derives the
// attention scale from the model size (query_pre_attn_scalar is not in the file): hidden / heads
// for the 27B models (46 layers for Gemma 2, 62 for Gemma 3), head_dim for the others. Which
// layers slide: the file's sliding_window_pattern, else llama.cpp's fixed period.
void read_gemma_gguf(const GgufFile& f, const std::string& p, ModelConfig& c, int64_t layers_27b,
                     int64_t swa_pattern) {
  c.activation = Activation::kGeluTanh;
  c.norm_weight_offset = 0.f;
  c.sandwich_norms = true;
  c.embedding_scale = std::sqrt(static_cast<float>(c.hidden_size));
  const double scalar = c.num_layers == layers_27b
                            ? static_cast<double>(c.hidden_size) / static_cast<double>(c.num_heads)
                            : static_cast<double>(c.head_dim);
  const float softcap =
      f.find(p + "attn_logit_softcapping") ? f.get_float(p + "attn_logit_softcapping") : 0.f;
  // Newer converters write the layer pattern (a period, or one bool per layer) and leave out
  // sliding_window when no layer slides.
  const int64_t window =
      f.find(p + "attention.sliding_window") ? f.get_int(p + "attention.sliding_window") : 0;
  PAGEDLM_CHECK(window >= 0 && window <= INT32_MAX, "GGUF file '", f.path(), "' metadata '", p,
                "attention.sliding_window' must be a non-negative int32, got ", window);
  std::vector<bool> slides(c.num_layers);
  const GgufValue* pattern = f.find(p + "attention.sliding_window_pattern");
  if (pattern != nullptr && !pattern->is_int()) {
    const GgufValue::Array& flags = pattern->as_array();
    PAGEDLM_CHECK(static_cast<int64_t>(flags.size()) == c.num_layers, "GGUF file '", f.path(),
                  "' metadata '", p, "attention.sliding_window_pattern' has ", flags.size(),
                  " entries for ", c.num_layers, " layers");
    for (int64_t i = 0; i < c.num_layers; ++i) {
      PAGEDLM_CHECK(std::holds_alternative<bool>(flags[i].value), "GGUF file '", f.path(),
                    "' metadata '", p, "attention.sliding_window_pattern' must hold bools");
      slides[i] = std::get<bool>(flags[i].value);
    }
  } else {
    if (pattern != nullptr) swa_pattern = pattern->as_int();
    PAGEDLM_CHECK(swa_pattern > 0, "GGUF file '", f.path(), "' metadata '", p,
                  "attention.sliding_window_pattern' must be positive, got ", swa_pattern);
    // llama.cpp's period: layer i slides unless i % period == period - 1.
    for (int64_t i = 0; i < c.num_layers; ++i) slides[i] = i % swa_pattern < swa_pattern - 1;
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerSpec& l = c.layers[i];
    l.attention.scale = static_cast<float>(1.0 / std::sqrt(scalar));
    l.attention.softcap = softcap;
    if (slides[i] && window > 0) l.attention.window = static_cast<int32_t>(window);
  }
  c.final_logit_softcap =
      f.find(p + "final_logit_softcapping") ? f.get_float(p + "final_logit_softcapping") : 0.f;
}

void read_gemma2_gguf(const GgufFile& f, const std::string& p, ModelConfig& c) {
  read_gemma_gguf(f, p, c, 46, 2);
}

// Gemma 3's sliding layers rotate with rope.freq_base_swa (1e4 when absent, llama.cpp's
// default) and no scaling; rope.freq_base and any rope scaling are the global layers'.
void read_gemma3_gguf(const GgufFile& f, const std::string& p, ModelConfig& c) {
  read_gemma_gguf(f, p, c, 62, 6);
  c.qk_norm = true;
  RopeSpec local;
  local.theta = f.find(p + "rope.freq_base_swa") ? f.get_float(p + "rope.freq_base_swa") : 1e4f;
  for (LayerSpec& l : c.layers) {
    if (l.attention.window != 0) l.rope = local;
  }
}

}  // namespace

extern const Family kGemma2Family = {
    "gemma2",    {"Gemma2ForCausalLM"}, {"gemma2"},       "gemma2",
    kGemmaNames, read_gemma2,           read_gemma2_gguf,
};
extern const Family kGemma3Family = {
    "gemma3",    {"Gemma3ForCausalLM"}, {"gemma3_text"},  "gemma3",
    kGemmaNames, read_gemma3,           read_gemma3_gguf,
};

}  // namespace pagedlm
