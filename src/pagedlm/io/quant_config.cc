#include "pagedlm/io/quant_config.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "pagedlm/core/error.h"
#include "pagedlm/io/config_keys.h"

namespace pagedlm {

namespace {

// A config is no place for a pattern of more than a few module names.
constexpr size_t kMaxPatternChars = 512;
// Backtracking steps one match may take: a module name is short, so only a pattern built to
// backtrack exponentially ("(.*)*x") gets near it, and it fails instead of hanging the load.
constexpr uint32_t kMatchLimit = 100'000;

struct Pcre2Code {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};

// A compiled "re:" pattern (Python's re syntax, which PCRE2 reads), anchored at the start of the
// subject as re.match is. Throws pagedlm::Error naming `where` for a bad pattern.
std::unique_ptr<pcre2_code, Pcre2Code> compile_pattern(const std::string& pattern,
                                                       const std::string& where) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  std::unique_ptr<pcre2_code, Pcre2Code> code(
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_ANCHORED,
                    &error_code, &error_offset, nullptr));
  if (!code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    fail("config key \"quantization_config.", where,
         "\" holds a bad regular expression 're:", pattern, "' (",
         reinterpret_cast<const char*>(message), " at offset ", error_offset, ")");
  }
  return code;
}

bool pattern_matches(const std::string& pattern, const std::string& module) {
  const auto code = compile_pattern(pattern, "re:");
  std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> context(
      pcre2_match_context_create(nullptr), &pcre2_match_context_free);
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(code.get(), nullptr), &pcre2_match_data_free);
  PAGEDLM_CHECK(context && data, "out of memory matching quantization_config pattern");
  pcre2_set_match_limit(context.get(), kMatchLimit);
  const int rc = pcre2_match(code.get(), reinterpret_cast<PCRE2_SPTR>(module.data()), module.size(),
                             0, 0, data.get(), context.get());
  PAGEDLM_CHECK(rc >= 0 || rc == PCRE2_ERROR_NOMATCH, "quantization_config pattern 're:", pattern,
                "' failed on module ", module, " (PCRE2 error ", rc, ")");
  return rc >= 0;
}

// A list of module names or "re:" patterns, each checked.
// `where`: the dotted path of `keys` inside quantization_config ("" or "config_groups.g.").
std::vector<std::string> string_list(const ConfigKeys& keys, const std::string& where,
                                     const std::string& key) {
  std::vector<std::string> out = keys.get_string_list(key);
  for (const std::string& s : out) {
    PAGEDLM_CHECK(!s.empty(), "config key \"quantization_config.", where, key,
                  "\" holds an empty module name");
    PAGEDLM_CHECK(s.size() <= kMaxPatternChars, "config key \"quantization_config.", where, key,
                  "\" holds a name of ", s.size(), " characters (at most ", kMaxPatternChars, ")");
    if (s.rfind("re:", 0) == 0) compile_pattern(s.substr(3), where + key);
  }
  return out;
}

// compressed-tensors' rule for targets and ignore: "re:" from the start of the name, else the
// exact name; "Linear" is the class every projection has.
bool matches_target(const std::string& target, const std::string& module) {
  if (target == "Linear") return true;
  if (target.rfind("re:", 0) == 0) {
    return pattern_matches(target.substr(3), module);
  }
  return target == module;
}

// modules_to_not_convert / ignored_layers: whole dotted components of the name.
bool matches_component(const std::string& entry, const std::string& module) {
  return cat(".", module, ".").find(cat(".", entry, ".")) != std::string::npos;
}

WeightQuantSpec block_weights(const ConfigKeys& keys, const std::string& where,
                              const std::string& key, const std::string& scale_suffix) {
  const nlohmann::json* v = keys.find(key);
  PAGEDLM_CHECK(v != nullptr && v->is_array() && v->size() == 2 && (*v)[0].is_number_integer() &&
                    (*v)[1].is_number_integer() && (*v)[0].get<int64_t>() > 0 &&
                    (*v)[1].get<int64_t>() > 0,
                "config key \"quantization_config.", where, key,
                "\" must be two positive integers [rows, cols], got ", v ? v->dump() : "nothing");
  WeightQuantSpec w;
  w.layout = WeightScaleLayout::kBlock;
  w.block_rows = (*v)[0].get<int64_t>();
  w.block_cols = (*v)[1].get<int64_t>();
  w.scale_suffix = scale_suffix;
  return w;
}

// One of compressed-tensors' QuantizationArgs must be 8-bit float, symmetric.
void check_float8_args(const ConfigKeys& args, const std::string& where) {
  const int64_t bits = args.get_int("num_bits", 8);
  const std::string type = args.get_string("type", "int");
  PAGEDLM_CHECK(bits == 8 && type == "float", "config key \"quantization_config.", where,
                "\" asks for ", bits, "-bit ", type,
                " quantization; pagedlm reads 8-bit float (FP8 e4m3) only");
  PAGEDLM_CHECK(args.get_bool("symmetric", true), "config key \"quantization_config.", where,
                "\" asks for asymmetric FP8 (zero points); pagedlm reads symmetric FP8 only");
}

