#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/parallel.h"
#include "pagedlm/ops/exp_cpu.h"
#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/paged_attention.h"
#include "pagedlm/ops/rope.h"
#include "pagedlm/ops/write_kv.h"

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

// Work for one thread: rows (kv head, token, q head) of kv heads [hk, hk1), tokens [t0, t1) of
// sequence b and q heads [h0, h1) of each kv head's group, all reading the same pages.
struct RowBlock {
  int64_t b, hk, hk1, t0, t1, h0, h1;
  bool prefill;  // the sequence has kPrefillMinTokens new tokens or more
};

// Blocks per thread (with more than one thread) below which decode-like rows of one kv head are
// split over several blocks, and above which a block takes several kv heads.
constexpr int64_t kBlocksPerThread = 2;

// Sequences with at least this many new tokens are prefill: their rows go in blocks of
// kPrefillTokenBlock tokens, which share each tile of keys and values while it is in cache (a
// 1k-token prompt otherwise re-reads every key once per query row), and its transpose. 32
// tokens read each tile half as often as 16 (0.89x the time of a 4000-token prompt's
// attention on a 2-core x86-64 VM) and keep a block's scratch (96 rows for SmolLM2) in L2.
constexpr int64_t kPrefillMinTokens = 16;
constexpr int64_t kPrefillTokenBlock = 32;

// Prefill blocks with at least this many rows score a key tile from a transposed copy of its
// keys (tile_scores): the copy costs about as much as scoring one row the plain way. Decode
// blocks, a few rows each, score key by key; both ways give the same bits.
constexpr int64_t kTransposedMinRows = 8;

// Per-row online-softmax state of a block, reused across blocks by one thread.
struct RowScratch {
  std::vector<float> acc, running_max, running_sum, scores;
  std::vector<float> keys_t;                 // [head_dim][kKvTile]: the tile's keys transposed
  std::vector<int64_t> first_key, end_key;   // the row's kv positions [first_key, end_key)
  std::vector<const float*> q;               // the row's query
  std::vector<float*> score_rows, acc_rows;  // the row's part of scores and acc
  void resize(int64_t rows, int64_t head_dim) {
    acc.assign(rows * head_dim, 0.f);
    running_max.assign(rows, -std::numeric_limits<float>::infinity());
    running_sum.assign(rows, 0.f);
    scores.resize(rows * kKvTile);
    keys_t.resize(head_dim * kKvTile);
    first_key.resize(rows);
    end_key.resize(rows);
    q.resize(rows);
    score_rows.resize(rows);
    acc_rows.resize(rows);
  }
};

// 16 floats in one vector register (GCC/Clang vector extension, whatever the ISA), for head
// sizes that are multiples of it.
constexpr int64_t kWidth = 16;
using Vec = float __attribute__((vector_size(kWidth * sizeof(float))));

// AVX2 with FMA but without AVX-512 (16 registers of 8 floats) has kernels of its own, chosen
// at compile time like the AVX-512 ones; they add the same lanes in the same order.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PAGEDLM_ATTENTION_AVX2 1
#endif

// Rows that score a transposed key tile together (each key vector loaded once for all of them)
// and rows that add a full tile's values together (each value vector loaded once for all of
// them): as many as leave the accumulators in registers (32 AVX-512 registers hold one Vec
// each, 16 AVX2 registers half of one).
#if defined(__AVX512F__)
constexpr int64_t kScoreRows = 6;  // 4 accumulators a row (2 lane sums, 2 scores)
constexpr int64_t kValueRows = 4;  // 4 rows x kValueVecs accumulators
#elif defined(PAGEDLM_ATTENTION_AVX2)
// tile_scores scores 8 keys at a time: 2 registers a row (a lane sum and the scores), one for
// the key vector and one for the broadcast query element. A row's kValueVecs accumulators take
// 8 registers, so values go a row at a time.
constexpr int64_t kScoreRows = 6;
constexpr int64_t kValueRows = 1;
#else
constexpr int64_t kScoreRows = 1;
constexpr int64_t kValueRows = 1;
#endif
// Value vectors (of kWidth dims) a row accumulates per pass over a tile's keys.
constexpr int64_t kValueVecs = 4;

#if defined(__AVX512F__)
// m[r][c] = m[c][r] for a 16 x 16 block: at each level b (8, 4, 2, 1), rows r and r + b swap
// their off-diagonal halves, which exchanges bit b of the row and of the column index.
template <int B>
[[gnu::always_inline]] inline void transpose_level(__m512* m) {
  // Lanes c with bit B clear keep row r's lane c; lanes with it set take row r + B's lane c - B
  // (indices 16.. name the second operand); row r + B gets the mirror image.
  alignas(64) int32_t lo_idx[kWidth], hi_idx[kWidth];
  for (int c = 0; c < kWidth; ++c) {
    lo_idx[c] = (c & B) != 0 ? kWidth + c - B : c;
    hi_idx[c] = (c & B) != 0 ? kWidth + c : c + B;
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int r = 0; r < kWidth; ++r) {
    if ((r & B) != 0) continue;
    const __m512 a = m[r], b = m[r + B];
    m[r] = _mm512_permutex2var_ps(a, lo, b);
    m[r + B] = _mm512_permutex2var_ps(a, hi, b);
  }
}

[[gnu::always_inline]] inline void transpose16(__m512* m) {
  transpose_level<8>(m);
  transpose_level<4>(m);
  transpose_level<2>(m);
  transpose_level<1>(m);
}
#elif defined(PAGEDLM_ATTENTION_AVX2)
// Floats in one AVX2 register; a Vec is two of them (lanes 0-7 and 8-15).
constexpr int64_t kHalf = 8;

// m[r][c] = m[c][r] for an 8 x 8 block: pairs of rows interleave (2 x 2 blocks), pairs of
// those swap 2 x 2 blocks (4 x 4), then the 128-bit halves of rows r and r + 4 swap.
[[gnu::always_inline]] inline void transpose8(__m256* m) {
  __m256 t[kHalf];
  for (int r = 0; r < kHalf; r += 2) {
    t[r] = _mm256_unpacklo_ps(m[r], m[r + 1]);
    t[r + 1] = _mm256_unpackhi_ps(m[r], m[r + 1]);
  }
  __m256 u[kHalf];
  for (int r = 0; r < kHalf; r += 4) {
    u[r] = _mm256_shuffle_ps(t[r], t[r + 2], 0x44);
    u[r + 1] = _mm256_shuffle_ps(t[r], t[r + 2], 0xEE);
    u[r + 2] = _mm256_shuffle_ps(t[r + 1], t[r + 3], 0x44);
    u[r + 3] = _mm256_shuffle_ps(t[r + 1], t[r + 3], 0xEE);
  }
  for (int r = 0; r < 4; ++r) {
    m[r] = _mm256_permute2f128_ps(u[r], u[r + 4], 0x20);
    m[r + 4] = _mm256_permute2f128_ps(u[r], u[r + 4], 0x31);
  }
}
#endif

