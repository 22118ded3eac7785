#include "pagedlm/ops/exp_cpu.h"
#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/silu_mul.h"

namespace pagedlm::ops {

namespace cpu {

void silu_mul(const float* gate_up, float* out, int64_t n_tokens, int64_t ffn) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* gate = gate_up + t * 2 * ffn;
    const float* up = gate + ffn;
    float* o = out + t * ffn;
    for (int64_t i = 0; i < ffn; ++i) {
      o[i] = gate[i] / (1.f + exp_vectorizable(-gate[i])) * up[i];
    }
  }
}

}  // namespace cpu

void silu_mul(const Tensor& gate_up, const Tensor& out, void* stream) {
  using detail::kAnyDim;
  constexpr const char* kOp = "silu_mul";
  const DType dt = detail::compute_dtype(gate_up, kOp, "gate_up");
  detail::expect(gate_up, kOp, "gate_up", dt, {kAnyDim, kAnyDim});
  PAGEDLM_CHECK(gate_up.dim(1) % 2 == 0, kOp, ": gate_up has an odd number of columns (",
                gate_up.dim(1), ")");
  const int64_t n_tokens = gate_up.dim(0), ffn = gate_up.dim(1) / 2;
  detail::expect(out, kOp, "out", dt, {n_tokens, ffn});
  detail::expect_device(out, gate_up.device(), kOp, "out");
  if (gate_up.device() == Device::kCpu) {
    cpu::silu_mul(gate_up.data<float>(), out.data<float>(), n_tokens, ffn);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::silu_mul(gate_up.raw(), out.raw(), n_tokens, ffn, dt, stream);
#else
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