QuantScheme compressed_tensors_scheme(const ConfigKeys& group, const std::string& where) {
  QuantScheme scheme;
  const std::optional<ConfigKeys> weights = group.get_object("weights");
  PAGEDLM_CHECK(weights.has_value(), "config key \"quantization_config.", where,
                ".weights\" is missing; pagedlm reads weight-quantized groups only");
  check_float8_args(*weights, where + ".weights");
  PAGEDLM_CHECK(!weights->get_bool("dynamic", false), "config key \"quantization_config.", where,
                ".weights.dynamic\" is true; stored weights need stored scales");
  const std::string strategy = weights->get_string("strategy", "tensor");
  if (strategy == "tensor") {
    scheme.weights.layout = WeightScaleLayout::kTensor;
  } else if (strategy == "channel") {
    scheme.weights.layout = WeightScaleLayout::kChannel;
  } else if (strategy == "block") {
    scheme.weights =
        block_weights(*weights, where + ".weights.", "block_structure", "weight_scale");
  } else {
    fail("config key \"quantization_config.", where, ".weights.strategy\" is '", strategy,
         "'; pagedlm reads FP8 weights per tensor, channel or block");
  }
  if (const std::optional<ConfigKeys> inputs = group.get_object("input_activations")) {
    check_float8_args(*inputs, where + ".input_activations");
    const std::string input_strategy = inputs->get_string("strategy", "tensor");
    const bool dynamic = inputs->get_bool("dynamic", false);
    if (input_strategy == "token" && dynamic) {
      scheme.inputs = ActivationQuant::kDynamicToken;
    } else if (input_strategy == "tensor") {
      scheme.inputs = dynamic ? ActivationQuant::kDynamicTensor : ActivationQuant::kStaticTensor;
    } else {
      fail("config key \"quantization_config.", where, ".input_activations\" asks for ",
           dynamic ? "dynamic" : "static", " ", input_strategy,
           " scales; pagedlm reads dynamic per-token or per-tensor, or static per-tensor");
    }
  }
  return scheme;
}

QuantConfig parse_fp8(const ConfigKeys& q) {
  QuantConfig c;
  c.method = QuantMethod::kFp8;
  const std::string fmt = q.get_string("fmt", "e4m3");
  PAGEDLM_CHECK(fmt == "e4m3", "config key \"quantization_config.fmt\" is '", fmt,
                "'; pagedlm reads e4m3 FP8 weights only");
  QuantScheme scheme;
  if (q.has("weight_block_size")) {
    scheme.weights = block_weights(q, "", "weight_block_size", "weight_scale_inv");
  }
  const std::string activations = q.get_string("activation_scheme", "dynamic");
  if (activations == "dynamic") {
    // Per token with block weights (DeepSeek's 1 x block_cols groups are finer still), per
    // tensor with a per-tensor weight scale, as vLLM computes them.
    scheme.inputs = scheme.weights.layout == WeightScaleLayout::kBlock
                        ? ActivationQuant::kDynamicToken
                        : ActivationQuant::kDynamicTensor;
  } else if (activations == "static") {
    scheme.inputs = ActivationQuant::kStaticTensor;
  } else {
    fail("config key \"quantization_config.activation_scheme\" is '", activations,
         "'; expected dynamic or static");
  }
  c.groups.push_back({{"Linear"}, scheme});
  for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
    for (std::string& s : string_list(q, "", key)) c.ignore.push_back(std::move(s));
  }
  return c;
}

QuantConfig parse_compressed_tensors(const ConfigKeys& q) {
  QuantConfig c;
  c.method = QuantMethod::kCompressedTensors;
  const std::string format = q.get_string("format", "float-quantized");
  PAGEDLM_CHECK(format == "float-quantized" || format == "naive-quantized",
                "config key \"quantization_config.format\" is '", format,
                "'; pagedlm reads compressed-tensors' float-quantized (FP8) checkpoints only");
  const std::optional<ConfigKeys> groups = q.get_object("config_groups");
  PAGEDLM_CHECK(groups.has_value(), "config key \"quantization_config.config_groups\" is missing");
  const nlohmann::json* groups_json = q.find("config_groups");
  PAGEDLM_CHECK(!groups_json->empty(),
                "config key \"quantization_config.config_groups\" holds no group");
  for (const auto& [name, value] : groups_json->items()) {
    const std::string where = cat("config_groups.", name);
    const std::optional<ConfigKeys> group = groups->get_object(name);
    PAGEDLM_CHECK(group.has_value(), "config key \"quantization_config.", where, "\" is null");
    QuantGroup g;
    g.targets = string_list(*group, where + ".", "targets");
    PAGEDLM_CHECK(!g.targets.empty(), "config key \"quantization_config.", where,
                  ".targets\" is missing or empty");
    g.scheme = compressed_tensors_scheme(*group, where);
    c.groups.push_back(std::move(g));
  }
  c.ignore = string_list(q, "", "ignore");
  if (const std::optional<ConfigKeys> kv = q.get_object("kv_cache_scheme")) {
    check_float8_args(*kv, "kv_cache_scheme");
    c.kv_cache_scales = true;
  }
  return c;
}

