#include "pagedlm/ops/linear_weight.h"

#include <algorithm>
#include <utility>

#include "pagedlm/core/error.h"

namespace pagedlm::ops {

int64_t CpuBlockPart::bytes() const {
  return static_cast<int64_t>(q8.empty() ? blocks.blocks.size() : q8.data.size());
}

std::string CpuBlockPart::format() const {
  if (q8.empty()) return quant_format(blocks.type).name;
  return std::string(quant_format(q8.type).name) + (q8_input == IntActivations::kFixed32
                                                        ? " (32-bit fixed-point activations)"
                                                        : " (8-bit activations)");
}

LinearWeight LinearWeight::dense(Tensor weight) {
  LinearWeight w;
  w.format_ = WeightFormat::kDense;
  w.dense_ = std::move(weight);
  return w;
}

LinearWeight LinearWeight::cpu_blocks(std::vector<CpuBlockPart> parts) {
  PAGEDLM_CHECK(!parts.empty(), "a CPU block projection needs at least one part");
  for (const CpuBlockPart& part : parts) {
    PAGEDLM_CHECK(part.cols() == parts.front().cols(), "a CPU block projection's parts have ",
                  parts.front().cols(), " and ", part.cols(), " input features");
  }
  LinearWeight w;
  w.format_ = WeightFormat::kCpuBlocks;
  w.cpu_ = std::move(parts);
  return w;
}

LinearWeight LinearWeight::fp8(Fp8Weight weight) {
  PAGEDLM_CHECK(weight.defined(), "an FP8 projection needs its weight");
  LinearWeight w;
  w.format_ = WeightFormat::kFp8;
  w.fp8_ = std::move(weight);
  return w;
}

LinearWeight LinearWeight::gpu_blocks(std::vector<DeviceBlocks> parts) {
  PAGEDLM_CHECK(!parts.empty(), "a GPU block projection needs at least one part");
  for (const DeviceBlocks& part : parts) {
    PAGEDLM_CHECK(part.cols == parts.front().cols, "a GPU block projection's parts have ",
                  parts.front().cols, " and ", part.cols, " input features");
  }
  LinearWeight w;
  w.format_ = WeightFormat::kGpuBlocks;
  w.gpu_ = std::move(parts);
  return w;
}

int64_t LinearWeight::out_features() const {
  int64_t rows = 0;
  switch (format_) {
    case WeightFormat::kDense:
      return dense_.defined() ? dense_.dim(0) : 0;
    case WeightFormat::kFp8:
      return fp8_.rows();
    case WeightFormat::kCpuBlocks:
      for (const CpuBlockPart& part : cpu_) rows += part.rows();
      return rows;
    case WeightFormat::kGpuBlocks:
      for (const DeviceBlocks& part : gpu_) rows += part.rows;
      return rows;
  }
  return 0;
}

int64_t LinearWeight::in_features() const {
  switch (format_) {
    case WeightFormat::kDense:
      return dense_.defined() ? dense_.dim(1) : 0;
    case WeightFormat::kFp8:
      return fp8_.cols();
    case WeightFormat::kCpuBlocks:
      return cpu_.empty() ? 0 : cpu_.front().cols();
    case WeightFormat::kGpuBlocks:
      return gpu_.empty() ? 0 : gpu_.front().cols;
  }
  return 0;
}

void LinearWeight::apply(const Tensor& x, const Tensor& bias, const Tensor& out, void* stream,
                         DeviceState* state, const LinearScratch& scratch,
                         const Fp8Apply& fp8) const {
  if (format_ != WeightFormat::kFp8) {
    PAGEDLM_CHECK(!fp8.x_quantized, "linear: x quantized to e4m3 for a projection that is not FP8");
    if (fp8.unscaled != nullptr) *fp8.unscaled = {};
  }
  switch (format_) {
    case WeightFormat::kDense:
      linear(x, dense_, bias, out, stream, state);
      return;
    case WeightFormat::kFp8:
      linear_fp8(x, fp8_, bias, out, scratch.fp8, stream, state, fp8);
      return;
    case WeightFormat::kGpuBlocks:
      apply_gpu_blocks(x, bias, out, stream, state, scratch);
      return;
    case WeightFormat::kCpuBlocks:
      break;
  }
  int64_t col0 = 0;
  for (const CpuBlockPart& part : cpu_) {
    if (!part.q8.empty()) {
      linear_q8(x, part.q8, bias, out, col0, part.q8_input);
    } else {
      linear(x, part.blocks, bias, out, col0);
    }
    col0 += part.rows();
  }
  PAGEDLM_CHECK(col0 == out.dim(1), "a projection's parts have ", col0, " outputs, out has ",
                out.dim(1));
}

// Decode: each part's blocks through the matrix-vector kernels into its columns of out, up to
// kBlockMatvecMaxRows rows, or kStagedRowsMaxRows where every part takes x staged. Larger steps:
// all parts expanded to bf16 into the scratch, one GEMM (the expansion writes 2 bytes and the GEMM
// reads them back per weight, on top of the blocks: a cost per prefill call, not per token).
void LinearWeight::apply_gpu_blocks(const Tensor& x, const Tensor& bias, const Tensor& out,
                                    void* stream, DeviceState* state,
                                    const LinearScratch& scratch) const {
  const int64_t n = x.dim(0);
  auto takes_staged = [n](const DeviceBlocks& part) { return takes_staged_rows(part.type, n); };
  const bool can_stage = scratch.staged_rows.defined();
  if (n <= kBlockMatvecMaxRows ||
      (can_stage && std::all_of(gpu_.begin(), gpu_.end(), takes_staged))) {
    // x staged once for every part whose kernel takes it so.
    Tensor staged;
    if (can_stage && std::any_of(gpu_.begin(), gpu_.end(), takes_staged)) {
      staged = scratch.staged_rows;
      stage_rows(x, staged, stream);
    }
    int64_t col0 = 0;
    for (const DeviceBlocks& part : gpu_) {
      linear_blocks(x, part, bias, out, col0, stream, staged);
      col0 += part.rows;
    }
    PAGEDLM_CHECK(col0 == out.dim(1), "a projection's parts have ", col0, " outputs, out has ",
                  out.dim(1));
    return;
  }
  const int64_t rows = out_features(), cols = in_features();
  PAGEDLM_CHECK(scratch.dequantized.defined() && scratch.dequantized.numel() >= rows * cols,
                "a GPU block projection [", rows, ", ", cols,
                "] needs a bf16 scratch of that size for steps of ", x.dim(0), " rows");
  const Tensor weight = scratch.dequantized.rows(0, rows * cols).reshape({rows, cols});
  int64_t row0 = 0;
  for (const DeviceBlocks& part : gpu_) {
    dequantize_blocks(part, weight, row0, stream);
    row0 += part.rows;
  }
  linear(x, weight, bias, out, stream, state);
}

int64_t LinearWeight::bytes() const {
  switch (format_) {
    case WeightFormat::kDense:
      return dense_.defined() ? static_cast<int64_t>(dense_.nbytes()) : 0;
    case WeightFormat::kFp8:
      return fp8_.bytes();
    case WeightFormat::kCpuBlocks:
    case WeightFormat::kGpuBlocks:
      break;
  }
  int64_t total = 0;
  for (const CpuBlockPart& part : cpu_) total += part.bytes();
  for (const DeviceBlocks& part : gpu_) total += part.bytes();
  return total;
}

void LinearWeight::add_bytes(std::map<std::string, int64_t>& by_format) const {
  switch (format_) {
    case WeightFormat::kDense:
      if (dense_.defined()) by_format[std::string(dtype_name(dense_.dtype()))] += bytes();
      return;
    case WeightFormat::kFp8:
      by_format["f8_e4m3 (W8A8)"] += bytes();
      return;
    case WeightFormat::kCpuBlocks:
      for (const CpuBlockPart& part : cpu_) by_format[part.format()] += part.bytes();
      return;
    case WeightFormat::kGpuBlocks:
      for (const DeviceBlocks& part : gpu_) by_format[quant_format(part.type).name] += part.bytes();
      return;
  }
}

}  // namespace pagedlm::ops
