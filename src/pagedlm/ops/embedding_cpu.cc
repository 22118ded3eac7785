#include "pagedlm/ops/embedding.h"
#include "pagedlm/ops/gather_rows.h"
#include "pagedlm/ops/op_check.h"

namespace pagedlm::ops {

namespace cpu {

void embedding(const float* table, const int32_t* ids, float* out, int64_t n_tokens, int64_t vocab,
               int64_t dim, float scale) {
  // Checked up front, outside the parallel loop, so the error is thrown on the calling thread.
  for (int64_t t = 0; t < n_tokens; ++t) {
    PAGEDLM_CHECK(ids[t] >= 0 && ids[t] < vocab, "embedding: token id ", ids[t], " at position ", t,
                  " is outside the vocabulary [0, ", vocab, ")");
  }
  // An embedding lookup is a row gather from the table.
  gather_rows(table, ids, out, vocab, n_tokens, dim);
  // Scaled in a second pass over the rows (one read and write of [n_tokens, dim], small next to
  // any layer), which a scale of 1, every model's but Gemma's, skips.
  if (scale == 1.f) return;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n_tokens * dim; ++i) out[i] *= scale;
}

void embedding_shard(const float* table, const int32_t* ids, float* out, int64_t n_tokens,
                     int64_t vocab, int64_t dim, float scale, int64_t vocab_begin) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t row = int64_t{ids[t]} - vocab_begin;
    float* dst = out + t * dim;
    if (row < 0 || row >= vocab) {
      for (int64_t i = 0; i < dim; ++i) dst[i] = 0.f;
      continue;
    }
    const float* src = table + row * dim;
    for (int64_t i = 0; i < dim; ++i) dst[i] = src[i] * scale;
  }
}

}  // namespace cpu

void embedding(const Tensor& table, const Tensor& ids, const Tensor& out, void* stream, float scale,
               std::optional<int64_t> vocab_begin) {
  using detail::kAnyDim;
  constexpr const char* kOp = "embedding";
  const DType dt = detail::compute_dtype(table, kOp, "table");
  detail::expect(table, kOp, "table", dt, {kAnyDim, kAnyDim});
  detail::expect(ids, kOp, "ids", DType::kI32, {kAnyDim});
  const int64_t vocab = table.dim(0), dim = table.dim(1), n_tokens = ids.dim(0);
  detail::expect(out, kOp, "out", DType::kF32, {n_tokens, dim});
  detail::expect_device(ids, table.device(), kOp, "ids");
  detail::expect_device(out, table.device(), kOp, "out");
  PAGEDLM_CHECK(!vocab_begin || *vocab_begin >= 0, "embedding: vocab_begin must be >= 0, got ",
                vocab_begin.value_or(0));
  if (table.device() == Device::kCpu) {
    if (vocab_begin) {
      cpu::embedding_shard(table.data<float>(), ids.data<int32_t>(), out.data<float>(), n_tokens,
                           vocab, dim, scale, *vocab_begin);
      return;
    }
    cpu::embedding(table.data<float>(), ids.data<int32_t>(), out.data<float>(), n_tokens, vocab,
                   dim, scale);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::embedding(table.raw(), ids.data<int32_t>(), out.data<float>(), n_tokens, vocab, dim, scale,
                  dt, stream, vocab_begin.value_or(-1));
#else
  detail::fail_no_cuda(kOp);
#endif
}

namespace {

// out[t] = row ids[t] of a [vocab, dim] table kept in blocks, as `dequantize(row, dst)` gives it,
// times scale.
template <typename Dequantize>
void embed_block_rows(const char* op, int64_t vocab, int64_t dim, const Tensor& ids,
                      const Tensor& out, float scale, std::optional<int64_t> vocab_begin,
                      Dequantize dequantize) {
  detail::expect(ids, op, "ids", DType::kI32, {detail::kAnyDim});
  const int64_t n_tokens = ids.dim(0);
  detail::expect(out, op, "out", DType::kF32, {n_tokens, dim});
  PAGEDLM_CHECK(ids.device() == Device::kCpu && out.device() == Device::kCpu, op,
                ": a table in blocks is a CPU path");
  PAGEDLM_CHECK(!vocab_begin || *vocab_begin >= 0, "embedding: vocab_begin must be >= 0, got ",
                vocab_begin.value_or(0));
  const int32_t* id = ids.data<int32_t>();
  if (!vocab_begin) {
    for (int64_t t = 0; t < n_tokens; ++t) {
      PAGEDLM_CHECK(id[t] >= 0 && id[t] < vocab, "embedding: token id ", id[t], " at position ", t,
                    " is outside the vocabulary [0, ", vocab, ")");
    }
  }
  const int64_t begin = vocab_begin.value_or(0);
  float* dst = out.data<float>();
#pragma omp parallel for schedule(static) if (n_tokens >= 16)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t row = int64_t{id[t]} - begin;
    float* o = dst + t * dim;
    if (row < 0 || row >= vocab) {
      for (int64_t i = 0; i < dim; ++i) o[i] = 0.f;
      continue;
    }
    dequantize(row, o);
    if (scale != 1.f) {
      for (int64_t i = 0; i < dim; ++i) o[i] *= scale;
    }
  }
}

}  // namespace

void embedding(const QuantizedMatrix& table, const Tensor& ids, const Tensor& out, float scale,
               std::optional<int64_t> vocab_begin) {
  embed_block_rows("embedding (table in blocks)", table.rows, table.cols, ids, out, scale,
                   vocab_begin, [&](int64_t row, float* o) { dequantize_row(table, row, o); });
}

void embedding(const Q8PackedMatrix& table, const Tensor& ids, const Tensor& out, float scale,
               std::optional<int64_t> vocab_begin) {
  embed_block_rows("embedding (table packed for 8-bit activations)", table.rows, table.cols, ids,
                   out, scale, vocab_begin,
                   [&](int64_t row, float* o) { dequantize_row(table, row, o); });
}

}  // namespace pagedlm::ops
