// Token embedding lookup.
#pragma once

#include <cstdint>
#include <optional>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/linear.h"

namespace pagedlm::ops {

// table: [vocab, dim] (compute dtype), ids: [n_tokens] i32 (same device), out: [n_tokens, dim]
// f32 on every device: the embedding starts the residual stream, which is kept in f32.
// out[t] = table[ids[t]] * scale, the product in f32 (Gemma scales its embeddings by
// sqrt(hidden_size)). Throws an Error naming the first id outside [0, vocab) (checked on the CPU
// only).
// With `vocab_begin` the table is one tensor-parallel rank's share of the vocabulary, rows
// [vocab_begin, vocab_begin + vocab): an id outside them gives a zero row (another rank holds
// it; the ranks' outputs are then summed) and ids are not checked.
void embedding(const Tensor& table, const Tensor& ids, const Tensor& out, void* stream = nullptr,
               float scale = 1.f, std::optional<int64_t> vocab_begin = std::nullopt);

// The same from a table kept in blocks (CPU): each row looked up is its format's reference
// dequantization (core/quantized.h), so out is what the dequantized f32 table gives, without
// keeping [vocab, dim] floats.
void embedding(const QuantizedMatrix& table, const Tensor& ids, const Tensor& out,
               float scale = 1.f, std::optional<int64_t> vocab_begin = std::nullopt);
// The same from a table packed for 8-bit activations (a tied lm_head's, ops/linear.h): the rows
// are the same floats as those of the blocks it was packed from.
void embedding(const Q8PackedMatrix& table, const Tensor& ids, const Tensor& out, float scale = 1.f,
               std::optional<int64_t> vocab_begin = std::nullopt);

namespace cpu {
// table: [vocab, dim] f32, ids: [n_tokens], out: [n_tokens, dim] f32.
void embedding(const float* table, const int32_t* ids, float* out, int64_t n_tokens, int64_t vocab,
               int64_t dim, float scale);
// The same for rows [vocab_begin, vocab_begin + vocab) of the vocabulary: other ids give zeros.
void embedding_shard(const float* table, const int32_t* ids, float* out, int64_t n_tokens,
                     int64_t vocab, int64_t dim, float scale, int64_t vocab_begin);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as cpu::embedding (vocab_begin >= 0: cpu::embedding_shard's); table holds
// `dtype` elements. Ids were not checked.
void embedding(const void* table, const int32_t* ids, float* out, int64_t n_tokens, int64_t vocab,
               int64_t dim, float scale, DType dtype, void* stream, int64_t vocab_begin = -1);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
