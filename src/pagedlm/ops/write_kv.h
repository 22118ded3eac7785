// Scatter of this step's keys and values into the paged KV cache.
#pragma once

#include <cstdint>

#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// k, v: [n_tokens, n_kv_heads, head_dim] f32, slot_mapping: [n_tokens] i32,
// k_cache, v_cache: [num_pages, page_size, n_kv_heads, head_dim], f32 or bf16 (each value
// rounded to nearest even).
// Token t goes to slot s = slot_mapping[t] = page * page_size + offset; s == -1 skips the token
// (padding of a captured decode bucket). Slots outside [-1, num_pages * page_size) throw an
// Error naming the token.
// CPU tensors only: the GPU writes the cache in the same kernel that applies rope
// (rope_write_kv, ops/paged_attention.h), which runs this op on the CPU.
void write_kv(const Tensor& k, const Tensor& v, const Tensor& slot_mapping, const Tensor& k_cache,
              const Tensor& v_cache);

namespace cpu {
// Kv: float (an f32 cache) or uint16_t (a bf16 cache's bits), the two it is built for.
template <typename Kv>
void write_kv(const float* k, const float* v, const int32_t* slot_mapping, Kv* k_cache, Kv* v_cache,
              int64_t n_tokens, int64_t n_kv_heads, int64_t head_dim, int64_t num_slots);
}  // namespace cpu

}  // namespace pagedlm::ops
