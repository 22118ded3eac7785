// The CPU projections with 8-bit activations (--cpu-q8-activations): x is quantized per block of
// 32 to int8 (ops/linear.h, Q8Activations) and each block's dot product with a Q4_1 or Q8_0
// weight block is an exact integer sum; only the scales are floating point. Not exact (x loses
// its low bits), which is why it is an option.
//
// Layout: the weight's rows (output features) are regrouped 16 at a time, block by block, so
// that a 64-byte chunk holds 4 consecutive elements of each of the 16 features. One VNNI
// instruction (dpbusd) then multiplies a chunk by the same 4 bytes of x broadcast to every lane
// and adds each lane's 4 products into that lane's int32: after the 8 chunks of a block, lane c
// holds feature c's block dot product, with no horizontal sums. A group's block is
//   Q4_1: 16 f16 d, 16 f16 m, 4 chunks of nibbles (chunk k, lane c: feature c's ggml byte
//         4k..4k+3, whose low nibbles are elements 4k.. and high nibbles elements 16 + 4k..);
//   Q8_0: 16 f16 d, 8 chunks of q + 128 (unsigned, as dpbusd wants; the dot product takes
//         128 * sum(x) back off).
// That is as many bytes per weight as ggml's blocks, so decode streams no more.
//
// Per lane and block, every kernel does the same float operations in the same order:
//   acc = fma(float(isum), d_w * d_x, acc); Q4_1 also acc = fma(m_w, d_x * sum_x, acc),
// then adds the bias. The integer part is exact, so the portable, AVX2 and VNNI kernels give
// the same bits, and a row's outputs never depend on the rows tiled with it (batch invariant).
//
// Q4_0 and Q5_0 are packed as the Q4_1 and Q8_0 blocks holding the same weights (pack_for_q8).
//
// Dispatch is at compile time: the build uses -march=native (as linear_cpu.cc does), so the
// binary runs where it was built and every instruction set the compiler enables is present.
// Each kernel the build can compile is kept, so tests compare them all against the portable one.
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "pagedlm/core/dtype.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/op_check.h"

