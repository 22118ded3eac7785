#include <cmath>

#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/rms_norm.h"

namespace pagedlm::ops {

namespace cpu {
namespace {

// One row; the sum of squares is accumulated in double in index order, which makes the result
// independent of the batch and keeps the error far below float32 resolution.
inline void norm_row(const float* x, const float* weight, float* out, int64_t dim, float eps,
                     float weight_offset) {
  double sum_sq = 0.0;
  for (int64_t i = 0; i < dim; ++i) sum_sq += static_cast<double>(x[i]) * x[i];
  const float inv_rms =
      static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(dim) + eps));
  for (int64_t i = 0; i < dim; ++i) out[i] = (weight_offset + weight[i]) * (x[i] * inv_rms);
}

}  // namespace

void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps,
              float weight_offset) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    norm_row(x + r * dim, weight, out + r * dim, dim, eps, weight_offset);
  }
}

void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows,
                  int64_t dim, float eps, float weight_offset) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* res = residual + r * dim;
    const float* xr = x + r * dim;
    for (int64_t i = 0; i < dim; ++i) res[i] += xr[i];
    norm_row(res, weight, out + r * dim, dim, eps, weight_offset);
  }
}

void head_rms_norm(float* x, int64_t rows, int64_t width, int64_t first_head, int64_t num_heads,
                   int64_t head_dim, const float* weight, float eps, float weight_offset) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = first_head; h < first_head + num_heads; ++h) {
      float* head = x + r * width + h * head_dim;
      norm_row(head, weight, head, head_dim, eps, weight_offset);
    }
  }
}

}  // namespace cpu

namespace {

// Checks x: [rows, dim] in x_dtype, weight: [dim] and out: [rows, dim] in dtype, all on x's
// device.
void check_norm_args(const char* op, const Tensor& x, DType x_dtype, const Tensor& weight,
                     const Tensor& out, DType dtype) {
  detail::expect(x, op, "x", x_dtype, {detail::kAnyDim, detail::kAnyDim});
  detail::expect(weight, op, "weight", dtype, {x.dim(1)});
  detail::expect(out, op, "out", dtype, {x.dim(0), x.dim(1)});
  detail::expect_device(weight, x.device(), op, "weight");
  detail::expect_device(out, x.device(), op, "out");
}

}  // namespace

void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out, void* stream,
              float weight_offset, const Fp8RowsOut& fp8_out) {
  constexpr const char* kOp = "rms_norm";
  const DType x_dt = detail::compute_dtype(x, kOp, "x");
  // An f32 x is the residual stream, normalized into the compute dtype (weight's).
  const DType dt = x_dt == DType::kF32 ? detail::compute_dtype(weight, kOp, "weight") : x_dt;
  check_norm_args(kOp, x, x_dt, weight, out, dt);
  check_fp8_forms(kOp, x.device() == Device::kCuda, norm_fuses_fp8(x.dim(1)), x.dim(0), x.dim(1),
                  {}, x.dim(1), fp8_out);
  if (x.device() == Device::kCpu) {
    cpu::rms_norm(x.data<float>(), weight.data<float>(), out.data<float>(), x.dim(0), x.dim(1), eps,
                  weight_offset);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::rms_norm(x.raw(), x_dt, weight.raw(), out.raw(), x.dim(0), x.dim(1), eps, weight_offset, dt,
                 stream, fp8_out);
#else
  detail::fail_no_cuda(kOp);
#endif
}

void add_rms_norm(const Tensor& residual, const Tensor& x, const Tensor& weight, float eps,
                  const Tensor& out, void* stream, float weight_offset,
                  const Fp8Unscaled& x_unscaled, const Fp8RowsOut& fp8_out) {
  constexpr const char* kOp = "add_rms_norm";
  const DType dt = detail::compute_dtype(x, kOp, "x");
  check_norm_args(kOp, x, dt, weight, out, dt);
  detail::expect(residual, kOp, "residual", DType::kF32, {x.dim(0), x.dim(1)});
  detail::expect_device(residual, x.device(), kOp, "residual");
  check_fp8_forms(kOp, x.device() == Device::kCuda, norm_fuses_fp8(x.dim(1)), x.dim(0), x.dim(1),
                  x_unscaled, x.dim(1), fp8_out);
  if (x.device() == Device::kCpu) {
    cpu::add_rms_norm(residual.data<float>(), x.data<float>(), weight.data<float>(),
                      out.data<float>(), x.dim(0), x.dim(1), eps, weight_offset);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::add_rms_norm(residual.data<float>(), x.raw(), weight.raw(), out.raw(), x.dim(0), x.dim(1),
                     eps, weight_offset, dt, stream, x_unscaled, fp8_out);
#else
  detail::fail_no_cuda(kOp);
#endif
}

void head_rms_norm(const Tensor& x, int64_t first_head, int64_t num_heads, int64_t head_dim,
                   const Tensor& weight, float eps, void* stream, float weight_offset) {
  constexpr const char* kOp = "head_rms_norm";
  const DType dt = detail::compute_dtype(x, kOp, "x");
  detail::expect(x, kOp, "x", dt, {detail::kAnyDim, detail::kAnyDim});
  detail::expect(weight, kOp, "weight", dt, {head_dim});
  detail::expect_device(weight, x.device(), kOp, "weight");
  PAGEDLM_CHECK(
      first_head >= 0 && num_heads >= 0 && (first_head + num_heads) * head_dim <= x.dim(1), kOp,
      ": heads ", first_head, "..", first_head + num_heads, " of ", head_dim, " exceed a row of ",
      x.dim(1));
  if (x.device() == Device::kCpu) {
    cpu::head_rms_norm(x.data<float>(), x.dim(0), x.dim(1), first_head, num_heads, head_dim,
                       weight.data<float>(), eps, weight_offset);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::head_rms_norm(x.raw(), x.dim(0), x.dim(1), first_head, num_heads, head_dim, weight.raw(),
                      eps, weight_offset, dt, stream);
#else
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
