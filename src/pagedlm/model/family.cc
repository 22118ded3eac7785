#include "pagedlm/model/family.h"

#include <algorithm>
#include <cmath>
#include <string_view>

#include "pagedlm/core/error.h"
#include "pagedlm/io/config_keys.h"
#include "pagedlm/model/rope.h"

namespace pagedlm {

// The families, each defined in model/families/<name>.cc.
extern const Family kLlamaFamily, kMistralFamily, kQwen2Family, kQwen3Family, kPhi3Family,
    kGemma2Family, kGemma3Family, kQwen3MoeFamily, kMixtralFamily;

namespace {

// The registry: the one list of what pagedlm runs.
const Family* const kFamilies[] = {&kLlamaFamily,  &kMistralFamily,  &kQwen2Family,
                                   &kQwen3Family,  &kPhi3Family,     &kGemma2Family,
                                   &kGemma3Family, &kQwen3MoeFamily, &kMixtralFamily};

template <typename Names>
std::string list_of(Names names_of) {
  std::string out;
  for (const Family* f : kFamilies) {
    for (const char* n : names_of(*f)) {
      if (n != nullptr) out += cat(out.empty() ? "" : ", ", n);
    }
  }
  return out;
}

template <typename Names>
const Family* find_family(const std::string& name, Names names_of) {
  for (const Family* f : kFamilies) {
    for (const char* n : names_of(*f)) {
      if (n != nullptr && name == n) return f;
    }
  }
  return nullptr;
}

const auto kArchitecturesOf = [](const Family& f) { return f.hf_architectures; };
const auto kModelTypesOf = [](const Family& f) { return f.hf_model_types; };
const auto kGgufOf = [](const Family& f) { return std::vector<const char*>{f.gguf_architecture}; };

const LayerWeightName* find_weight(const Family& family, LayerWeight w) {
  for (const LayerWeightName& n : family.layer_weights) {
    if (n.weight == w) return &n;
  }
  return nullptr;
}

}  // namespace

const Family& family_for_hf_architecture(const std::string& architecture) {
  const Family* f = find_family(architecture, kArchitecturesOf);
  PAGEDLM_CHECK(f != nullptr, "unsupported architecture ", architecture,
                " (supported: ", list_of(kArchitecturesOf), ")");
  return *f;
}

const Family& family_for_hf_model_type(const std::string& model_type) {
  const Family* f = find_family(model_type, kModelTypesOf);
  PAGEDLM_CHECK(f != nullptr, "unsupported model_type \"", model_type,
                "\" (supported architectures: ", list_of(kArchitecturesOf), ")");
  return *f;
}

const Family& family_for_gguf_architecture(const std::string& architecture, bool has_experts) {
  const Family* named = nullptr;
  for (const Family* f : kFamilies) {
    if (f->gguf_architecture == nullptr || architecture != f->gguf_architecture) continue;
    if (f->mixture_of_experts == has_experts) return *f;
    named = f;
  }
  PAGEDLM_CHECK(named == nullptr, "GGUF architecture '", architecture, "' ",
                has_experts ? "with experts (expert_count > 0) is not supported"
                            : "needs experts (expert_count > 0)");
  fail("GGUF architecture '", architecture, "' is not supported (supported: ", list_of(kGgufOf),
       ")");
}

const Family& family_of(const ModelConfig& config) {
  for (const Family* f : kFamilies) {
    if (config.model_type == f->name) return *f;
  }
  fail("no model family is named \"", config.model_type, "\"");
}

bool has_layer_weight(const Family& family, LayerWeight w) {
  return find_weight(family, w) != nullptr;
}

Shard layer_weight_shard(const Family& family, LayerWeight w) {
  const LayerWeightName* n = find_weight(family, w);
  PAGEDLM_CHECK(n != nullptr, "model family ", family.name, " has no layer weight ",
                static_cast<int>(w));
  return n->shard;
}

std::string hf_weight_name(const Family& family, int64_t layer, LayerWeight w, int64_t expert) {
  const LayerWeightName* n = find_weight(family, w);
  PAGEDLM_CHECK(n != nullptr, "model family ", family.name, " has no layer weight ",
                static_cast<int>(w));
  std::string name = cat("model.layers.", layer, ".", n->hf);
  const size_t star = name.find('*');
  PAGEDLM_CHECK((star != std::string::npos) == (expert >= 0), "layer weight ", name,
                expert >= 0 ? " is not an expert's" : " needs an expert index");
  if (star != std::string::npos) name.replace(star, 1, std::to_string(expert));
  return name;
}

std::vector<std::pair<std::string, Shape>> expected_tensor_shapes(const ModelConfig& c) {
  const Family& family = family_of(c);
  const int64_t D = c.hidden_size, F = c.intermediate_size, d = c.head_dim;
  const int64_t q_rows = c.num_heads * d, kv_rows = c.num_kv_heads * d;
  std::vector<std::pair<std::string, Shape>> shapes;
  shapes.emplace_back("model.embed_tokens.weight", Shape{c.vocab_size, D});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const auto add = [&](LayerWeight w, Shape shape) {
      shapes.emplace_back(hf_weight_name(family, i, w), std::move(shape));
    };
    add(LayerWeight::kAttnNorm, {D});
    if (has_layer_weight(family, LayerWeight::kQkv)) {
      add(LayerWeight::kQkv, {q_rows + 2 * kv_rows, D});
    } else {
      add(LayerWeight::kQ, {q_rows, D});
      add(LayerWeight::kK, {kv_rows, D});
      add(LayerWeight::kV, {kv_rows, D});
    }
    if (c.attention_bias) {
      add(LayerWeight::kQBias, {q_rows});
      add(LayerWeight::kKBias, {kv_rows});
      add(LayerWeight::kVBias, {kv_rows});
    }
    if (c.qk_norm) {
      add(LayerWeight::kQNorm, {d});
      add(LayerWeight::kKNorm, {d});
    }
    add(LayerWeight::kO, {D, q_rows});
    if (c.sandwich_norms) add(LayerWeight::kAttnOutNorm, {D});
    add(LayerWeight::kFfnNorm, {D});
    if (c.layers[i].sparse_mlp) {
      const int64_t E = c.moe.num_experts, Fe = c.moe.expert_intermediate_size;
      add(LayerWeight::kRouter, {E, D});
      for (int64_t e = 0; e < E; ++e) {
        shapes.emplace_back(hf_weight_name(family, i, LayerWeight::kExpertGate, e), Shape{Fe, D});
        shapes.emplace_back(hf_weight_name(family, i, LayerWeight::kExpertUp, e), Shape{Fe, D});
        shapes.emplace_back(hf_weight_name(family, i, LayerWeight::kExpertDown, e), Shape{D, Fe});
      }
    } else if (has_layer_weight(family, LayerWeight::kGateUp)) {
      add(LayerWeight::kGateUp, {2 * F, D});
    } else {
      add(LayerWeight::kGate, {F, D});
      add(LayerWeight::kUp, {F, D});
    }
    if (!c.layers[i].sparse_mlp) add(LayerWeight::kDown, {D, F});
    if (c.sandwich_norms) add(LayerWeight::kFfnOutNorm, {D});
  }
  shapes.emplace_back("model.norm.weight", Shape{D});
  if (!c.tie_word_embeddings) shapes.emplace_back("lm_head.weight", Shape{c.vocab_size, D});
  return shapes;
}

