#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/paged_attention.h"

namespace pagedlm::ops {

namespace cpu {
namespace {

// Keys scored per online-softmax step; bounds the score buffer whatever the context length.
constexpr int64_t kKvTile = 32;

// Throws unless the CSR page table is consistent with the stream and the cache.
void validate_plan(const int32_t* q_indptr, const int32_t* kv_indptr,
                   const int32_t* kv_page_indices, const int32_t* kv_last_page_len,
                   const PagedAttentionDims& d) {
  constexpr const char* kOp = "paged_attention";
  PAGEDLM_CHECK(q_indptr[0] == 0 && kv_indptr[0] == 0, kOp,
                ": q_indptr[0] and kv_indptr[0] must be 0, got ", q_indptr[0], " and ",
                kv_indptr[0]);
  PAGEDLM_CHECK(q_indptr[d.num_seqs] == d.n_tokens, kOp, ": q_indptr[", d.num_seqs,
                "] = ", q_indptr[d.num_seqs], " but q has ", d.n_tokens, " tokens");
  PAGEDLM_CHECK(kv_indptr[d.num_seqs] <= d.num_page_indices, kOp, ": kv_indptr[", d.num_seqs,
                "] = ", kv_indptr[d.num_seqs], " exceeds the ", d.num_page_indices,
                " kv_page_indices");
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t n_new = q_indptr[b + 1] - q_indptr[b];
    const int64_t num_pages = kv_indptr[b + 1] - kv_indptr[b];
    PAGEDLM_CHECK(n_new >= 0 && num_pages >= 0, kOp, ": sequence ", b,
                  " has a decreasing q_indptr or kv_indptr");
    if (n_new == 0) continue;
    const int64_t last = kv_last_page_len[b];
    PAGEDLM_CHECK(num_pages >= 1 && last >= 1 && last <= d.page_size, kOp, ": sequence ", b,
                  " has ", num_pages, " pages and last page length ", last, " (page size ",
                  d.page_size, ")");
    const int64_t n_kv = (num_pages - 1) * d.page_size + last;
    PAGEDLM_CHECK(n_kv >= n_new, kOp, ": sequence ", b, " has ", n_new, " new tokens but only ",
                  n_kv, " kv positions");
    for (int64_t i = kv_indptr[b]; i < kv_indptr[b + 1]; ++i) {
      PAGEDLM_CHECK(kv_page_indices[i] >= 0 && kv_page_indices[i] < d.num_pages, kOp, ": sequence ",
                    b, " uses page ", kv_page_indices[i], ", outside [0, ", d.num_pages, ")");
    }
  }
}

// One (token, q head): out = softmax(scale * q K^T) V over kv positions [0, n_attend), one pass
// with a running max and sum (FlashAttention). The reduction order is fixed by the position
// order alone, so the row does not depend on what else is in the batch.
void attend_row(const float* q, const float* k_cache, const float* v_cache, const int32_t* pages,
                int64_t n_attend, int64_t kv_head, float scale, const PagedAttentionDims& d,
                float* acc, float* out) {
  const int64_t head_dim = d.head_dim;
  const int64_t slot_stride = d.n_kv_heads * head_dim;
  float running_max = -std::numeric_limits<float>::infinity();
  float running_sum = 0.f;
  std::fill(acc, acc + head_dim, 0.f);
  float scores[kKvTile];
  for (int64_t start = 0; start < n_attend; start += kKvTile) {
    const int64_t count = std::min(kKvTile, n_attend - start);
    float tile_max = running_max;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pos = start + j;
      const int64_t slot = pages[pos / d.page_size] * d.page_size + pos % d.page_size;
      const float* key = k_cache + slot * slot_stride + kv_head * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < head_dim; ++i) dot += q[i] * key[i];
      scores[j] = dot * scale;
      tile_max = std::max(tile_max, scores[j]);
    }
    // Rescale what was accumulated under the old maximum (exp(-inf) == 0 on the first tile).
    const float correction = std::exp(running_max - tile_max);
    running_sum *= correction;
    for (int64_t i = 0; i < head_dim; ++i) acc[i] *= correction;
    running_max = tile_max;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pos = start + j;
      const int64_t slot = pages[pos / d.page_size] * d.page_size + pos % d.page_size;
      const float* value = v_cache + slot * slot_stride + kv_head * head_dim;
      const float p = std::exp(scores[j] - running_max);
      running_sum += p;
#pragma omp simd
      for (int64_t i = 0; i < head_dim; ++i) acc[i] += p * value[i];
    }
  }
  const float inv_sum = 1.f / running_sum;
  for (int64_t i = 0; i < head_dim; ++i) out[i] = acc[i] * inv_sum;
}

}  // namespace

