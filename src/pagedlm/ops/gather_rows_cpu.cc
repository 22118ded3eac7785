#include <cstring>

#include "pagedlm/ops/gather_rows.h"
#include "pagedlm/ops/op_check.h"

namespace pagedlm::ops {

namespace cpu {

void gather_rows(const float* x, const int32_t* rows, float* out, int64_t n_rows, int64_t n_out,
                 int64_t dim) {
  for (int64_t i = 0; i < n_out; ++i) {
    PAGEDLM_CHECK(rows[i] >= 0 && rows[i] < n_rows, "gather_rows: row index ", rows[i],
                  " at position ", i, " is outside [0, ", n_rows, ")");
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n_out; ++i) {
    std::memcpy(out + i * dim, x + static_cast<int64_t>(rows[i]) * dim, dim * sizeof(float));
  }
}

}  // namespace cpu

void gather_rows(const Tensor& x, const Tensor& rows, const Tensor& out, void* stream) {
  using detail::kAnyDim;
  constexpr const char* kOp = "gather_rows";
  const DType dt = detail::compute_dtype(x, kOp, "x");
  detail::expect(x, kOp, "x", dt, {kAnyDim, kAnyDim});
  detail::expect(rows, kOp, "rows", DType::kI32, {kAnyDim});
  const int64_t n_rows = x.dim(0), dim = x.dim(1), n_out = rows.dim(0);
  detail::expect(out, kOp, "out", dt, {n_out, dim});
  detail::expect_device(rows, x.device(), kOp, "rows");
  detail::expect_device(out, x.device(), kOp, "out");
  if (x.device() == Device::kCpu) {
    cpu::gather_rows(x.data<float>(), rows.data<int32_t>(), out.data<float>(), n_rows, n_out, dim);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::gather_rows(x.raw(), rows.data<int32_t>(), out.raw(), n_rows, n_out, dim, dt, stream);
#else
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