// A cache's elements as f32: an f32 cache's as they are, a bf16 cache's (uint16_t, the value's
// upper 16 bits) widened in registers where they are loaded, so that both run the same
// arithmetic on the stored values and a bf16 cache reads half the bytes.
[[gnu::always_inline]] inline float cache_value(float x) { return x; }
[[gnu::always_inline]] inline float cache_value(uint16_t bits) { return bf16_to_f32(bits); }

#if defined(__AVX512F__)
// 16 elements from p.
[[gnu::always_inline]] inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
[[gnu::always_inline]] inline __m512 load16(const uint16_t* p) {
  // The zero-masking forms with every lane kept (GCC 12 warns of the plain ones' undefined
  // start, as in whole_tile_max).
  constexpr __mmask16 kAll = 0xFFFF;
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, bits), 16));
}
#elif defined(PAGEDLM_ATTENTION_AVX2)
// 8 elements from p.
[[gnu::always_inline]] inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
[[gnu::always_inline]] inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

// kWidth elements from p into v (out through a reference, as lane_sums below).
template <typename Kv>
[[gnu::always_inline]] inline void load_vec(const Kv* p, Vec& v) {
  if constexpr (std::is_same_v<Kv, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else {
#if defined(__AVX512F__)
    const __m512 w = load16(p);
    std::memcpy(&v, &w, sizeof(v));
#else
    for (int64_t l = 0; l < kWidth; ++l) v[l] = cache_value(p[l]);
#endif
  }
}

// Every score, whichever path computes it, is summed in one order, so that a row's bits do not
// depend on whether its chunk was scored key by key (decode) or from transposed keys (prefill),
// and so on how a prompt was split into chunks: lane l (l < 16) adds q[i] * k[i] over dims
// i = l, l + 16, ... in order from zero, then the 16 lanes are added in order from zero, then
// the sum is scaled.

// scale * q . k_j for the tile's first `count` keys, key by key, for head sizes of whole
// vectors (the others always score from transposed keys). With AVX-512, the lane sums of
// 16 keys are transposed so that their 16 in-order additions run as 16 vector additions instead
// of a chain of scalar ones per key.
template <typename Kv>
void dot_products(const float* q, const Kv* const* keys, int64_t count, int64_t head_dim,
                  float scale, float* scores) {
  // Out through a reference: a 64-byte vector returned by value changes the ABI without
  // AVX-512 (GCC's -Wpsabi).
  auto lane_sums = [&](const Kv* k, Vec& part) {
    part = Vec{};
    for (int64_t i0 = 0; i0 < head_dim; i0 += kWidth) {
      Vec qv, kv;
      std::memcpy(&qv, q + i0, sizeof(qv));
      load_vec(k + i0, kv);
      part += qv * kv;
    }
  };
  int64_t j0 = 0;
#if defined(__AVX512F__)
  for (; j0 < count; j0 += kWidth) {
    // lane_sums of the 16 keys side by side: each key's chain of additions is the same, and
    // the 16 chains overlap instead of each waiting on its own additions' latency. A last group
    // of fewer keys scores its first key again in the missing places and stores only its own.
    const int64_t n = std::min(kWidth, count - j0);
    const Kv* group[kWidth];
    for (int64_t j = 0; j < kWidth; ++j) group[j] = keys[j0 + (j < n ? j : 0)];
    Vec sums[kWidth] = {};
    for (int64_t i0 = 0; i0 < head_dim; i0 += kWidth) {
      Vec qv;
      std::memcpy(&qv, q + i0, sizeof(qv));
      for (int64_t j = 0; j < kWidth; ++j) {
        Vec kv;
        load_vec(group[j] + i0, kv);
        sums[j] += qv * kv;
      }
    }
    __m512 parts[kWidth];
    std::memcpy(parts, sums, sizeof(parts));
    transpose16(parts);  // parts[l] = lane l of the 16 keys
    __m512 dots = _mm512_setzero_ps();
    for (int64_t l = 0; l < kWidth; ++l) dots = _mm512_add_ps(dots, parts[l]);
    _mm512_mask_storeu_ps(scores + j0, static_cast<__mmask16>((1u << n) - 1),
                          _mm512_mul_ps(dots, _mm512_set1_ps(scale)));
  }
#elif defined(PAGEDLM_ATTENTION_AVX2)
  for (; j0 + kHalf <= count; j0 += kHalf) {
    // 8 keys side by side, as above, a half of the lanes at a time (8 keys' lanes of both
    // halves would take all 16 registers): each key's lanes 0-7, transposed and added in order,
    // then its lanes 8-15 onto those sums.
    __m256 dots = _mm256_setzero_ps();
    for (int64_t half = 0; half < kWidth; half += kHalf) {
      __m256 sums[kHalf];
      for (auto& sum : sums) sum = _mm256_setzero_ps();
      for (int64_t i0 = half; i0 < head_dim; i0 += kWidth) {
        const __m256 qv = _mm256_loadu_ps(q + i0);
        for (int64_t j = 0; j < kHalf; ++j) {
          sums[j] = _mm256_fmadd_ps(qv, load8(keys[j0 + j] + i0), sums[j]);
        }
      }
      transpose8(sums);  // sums[l] = lane half + l of the 8 keys
      for (const __m256 lane : sums) dots = _mm256_add_ps(dots, lane);
    }
    _mm256_storeu_ps(scores + j0, _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
  }
#endif
  for (int64_t j = j0; j < count; ++j) {
    Vec part;
    lane_sums(keys[j], part);
    float dot = 0.f;
    for (int64_t l = 0; l < kWidth; ++l) dot += part[l];
    scores[j] = dot * scale;
  }
}

// keys_t[i * kKvTile + j] = dim i of key j, zeros past the tile's `count` keys (scored, never
// used).
template <typename Kv>
void transpose_tile(const Kv* const* keys, int64_t count, int64_t head_dim, float* keys_t) {
#if defined(__AVX512F__)
  if (head_dim % kWidth == 0) {
    static_assert(kKvTile % kWidth == 0, "a tile is whole 16 x 16 blocks");
    for (int64_t jb = 0; jb < kKvTile; jb += kWidth) {
      for (int64_t ib = 0; ib < head_dim; ib += kWidth) {
        __m512 m[kWidth];
        for (int64_t j = 0; j < kWidth; ++j) {
          m[j] = jb + j < count ? load16(keys[jb + j] + ib) : _mm512_setzero_ps();
        }
        transpose16(m);
        for (int64_t i = 0; i < kWidth; ++i)
          _mm512_storeu_ps(keys_t + (ib + i) * kKvTile + jb, m[i]);
      }
    }
    return;
  }
#elif defined(PAGEDLM_ATTENTION_AVX2)
  if (head_dim % kHalf == 0) {
    static_assert(kKvTile % kHalf == 0, "a tile is whole 8 x 8 blocks");
    for (int64_t jb = 0; jb < kKvTile; jb += kHalf) {
      for (int64_t ib = 0; ib < head_dim; ib += kHalf) {
        __m256 m[kHalf];
        for (int64_t j = 0; j < kHalf; ++j) {
          m[j] = jb + j < count ? load8(keys[jb + j] + ib) : _mm256_setzero_ps();
        }
        transpose8(m);
        for (int64_t i = 0; i < kHalf; ++i)
          _mm256_storeu_ps(keys_t + (ib + i) * kKvTile + jb, m[i]);
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < head_dim; ++i) {
    for (int64_t j = 0; j < kKvTile; ++j) {
      keys_t[i * kKvTile + j] = j < count ? cache_value(keys[j][i]) : 0.f;
    }
  }
}

// scale * q_r . k_j for R rows and the tile's kKvTile keys, from their transposed copy: a key's
// lane sum l adds q_r[i] times a vector of the keys' dim i, so a row's 32 scores build up in
// registers without a horizontal sum per key, in the order above, and each key vector loaded
// serves all R rows. A row's arithmetic is the same whatever R.
template <int64_t R>
void tile_scores(const float* const* q, const float* keys_t, int64_t head_dim, float scale,
                 float* const* scores) {
#if defined(PAGEDLM_ATTENTION_AVX2)
  // 8 keys at a time, the tile's 4 groups one after another: each key's lanes take the same
  // additions in the same order as below, with 2 registers a row instead of 8.
  for (int64_t jb = 0; jb < kKvTile; jb += kHalf) {
    __m256 sum[R];
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
    for (int64_t l = 0; l < kWidth; ++l) {
      __m256 part[R];
#pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
      for (int64_t i = l; i < head_dim; i += kWidth) {
        const __m256 k = _mm256_loadu_ps(keys_t + i * kKvTile + jb);
#pragma GCC unroll 16
        for (int64_t r = 0; r < R; ++r) {
          part[r] = _mm256_fmadd_ps(_mm256_set1_ps(q[r][i]), k, part[r]);
        }
      }
#pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) sum[r] = _mm256_add_ps(sum[r], part[r]);
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      _mm256_storeu_ps(scores[r] + jb, _mm256_mul_ps(sum[r], _mm256_set1_ps(scale)));
    }
  }
#else
  static_assert(kKvTile == 2 * kWidth, "a tile's scores are two vectors");
  Vec lo[R] = {}, hi[R] = {};
  for (int64_t l = 0; l < kWidth; ++l) {
    Vec part_lo[R] = {}, part_hi[R] = {};
    for (int64_t i = l; i < head_dim; i += kWidth) {
      Vec k_lo, k_hi;
      std::memcpy(&k_lo, keys_t + i * kKvTile, sizeof(k_lo));
      std::memcpy(&k_hi, keys_t + i * kKvTile + kWidth, sizeof(k_hi));
#pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) {
        part_lo[r] += q[r][i] * k_lo;
        part_hi[r] += q[r][i] * k_hi;
      }
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      lo[r] += part_lo[r];
      hi[r] += part_hi[r];
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    lo[r] *= scale;
    hi[r] *= scale;
    std::memcpy(scores[r], &lo[r], sizeof(lo[r]));
    std::memcpy(scores[r] + kWidth, &hi[r], sizeof(hi[r]));
  }
#endif
}

// The largest of running and a whole tile's scores, as the single-row path's in-order std::max
// chain gives it: a NaN score is skipped as std::max(m, NaN) skips it (the running maximum is
// never NaN), and the lanes may be combined in any order, since maxima of one set differ at
// most in the sign of a zero, which the exponentials of differences taken from them do not
// tell apart (exp(+0) = exp(-0) = 1, x - (+0) = x - (-0) otherwise).
float whole_tile_max(float running, const float* scores) {
#if defined(__AVX512F__)
  static_assert(kKvTile == 2 * kWidth, "a tile's scores are two vectors");
  // The zero-masking forms with every lane kept: the plain ones start from
  // _mm512_undefined_ps, which GCC 12 warns about (maybe-uninitialized).
  constexpr __mmask16 kAll = 0xFFFF;
  __m512 m = _mm512_set1_ps(running);
  // A NaN in the first operand gives the second.
  m = _mm512_maskz_max_ps(kAll, _mm512_loadu_ps(scores), m);
  m = _mm512_maskz_max_ps(kAll, _mm512_loadu_ps(scores + kWidth), m);
  // Halves, quarters, pairs, then neighbours.
  m = _mm512_maskz_max_ps(kAll, m, _mm512_maskz_shuffle_f32x4(kAll, m, m, 0x4E));
  m = _mm512_maskz_max_ps(kAll, m, _mm512_maskz_shuffle_f32x4(kAll, m, m, 0xB1));
  m = _mm512_maskz_max_ps(kAll, m, _mm512_maskz_permute_ps(kAll, m, 0x4E));
  m = _mm512_maskz_max_ps(kAll, m, _mm512_maskz_permute_ps(kAll, m, 0xB1));
  return _mm512_cvtss_f32(m);
#elif defined(PAGEDLM_ATTENTION_AVX2)
  static_assert(kKvTile == 4 * kHalf, "a tile's scores are four vectors");
  __m256 m = _mm256_set1_ps(running);
  // A NaN in the first operand gives the second.
  for (int64_t j = 0; j < kKvTile; j += kHalf) m = _mm256_max_ps(_mm256_loadu_ps(scores + j), m);
  // Halves, pairs, then neighbours.
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 0x01));
  m = _mm256_max_ps(m, _mm256_permute_ps(m, 0x4E));
  m = _mm256_max_ps(m, _mm256_permute_ps(m, 0xB1));
  return _mm256_cvtss_f32(m);
#else
  for (int64_t j = 0; j < kKvTile; ++j) running = std::max(running, scores[j]);
  return running;
#endif
}

// A row's running sum and accumulator times the tile's correction, each product rounded on its
// own and stored, in a function of its own for both the single and the grouped rows. Inline, GCC
// fuses a product with an addition that follows it into one fma wherever the product has no
// other use (-ffp-contract=fast, GNU C++'s default), so the two paths rounded differently
// (the grouped rows' rescaled sum fused with the first exponential, the single row's did not).
[[gnu::noinline]] void rescale_row(float correction, float* running_sum, float* acc,
                                   int64_t head_dim) {
  *running_sum *= correction;
  for (int64_t i = 0; i < head_dim; ++i) acc[i] *= correction;
}

#if defined(PAGEDLM_ATTENTION_AVX2)
// acc[i] += p_j * v_j[i0 + i] for i < 8 C, over `count` keys in order, in C registers.
template <int64_t C, typename Kv>
[[gnu::always_inline]] inline void accumulate_values_avx2(float* acc, const float* p,
                                                          const Kv* const* values, int64_t count,
                                                          int64_t i0) {
  __m256 a[C];
#pragma GCC unroll 16
  for (int64_t c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(acc + c * kHalf);
  for (int64_t j = 0; j < count; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 16
    for (int64_t c = 0; c < C; ++c) {
      a[c] = _mm256_fmadd_ps(pj, load8(values[j] + i0 + c * kHalf), a[c]);
    }
  }
#pragma GCC unroll 16
  for (int64_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + c * kHalf, a[c]);
}
#endif

// acc[i] += p_j * v_j[i] over a tile's keys, j in order. Where the head size allows, 16 dims at a
// time in one register across the keys: the same additions in the same order as the plain loop,
// without a store and reload of acc per key, which bound the loop before.
template <typename Kv>
void accumulate_values(float* acc, const float* p, const Kv* const* values, int64_t count,
                       int64_t head_dim) {
#if defined(PAGEDLM_ATTENTION_AVX2)
  // GCC spills a Vec's two halves to memory between the keys: registers of 8 dims instead, 8 of
  // them at a time (kValueVecs Vecs), then one at a time.
  if (head_dim % kWidth == 0) {
    int64_t i0 = 0;
    for (; i0 + 2 * kValueVecs * kHalf <= head_dim; i0 += 2 * kValueVecs * kHalf) {
      accumulate_values_avx2<2 * kValueVecs>(acc + i0, p, values, count, i0);
    }
    for (; i0 < head_dim; i0 += kHalf) accumulate_values_avx2<1>(acc + i0, p, values, count, i0);
    return;
  }
#endif
  if (head_dim % kWidth != 0) {
    for (int64_t j = 0; j < count; ++j) {
#pragma omp simd
      for (int64_t i = 0; i < head_dim; ++i) acc[i] += p[j] * cache_value(values[j][i]);
    }
    return;
  }
  // kValueVecs vectors of dims at a time, so that their chains over the keys overlap.
  int64_t i0 = 0;
  for (; i0 + kValueVecs * kWidth <= head_dim; i0 += kValueVecs * kWidth) {
    Vec a[kValueVecs];
    std::memcpy(a, acc + i0, sizeof(a));
    for (int64_t j = 0; j < count; ++j) {
      for (int64_t c = 0; c < kValueVecs; ++c) {
        Vec v;
        load_vec(values[j] + i0 + c * kWidth, v);
        a[c] += p[j] * v;
      }
    }
    std::memcpy(acc + i0, a, sizeof(a));
  }
  for (; i0 < head_dim; i0 += kWidth) {
    Vec a;
    std::memcpy(&a, acc + i0, sizeof(a));
    for (int64_t j = 0; j < count; ++j) {
      Vec v;
      load_vec(values[j] + i0, v);
      a += p[j] * v;
    }
    std::memcpy(acc + i0, &a, sizeof(a));
  }
}

// accumulate_values for R rows over the same `count` keys, dims [i0, i0 + V kWidth): each value
// vector loaded serves all R rows, and a row's additions are the same, in the same order.
template <int64_t R, int64_t V, typename Kv>
void accumulate_values_rows(float* const* acc, const float* const* p, const Kv* const* values,
                            int64_t count, int64_t i0) {
#if defined(PAGEDLM_ATTENTION_AVX2)
  static_assert(R == 1, "AVX2 holds one row's accumulators");
  accumulate_values_avx2<2 * V>(acc[0] + i0, p[0], values, count, i0);
#else
  Vec a[R][V];
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int64_t c = 0; c < V; ++c) std::memcpy(&a[r][c], acc[r] + i0 + c * kWidth, sizeof(Vec));
  }
  for (int64_t j = 0; j < count; ++j) {
    Vec v[V];
#pragma GCC unroll 16
    for (int64_t c = 0; c < V; ++c) load_vec(values[j] + i0 + c * kWidth, v[c]);
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 16
      for (int64_t c = 0; c < V; ++c) a[r][c] += p[r][j] * v[c];
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int64_t c = 0; c < V; ++c) std::memcpy(acc[r] + i0 + c * kWidth, &a[r][c], sizeof(Vec));
  }
#endif
}

