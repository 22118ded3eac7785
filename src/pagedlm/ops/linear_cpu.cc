#include <cblas.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/prefetch_cpu.h"

namespace pagedlm::ops {

namespace cpu {
namespace {

// Output features per OpenBLAS call; the unit of work handed to the OpenMP threads.
constexpr int64_t kLinearColChunk = 128;

// tile_out[j * kLinearRowTile + i] = dot(x_tile row i, weight row j) for j < n_cols: column-major
// [kLinearRowTile, n_cols], so the tile's rows are OpenBLAS's M dimension (the SIMD lanes of one
// micro-kernel) rather than its N dimension (register columns with edge kernels).
void gemm_tile(const float* x_tile, const float* weight_chunk, float* tile_out, int64_t n_cols,
               int64_t in_features) {
  const auto k = static_cast<blasint>(in_features);
  cblas_sgemm(CblasColMajor, CblasTrans, CblasNoTrans, static_cast<blasint>(kLinearRowTile),
              static_cast<blasint>(n_cols), k, 1.f, x_tile, k, weight_chunk, k, 0.f, tile_out,
              static_cast<blasint>(kLinearRowTile));
}

}  // namespace

// Batch invariance: a row's output bits must not depend on how many rows share the call or where
// the row sits. OpenBLAS chooses blockings, edge kernels and its thread split from (M, N, K), and
// measured results do change with all three: a row differs between M = 1 and M = 16, and with
// the row index inside a 16-row call when rows are OpenBLAS's N dimension (6-wide register
// blocks plus a 4-wide edge kernel) or when OpenBLAS splits M across its threads. So:
//   - every call has M == kLinearRowTile (a short last tile is zero-padded in scratch), and the
//     rows are M, i.e. lanes of the same SIMD instructions, which treat every lane alike;
//   - OpenBLAS runs single-threaded and the threads of core/parallel.h split the output features
//     into fixed kLinearColChunk chunks, so a column's chunk, and with it its arithmetic, depends
//     only on the weight's shape (the result is also independent of the thread count).
// Decode steps, the case that pays for the padding, are bound by streaming the weights from
// memory, and a 16-row tile reads each weight once just as a 1-row GEMV would.
void linear(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
            int64_t out_features, int64_t in_features) {
  if (rows == 0 || out_features == 0) return;
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
  const int64_t num_tiles = (rows + kLinearRowTile - 1) / kLinearRowTile;
  const int64_t tail = rows - (num_tiles - 1) * kLinearRowTile;
  thread_local std::vector<float> x_pad;
  const float* last_tile = x + (num_tiles - 1) * kLinearRowTile * in_features;
  if (tail < kLinearRowTile) {
    x_pad.assign(kLinearRowTile * in_features, 0.f);
    std::memcpy(x_pad.data(), last_tile, tail * in_features * sizeof(float));
    last_tile = x_pad.data();
  }
  const int64_t num_chunks = (out_features + kLinearColChunk - 1) / kLinearColChunk;
  // Chunk-major so a thread keeps its slice of the weights in cache across the row tiles.
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    thread_local std::vector<float> tile_out;
    tile_out.resize(kLinearRowTile * kLinearColChunk);
    const int64_t col0 = chunk * kLinearColChunk;
    const int64_t n_cols = std::min(kLinearColChunk, out_features - col0);
    for (int64_t tile = 0; tile < num_tiles; ++tile) {
      const bool is_last = tile == num_tiles - 1;
      const float* x_tile = is_last ? last_tile : x + tile * kLinearRowTile * in_features;
      gemm_tile(x_tile, weight + col0 * in_features, tile_out.data(), n_cols, in_features);
      const int64_t tile_rows = is_last ? tail : kLinearRowTile;
      for (int64_t i = 0; i < tile_rows; ++i) {
        float* dst = out + (tile * kLinearRowTile + i) * out_features + col0;
        for (int64_t j = 0; j < n_cols; ++j) {
          dst[j] = tile_out[j * kLinearRowTile + i] + (bias != nullptr ? bias[col0 + j] : 0.f);
        }
      }
    }
  }
}

namespace {

// Every output of the block kernels is defined by one arithmetic, whichever kernel computes it
// (that is what makes them batch invariant: a decode step's 1-row kernel, a prefill's panel GEMM
// and the portable loops give the same bits):
//   - a weight is its format's reference dequantization (core/quantized.cc, ggml's arithmetic,
//     whose every weight is one correctly rounded value, so fused or not makes no difference);
//   - 16 lanes accumulate with fused multiply-adds, block by block in order: lane l adds
//     w[l] * x[l], then w[l + 16] * x[l + 16];
//   - the lanes are summed as a tree (reduce_lanes), then the bias (or 0) is added.
constexpr int kLanes = 16;
constexpr int64_t kQuantRowTile = 8;
constexpr int64_t kQuantColChunk = 64;

// The lane sum: halves added pairwise (l + 8, then l + 4, l + 2, l + 1), the order AVX-512 and
// AVX2 reduce a register in, and the one the panel GEMM's transposing reduction keeps.
inline float reduce_lanes(const float* a) {
  float u[8], v[4], w[2];
  for (int l = 0; l < 8; ++l) u[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) v[l] = u[l] + u[l + 4];
  for (int l = 0; l < 2; ++l) w[l] = v[l] + v[l + 2];
  return w[0] + w[1];
}

// out[i] = dot(x row i, weight row) for the R rows of a tile, in plain loops: each block's
// weights by its format's reference dequantization (core/quantized.h), consumed 32 at a time
// (std::fma keeps the products unrounded as the SIMD kernels' FMAs do).
template <int R>
void quant_dot_rows_portable(const float* x, int64_t in_features, const uint8_t* weight_row,
                             QuantType type, float* out) {
  const QuantFormat& format = quant_format(type);
  const int64_t num_blocks = in_features / format.block_elems;
  float acc[R][kLanes] = {};
  float w[kMaxQuantBlockElems];
  for (int64_t b = 0; b < num_blocks; ++b) {
    format.dequantize_block(weight_row + b * format.block_bytes, w);
    for (int64_t s = 0; s < format.block_elems; s += kQuantBlock) {
      for (int i = 0; i < R; ++i) {
        const float* xb = x + i * in_features + b * format.block_elems + s;
        for (int l = 0; l < kLanes; ++l) acc[i][l] = std::fma(w[s + l], xb[l], acc[i][l]);
        for (int l = 0; l < kLanes; ++l) {
          acc[i][l] = std::fma(w[s + kLanes + l], xb[kLanes + l], acc[i][l]);
        }
      }
    }
  }
  for (int i = 0; i < R; ++i) out[i] = reduce_lanes(acc[i]);
}

using QuantDotFn = void (*)(const float*, int64_t, const uint8_t*, QuantType, float*);
constexpr QuantDotFn kPortableDot[kQuantRowTile] = {
    quant_dot_rows_portable<1>, quant_dot_rows_portable<2>, quant_dot_rows_portable<3>,
    quant_dot_rows_portable<4>, quant_dot_rows_portable<5>, quant_dot_rows_portable<6>,
    quant_dot_rows_portable<7>, quant_dot_rows_portable<8>};

// The column-chunk / row-tile driver over one of the row kernels: the decode path (few rows,
// bound by streaming the blocks) and the portable one.
void linear_rows(const QuantDotFn* dot, const float* x, const QuantizedMatrix& weight,
                 const float* bias, float* out, int64_t rows, int64_t out_stride) {
  const int64_t out_features = weight.rows, in_features = weight.cols;
  const int64_t row_bytes = weight.row_bytes();
  const int64_t num_chunks = (out_features + kQuantColChunk - 1) / kQuantColChunk;
  // Column chunks across threads (a column's arithmetic never depends on the split); within a
  // chunk, row tiles outer so a tile of x stays in L1 while the chunk's weight rows pass by.
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int64_t col0 = chunk * kQuantColChunk;
    const int64_t col1 = std::min(out_features, col0 + kQuantColChunk);
    float tile_out[kQuantRowTile];
    for (int64_t r0 = 0; r0 < rows; r0 += kQuantRowTile) {
      const int64_t tile_rows = std::min(kQuantRowTile, rows - r0);
      for (int64_t n = col0; n < col1; ++n) {
        dot[tile_rows - 1](x + r0 * in_features, in_features, weight.blocks.data() + n * row_bytes,
                           weight.type, tile_out);
        for (int64_t i = 0; i < tile_rows; ++i) {
          out[(r0 + i) * out_stride + n] = tile_out[i] + (bias != nullptr ? bias[n] : 0.f);
        }
      }
    }
  }
}

#if (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))) && defined(__F16C__)
// ---- What the AVX-512 and AVX2 block kernels share ----
inline float half_to_float(const uint8_t* p) {
  return _cvtsh_ss(static_cast<uint16_t>(p[0] | (p[1] << 8)));
}

inline float load_float(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof(f));
  return f;
}

// An IQ4 sub-block of 32 weights, d * level(q): its scale (IQ4_NL: the block's f16 d, or the f32
// one of its CPU form; IQ4_XS's CPU form: sub-block `sub`'s f32 d * sc) and its 16 bytes of
// nibbles (laid out as Q4_0's).
struct Iq4SubBlock {
  float d;
  const uint8_t* qs;
};

template <QuantType kType>
inline Iq4SubBlock iq4_sub_block(const uint8_t* block, int sub) {
  if constexpr (kType == QuantType::kIQ4_NL) {
    return {half_to_float(block), block + 2};
  } else if constexpr (kType == QuantType::kIQ4_NLF32) {
    return {load_float(block), block + 4};
  } else {
    static_assert(kType == QuantType::kIQ4_XSF32);
    return {load_float(block) * static_cast<float>(static_cast<int8_t>(block[4 + sub])),
            block + 12 + 16 * sub};
  }
}