namespace pagedlm::ops {

namespace {

constexpr int64_t kGroup = 16;  // output features per packed group
constexpr int64_t kChunk = 4 * kGroup;
constexpr int kMaxTileRows = 8;

constexpr int64_t group_block_bytes(QuantType t) {
  return t == QuantType::kQ4_1 ? 2 * 2 * kGroup + 4 * kChunk : 2 * kGroup + 8 * kChunk;
}

// Q4_0 and Q5_0 blocks as the Q4_1 and Q8_0 blocks holding the same weights: Q4_0's
// (q - 8) * d is Q4_1's q * d + m with m = -8 d (exact in f16 but for |d| >= 8192, refused);
// Q5_0's (q - 16) * d is Q8_0's with q - 16, which fits an int8.
QuantType q8_layout_of(QuantType t) {
  return t == QuantType::kQ4_1 || t == QuantType::kQ4_0 ? QuantType::kQ4_1 : QuantType::kQ8_0;
}

const uint8_t* as_q8_layout(QuantType t, const uint8_t* src, uint8_t* tmp) {
  if (t == QuantType::kQ4_0) {
    uint16_t d;
    std::memcpy(&d, src, 2);
    const float m = -8.f * f16_to_f32(d);
    const uint16_t m_bits = f32_to_f16(m);
    PAGEDLM_CHECK(f16_to_f32(m_bits) == m, "pack_for_q8: a Q4_0 scale of ", f16_to_f32(d),
                  " is too large for 8-bit activations");
    std::memcpy(tmp, src, 2);
    std::memcpy(tmp + 2, &m_bits, 2);
    std::memcpy(tmp + 4, src + 2, kQuantBlock / 2);
    return tmp;
  }
  if (t == QuantType::kQ5_0) {
    std::memcpy(tmp, src, 2);
    uint32_t qh;
    std::memcpy(&qh, src + 2, 4);
    for (int j = 0; j < kQuantBlock / 2; ++j) {
      const int lo = (src[6 + j] & 0x0F) | (((qh >> j) & 1) << 4);
      const int hi = (src[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      tmp[2 + j] = static_cast<uint8_t>(lo - 16);
      tmp[2 + j + kQuantBlock / 2] = static_cast<uint8_t>(hi - 16);
    }
    return tmp;
  }
  return src;
}

}  // namespace

bool q8_packs(QuantType type) {
  return type == QuantType::kQ4_1 || type == QuantType::kQ8_0 || type == QuantType::kQ4_0 ||
         type == QuantType::kQ5_0;
}

Q8PackedMatrix pack_for_q8(const QuantizedMatrix& weight) {
  PAGEDLM_CHECK(weight.cols % kQuantBlock == 0 &&
                    static_cast<int64_t>(weight.blocks.size()) == weight.rows * weight.row_bytes(),
                "pack_for_q8: the weight's blocks do not match its shape [", weight.rows, ", ",
                weight.cols, "]");
  PAGEDLM_CHECK(q8_packs(weight.type),
                "pack_for_q8: takes ggml's Q4_0, Q4_1, Q5_0 or Q8_0 blocks, not ",
                quant_format(weight.type).name);
  Q8PackedMatrix p;
  p.type = q8_layout_of(weight.type);
  p.rows = weight.rows;
  p.cols = weight.cols;
  const int64_t nb = weight.cols / kQuantBlock;
  const int64_t num_groups = (weight.rows + kGroup - 1) / kGroup;
  const int64_t gbb = group_block_bytes(p.type);
  const int64_t src_bytes = quant_block_bytes(weight.type);
  const bool q4 = p.type == QuantType::kQ4_1;
  // Padding features (past rows) get zero scales and zero quants (Q8_0: 128, i.e. q = 0).
  p.data.assign(num_groups * nb * gbb, 0);
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* dst = p.data.data() + (g * nb + b) * gbb;
      for (int64_t c = 0; c < kGroup; ++c) {
        const int64_t n = g * kGroup + c;
        if (n >= weight.rows) {
          if (!q4) {
            for (int64_t j = 0; j < 8; ++j)
              std::memset(dst + 2 * kGroup + j * kChunk + 4 * c, 128, 4);
          }
          continue;
        }
        uint8_t converted[quant_block_bytes(QuantType::kQ8_0)];
        const uint8_t* src = as_q8_layout(
            weight.type, weight.blocks.data() + n * weight.row_bytes() + b * src_bytes, converted);
        std::memcpy(dst + 2 * c, src, 2);  // d
        if (q4) {
          std::memcpy(dst + 2 * kGroup + 2 * c, src + 2, 2);  // m
          for (int64_t k = 0; k < 4; ++k) {
            std::memcpy(dst + 4 * kGroup + k * kChunk + 4 * c, src + 4 + 4 * k, 4);
          }
        } else {
          for (int64_t j = 0; j < 8; ++j) {
            for (int64_t e = 0; e < 4; ++e) {
              dst[2 * kGroup + j * kChunk + 4 * c + e] =
                  static_cast<uint8_t>(src[2 + 4 * j + e] ^ 0x80);
            }
          }
        }
      }
    }
  }
  return p;
}

namespace cpu {

void quantize_q8(const float* x, int64_t rows, int64_t cols, Q8Activations& out) {
  const int64_t nb = cols / kQuantBlock;
  out.rows = rows;
  out.cols = cols;
  out.qs.resize(rows * cols);
  out.scale.resize(rows * nb);
  out.sum.resize(rows * nb);
  out.scaled_sum.resize(rows * nb);
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * cols + b * kQuantBlock;
      float amax = 0.f;
      for (int64_t j = 0; j < kQuantBlock; ++j) amax = std::max(amax, std::abs(xb[j]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = out.qs.data() + r * cols + b * kQuantBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kQuantBlock; ++j) {
        // |x * id| <= 127 up to rounding, so the value fits an int8.
        q[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
        sum += q[j];
      }
      out.scale[r * nb + b] = d;
      out.sum[r * nb + b] = sum;
      out.scaled_sum[r * nb + b] = d * static_cast<float>(sum);
    }
  }
}

namespace {

// tile[i * kGroup + c] = feature c's accumulator for row r0 + i, before the bias.
using TileFn = void (*)(const Q8Activations& x, int64_t r0, const uint8_t* group, float* tile);

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <QuantType T, int R>
void tile_portable(const Q8Activations& x, int64_t r0, const uint8_t* group, float* tile) {
  constexpr bool kQ4 = T == QuantType::kQ4_1;
  const int64_t nb = x.cols / kQuantBlock;
  float acc[R][kGroup] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * group_block_bytes(T);
    for (int64_t c = 0; c < kGroup; ++c) {
      const float dw = f16_to_f32(static_cast<uint16_t>(blk[2 * c] | (blk[2 * c + 1] << 8)));
      const uint8_t* mp = blk + 2 * kGroup + 2 * c;
      const float mw = kQ4 ? f16_to_f32(static_cast<uint16_t>(mp[0] | (mp[1] << 8))) : 0.f;
      for (int i = 0; i < R; ++i) {
        const int64_t xb = (r0 + i) * nb + b;
        const int8_t* xq = x.qs.data() + (r0 + i) * x.cols + b * kQuantBlock;
        int32_t isum = 0;
        for (int64_t k = 0; k < kQuantBlock; ++k) {
          int32_t w;
          if (kQ4) {
            const uint8_t byte = blk[4 * kGroup + (k % 16) / 4 * kChunk + 4 * c + k % 4];
            w = k < 16 ? (byte & 0x0F) : (byte >> 4);
          } else {
            w = blk[2 * kGroup + k / 4 * kChunk + 4 * c + k % 4];
          }
          isum += w * xq[k];
        }
        if (!kQ4) isum -= 128 * x.sum[xb];
        acc[i][c] = std::fma(static_cast<float>(isum), dw * x.scale[xb], acc[i][c]);
        if (kQ4) acc[i][c] = std::fma(mw, x.scaled_sum[xb], acc[i][c]);
      }
    }
  }
  for (int i = 0; i < R; ++i) std::memcpy(tile + i * kGroup, acc[i], sizeof(acc[i]));
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PAGEDLM_Q8_AVX2 1

template <int R>
inline void finish_rows_256(const Q8Activations& x, int64_t r0, int64_t b, const __m256i* isum,
                            __m256 dw, __m256 mw, bool q4, __m256* acc) {
  const int64_t nb = x.cols / kQuantBlock;
  for (int i = 0; i < R; ++i) {
    const int64_t xb = (r0 + i) * nb + b;
    const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.scale[xb]));
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), scale, acc[i]);
    if (q4) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.scaled_sum[xb]), acc[i]);
  }
}

