#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "pagedlm/ops/exp_cpu.h"
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

// Work for one thread: rows (token, q head) of tokens [t0, t1) of sequence b and q heads
// [h0, h1) of kv head hk's group, all reading the same pages.
struct RowBlock {
  int64_t b, hk, t0, t1, h0, h1;
};

// Tokens of one prefill block: its rows share each tile of keys and values while it is in cache
// (a 1k-token prompt otherwise re-reads every key once per query row).
constexpr int64_t kPrefillTokenBlock = 16;

// Blocks with at least this many rows score a key tile from a transposed copy of its keys
// (tile_scores): the copy costs about as much as scoring one row the plain way.
constexpr int64_t kTransposedMinRows = 8;

// Per-row online-softmax state of a block, reused across blocks by one thread.
struct RowScratch {
  std::vector<float> acc, running_max, running_sum, scores;
  std::vector<float> keys_t;  // [head_dim][kKvTile]: the tile's keys transposed
  std::vector<int64_t> n_attend;
  void resize(int64_t rows, int64_t head_dim) {
    acc.assign(rows * head_dim, 0.f);
    running_max.assign(rows, -std::numeric_limits<float>::infinity());
    running_sum.assign(rows, 0.f);
    scores.resize(rows * kKvTile);
    keys_t.resize(head_dim * kKvTile);
    n_attend.resize(rows);
  }
};

// 16 floats in one vector register (GCC/Clang vector extension, whatever the ISA), for head
// sizes that are multiples of it.
constexpr int64_t kWidth = 16;
using Vec = float __attribute__((vector_size(kWidth * sizeof(float))));

// q . k: 16 lane sums (lane l over dims l, l + 16, ...), then the lanes added in order, as the
// vectorized reduction loop did; in registers rather than through a spill of the lanes.
float dot_product(const float* q, const float* k, int64_t head_dim) {
  if (head_dim % kWidth != 0) {
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < head_dim; ++i) dot += q[i] * k[i];
    return dot;
  }
  Vec part = {};
  for (int64_t i0 = 0; i0 < head_dim; i0 += kWidth) {
    Vec qv, kv;
    std::memcpy(&qv, q + i0, sizeof(qv));
    std::memcpy(&kv, k + i0, sizeof(kv));
    part += qv * kv;
  }
  float dot = 0.f;
  for (int64_t l = 0; l < kWidth; ++l) dot += part[l];
  return dot;
}

// scale * q . k_j for the tile's kKvTile keys, from their transposed copy (keys_t[i * kKvTile +
// j] = dim i of key j): each dim adds q[i] times a vector of the keys' values, so the scores
// build up in two registers without a horizontal sum per key.
void tile_scores(const float* q, const float* keys_t, int64_t head_dim, float scale,
                 float* scores) {
  static_assert(kKvTile == 2 * kWidth, "a tile's scores are two vectors");
  Vec lo = {}, hi = {};
  for (int64_t i = 0; i < head_dim; ++i) {
    Vec k_lo, k_hi;
    std::memcpy(&k_lo, keys_t + i * kKvTile, sizeof(k_lo));
    std::memcpy(&k_hi, keys_t + i * kKvTile + kWidth, sizeof(k_hi));
    lo += q[i] * k_lo;
    hi += q[i] * k_hi;
  }
  lo *= scale;
  hi *= scale;
  std::memcpy(scores, &lo, sizeof(lo));
  std::memcpy(scores + kWidth, &hi, sizeof(hi));
}

// acc[i] += p_j * v_j[i] over a tile's keys, j in order. Where the head size allows, 16 dims at a
// time in one register across the keys: the same additions in the same order as the plain loop,
// without a store and reload of acc per key, which bound the loop before.
void accumulate_values(float* acc, const float* p, const float* const* values, int64_t count,
                       int64_t head_dim) {
  if (head_dim % kWidth != 0) {
    for (int64_t j = 0; j < count; ++j) {
#pragma omp simd
      for (int64_t i = 0; i < head_dim; ++i) acc[i] += p[j] * values[j][i];
    }
    return;
  }
  for (int64_t i0 = 0; i0 < head_dim; i0 += kWidth) {
    Vec a;
    std::memcpy(&a, acc + i0, sizeof(a));
    for (int64_t j = 0; j < count; ++j) {
      Vec v;
      std::memcpy(&v, values[j] + i0, sizeof(v));
      a += p[j] * v;
    }
    std::memcpy(acc + i0, &a, sizeof(a));
  }
}