// ---- Prefill-sized steps: packed panels ----
// x is packed once per step into tiles of kRows rows, block-interleaved (tile t, block b: row
// 0's 32 floats, row 1's, ...; rows past the end are zero), and each panel of kPanelCols weight
// rows is expanded once per block of rows into the same layout, so the kernels read two
// sequential streams from two pointers. A kernel takes a tile's rows times kCols of the panel's
// columns, each output its own 16-lane accumulator fed as quant_dot_rows' are.
constexpr int64_t kPanelCols = 8;  // weight rows expanded together (32 KiB at 1024 inputs)

// out rows [rows of the tile][n_cols] (row stride out_stride) = the packed tile times the packed
// panel's columns [c, c + kCols), plus bias (kCols values).
using PanelKernelFn = void (*)(const float* x_tile, const float* panel, int64_t num_blocks,
                               const float* bias, float* out, int64_t out_stride, int64_t n_cols);

template <typename T>
inline T* align64(std::vector<T>& v, size_t n) {
  v.resize(n + 64 / sizeof(T));
  const auto misalign = reinterpret_cast<uintptr_t>(v.data()) % 64;
  return v.data() + (misalign == 0 ? 0 : (64 - misalign) / sizeof(T));
}

// Packs rows [r0, r0 + tile_rows) of x (rows past `rows` zero) into one tile.
inline void pack_tile(const float* x, int64_t rows, int64_t in_features, int64_t r0,
                      int64_t tile_rows, float* tile) {
  const int64_t num_blocks = in_features / kQuantBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int64_t i = 0; i < tile_rows; ++i) {
      float* dst = tile + (b * tile_rows + i) * kQuantBlock;
      if (r0 + i < rows) {
        std::memcpy(dst, x + (r0 + i) * in_features + b * kQuantBlock, kQuantBlock * sizeof(float));
      } else {
        std::memset(dst, 0, kQuantBlock * sizeof(float));
      }
    }
  }
}

// A prefill-sized step: panels of weights expanded once per block of rows. expand_panel(col0,
// n_cols, panel) expands weight rows [col0, col0 + n_cols) into a panel (columns past n_cols
// zero); kernels[r - 1] takes a tile of r rows.
template <int kRows, int64_t kCols, typename ExpandPanel>
void panel_linear(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
                  int64_t rows, int64_t out_stride, const ExpandPanel& expand_panel,
                  const PanelKernelFn* kernels) {
  static_assert(kPanelCols % kCols == 0);
  const int64_t out_features = weight.rows, in_features = weight.cols;
  const int64_t num_blocks = in_features / kQuantBlock;
  const int64_t num_panels = (out_features + kPanelCols - 1) / kPanelCols;
  const int64_t num_tiles = (rows + kRows - 1) / kRows;
  const int64_t tile_floats = kRows * in_features;
  // Tiles sharing one expansion of a panel: about 512 KiB of packed x, which stays in L2 while
  // the thread's panels pass by, so a panel is expanded once per that many rows.
  const int64_t block_tiles = std::max<int64_t>(1, (int64_t{1} << 19) / (tile_floats * 4));
  thread_local std::vector<float>
      packed_storage;  // the calling thread's; grows to its largest step
  float* packed = align64(packed_storage, num_tiles * tile_floats);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; ++t) {
      pack_tile(x, rows, in_features, t * kRows, kRows, packed + t * tile_floats);
    }
    // Panels split into one contiguous range per thread (a column's arithmetic never depends
    // on the split).
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t p0 = num_panels * t / threads, p1 = num_panels * (t + 1) / threads;
    thread_local std::vector<float> panel_storage;
    float* panel = align64(panel_storage, kPanelCols * in_features);
    for (int64_t t0 = 0; t0 < num_tiles; t0 += block_tiles) {
      const int64_t t1 = std::min(num_tiles, t0 + block_tiles);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col0 = p * kPanelCols;
        const int64_t n_cols = std::min(kPanelCols, out_features - col0);
        expand_panel(col0, n_cols, panel);
        alignas(16) float bias_panel[kPanelCols] = {};
        if (bias != nullptr) std::copy(bias + col0, bias + col0 + n_cols, bias_panel);
        for (int64_t tile = t0; tile < t1; ++tile) {
          const int64_t r = tile * kRows;
          for (int64_t c = 0; c < n_cols; c += kCols) {
            kernels[std::min<int64_t>(kRows, rows - r) - 1](
                packed + tile * tile_floats, panel + c * kQuantBlock, num_blocks, bias_panel + c,
                out + r * out_stride + col0 + c, out_stride, std::min<int64_t>(kCols, n_cols - c));
          }
        }
      }
    }
  }
}
#endif

#if defined(__AVX512F__) && defined(__F16C__)
// GCC 12's AVX-512 headers start conversions from _mm512_undefined_*() and then warn about it.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// A block as two registers: weights 0-15 and 16-31, each as expand_block above computes it. A
// Q4_1 block has 16 possible weights, fma(k, d, m) for k = 0..15: one register of them, from
// which a permute picks each weight by its nibble (vpermps reads an index's low 4 bits only, so
// the high nibble needs a shift and the low one no mask), instead of a conversion and an fma per
// weight. A decode step expands every weight it reads once and is bound by that, not by memory:
// SmolLM2's single-stream decode on one thread took 8% less time (AMD EPYC, 2026-12-01).
inline void expand_q4_1(__m512 d, __m512 m, const uint8_t* qs, __m512& lo, __m512& hi) {
  const __m512 nibble_values = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f,
                                              10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  const __m512 weights = _mm512_fmadd_ps(nibble_values, d, m);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  lo = _mm512_permutexvar_ps(bytes, weights);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), weights);
}

inline __m512i load_bytes_u32(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 32 weights of 5 bits from their 32 possible ones (`below`: q = 0..15, `above`: 16..31), their
// low 4 bits (q_lo: weights 0-15, q_hi: 16-31, as 32-bit lanes) and the u32 at qh_bytes of their
// fifth bits (bit j: weight j's): the fifth bit set by a masked or, which also picks the register
// (vpermt2ps reads an index's low 5 bits).
inline void pick_5bit(__m512 below, __m512 above, const uint8_t* qh_bytes, __m512i q_lo,
                      __m512i q_hi, __m512& lo, __m512& hi) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, sizeof(qh));
  const __m512i fifth = _mm512_set1_epi32(16);
  lo = _mm512_permutex2var_ps(
      below, _mm512_mask_or_epi32(q_lo, static_cast<__mmask16>(qh), q_lo, fifth), above);
  hi = _mm512_permutex2var_ps(
      below, _mm512_mask_or_epi32(q_hi, static_cast<__mmask16>(qh >> 16), q_hi, fifth), above);
}

// A Q5_0 or Q5_1 block's weights: its fifth bits, then 16 bytes of nibbles (weight j: the low
// nibble of byte j, weight j + 16: the high one).
inline void expand_5bit(__m512 below, __m512 above, const uint8_t* qh_bytes, const uint8_t* qs,
                        __m512& lo, __m512& hi) {
  const __m512i bytes = load_bytes_u32(qs);
  pick_5bit(below, above, qh_bytes, _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)),
            _mm512_srli_epi32(bytes, 4), lo, hi);
}

// The K-quants with a scale per 16 weights (Q2_K, Q3_K, Q6_K) expand the four 32-weight
// sub-blocks of a half block (128 weights) from one setup (BlockExpander below): the half's
// scales converted together and its quants loaded once. Set up per sub-block, the scales' scalar
// conversions and broadcasts and the repeated loads had made these the slowest formats to expand.
struct KQuantHalf {
  const uint8_t* block;  // the block's CPU form
  int h;                 // which half of it
};
inline KQuantHalf k_quant_half(QuantType type, const uint8_t* row, int64_t k) {
  return {row + k / quant_block_elems(type) * quant_block_bytes(type),
          static_cast<int>(k % quant_block_elems(type) / 128)};
}

// A half's 32 bytes of 2-bit quants (byte l: weight l of sub-block c at bits 2c), bytes 0-15 and
// 16-31 widened to u32 lanes.
struct TwoBitQuants {
  __m512i lo, hi;
  void load(const uint8_t* half) {
    lo = load_bytes_u32(half);
    hi = load_bytes_u32(half + 16);
  }
  // Sub-block c's quants from bytes (lo or hi) as table lanes: (bytes >> 2c) & 3 | base, one
  // ternary logic op after the shift.
  static __m512i lanes(__m512i bytes, int c, int base) {
    constexpr int kAndOr = 0xEA;  // (A & B) | C on ternary logic's truth-table operands
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(bytes, 2 * c), _mm512_set1_epi32(3),
                                     _mm512_set1_epi32(base), kAndOr);
  }
};

// Q3_K's and Q6_K's CPU forms: f32 d, then int8 scales, one per 16 weights. Lane g < 8: d * sc of
// half h's group g (exact: d from f16, sc 8 bits); lanes 8-15 read the bytes after the half's
// scales, which no sub-block takes.
inline __m512 half_int8_scales(const uint8_t* block, int h) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4 + 8 * h)))),
                       _mm512_set1_ps(load_float(block)));
}

