// An FP8 checkpoint's projection weights (io/quant_config.h names the layouts): each kept as the
// file stores it, e4m3 values and scales. The CPU computes with them dequantized to float32 (the
// exact reference); a GPU with FP8 tensor cores takes per-tensor and per-channel ones as they
// are for W8A8 GEMMs (ops/linear_fp8.h), and the others (per-block scales, a GPU without FP8)
// dequantized to bf16.
#pragma once

#include <map>
#include <string>

#include "pagedlm/core/tensor.h"
#include "pagedlm/io/quant_config.h"

namespace pagedlm {

struct Fp8Matrix {
  Tensor weight;  // [rows, cols] F8_E4M3, a view of the mapped file
  // F32, BF16 or F16: one value (kTensor), [rows, 1] or [rows] (kChannel), or
  // [rows / block_rows, cols / block_cols] (kBlock).
  Tensor scale;
  WeightQuantSpec spec;
  ActivationQuant inputs = ActivationQuant::kNone;
  Tensor input_scale;              // kStaticTensor only: one value
  double activation_scale_ub = 0;  // fbgemm_fp8: dynamic per-token scales clamp at ub / 448

  int64_t rows() const { return weight.dim(0); }
  int64_t cols() const { return weight.dim(1); }
  // F32 [rows, cols], each element the e4m3 value times its scale, rounded once to float32 (a
  // product of a 4-bit and a 24-bit significand).
  Tensor dequantize() const;
  // "x per-block 128x128 scale (f32 [8, 8]); activations dynamic per-token", a single scale
  // and a static input_scale with their values.
  std::string describe() const;
};

// Moves every FP8 projection weight of `tensors` (a checkpoint's, by HF name), with its scale
// and input scale, into `fp8` under the weight's name, and the attention layers' k_scale /
// v_scale into `kv_scales`. Throws pagedlm::Error naming the tensor or key for an FP8 tensor the
// config does not quantize (or with no quantization_config at all), a missing scale, a scale
// whose shape does not match its weight or whose dtype is not a float, a weight the block size
// does not divide, or a scale whose weight is not FP8.
void take_fp8_weights(const QuantConfig& config, std::map<std::string, Tensor>& tensors,
                      std::map<std::string, Fp8Matrix>& fp8,
                      std::map<std::string, Tensor>& kv_scales);

}  // namespace pagedlm
