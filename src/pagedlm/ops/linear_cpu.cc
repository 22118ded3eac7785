#include "pagedlm/ops/linear.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "pagedlm/ops/op_check.h"

namespace pagedlm::ops {

namespace cpu {
namespace {

// out[tile, n] = x[tile, k] * w[n, k]^T for one tile of exactly kLinearRowTile rows.
void gemm_tile(const float* x, const float* weight, float* out, int64_t n, int64_t k) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(kLinearRowTile),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.f, x, static_cast<blasint>(k),
              weight, static_cast<blasint>(k), 0.f, out, static_cast<blasint>(n));
}

}  // namespace

// Batch invariance: OpenBLAS picks kernels, blockings and the split of the K reduction from
// (M, N, K), so a row's bits could change with the number of rows in the batch. Every sgemm call
// here therefore has M == kLinearRowTile; a short last tile is zero-padded in scratch memory. A
// row's result then depends only on its own data and the weights (rows never interact in a GEMM,
// and the row's slot inside the tile does not change the per-element reduction order; the test
// checks this). Decode steps, the case that pays for padding, are bound by streaming the weight
// matrix from memory, and a 16-row tile reads the weights once just like a 1-row GEMV would.
void linear(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
            int64_t out_features, int64_t in_features) {
  const int64_t full_rows = rows / kLinearRowTile * kLinearRowTile;
  for (int64_t r = 0; r < full_rows; r += kLinearRowTile) {
    gemm_tile(x + r * in_features, weight, out + r * out_features, out_features, in_features);
  }
  const int64_t tail = rows - full_rows;
  if (tail > 0) {
    thread_local std::vector<float> x_pad, out_pad;
    x_pad.assign(kLinearRowTile * in_features, 0.f);
    out_pad.resize(kLinearRowTile * out_features);
    std::memcpy(x_pad.data(), x + full_rows * in_features, tail * in_features * sizeof(float));
    gemm_tile(x_pad.data(), weight, out_pad.data(), out_features, in_features);
    std::memcpy(out + full_rows * out_features, out_pad.data(),
                tail * out_features * sizeof(float));
  }
  if (bias != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float* row = out + r * out_features;
      for (int64_t j = 0; j < out_features; ++j) row[j] += bias[j];
    }
  }
}

}  // namespace cpu

void linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
            void* stream) {
  using detail::kAnyDim;
  constexpr const char* kOp = "linear";
  const DType dt = detail::compute_dtype(x, kOp, "x");
  detail::expect(x, kOp, "x", dt, {kAnyDim, kAnyDim});
  const int64_t rows = x.dim(0), in_features = x.dim(1);
  detail::expect(weight, kOp, "weight", dt, {kAnyDim, in_features});
  const int64_t out_features = weight.dim(0);
  detail::expect(out, kOp, "out", dt, {rows, out_features});
  detail::expect_device(weight, x.device(), kOp, "weight");
  detail::expect_device(out, x.device(), kOp, "out");
  // An undefined Tensor (default-constructed, shape []) means "no bias".
  const bool has_bias = bias.defined();
  if (has_bias) {
    detail::expect(bias, kOp, "bias", dt, {out_features});
    detail::expect_device(bias, x.device(), kOp, "bias");
  }
  if (x.device() == Device::kCpu) {
    cpu::linear(x.data<float>(), weight.data<float>(), has_bias ? bias.data<float>() : nullptr,
                out.data<float>(), rows, out_features, in_features);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::linear(x.raw(), weight.raw(), has_bias ? bias.raw() : nullptr, out.raw(), rows,
               out_features, in_features, dt, stream);
#else
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