// GCC vectorizes the softmax's loops (exp above all) 8 lanes wide by default even with AVX-512;
// 16 lanes halve their instructions. The lanes' arithmetic is the same at either width.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDLM_WIDE_VECTORS __attribute__((target("prefer-vector-width=512")))
#else
#define PAGEDLM_WIDE_VECTORS
#endif

// The softmax's exponentials. With AVX2 every one of them (the corrections too) goes through
// exp_avx2, whose bits may differ from exp_vectorizable's (GCC leaves that one scalar there, see
// exp_cpu.h), so that a score's exponential does not depend on which loop takes it.
[[gnu::always_inline]] inline float softmax_exp(float x) {
#if defined(PAGEDLM_ATTENTION_AVX2)
  return _mm256_cvtss_f32(exp_avx2(_mm256_set1_ps(x)));
#else
  return exp_vectorizable(x);
#endif
}

// scores[j] = exp(scores[j] - max) for j in [j0, j1), j1 <= kKvTile.
[[gnu::always_inline]] inline void softmax_exps(float* scores, int64_t j0, int64_t j1, float max) {
#if defined(PAGEDLM_ATTENTION_AVX2)
  // Whole vectors of the row's kKvTile scores, storing only the lanes in [j0, j1) (the others,
  // left from earlier tiles, are read and dropped).
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 m = _mm256_set1_ps(max);
  for (int64_t jb = j0 / kHalf * kHalf; jb < j1; jb += kHalf) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + jb), m));
    if (jb >= j0 && jb + kHalf <= j1) {
      _mm256_storeu_ps(scores + jb, e);
      continue;
    }
    const __m256i at = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(jb)));
    const __m256i keep =
        _mm256_and_si256(_mm256_cmpgt_epi32(at, _mm256_set1_epi32(static_cast<int32_t>(j0 - 1))),
                         _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(j1)), at));
    _mm256_maskstore_ps(scores + jb, keep, e);
  }
