// Projections whose weight stays in a GGUF's block format on the GPU: the blocks are uploaded
// byte for byte as the file holds them (no repacking: every format here keeps its fields 2-byte
// aligned, which is all the kernels' loads need). A step of few rows (decode) multiplies them with
// a matrix-vector kernel that reads every weight byte once per step: blocks expanded in registers
// and accumulated in f32, or for Q4_K and Q6_K integer products on tensor cores with x rounded
// (linear_blocks below); a larger step (prefill) expands the whole matrix to bf16 into a workspace
// and runs the bf16 GEMM of ops::linear on it.
#pragma once

#include <cstdint>

#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// The steps of up to this many rows run linear_blocks' matrix-vector kernel; larger ones
// dequantize_blocks and a GEMM, except for projections whose every part takes_staged_rows.
inline constexpr int64_t kBlockMatvecMaxRows = 8;

// Q4_K and Q6_K parts multiply steps of up to this many rows from x staged (stage_rows), in
// integers on tensor cores, reading each block once a step. Each group of eight rows adds an mma
// a plane to every sub-block, so the cost grows with the rows while the GEMM's stays flat: on an
// H100 (8B shape) 16 rows ran 1.4x the GEMM path, 24 and 32 rows 0.8-0.9x.
inline constexpr int64_t kStagedRowsMaxRows = 16;

// A [rows, cols] matrix of blocks on the GPU: each row its blocks, rows back to back, as
// QuantizedMatrix (core/quantized.h) holds them.
struct DeviceBlocks {
  QuantType type = QuantType::kQ8_0;
  int64_t rows = 0, cols = 0;
  Tensor blocks;  // [rows * row_bytes] U8, on the GPU

  bool defined() const { return rows > 0 && blocks.defined(); }
  int64_t row_bytes() const { return cols / quant_block_elems(type) * quant_block_bytes(type); }
  int64_t bytes() const { return static_cast<int64_t>(blocks.nbytes()); }
};

// Whether the GPU computes from blocks of this (ggml) format: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// Q4_K, Q5_K and Q6_K (not yet Q3_K, Q2_K, IQ4_NL and IQ4_XS).
bool gpu_computes_blocks(QuantType type);

// The matrix's blocks copied to the GPU as they are. Throws unless gpu_computes_blocks(type).
DeviceBlocks upload_blocks(const QuantizedMatrix& weight);

// x's rows in two 8-bit planes per 32 values, what linear_blocks' integer kernels at two rows and
// more take: hi, x / dx rounded as ggml rounds activations for its integer kernels (dx = max |x| /
// 127, to nearest, ties to even), and lo, what hi leaves in 128ths of dx, so that x keeps about 15
// bits against its 32's largest value (one plane's 8 bits moved a model's logits past the bf16
// bound). staged: [>= staged_rows_words(rows, cols)] I32 on the GPU; x [rows <=
// kStagedRowsMaxRows, cols] bf16, cols a multiple of 32.
inline constexpr int64_t kStagedWordsPer32 = 18;  // 2 x 8 words of int8, dx / 128, the 32's sum

// Whether linear_blocks multiplies a part of this format at this many rows from x staged: Q4_K
// and Q6_K at two to kStagedRowsMaxRows rows (Q4_K's one-row kernel rounds x itself).
constexpr bool takes_staged_rows(QuantType type, int64_t rows) {
  return (type == QuantType::kQ4_K || type == QuantType::kQ6_K) && rows >= 2 &&
         rows <= kStagedRowsMaxRows;
}
int64_t staged_rows_words(int64_t rows, int64_t cols);
void stage_rows(const Tensor& x, const Tensor& staged, void* stream = nullptr);

// out[:, out_col0 : out_col0 + w.rows] = x w^T (+ bias[out_col0 : out_col0 + w.rows]).
// x [rows, w.cols] bf16, rows <= kBlockMatvecMaxRows, or <= kStagedRowsMaxRows where the part
// takes_staged_rows and `staged` is given; out [rows, >= out_col0 + w.rows], bf16, or f32
// without a bias; bias [out.dim(1)] bf16 or undefined. Each output is the block weights (f32,
// ggml's dequantization) times x in f32, summed in f32; except where the kernels take x rounded
// and sum integer products on tensor cores: Q4_K at one row (the kernel rounds x itself to one
// 8-bit plane, ggml's rule), and the parts that takes_staged_rows where `staged` holds x as
// stage_rows wrote it (undefined: the f32 kernels).
void linear_blocks(const Tensor& x, const DeviceBlocks& w, const Tensor& bias, const Tensor& out,
                   int64_t out_col0 = 0, void* stream = nullptr, const Tensor& staged = Tensor());

// The weights as bf16 into rows [row0, row0 + w.rows) of dense [>= row0 + w.rows, w.cols] (GPU):
// each one ggml's f32 dequantization rounded to nearest even.
void dequantize_blocks(const DeviceBlocks& w, const Tensor& dense, int64_t row0 = 0,
                       void* stream = nullptr);

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
void stage_rows(const void* x, void* staged, int64_t rows, int64_t in_features, void* stream);
// staged: x as stage_rows wrote it, or null.
void linear_blocks(const void* x, const void* blocks, QuantType type, const void* bias, void* out,
                   bool out_f32, int64_t rows, int64_t out_features, int64_t in_features,
                   int64_t out_stride, void* stream, const void* staged);
void dequantize_blocks(const void* blocks, QuantType type, void* dense, int64_t out_features,
                       int64_t in_features, void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