// Q2_K: w = d * sc * q - dmin * m per group of 16 weights, q = 0..3. The half's eight groups
// have 32 possible weights, two tables of 16 (lane 4s + q: group 4p + s's weight for q), so a
// sub-block takes a shift, a ternary logic op and a permute per 16 weights. Every weight is one
// rounding of an exact value (d * sc * q and dmin * m are exact in float32: d and dmin came
// from f16; sc, m and q have 4, 4 and 2 bits), so the bits are the reference's.
struct Q2kHalf {
  static constexpr int kSubs = 4;  // sub-blocks of 32 expanded from one setup
  __m512 table[2];                 // table[p]: the half's groups 4p..4p + 3
  TwoBitQuants quants;
  Q2kHalf(const uint8_t* row, int64_t k) {
    const auto [block, h] = k_quant_half(QuantType::kQ2_KF32, row, k);
    // Lane g < 8: group g of the half's scale (low nibble) and min (high) byte; lanes 8-15 read
    // the bytes after them, which no table takes.
    const __m512i scale_bytes = load_bytes_u32(block + 8 + 8 * h);
    const __m512 q_times_d = _mm512_mul_ps(_mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 0.f, 1.f, 2.f, 3.f,
                                                          0.f, 1.f, 2.f, 3.f, 0.f, 1.f, 2.f, 3.f),
                                           _mm512_set1_ps(load_float(block)));
    const __m512 dmin = _mm512_set1_ps(load_float(block + 4));
    for (int p = 0; p < 2; ++p) {
      const __m512i group_bytes = _mm512_permutexvar_epi32(
          _mm512_add_epi32(_mm512_set1_epi32(4 * p),
                           _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)),
          scale_bytes);
      const __m512 scales =
          _mm512_cvtepi32_ps(_mm512_and_si512(group_bytes, _mm512_set1_epi32(0x0F)));
      const __m512 mins = _mm512_cvtepi32_ps(_mm512_srli_epi32(group_bytes, 4));
      table[p] = _mm512_fmsub_ps(scales, q_times_d, _mm512_mul_ps(mins, dmin));
    }
    quants.load(block + 24 + 32 * h);
  }
  void expand(int c, __m512& lo, __m512& hi) const {
    // Groups 2c (weights 0-15) and 2c + 1: table c / 2 at lanes 8 (c % 2) and 8 (c % 2) + 4.
    lo = _mm512_permutexvar_ps(TwoBitQuants::lanes(quants.lo, c, 8 * (c % 2)), table[c / 2]);
    hi = _mm512_permutexvar_ps(TwoBitQuants::lanes(quants.hi, c, 8 * (c % 2) + 4), table[c / 2]);
  }
};

// Q3_K: w = d * sc * (q - 4) per group of 16 weights, q = 0..7 (its third bit in the sub-block's
// u32). The half's eight scales d * sc are converted together; sub-block c's table holds
// (q - 4) * d * sc for its groups 2c (lanes 0-7) and 2c + 1 (lanes 8-15). Every product is exact
// (d from f16, sc 8 bits, q - 4 3 bits), as the reference's.
struct Q3kHalf {
  static constexpr int kSubs = 4;
  __m512 scales;  // lane g < 8: d * sc of the half's group g
  const uint8_t* third_bits;
  TwoBitQuants quants;
  Q3kHalf(const uint8_t* row, int64_t k) {
    const auto [block, h] = k_quant_half(QuantType::kQ3_KF32, row, k);
    scales = half_int8_scales(block, h);
    third_bits = block + 20 + 16 * h;
    quants.load(block + 52 + 32 * h);
  }
  void expand(int c, __m512& lo, __m512& hi) const {
    const __m512 weights = _mm512_mul_ps(
        _mm512_setr_ps(-4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f,
                       2.f, 3.f),
        _mm512_permutexvar_ps(
            _mm512_add_epi32(_mm512_set1_epi32(2 * c),
                             _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)),
            scales));
    uint32_t third;
    std::memcpy(&third, third_bits + 4 * c, sizeof(third));
    const __m512i four = _mm512_set1_epi32(4);
    const __m512i q_lo = TwoBitQuants::lanes(quants.lo, c, 0);
    const __m512i q_hi = TwoBitQuants::lanes(quants.hi, c, 8);
    lo = _mm512_permutexvar_ps(
        _mm512_mask_or_epi32(q_lo, static_cast<__mmask16>(third), q_lo, four), weights);
    hi = _mm512_permutexvar_ps(
        _mm512_mask_or_epi32(q_hi, static_cast<__mmask16>(third >> 16), q_hi, four), weights);
  }
};

// Q6_K: w = d * sc * (q - 32) per group of 16 weights, q of 6 bits: 4 in the half's 64 bytes of
// ql (sub-blocks 0 and 2 in the low and high nibbles of the first 32, 1 and 3 of the second), 2
// in its 32 bytes of qh (sub-block c's at bits 2c). The half's eight scales d * sc are converted
// together and its quant bytes loaded once; per sub-block the bits are combined in bytes, then
// widened. Every product is exact (d from f16, sc 8 bits, q - 32 6 bits), as the reference's.
struct Q6kHalf {
  static constexpr int kSubs = 4;
  __m512 scales;  // lane g < 8: d * sc of the half's group g
  __m256i ql[2], qh;
  Q6kHalf(const uint8_t* row, int64_t k) {
    const auto [block, h] = k_quant_half(QuantType::kQ6_KF32, row, k);
    scales = half_int8_scales(block, h);
    ql[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 20 + 64 * h));
    ql[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 52 + 64 * h));
    qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 148 + 32 * h));
  }
  void expand(int c, __m512& lo, __m512& hi) const {
    // Shifts are per 16 bits; the masks keep only bits that come from their own byte.
    const __m256i low_bits =
        _mm256_and_si256(_mm256_srli_epi16(ql[c % 2], 4 * (c / 2)), _mm256_set1_epi8(0x0F));
    const __m256i high_at_4 =
        c < 3 ? _mm256_slli_epi16(qh, 4 - 2 * c) : _mm256_srli_epi16(qh, 2 * c - 4);
    const __m256i q = _mm256_sub_epi8(
        _mm256_or_si256(low_bits, _mm256_and_si256(high_at_4, _mm256_set1_epi8(0x30))),
        _mm256_set1_epi8(32));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                       _mm512_permutexvar_ps(_mm512_set1_epi32(2 * c), scales));
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                       _mm512_permutexvar_ps(_mm512_set1_epi32(2 * c + 1), scales));
  }
};

// Weights k..k + 31 of a weight row (k a multiple of 32) as two registers, weights k..k + 15 and
// k + 16..k + 31, each the format's reference dequantization bit for bit. The 4- and 5-bit
// formats look their weights up: a block's 16 (or 32) possible weights, computed once, and a
// permute that picks each by its quant. (Q2_K, Q3_K and Q6_K: their half-block expanders above.)
template <QuantType kType>
inline void expand_block(const uint8_t* row, int64_t k, __m512& lo, __m512& hi) {
  const uint8_t* block = row + k / quant_block_elems(kType) * quant_block_bytes(kType);
  const int sub = static_cast<int>(k % quant_block_elems(kType) / kQuantBlock);
  if constexpr (kType == QuantType::kQ4_1) {
    // d and m side by side, converted by one instruction.
    uint32_t dm_bits;
    std::memcpy(&dm_bits, block, sizeof(dm_bits));
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm_bits)));
    expand_q4_1(_mm512_broadcastss_ps(dm), _mm512_broadcastss_ps(_mm_movehdup_ps(dm)), block + 4,
                lo, hi);
  } else if constexpr (kType == QuantType::kQ4_1F32) {
    // Broadcasts from memory, which the load unit does: no conversion, no shuffle.
    expand_q4_1(_mm512_set1_ps(load_float(block)), _mm512_set1_ps(load_float(block + 4)),
                block + 2 * sizeof(float), lo, hi);
  } else if constexpr (kType == QuantType::kQ8_0) {
    const __m512 d = _mm512_set1_ps(half_to_float(block));
    const __m128i q_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i q_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q_lo)), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q_hi)), d);
  } else if constexpr (kType == QuantType::kQ4_0 || kType == QuantType::kQ4_0F32) {
    // (q - 8) * d for q = 0..15. The f32 d of Q4_0's CPU form is a broadcast from memory inside
    // the multiply, one instruction where the f16 one takes three (load, convert, broadcast):
    // SmolLM2 Q4_0's single-stream decode ran 10% faster (AVX-512 AMD EPYC, 2026-12-04).
    constexpr bool kF32 = kType == QuantType::kQ4_0F32;
    const __m512 centered = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f,
                                           2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    const __m512 weights =
        _mm512_mul_ps(centered, _mm512_set1_ps(kF32 ? load_float(block) : half_to_float(block)));
    const __m512i bytes = load_bytes_u32(block + (kF32 ? 4 : 2));
    lo = _mm512_permutexvar_ps(bytes, weights);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), weights);
  } else if constexpr (kType == QuantType::kIQ4_NL || kType == QuantType::kIQ4_NLF32 ||
                       kType == QuantType::kIQ4_XSF32) {
    // d * level for the 16 levels, picked by nibble as Q4_0's (IQ4_NL's f32 d, as Q4_0's, a
    // broadcast from memory inside the multiply).
    const Iq4SubBlock iq4 = iq4_sub_block<kType>(block, sub);
    const __m512 levels = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues))));
    const __m512 weights = _mm512_mul_ps(levels, _mm512_set1_ps(iq4.d));
    const __m512i bytes = load_bytes_u32(iq4.qs);
    lo = _mm512_permutexvar_ps(bytes, weights);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), weights);
  } else if constexpr (kType == QuantType::kQ5_0F32) {
    // (q - 16) * d: (low 4 bits - 16) * d picked from one register, plus 16 d where the fifth bit
    // is set. Both terms and their sum are exact multiples of d (at most 5 bits of them), so the
    // sum is the reference's weight (q = 16 gives +0 where a negative d gives the reference -0,
    // which no output can show: the accumulators start at +0, and +0 + -0 is +0). The
    // one-register permutes take no mask of the low bits (vpermps reads an index's low 4 bits)
    // where the 32-entry ones took a mask and an or: 1.05x single-stream decode on the Q5_0 and
    // Q4_K_M files (AMD EPYC, 1 thread, 2026-12-05).
    const __m512 d = _mm512_set1_ps(load_float(block));
    const __m512 below =
        _mm512_mul_ps(_mm512_setr_ps(-16.f, -15.f, -14.f, -13.f, -12.f, -11.f, -10.f, -9.f, -8.f,
                                     -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f),
                      d);
    const __m512 sixteen_d = _mm512_mul_ps(_mm512_set1_ps(16.f), d);
    uint32_t qh;
    std::memcpy(&qh, block + 4, sizeof(qh));
    const __m512i bytes = load_bytes_u32(block + 8);
    const __m512 low = _mm512_permutexvar_ps(bytes, below);
    const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), below);
    lo = _mm512_mask_add_ps(low, static_cast<__mmask16>(qh), low, sixteen_d);
    hi = _mm512_mask_add_ps(high, static_cast<__mmask16>(qh >> 16), high, sixteen_d);
  } else if constexpr (kType == QuantType::kQ5_1) {
    // q * d + m for q = 0..31 in two registers (d and m converted together as Q4_1's).
    uint32_t dm_bits;
    std::memcpy(&dm_bits, block, sizeof(dm_bits));
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm_bits)));
    const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    const __m512 below = _mm512_fmadd_ps(_mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f,
                                                        9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f),
                                         d, m);
    const __m512 above =
        _mm512_fmadd_ps(_mm512_setr_ps(16.f, 17.f, 18.f, 19.f, 20.f, 21.f, 22.f, 23.f, 24.f, 25.f,
                                       26.f, 27.f, 28.f, 29.f, 30.f, 31.f),
                        d, m);
    expand_5bit(below, above, block + 4, block + 8, lo, hi);
  } else if constexpr (kType == QuantType::kQ4_KF32) {
    // Sub-block `sub`: d * sc * q - dmin * m for q = 0..15, its nibbles the low (even sub) or
    // high (odd) ones of chunk sub / 2.
    const float scale = load_float(block) * static_cast<float>(block[8 + sub]);
    const float min = load_float(block + 4) * static_cast<float>(block[16 + sub]);
    const __m512 nibble_values = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f,
                                                10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
    const __m512 weights =
        _mm512_sub_ps(_mm512_mul_ps(nibble_values, _mm512_set1_ps(scale)), _mm512_set1_ps(min));
    const uint8_t* qs = block + 24 + 32 * (sub / 2);
    __m512i q_lo = load_bytes_u32(qs), q_hi = load_bytes_u32(qs + 16);
    if (sub % 2 == 1) {
      q_lo = _mm512_srli_epi32(q_lo, 4);
      q_hi = _mm512_srli_epi32(q_hi, 4);
    }
    lo = _mm512_permutexvar_ps(q_lo, weights);
    hi = _mm512_permutexvar_ps(q_hi, weights);
  } else if constexpr (kType == QuantType::kQ5_KF32) {
    // Sub-block `sub`: d * sc * q - dmin * m for q = 0..31 in two registers, its nibbles as
    // Q4_K's (low or high ones of chunk sub / 2, masked: the fifth bit picks the register) and
    // its u32 of fifth bits.
    const float scale = load_float(block) * static_cast<float>(block[8 + sub]);
    const float min = load_float(block + 4) * static_cast<float>(block[16 + sub]);
    const __m512 below =
        _mm512_sub_ps(_mm512_mul_ps(_mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f,
                                                   10.f, 11.f, 12.f, 13.f, 14.f, 15.f),
                                    _mm512_set1_ps(scale)),
                      _mm512_set1_ps(min));
    const __m512 above =
        _mm512_sub_ps(_mm512_mul_ps(_mm512_setr_ps(16.f, 17.f, 18.f, 19.f, 20.f, 21.f, 22.f, 23.f,
                                                   24.f, 25.f, 26.f, 27.f, 28.f, 29.f, 30.f, 31.f),
                                    _mm512_set1_ps(scale)),
                      _mm512_set1_ps(min));
    const uint8_t* qs = block + 56 + 32 * (sub / 2);
    __m512i q_lo = load_bytes_u32(qs), q_hi = load_bytes_u32(qs + 16);
    if (sub % 2 == 1) {
      q_lo = _mm512_srli_epi32(q_lo, 4);
      q_hi = _mm512_srli_epi32(q_hi, 4);
    } else {
      q_lo = _mm512_and_si512(q_lo, _mm512_set1_epi32(0x0F));
      q_hi = _mm512_and_si512(q_hi, _mm512_set1_epi32(0x0F));
    }
    pick_5bit(below, above, block + 24 + 4 * sub, q_lo, q_hi, lo, hi);
  } else {
    static_assert(kType == QuantType::kQ8_0, "no AVX-512 expansion for this format");
  }
}

