// The Tensor entry points of ops/linear_blocks.h: argument checks, then the CUDA kernels
// (ops/cuda/blocks.cu). There is no CPU kernel here: the CPU computes blocks with ops::linear.
#include "pagedlm/ops/linear_blocks.h"

#include <cstdint>
#include <utility>

#include "pagedlm/ops/op_check.h"

namespace pagedlm::ops {

namespace {

void expect_gpu(const Tensor& t, std::string_view op, std::string_view name) {
  PAGEDLM_CHECK(t.device() == Device::kCuda, op, ": ", name,
                " must be on the GPU (block weights are computed from on the GPU here; the CPU's "
                "are ops::linear's)");
}

void expect_blocks(const DeviceBlocks& w, std::string_view op) {
  PAGEDLM_CHECK(w.defined(), op, ": the weight is not defined");
  PAGEDLM_CHECK(gpu_computes_blocks(w.type), op, ": the GPU has no kernel for ",
                quant_format(w.type).name, " blocks");
  PAGEDLM_CHECK(w.cols % quant_block_elems(w.type) == 0, op, ": ", w.cols,
                " input features are not whole blocks of ", quant_block_elems(w.type));
  detail::expect(w.blocks, op, "weight blocks", DType::kU8, {w.rows * w.row_bytes()});
  expect_gpu(w.blocks, op, "weight blocks");
}

}  // namespace

bool gpu_computes_blocks(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0:
    case QuantType::kQ4_0:
    case QuantType::kQ4_1:
    case QuantType::kQ5_0:
    case QuantType::kQ5_1:
    case QuantType::kQ4_K:
    case QuantType::kQ5_K:
    case QuantType::kQ6_K:
      return true;
    default:
      return false;  // Q3_K, Q2_K, IQ4_NL, IQ4_XS, and the CPU's repackings
  }
}

DeviceBlocks upload_blocks(const QuantizedMatrix& weight) {
  PAGEDLM_CHECK(gpu_computes_blocks(weight.type), "upload_blocks: the GPU has no kernel for ",
                quant_format(weight.type).name, " blocks");
  PAGEDLM_CHECK(static_cast<int64_t>(weight.blocks.size()) == weight.rows * weight.row_bytes(),
                "upload_blocks: [", weight.rows, ", ", weight.cols, "] ",
                quant_format(weight.type).name, " needs ", weight.rows * weight.row_bytes(),
                " bytes of blocks, got ", weight.blocks.size());
  DeviceBlocks out;
  out.type = weight.type;
  out.rows = weight.rows;
  out.cols = weight.cols;
  // The host vector is wrapped (not copied) for the upload.
  auto* data = const_cast<uint8_t*>(weight.blocks.data());
  out.blocks = Tensor::wrap(data, DType::kU8, {static_cast<int64_t>(weight.blocks.size())},
                            Device::kCpu, nullptr)
                   .to(Device::kCuda);
  return out;
}

int64_t staged_rows_words(int64_t rows, int64_t cols) {
  return rows * (cols / 32) * kStagedWordsPer32;
}

void stage_rows(const Tensor& x, const Tensor& staged, void* stream) {
  constexpr const char* kOp = "stage_rows";
  detail::expect(x, kOp, "x", DType::kBF16, {detail::kAnyDim, detail::kAnyDim});
  const int64_t rows = x.dim(0), cols = x.dim(1);
  PAGEDLM_CHECK(rows <= kStagedRowsMaxRows, kOp, ": takes up to ", kStagedRowsMaxRows,
                " rows, got ", rows);
  PAGEDLM_CHECK(cols % 32 == 0, kOp, ": ", cols, " columns are not whole groups of 32");
  detail::expect(staged, kOp, "staged", DType::kI32, {detail::kAnyDim});
  PAGEDLM_CHECK(staged.numel() >= staged_rows_words(rows, cols), kOp, ": staged holds ",
                staged.numel(), " words, x needs ", staged_rows_words(rows, cols));
  expect_gpu(x, kOp, "x");
  expect_gpu(staged, kOp, "staged");
  PAGEDLM_CHECK(reinterpret_cast<uintptr_t>(x.raw()) % 16 == 0, kOp, ": x must be 16-byte aligned");
#ifdef PAGEDLM_HAS_CUDA
  cuda::stage_rows(x.raw(), staged.raw(), rows, cols, stream);
#else
  (void)stream;
  detail::fail_no_cuda(kOp);
#endif
}