// 8 features (half h of the group) at a time in 256-bit registers. kVnni: dpbusd; otherwise
// maddubs + madd, whose int16 pair sums cannot saturate: Q4_1 products are at most 15 * 127
// (and the block's 8 chunks sum to at most 8 * 2 * 15 * 127 < 32768 in int16); Q8_0 uses |q| and
// x with q's sign, at most 128 * 127 per product.
template <bool kVnni, QuantType T, int R>
void tile_avx2(const Q8Activations& x, int64_t r0, const uint8_t* group, float* tile) {
  constexpr bool kQ4 = T == QuantType::kQ4_1;
  const int64_t nb = x.cols / kQuantBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = group + b * group_block_bytes(T);
      const __m256 dw =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
      __m256 mw = _mm256_setzero_ps();
      __m256i w[8], w_abs[8];
      if constexpr (kQ4) {
        mw = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * kGroup + 16 * h)));
        for (int k = 0; k < 4; ++k) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(blk + 4 * kGroup + k * kChunk + 32 * h));
          w[k] = _mm256_and_si256(v, low);
          w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      } else {
        for (int j = 0; j < 8; ++j) {
          w[j] = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(blk + 2 * kGroup + j * kChunk + 32 * h));
          // maddubs: back to signed q (dpbusd takes the unsigned q + 128 as stored).
          if (!kVnni) {
            w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8(static_cast<char>(0x80)));
            w_abs[j] = _mm256_abs_epi8(w[j]);
          }
        }
      }
      __m256i isum[R];
      for (int i = 0; i < R; ++i) {
        const int8_t* xq = x.qs.data() + (r0 + i) * x.cols + b * kQuantBlock;
        if constexpr (kVnni) {
          __m256i s = _mm256_setzero_si256();
          for (int j = 0; j < 8; ++j) {
            const __m256i xv = _mm256_set1_epi32(load_i32(xq + 4 * j));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            s = _mm256_dpbusd_epi32(s, w[j], xv);
#else
            s = _mm256_dpbusd_avx_epi32(s, w[j], xv);
#endif
          }
          if (!kQ4) s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * x.sum[(r0 + i) * nb + b]));
          isum[i] = s;
        } else if constexpr (kQ4) {
          __m256i s16 = _mm256_setzero_si256();
          for (int j = 0; j < 8; ++j) {
            const __m256i xv = _mm256_set1_epi32(load_i32(xq + 4 * j));
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], xv));
          }
          isum[i] = _mm256_madd_epi16(s16, ones16);
        } else {
          __m256i s = _mm256_setzero_si256();
          for (int j = 0; j < 8; ++j) {
            const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq + 4 * j)), w[j]);
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs[j], xv), ones16));
          }
          isum[i] = s;
        }
      }
      finish_rows_256<R>(x, r0, b, isum, dw, mw, kQ4, acc);
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(tile + i * kGroup + 8 * h, acc[i]);
  }
}

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define PAGEDLM_Q8_AVX_VNNI 1
#endif
#endif