// Calls fn(std::integral_constant<QuantType, T>) for the format T the AVX-512 kernels compute
// from; false for a format they do not read (ggml's layout of a format the CPU repacks).
template <typename Fn>
bool with_avx512_format(QuantType type, Fn&& fn) {
  switch (type) {
    case QuantType::kQ4_1:
      fn(std::integral_constant<QuantType, QuantType::kQ4_1>{});
      return true;
    case QuantType::kQ8_0:
      fn(std::integral_constant<QuantType, QuantType::kQ8_0>{});
      return true;
    case QuantType::kQ4_1F32:
      fn(std::integral_constant<QuantType, QuantType::kQ4_1F32>{});
      return true;
    case QuantType::kQ4_0:
      fn(std::integral_constant<QuantType, QuantType::kQ4_0>{});
      return true;
    case QuantType::kQ4_0F32:
      fn(std::integral_constant<QuantType, QuantType::kQ4_0F32>{});
      return true;
    case QuantType::kQ5_0F32:
      fn(std::integral_constant<QuantType, QuantType::kQ5_0F32>{});
      return true;
    case QuantType::kQ5_1:
      fn(std::integral_constant<QuantType, QuantType::kQ5_1>{});
      return true;
    case QuantType::kQ4_KF32:
      fn(std::integral_constant<QuantType, QuantType::kQ4_KF32>{});
      return true;
    case QuantType::kQ6_KF32:
      fn(std::integral_constant<QuantType, QuantType::kQ6_KF32>{});
      return true;
    case QuantType::kQ5_KF32:
      fn(std::integral_constant<QuantType, QuantType::kQ5_KF32>{});
      return true;
    case QuantType::kQ3_KF32:
      fn(std::integral_constant<QuantType, QuantType::kQ3_KF32>{});
      return true;
    case QuantType::kQ2_KF32:
      fn(std::integral_constant<QuantType, QuantType::kQ2_KF32>{});
      return true;
    case QuantType::kIQ4_NL:
      fn(std::integral_constant<QuantType, QuantType::kIQ4_NL>{});
      return true;
    case QuantType::kIQ4_NLF32:
      fn(std::integral_constant<QuantType, QuantType::kIQ4_NLF32>{});
      return true;
    case QuantType::kIQ4_XSF32:
      fn(std::integral_constant<QuantType, QuantType::kIQ4_XSF32>{});
      return true;
    default:
      return false;
  }
}

// The AVX-512 kernels keep a tile of outputs in registers, each its own 16-lane accumulator.
// Decode steps (up to 4 rows): micro_kernel, kMicroRows x kMicroCols outputs, weights expanded
// from the blocks as they stream by (four columns give four independent FMA chains instead of
// one). Larger steps: panel_kernel (below), which expands each weight once per step into packed
// float32 panels shared by all the step's rows.
constexpr int kMicroRows = 4, kMicroCols = 4;
constexpr int64_t kPanelMinRows = 5;  // fewer rows: straight from the blocks (measured)
// Columns a thread takes at a time in a decode step: 32 splits SmolLM2's 192-wide k and v
// projections evenly over 2 threads (64 left one thread 2 chunks of 3).
constexpr int64_t kDecodeColChunk = 32;
// How far ahead of the micro-kernel its blocks are prefetched, in groups of kMicroCols weight rows
// (a thread's columns are contiguous, so the next groups are the next bytes of the matrix). The
// hardware prefetcher alone did not keep up with the kMicroCols interleaved streams: SmolLM2's
// Q8_0 output head streamed at 4.5 GB/s on one thread, with this 15 GB/s, and its single-stream
// decode went from 54 to about 78 tok/s (AMD EPYC, 2026-12-01; 2 and 4 groups measured alike).
constexpr int64_t kPrefetchGroups = 3;