#else
  for (int64_t j = j0; j < j1; ++j) scores[j] = exp_vectorizable(scores[j] - max);
#endif
}

// Asks for the cache lines of kv heads [hk, hk1)'s keys and values at kv positions [from, to) of
// a sequence (its pages `pages`), into L2: several kv heads' rows of a slot lie side by side, so
// a block of all of them reads whole slots. Out of cache, a decode step's attention at SmolLM2's
// shape (one sequence, 124 keys, `cpu_attention_bench` BM_DecodeOneCold) took 20.0 us with
// this and whole-slot blocks, 26.7 us without (AVX-512 AMD EPYC, 2026-12-05).
// Inline: out of line, GCC 12 takes a function of prefetches alone for one without side effects
// and drops the call.
template <typename Kv>
[[gnu::always_inline]] inline void prefetch_slots(const Kv* k_cache, const Kv* v_cache,
                                                  const int32_t* pages, int64_t hk, int64_t hk1,
                                                  int64_t from, int64_t to,
                                                  const PagedAttentionDims& d) {
  constexpr int64_t kLineElements = 64 / sizeof(Kv);
  const int64_t span = (hk1 - hk) * d.head_dim;
  for (int64_t pos = from; pos < to; ++pos) {
    const int64_t slot = pages[pos / d.page_size] * d.page_size + pos % d.page_size;
    const int64_t at = (slot * d.n_kv_heads + hk) * d.head_dim;
    for (int64_t i = 0; i < span; i += kLineElements) {
      __builtin_prefetch(k_cache + at + i, 0, 2);
      __builtin_prefetch(v_cache + at + i, 0, 2);
    }
  }
}

