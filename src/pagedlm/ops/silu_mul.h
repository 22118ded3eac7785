// Gated activations of the fused gate/up projection: SwiGLU (silu_mul, here) and GeGLU
// (gelu_tanh_mul, ops/gelu_tanh_mul.h). One implementation per device serves both,
// parameterized by the activation.
#pragma once

#include <cstdint>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/linear_fp8.h"

namespace pagedlm::ops {

// gate_up: [n_tokens, 2 * ffn] (gate = first ffn columns, up = last ffn; the model stacks
// gate_proj and up_proj rows into one [2 * ffn, hidden] weight), out: [n_tokens, ffn].
// out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
void silu_mul(const Tensor& gate_up, const Tensor& out, void* stream = nullptr);

enum class GatedActivation : uint8_t {
  kSilu,      // silu_mul
  kGeluTanh,  // gelu_tanh_mul
};

// The op's name, for error messages.
constexpr const char* gated_mul_name(GatedActivation act) {
  return act == GatedActivation::kSilu ? "silu_mul" : "gelu_tanh_mul";
}

// What silu_mul and gelu_tanh_mul do: checks the layout above and runs `act` on the tensors'
// device.
// gate_up_unscaled and fp8_out (GPU, gated_mul_fuses_fp8(ffn)): gate_up is an FP8 projection's
// unscaled output, and out's rows are also written as the next FP8 projection's input
// (ops/linear_fp8.h).
void gated_mul(GatedActivation act, const Tensor& gate_up, const Tensor& out, void* stream,
               const Fp8Unscaled& gate_up_unscaled = {}, const Fp8RowsOut& fp8_out = {});

namespace cpu {
void gated_mul(GatedActivation act, const float* gate_up, float* out, int64_t n_tokens,
               int64_t ffn);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as cpu::gated_mul; both pointers hold `dtype` elements.
void gated_mul(GatedActivation act, const void* gate_up, void* out, int64_t n_tokens, int64_t ffn,
               DType dtype, void* stream, const Fp8Unscaled& gate_up_unscaled = {},
               const Fp8RowsOut& fp8_out = {});
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