QuantConfig parse_fbgemm_fp8(const ConfigKeys& q) {
  QuantConfig c;
  c.method = QuantMethod::kFbgemmFp8;
  QuantScheme scheme;
  scheme.weights.layout = WeightScaleLayout::kChannel;
  scheme.inputs = ActivationQuant::kDynamicToken;
  scheme.activation_scale_ub = q.get_float("activation_scale_ub", 1200.0);
  PAGEDLM_CHECK(scheme.activation_scale_ub > 0,
                "config key \"quantization_config.activation_scale_ub\" must be positive, got ",
                scheme.activation_scale_ub);
  c.groups.push_back({{"Linear"}, scheme});
  c.ignore = string_list(q, "", "modules_to_not_convert");
  return c;
}

}  // namespace

const QuantScheme* QuantConfig::scheme_for(const std::string& module) const {
  for (const std::string& entry : ignore) {
    const bool ignored = method == QuantMethod::kCompressedTensors
                             ? entry != "Linear" && matches_target(entry, module)
                             : matches_component(entry, module);
    if (ignored) return nullptr;
  }
  // compressed-tensors' precedence: a group naming the module, then one whose regex matches it,
  // then one for every Linear.
  auto kind_of = [](const std::string& t) { return t == "Linear" ? 2 : t.rfind("re:", 0) == 0; };
  for (int kind = 0; kind < 3; ++kind) {
    for (const QuantGroup& g : groups) {
      for (const std::string& t : g.targets) {
        if (kind_of(t) == kind && matches_target(t, module)) return &g.scheme;
      }
    }
  }
  return nullptr;
}

std::string QuantConfig::describe() const {
  if (!quantized()) return "none";
  std::string out = quant_method_name(method);
  for (size_t i = 0; i < groups.size(); ++i) {
    const QuantScheme& s = groups[i].scheme;
    out += cat(i == 0 ? ": " : "; ", "weights e4m3 ", weight_quant_name(s.weights),
               ", activations ", activation_quant_name(s.inputs));
    if (s.activation_scale_ub > 0) out += cat(" (scale ub ", s.activation_scale_ub, ")");
    if (method == QuantMethod::kCompressedTensors) {
      std::string targets;
      for (const std::string& t : groups[i].targets) targets += cat(targets.empty() ? "" : " ", t);
      out += cat(" for ", targets);
    }
  }
  std::string ignored;
  for (const std::string& entry : ignore) ignored += cat(ignored.empty() ? "" : ", ", entry);
  if (!ignored.empty()) out += cat("; not ", ignored);
  if (kv_cache_scales) out += "; kv cache scales";
  return out;
}

QuantConfig parse_quant_config(const nlohmann::json& config) {
  PAGEDLM_CHECK(config.is_object(), "config is not a JSON object");
  const ConfigKeys keys(config, "");
  const std::optional<ConfigKeys> q = keys.get_object("quantization_config");
  if (!q) return {};
  const std::string method = q->get_string("quant_method");
  if (method == "fp8") return parse_fp8(*q);
  if (method == "compressed-tensors") return parse_compressed_tensors(*q);
  if (method == "fbgemm_fp8") return parse_fbgemm_fp8(*q);
  fail("config key \"quantization_config.quant_method\" is '", method,
       "'; pagedlm reads fp8, compressed-tensors (FP8) and fbgemm_fp8 checkpoints (GGUF files for "
       "other quantizations)");
}

const char* quant_method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::kFp8:
      return "fp8";
    case QuantMethod::kCompressedTensors:
      return "compressed-tensors";
    case QuantMethod::kFbgemmFp8:
      return "fbgemm_fp8";
    case QuantMethod::kNone:
      break;
  }
  return "none";
}

std::string weight_quant_name(const WeightQuantSpec& w) {
  switch (w.layout) {
    case WeightScaleLayout::kTensor:
      return "per-tensor";
    case WeightScaleLayout::kChannel:
      return "per-channel";
    case WeightScaleLayout::kBlock:
      return cat("per-block ", w.block_rows, "x", w.block_cols);
  }
  return "?";
}

const char* activation_quant_name(ActivationQuant a) {
  switch (a) {
    case ActivationQuant::kNone:
      return "unquantized";
    case ActivationQuant::kDynamicTensor:
      return "dynamic per-tensor";
    case ActivationQuant::kDynamicToken:
      return "dynamic per-token";
    case ActivationQuant::kStaticTensor:
      return "static per-tensor";
  }
  return "?";
}

}  // namespace pagedlm