// reduce_lanes of 16 registers at once, transposing as it adds: sums[o] = reduce_lanes(acc[o]).
// Each stage adds the two halves the scalar tree adds, two registers' worth per instruction.
inline __m512 reduce_lanes_16(const __m512* acc) {
  __m512 h1[8], h2[4], h3[2];
  for (int k = 0; k < 8; ++k) {  // u = lanes 0-7 + 8-15: [u(2k) | u(2k+1)]
    h1[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0x44),
                          _mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // v = u 0-3 + 4-7: [v(4k) | v(4k+1) | v(4k+2) | v(4k+3)]
    h2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(h1[2 * k], h1[2 * k + 1], 0x88),
                          _mm512_shuffle_f32x4(h1[2 * k], h1[2 * k + 1], 0xDD));
  }
  for (int k = 0; k < 2; ++k) {  // w = v 0-1 + 2-3; quarter q: [w(8k+q) | w(8k+4+q)]
    h3[k] = _mm512_add_ps(_mm512_shuffle_ps(h2[2 * k], h2[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(h2[2 * k], h2[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // w0 + w1; quarter q: [s(q), s(q + 4), s(q + 8), s(q + 12)], so lane 4q + r holds s(q + 4r).
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(h3[0], h3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(h3[0], h3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}

// A weight row's blocks from weight k on, as the micro-kernel expands them: kSubs sub-blocks of 32
// from one setup (expand(c, ...): weights k + 32 c..). Most formats set up nothing; Q2_K and Q3_K
// share a half block's setup among its four sub-blocks (KQuantHalf).
template <QuantType kType>
struct BlockExpander {
  static constexpr int kSubs = 1;
  const uint8_t* row;
  int64_t k;
  BlockExpander(const uint8_t* row, int64_t k) : row(row), k(k) {}
  void expand(int c, __m512& lo, __m512& hi) const {
    expand_block<kType>(row, k + c * kQuantBlock, lo, hi);
  }
};
template <>
struct BlockExpander<QuantType::kQ2_KF32> : Q2kHalf {
  using Q2kHalf::Q2kHalf;
};
template <>
struct BlockExpander<QuantType::kQ3_KF32> : Q3kHalf {
  using Q3kHalf::Q3kHalf;
};
template <>
struct BlockExpander<QuantType::kQ6_KF32> : Q6kHalf {
  using Q6kHalf::Q6kHalf;
};

// Weight columns of the micro-kernel: kMicroCols weight rows expanded from their blocks as they
// are read.
template <QuantType kType>
struct BlockColumns {
  using Expander = BlockExpander<kType>;
  const uint8_t* first;  // column 0's row of blocks
  int64_t row_bytes;
  // Columns past n_cols repeat the last one, whose outputs micro_kernel drops: no branch in the
  // loop (with one, GCC stored the accumulators to memory on every block).
  int64_t n_cols;
  Expander expander(int j, int64_t k) const {
    const int64_t col = j < n_cols ? j : n_cols - 1;
    return Expander(first + col * row_bytes, k);
  }
  // One block step's share of the group kPrefetchGroups ahead: the bytes of its kMicroCols rows
  // taken in order, kMicroCols blocks' worth a step, so the steps of a group cover the next.
  // The loop's trip count is a constant: with bounds computed from k, GCC 12 emitted no
  // prefetch at all in the 1-row kernel, and SmolLM2 Q8_0's single-stream decode halved.
  void prefetch(int64_t k) const {
    constexpr int64_t kStepBytes =
        kMicroCols * quant_block_bytes(kType) * kQuantBlock / quant_block_elems(kType);
    static_assert(kStepBytes * quant_block_elems(kType) ==
                  kMicroCols * quant_block_bytes(kType) * kQuantBlock);
    const int64_t from = kPrefetchGroups * kMicroCols * row_bytes + k / kQuantBlock * kStepBytes;
    // The address is formed as an integer and not bounded by the matrix's end (a prefetch never
    // faults): with a bound's branch here, or with _mm_prefetch (prefetch_line says why), GCC
    // stored every accumulator to the stack on every block step.
    const auto base = reinterpret_cast<uintptr_t>(first) + static_cast<uintptr_t>(from);
    for (int64_t off = 0; off < kStepBytes; off += 64) {
      prefetch_line(base + static_cast<uintptr_t>(off));
    }
  }
};

// out rows [MR][n_cols] (row stride out_stride) = x rows [MR] (stride in_features) times the
// kMicroCols columns, plus bias4 (kMicroCols values).
template <int MR, typename Columns>
void micro_kernel(const float* x, int64_t in_features, const Columns& w, const float* bias4,
                  float* out, int64_t out_stride, int64_t n_cols) {
  // Only the MR rows' accumulators: zeroing all 16 became a 1 KiB memset per call (2% of a
  // decode step); the reduction below pads the rest with zeros.
  __m512 acc[MR * kMicroCols];
  for (__m512& a : acc) a = _mm512_setzero_ps();
  // A column's block step: weights k..k + 31 times the rows' x (from registers, or loaded).
  const auto step = [&](int j, const __m512& w_lo, const __m512& w_hi, const __m512* x_lo,
                        const __m512* x_hi) {
    for (int i = 0; i < MR; ++i) {
      acc[i * kMicroCols + j] = _mm512_fmadd_ps(w_lo, x_lo[i], acc[i * kMicroCols + j]);
    }
    for (int i = 0; i < MR; ++i) {
      acc[i * kMicroCols + j] = _mm512_fmadd_ps(w_hi, x_hi[i], acc[i * kMicroCols + j]);
    }
  };
  constexpr int kSubs = Columns::Expander::kSubs;
  for (int64_t k0 = 0; k0 < in_features; k0 += kSubs * kQuantBlock) {
    for (int c = 0; c < kSubs; ++c) w.prefetch(k0 + c * kQuantBlock);
    if constexpr (kSubs == 1) {
      __m512 x_lo[MR], x_hi[MR];
      for (int i = 0; i < MR; ++i) {
        x_lo[i] = _mm512_loadu_ps(x + i * in_features + k0);
        x_hi[i] = _mm512_loadu_ps(x + i * in_features + k0 + kLanes);
      }
      for (int j = 0; j < kMicroCols; ++j) {
        __m512 w_lo, w_hi;
        w.expander(j, k0).expand(0, w_lo, w_hi);
        step(j, w_lo, w_hi, x_lo, x_hi);
      }
    } else {
      // A column's sub-blocks one after the other from its setup: each accumulator still takes
      // its blocks in order. x is read again per column (from L1) to leave the registers to the
      // setups.
      for (int j = 0; j < kMicroCols; ++j) {
        const auto e = w.expander(j, k0);
#pragma GCC unroll 4
        for (int c = 0; c < kSubs; ++c) {
          const int64_t k = k0 + c * kQuantBlock;
          __m512 x_lo[MR], x_hi[MR], w_lo, w_hi;
          for (int i = 0; i < MR; ++i) {
            x_lo[i] = _mm512_loadu_ps(x + i * in_features + k);
            x_hi[i] = _mm512_loadu_ps(x + i * in_features + k + kLanes);
          }
          e.expand(c, w_lo, w_hi);
          step(j, w_lo, w_hi, x_lo, x_hi);
        }
      }
    }
  }
  // Quarter i of the sums: row i's kMicroCols outputs.
  __m512 all[kMicroRows * kMicroCols];
  for (int o = 0; o < kMicroRows * kMicroCols; ++o) {
    all[o] = o < MR * kMicroCols ? acc[o] : _mm512_setzero_ps();
  }
  alignas(64) float sums[kMicroRows * kMicroCols];
  _mm512_store_ps(sums, reduce_lanes_16(all));
  for (int i = 0; i < MR; ++i) {
    for (int64_t j = 0; j < n_cols; ++j)
      out[i * out_stride + j] = sums[i * kMicroCols + j] + bias4[j];
  }
}

// The micro-kernel over rows [r0, r1) and weight columns [col0, col0 + n_cols), in 4-row tiles.
template <typename Columns>
void micro_tiles(const float* x, int64_t in_features, int64_t r0, int64_t r1, const Columns& w,
                 const float* bias4, float* out, int64_t out_features) {
  for (int64_t r = r0; r < r1; r += kMicroRows) {
    const float* xr = x + r * in_features;
    float* o = out + r * out_features;
    const int64_t n_cols = std::min<int64_t>(kMicroCols, w.n_cols);
    switch (std::min<int64_t>(kMicroRows, r1 - r)) {
      case 1:
        micro_kernel<1>(xr, in_features, w, bias4, o, out_features, n_cols);
        break;
      case 2:
        micro_kernel<2>(xr, in_features, w, bias4, o, out_features, n_cols);
        break;
      case 3:
        micro_kernel<3>(xr, in_features, w, bias4, o, out_features, n_cols);
        break;
      default:
        micro_kernel<4>(xr, in_features, w, bias4, o, out_features, n_cols);
        break;
    }
  }
}

// ---- Prefill-sized steps (panel_linear): the AVX-512 kernel ----
// Its tile is kTileRows x kMicroCols outputs (24 accumulators), fed half a block at a time:
// each lane's first FMA of a block, then its second, exactly as in micro_kernel.
constexpr int kTileRows = 6;

// out rows [n_rows][n_cols] (row stride out_stride) = the packed tile times the packed panel's
// columns [c, c + kMicroCols), plus bias4.
// MR: the tile's rows that exist (the last tile of a step may have fewer).
template <int MR>
void panel_kernel(const float* x_tile, const float* panel, int64_t num_blocks, const float* bias4,
                  float* out, int64_t out_stride, int64_t n_cols) {
  constexpr int kAcc = MR * kMicroCols;
  __m512 acc[kAcc];
  for (__m512& a : acc) a = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x_tile + b * kTileRows * kQuantBlock;
    const float* wb = panel + b * kPanelCols * kQuantBlock;
    for (int h = 0; h < kQuantBlock; h += kLanes) {
      __m512 w[kMicroCols];
      for (int j = 0; j < kMicroCols; ++j) w[j] = _mm512_load_ps(wb + j * kQuantBlock + h);
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = _mm512_load_ps(xb + i * kQuantBlock + h);
        for (int j = 0; j < kMicroCols; ++j) {
          acc[i * kMicroCols + j] = _mm512_fmadd_ps(w[j], xv, acc[i * kMicroCols + j]);
        }
      }
    }
  }
  // Sixteen outputs per reduction: quarter q of group g holds row 4g + q's kMicroCols outputs.
  alignas(64) float sums[32];
  for (int g = 0; g * 16 < kAcc; ++g) {
    __m512 group[16];
    for (int o = 0; o < 16; ++o) {
      group[o] = 16 * g + o < kAcc ? acc[16 * g + o] : _mm512_setzero_ps();
    }
    _mm512_store_ps(sums + 16 * g, reduce_lanes_16(group));
  }
  for (int i = 0; i < MR; ++i) {
    for (int64_t j = 0; j < n_cols; ++j) {
      out[i * out_stride + j] = sums[i * kMicroCols + j] + bias4[j];
    }
  }
}

constexpr PanelKernelFn kPanelKernel[kTileRows] = {panel_kernel<1>, panel_kernel<2>,
                                                   panel_kernel<3>, panel_kernel<4>,
                                                   panel_kernel<5>, panel_kernel<6>};

// Expands weight rows [col0, col0 + n_cols) into a packed panel; columns past n_cols are zero
// (their outputs are computed and dropped).
template <QuantType kType>
void expand_panel(const QuantizedMatrix& weight, int64_t col0, int64_t n_cols, float* panel) {
  using Expander = BlockExpander<kType>;
  const int64_t num_blocks = weight.cols / kQuantBlock;
  const int64_t row_bytes = weight.row_bytes();
  for (int64_t b0 = 0; b0 < num_blocks; b0 += Expander::kSubs) {
    for (int64_t c = 0; c < kPanelCols; ++c) {
      const auto store = [&](int s, __m512 lo, __m512 hi) {
        float* dst = panel + ((b0 + s) * kPanelCols + c) * kQuantBlock;
        _mm512_store_ps(dst, lo);
        _mm512_store_ps(dst + kLanes, hi);
      };
      if (c >= n_cols) {
        for (int s = 0; s < Expander::kSubs; ++s)
          store(s, _mm512_setzero_ps(), _mm512_setzero_ps());
        continue;
      }
      // The column's sub-blocks from one setup, as the micro-kernel takes them.
      const Expander e(weight.blocks.data() + (col0 + c) * row_bytes, b0 * kQuantBlock);
      for (int s = 0; s < Expander::kSubs; ++s) {
        __m512 lo, hi;
        e.expand(s, lo, hi);
        store(s, lo, hi);
      }
    }
  }
}

// A decode-sized step (fewer than kPanelMinRows rows): the micro-kernel straight from the blocks,
// their format fixed at compile time so that no block asks which it is.
template <QuantType kType>
void decode_linear(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
                   int64_t rows, int64_t out_stride) {
  const int64_t out_features = weight.rows, in_features = weight.cols;
  const int64_t row_bytes = weight.row_bytes();
  const int64_t num_chunks = (out_features + kDecodeColChunk - 1) / kDecodeColChunk;
  // Column chunks across threads (a column's arithmetic never depends on the split).
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    alignas(16) float bias4[kMicroCols] = {};
    const int64_t col1 = std::min(out_features, (chunk + 1) * kDecodeColChunk);
    for (int64_t c = chunk * kDecodeColChunk; c < col1; c += kMicroCols) {
      const BlockColumns<kType> w{weight.blocks.data() + c * row_bytes, row_bytes,
                                  std::min<int64_t>(kMicroCols, col1 - c)};
      for (int64_t j = 0; j < w.n_cols; ++j) bias4[j] = bias != nullptr ? bias[c + j] : 0.f;
      micro_tiles(x, in_features, 0, rows, w, bias4, out + c, out_stride);
    }
  }
}

// False for a format the AVX-512 kernels do not read.
bool linear_avx512(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
                   int64_t rows, int64_t out_stride) {
  return with_avx512_format(weight.type, [&](auto format) {
    if (rows < kPanelMinRows) {
      decode_linear<format.value>(x, weight, bias, out, rows, out_stride);
    } else {
      panel_linear<kTileRows, kMicroCols>(
          x, weight, bias, out, rows, out_stride,
          [&](int64_t col0, int64_t n_cols, float* panel) {
            expand_panel<format.value>(weight, col0, n_cols, panel);
          },
          kPanelKernel);
    }
  });
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The formats the AVX2 kernels expand in registers; the others (ggml's layouts of the formats
// the CPU repacks) by their reference dequantization, a block at a time.
constexpr bool expands_in_registers(QuantType t) {
  switch (t) {
    case QuantType::kQ4_1:
    case QuantType::kQ4_1F32:
    case QuantType::kQ8_0:
    case QuantType::kQ4_0:
    case QuantType::kQ4_0F32:
    case QuantType::kQ5_0F32:
    case QuantType::kQ5_1:
    case QuantType::kQ4_KF32:
    case QuantType::kQ5_KF32:
    case QuantType::kQ6_KF32:
    case QuantType::kQ3_KF32:
    case QuantType::kQ2_KF32:
    case QuantType::kIQ4_NL:
    case QuantType::kIQ4_NLF32:
    case QuantType::kIQ4_XSF32:
      return true;
    default:
      return false;
  }
}

// A 32-weight sub-block's quants as bytes: weights 0-15 in lo, 16-31 in hi (each half its own
// 128 bits, so that widening them to four registers of eight takes no lane crossing).
struct QuantBytes {
  __m128i lo, hi;
};

inline __m128i load_16_bytes(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

inline QuantBytes operator|(QuantBytes a, QuantBytes b) {
  return {_mm_or_si128(a.lo, b.lo), _mm_or_si128(a.hi, b.hi)};
}

// Less `value` in every byte (unsigned quants made the signed ones they stand for).
inline QuantBytes minus(QuantBytes q, char value) {
  const __m128i v = _mm_set1_epi8(value);
  return {_mm_sub_epi8(q.lo, v), _mm_sub_epi8(q.hi, v)};
}

// 16 bytes of nibbles as 32 4-bit quants: their low nibbles (weights 0-15), then their high ones.
inline QuantBytes nibbles_as_bytes(const uint8_t* qs) {
  const __m128i q = load_16_bytes(qs);
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  return {_mm_and_si128(q, low_nibbles), _mm_and_si128(_mm_srli_epi16(q, 4), low_nibbles)};
}

// The bits at `shift` (mask `mask`) of 32 bytes, byte l weight l's: a K-quant's quants packed
// 4 (Q4_K's nibbles) or 2 (Q2_K's, Q3_K's and Q6_K's 2-bit fields) to the byte.
inline QuantBytes bits_of_bytes(const uint8_t* p, int shift, char mask) {
  const __m128i count = _mm_cvtsi32_si128(shift);
  const __m128i m = _mm_set1_epi8(mask);
  return {_mm_and_si128(_mm_srl_epi16(load_16_bytes(p), count), m),
          _mm_and_si128(_mm_srl_epi16(load_16_bytes(p + 16), count), m)};
}

// The u32 at p as 32 bytes: byte l is `value` where bit l is set, else 0 (a fifth or third bit).
inline QuantBytes bits_as_bytes(const uint8_t* p, char value) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  const __m128i all = _mm_set1_epi32(static_cast<int>(bits));
  const __m128i bit = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m128i v = _mm_set1_epi8(value);
  // Byte l takes the u32's byte l / 8 (a shuffle), then tests its bit l % 8.
  const auto spread = [&](__m128i byte_of) {
    const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(all, byte_of), bit), bit);
    return _mm_and_si128(set, v);
  };
  return {spread(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)),
          spread(_mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3))};
}

// Eight quants (bytes 0-7 of q) as floats.
template <bool kSigned>
inline __m256 bytes_as_floats(__m128i q) {
  return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q));
}

