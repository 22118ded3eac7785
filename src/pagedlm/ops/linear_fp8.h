// W8A8 projections on GPUs with FP8 tensor cores (compute capability 8.9 and up): the weight in
// e4m3 with one f32 scale per output feature, each input row quantized to e4m3 with a scale of
// its own just before the GEMM, the e4m3 products accumulated in f32 by cuBLASLt and scaled by
// (row scale x feature scale) on the way out: y[m, n] = sx[m] sw[n] sum_k qx[m, k] qw[n, k]
// (+ b[n]). Half the weight bytes of bf16 and twice its tensor-core rate, at the cost of
// rounding every input to 4 significant bits.
#pragma once

#include <cstdint>
#include <string_view>

#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/device_state.h"

namespace pagedlm::ops {

// The largest e4m3 magnitude, and the smallest scale a row computes for itself (a row of zeros,
// as the padding rows of a decode graph are, would otherwise divide by 0).
inline constexpr float kFp8Max = 448.f;
inline constexpr float kFp8MinScale = 1.f / (448.f * 512.f);

// How a projection's input rows are quantized.
struct Fp8InputScaling {
  // > 0: every row's scale is this calibrated value (a checkpoint's static input_scale); values
  // beyond +-448 x scale saturate. 0: each row's own, max |x| / 448 (dynamic per token).
  float static_scale = 0.f;
  // Dynamic only, > 0: a row's max |x| is taken as at most this (fbgemm_fp8's
  // activation_scale_ub), so that an outlier saturates instead of coarsening its whole row.
  float max_abs_ub = 0.f;
};

// A projection's weight for linear_fp8, on the GPU.
struct Fp8Weight {
  Tensor weight;  // [out_features, in_features] F8_E4M3
  Tensor scale;   // [out_features] F32: weight = e4m3 value x scale (a per-tensor one repeated)
  Fp8InputScaling inputs;

  bool defined() const { return weight.defined() && weight.ndim() == 2; }
  int64_t rows() const { return weight.dim(0); }
  int64_t cols() const { return weight.dim(1); }
  int64_t bytes() const { return static_cast<int64_t>(weight.nbytes() + scale.nbytes()); }
};

// Where linear_fp8 puts its quantized input: values [>= rows * in_features] F8_E4M3 and scales
// [>= rows] F32, on the GPU, preallocated (nothing is allocated per call, so a step that runs
// it can be captured as a CUDA graph).
struct Fp8Scratch {
  Tensor values, scales;
};

// The two forms that let the kernels beside an FP8 projection do its extra passes (GPU):
// - Fp8RowsOut: a norm or the gated product writes its bf16 output rows a second time as the
//   projection's quantized input (quantize_fp8_rows' codes and scales, as `how` says), and the
//   projection, applied with x_quantized, quantizes nothing;
// - Fp8Unscaled: the projection leaves its output unscaled where its GEMM would scale it in a
//   kernel of its own (linear_fp8 with `unscaled`), and the kernel that reads the output next
//   scales each value as that kernel would: bf16(y[r, c] x (x_scales[r] x w_scales[c])).
// x_scales is the projection's scratch.scales, which the next Fp8RowsOut may overwrite in the
// same kernel (each row's block reads its scale before writing the new one).
struct Fp8RowsOut {
  Tensor values;  // >= [rows * cols] F8_E4M3; undefined: off
  Tensor scales;  // >= [rows] F32
  Fp8InputScaling how;
  bool on() const { return values.defined(); }
};
struct Fp8Unscaled {
  Tensor x_scales;  // >= [rows] F32; undefined: off
  Tensor w_scales;  // [the output's width] F32
  bool on() const { return x_scales.defined(); }
};
// Whether the norms (ops/rms_norm.h) and the gated product (ops/silu_mul.h) take those forms for
// rows of `dim` values on the GPU (false without CUDA).
bool norm_fuses_fp8(int64_t dim);
bool gated_mul_fuses_fp8(int64_t dim);

// The argument checks of an op that takes those forms (throws pagedlm::Error naming `op`): on the
// GPU, `fuses` (the op's *_fuses_fp8 for its width), the unscaled input's scales for `rows` rows
// of `in_cols` values, the rows out's room for `rows` rows of `out_cols`.
void check_fp8_forms(std::string_view op, bool on_gpu, bool fuses, int64_t rows, int64_t in_cols,
                     const Fp8Unscaled& in, int64_t out_cols, const Fp8RowsOut& out);

// How linear_fp8 takes its input and leaves its output.
struct Fp8Apply {
  bool x_quantized = false;         // scratch holds x's codes and scales already (Fp8RowsOut)
  Fp8Unscaled* unscaled = nullptr;  // set: the output may be left unscaled, said here
};

// x [rows, cols] bf16 quantized row by row as `how` says: q [rows, cols] F8_E4M3 and scales
// [rows] F32 (GPU).
void quantize_fp8_rows(const Tensor& x, const Fp8InputScaling& how, const Tensor& q,
                       const Tensor& scales, void* stream = nullptr);

// out [rows, out_features] bf16 = x [rows, in_features] bf16 through the FP8 weight, + bias
// [out_features] bf16 (or an undefined Tensor). in_features and out_features must be multiples
// of 16 (cuBLASLt's FP8 layouts).
// `state`: the caller's GPU state (its cuBLASLt handle and plans), which must be given.
// `apply`: Fp8Apply's two forms.
void linear_fp8(const Tensor& x, const Fp8Weight& w, const Tensor& bias, const Tensor& out,
                const Fp8Scratch& scratch, void* stream = nullptr, DeviceState* state = nullptr,
                const Fp8Apply& apply = {});

// A bf16 weight [out_features, in_features] on the GPU quantized per output feature (each row's
// scale max |w| / 448), dynamic per-token inputs: --quantization fp8 on a bf16 checkpoint.
Fp8Weight quantize_fp8_weight(const Tensor& weight, void* stream = nullptr);

// Throws pagedlm::Error naming `what` and the device unless a device of this compute capability
// has FP8 tensor cores (8.9: Ada; 9.0: Hopper; and later).
void check_fp8_compute_capability(int major, int minor, std::string_view device_name,
                                  std::string_view what);
// Whether this process's current GPU has FP8 tensor cores (false without CUDA or a GPU).
bool fp8_gemm_supported();
// check_fp8_compute_capability for the current GPU (throws without one).
void check_fp8_gemm_supported(std::string_view what);

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
void quantize_fp8_rows(const void* x, void* q, float* scales, int64_t rows, int64_t cols,
                       const Fp8InputScaling& how, void* stream);
// *unscaled (may be null): launch_gemm_fp8's.
void linear_fp8(const void* xq, const float* x_scales, const void* wq, const float* w_scales,
                const void* bias, void* out, int64_t rows, int64_t out_features,
                int64_t in_features, void* stream, DeviceState& state, bool* unscaled = nullptr);
bool norm_fuses_fp8(int64_t dim);
bool gated_mul_fuses_fp8(int64_t dim);
// The current device's name and compute capability.
void device_capability(int* major, int* minor, const char** name);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
