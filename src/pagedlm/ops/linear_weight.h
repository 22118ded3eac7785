// A projection's weight in whichever form its kernel multiplies by: one type for every format, so
// that a model holds its projections alike and asks each one to apply itself (vLLM's quantization
// methods, the apply side; model/weights.h chooses the format and creates the weight). The
// formats:
//   kDense:     the compute dtype's matrix (f32 on the CPU, bf16 on the GPU), ops::linear;
//   kCpuBlocks: a GGUF's blocks on the CPU, repacked for the exact kernels (ops::linear), or
//               regrouped for the integer kernels (ops::linear_q8) with 8-bit or 32-bit
//               fixed-point inputs; one part per run of output features in one block format;
//   kFp8:       e4m3 with one scale per output feature, W8A8 GEMMs on GPUs with FP8 tensor cores
//               (ops/linear_fp8.h), inputs quantized per token or with a checkpoint's static scale;
//   kGpuBlocks: a GGUF's blocks on the GPU as the file holds them (ops/linear_blocks.h), one part
//               per run of output features in one block format.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/device_state.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/linear_blocks.h"
#include "pagedlm/ops/linear_fp8.h"

namespace pagedlm::ops {

enum class WeightFormat : uint8_t { kDense, kCpuBlocks, kFp8, kGpuBlocks };

// Output features [first, first + rows()) of a CPU block projection, in one block format: their
// blocks as the exact kernels read them, or (q8 not empty) regrouped for the integer kernels,
// which take the input as `q8_input` says.
struct CpuBlockPart {
  QuantizedMatrix blocks;
  Q8PackedMatrix q8;
  IntActivations q8_input = IntActivations::kInt8;

  int64_t rows() const { return q8.empty() ? blocks.rows : q8.rows; }
  int64_t cols() const { return q8.empty() ? blocks.cols : q8.cols; }
  int64_t bytes() const;
  // The format's name, and the integer kernels' input where they compute it.
  std::string format() const;
};

// What apply() may overwrite besides its output, preallocated by the model for its largest step
// (a step captured in a CUDA graph allocates nothing): an FP8 projection's quantized input; the
// bf16 expansion of a GPU block projection for a step of more rows than kBlockMatvecMaxRows
// ([>= rows * cols] of the largest such projection); a GPU block projection's input rounded to 8
// bits for its integer kernels (ops::takes_staged_rows; ops::stage_rows: [>=
// staged_rows_words(rows, cols)] I32 of the widest input; undefined: the f32 kernels).
struct LinearScratch {
  Fp8Scratch fp8;
  Tensor dequantized;
  Tensor staged_rows;
};

class LinearWeight {
 public:
  LinearWeight() = default;  // none: a projection the model does not have (a dense layer's router)
  // weight [out_features, in_features] in the compute dtype.
  static LinearWeight dense(Tensor weight);
  static LinearWeight cpu_blocks(std::vector<CpuBlockPart> parts);
  static LinearWeight fp8(Fp8Weight weight);
  static LinearWeight gpu_blocks(std::vector<DeviceBlocks> parts);

  WeightFormat format() const { return format_; }
  bool defined() const { return out_features() > 0; }
  int64_t out_features() const;
  int64_t in_features() const;
  const Tensor& dense_weight() const { return dense_; }                // kDense
  const std::vector<CpuBlockPart>& cpu_parts() const { return cpu_; }  // kCpuBlocks
  const std::vector<DeviceBlocks>& gpu_parts() const { return gpu_; }  // kGpuBlocks

  // out [rows, out_features] = x [rows, in_features] W^T (+ bias [out_features]), on the
  // weight's device, by its format's kernel. `state`: the caller's GPU state (GPU formats).
  // `fp8`: an FP8 projection's input already quantized into scratch.fp8, or its output left
  // unscaled (ops/linear_fp8.h); for the other formats x_quantized must be false, and *unscaled
  // comes back off.
  void apply(const Tensor& x, const Tensor& bias, const Tensor& out, void* stream,
             DeviceState* state, const LinearScratch& scratch, const Fp8Apply& fp8 = {}) const;
  // How an FP8 projection quantizes its input, for a kernel that writes x's codes for it
  // (Fp8RowsOut); null for the other formats.
  const Fp8InputScaling* fp8_inputs() const {
    return format_ == WeightFormat::kFp8 ? &fp8_.inputs : nullptr;
  }

  // The bytes apply() reads, and the same by format name, added to `by_format`.
  int64_t bytes() const;
  void add_bytes(std::map<std::string, int64_t>& by_format) const;

 private:
  void apply_gpu_blocks(const Tensor& x, const Tensor& bias, const Tensor& out, void* stream,
                        DeviceState* state, const LinearScratch& scratch) const;

  WeightFormat format_ = WeightFormat::kDense;
  Tensor dense_;
  std::vector<CpuBlockPart> cpu_;
  Fp8Weight fp8_;
  std::vector<DeviceBlocks> gpu_;
};

}  // namespace pagedlm::ops
