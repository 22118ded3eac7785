// The Llama family: Llama (incl. llama3 rope), Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k
// norms), and the mixture-of-experts versions of the last two: Mixtral and Qwen3-MoE. They share
// one block (pre-norm attention and SwiGLU MLP, or SwiGLU experts) and differ in optional
// tensors, in which layers slide and in which layers' MLPs are experts.
#include <algorithm>

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

// The expert weights: HF's per-expert tensors ('*' is the expert) and llama.cpp's 3-D stacks.
std::vector<LayerWeightName> with_experts(std::vector<LayerWeightName> names, const char* router,
                                          const char* gate, const char* up, const char* down) {
  names.push_back({LayerWeight::kRouter, router, "ffn_gate_inp.weight", Shard::kNotSplit});
  names.push_back({LayerWeight::kExpertGate, gate, "ffn_gate_exps.weight", Shard::kNotSplit});
  names.push_back({LayerWeight::kExpertUp, up, "ffn_up_exps.weight", Shard::kNotSplit});
  names.push_back({LayerWeight::kExpertDown, down, "ffn_down_exps.weight", Shard::kNotSplit});
  return names;
}

const std::vector<LayerWeightName> kQwen3MoeNames =
    with_experts(kLlamaNames, "mlp.gate.weight", "mlp.experts.*.gate_proj.weight",
                 "mlp.experts.*.up_proj.weight", "mlp.experts.*.down_proj.weight");
const std::vector<LayerWeightName> kMixtralNames = with_experts(
    kLlamaNames, "block_sparse_moe.gate.weight", "block_sparse_moe.experts.*.w1.weight",
    "block_sparse_moe.experts.*.w3.weight", "block_sparse_moe.experts.*.w2.weight");

// Checks a MoE spec read from either file format.
void check_moe(const ModelConfig& c) {
  const MoeSpec& m = c.moe;
  PAGEDLM_CHECK(m.num_experts > 0 && m.experts_per_token > 0 &&
                    m.experts_per_token <= m.num_experts && m.expert_intermediate_size > 0,
                c.architecture, ": a mixture of experts needs 0 < experts per token (",
                m.experts_per_token, ") <= experts (", m.num_experts,
                ") and a positive expert size (", m.expert_intermediate_size, ")");
  // The router's top-k runs in one warp per token over registers (ops/moe.h).
  PAGEDLM_CHECK(m.num_experts <= 512 && m.experts_per_token <= 16, c.architecture, ": ",
                m.num_experts, " experts with ", m.experts_per_token,
                " per token are more than pagedlm supports (512 experts, 16 per token)");
}

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

// Qwen3-MoE: Qwen3's attention; layer i's MLP is sparse unless listed in mlp_only_layers, and
// then only every decoder_sparse_step-th layer (HF: (i + 1) % step == 0).
void read_qwen3_moe(const ConfigKeys& keys, ModelConfig& c) {
  read_qwen3(keys, c);
  PAGEDLM_CHECK(keys.get_int("shared_expert_intermediate_size", 0) == 0,
                "shared experts (shared_expert_intermediate_size) are unsupported for ",
                c.architecture);
  // The Hub's configs say num_experts; transformers 5 writes num_local_experts.
  c.moe.num_experts = keys.has("num_experts") ? keys.get_positive_int("num_experts")
                                              : keys.get_positive_int("num_local_experts");
  c.moe.experts_per_token = keys.get_positive_int("num_experts_per_tok");
  c.moe.expert_intermediate_size = keys.get_positive_int("moe_intermediate_size");
  c.moe.normalize_top_k = keys.get_bool("norm_topk_prob", false);  // HF's default
  check_moe(c);
  const int64_t step = keys.get_positive_int("decoder_sparse_step", 1);
  std::vector<int64_t> dense_layers;
  if (const nlohmann::json* list = keys.find("mlp_only_layers"); list && !list->is_null()) {
    PAGEDLM_CHECK(list->is_array(), "config key \"mlp_only_layers\" must be a list of layers");
    for (const nlohmann::json& v : *list) {
      PAGEDLM_CHECK(
          v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < c.num_layers,
          "config key \"mlp_only_layers\" holds ", v.dump(), ", not a layer index");
      dense_layers.push_back(v.get<int64_t>());
    }
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const bool dense = std::find(dense_layers.begin(), dense_layers.end(), i) != dense_layers.end();
    c.layers[i].sparse_mlp = !dense && (i + 1) % step == 0;
  }
}

// Mixtral: Mistral's attention, every MLP sparse; intermediate_size is each expert's, and the
// top 2 are always renormalized.
void read_mixtral(const ConfigKeys& keys, ModelConfig& c) {
  read_mistral(keys, c);
  c.moe.num_experts = keys.get_positive_int("num_local_experts");
  c.moe.experts_per_token = keys.get_positive_int("num_experts_per_tok");
  c.moe.expert_intermediate_size = c.intermediate_size;
  c.moe.normalize_top_k = true;
  check_moe(c);
  for (LayerSpec& l : c.layers) l.sparse_mlp = true;
}

// Qwen2 always has q/k/v biases and Qwen3 always has q/k norms; reading the tensors rather than
// the architecture also covers llama-architecture files that carry them.
void read_llama_gguf(const GgufFile& f, const std::string&, ModelConfig& c) {
  c.attention_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.qk_norm = f.find_tensor("blk.0.attn_q_norm.weight") != nullptr;
}

// llama.cpp's expert keys; every layer is sparse, as llama.cpp builds these architectures.
// Qwen3-MoE's GGUF files renormalize (llama.cpp hard-codes it) unless expert_weights_norm says.
void read_moe_gguf(const GgufFile& f, const std::string& prefix, ModelConfig& c) {
  read_llama_gguf(f, prefix, c);
  c.moe.num_experts = f.get_int(prefix + "expert_count");
  c.moe.experts_per_token = f.get_int(prefix + "expert_used_count");
  const std::string expert_ffn = prefix + "expert_feed_forward_length";
  c.moe.expert_intermediate_size = f.find(expert_ffn) ? f.get_int(expert_ffn) : c.intermediate_size;
  const std::string norm = prefix + "expert_weights_norm";
  c.moe.normalize_top_k = true;
  if (const GgufValue* v = f.find(norm)) {
    const bool* b = std::get_if<bool>(&v->value);
    PAGEDLM_CHECK(b != nullptr, "GGUF file '", f.path(), "' metadata '", norm, "' is not a bool");
    c.moe.normalize_top_k = *b;
  }
  check_moe(c);
  for (LayerSpec& l : c.layers) l.sparse_mlp = true;
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

extern const Family kQwen3MoeFamily = {
    "qwen3_moe",
    {"Qwen3MoeForCausalLM"},
    {"qwen3_moe"},
    "qwen3moe",
    kQwen3MoeNames,
    read_qwen3_moe,
    read_moe_gguf,
    /*gguf_interleaves_qk=*/false,
    /*mixture_of_experts=*/true,
};
// Mixtral's GGUF files say "llama" and carry llama.expert_count.
extern const Family kMixtralFamily = {
    "mixtral",
    {"MixtralForCausalLM"},
    {"mixtral"},
    "llama",
    kMixtralNames,
    read_mixtral,
    read_moe_gguf,
    /*gguf_interleaves_qk=*/true,
    /*mixture_of_experts=*/true,
};

}  // namespace pagedlm
