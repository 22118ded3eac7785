#include "pagedlm/ops/gelu_tanh_mul.h"

namespace pagedlm::ops {

void gelu_tanh_mul(const Tensor& gate_up, const Tensor& out, void* stream) {
  gated_mul(GatedActivation::kGeluTanh, gate_up, out, stream);
}

}  // namespace pagedlm::ops
