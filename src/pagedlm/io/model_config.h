// ModelConfig: everything the model code needs to know about an architecture instance,
// whatever file format it came from (HF config.json or GGUF metadata).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pagedlm {

enum class RopeScaling : uint8_t { kNone, kLlama3, kLinear };

struct ModelConfig {
  std::string architecture;  // HF class name, e.g. "LlamaForCausalLM"
  std::string model_type;    // "llama", "mistral", "qwen2", "qwen3"
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
  bool qk_norm = false;         // per-head RMSNorm of q and k before rope (Qwen3)

  // Rope: inv_freq[i] = rope_theta^(-2i/head_dim), then scaled as below.
  float rope_theta = 10000.f;
  RopeScaling rope_scaling = RopeScaling::kNone;
  float rope_factor = 1.f;
  float rope_low_freq_factor = 1.f;
  float rope_high_freq_factor = 4.f;
  int64_t rope_original_max_position = 0;

  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;
};

}  // namespace pagedlm