void linear_blocks(const Tensor& x, const DeviceBlocks& w, const Tensor& bias, const Tensor& out,
                   int64_t out_col0, void* stream, const Tensor& staged) {
  constexpr const char* kOp = "linear (GGUF blocks)";
  expect_blocks(w, kOp);
  detail::expect(x, kOp, "x", DType::kBF16, {detail::kAnyDim, w.cols});
  const int64_t rows = x.dim(0);
  const bool from_staged = staged.defined() && takes_staged_rows(w.type, rows);
  PAGEDLM_CHECK(rows <= kBlockMatvecMaxRows || from_staged, kOp, ": ", rows, " rows of ",
                quant_format(w.type).name, " blocks: the matrix-vector kernels take up to ",
                kBlockMatvecMaxRows, " (Q4_K and Q6_K with staged x up to ", kStagedRowsMaxRows,
                "); larger steps dequantize_blocks and run a GEMM");
  const bool out_f32 = out.dtype() == DType::kF32;
  detail::expect(out, kOp, "out", out_f32 ? DType::kF32 : DType::kBF16, {rows, detail::kAnyDim});
  PAGEDLM_CHECK(out_col0 >= 0 && out_col0 + w.rows <= out.dim(1), kOp, ": the weight's ", w.rows,
                " outputs from column ", out_col0, " do not fit out's ", out.dim(1));
  if (bias.defined()) {
    PAGEDLM_CHECK(!out_f32, kOp, ": an f32 output takes no bias");
    detail::expect(bias, kOp, "bias", DType::kBF16, {out.dim(1)});
    expect_gpu(bias, kOp, "bias");
  }
  expect_gpu(x, kOp, "x");
  expect_gpu(out, kOp, "out");
  // Activations are read 8 at a time (16 bytes).
  PAGEDLM_CHECK(reinterpret_cast<uintptr_t>(x.raw()) % 16 == 0, kOp, ": x must be 16-byte aligned");
  if (staged.defined()) {
    detail::expect(staged, kOp, "staged x", DType::kI32, {detail::kAnyDim});
    PAGEDLM_CHECK(staged.numel() >= staged_rows_words(rows, w.cols), kOp, ": staged x holds ",
                  staged.numel(), " words, ", rows, " rows of ", w.cols, " need ",
                  staged_rows_words(rows, w.cols));
    expect_gpu(staged, kOp, "staged x");
  }
  // The integer Q4_K kernels read a block's 144 bytes 16 at a time.
  PAGEDLM_CHECK(!from_staged || w.type != QuantType::kQ4_K ||
                    reinterpret_cast<uintptr_t>(w.blocks.raw()) % 16 == 0,
                kOp, ": Q4_K blocks must be 16-byte aligned");
#ifdef PAGEDLM_HAS_CUDA
  const size_t elem = out_f32 ? 4 : 2;
  cuda::linear_blocks(
      x.raw(), w.blocks.raw(), w.type,
      bias.defined() ? static_cast<const uint16_t*>(bias.raw()) + out_col0 : nullptr,
      static_cast<char*>(out.raw()) + out_col0 * elem, out_f32, rows, w.rows, w.cols, out.dim(1),
      stream, staged.defined() ? staged.raw() : nullptr);
#else
  (void)stream;
  detail::fail_no_cuda(kOp);
#endif
}

void dequantize_blocks(const DeviceBlocks& w, const Tensor& dense, int64_t row0, void* stream) {
  constexpr const char* kOp = "dequantize_blocks";
  expect_blocks(w, kOp);
  detail::expect(dense, kOp, "dense", DType::kBF16, {detail::kAnyDim, w.cols});
  PAGEDLM_CHECK(row0 >= 0 && row0 + w.rows <= dense.dim(0), kOp, ": rows [", row0, ", ",
                row0 + w.rows, ") do not fit dense's ", dense.dim(0));
  expect_gpu(dense, kOp, "dense");
  PAGEDLM_CHECK(reinterpret_cast<uintptr_t>(dense.raw()) % 16 == 0, kOp,
                ": dense must be 16-byte aligned");
#ifdef PAGEDLM_HAS_CUDA
  cuda::dequantize_blocks(w.blocks.raw(), w.type,
                          static_cast<uint16_t*>(dense.raw()) + row0 * w.cols, w.rows, w.cols,
                          stream);
#else
  (void)stream;
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