RopeSpec read_rope(const ConfigKeys* params, double theta) {
  RopeSpec r;
  r.theta = static_cast<float>(params != nullptr ? params->get_float("rope_theta", theta) : theta);
  PAGEDLM_CHECK(r.theta > 0, "config key \"rope_theta\" must be positive, got ", r.theta);
  if (params == nullptr) return r;
  const std::string type = params->has("rope_type") ? params->get_string("rope_type")
                                                    : params->get_string("type", "default");
  if (type == "default") return r;
  if (type == "linear") {
    r.type = RopeType::kLinear;
  } else if (type == "llama3") {
    r.type = RopeType::kLlama3;
    r.low_freq_factor = static_cast<float>(params->get_float("low_freq_factor"));
    r.high_freq_factor = static_cast<float>(params->get_float("high_freq_factor"));
    r.original_max_position = params->get_positive_int("original_max_position_embeddings");
    PAGEDLM_CHECK(r.high_freq_factor > r.low_freq_factor,
                  "llama3 rope scaling needs high_freq_factor > low_freq_factor, got ",
                  r.high_freq_factor, " and ", r.low_freq_factor);
  } else if (type == "yarn") {
    r.type = RopeType::kYarn;
    r.original_max_position = params->get_positive_int("original_max_position_embeddings");
    r.beta_fast = static_cast<float>(params->get_float("beta_fast", 32.0));
    r.beta_slow = static_cast<float>(params->get_float("beta_slow", 1.0));
    r.truncate = params->get_bool("truncate", true);
    // mscale / mscale_all_dim (DeepSeek's variant) change the attention factor: refuse rather
    // than compute another model's numbers.
    PAGEDLM_CHECK(!params->has("mscale") && !params->has("mscale_all_dim"),
                  "yarn rope scaling with mscale / mscale_all_dim is unsupported");
  } else {
    fail("unsupported rope_type \"", type, "\" (supported: default, linear, llama3, yarn)");
  }
  r.factor = static_cast<float>(params->get_float("factor"));
  PAGEDLM_CHECK(r.factor > 0, "rope scaling factor must be positive, got ", r.factor);
  if (r.type == RopeType::kYarn) {
    r.attention_factor =
        static_cast<float>(params->get_float("attention_factor", yarn_attention_factor(r.factor)));
    PAGEDLM_CHECK(r.attention_factor > 0, "yarn attention_factor must be positive, got ",
                  r.attention_factor);
  }
  return r;
}

void read_layer_types(const ConfigKeys& keys, ModelConfig& c,
                      const std::function<bool(int64_t)>& sliding_default,
                      const RopeSpec* sliding_rope) {
  std::vector<std::string> types = keys.get_string_list("layer_types");
  if (types.empty()) {
    for (int64_t i = 0; i < c.num_layers; ++i) {
      types.push_back(sliding_default(i) ? "sliding_attention" : "full_attention");
    }
  }
  PAGEDLM_CHECK(static_cast<int64_t>(types.size()) == c.num_layers,
                "config key \"layer_types\" has ", types.size(), " entries for ", c.num_layers,
                " layers");
  const bool any_sliding =
      std::find(types.begin(), types.end(), "sliding_attention") != types.end();
  const int64_t window = any_sliding ? keys.get_positive_int("sliding_window") : 0;
  PAGEDLM_CHECK(window <= INT32_MAX, "config key \"sliding_window\" is too large: ", window);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    if (types[i] == "full_attention") continue;
    PAGEDLM_CHECK(
        types[i] == "sliding_attention", "unsupported layer type \"", types[i],
        "\" in config key \"layer_types\" (supported: full_attention, sliding_attention)");
    // A window as long as the model's context is no window at all.
    if (window < c.max_position_embeddings) {
      c.layers[i].attention.window = static_cast<int32_t>(window);
    }
    if (sliding_rope != nullptr) c.layers[i].rope = *sliding_rope;
  }
}

}  // namespace pagedlm
