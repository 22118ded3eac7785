// Rotary position embedding, NEOX / HF rotate_half form: dimension i is paired with i + d/2.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// q: [n_tokens, n_q_heads, head_dim], k: [n_tokens, n_kv_heads, head_dim], both rotated in place;
// positions: [n_tokens] i32, inv_freq: [head_dim / 2] f32.
// For pair (x1, x2) = (x[i], x[i + d/2]) and angle = float(pos) * inv_freq[i] in float32:
// x[i] = x1 cos - x2 sin, x[i + d/2] = x2 cos + x1 sin.
// CPU tensors only: the GPU rotates in the same kernel that writes the KV cache
// (rope_write_kv, ops/paged_attention.h), which runs this op on the CPU.
void rope(const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& inv_freq);

namespace cpu {
void rope(float* q, float* k, const int32_t* positions, const float* inv_freq, int64_t n_tokens,
          int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim);
}  // namespace cpu

}  // namespace pagedlm::ops
