// Phi-3: Llama's block with q/k/v stored as one qkv_proj and gate/up as one gate_up_proj (the
// layout the model computes with anyway), and a sliding window on every layer when set.
#include "pagedlm/core/error.h"
#include "pagedlm/io/config_keys.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/model/family.h"

namespace pagedlm {
namespace {

const std::vector<LayerWeightName> kPhi3Names = {
    {LayerWeight::kAttnNorm, "input_layernorm.weight", "attn_norm.weight", Shard::kReplicated},
    {LayerWeight::kQkv, "self_attn.qkv_proj.weight", "attn_qkv.weight", Shard::kQkvHeadRows},
    {LayerWeight::kO, "self_attn.o_proj.weight", "attn_output.weight", Shard::kCols},
    {LayerWeight::kFfnNorm, "post_attention_layernorm.weight", "ffn_norm.weight",
     Shard::kReplicated},
    // llama.cpp keeps the fused [2F, D] matrix under ffn_up.
    {LayerWeight::kGateUp, "mlp.gate_up_proj.weight", "ffn_up.weight", Shard::kHalvesRows},
    {LayerWeight::kDown, "mlp.down_proj.weight", "ffn_down.weight", Shard::kCols},
};

void read_phi3(const ConfigKeys& keys, ModelConfig& c) {
  const std::string act = keys.get_string("hidden_act", "silu");
  PAGEDLM_CHECK(act == "silu", "unsupported hidden_act \"", act, "\" (only silu is supported)");
  // Partial rotary (Phi-3.5-MoE, Phi-4-mini) rotates only part of each head.
  const std::optional<ConfigKeys> rope = keys.get_object("rope_parameters");
  const double partial = rope && rope->has("partial_rotary_factor")
                             ? rope->get_float("partial_rotary_factor")
                             : keys.get_float("partial_rotary_factor", 1.0);
  PAGEDLM_CHECK(partial == 1.0, "partial_rotary_factor=", partial, " is unsupported for ",
                c.architecture);
  if (keys.has("sliding_window")) read_layer_types(keys, c, [](int64_t) { return true; });
}

void read_phi3_gguf(const GgufFile& f, const std::string& p, ModelConfig& c) {
  PAGEDLM_CHECK(f.find_tensor("rope_factors_long.weight") == nullptr, "GGUF file '", f.path(),
                "' uses Phi-3's longrope scaling, which pagedlm does not support");
  if (!f.find(p + "attention.sliding_window")) return;
  const int64_t window = f.get_int(p + "attention.sliding_window");
  if (window == 0) return;  // llama.cpp's converter writes 0 when the config has no window
  PAGEDLM_CHECK(window > 0 && window <= INT32_MAX, "GGUF file '", f.path(), "' metadata '", p,
                "attention.sliding_window' must be a positive int32, got ", window);
  if (window >= c.max_position_embeddings) return;
  for (LayerSpec& l : c.layers) l.attention.window = static_cast<int32_t>(window);
}

}  // namespace

extern const Family kPhi3Family = {
    "phi3", {"Phi3ForCausalLM"}, {"phi3"}, "phi3", kPhi3Names, read_phi3, read_phi3_gguf,
};

}  // namespace pagedlm
