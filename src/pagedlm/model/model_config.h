// ModelConfig: everything the model code needs to know about an architecture instance, whatever
// file format it came from (HF config.json or GGUF metadata). A family (model/family.h) fills it
// in: the dimensions, the block structure and one attention spec per layer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedlm/core/attention_variant.h"

namespace pagedlm {

enum class RopeType : uint8_t { kDefault, kLinear, kLlama3, kYarn };

// A layer's rotary embedding: inv_freq[i] = theta^(-2i/head_dim), then rescaled per `type`
// exactly as HF transformers' modeling_rope_utils does (model/rope.h computes it).
struct RopeSpec {
  RopeType type = RopeType::kDefault;
  float theta = 10000.f;
  float factor = 1.f;                 // linear, llama3, yarn
  float low_freq_factor = 1.f;        // llama3
  float high_freq_factor = 4.f;       // llama3
  int64_t original_max_position = 0;  // llama3, yarn
  float beta_fast = 32.f;             // yarn
  float beta_slow = 1.f;              // yarn
  bool truncate = true;               // yarn: round the correction range outwards
  // YaRN's attention factor: HF multiplies cos and sin by it, so q.k grows by its square. The
  // family folds that square into the layer's AttentionVariant::scale; rope itself stays plain.
  float attention_factor = 1.f;

  bool operator==(const RopeSpec&) const = default;
};

// One decoder layer's attention: how its queries score keys and how q and k are rotated.
struct LayerSpec {
  AttentionVariant attention;
  RopeSpec rope;
  // The layer's MLP is the mixture of experts (ModelConfig::moe), not the dense gated MLP.
  bool sparse_mlp = false;
};

// The gated MLP's activation: SwiGLU (Llama) or GeGLU with tanh-approximated GELU (Gemma).
enum class Activation : uint8_t { kSilu, kGeluTanh };

// A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks `experts_per_token` of
// `num_experts` gated MLPs per token (softmax over the router's logits, the top k, renormalized
// to sum 1 when `normalize_top_k`), and the token's output is their weighted sum.
struct MoeSpec {
  int64_t num_experts = 0;  // 0: every layer's MLP is dense
  int64_t experts_per_token = 0;
  int64_t expert_intermediate_size = 0;
  bool normalize_top_k = true;
};

struct ModelConfig {
  std::string architecture;  // HF class name, e.g. "LlamaForCausalLM"
  std::string model_type;    // the family's name: "llama", "mistral", "qwen2", "gemma2", ...
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  float rms_norm_eps = 1e-5f;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projection biases (Qwen2)
  bool qk_norm = false;         // per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)

  // Block structure.
  Activation activation = Activation::kSilu;
  // RMSNorm multiplies by (norm_weight_offset + w): 1 for Gemma's checkpoints, which store w - 1
  // (llama.cpp's converter adds the 1 into GGUF files, so those read 0).
  float norm_weight_offset = 0.f;
  // Gemma 2/3: the attention output and the MLP output are normalized too, before each joins the
  // residual stream (pre- and post- norms around both sublayers).
  bool sandwich_norms = false;
  float embedding_scale = 1.f;      // Gemma: sqrt(hidden_size)
  float final_logit_softcap = 0.f;  // Gemma 2: logits = cap * tanh(logits / cap); 0: none

  MoeSpec moe;  // the layers with LayerSpec::sparse_mlp use it

  // The rope of layers whose own spec says nothing else (GGUF Llama 3 files carry rope_freqs).
  RopeSpec rope;
  std::vector<LayerSpec> layers;  // [num_layers]

  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;

  // The largest sliding window over the layers when every layer has one (0 otherwise): keys
  // older than that are never read again, by any layer.
  int32_t window_of_all_layers() const {
    int32_t widest = 0;
    for (const LayerSpec& l : layers) {
      if (l.attention.window == 0) return 0;
      widest = l.attention.window > widest ? l.attention.window : widest;
    }
    return widest;
  }
};

}  // namespace pagedlm