// Rows [r, r + R) of a block, all scored over keys [j0, j1) of the tile: the online softmax's
// step (the new maximum, the correction of what was accumulated under the old one, the
// exponentials and their sum in key order) and the values weighted by them. R rows go side by
// side, each value vector loaded once for all of them; a row's operations are the same whatever
// R (the single row's in its own loops, as accumulate_values_rows promises).
template <int64_t R, typename Kv>
PAGEDLM_WIDE_VECTORS void take_tile(RowScratch& s, int64_t r, int64_t j0, int64_t j1,
                                    const Kv* const* values, int64_t head_dim) {
  float tile_max[R], correction[R], sum[R];
  for (int64_t i = 0; i < R; ++i) {
    const float* scores = s.score_rows[r + i];
    if (R > 1 && j0 == 0 && j1 == kKvTile) {
      tile_max[i] = whole_tile_max(s.running_max[r + i], scores);
    } else {
      tile_max[i] = s.running_max[r + i];
      for (int64_t j = j0; j < j1; ++j) tile_max[i] = std::max(tile_max[i], scores[j]);
    }
  }
  // Rescale what was accumulated under the old maximum (exp(-inf) == 0 on the first tile); the
  // rows' corrections in one vector.
  for (int64_t i = 0; i < R; ++i) correction[i] = softmax_exp(s.running_max[r + i] - tile_max[i]);
  for (int64_t i = 0; i < R; ++i) {
    rescale_row(correction[i], &s.running_sum[r + i], s.acc_rows[r + i], head_dim);
    sum[i] = s.running_sum[r + i];
    s.running_max[r + i] = tile_max[i];
    softmax_exps(s.score_rows[r + i], j0, j1, tile_max[i]);
  }
  // Each row's sum in order, the rows' chains side by side.
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t i = 0; i < R; ++i) sum[i] += s.score_rows[r + i][j];
  }
  for (int64_t i = 0; i < R; ++i) s.running_sum[r + i] = sum[i];
  if constexpr (R == 1) {
    accumulate_values(s.acc_rows[r], s.score_rows[r] + j0, values + j0, j1 - j0, head_dim);
  } else {
    const float* p[R];
    for (int64_t i = 0; i < R; ++i) p[i] = s.score_rows[r + i] + j0;
    for (int64_t i0 = 0; i0 < head_dim; i0 += kValueVecs * kWidth) {
      accumulate_values_rows<R, kValueVecs>(&s.acc_rows[r], p, values + j0, j1 - j0, i0);
    }
  }
}

