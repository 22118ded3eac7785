// A model family describes itself here: the config keys it reads (both transformers 5's and the
// Hub's older style), the names its checkpoints give each weight (HF and GGUF), and so its
// tensors' shapes, its block structure and each layer's attention. One registry maps
// config.json's `architectures` / `model_type` and GGUF's `general.architecture` to a family.
// Adding a family means one file in model/families/ and one line in the registry (family.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/core/tensor.h"
#include "pagedlm/model/model_config.h"

namespace pagedlm {

class ConfigKeys;
class GgufFile;

// A decoder layer's weights, by what they do.
enum class LayerWeight : uint8_t {
  kAttnNorm,  // before attention
  kQ,         // q/k/v projections, or all three in one (Phi-3)
  kK,
  kV,
  kQkv,
  kQBias,  // q/k/v biases (Qwen2)
  kKBias,
  kVBias,
  kQNorm,  // per-head norms of q and k (Qwen3, Gemma 3)
  kKNorm,
  kO,            // attention output projection
  kAttnOutNorm,  // after attention (sandwich norms)
  kFfnNorm,      // before the MLP
  kGate,         // gate and up projections, or both in one (Phi-3)
  kUp,
  kGateUp,
  kDown,
  kFfnOutNorm,  // after the MLP (sandwich norms)
  // Mixture-of-experts layers (LayerSpec::sparse_mlp): the router's [num_experts, hidden]
  // matrix and each expert's gate, up and down projections. HF names hold a '*' where the
  // expert's index goes; GGUF files stack all experts in one 3-D tensor.
  kRouter,
  kExpertGate,
  kExpertUp,
  kExpertDown,
};

// How tensor parallelism splits a weight between ranks (model/tensor_parallel.h computes the
// ranges). Each weight declares its rule in its family's table, so the loader holds no list of
// names and a new kind of weight brings its own rule.
enum class Shard : uint8_t {
  kReplicated,   // every rank holds all of it (norms)
  kRows,         // output rows split evenly: q (by q heads, which the ranks divide), gate, up
  kKvHeadRows,   // output rows by kv head; a kv head is replicated when ranks outnumber them
  kQkvHeadRows,  // fused q|k|v rows: the q part as kRows, the k and v parts as kKvHeadRows
  kHalvesRows,   // fused gate|up rows: each half split evenly
  kCols,         // input columns split evenly (o, down); the partial outputs are all-reduced
  kNotSplit,     // no rule yet (the experts of MoE layers): more than one rank is refused
};

// How a family's files name one layer weight (HF's name after "model.layers.N.", GGUF's after
// "blk.N.") and how tensor parallelism splits it.
struct LayerWeightName {
  LayerWeight weight;
  const char* hf;
  const char* gguf;
  Shard shard;
};

struct Family {
  const char* name;                           // ModelConfig::model_type
  std::vector<const char*> hf_architectures;  // config.json "architectures"[0]
  std::vector<const char*> hf_model_types;    // config.json "model_type", when no architectures
  const char* gguf_architecture;              // "general.architecture", or null
  // The names of every layer weight the family's checkpoints may hold. A family that lists kQkv
  // (kGateUp) stores q/k/v (gate/up) fused; which optional weights a given config has is up to
  // its flags (attention_bias, qk_norm, sandwich_norms).
  std::vector<LayerWeightName> layer_weights;
  // Its own config.json keys: block structure, per-layer attention and validation. Runs after
  // the keys every family shares (dimensions, rope, tokens), which `c` already holds, and with
  // c.layers already holding the default layer (scale head_dim^-0.5, no window, c.rope).
  void (*read_hf_config)(const ConfigKeys& keys, ModelConfig& c);
  // The same from GGUF metadata; `prefix` is "<general.architecture>.".
  void (*read_gguf_config)(const GgufFile& file, const std::string& prefix, ModelConfig& c);
  // llama.cpp's converter interleaves the rope halves of this family's Q/K rows in GGUF files.
  bool gguf_interleaves_qk = false;
  // A mixture-of-experts family: its GGUF files may share general.architecture with a dense
  // family (Mixtral's say "llama") and are told apart by {arch}.expert_count.
  bool mixture_of_experts = false;
};

// The family of a config.json's architectures (or model_type when it has none), or of a GGUF
// file's general.architecture; throws naming the unsupported name and the supported ones.
const Family& family_for_hf_architecture(const std::string& architecture);
const Family& family_for_hf_model_type(const std::string& model_type);
const Family& family_for_gguf_architecture(const std::string& architecture, bool has_experts);
// The family whose ModelConfig::model_type this is; throws if none.
const Family& family_of(const ModelConfig& config);

// HF's name of layer `layer`'s weight `w` ("model.layers.3.self_attn.q_proj.weight"); throws if
// the family has no such weight. For an expert weight, `expert` fills the name's '*'.
std::string hf_weight_name(const Family& family, int64_t layer, LayerWeight w, int64_t expert = -1);
// Whether the family stores this weight (kQkv: q/k/v fused).
bool has_layer_weight(const Family& family, LayerWeight w);
// How tensor parallelism splits the family's weight `w`; throws if the family has no such weight.
Shard layer_weight_shard(const Family& family, LayerWeight w);

// Every tensor the model reads, under its HF name with its HF shape, in load order:
// embeddings, each layer's attention then MLP, the final norm, and lm_head unless tied.
// The one list the loader's checks, the dummy weights and the model's lookups come from.
std::vector<std::pair<std::string, Shape>> expected_tensor_shapes(const ModelConfig& config);

// Helpers the families share.
// Applies HF's per-layer `layer_types` ("sliding_attention" / "full_attention") with
// `sliding_window`; `sliding_default(i)` says which layers slide when the config has no list.
// A sliding layer's rope is `sliding_rope` when given.
void read_layer_types(const ConfigKeys& keys, ModelConfig& c,
                      const std::function<bool(int64_t)>& sliding_default,
                      const RopeSpec* sliding_rope = nullptr);
// The rope of config.json: transformers 5's rope_parameters {rope_theta, rope_type, ...} or the
// Hub's top-level rope_theta with rope_scaling {rope_type or type, ...} or null. `params` is the
// object holding rope_type and its parameters (or nothing: default rope).
RopeSpec read_rope(const ConfigKeys* params, double theta);

}  // namespace pagedlm