#if defined(PAGEDLM_Q8_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define PAGEDLM_Q8_AVX512 1

// The whole group in one 512-bit register per row. The conversions are the zero-masked forms
// with every lane selected: GCC 12 warns (maybe-uninitialized) inside the unmasked ones.
constexpr __mmask16 kAllLanes = 0xFFFF;

template <QuantType T, int R>
void tile_avx512(const Q8Activations& x, int64_t r0, const uint8_t* group, float* tile) {
  constexpr bool kQ4 = T == QuantType::kQ4_1;
  const int64_t nb = x.cols / kQuantBlock;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * group_block_bytes(T);
    const __m512 dw =
        _mm512_maskz_cvtph_ps(kAllLanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512 mw = _mm512_setzero_ps();
    __m512i w[8];
    if constexpr (kQ4) {
      mw = _mm512_maskz_cvtph_ps(
          kAllLanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 * kGroup)));
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512(blk + 4 * kGroup + k * kChunk);
        w[k] = _mm512_and_si512(v, low);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(blk + 2 * kGroup + j * kChunk);
    }
    for (int i = 0; i < R; ++i) {
      const int64_t xb = (r0 + i) * nb + b;
      const int8_t* xq = x.qs.data() + (r0 + i) * x.cols + b * kQuantBlock;
      __m512i s = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        s = _mm512_dpbusd_epi32(s, w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
      }
      if (!kQ4) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * x.sum[xb]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.scale[xb]));
      acc[i] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAllLanes, s), scale, acc[i]);
      if (kQ4) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.scaled_sum[xb]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(tile + i * kGroup, acc[i]);
}
#endif

// A kernel's tile functions for 1..kMaxTileRows rows, per weight type.
struct KernelTable {
  int max_rows;
  TileFn q4_1[kMaxTileRows];
  TileFn q8_0[kMaxTileRows];
};

