// The Llama family: Llama (incl. llama3 rope), Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k
// norms). They share one block (pre-norm attention and SwiGLU MLP) and differ in optional
// tensors and in which layers slide.
#include "pagedlm/core/error.h"
#include "pagedlm/io/config_keys.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/model/family.h"

namespace pagedlm {
namespace {

// HF's Llama-style names, and llama.cpp's (after "model.layers.N." / "blk.N.").
const std::vector<LayerWeightName> kLlamaNames = {
    {LayerWeight::kAttnNorm, "input_layernorm.weight", "attn_norm.weight", Shard::kReplicated},
    {LayerWeight::kQ, "self_attn.q_proj.weight", "attn_q.weight", Shard::kRows},
    {LayerWeight::kK, "self_attn.k_proj.weight", "attn_k.weight", Shard::kKvHeadRows},
    {LayerWeight::kV, "self_attn.v_proj.weight", "attn_v.weight", Shard::kKvHeadRows},
    {LayerWeight::kQBias, "self_attn.q_proj.bias", "attn_q.bias", Shard::kRows},
    {LayerWeight::kKBias, "self_attn.k_proj.bias", "attn_k.bias", Shard::kKvHeadRows},
    {LayerWeight::kVBias, "self_attn.v_proj.bias", "attn_v.bias", Shard::kKvHeadRows},
    {LayerWeight::kQNorm, "self_attn.q_norm.weight", "attn_q_norm.weight", Shard::kReplicated},
    {LayerWeight::kKNorm, "self_attn.k_norm.weight", "attn_k_norm.weight", Shard::kReplicated},
    {LayerWeight::kO, "self_attn.o_proj.weight", "attn_output.weight", Shard::kCols},
    // Llama calls the norm before its MLP "post_attention_layernorm".
    {LayerWeight::kFfnNorm, "post_attention_layernorm.weight", "ffn_norm.weight",
     Shard::kReplicated},
    {LayerWeight::kGate, "mlp.gate_proj.weight", "ffn_gate.weight", Shard::kRows},
    {LayerWeight::kUp, "mlp.up_proj.weight", "ffn_up.weight", Shard::kRows},
    {LayerWeight::kDown, "mlp.down_proj.weight", "ffn_down.weight", Shard::kCols},
};

// The keys that would ask for what this block does not have.
void check_llama_block(const ConfigKeys& keys, const ModelConfig& c, bool qkv_bias) {
  // Llama and Qwen3's attention_bias also adds an o_proj bias, which no model code here reads.
  PAGEDLM_CHECK(qkv_bias || !keys.get_bool("attention_bias", false), "attention_bias=true ",
                "(biases on q/k/v/o projections) is unsupported for ", c.architecture);
  PAGEDLM_CHECK(!keys.get_bool("mlp_bias", false), "mlp_bias=true is unsupported for ",
                c.architecture);
  const std::string act = keys.get_string("hidden_act", "silu");
  PAGEDLM_CHECK(act == "silu", "unsupported hidden_act \"", act, "\" (only silu is supported)");
}

bool every_layer_slides(int64_t) { return true; }

void read_llama(const ConfigKeys& keys, ModelConfig& c) { check_llama_block(keys, c, false); }

// Mistral slides every layer whenever sliding_window is set.
void read_mistral(const ConfigKeys& keys, ModelConfig& c) {
  check_llama_block(keys, c, false);
  if (keys.has("sliding_window")) read_layer_types(keys, c, every_layer_slides);
}

// Qwen2/Qwen3 slide only with use_sliding_window, and then layers from max_window_layers on.
void read_qwen_layers(const ConfigKeys& keys, ModelConfig& c) {
  if (!keys.get_bool("use_sliding_window", false) || !keys.has("sliding_window")) return;
  const int64_t max_window_layers = keys.get_int("max_window_layers", 28);
  read_layer_types(keys, c, [&](int64_t i) { return i >= max_window_layers; });
}

void read_qwen2(const ConfigKeys& keys, ModelConfig& c) {
  check_llama_block(keys, c, true);
  c.attention_bias = true;  // Qwen2 hard-codes q/k/v biases in its modeling code; no config key
  read_qwen_layers(keys, c);
}

void read_qwen3(const ConfigKeys& keys, ModelConfig& c) {
  check_llama_block(keys, c, false);
  c.qk_norm = true;
  read_qwen_layers(keys, c);
}

// Qwen2 always has q/k/v biases and Qwen3 always has q/k norms; reading the tensors rather than
// the architecture also covers llama-architecture files that carry them.
void read_llama_gguf(const GgufFile& f, const std::string&, ModelConfig& c) {
  c.attention_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.qk_norm = f.find_tensor("blk.0.attn_q_norm.weight") != nullptr;
}

}  // namespace

extern const Family kLlamaFamily = {
    "llama",
    {"LlamaForCausalLM"},
    {"llama"},
    "llama",
    kLlamaNames,
    read_llama,
    read_llama_gguf,
    /*gguf_interleaves_qk=*/true,
};
// Mistral's GGUF files say "llama".
extern const Family kMistralFamily = {
    "mistral",   {"MistralForCausalLM"}, {"mistral"},     nullptr,
    kLlamaNames, read_mistral,           read_llama_gguf,
};
extern const Family kQwen2Family = {
    "qwen2", {"Qwen2ForCausalLM"}, {"qwen2"}, "qwen2", kLlamaNames, read_qwen2, read_llama_gguf,
};
extern const Family kQwen3Family = {
    "qwen3", {"Qwen3ForCausalLM"}, {"qwen3"}, "qwen3", kLlamaNames, read_qwen3, read_llama_gguf,
};

}  // namespace pagedlm
