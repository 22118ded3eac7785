#include "pagedlm/model/fp8_weights.h"

#include <array>
#include <vector>

#include "pagedlm/core/error.h"

namespace pagedlm {

namespace {

constexpr std::string_view kWeightSuffix = ".weight";

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_float(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// A scale tensor as float32, its dtype checked.
Tensor scale_f32(const std::string& name, const Tensor& t) {
  PAGEDLM_CHECK(is_float(t.dtype()), "scale tensor ", name, " has dtype ", dtype_name(t.dtype()),
                "; scales must be f32, bf16 or f16");
  return t.to_f32();
}

// The scale shapes the layout allows for a [rows, cols] weight (a single value may be stored
// as a scalar or as [1]; per-channel scales as [rows, 1] or [rows]).
std::vector<Shape> allowed_scale_shapes(const WeightQuantSpec& spec, int64_t rows, int64_t cols) {
  switch (spec.layout) {
    case WeightScaleLayout::kTensor:
      return {{}, {1}};
    case WeightScaleLayout::kChannel:
      return {{rows, 1}, {rows}};
    case WeightScaleLayout::kBlock:
      return {{rows / spec.block_rows, cols / spec.block_cols}};
  }
  return {};
}

void check_single_value(const std::string& name, const Tensor& t) {
  PAGEDLM_CHECK(t.numel() == 1, "tensor ", name, " must hold one value, got shape ",
                shape_str(t.shape()));
  scale_f32(name, t);
}

Tensor take(std::map<std::string, Tensor>& tensors, const std::string& name) {
  const auto it = tensors.find(name);
  if (it == tensors.end()) return {};
  Tensor t = std::move(it->second);
  tensors.erase(it);
  return t;
}

Fp8Matrix take_matrix(const QuantConfig& config, std::map<std::string, Tensor>& tensors,
                      const std::string& name) {
  PAGEDLM_CHECK(ends_with(name, kWeightSuffix), "tensor ", name,
                " has dtype f8_e4m3; only projection weights (<module>.weight) may be FP8");
  const std::string module = name.substr(0, name.size() - kWeightSuffix.size());
  PAGEDLM_CHECK(config.quantized(), "tensor ", name,
                " has dtype f8_e4m3 but config.json has no quantization_config");
  const QuantScheme* scheme = config.scheme_for(module);
  PAGEDLM_CHECK(scheme != nullptr, "tensor ", name, " has dtype f8_e4m3 but quantization_config (",
                quant_method_name(config.method), ") leaves module ", module,
                " unquantized (ignored, or matched by no group)");
  Fp8Matrix m;
  m.weight = take(tensors, name);
  m.spec = scheme->weights;
  m.inputs = scheme->inputs;
  m.activation_scale_ub = scheme->activation_scale_ub;
  PAGEDLM_CHECK(m.weight.shape().size() == 2, "FP8 tensor ", name, " must be a matrix, got shape ",
                shape_str(m.weight.shape()));
  const std::string scale_name = cat(module, ".", m.spec.scale_suffix);
  PAGEDLM_CHECK(tensors.count(scale_name) != 0, "scale tensor ", scale_name, " of FP8 tensor ",
                name, " is missing (", quant_method_name(config.method), " with ",
                weight_quant_name(m.spec), " scales)");
  m.scale = take(tensors, scale_name);
  if (m.spec.layout == WeightScaleLayout::kBlock) {
    PAGEDLM_CHECK(m.rows() % m.spec.block_rows == 0 && m.cols() % m.spec.block_cols == 0,
                  "FP8 tensor ", name, " ", shape_str(m.weight.shape()),
                  " does not divide into quantization_config's ", m.spec.block_rows, "x",
                  m.spec.block_cols, " blocks");
  }
  const std::vector<Shape> shapes = allowed_scale_shapes(m.spec, m.rows(), m.cols());
  bool shape_ok = false;
  for (const Shape& s : shapes) shape_ok |= m.scale.shape() == s;
  PAGEDLM_CHECK(shape_ok, "scale tensor ", scale_name, " has shape ", shape_str(m.scale.shape()),
                " but FP8 tensor ", name, " ", shape_str(m.weight.shape()), " with ",
                weight_quant_name(m.spec), " scales needs ", shape_str(shapes.front()));
  scale_f32(scale_name, m.scale);
  // Static activations need their calibrated scale; dynamic ones may carry one all the same.
  const std::string input_name = module + ".input_scale";
  PAGEDLM_CHECK(m.inputs != ActivationQuant::kStaticTensor || tensors.count(input_name) != 0,
                "tensor ", input_name, " is missing: quantization_config asks for static ",
                "activation scales");
  if (tensors.count(input_name) != 0) {
    m.input_scale = take(tensors, input_name);
    check_single_value(input_name, m.input_scale);
  }
  return m;
}

}  // namespace

Tensor Fp8Matrix::dequantize() const {
  static const std::array<float, 256> kValues = [] {
    std::array<float, 256> v{};
    for (int i = 0; i < 256; ++i) v[i] = f8e4m3_to_f32(static_cast<uint8_t>(i));
    return v;
  }();
  const int64_t R = rows(), C = cols();
  const Tensor s = scale.to_f32();
  const float* sv = s.data<float>();
  // The scale of (r, c): sv[r * row_stride + c / col_block] (kTensor: both strides 0).
  int64_t row_stride = 0, col_block = C;
  int64_t row_block = R;
  if (spec.layout == WeightScaleLayout::kChannel) {
    row_stride = 1;
    row_block = 1;
  } else if (spec.layout == WeightScaleLayout::kBlock) {
    row_block = spec.block_rows;
    col_block = spec.block_cols;
    row_stride = C / col_block;
  }
  Tensor out = Tensor::empty(DType::kF32, {R, C});
  const uint8_t* w = weight.data<uint8_t>();
  float* dst = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const float* row_scales = sv + (r / row_block) * row_stride;
    for (int64_t c = 0; c < C; ++c) {
      dst[r * C + c] = kValues[w[r * C + c]] * row_scales[c / col_block];
    }
  }
  return out;
}

std::string Fp8Matrix::describe() const {
  std::string out = cat("x ", weight_quant_name(spec), " scale");
  if (scale.numel() == 1) out += cat(" ", scale.to_f32().data<float>()[0]);
  out += cat(" (", dtype_name(scale.dtype()), " ", shape_str(scale.shape()), "); activations ",
             activation_quant_name(inputs));
  if (input_scale.numel() == 1 && input_scale.defined()) {
    out += cat(", input_scale ", input_scale.to_f32().data<float>()[0]);
  }
  return out;
}

void take_fp8_weights(const QuantConfig& config, std::map<std::string, Tensor>& tensors,
                      std::map<std::string, Fp8Matrix>& fp8,
                      std::map<std::string, Tensor>& kv_scales) {
  std::vector<std::string> fp8_names;
  for (const auto& [name, t] : tensors) {
    if (t.dtype() == DType::kF8E4M3) fp8_names.push_back(name);
  }
  for (const std::string& name : fp8_names) {
    fp8.emplace(name, take_matrix(config, tensors, name));
  }
  // What is left of the quantization's tensors belongs to no FP8 weight.
  std::vector<std::string> leftover;
  for (const auto& [name, t] : tensors) {
    for (std::string_view suffix : {".weight_scale", ".weight_scale_inv", ".input_scale"}) {
      if (ends_with(name, suffix)) leftover.push_back(name);
    }
    if (ends_with(name, ".k_scale") || ends_with(name, ".v_scale")) {
      check_single_value(name, t);
      kv_scales.emplace(name, t);
    }
  }
  for (const auto& [name, t] : kv_scales) tensors.erase(name);
  for (const std::string& name : leftover) {
    const std::string module = name.substr(0, name.rfind('.'));
    const std::string weight = module + ".weight";
    const auto it = tensors.find(weight);
    if (it == tensors.end() && fp8.count(weight) == 0) {
      fail("tensor ", name, " is the scale of ", weight, ", which the checkpoint lacks");
    }
    PAGEDLM_CHECK(it == tensors.end(), "tensor ", name, " scales ", weight, ", which has dtype ",
                  dtype_name(it->second.dtype()), "; quantized weights must be f8_e4m3");
    fail("tensor ", name, " is not a scale the quantization_config (", config.describe(),
         ") gives ", weight);
  }
}

}  // namespace pagedlm