template <template <QuantType, int> class K, int... Rs>
constexpr KernelTable make_table(int max_rows, std::integer_sequence<int, Rs...> /*rows*/) {
  return KernelTable{
      max_rows, {K<QuantType::kQ4_1, Rs + 1>::fn...}, {K<QuantType::kQ8_0, Rs + 1>::fn...}};
}

template <QuantType T, int R>
struct Portable {
  static constexpr TileFn fn = tile_portable<T, R>;
};
constexpr KernelTable kPortableTable =
    make_table<Portable>(kMaxTileRows, std::make_integer_sequence<int, kMaxTileRows>{});

#ifdef PAGEDLM_Q8_AVX2
// Four rows at most: two halves of 8 features, each its 8 weight registers and R accumulators.
template <QuantType T, int R>
struct Avx2 {
  static constexpr TileFn fn = tile_avx2<false, T, R>;
};
constexpr KernelTable kAvx2Table = make_table<Avx2>(4, std::make_integer_sequence<int, 4>{});
#ifdef PAGEDLM_Q8_AVX_VNNI
template <QuantType T, int R>
struct AvxVnni {
  static constexpr TileFn fn = tile_avx2<true, T, R>;
};
constexpr KernelTable kAvxVnniTable = make_table<AvxVnni>(4, std::make_integer_sequence<int, 4>{});
#endif
#endif
#ifdef PAGEDLM_Q8_AVX512
template <QuantType T, int R>
struct Avx512 {
  static constexpr TileFn fn = tile_avx512<T, R>;
};
constexpr KernelTable kAvx512Table =
    make_table<Avx512>(kMaxTileRows, std::make_integer_sequence<int, kMaxTileRows>{});
#endif

const KernelTable& table_of(Q8Kernel kernel) {
  switch (kernel) {
    case Q8Kernel::kPortable:
      return kPortableTable;
#ifdef PAGEDLM_Q8_AVX2
    case Q8Kernel::kAvx2:
      return kAvx2Table;
#ifdef PAGEDLM_Q8_AVX_VNNI
    case Q8Kernel::kAvxVnni:
      return kAvxVnniTable;
#endif
#endif
#ifdef PAGEDLM_Q8_AVX512
    case Q8Kernel::kAvx512Vnni:
      return kAvx512Table;
#endif
    default:
      fail("linear_q8: this build has no ", q8_kernel_name(kernel), " kernel");
  }
}

// Weight bytes of the groups one work unit multiplies every row tile by: they stay in L1
// (48 KiB on the machines measured) while the rows pass, together with a tile of x.
constexpr int64_t kUnitWeightBytes = 16 << 10;

}  // namespace

std::vector<Q8Kernel> q8_kernels() {
  std::vector<Q8Kernel> kernels;
#ifdef PAGEDLM_Q8_AVX512
  kernels.push_back(Q8Kernel::kAvx512Vnni);
#endif
#ifdef PAGEDLM_Q8_AVX_VNNI
  kernels.push_back(Q8Kernel::kAvxVnni);
#endif
#ifdef PAGEDLM_Q8_AVX2
  kernels.push_back(Q8Kernel::kAvx2);
#endif
  kernels.push_back(Q8Kernel::kPortable);
  return kernels;
}

const char* q8_kernel_name(Q8Kernel kernel) {
  switch (kernel) {
    case Q8Kernel::kPortable:
      return "portable";
    case Q8Kernel::kAvx2:
      return "AVX2";
    case Q8Kernel::kAvxVnni:
      return "AVX-VNNI (256-bit)";
    case Q8Kernel::kAvx512Vnni:
      return "AVX-512 VNNI";
  }
  return "unknown";
}