// Every row r of the block: out_r = softmax(scale * q_r K^T) V over kv positions
// [0, n_attend_r), one pass with a running max and sum (FlashAttention), tile by tile. A row's
// arithmetic is the same whatever block it is in (its tiles in position order, the same
// operations on each), so it depends on neither the batch nor the blocking.
void attend_block(const RowBlock& blk, const float* q, const float* k_cache, const float* v_cache,
                  const int32_t* q_indptr, const int32_t* kv_indptr, const int32_t* kv_page_indices,
                  const int32_t* kv_last_page_len, float scale, const PagedAttentionDims& d,
                  RowScratch& s, float* out) {
  const int64_t head_dim = d.head_dim, group = d.n_q_heads / d.n_kv_heads;
  const int64_t slot_stride = d.n_kv_heads * head_dim;
  const int32_t* pages = kv_page_indices + kv_indptr[blk.b];
  const int64_t n_new = q_indptr[blk.b + 1] - q_indptr[blk.b];
  const int64_t num_pages = kv_indptr[blk.b + 1] - kv_indptr[blk.b];
  const int64_t n_kv = (num_pages - 1) * d.page_size + kv_last_page_len[blk.b];
  const int64_t heads = blk.h1 - blk.h0, rows = (blk.t1 - blk.t0) * heads;
  s.resize(rows, head_dim);
  auto q_row = [&](int64_t r) {
    const int64_t t = blk.t0 + r / heads, h = blk.hk * group + blk.h0 + r % heads;
    return (t * d.n_q_heads + h) * head_dim;
  };
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    s.n_attend[r] = n_kv - n_new + (blk.t0 + r / heads - q_indptr[blk.b]) + 1;
    longest = std::max(longest, s.n_attend[r]);
  }
  auto slot_of = [&](int64_t pos) {
    return pages[pos / d.page_size] * d.page_size + pos % d.page_size;
  };
  const float* keys[kKvTile];
  const float* values[kKvTile];
  const bool transposed = rows >= kTransposedMinRows;
  float* keys_t = s.keys_t.data();
  for (int64_t start = 0; start < longest; start += kKvTile) {
    // The tile's key and value rows, looked up once for all rows of the block.
    const int64_t tile_keys = std::min(kKvTile, longest - start);
    for (int64_t j = 0; j < tile_keys; ++j) {
      const int64_t at = slot_of(start + j) * slot_stride + blk.hk * head_dim;
      keys[j] = k_cache + at;
      values[j] = v_cache + at;
    }
    if (transposed) {  // zeros past the tile's last key: scored, never used
      for (int64_t i = 0; i < head_dim; ++i) {
        for (int64_t j = 0; j < kKvTile; ++j) {
          keys_t[i * kKvTile + j] = j < tile_keys ? keys[j][i] : 0.f;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (s.n_attend[r] <= start) continue;
      const int64_t count = std::min(kKvTile, s.n_attend[r] - start);
      const float* qr = q + q_row(r);
      float* scores = s.scores.data() + r * kKvTile;
      float* acc = s.acc.data() + r * head_dim;
      float tile_max = s.running_max[r];
      if (transposed) {
        tile_scores(qr, keys_t, head_dim, scale, scores);
      } else {
        for (int64_t j = 0; j < count; ++j) scores[j] = dot_product(qr, keys[j], head_dim) * scale;
      }
      for (int64_t j = 0; j < count; ++j) tile_max = std::max(tile_max, scores[j]);
      // Rescale what was accumulated under the old maximum (exp(-inf) == 0 on the first tile).
      const float correction = exp_vectorizable(s.running_max[r] - tile_max);
      s.running_sum[r] *= correction;
      for (int64_t i = 0; i < head_dim; ++i) acc[i] *= correction;
      s.running_max[r] = tile_max;
      // The exponentials in a vector loop, then their sum in order.
      for (int64_t j = 0; j < count; ++j) scores[j] = exp_vectorizable(scores[j] - tile_max);
      for (int64_t j = 0; j < count; ++j) s.running_sum[r] += scores[j];
      accumulate_values(acc, scores, values, count, head_dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv_sum = 1.f / s.running_sum[r];
    float* dst = out + q_row(r);
    for (int64_t i = 0; i < head_dim; ++i) dst[i] = s.acc[r * head_dim + i] * inv_sum;
  }
}

}  // namespace

void paged_attention(const float* q, const float* k_cache, const float* v_cache,
                     const int32_t* q_indptr, const int32_t* kv_indptr,
                     const int32_t* kv_page_indices, const int32_t* kv_last_page_len, float scale,
                     float* out, const PagedAttentionDims& d) {
  validate_plan(q_indptr, kv_indptr, kv_page_indices, kv_last_page_len, d);
  const int64_t group = d.n_q_heads / d.n_kv_heads;
  // Decode-like sequences (a few new tokens) get a block per (token, q head), which spreads a
  // single sequence over the threads; prefill chunks a block per (16 tokens, kv head) with all
  // of its group's q heads, so a tile of keys serves up to 16 x group rows.
  std::vector<RowBlock> blocks;
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t t_begin = q_indptr[b], t_end = q_indptr[b + 1];
    const bool prefill = t_end - t_begin >= kPrefillTokenBlock;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += prefill ? kPrefillTokenBlock : 1) {
      const int64_t t1 = prefill ? std::min(t_end, t0 + kPrefillTokenBlock) : t0 + 1;
      for (int64_t hk = 0; hk < d.n_kv_heads; ++hk) {
        if (prefill) {
          blocks.push_back({b, hk, t0, t1, 0, group});
        } else {
          for (int64_t h = 0; h < group; ++h) blocks.push_back({b, hk, t0, t1, h, h + 1});
        }
      }
    }
  }
  const auto num_blocks = static_cast<int64_t>(blocks.size());
#pragma omp parallel
  {
    RowScratch scratch;
    // Blocks differ in length (decode vs long prefill), so hand them out dynamically.
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < num_blocks; ++i) {
      attend_block(blocks[i], q, k_cache, v_cache, q_indptr, kv_indptr, kv_page_indices,
                   kv_last_page_len, scale, d, scratch, out);
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
