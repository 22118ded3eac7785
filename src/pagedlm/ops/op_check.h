// Argument checks shared by the Tensor-level entry points of every op, so each error names the
// op and the offending tensor the same way ("rms_norm: weight: expected f32 [64], got ...").
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops::detail {

// Dimension wildcard for expect(): any size is accepted.
inline constexpr int64_t kAnyDim = -1;

// Checks dtype, rank and every dimension that is not kAnyDim.
inline void expect(const Tensor& t, std::string_view op, std::string_view name, DType dtype,
                   std::initializer_list<int64_t> dims) {
  PAGEDLM_CHECK(t.defined(), op, ": ", name, " is not defined");
  bool ok = t.dtype() == dtype && t.ndim() == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (ok && d != kAnyDim && t.dim(i) != d) ok = false;
    ++i;
  }
  if (ok) return;
  Shape want;
  for (int64_t d : dims) want.push_back(d);
  fail(op, ": ", name, ": expected ", dtype_name(dtype), " ", shape_str(want), " (-1 = any), got ",
       dtype_name(t.dtype()), " ", shape_str(t.shape()));
}

inline void expect_device(const Tensor& t, Device device, std::string_view op,
                          std::string_view name) {
  PAGEDLM_CHECK(t.device() == device, op, ": ", name, " is on the ",
                t.device() == Device::kCpu ? "CPU" : "GPU", " but the op runs on the ",
                device == Device::kCpu ? "CPU" : "GPU");
}

inline void expect_devices(
    std::string_view op, Device device,
    std::initializer_list<std::pair<const Tensor*, std::string_view>> tensors) {
  for (const auto& [t, name] : tensors) expect_device(*t, device, op, name);
}

// The dtype activations are computed in: float32 on the CPU (weights are converted at load),
// f32/bf16/f16 on the GPU.
inline DType compute_dtype(const Tensor& t, std::string_view op, std::string_view name) {
  const DType dt = t.dtype();
  const bool ok = t.device() == Device::kCpu
                      ? dt == DType::kF32
                      : dt == DType::kF32 || dt == DType::kBF16 || dt == DType::kF16;
  PAGEDLM_CHECK(ok, op, ": ", name, " has dtype ", dtype_name(dt), ", which the ",
                t.device() == Device::kCpu ? "CPU" : "GPU", " backend does not compute in");
  return dt;
}

// A projection whose `num_cols` outputs go into columns [col0, col0 + num_cols) of a wider f32
// `out`, beside other weights' (one output for the fused projections): out must have x's rows
// and room for those columns.
inline void expect_output_columns(const Tensor& x, const Tensor& out, int64_t col0,
                                  int64_t num_cols, std::string_view op) {
  PAGEDLM_CHECK(out.dtype() == DType::kF32 && out.ndim() == 2 && out.dim(0) == x.dim(0) &&
                    col0 >= 0 && col0 + num_cols <= out.dim(1),
                op, ": out must be f32 [", x.dim(0), ", >= ", col0 + num_cols, "] (columns ", col0,
                " on for this weight's ", num_cols, " rows), got ", dtype_name(out.dtype()), " ",
                shape_str(out.shape()));
}

[[noreturn]] inline void fail_no_cuda(std::string_view op) {
  fail(op, ": tensor is on the GPU but this build of pagedlm has no CUDA support");
}

}  // namespace pagedlm::ops::detail
