#include <cmath>

#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/softcap.h"

namespace pagedlm::ops {

namespace cpu {

// std::tanh rather than a form of the vectorizable exp: 1 - 2 / (exp(2 z) + 1) cancels for small
// |z|, the bulk of the logits, and a step's logits cost little next to its GEMMs. x / cap (not
// x * (1 / cap)), as HF computes it.
void softcap(float* x, int64_t n, float cap) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

}  // namespace cpu

void softcap(const Tensor& x, float cap, void* stream) {
  constexpr const char* kOp = "softcap";
  PAGEDLM_CHECK(x.defined(), kOp, ": x is not defined");
  PAGEDLM_CHECK(cap > 0.f && std::isfinite(cap), kOp, ": cap ", cap, " is not positive and finite");
  if (x.device() == Device::kCpu) {
    PAGEDLM_CHECK(x.dtype() == DType::kF32, kOp, ": x has dtype ", dtype_name(x.dtype()),
                  ", expected f32");
    cpu::softcap(x.data<float>(), x.numel(), cap);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::softcap(x.raw(), x.numel(), cap, detail::compute_dtype(x, kOp, "x"), stream);
#else
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
