// A checkpoint's weights loaded into the forms the kernels compute with: this rank's share of each
// (model/tensor_parallel.h), in the compute dtype on the model's device, and each projection in
// the format its weights and the options call for (ops/linear_weight.h). One method per format
// creates a projection from the checkpoint's parts, or declines where the parts do not allow it
// (vLLM's quantization methods, the load side); linear() asks them in order:
//   - CPU, every part in a GGUF's blocks: the blocks, repacked for the exact kernels or regrouped
//     for the integer ones (ModelOptions::cpu_int_activations);
//   - GPU with ModelOptions::gguf_blocks_on_gpu, every part in a block format the GPU computes
//     from: the blocks as the file holds them;
//   - GPU with FP8 weights (ModelOptions::fp8_weights): the checkpoint's own e4m3 weights with
//     per-tensor or per-channel scales, or (--quantization fp8) the dense weight quantized at
//     load;
//   - else dense in the compute dtype (GGUF blocks and FP8 weights dequantized).
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/family.h"
#include "pagedlm/model/model.h"
#include "pagedlm/model/tensor_parallel.h"
#include "pagedlm/ops/linear_weight.h"
#include "pagedlm/ops/moe.h"

namespace pagedlm {

// A weight of a projection: its HF name and full shape, and how tensor parallelism splits it.
struct WeightPart {
  std::string name;
  Shape shape;
  Shard shard;
};

class WeightLoader {
 public:
  // Throws where the options do not fit the device (integer activations or FP8 weights on a
  // device without them, a compute dtype the device's kernels do not take).
  WeightLoader(const Checkpoint& ckpt, Device device, TensorParallel tp,
               const ModelOptions& options);

  Device device() const { return device_; }
  // f32 on the CPU, bf16 on the GPU (ModelOptions::compute_dtype).
  DType compute_dtype() const { return dtype_; }

  // This rank's share of the parts (shapes checked) stacked by rows into one projection, in the
  // first format whose method takes them (above). may_fp8: false for the projections that stay
  // in the compute dtype whatever the options (the lm_head, a router: both write f32).
  ops::LinearWeight linear(const std::vector<WeightPart>& parts, bool may_fp8 = true);
  // The lm_head: linear() without FP8, except that on the CPU its blocks take 32-bit fixed-point
  // activations where no other integer activations were asked for (cpu_blocks).
  ops::LinearWeight lm_head(const std::vector<WeightPart>& parts);
  // The CPU's block form of the parts, undefined unless every part has blocks (a tied lm_head,
  // whose embedding then reads its rows from the same blocks). In the exact mode, the lm_head's
  // blocks and Q2_K's, where the integer kernels take their format with VNNI
  // (ops::fixed32_on_vnni), are packed for 32-bit fixed-point activations, which are as exact as
  // the exact kernels (to float32 rounding) and faster one row at a time. They take them at every
  // step, so their arithmetic does not depend on the step (batch invariance); a prefill, whose
  // rows the fixed-point panels take more slowly, sends the lm_head only the rows that need
  // logits, and Q2_K's float32 kernels decode below llama.cpp's speed (weights.cc).
  ops::LinearWeight cpu_blocks(const std::vector<WeightPart>& parts, bool lm_head = false);
  // The part's blocks repacked for the CPU's exact kernels, empty unless it has blocks of one
  // format (an embedding kept in blocks).
  QuantizedMatrix cpu_embedding_blocks(const WeightPart& part);
  // This rank's share of the parts stacked by rows, in the compute dtype on the device.
  Tensor dense(const std::vector<WeightPart>& parts);
  // A tensor of the checkpoint (shape checked), whole, in the compute dtype on the device.
  Tensor replicated(const std::string& name, const Shape& shape);
  // A host tensor in the compute dtype on the device.
  Tensor upload(const Tensor& t) const;
  // A sparse layer's experts, this rank's share of each expert's intermediate size: per-expert
  // blocks on the CPU where every expert's matrices have them, else stacked in the compute dtype.
  ops::ExpertWeights experts(int64_t layer);

  // Throws where integer activations were asked for and no projection took them (a model without
  // GGUF blocks); called once every projection is loaded.
  void check_options_used() const;
  // Whether some projection is FP8 (the model then sizes the FP8 scratch), and the weights of
  // the largest GPU block projection (the bf16 scratch its prefill steps expand it into).
  bool has_fp8() const { return has_fp8_; }
  int64_t widest_gpu_blocks() const { return widest_gpu_blocks_; }
  // Whether some GPU block projection has a part whose kernels take x staged (ops::stage_rows):
  // the model then sizes the staging scratch.
  bool gpu_blocks_stage_rows() const { return gpu_blocks_stage_rows_; }

 private:
  // The format methods: each a projection in its format, or undefined where the parts do not
  // allow it (fp8: or dense, where it had to upload the weight to find that its shape does not
  // fit the FP8 GEMM).
  ops::LinearWeight gpu_blocks(const std::vector<WeightPart>& parts);
  ops::LinearWeight fp8(const std::vector<WeightPart>& parts);

  const Checkpoint& ckpt_;
  Device device_;
  TensorParallel tp_;
  ModelOptions options_;
  DType dtype_;
  bool fp8_ = false;  // the model runs W8A8 GEMMs (runs_fp8)
  int64_t num_int_projections_ = 0;
  bool has_fp8_ = false;
  int64_t widest_gpu_blocks_ = 0;
  bool gpu_blocks_stage_rows_ = false;
  std::set<std::string> expanded_formats_;  // GGUF formats said on stderr to go to bf16
};

}  // namespace pagedlm
