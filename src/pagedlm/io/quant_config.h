// config.json's quantization_config, typed: which FP8 layout a checkpoint's projection weights
// are stored in, where their scales are, how activations were meant to be quantized, and which
// modules stay unquantized. Three writers' conventions are read:
//   - "fp8" (transformers' FineGrainedFP8Config, AutoFP8, vLLM's Fp8Config): per-tensor
//     `weight_scale` (+ `input_scale` when activation_scheme is static), or with
//     weight_block_size [r, c] a `weight_scale_inv` per r x c block (DeepSeek-V3, Qwen3-FP8);
//   - "compressed-tensors" with float 8-bit weights (llm-compressor): config_groups, each with
//     targets, a weight strategy (tensor, channel or block) and input activations (per token or
//     per tensor, dynamic or static with `input_scale`), an `ignore` list, kv_cache_scheme;
//   - "fbgemm_fp8": per-channel `weight_scale`, activations dynamic per token, clamped at
//     activation_scale_ub.
// Every scale multiplies: weight = e4m3 value x scale (the "_inv" of weight_scale_inv is the
// reciprocal of the quantizer's scale, i.e. the dequantizing factor).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace pagedlm {

enum class QuantMethod : uint8_t { kNone, kFp8, kCompressedTensors, kFbgemmFp8 };

// How a weight's scales cover it: one for the matrix, one per output row, one per block.
enum class WeightScaleLayout : uint8_t { kTensor, kChannel, kBlock };

// How the checkpoint's writer meant activations to be quantized for an FP8 GEMM.
enum class ActivationQuant : uint8_t {
  kNone,           // weights only (compressed-tensors without input_activations)
  kDynamicTensor,  // one scale per step, computed from the activations
  kDynamicToken,   // one scale per token (row), computed from the activations
  kStaticTensor,   // one calibrated scale per matrix, stored as `input_scale`
};

struct WeightQuantSpec {
  WeightScaleLayout layout = WeightScaleLayout::kTensor;
  int64_t block_rows = 0, block_cols = 0;     // kBlock only
  std::string scale_suffix = "weight_scale";  // the scale tensor: <module>.<scale_suffix>
};

struct QuantScheme {
  WeightQuantSpec weights;
  ActivationQuant inputs = ActivationQuant::kNone;
  double activation_scale_ub = 0;  // fbgemm_fp8: per-token scales clamp at ub / 448; 0: none
};

struct QuantGroup {
  // compressed-tensors' targets: "Linear" (every projection), "re:<regex>" (matched from the
  // start of the module name, as Python's re.match), or an exact module name. Other methods: one
  // group targeting "Linear".
  std::vector<std::string> targets;
  QuantScheme scheme;
};

struct QuantConfig {
  QuantMethod method = QuantMethod::kNone;
  // A module takes the group naming it, else the first whose regex matches it, else the first
  // targeting "Linear".
  std::vector<QuantGroup> groups;
  // Modules kept unquantized. compressed-tensors: as targets. The others (modules_to_not_convert,
  // ignored_layers): a dotted name matching whole components of the module's name
  // ("lm_head", "mlp.gate", "model.layers.0").
  std::vector<std::string> ignore;
  // compressed-tensors' kv_cache_scheme (or k_scale / v_scale tensors in an fp8 checkpoint):
  // the attention layers carry self_attn.k_scale and v_scale for an FP8 KV cache.
  bool kv_cache_scales = false;

  bool quantized() const { return method != QuantMethod::kNone; }
  // The scheme of the projection `module` (an HF module name, e.g. "model.layers.0.mlp.up_proj"),
  // or null when the config leaves it unquantized.
  const QuantScheme* scheme_for(const std::string& module) const;
  // One line: the method and each group's weight and activation layout.
  std::string describe() const;
};

// The typed quantization_config of a whole config.json (method kNone without one). Throws
// pagedlm::Error naming the key for an unknown quant_method, a format other than FP8 (e4m3)
// weights, a bad block size or a malformed list.
QuantConfig parse_quant_config(const nlohmann::json& config);

const char* quant_method_name(QuantMethod m);
std::string weight_quant_name(const WeightQuantSpec& w);  // "per-block 128x128", "per-channel"
const char* activation_quant_name(ActivationQuant a);

}  // namespace pagedlm