void paged_attention(const float* q, const float* k_cache, const float* v_cache,
                     const int32_t* q_indptr, const int32_t* kv_indptr,
                     const int32_t* kv_page_indices, const int32_t* kv_last_page_len, float scale,
                     float* out, const PagedAttentionDims& d) {
  validate_plan(q_indptr, kv_indptr, kv_page_indices, kv_last_page_len, d);
  std::vector<int32_t> seq_of_token(d.n_tokens);
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    std::fill(seq_of_token.begin() + q_indptr[b], seq_of_token.begin() + q_indptr[b + 1], b);
  }
  const int64_t group = d.n_q_heads / d.n_kv_heads;
  const int64_t work = d.n_tokens * d.n_q_heads;
#pragma omp parallel
  {
    std::vector<float> acc(d.head_dim);
    // Rows differ in length (decode vs long prefill), so hand them out dynamically.
#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t t = item / d.n_q_heads, h = item % d.n_q_heads;
      const int64_t b = seq_of_token[t];
      const int64_t n_new = q_indptr[b + 1] - q_indptr[b];
      const int64_t num_pages = kv_indptr[b + 1] - kv_indptr[b];
      const int64_t n_kv = (num_pages - 1) * d.page_size + kv_last_page_len[b];
      const int64_t n_attend = n_kv - n_new + (t - q_indptr[b]) + 1;
      const int64_t row = (t * d.n_q_heads + h) * d.head_dim;
      attend_row(q + row, k_cache, v_cache, kv_page_indices + kv_indptr[b], n_attend, h / group,
                 scale, d, acc.data(), out + row);
    }
  }
}

}  // namespace cpu

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& q_indptr, const Tensor& kv_indptr, const Tensor& kv_page_indices,
                     const Tensor& kv_last_page_len, float scale, const Tensor& out, void* stream) {
  using detail::kAnyDim;
  constexpr const char* kOp = "paged_attention";
  const DType dt = detail::compute_dtype(q, kOp, "q");
  detail::expect(q, kOp, "q", dt, {kAnyDim, kAnyDim, kAnyDim});
  PagedAttentionDims dims{};
  dims.n_tokens = q.dim(0);
  dims.n_q_heads = q.dim(1);
  dims.head_dim = q.dim(2);
  detail::expect(k_cache, kOp, "k_cache", dt, {kAnyDim, kAnyDim, kAnyDim, dims.head_dim});
  dims.num_pages = k_cache.dim(0);
  dims.page_size = k_cache.dim(1);
  dims.n_kv_heads = k_cache.dim(2);
  PAGEDLM_CHECK(dims.page_size > 0 && dims.n_kv_heads > 0 && dims.n_q_heads % dims.n_kv_heads == 0,
                kOp, ": ", dims.n_q_heads, " q heads cannot share ", dims.n_kv_heads,
                " kv heads (page size ", dims.page_size, ")");
  detail::expect(v_cache, kOp, "v_cache", dt,
                 {dims.num_pages, dims.page_size, dims.n_kv_heads, dims.head_dim});
  detail::expect(q_indptr, kOp, "q_indptr", DType::kI32, {kAnyDim});
  PAGEDLM_CHECK(q_indptr.dim(0) >= 1, kOp, ": q_indptr is empty");
  dims.num_seqs = q_indptr.dim(0) - 1;
  detail::expect(kv_indptr, kOp, "kv_indptr", DType::kI32, {dims.num_seqs + 1});
  detail::expect(kv_page_indices, kOp, "kv_page_indices", DType::kI32, {kAnyDim});
  dims.num_page_indices = kv_page_indices.dim(0);
  detail::expect(kv_last_page_len, kOp, "kv_last_page_len", DType::kI32, {dims.num_seqs});
  detail::expect(out, kOp, "out", dt, {dims.n_tokens, dims.n_q_heads, dims.head_dim});
  detail::expect_devices(kOp, q.device(),
                         {{&k_cache, "k_cache"},
                          {&v_cache, "v_cache"},
                          {&q_indptr, "q_indptr"},
                          {&kv_indptr, "kv_indptr"},
                          {&kv_page_indices, "kv_page_indices"},
                          {&kv_last_page_len, "kv_last_page_len"},
                          {&out, "out"}});
  if (q.device() == Device::kCpu) {
    cpu::paged_attention(q.data<float>(), k_cache.data<float>(), v_cache.data<float>(),
                         q_indptr.data<int32_t>(), kv_indptr.data<int32_t>(),
                         kv_page_indices.data<int32_t>(), kv_last_page_len.data<int32_t>(), scale,
                         out.data<float>(), dims);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::paged_attention(q.raw(), k_cache.raw(), v_cache.raw(), q_indptr.data<int32_t>(),
                        kv_indptr.data<int32_t>(), kv_page_indices.data<int32_t>(),
                        kv_last_page_len.data<int32_t>(), scale, out.raw(), dims, dt, stream);
#else
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