// w = q * scale + add for unsigned quants, scale and add one per 16 weights (lo: weights 0-15).
// The formats that take this path have an exact q * scale, so the fused multiply-add rounds
// once, where the reference's multiply and add (or subtract) round the sum once too.
inline void fma_unsigned(QuantBytes q, float scale_lo, float scale_hi, float add_lo, float add_hi,
                         __m256* w) {
  const __m128i parts[4] = {q.lo, _mm_srli_si128(q.lo, 8), q.hi, _mm_srli_si128(q.hi, 8)};
  for (int j = 0; j < 4; ++j) {
    w[j] = _mm256_fmadd_ps(bytes_as_floats<false>(parts[j]),
                           _mm256_set1_ps(j < 2 ? scale_lo : scale_hi),
                           _mm256_set1_ps(j < 2 ? add_lo : add_hi));
  }
}

// w = q * scale for signed quants, a scale per 16 weights: one rounding, as the reference's.
inline void mul_signed(QuantBytes q, float scale_lo, float scale_hi, __m256* w) {
  const __m128i parts[4] = {q.lo, _mm_srli_si128(q.lo, 8), q.hi, _mm_srli_si128(q.hi, 8)};
  for (int j = 0; j < 4; ++j) {
    w[j] =
        _mm256_mul_ps(bytes_as_floats<true>(parts[j]), _mm256_set1_ps(j < 2 ? scale_lo : scale_hi));
  }
}