// Every row r of the block: out_r = softmax(scores_r) V over kv positions
// [first_key_r, end_key_r), scores_r = softcap(scale * q_r K^T), in one pass with a running max
// and sum (FlashAttention), tile by tile. Tiles sit at multiples of kKvTile whatever the block,
// and a row skips the tiles outside its window and scores only its own keys of the others: so a
// windowed row costs about window keys, and a row's arithmetic is the same whatever block it is
// in (its tiles in position order, the same operations on each), so it depends on neither the
// batch nor the blocking. Rows are grouped only to share loads: kScoreRows rows score a
// transposed tile together, and up to kValueRows rows that see the same keys of a tile take its
// softmax and values together (take_tile); the rest go one by one, through the same operations.
template <typename Kv>
PAGEDLM_WIDE_VECTORS void attend_block(const RowBlock& blk, const float* q, const Kv* k_cache,
                                       const Kv* v_cache, const int32_t* q_indptr,
                                       const int32_t* kv_indptr, const int32_t* kv_page_indices,
                                       const int32_t* kv_last_page_len,
                                       const AttentionVariant& variant, const PagedAttentionDims& d,
                                       RowScratch& s, float* out) {
  const int64_t head_dim = d.head_dim, group = d.n_q_heads / d.n_kv_heads;
  const int64_t slot_stride = d.n_kv_heads * head_dim;
  const int32_t* pages = kv_page_indices + kv_indptr[blk.b];
  const int64_t n_new = q_indptr[blk.b + 1] - q_indptr[blk.b];
  const int64_t num_pages = kv_indptr[blk.b + 1] - kv_indptr[blk.b];
  const int64_t n_kv = (num_pages - 1) * d.page_size + kv_last_page_len[blk.b];
  const int64_t heads = blk.h1 - blk.h0, head_rows = (blk.t1 - blk.t0) * heads;
  const int64_t rows = (blk.hk1 - blk.hk) * head_rows;
  s.resize(rows, head_dim);
  auto q_row = [&](int64_t r) {
    const int64_t in_head = r % head_rows;
    const int64_t t = blk.t0 + in_head / heads;
    const int64_t h = (blk.hk + r / head_rows) * group + blk.h0 + in_head % heads;
    return (t * d.n_q_heads + h) * head_dim;
  };
  int64_t first = n_kv, longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = n_kv - n_new + (blk.t0 + r % head_rows / heads - q_indptr[blk.b]);
    s.end_key[r] = pos + 1;
    s.first_key[r] = variant.window > 0 ? std::max<int64_t>(0, pos - variant.window + 1) : 0;
    s.q[r] = q + q_row(r);
    s.score_rows[r] = s.scores.data() + r * kKvTile;
    s.acc_rows[r] = s.acc.data() + r * head_dim;
    first = std::min(first, s.first_key[r]);
    longest = std::max(longest, s.end_key[r]);
  }
  const Kv* keys[kKvTile];
  const Kv* values[kKvTile];
  // Head sizes of part vectors always score from transposed keys: a scalar loop in the
  // key-by-key order is not contracted into fmas the way the vector loop is (GCC 12), which
  // would round a chunk's scores differently from a prefill's.
  const bool transposed =
      (blk.prefill && head_rows >= kTransposedMinRows) || head_dim % kWidth != 0;
  const bool grouped_values = head_dim % (kValueVecs * kWidth) == 0;
  const float scale = variant.scale, softcap = variant.softcap;
  float* keys_t = s.keys_t.data();
  for (int64_t start = first / kKvTile * kKvTile; start < longest; start += kKvTile) {
    const int64_t tile_keys = std::min(kKvTile, longest - start);
    if (!blk.prefill) {
      // A decode step finds a layer's keys and values out of cache (every layer's weights
      // stream through it in between): the first tile asks for itself and the two after it,
      // every later one for the tile two ahead.
      const bool first_tile = start < first / kKvTile * kKvTile + kKvTile;
      prefetch_slots(k_cache, v_cache, pages, blk.hk, blk.hk1,
                     first_tile ? start : start + 2 * kKvTile,
                     std::min(longest, start + 3 * kKvTile), d);
    }
    // The block's kv heads one after another, each through the whole tile: together they read
    // the tile's slots whole, in address order.
    for (int64_t hk = blk.hk, r_begin = 0; hk < blk.hk1; ++hk, r_begin += head_rows) {
      const int64_t r_end = r_begin + head_rows;
      // The tile's key and value rows, looked up once for all rows of the kv head, a page at a
      // time: one division a page, not one a key.
      for (int64_t j = 0; j < tile_keys;) {
        const int64_t pos = start + j, in_page = pos % d.page_size;
        const int64_t run = std::min(d.page_size - in_page, tile_keys - j);
        int64_t at =
            ((pages[pos / d.page_size] * d.page_size + in_page) * d.n_kv_heads + hk) * head_dim;
        for (const int64_t end = j + run; j < end; ++j, at += slot_stride) {
          keys[j] = k_cache + at;
          values[j] = v_cache + at;
        }
      }
      // The row's keys of this tile: [j0, j1).
      auto key_range = [&](int64_t r) {
        return std::pair{std::max<int64_t>(0, s.first_key[r] - start),
                         std::min(kKvTile, s.end_key[r] - start)};
      };
      if (transposed) {
        transpose_tile(keys, tile_keys, head_dim, keys_t);
        int64_t r = r_begin;
        for (; r + kScoreRows <= r_end; r += kScoreRows) {
          tile_scores<kScoreRows>(&s.q[r], keys_t, head_dim, scale, &s.score_rows[r]);
        }
        for (; r < r_end; ++r) tile_scores<1>(&s.q[r], keys_t, head_dim, scale, &s.score_rows[r]);
      }
      for (int64_t r = r_begin; r < r_end; ++r) {
        const auto [j0, j1] = key_range(r);
        if (j0 >= j1) continue;
        float* scores = s.score_rows[r];
        if (!transposed) dot_products(s.q[r], keys + j0, j1 - j0, head_dim, scale, scores + j0);
        if (softcap > 0.f) {
          for (int64_t j = j0; j < j1; ++j) scores[j] = softcap * std::tanh(scores[j] / softcap);
        }
      }
      for (int64_t r = r_begin; r < r_end;) {
        // The rows after r that see the same keys of this tile (a decode token's q heads always
        // do) take its softmax and values with r, up to kValueRows of them.
        const auto keys_of_r = key_range(r);
        int64_t n = 1;
        while (grouped_values && n < kValueRows && r + n < r_end && key_range(r + n) == keys_of_r) {
          ++n;
        }
        const auto [j0, j1] = keys_of_r;
        if (j0 < j1) {
          switch (n) {
            case 1:
              take_tile<1>(s, r, j0, j1, values, head_dim);
              break;
#if !defined(PAGEDLM_ATTENTION_AVX2)
            case 2:
              take_tile<2>(s, r, j0, j1, values, head_dim);
              break;
            case 3:
              take_tile<3>(s, r, j0, j1, values, head_dim);
              break;
            default:
              take_tile<kValueRows>(s, r, j0, j1, values, head_dim);
              break;
#endif
          }
        }
        r += n;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv_sum = 1.f / s.running_sum[r];
    float* dst = out + q_row(r);
    for (int64_t i = 0; i < head_dim; ++i) dst[i] = s.acc[r * head_dim + i] * inv_sum;
  }
}

}  // namespace

