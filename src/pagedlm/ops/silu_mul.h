// SwiGLU activation of the fused gate/up projection.
#pragma once

#include <cstdint>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// gate_up: [n_tokens, 2 * ffn] (gate = first ffn columns, up = last ffn; the model stacks
// gate_proj and up_proj rows into one [2 * ffn, hidden] weight), out: [n_tokens, ffn].
// out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
void silu_mul(const Tensor& gate_up, const Tensor& out, void* stream = nullptr);

namespace cpu {
void silu_mul(const float* gate_up, float* out, int64_t n_tokens, int64_t ffn);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as cpu::silu_mul; both pointers hold `dtype` elements.
void silu_mul(const void* gate_up, void* out, int64_t n_tokens, int64_t ffn, DType dtype,
              void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