// Weights k..k + 31 of a weight row as four registers (elements 0-7, 8-15, 16-23, 24-31): the same
// lanes as the AVX-512 kernel, in two registers each, each weight its format's reference
// dequantization bit for bit. kType: a format expands_in_registers, or kQ5_0 standing for every
// other, expanded by format's reference dequantization into `dequantized` (the weight row's
// current block; k must then go through a row's blocks in order).
template <QuantType kType>
inline void expand_avx2(const QuantFormat& format, const uint8_t* weight_row, int64_t k,
                        float* dequantized, __m256* w) {
  constexpr bool kInRegisters = expands_in_registers(kType);
  // Blocks are 32 or 256 weights.
  const int64_t block_elems = kInRegisters ? quant_block_elems(kType) : format.block_elems;
  const int64_t block_bytes = kInRegisters ? quant_block_bytes(kType) : format.block_bytes;
  const uint8_t* block = weight_row + (k >> (block_elems == 256 ? 8 : 5)) * block_bytes;
  // The 32-weight sub-block of a 256-weight block: sub-block `sub` of half h (128 weights), its
  // part c.
  const int sub = static_cast<int>((k & (block_elems - 1)) / kQuantBlock);
  const int h = sub / 4, c = sub % 4;
  if constexpr (!kInRegisters) {
    const int64_t offset = k & (block_elems - 1);
    if (offset == 0) format.dequantize_block(block, dequantized);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_load_ps(dequantized + offset + 8 * j);
  } else if constexpr (kType == QuantType::kQ4_1 || kType == QuantType::kQ4_1F32) {
    constexpr bool kF32 = kType == QuantType::kQ4_1F32;
    const float d = kF32 ? load_float(block) : half_to_float(block);
    const float m = kF32 ? load_float(block + 4) : half_to_float(block + 2);
    fma_unsigned(nibbles_as_bytes(block + (kF32 ? 8 : 4)), d, d, m, m, w);
  } else if constexpr (kType == QuantType::kQ5_1) {
    // Q4_1's q * d + m, each nibble's fifth bit from the block's u32.
    const float d = half_to_float(block), m = half_to_float(block + 2);
    fma_unsigned(nibbles_as_bytes(block + 8) | bits_as_bytes(block + 4, 0x10), d, d, m, m, w);
  } else if constexpr (kType == QuantType::kQ4_0 || kType == QuantType::kQ4_0F32) {
    constexpr bool kF32 = kType == QuantType::kQ4_0F32;
    const float d = kF32 ? load_float(block) : half_to_float(block);
    mul_signed(minus(nibbles_as_bytes(block + (kF32 ? 4 : 2)), 8), d, d, w);
  } else if constexpr (kType == QuantType::kQ5_0F32) {
    const float d = load_float(block);
    mul_signed(minus(nibbles_as_bytes(block + 8) | bits_as_bytes(block + 4, 0x10), 16), d, d, w);
  } else if constexpr (kType == QuantType::kQ4_KF32 || kType == QuantType::kQ5_KF32) {
    // d * sc * q - dmin * m, the nibbles the low (even sub) or high (odd) ones of 32-byte chunk
    // sub / 2 (Q5_K: each with its fifth bit from the sub-block's u32). d * sc has at most 17
    // significant bits and q 5, so the product is exact.
    const float scale = load_float(block) * static_cast<float>(block[8 + sub]);
    const float min = load_float(block + 4) * static_cast<float>(block[16 + sub]);
    constexpr int kQs = kType == QuantType::kQ4_KF32 ? 24 : 56;
    QuantBytes q = bits_of_bytes(block + kQs + 32 * (sub / 2), 4 * (sub % 2), 0x0F);
    if constexpr (kType == QuantType::kQ5_KF32) q = q | bits_as_bytes(block + 24 + 4 * sub, 0x10);
    fma_unsigned(q, scale, scale, -min, -min, w);
  } else if constexpr (kType == QuantType::kQ3_KF32) {
    // d * sc * (q - 4), a scale per 16; q's 2 low bits at 2c of h's 32 bytes, its third bit (the
    // sub-block's u32) adding the 4 back.
    const float d = load_float(block);
    const auto* sc = reinterpret_cast<const int8_t*>(block + 4) + 2 * sub;
    const QuantBytes q =
        bits_of_bytes(block + 52 + 32 * h, 2 * c, 3) | bits_as_bytes(block + 20 + 4 * sub, 4);
    mul_signed(minus(q, 4), d * static_cast<float>(sc[0]), d * static_cast<float>(sc[1]), w);
  } else if constexpr (kType == QuantType::kQ2_KF32) {
    // d * sc * q - dmin * m per 16 (sc and m a byte's nibbles), q at bits 2c of h's 32 bytes. The
    // products are exact (d * sc: 15 significant bits; q: 2).
    const uint8_t sc_lo = block[8 + 2 * sub], sc_hi = block[9 + 2 * sub];
    const float d = load_float(block), dmin = load_float(block + 4);
    fma_unsigned(bits_of_bytes(block + 24 + 32 * h, 2 * c, 3), d * static_cast<float>(sc_lo & 0x0F),
                 d * static_cast<float>(sc_hi & 0x0F), -(dmin * static_cast<float>(sc_lo >> 4)),
                 -(dmin * static_cast<float>(sc_hi >> 4)), w);
  } else if constexpr (kType == QuantType::kQ6_KF32) {
    // d * sc * (q - 32), a scale per 16: q's low nibble from 32 bytes of ql (h's first or second
    // 32, c odd; their low or high nibbles, c >= 2), its 2 high bits at 2c of h's 32 bytes of qh.
    const float d = load_float(block);
    const auto* sc = reinterpret_cast<const int8_t*>(block + 4) + 8 * h + 2 * c;
    const QuantBytes low = bits_of_bytes(block + 20 + 64 * h + 32 * (c % 2), 4 * (c / 2), 0x0F);
    const QuantBytes high = bits_of_bytes(block + 148 + 32 * h, 2 * c, 3);
    const QuantBytes q = low | QuantBytes{_mm_slli_epi16(high.lo, 4), _mm_slli_epi16(high.hi, 4)};
    mul_signed(minus(q, 32), d * static_cast<float>(sc[0]), d * static_cast<float>(sc[1]), w);
  } else if constexpr (kType == QuantType::kIQ4_NL || kType == QuantType::kIQ4_NLF32 ||
                       kType == QuantType::kIQ4_XSF32) {
    // Each nibble's level as an int8 (pshufb), then level * d, every product exact as the
    // reference's.
    const Iq4SubBlock iq4 = iq4_sub_block<kType>(block, sub);
    const __m128i levels = load_16_bytes(reinterpret_cast<const uint8_t*>(kIq4NlValues));
    const QuantBytes q = nibbles_as_bytes(iq4.qs);
    mul_signed({_mm_shuffle_epi8(levels, q.lo), _mm_shuffle_epi8(levels, q.hi)}, iq4.d, iq4.d, w);
  } else {
    static_assert(kType == QuantType::kQ8_0);
    const __m256 d = _mm256_set1_ps(half_to_float(block));
    for (int j = 0; j < 4; ++j) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * j));
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
    }
  }
}

// Calls fn(std::integral_constant<QuantType, T>) for the format T the AVX2 kernels compute from:
// one that expands_in_registers, or kQ5_0 standing for every other.
template <typename Fn>
void with_avx2_format(QuantType type, Fn&& fn) {
  switch (type) {
    case QuantType::kQ4_1:
      return fn(std::integral_constant<QuantType, QuantType::kQ4_1>{});
    case QuantType::kQ4_1F32:
      return fn(std::integral_constant<QuantType, QuantType::kQ4_1F32>{});
    case QuantType::kQ8_0:
      return fn(std::integral_constant<QuantType, QuantType::kQ8_0>{});
    case QuantType::kQ4_0:
      return fn(std::integral_constant<QuantType, QuantType::kQ4_0>{});
    case QuantType::kQ4_0F32:
      return fn(std::integral_constant<QuantType, QuantType::kQ4_0F32>{});
    case QuantType::kQ5_0F32:
      return fn(std::integral_constant<QuantType, QuantType::kQ5_0F32>{});
    case QuantType::kQ5_1:
      return fn(std::integral_constant<QuantType, QuantType::kQ5_1>{});
    case QuantType::kQ4_KF32:
      return fn(std::integral_constant<QuantType, QuantType::kQ4_KF32>{});
    case QuantType::kQ5_KF32:
      return fn(std::integral_constant<QuantType, QuantType::kQ5_KF32>{});
    case QuantType::kQ6_KF32:
      return fn(std::integral_constant<QuantType, QuantType::kQ6_KF32>{});
    case QuantType::kQ3_KF32:
      return fn(std::integral_constant<QuantType, QuantType::kQ3_KF32>{});
    case QuantType::kQ2_KF32:
      return fn(std::integral_constant<QuantType, QuantType::kQ2_KF32>{});
    case QuantType::kIQ4_NL:
      return fn(std::integral_constant<QuantType, QuantType::kIQ4_NL>{});
    case QuantType::kIQ4_NLF32:
      return fn(std::integral_constant<QuantType, QuantType::kIQ4_NLF32>{});
    case QuantType::kIQ4_XSF32:
      return fn(std::integral_constant<QuantType, QuantType::kIQ4_XSF32>{});
    default:  // by the reference dequantization
      return fn(std::integral_constant<QuantType, QuantType::kQ5_0>{});
  }
}

// The 16 lanes of an output's two accumulators (lanes 0-7, 8-15) summed in reduce_lanes' order,
// in registers (through memory, with 112 kernels to inline it into, GCC called reduce_lanes).
inline float reduce_lanes_avx2(__m256 lo, __m256 hi) {
  const __m256 u = _mm256_add_ps(lo, hi);                                               // l + 8
  const __m128 v = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));  // l + 4
  const __m128 w = _mm_add_ps(v, _mm_movehl_ps(v, v));                                  // l + 2
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));                              // l + 1
}

// out[i] = dot(x row i, weight row) for the R rows of a tile, the weight's format fixed at
// compile time (no branch per block on it).
template <int R, QuantType kType>
void quant_dot_rows_of(const float* x, int64_t in_features, const uint8_t* weight_row,
                       const QuantFormat& format, float* out) {
  alignas(32) float dequantized[kMaxQuantBlockElems];
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in_features; k += kQuantBlock) {
    __m256 w[4];  // elements 0-7, 8-15, 16-23, 24-31
    expand_avx2<kType>(format, weight_row, k, dequantized, w);
    for (int i = 0; i < R; ++i) {
      const float* xb = x + i * in_features + k;
      acc[i][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[i][1]);
      acc[i][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = reduce_lanes_avx2(acc[i][0], acc[i][1]);
}

template <int R>
void quant_dot_rows(const float* x, int64_t in_features, const uint8_t* weight_row, QuantType type,
                    float* out) {
  const QuantFormat& format = quant_format(type);
  with_avx2_format(type, [&](auto f) {
    quant_dot_rows_of<R, f.value>(x, in_features, weight_row, format, out);
  });
}

constexpr QuantDotFn kQuantDot[kQuantRowTile] = {
    quant_dot_rows<1>, quant_dot_rows<2>, quant_dot_rows<3>, quant_dot_rows<4>,
    quant_dot_rows<5>, quant_dot_rows<6>, quant_dot_rows<7>, quant_dot_rows<8>};

// ---- One-row steps (a single decoding sequence): two weight rows a loop ----
// A lane's sum is a chain of FMAs, two a block, so one weight row's loop waits on the FMA's
// latency (8 cycles a Q4_1 block on a Zen 3, which the rest of its work would take in about 4),
// and the loop is too long for the core to start the next row under it. Two rows a loop give
// four chains, each row summed in quant_dot_rows_of<1>'s order (the same bits). Two rows are two
// streams, which the hardware prefetcher followed less well: through them alone, decode slowed
// down; with the weights asked for 4 KiB ahead it is 5-10% faster than one row a loop (SmolLM2
// Q4_1, Q4_K_M, Q6_K and Q8_0, 1 thread, 2-core AMD EPYC).
template <QuantType kType>
void quant_dot_two_weight_rows(const float* x, int64_t in_features, const uint8_t* row_a,
                               const uint8_t* row_b, const QuantFormat& format, float* out) {
  constexpr bool kInRegisters = expands_in_registers(kType);
  const int64_t block_elems = kInRegisters ? quant_block_elems(kType) : format.block_elems;
  const int64_t block_bytes = kInRegisters ? quant_block_bytes(kType) : format.block_bytes;
  alignas(32) float dequantized[2][kMaxQuantBlockElems];
  const uint8_t* rows[2] = {row_a, row_b};
  __m256 acc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()},
                      {_mm256_setzero_ps(), _mm256_setzero_ps()}};
  for (int64_t k = 0; k < in_features; k += kQuantBlock) {
    const float* xb = x + k;
    for (int r = 0; r < 2; ++r) {
      if (k % block_elems == 0) {
        const uint8_t* block = rows[r] + (k / block_elems) * block_bytes;
        prefetch_ahead(block, block + block_bytes);
      }
      __m256 w[4];
      expand_avx2<kType>(format, rows[r], k, dequantized[r], w);
      acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[r][1]);
    }
  }
  for (int r = 0; r < 2; ++r) out[r] = reduce_lanes_avx2(acc[r][0], acc[r][1]);
}

