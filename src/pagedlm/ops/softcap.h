// Soft-capping of logits (Gemma 2's final logits): a smooth clamp to (-cap, cap).
#pragma once

#include <cstdint>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// x: any shape (the logits, [S, vocab] f32), in place: x = cap * tanh(x / cap), in f32. cap > 0.
// f32 on every device; on the GPU the compute dtype (bf16) too.
void softcap(const Tensor& x, float cap, void* stream = nullptr);

namespace cpu {
void softcap(float* x, int64_t n, float cap);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as cpu::softcap; x holds `dtype` elements (f32 or bf16).
void softcap(void* x, int64_t n, float cap, DType dtype, void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