template <typename Kv>
void paged_attention(const float* q, const Kv* k_cache, const Kv* v_cache, const int32_t* q_indptr,
                     const int32_t* kv_indptr, const int32_t* kv_page_indices,
                     const int32_t* kv_last_page_len, const AttentionVariant& variant, float* out,
                     const PagedAttentionDims& d) {
  validate_plan(q_indptr, kv_indptr, kv_page_indices, kv_last_page_len, d);
  const int64_t group = d.n_q_heads / d.n_kv_heads;
  // Prefill chunks a block per (32 tokens, kv head) with all of its group's q heads, so a tile
  // of keys serves up to 32 x group rows. Decode-like sequences (a few new tokens) get a block
  // per (token, kv head) too where there are blocks enough for the threads, so that the group
  // reads its keys and values from memory once, not once per q head; else per (token, some of
  // the group's q heads), which spreads a single sequence over the threads; and with blocks to
  // spare, per (token, several kv heads). A row's arithmetic is the same in any of them (only
  // prefill blocks score from transposed keys).
  int64_t decode_units = 0;
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t n_new = q_indptr[b + 1] - q_indptr[b];
    if (n_new < kPrefillMinTokens) decode_units += n_new * d.n_kv_heads;
  }
  // One thread wants a single block a token; more, kBlocksPerThread blocks each.
  const int64_t wanted_blocks = num_threads() == 1 ? 1 : kBlocksPerThread * num_threads();
  const int64_t decode_heads =
      decode_units >= wanted_blocks
          ? group
          : std::clamp<int64_t>(decode_units * group / wanted_blocks, 1, group);
  // Where there are blocks to spare, a decode token's block takes several kv heads, whose rows
  // of a slot lie side by side: prefetch_slots then asks for whole slots, in address order.
  const int64_t decode_kv_heads =
      std::clamp<int64_t>(decode_units / wanted_blocks, 1, d.n_kv_heads);
  struct Costed {
    RowBlock block;
    int64_t cost;  // rows x keys of the longest row, to hand out the longest blocks first
  };
  std::vector<Costed> costed;
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t t_begin = q_indptr[b], t_end = q_indptr[b + 1];
    if (t_end == t_begin) continue;
    const int64_t n_kv = (kv_indptr[b + 1] - kv_indptr[b] - 1) * d.page_size + kv_last_page_len[b];
    const bool prefill = t_end - t_begin >= kPrefillMinTokens;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += prefill ? kPrefillTokenBlock : 1) {
      const int64_t t1 = prefill ? std::min(t_end, t0 + kPrefillTokenBlock) : t0 + 1;
      int64_t keys = n_kv - (t_end - t1);
      if (variant.window > 0) keys = std::min<int64_t>(keys, variant.window + (t1 - t0));
      const int64_t heads = prefill ? group : decode_heads;
      const int64_t kv_heads = prefill ? 1 : decode_kv_heads;
      for (int64_t hk = 0; hk < d.n_kv_heads; hk += kv_heads) {
        const int64_t hk1 = std::min(d.n_kv_heads, hk + kv_heads);
        for (int64_t h0 = 0; h0 < group; h0 += heads) {
          const int64_t h1 = std::min(group, h0 + heads);
          costed.push_back(
              {{b, hk, hk1, t0, t1, h0, h1, prefill}, (hk1 - hk) * (t1 - t0) * (h1 - h0) * keys});
        }
      }
    }
  }
  std::stable_sort(costed.begin(), costed.end(),
                   [](const Costed& x, const Costed& y) { return x.cost > y.cost; });
  const auto num_blocks = static_cast<int64_t>(costed.size());
#pragma omp parallel
  {
    RowScratch scratch;
    // Blocks differ in length (decode vs long prefill), so hand them out dynamically, longest
    // first, so that no long one is left for the end.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_blocks; ++i) {
      attend_block(costed[i].block, q, k_cache, v_cache, q_indptr, kv_indptr, kv_page_indices,
                   kv_last_page_len, variant, d, scratch, out);
    }
  }
}

template void paged_attention(const float*, const float*, const float*, const int32_t*,
                              const int32_t*, const int32_t*, const int32_t*,
                              const AttentionVariant&, float*, const PagedAttentionDims&);
template void paged_attention(const float*, const uint16_t*, const uint16_t*, const int32_t*,
                              const int32_t*, const int32_t*, const int32_t*,
                              const AttentionVariant&, float*, const PagedAttentionDims&);

}  // namespace cpu

namespace {

// Checks the plan's index tensors against q and the cache (and their device); returns the sizes.
PagedAttentionDims plan_dims(const Tensor& q, const Tensor& k_cache, const AttentionPlan& plan,
                             const char* op) {
  using detail::kAnyDim;
  PagedAttentionDims dims{};
  dims.n_tokens = q.dim(0);
  dims.n_q_heads = q.dim(1);
  dims.head_dim = q.dim(2);
  dims.num_pages = k_cache.dim(0);
  dims.page_size = k_cache.dim(1);
  dims.n_kv_heads = k_cache.dim(2);
  detail::expect(plan.q_indptr, op, "q_indptr", DType::kI32, {kAnyDim});
  PAGEDLM_CHECK(plan.q_indptr.dim(0) >= 1, op, ": q_indptr is empty");
  dims.num_seqs = plan.q_indptr.dim(0) - 1;
  detail::expect(plan.kv_indptr, op, "kv_indptr", DType::kI32, {dims.num_seqs + 1});
  detail::expect(plan.kv_page_indices, op, "kv_page_indices", DType::kI32, {kAnyDim});
  dims.num_page_indices = plan.kv_page_indices.dim(0);
  detail::expect(plan.kv_last_page_len, op, "kv_last_page_len", DType::kI32, {dims.num_seqs});
  detail::expect_devices(op, q.device(),
                         {{&plan.q_indptr, "q_indptr"},
                          {&plan.kv_indptr, "kv_indptr"},
                          {&plan.kv_page_indices, "kv_page_indices"},
                          {&plan.kv_last_page_len, "kv_last_page_len"}});
  return dims;
}

// An e4m3 cache's scales: positive and finite.
void check_kv_scales(const KvCacheScales& scales, DType cache, const char* op) {
  if (cache != DType::kF8E4M3) return;
  PAGEDLM_CHECK(
      std::isfinite(scales.k) && scales.k > 0.f && std::isfinite(scales.v) && scales.v > 0.f, op,
      ": the e4m3 KV cache's scales must be positive and finite, got k_scale ", scales.k,
      " and v_scale ", scales.v);
}

}  // namespace

void check_kv_cache_dtype(DType cache, DType compute, Device device, std::string_view op) {
  if (cache == compute) return;
  if (cache == DType::kBF16 && compute == DType::kF32) {
    PAGEDLM_CHECK(device == Device::kCpu, op,
                  ": a bf16 KV cache under f32 compute is CPU only (the GPU computes in bf16)");
    return;
  }
  PAGEDLM_CHECK(cache == DType::kF8E4M3, op, ": a KV cache of ", dtype_name(cache),
                " cannot hold values computed in ", dtype_name(compute),
                " (it takes the compute dtype, f8_e4m3, or bf16 under f32 on the CPU)");
  PAGEDLM_CHECK(device == Device::kCuda, op,
                ": an f8_e4m3 KV cache is GPU only (the CPU's attention reads f32 and bf16 "
                "caches)");
  PAGEDLM_CHECK(compute == DType::kBF16, op, ": an f8_e4m3 KV cache takes bf16 compute, not ",
                dtype_name(compute));
}