// linear_rows' column chunks for one row of x, the weight rows two at a time (a chunk's odd last
// one alone).
void decode_linear_avx2(const float* x, const QuantizedMatrix& weight, const float* bias,
                        float* out) {
  const QuantFormat& format = quant_format(weight.type);
  const int64_t out_features = weight.rows, in_features = weight.cols;
  const int64_t row_bytes = weight.row_bytes();
  const int64_t num_chunks = (out_features + kQuantColChunk - 1) / kQuantColChunk;
  with_avx2_format(weight.type, [&](auto f) {
#pragma omp parallel for schedule(static)
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
      const int64_t col0 = chunk * kQuantColChunk;
      const int64_t col1 = std::min(out_features, col0 + kQuantColChunk);
      for (int64_t n = col0; n < col1; n += 2) {
        const uint8_t* row = weight.blocks.data() + n * row_bytes;
        const int64_t count = std::min<int64_t>(2, col1 - n);
        float sums[2];
        if (count == 2) {
          quant_dot_two_weight_rows<f.value>(x, in_features, row, row + row_bytes, format, sums);
        } else {
          quant_dot_rows_of<1, f.value>(x, in_features, row, format, sums);
        }
        for (int64_t j = 0; j < count; ++j) {
          out[n + j] = sums[j] + (bias != nullptr ? bias[n + j] : 0.f);
        }
      }
    }
  });
}

// ---- Prefill-sized steps (panel_linear): the AVX2 kernel ----
// A tile of kAvx2TileRows x kAvx2TileCols outputs, each its 16 lanes in two registers (12 of the
// 16), fed a quarter block at a time as quant_dot_rows_of feeds its own: per block, two weight
// loads and three of x for six FMAs a quarter, where quant_dot_rows_of expands every weight
// again for each tile of 8 rows and loads x four times per four FMAs.
constexpr int kAvx2TileRows = 3;
constexpr int64_t kAvx2TileCols = 2;
// Fewer rows: quant_dot_rows straight from the blocks, one expansion per tile of up to 8 rows
// (through the panels, 8 parallel decodes measured 0.98x the tok/s of that, 32 of them 1.23x;
// medians of 4 runs each, 2-core AMD EPYC).
constexpr int64_t kAvx2PanelMinRows = kQuantRowTile + 1;

template <int MR>
void panel_kernel_avx2(const float* x_tile, const float* panel, int64_t num_blocks,
                       const float* bias, float* out, int64_t out_stride, int64_t n_cols) {
  __m256 acc[MR][kAvx2TileCols][2];
  for (auto& row : acc) {
    for (auto& a : row) a[0] = a[1] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x_tile + b * kAvx2TileRows * kQuantBlock;
    const float* wb = panel + b * kPanelCols * kQuantBlock;
    for (int q = 0; q < 4; ++q) {  // elements 8q .. 8q + 7, lanes 8 (q % 2) ..
      __m256 w[kAvx2TileCols];
      for (int64_t j = 0; j < kAvx2TileCols; ++j)
        w[j] = _mm256_load_ps(wb + j * kQuantBlock + 8 * q);
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_load_ps(xb + i * kQuantBlock + 8 * q);
        for (int64_t j = 0; j < kAvx2TileCols; ++j) {
          acc[i][j][q % 2] = _mm256_fmadd_ps(w[j], xv, acc[i][j][q % 2]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int64_t j = 0; j < n_cols; ++j) {
      out[i * out_stride + j] = reduce_lanes_avx2(acc[i][j][0], acc[i][j][1]) + bias[j];
    }
  }
}

constexpr PanelKernelFn kPanelKernelAvx2[kAvx2TileRows] = {
    panel_kernel_avx2<1>, panel_kernel_avx2<2>, panel_kernel_avx2<3>};

// Expands weight rows [col0, col0 + n_cols) into a packed panel, each row's blocks in order (as
// expand_avx2 needs for the formats it expands through `dequantized`); columns past n_cols are
// zero (their outputs are computed and dropped).
template <QuantType kType>
void expand_panel_avx2(const QuantizedMatrix& weight, int64_t col0, int64_t n_cols, float* panel) {
  const QuantFormat& format = quant_format(weight.type);
  const int64_t num_blocks = weight.cols / kQuantBlock;
  const int64_t row_bytes = weight.row_bytes();
  alignas(32) float dequantized[kMaxQuantBlockElems];
  for (int64_t c = 0; c < kPanelCols; ++c) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      float* dst = panel + (b * kPanelCols + c) * kQuantBlock;
      __m256 w[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
      if (c < n_cols) {
        expand_avx2<kType>(format, weight.blocks.data() + (col0 + c) * row_bytes, b * kQuantBlock,
                           dequantized, w);
      }
      for (int j = 0; j < 4; ++j) _mm256_store_ps(dst + 8 * j, w[j]);
    }
  }
}

// Prefill-sized steps through the panels, smaller ones straight from the blocks (one row two
// weight rows a loop).
void linear_avx2(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
                 int64_t rows, int64_t out_stride) {
  if (rows == 1) {
    decode_linear_avx2(x, weight, bias, out);
    return;
  }
  if (rows < kAvx2PanelMinRows) {
    linear_rows(kQuantDot, x, weight, bias, out, rows, out_stride);
    return;
  }
  with_avx2_format(weight.type, [&](auto format) {
    panel_linear<kAvx2TileRows, kAvx2TileCols>(
        x, weight, bias, out, rows, out_stride,
        [&](int64_t col0, int64_t n_cols, float* panel) {
          expand_panel_avx2<format.value>(weight, col0, n_cols, panel);
        },
        kPanelKernelAvx2);
  });
}
#else
constexpr const QuantDotFn* kQuantDot = kPortableDot;
#endif

}  // namespace

void linear(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
            int64_t rows, int64_t out_stride) {
  if (rows == 0 || weight.rows == 0) return;
  if (out_stride < 0) out_stride = weight.rows;
#if defined(__AVX512F__) && defined(__F16C__)
  if (linear_avx512(x, weight, bias, out, rows, out_stride)) return;
  linear_rows(kPortableDot, x, weight, bias, out, rows, out_stride);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  linear_avx2(x, weight, bias, out, rows, out_stride);
#else
  linear_rows(kQuantDot, x, weight, bias, out, rows, out_stride);
#endif
}

void linear_portable(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
                     int64_t rows) {
  if (rows == 0 || weight.rows == 0) return;
  linear_rows(kPortableDot, x, weight, bias, out, rows, weight.rows);
}

}  // namespace cpu

void linear(const Tensor& x, const QuantizedMatrix& weight, const Tensor& bias, const Tensor& out,
            int64_t out_col0) {
  constexpr const char* kOp = "linear (quantized weight)";
  detail::expect(x, kOp, "x", DType::kF32, {detail::kAnyDim, weight.cols});
  detail::expect_output_columns(x, out, out_col0, weight.rows, kOp);
  PAGEDLM_CHECK(x.device() == Device::kCpu && out.device() == Device::kCpu, kOp,
                ": block-quantized weights are a CPU path");
  PAGEDLM_CHECK(weight.cols % quant_block_elems(weight.type) == 0 &&
                    static_cast<int64_t>(weight.blocks.size()) == weight.rows * weight.row_bytes(),
                kOp, ": the weight's blocks do not match its shape [", weight.rows, ", ",
                weight.cols, "]");
  if (bias.defined()) detail::expect(bias, kOp, "bias", DType::kF32, {out.dim(1)});
  cpu::linear(x.data<float>(), weight, bias.defined() ? bias.data<float>() + out_col0 : nullptr,
              out.data<float>() + out_col0, x.dim(0), out.dim(1));
}

QuantizedMatrix repack_for_cpu(QuantizedMatrix weight) {
  const QuantFormat& from = quant_format(weight.type);
  if (from.repack_block == nullptr) return weight;
  QuantizedMatrix out;
  out.type = from.cpu_form;
  out.rows = weight.rows;
  out.cols = weight.cols;
  out.blocks.resize(out.rows * out.row_bytes());
  const int64_t num_blocks = weight.rows * weight.cols / from.block_elems;
  const int64_t to_bytes = quant_block_bytes(out.type);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < num_blocks; ++b) {
    from.repack_block(weight.blocks.data() + b * from.block_bytes,
                      out.blocks.data() + b * to_bytes);
  }
  return out;
}

void linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
            void* stream, DeviceState* state) {
  using detail::kAnyDim;
  constexpr const char* kOp = "linear";
  const DType dt = detail::compute_dtype(x, kOp, "x");
  detail::expect(x, kOp, "x", dt, {kAnyDim, kAnyDim});
  const int64_t rows = x.dim(0), in_features = x.dim(1);
  detail::expect(weight, kOp, "weight", dt, {kAnyDim, in_features});
  const int64_t out_features = weight.dim(0);
  const DType out_dt = out.dtype() == DType::kF32 ? DType::kF32 : dt;
  detail::expect(out, kOp, "out", out_dt, {rows, out_features});
  detail::expect_device(weight, x.device(), kOp, "weight");
  detail::expect_device(out, x.device(), kOp, "out");
  // An undefined Tensor (default-constructed, shape []) means "no bias".
  const bool has_bias = bias.defined();
  if (has_bias) {
    PAGEDLM_CHECK(out_dt == dt, kOp, ": a bias needs out in the compute dtype (", dtype_name(dt),
                  "), got ", dtype_name(out_dt));
    detail::expect(bias, kOp, "bias", dt, {out_features});
    detail::expect_device(bias, x.device(), kOp, "bias");
  }
  if (x.device() == Device::kCpu) {
    cpu::linear(x.data<float>(), weight.data<float>(), has_bias ? bias.data<float>() : nullptr,
                out.data<float>(), rows, out_features, in_features);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  PAGEDLM_CHECK(state != nullptr, kOp, ": a GPU linear needs its caller's DeviceState");
  cuda::linear(x.raw(), weight.raw(), has_bias ? bias.raw() : nullptr, out.raw(), rows,
               out_features, in_features, dt, out_dt, stream, *state);
#else
  (void)stream;
  (void)state;
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
