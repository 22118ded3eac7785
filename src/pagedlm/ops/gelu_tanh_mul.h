// GeGLU activation of the fused gate/up projection (Gemma's MLP).
#pragma once

#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/silu_mul.h"

namespace pagedlm::ops {

// The layout of silu_mul (ops/silu_mul.h). out = gelu_tanh(gate) * up in f32, gelu_tanh being
// HF's gelu_pytorch_tanh: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
void gelu_tanh_mul(const Tensor& gate_up, const Tensor& out, void* stream = nullptr);

}  // namespace pagedlm::ops