void linear_q8(const float* x, const Q8PackedMatrix& weight, const float* bias, float* out,
               int64_t rows, Q8Kernel kernel, int64_t out_stride) {
  if (out_stride < 0) out_stride = weight.rows;
  const KernelTable& table = table_of(kernel);
  const int64_t out_features = weight.rows;
  if (rows == 0 || out_features == 0) return;
  // Once per call: every group of features reads the same quantized rows.
  // (The threads below read it through this reference: by name they would see their own.)
  thread_local Q8Activations scratch;
  const Q8Activations& xq = scratch;
  quantize_q8(x, rows, weight.cols, scratch);
  const int64_t nb = weight.cols / kQuantBlock;
  const int64_t group_bytes = nb * group_block_bytes(weight.type);
  const int64_t num_groups = (out_features + kGroup - 1) / kGroup;
  const int64_t unit_groups = std::max<int64_t>(1, kUnitWeightBytes / group_bytes);
  const int64_t num_units = (num_groups + unit_groups - 1) / unit_groups;
  const TileFn* fns = weight.type == QuantType::kQ4_1 ? table.q4_1 : table.q8_0;
  // Units of whole groups across threads (a feature's arithmetic never depends on the split);
  // within a unit, row tiles outer so each group's weights are read from memory once.
#pragma omp parallel for schedule(static)
  for (int64_t unit = 0; unit < num_units; ++unit) {
    alignas(64) float tile[kMaxTileRows * kGroup];
    const int64_t g0 = unit * unit_groups, g1 = std::min(num_groups, g0 + unit_groups);
    for (int64_t r0 = 0; r0 < rows; r0 += table.max_rows) {
      const int64_t tile_rows = std::min<int64_t>(table.max_rows, rows - r0);
      for (int64_t g = g0; g < g1; ++g) {
        fns[tile_rows - 1](xq, r0, weight.data.data() + g * group_bytes, tile);
        const int64_t col0 = g * kGroup;
        const int64_t n_cols = std::min(kGroup, out_features - col0);
        for (int64_t i = 0; i < tile_rows; ++i) {
          float* dst = out + (r0 + i) * out_stride + col0;
          for (int64_t c = 0; c < n_cols; ++c) {
            dst[c] = tile[i * kGroup + c] + (bias != nullptr ? bias[col0 + c] : 0.f);
          }
        }
      }
    }
  }
}

}  // namespace cpu

void linear_q8(const Tensor& x, const Q8PackedMatrix& weight, const Tensor& bias, const Tensor& out,
               int64_t out_col0) {
  constexpr const char* kOp = "linear (8-bit activations)";
  detail::expect(x, kOp, "x", DType::kF32, {detail::kAnyDim, weight.cols});
  PAGEDLM_CHECK(out.dtype() == DType::kF32 && out.shape().size() == 2 && out.dim(0) == x.dim(0) &&
                    out_col0 >= 0 && out_col0 + weight.rows <= out.dim(1),
                kOp, ": out must be f32 [", x.dim(0), ", >= ", out_col0 + weight.rows,
                "] (columns ", out_col0, " on for this weight's ", weight.rows, " rows), got ",
                dtype_name(out.dtype()), " ", shape_str(out.shape()));
  PAGEDLM_CHECK(x.device() == Device::kCpu && out.device() == Device::kCpu, kOp,
                ": 8-bit activations are a CPU path");
  const int64_t num_groups = (weight.rows + kGroup - 1) / kGroup;
  PAGEDLM_CHECK(weight.cols % kQuantBlock == 0 &&
                    static_cast<int64_t>(weight.data.size()) ==
                        num_groups * (weight.cols / kQuantBlock) * group_block_bytes(weight.type),
                kOp, ": the packed weight does not match its shape [", weight.rows, ", ",
                weight.cols, "]");
  if (bias.defined()) detail::expect(bias, kOp, "bias", DType::kF32, {out.dim(1)});
  cpu::linear_q8(x.data<float>(), weight, bias.defined() ? bias.data<float>() + out_col0 : nullptr,
                 out.data<float>() + out_col0, x.dim(0), cpu::q8_kernels().front(), out.dim(1));
}

}  // namespace pagedlm::ops