void rope_write_kv(const Tensor& qkv, const Tensor& inv_freq, const AttentionPlan& plan,
                   const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, void* stream,
                   const KvCacheScales& scales) {
  using detail::kAnyDim;
  constexpr const char* kOp = "rope_write_kv";
  const DType dt = detail::compute_dtype(q, kOp, "q");
  detail::expect(q, kOp, "q", dt, {kAnyDim, kAnyDim, kAnyDim});
  const int64_t n_tokens = q.dim(0), n_q_heads = q.dim(1), head_dim = q.dim(2);
  const DType cache_dt = k_cache.dtype();
  check_kv_cache_dtype(cache_dt, dt, q.device(), kOp);
  check_kv_scales(scales, cache_dt, kOp);
  detail::expect(k_cache, kOp, "k_cache", cache_dt, {kAnyDim, kAnyDim, kAnyDim, head_dim});
  const int64_t n_kv_heads = k_cache.dim(2);
  detail::expect(v_cache, kOp, "v_cache", cache_dt,
                 {k_cache.dim(0), k_cache.dim(1), n_kv_heads, head_dim});
  const int64_t q_width = n_q_heads * head_dim, kv_width = n_kv_heads * head_dim;
  detail::expect(qkv, kOp, "qkv", dt, {n_tokens, q_width + 2 * kv_width});
  detail::expect_devices(kOp, q.device(),
                         {{&qkv, "qkv"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}});
  if (q.device() == Device::kCpu) {
    // The CPU ops take contiguous q, k and v: split the fused rows, then rope (which checks
    // positions and inv_freq) and the cache write (which checks slot_mapping).
    Tensor k = Tensor::empty(DType::kF32, {n_tokens, n_kv_heads, head_dim});
    Tensor v = Tensor::empty(DType::kF32, {n_tokens, n_kv_heads, head_dim});
    const float* src = qkv.data<float>();
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* row = src + t * (q_width + 2 * kv_width);
      std::memcpy(q.data<float>() + t * q_width, row, q_width * sizeof(float));
      std::memcpy(k.data<float>() + t * kv_width, row + q_width, kv_width * sizeof(float));
      std::memcpy(v.data<float>() + t * kv_width, row + q_width + kv_width,
                  kv_width * sizeof(float));
    }
    rope(q, k, plan.positions, inv_freq);
    write_kv(k, v, plan.slot_mapping, k_cache, v_cache);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  detail::expect(plan.positions, kOp, "positions", DType::kI32, {kAnyDim});
  detail::expect(plan.slot_mapping, kOp, "slot_mapping", DType::kI32, {kAnyDim});
  PAGEDLM_CHECK(plan.positions.dim(0) >= n_tokens && plan.slot_mapping.dim(0) >= n_tokens, kOp,
                ": the plan has ", plan.positions.dim(0), " positions and ",
                plan.slot_mapping.dim(0), " slots for ", n_tokens, " tokens");
  detail::expect(inv_freq, kOp, "inv_freq", DType::kF32, {head_dim / 2});
  detail::expect_devices(kOp, q.device(),
                         {{&plan.positions, "positions"},
                          {&plan.slot_mapping, "slot_mapping"},
                          {&inv_freq, "inv_freq"}});
  cuda::rope_write_kv(qkv.raw(), q.raw(), inv_freq.data<float>(), plan, k_cache.raw(),
                      v_cache.raw(), n_tokens, n_q_heads, n_kv_heads, head_dim, dt, cache_dt,
                      scales, stream);
#else
  (void)stream;
  detail::fail_no_cuda(kOp);
#endif
}

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const AttentionPlan& plan, const AttentionVariant& variant, const Tensor& out,
                     void* stream, const KvCacheScales& scales) {
  using detail::kAnyDim;
  constexpr const char* kOp = "paged_attention";
  const DType dt = detail::compute_dtype(q, kOp, "q");
  detail::expect(q, kOp, "q", dt, {kAnyDim, kAnyDim, kAnyDim});
  const DType cache_dt = k_cache.dtype();
  check_kv_cache_dtype(cache_dt, dt, q.device(), kOp);
  check_kv_scales(scales, cache_dt, kOp);
  detail::expect(k_cache, kOp, "k_cache", cache_dt, {kAnyDim, kAnyDim, kAnyDim, q.dim(2)});
  const PagedAttentionDims dims = plan_dims(q, k_cache, plan, kOp);
  PAGEDLM_CHECK(dims.page_size > 0 && dims.n_kv_heads > 0 && dims.n_q_heads % dims.n_kv_heads == 0,
                kOp, ": ", dims.n_q_heads, " q heads cannot share ", dims.n_kv_heads,
                " kv heads (page size ", dims.page_size, ")");
  detail::expect(v_cache, kOp, "v_cache", cache_dt,
                 {dims.num_pages, dims.page_size, dims.n_kv_heads, dims.head_dim});
  detail::expect(out, kOp, "out", dt, {dims.n_tokens, dims.n_q_heads, dims.head_dim});
  detail::expect_devices(kOp, q.device(),
                         {{&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&out, "out"}});
  PAGEDLM_CHECK(variant.window >= 0 && variant.softcap >= 0.f, kOp, ": window ", variant.window,
                " and softcap ", variant.softcap, " must not be negative");
  if (q.device() == Device::kCpu) {
    auto run = [&](const auto* k, const auto* v) {
      cpu::paged_attention(q.data<float>(), k, v, plan.q_indptr.data<int32_t>(),
                           plan.kv_indptr.data<int32_t>(), plan.kv_page_indices.data<int32_t>(),
                           plan.kv_last_page_len.data<int32_t>(), variant, out.data<float>(), dims);
    };
    if (cache_dt == DType::kBF16) {
      run(k_cache.data<uint16_t>(), v_cache.data<uint16_t>());
    } else {
      run(k_cache.data<float>(), v_cache.data<float>());
    }
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::paged_attention(q.raw(), k_cache.raw(), v_cache.raw(), plan, variant, out.raw(), dims, dt,
                        cache_dt, scales, stream);
#else
  (void)stream;
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
