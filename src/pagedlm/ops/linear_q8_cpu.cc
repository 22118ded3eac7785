// The CPU projections with 8-bit activations (--cpu-q8-activations): x is quantized per block of
// 32 (256 for the K-quants) to int8 (ops/linear.h, Q8Activations) and each block's dot product
// with a weight block is an exact integer sum; only the scales are floating point. Not exact (x
// loses its low bits), which is why it is an option.
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
// Q4_0, Q5_0, Q5_1 and the K-quants keep their bits per weight in a super-block layout (SuperLayout
// below): a weight is w = d * sc * (u - offset) - dmin * mn with u its unsigned quant, sc and mn
// the integer scale and min of its 16 or 32 weights, d and dmin its super-block's floats. x is
// quantized per super-block (256 weights: ggml's q8_K; 32 for Q5_1), so that a super-block's
// dot product is one integer, sum sc * (dot(u, q) - offset * sum q) over its sub-blocks, and its
// mins another, sum mn * sum q: per lane and super-block every kernel does
//   acc = fma(float(isum), d_w * d_x, acc); with mins acc = fma(-float(msum), dmin_w * d_x, acc).
// Q4_0, Q5_0 and Q5_1 are the case of one 32-weight sub-block with sc = 1 and f16 d as ggml's
// (Q4_0: offset 8; Q5_0: offset 16; Q5_1: mn = 1 and dmin = -m): Q4_0 so takes its 4.5 bits a
// weight (not the 5 of Q4_1's blocks, which held it before), Q5_0 5.5 (not Q8_0's 8.5).
// IQ4_NL and IQ4_XS are the same with u - offset replaced by a level of ggml's non-linear grid
// (kIq4NlValues[u]): IQ4_NL the case of one 32-weight sub-block with sc = 1 and f16 d (4.5 bits
// a weight, as its file's), IQ4_XS a 256-weight super-block with an int8 scale (ls - 32) per 32
// and f16 d (4.31 bits; the file's 4.25 packs the scales in 6 bits). Their nibbles expanded to
// bytes are mapped through a 16-byte table (pshufb) to the levels + 128 for dpbusd, which takes
// 128 * sum q back off, or to the signed levels for maddubs, which takes |level| and q with the
// level's sign (the levels + 128 times q could saturate its int16 pair sums).
//
// Dispatch is at compile time: the build uses -march=native (as linear_cpu.cc does), so the
// binary runs where it was built and every instruction set the compiler enables is present.
// Each kernel the build can compile is kept, so tests compare them all against the portable one.
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <utility>
#include <vector>

#include "pagedlm/core/dtype.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/prefetch_cpu.h"

namespace pagedlm::ops {

namespace {

constexpr int64_t kGroup = 16;  // output features per packed group
constexpr int64_t kChunk = 4 * kGroup;
constexpr int kMaxTileRows = 8;

constexpr int64_t group_block_bytes(QuantType t) {
  return t == QuantType::kQ4_1 ? 2 * 2 * kGroup + 4 * kChunk : 2 * kGroup + 8 * kChunk;
}

// A super-block format's layout. A group's super-block: d[16], dmin[16] (with mins; f16 or f32),
// then per 32-weight sub-block: `scales` rows of 16 int8 scales (one per 32 weights, or one per
// 16: the first half's row, then the second's), `mins` rows of 16 uint8 mins likewise, the low
// bits of u and its high bit planes:
//   low_bits 4: 4 chunks as Q4_1's (chunk k, lane c, byte e: element 4k + e in the low nibble,
//               16 + 4k + e in the high one);
//   low_bits 2: 2 chunks, chunk v's byte e holding element 4 (4v + t) + e at bits 2t;
//   plane p:    one chunk, byte e's bit j the bit low_bits + p of element 4j + e.
// Expanded, element 4j + e of every lane lands in byte e of chunk j, as a Q8_0 group's.
struct SuperLayout {
  int64_t sb;       // weights per super-block, and per block of quantized x
  int low_bits;     // 4 or 2
  int high_bits;    // bit planes above them
  int scales;       // int8 scale rows per sub-block: 0 (sc = 1), 1 (per 32) or 2 (per 16)
  int mins;         // uint8 min rows per sub-block: 0, 1 or 2; -1: mn = 1 (Q5_1)
  int offset;       // subtracted from u
  int scale_bytes;  // d and dmin as f16 (2: as ggml has them) or f32 (4)
  // IQ4: u indexes kIq4NlValues, whose level takes the place of u - offset (offset 0). The
  // kernels map the expanded bytes through a 16-byte table (pshufb): to the signed levels for
  // maddubs, or to the levels + 128 for dpbusd (unsigned, as it wants; 128 * sum q taken back
  // off, as Q8_0's).
  bool levels = false;
};

constexpr bool is_super(QuantType t) {
  switch (t) {
    case QuantType::kQ4_0:
    case QuantType::kQ5_0:
    case QuantType::kQ5_1:
    case QuantType::kQ2_K:
    case QuantType::kQ3_K:
    case QuantType::kQ4_K:
    case QuantType::kQ5_K:
    case QuantType::kQ6_K:
    case QuantType::kIQ4_NL:
    case QuantType::kIQ4_XS:
      return true;
    default:
      return false;
  }
}

constexpr SuperLayout super_layout(QuantType t) {
  switch (t) {
    case QuantType::kQ4_0:
      return {32, 4, 0, 0, 0, 8, 2};
    case QuantType::kQ5_0:
      return {32, 4, 1, 0, 0, 16, 2};
    case QuantType::kQ5_1:
      return {32, 4, 1, 0, -1, 0, 2};
    case QuantType::kQ2_K:
      return {256, 2, 0, 2, 2, 0, 4};
    case QuantType::kQ3_K:
      return {256, 2, 1, 2, 0, 4, 4};
    case QuantType::kQ4_K:
      return {256, 4, 0, 1, 1, 0, 4};
    case QuantType::kQ5_K:
      return {256, 4, 1, 1, 1, 0, 4};
    case QuantType::kIQ4_NL:
      return {32, 4, 0, 0, 0, 0, 2, true};
    case QuantType::kIQ4_XS:
      return {256, 4, 0, 1, 0, 0, 2, true};
    default:  // kQ6_K
      return {256, 4, 2, 2, 0, 32, 4};
  }
}

constexpr bool has_min(const SuperLayout& l) { return l.mins != 0; }
constexpr int64_t sub_header_bytes(const SuperLayout& l) {
  return kGroup * (l.scales + std::max(l.mins, 0));
}
constexpr int64_t sub_bytes(const SuperLayout& l) {
  return sub_header_bytes(l) + kChunk * (l.low_bits + l.high_bits);
}
constexpr int64_t super_header_bytes(const SuperLayout& l) {
  return l.scale_bytes * kGroup * (has_min(l) ? 2 : 1);
}
constexpr int64_t super_group_bytes(const SuperLayout& l) {
  return super_header_bytes(l) + l.sb / kQuantBlock * sub_bytes(l);
}

// Bytes of one group of 16 features over `cols` inputs.
int64_t packed_group_bytes(QuantType t, int64_t cols) {
  if (is_super(t)) return cols / super_layout(t).sb * super_group_bytes(super_layout(t));
  return cols / kQuantBlock * group_block_bytes(t);
}

// The weights per quantized block of x a layout wants.
int64_t activation_block(QuantType t) { return is_super(t) ? super_layout(t).sb : kQuantBlock; }

// Row r's quantized x in sub-block `sub` of super-block b (of sb weights), and the sums of its
// two halves' quants.
inline const int8_t* sub_block_quants(const cpu::Q8Activations& x, int64_t r, int64_t sb, int64_t b,
                                      int64_t sub) {
  return x.qs.data() + r * x.cols + b * sb + sub * kQuantBlock;
}
inline const int32_t* sub_block_sums16(const cpu::Q8Activations& x, int64_t r, int64_t sb,
                                       int64_t b, int64_t sub) {
  return x.sum16.data() + (r * x.cols + b * sb) / 16 + 2 * sub;
}

// One super-block of one feature, decomposed: w_k = d * sc_k * (u_k - offset) - dmin * mn_k.
struct SuperBlock {
  float d = 0.f, dmin = 0.f;
  uint8_t u[kMaxQuantBlockElems] = {};
  int8_t sc[kMaxQuantBlockElems / 16] = {};  // per 16 weights
  uint8_t mn[kMaxQuantBlockElems / 16] = {};
};

float f32_at(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// From ggml's Q4_0, Q5_0 or Q5_1 block, or from the CPU's repacking of a K-quant's
// (core/quantized.h: its scales unpacked, its high bits transposed), whose fields are read here as
// that header lays them out.
SuperBlock decompose(QuantType t, const uint8_t* b) {
  SuperBlock s;
  auto nibble = [](const uint8_t* q, int64_t k) {  // k of 256 in Q4_K's nibble order
    return (q[32 * (k / 64) + k % 32] >> (4 * (k / 32 % 2))) & 0x0F;
  };
  auto crumb = [](const uint8_t* q, int64_t k) {  // k of 256 in Q3_K's / Q2_K's 2-bit order
    return (q[32 * (k / 128) + k % 32] >> (2 * (k / 32 % 4))) & 3;
  };
  auto high_bit = [](const uint8_t* words, int64_t k) {  // one u32 per sub-block of 32
    uint32_t w;
    std::memcpy(&w, words + 4 * (k / 32), 4);
    return static_cast<int>((w >> (k % 32)) & 1);
  };
  switch (t) {
    case QuantType::kQ5_1: {  // f16 d, f16 m, u32 qh, 16 bytes of nibbles
      uint16_t d, m;
      std::memcpy(&d, b, 2);
      std::memcpy(&m, b + 2, 2);
      s.d = f16_to_f32(d);
      s.dmin = -f16_to_f32(m);
      for (int64_t k = 0; k < 32; ++k) {
        const int low = (b[8 + k % 16] >> (4 * (k / 16))) & 0x0F;
        s.u[k] = static_cast<uint8_t>(low | (high_bit(b + 4, k) << 4));
      }
      break;
    }
    case QuantType::kQ4_0:      // f16 d, 16 bytes of nibbles; u - 8
    case QuantType::kIQ4_NL: {  // the same bytes; u a level's index
      uint16_t d;
      std::memcpy(&d, b, 2);
      s.d = f16_to_f32(d);
      for (int64_t k = 0; k < 32; ++k) s.u[k] = (b[2 + k % 16] >> (4 * (k / 16))) & 0x0F;
      break;
    }
    case QuantType::kQ5_0: {  // f16 d, u32 qh, 16 bytes of nibbles; u - 16
      uint16_t d;
      std::memcpy(&d, b, 2);
      s.d = f16_to_f32(d);
      for (int64_t k = 0; k < 32; ++k) {
        const int low = (b[6 + k % 16] >> (4 * (k / 16))) & 0x0F;
        s.u[k] = static_cast<uint8_t>(low | (high_bit(b + 2, k) << 4));
      }
      break;
    }
    case QuantType::kQ4_KF32:  // f32 d, f32 dmin, u8 sc[8], u8 m[8], nibbles
    case QuantType::kQ5_KF32:  // the same, u32 fifth[8] before the nibbles
    {
      const bool five = t == QuantType::kQ5_KF32;
      s.d = f32_at(b);
      s.dmin = f32_at(b + 4);
      for (int64_t i = 0; i < 16; ++i) {
        s.sc[i] = static_cast<int8_t>(b[8 + i / 2]);
        s.mn[i] = b[16 + i / 2];
      }
      for (int64_t k = 0; k < 256; ++k) {
        s.u[k] = static_cast<uint8_t>(five ? nibble(b + 56, k) | (high_bit(b + 24, k) << 4)
                                           : nibble(b + 24, k));
      }
      break;
    }
    case QuantType::kQ6_KF32: {  // f32 d, int8 sc[16], ql[128], qh[64]
      s.d = f32_at(b);
      std::memcpy(s.sc, b + 4, 16);
      const uint8_t *ql = b + 20, *qh = b + 148;
      for (int64_t k = 0; k < 256; ++k) {
        const int64_t half = k / 128, quarter = k % 128 / 32, l = k % 32;
        const int low = (ql[64 * half + 32 * (quarter % 2) + l] >> (4 * (quarter / 2))) & 0x0F;
        const int high = (qh[32 * half + l] >> (2 * quarter)) & 3;
        s.u[k] = static_cast<uint8_t>(low | (high << 4));
      }
      break;
    }
    case QuantType::kQ3_KF32: {  // f32 d, int8 sc[16] (less 32), u32 hmask[8], qs[64]
      s.d = f32_at(b);
      std::memcpy(s.sc, b + 4, 16);
      for (int64_t k = 0; k < 256; ++k) {
        s.u[k] = static_cast<uint8_t>(crumb(b + 52, k) | (high_bit(b + 20, k) << 2));
      }
      break;
    }
    case QuantType::kIQ4_XSF32: {  // f32 d, int8 sc[8] (less 32), 16 bytes of nibbles per 32
      s.d = f32_at(b);
      for (int64_t i = 0; i < 16; ++i) s.sc[i] = static_cast<int8_t>(b[4 + i / 2]);
      for (int64_t k = 0; k < 256; ++k) {
        s.u[k] = (b[12 + 16 * (k / 32) + k % 16] >> (4 * (k % 32 / 16))) & 0x0F;
      }
      break;
    }
    case QuantType::kQ2_KF32: {  // f32 d, f32 dmin, scales (low nibble) and mins, qs[64]
      s.d = f32_at(b);
      s.dmin = f32_at(b + 4);
      for (int64_t i = 0; i < 16; ++i) {
        s.sc[i] = static_cast<int8_t>(b[8 + i] & 0x0F);
        s.mn[i] = b[8 + i] >> 4;
      }
      for (int64_t k = 0; k < 256; ++k) s.u[k] = static_cast<uint8_t>(crumb(b + 24, k));
      break;
    }
    default:
      fail("pack_for_q8: no super-block decomposition of ", quant_format(t).name);
  }
  return s;
}

// Lane c of a group's super-block at dst from one feature's decomposition.
void put_super_lane(const SuperLayout& l, const SuperBlock& s, int64_t c, uint8_t* dst) {
  auto put_scale = [&](float v, uint8_t* at) {
    if (l.scale_bytes == 2) {
      const uint16_t h = f32_to_f16(v);  // exact: d and m came from f16
      std::memcpy(at + 2 * c, &h, 2);
    } else {
      std::memcpy(at + 4 * c, &v, 4);
    }
  };
  put_scale(s.d, dst);
  if (has_min(l)) put_scale(s.dmin, dst + l.scale_bytes * kGroup);
  for (int64_t sub = 0; sub < l.sb / kQuantBlock; ++sub) {
    uint8_t* p = dst + super_header_bytes(l) + sub * sub_bytes(l);
    const uint8_t* u = s.u + sub * kQuantBlock;
    for (int r = 0; r < l.scales; ++r) {
      p[r * kGroup + c] = static_cast<uint8_t>(s.sc[2 * sub + r]);
    }
    for (int r = 0; r < l.mins; ++r) p[(l.scales + r) * kGroup + c] = s.mn[2 * sub + r];
    uint8_t* q = p + sub_header_bytes(l);
    for (int e = 0; e < 4; ++e) {
      if (l.low_bits == 4) {
        for (int k = 0; k < 4; ++k) {
          q[k * kChunk + 4 * c + e] =
              static_cast<uint8_t>((u[4 * k + e] & 0x0F) | ((u[16 + 4 * k + e] & 0x0F) << 4));
        }
      } else {
        for (int v = 0; v < 2; ++v) {
          int byte = 0;
          for (int t = 0; t < 4; ++t) byte |= (u[4 * (4 * v + t) + e] & 3) << (2 * t);
          q[v * kChunk + 4 * c + e] = static_cast<uint8_t>(byte);
        }
      }
      for (int plane = 0; plane < l.high_bits; ++plane) {
        int byte = 0;
        for (int j = 0; j < 8; ++j) byte |= ((u[4 * j + e] >> (l.low_bits + plane)) & 1) << j;
        q[(l.low_bits + plane) * kChunk + 4 * c + e] = static_cast<uint8_t>(byte);
      }
    }
  }
}

// Lane c's d (or dmin) of a group's super-block header at p.
float header_scale(const SuperLayout& l, const uint8_t* p, int64_t c) {
  if (l.scale_bytes == 4) return f32_at(p + 4 * c);
  uint16_t h;
  std::memcpy(&h, p + 2 * c, 2);
  return f16_to_f32(h);
}

// Element k (0..31) of lane c's unsigned quants in a super-block layout's sub-block q.
int super_quant(const SuperLayout& l, const uint8_t* q, int64_t c, int64_t k) {
  const int64_t j = k / 4, e = k % 4;
  int u;
  if (l.low_bits == 4) {
    u = (q[j % 4 * kChunk + 4 * c + e] >> (4 * (j / 4))) & 0x0F;
  } else {
    u = (q[j / 4 * kChunk + 4 * c + e] >> (2 * (j % 4))) & 3;
  }
  for (int plane = 0; plane < l.high_bits; ++plane) {
    u |= ((q[(l.low_bits + plane) * kChunk + 4 * c + e] >> j) & 1) << (l.low_bits + plane);
  }
  return u;
}

// The integer a weight's unsigned quant u stands for: u - offset, or IQ4's level u.
constexpr int quant_value(const SuperLayout& l, int u) {
  return l.levels ? kIq4NlValues[u] : u - l.offset;
}

Q8PackedMatrix pack_super(const QuantizedMatrix& weight) {
  const SuperLayout l = super_layout(weight.type);
  // The K-quants and IQ4_XS are read from their repacking at load, whose fields are unpacked.
  const QuantizedMatrix repacked = l.sb == kQuantBlock ? weight : repack_for_cpu(weight);
  Q8PackedMatrix p;
  p.type = weight.type;
  p.rows = weight.rows;
  p.cols = weight.cols;
  const int64_t nsb = weight.cols / l.sb;
  const int64_t num_groups = (weight.rows + kGroup - 1) / kGroup;
  const int64_t src_bytes = quant_block_bytes(repacked.type);
  // Padding features (past rows) are zero: d = 0.
  p.data.assign(num_groups * nsb * super_group_bytes(l), 0);
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int64_t b = 0; b < nsb; ++b) {
      uint8_t* dst = p.data.data() + (g * nsb + b) * super_group_bytes(l);
      for (int64_t c = 0; c < kGroup && g * kGroup + c < weight.rows; ++c) {
        const int64_t n = g * kGroup + c;
        const SuperBlock s = decompose(
            repacked.type, repacked.blocks.data() + n * repacked.row_bytes() + b * src_bytes);
        put_super_lane(l, s, c, dst);
      }
    }
  }
  return p;
}

}  // namespace

bool q8_packs(QuantType type) {
  return type == QuantType::kQ4_1 || type == QuantType::kQ8_0 || is_super(type);
}

Q8PackedMatrix pack_for_q8(const QuantizedMatrix& weight) {
  PAGEDLM_CHECK(weight.cols % kQuantBlock == 0 &&
                    static_cast<int64_t>(weight.blocks.size()) == weight.rows * weight.row_bytes(),
                "pack_for_q8: the weight's blocks do not match its shape [", weight.rows, ", ",
                weight.cols, "]");
  PAGEDLM_CHECK(
      q8_packs(weight.type),
      "pack_for_q8: takes ggml's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, IQ4_NL, "
      "IQ4_XS), not ",
      quant_format(weight.type).name);
  if (is_super(weight.type)) return pack_super(weight);
  Q8PackedMatrix p;
  p.type = weight.type;
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
        const uint8_t* src = weight.blocks.data() + n * weight.row_bytes() + b * src_bytes;
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
              p.has_q_minus_128 |= src[2 + 4 * j + e] == 0x80;
            }
          }
        }
      }
    }
  }
  return p;
}

void dequantize_row(const Q8PackedMatrix& m, int64_t r, float* out) {
  PAGEDLM_CHECK(r >= 0 && r < m.rows, "dequantize_row: row ", r, " of ", m.rows);
  const int64_t c = r % kGroup;
  const uint8_t* group = m.data.data() + r / kGroup * packed_group_bytes(m.type, m.cols);
  auto half = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return f16_to_f32(h);
  };
  if (!is_super(m.type)) {
    const bool q4 = m.type == QuantType::kQ4_1;
    for (int64_t b = 0; b < m.cols / kQuantBlock; ++b) {
      const uint8_t* blk = group + b * group_block_bytes(m.type);
      const float d = half(blk + 2 * c);
      float* o = out + b * kQuantBlock;
      if (q4) {  // ggml's q * d + m
        const float mw = half(blk + 2 * kGroup + 2 * c);
        for (int64_t k = 0; k < kQuantBlock; ++k) {
          const uint8_t byte = blk[4 * kGroup + k % 16 / 4 * kChunk + 4 * c + k % 4];
          o[k] = static_cast<float>(k < 16 ? byte & 0x0F : byte >> 4) * d + mw;
        }
      } else {  // q stored as q + 128
        for (int64_t k = 0; k < kQuantBlock; ++k) {
          const auto q =
              static_cast<int8_t>(blk[2 * kGroup + k / 4 * kChunk + 4 * c + k % 4] ^ 0x80);
          o[k] = static_cast<float>(q) * d;
        }
      }
    }
    return;
  }
  // ggml's (d * sc) * (u - offset) - dmin * mn, in that order (its dequantize_row_q*_K).
  const SuperLayout l = super_layout(m.type);
  for (int64_t b = 0; b < m.cols / l.sb; ++b) {
    const uint8_t* blk = group + b * super_group_bytes(l);
    const float d = header_scale(l, blk, c);
    const float dmin = has_min(l) ? header_scale(l, blk + l.scale_bytes * kGroup, c) : 0.f;
    for (int64_t sub = 0; sub < l.sb / kQuantBlock; ++sub) {
      const uint8_t* p = blk + super_header_bytes(l) + sub * sub_bytes(l);
      float* o = out + b * l.sb + sub * kQuantBlock;
      for (int64_t k = 0; k < kQuantBlock; ++k) {
        const int h = static_cast<int>(k / 16);
        const int sc =
            l.scales == 0 ? 1 : static_cast<int8_t>(p[(l.scales == 2 ? h : 0) * kGroup + c]);
        const int mn = l.mins < 0    ? 1
                       : l.mins == 0 ? 0
                                     : p[(l.scales + (l.mins == 2 ? h : 0)) * kGroup + c];
        const float value =
            static_cast<float>(quant_value(l, super_quant(l, p + sub_header_bytes(l), c, k)));
        o[k] = has_min(l) ? d * static_cast<float>(sc) * value - dmin * static_cast<float>(mn)
                          : d * static_cast<float>(sc) * value;
      }
    }
  }
}

namespace cpu {

namespace {
// out sized for `rows` integer rows of `cols` values in blocks of `block`.
void size_activations(const char* op, int64_t rows, int64_t cols, int64_t block,
                      Q8Activations& out) {
  PAGEDLM_CHECK(block % 16 == 0 && block > 0 && cols % block == 0, op, ": ", cols,
                " columns are not whole blocks of ", block);
  const int64_t nb = cols / block;
  out.rows = rows;
  out.cols = cols;
  out.block = block;
  out.qs.resize(rows * cols);
  out.scale.resize(rows * nb);
  out.sum.resize(rows * nb);
  out.scaled_sum.resize(rows * nb);
  out.sum16.resize(rows * cols / 16);
}

// The largest |x| of a block of n (a multiple of 16) values, as the in-order std::max chain
// from 0 gives it, but 16 or 8 lanes at a time (the chain alone took 40% of quantize_q8's
// time): the maximum of a set of non-negative floats does not depend on the order, and maxps
// returns its second operand, the running maximum, where x is a NaN, as std::max(m, NaN) does.
// And whether every value is finite (|x| <= FLT_MAX, which a NaN and an infinity fail).
struct BlockMagnitude {
  float amax;
  bool finite;
};

BlockMagnitude block_magnitude(const float* x, int64_t n) {
  constexpr float kLargest = std::numeric_limits<float>::max();
#if defined(__AVX512F__)
  // The zero-masked forms with every lane kept: GCC 12 warns (maybe-uninitialized) in the plain.
  constexpr __mmask16 kAll = 0xFFFF;
  __m512 m = _mm512_setzero_ps();
  __mmask16 beyond = 0;  // lanes that met a NaN or an infinity
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + j));
    beyond |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(kLargest), _CMP_NLE_UQ);
    m = _mm512_maskz_max_ps(kAll, a, m);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, m);
  bool finite = beyond == 0;
#elif defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps(), beyond = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + j), magnitude);
    beyond = _mm256_or_ps(beyond, _mm256_cmp_ps(a, _mm256_set1_ps(kLargest), _CMP_NLE_UQ));
    m = _mm256_max_ps(a, m);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  bool finite = _mm256_movemask_ps(beyond) == 0;
#endif
  // The lanes' maxima (magnitudes already) folded, or without vectors the block itself.
#if defined(__AVX512F__) || defined(__AVX2__)
  const float* values = lanes;
  const int64_t count = std::size(lanes);
#else
  const float* values = x;
  const int64_t count = n;
  bool finite = true;
#endif
  float amax = 0.f;
  for (int64_t j = 0; j < count; ++j) {
    const float a = std::abs(values[j]);
    finite &= a <= kLargest;
    amax = std::max(amax, a);
  }
  return {amax, finite};
}
}  // namespace

void quantize_q8(const float* x, int64_t rows, int64_t cols, Q8Activations& out, int64_t block) {
  size_activations("quantize_q8", rows, cols, block, out);
  const int64_t nb = cols / block;
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * cols + b * block;
      const float d = block_magnitude(xb, block).amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = out.qs.data() + r * cols + b * block;
      int32_t sum = 0;
      for (int64_t j = 0; j < block; ++j) {
        // |x * id| <= 127 up to rounding, so the value fits an int8.
        q[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
        sum += q[j];
      }
      for (int64_t h = 0; h < block / 16; ++h) {
        int32_t s16 = 0;
        for (int64_t j = 0; j < 16; ++j) s16 += q[16 * h + j];
        out.sum16[(r * cols + b * block) / 16 + h] = s16;
      }
      out.scale[r * nb + b] = d;
      out.sum[r * nb + b] = sum;
      out.scaled_sum[r * nb + b] = d * static_cast<float>(sum);
    }
  }
}

// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_*() and then warn about
// it (as linear_cpu.cc says).
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
void quantize_fixed32(const float* x, int64_t rows, int64_t cols, Q8Activations& out,
                      int64_t block) {
  size_activations("quantize_fixed32", kFixed32Planes * rows, cols, block, out);
  const int64_t nb = cols / block;
  // Below this the planes' scales would leave float32's normal range.
  constexpr int kMinExponent = -96;
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * cols + b * block;
      const auto [amax, finite] = block_magnitude(xb, block);
      const int e = finite && amax > 0.f ? std::ilogb(amax) : kMinExponent - 1;
      const bool zero = e < kMinExponent;  // or not finite: digits 0, and the scales say which
      // x * 2^(29 - e) is exact (a power of two, in range) and below 2^30 in magnitude, so it
      // rounds to an int32 m with four balanced base-256 digits.
      const float to_units = zero ? 0.f : std::ldexp(1.f, 29 - e);
      // Where plane p's values j0.. of this block start in out.qs (and, over 16, in out.sum16).
      auto plane_at = [&](int64_t p, int64_t j0) {
        return (kFixed32Planes * r + p) * cols + b * block + j0;
      };
      int32_t sum[kFixed32Planes] = {};
      for (int64_t j0 = 0; j0 < block; j0 += 16) {
        int32_t sum16[kFixed32Planes] = {};
        if (zero) {
          for (int64_t p = 0; p < kFixed32Planes; ++p) {
            std::memset(out.qs.data() + plane_at(p, j0), 0, 16);
          }
        } else {
#ifdef __AVX512F__
          // The same digits, 16 at a time (the conversion rounds to nearest even, as nearbyint
          // does in the default rounding mode): the scalar loop took 8% of a decode step.
          __m512i m =
              _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + j0), _mm512_set1_ps(to_units)));
          for (int64_t p = kFixed32Planes - 1; p >= 0; --p) {
            const __m512i digit = _mm512_srai_epi32(_mm512_slli_epi32(m, 24), 24);
            m = _mm512_srai_epi32(_mm512_sub_epi32(m, digit), 8);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out.qs.data() + plane_at(p, j0)),
                             _mm512_cvtepi32_epi8(digit));
            sum16[p] = _mm512_reduce_add_epi32(digit);
          }
#else
          for (int64_t j = 0; j < 16; ++j) {
            int32_t m = static_cast<int32_t>(std::nearbyint(xb[j0 + j] * to_units));
            for (int64_t p = kFixed32Planes - 1; p >= 0; --p) {
              const auto digit = static_cast<int8_t>(m);  // m's low byte, as -128..127
              m = (m - digit) >> 8;                       // exact: the low byte is now 0
              out.qs[plane_at(p, j0) + j] = digit;
              sum16[p] += digit;
            }
          }
#endif
        }
        for (int64_t p = 0; p < kFixed32Planes; ++p) {
          out.sum16[plane_at(p, j0) / 16] = sum16[p];
          sum[p] += sum16[p];
        }
      }
      for (int64_t p = 0; p < kFixed32Planes; ++p) {
        const int64_t at = (kFixed32Planes * r + p) * nb + b;
        const float d = !finite ? std::numeric_limits<float>::quiet_NaN()
                                : (zero ? 0.f : std::ldexp(1.f, e - 5 - 8 * static_cast<int>(p)));
        out.scale[at] = d;
        out.sum[at] = sum[p];
        out.scaled_sum[at] = d * static_cast<float>(sum[p]);
      }
    }
  }
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif

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

template <QuantType T, int R>
void tile_super_portable(const Q8Activations& x, int64_t r0, const uint8_t* group, float* tile) {
  constexpr SuperLayout kL = super_layout(T);
  const int64_t nsb = x.cols / kL.sb;
  float acc[R][kGroup] = {};
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* blk = group + b * super_group_bytes(kL);
    for (int64_t c = 0; c < kGroup; ++c) {
      const float dw = header_scale(kL, blk, c);
      const float dmin = has_min(kL) ? header_scale(kL, blk + kL.scale_bytes * kGroup, c) : 0.f;
      for (int i = 0; i < R; ++i) {
        const int64_t xb = (r0 + i) * nsb + b;
        const int8_t* xq = x.qs.data() + (r0 + i) * x.cols + b * kL.sb;
        const int32_t* xs16 = x.sum16.data() + ((r0 + i) * x.cols + b * kL.sb) / 16;
        int32_t isum = 0, msum = 0;
        for (int64_t sub = 0; sub < kL.sb / kQuantBlock; ++sub) {
          const uint8_t* p = blk + super_header_bytes(kL) + sub * sub_bytes(kL);
          for (int h = 0; h < 2; ++h) {
            int32_t dot = 0;
            for (int64_t k = 16 * h; k < 16 * h + 16; ++k) {
              dot += quant_value(kL, super_quant(kL, p + sub_header_bytes(kL), c, k)) *
                     xq[sub * kQuantBlock + k];
            }
            const int32_t xsum = xs16[2 * sub + h];
            const int32_t sc =
                kL.scales == 0 ? 1 : static_cast<int8_t>(p[(kL.scales == 2 ? h : 0) * kGroup + c]);
            isum += sc * dot;
            if (kL.mins != 0) {
              const int32_t mn =
                  kL.mins < 0 ? 1 : p[(kL.scales + (kL.mins == 2 ? h : 0)) * kGroup + c];
              msum += mn * xsum;
            }
          }
        }
        acc[i][c] = std::fma(static_cast<float>(isum), dw * x.scale[xb], acc[i][c]);
        if (has_min(kL)) {
          acc[i][c] = std::fma(-static_cast<float>(msum), dmin * x.scale[xb], acc[i][c]);
        }
      }
    }
  }
  for (int i = 0; i < R; ++i) std::memcpy(tile + i * kGroup, acc[i], sizeof(acc[i]));
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PAGEDLM_Q8_AVX2 1
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define PAGEDLM_Q8_AVX_VNNI 1
#endif

// A byte lookup table (pshufb, vpermb) of N entries, entry i = entry(i), built at compile time.
template <int N>
struct ByteTable {
  uint8_t v[N];
};
template <int N, typename Entry>
constexpr ByteTable<N> byte_table(Entry entry) {
  ByteTable<N> t{};
  for (int i = 0; i < N; ++i) t.v[i] = static_cast<uint8_t>(entry(i));
  return t;
}

// IQ4's levels as the bytes a pshufb maps each index to: signed, or + 128 (unsigned).
alignas(16) constexpr auto kSignedLevels = byte_table<16>([](int i) { return kIq4NlValues[i]; });
#ifdef PAGEDLM_Q8_AVX_VNNI  // dpbusd's unsigned bytes: the VNNI kernels' alone
alignas(16) constexpr auto kUnsignedLevels = byte_table<16>([](int i) {
  return kIq4NlValues[i] + 128;
});
#endif
// The offset a kernel takes off each quant's dot product: the layout's, or for IQ4 128 where its
// bytes are the levels + 128 (dpbusd), 0 where they are the signed levels (maddubs).
constexpr int kernel_offset(const SuperLayout& l, bool unsigned_levels) {
  return l.levels ? (unsigned_levels ? 128 : 0) : l.offset;
}

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

// maddubs of signed weights w (|w| in w_abs) and 4 bytes of x broadcast: pair sums of w * x.
// maddubs wants one side unsigned: |w| and x with w's sign, or (kSignsOnW) |x| and w with x's
// sign, for x digits of -128, whose sign cannot flip in an int8 (no w is -128 there).
template <bool kSignsOnW>
inline __m256i signed_products(__m256i w, __m256i w_abs, int32_t x4) {
  const __m256i xv = _mm256_set1_epi32(x4);
  if constexpr (kSignsOnW) {
    return _mm256_maddubs_epi16(_mm256_abs_epi8(xv), _mm256_sign_epi8(w, xv));
  } else {
    return _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xv, w));
  }
}

// 8 features (half h of the group) at a time in 256-bit registers. kVnni: dpbusd; otherwise
// maddubs + madd, whose int16 pair sums cannot saturate: Q4_1 products are at most 15 * 128
// (and the block's 8 chunks sum to at most 8 * 2 * 15 * 128 < 32768 in int16); Q8_0 uses |q| and
// x with q's sign, at most 128 * 127 per product, or with kSignsOnW (32-bit fixed point, whose
// digits reach -128, which takes no sign flip) |x| and q with x's sign, at most 128 * 127 where
// no q is -128 (Q8PackedMatrix::has_q_minus_128).
template <bool kVnni, bool kSignsOnW, QuantType T, int R>
void tile_avx2(const Q8Activations& x, int64_t r0, const uint8_t* group, float* tile) {
  constexpr bool kQ4 = T == QuantType::kQ4_1;
  const int64_t nb = x.cols / kQuantBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  // One row takes both halves in one pass, as tile_super_avx2 does.
  constexpr int kHalves = R == 1 ? 2 : 1;
  for (int h0 = 0; h0 < 2; h0 += kHalves) {
    __m256 acc[kHalves][R];
    for (int hh = 0; hh < kHalves; ++hh) {
      for (int i = 0; i < R; ++i) acc[hh][i] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = group + b * group_block_bytes(T);
      // One row reads each weight once; more rows read a unit's weights again from cache, where
      // the hint only costs instructions (SmolLM2 Q4_1 prefill measured 0.99-1.17x the time).
      if (R == 1) prefetch_ahead(blk, blk + group_block_bytes(T));
      for (int hh = 0; hh < kHalves; ++hh) {
        const int h = h0 + hh;
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
              w_abs[j] = kSignsOnW ? w[j] : _mm256_abs_epi8(w[j]);  // unread with kSignsOnW
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
              s = _mm256_add_epi32(
                  s, _mm256_madd_epi16(
                         signed_products<kSignsOnW>(w[j], w_abs[j], load_i32(xq + 4 * j)), ones16));
            }
            isum[i] = s;
          }
        }
        finish_rows_256<R>(x, r0, b, isum, dw, mw, kQ4, acc[hh]);
      }
    }
    for (int hh = 0; hh < kHalves; ++hh) {
      for (int i = 0; i < R; ++i) _mm256_storeu_ps(tile + i * kGroup + 8 * (h0 + hh), acc[hh][i]);
    }
  }
}

// A super-block layout's sub-block quants q expanded to the 8 chunks of a Q8_0 group (unsigned
// u), lanes [8h, 8h + 8) (256-bit) or all 16 (512-bit): V is the register type. Shifts are per
// 16 bits; every bit kept by the masks comes from the byte it lands in.
template <typename V, typename Ops>
inline void expand_super(const SuperLayout& l, const uint8_t* q, V* w) {
  if (l.low_bits == 4) {
    for (int k = 0; k < 4; ++k) {
      const V v = Ops::load(q + k * kChunk);
      w[k] = Ops::and_(v, Ops::bytes(0x0F));
      w[k + 4] = Ops::and_(Ops::srli16(v, 4), Ops::bytes(0x0F));
    }
  } else {
    for (int c = 0; c < 2; ++c) {
      const V v = Ops::load(q + c * kChunk);
      for (int t = 0; t < 4; ++t) w[4 * c + t] = Ops::and_(Ops::srli16(v, 2 * t), Ops::bytes(3));
    }
  }
  if (l.low_bits == 4 && l.high_bits == 2) {
    // Both planes at once (Q6_K): `even` holds bit 2k of plane 4 at 2k and of plane 5 at 2k + 1,
    // `odd` bit 2k + 1 of each likewise, so chunk j moves one bit pair to bits 4 and 5: three
    // operations a chunk instead of six.
    const V h4 = Ops::load(q + 4 * kChunk), h5 = Ops::load(q + 5 * kChunk);
    const V even =
        Ops::or_(Ops::and_(h4, Ops::bytes(0x55)), Ops::and_(Ops::slli16(h5, 1), Ops::bytes(0xAA)));
    const V odd =
        Ops::or_(Ops::and_(Ops::srli16(h4, 1), Ops::bytes(0x55)), Ops::and_(h5, Ops::bytes(0xAA)));
    for (int j = 0; j < 8; ++j) {
      const V pair = j % 2 == 0 ? even : odd;
      const int at = 2 * (j / 2);
      const V moved = at < 4   ? Ops::slli16(pair, 4 - at)
                      : at > 4 ? Ops::srli16(pair, at - 4)
                               : pair;
      w[j] = Ops::or_(w[j], Ops::and_(moved, Ops::bytes(0x30)));
    }
    return;
  }
  for (int plane = 0; plane < l.high_bits; ++plane) {
    const int bit = l.low_bits + plane;
    const V h = Ops::load(q + bit * kChunk);
    for (int j = 0; j < 8; ++j) w[j] = Ops::with_bit(w[j], h, j, bit);
  }
}

struct Ops256 {
  static __m256i load(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static __m256i and_(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
  static __m256i or_(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
  static __m256i srli16(__m256i a, int n) { return _mm256_srli_epi16(a, n); }
  static __m256i slli16(__m256i a, int n) { return _mm256_slli_epi16(a, n); }
  // w with bit `to` of each byte set where bit `from` of h's byte is (clear in w before).
  static __m256i with_bit(__m256i w, __m256i h, int from, int to) {
    const __m256i moved = from < to ? slli16(h, to - from) : srli16(h, from - to);
    return or_(w, and_(moved, bytes(1 << to)));
  }
};

// Lanes [8h, 8h + 8) of a super-block header's d (or dmin) at p.
inline __m256 header_scales_256(const SuperLayout& l, const uint8_t* p, int h) {
  if (l.scale_bytes == 4) return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * h);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
}

// Two rows of lane bytes at a and b (lanes [8h, 8h + 8)) as int16 pairs: int32 lane c holds
// (a[c], b[c]), the multiplier madd wants.
inline __m256i lane_pairs_256(const uint8_t* a, const uint8_t* b, bool is_signed) {
  const __m128i v = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return is_signed ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
}

// x's two sums of 16 over a sub-block (each at most 16 * 127) as the int16 pair (xs[0], xs[1])
// in every int32 lane.
inline __m256i sum_pairs_256(const int32_t* xs) {
  const uint32_t pair =
      (static_cast<uint32_t>(xs[1]) << 16) | (static_cast<uint32_t>(xs[0]) & 0xFFFFu);
  return _mm256_set1_epi32(static_cast<int32_t>(pair));
}

// How many chunks of maddubs products one int16 lane sums before madd widens them: as many as
// cannot saturate (a pair sum is at most 2 * 127 * the largest |w|) and share one scale.
constexpr int int16_chunks(const SuperLayout& l) {
  const int w_max = l.levels ? 127 : (1 << (l.low_bits + l.high_bits)) - 1;
  const int limit = l.scales == 2 ? 4 : 8;
  int chunks = 1;
  while (2 * chunks <= limit && 2 * chunks * 2 * w_max * 127 <= 32767) chunks *= 2;
  return chunks;
}

// One sub-block's integer sums without VNNI, added to isum and msum: maddubs products summed in
// int16 over int16_chunks() chunks, then widened by madd with the lane's integer scale as the
// multiplier (1 without scales), so no int32 multiply is left per half. The offset comes off as
// offset * sum sc * xs (one madd of the scale pairs times offset against x's sum pairs) and the
// mins as one madd of the min pairs: the same integers as sc * (dot - offset * xs) and mn * xs.
template <bool kSignsOnW, QuantType T, int R>
inline void sub_block_maddubs_256(const Q8Activations& x, int64_t r0, int64_t b, int64_t sub,
                                  const uint8_t* p, int h, __m256i* isum, __m256i* msum) {
  constexpr SuperLayout kL = super_layout(T);
  constexpr int kOffset = kernel_offset(kL, false);
  constexpr int kChunks = int16_chunks(kL);
  __m256i w[8], w_abs[8];
  expand_super<__m256i, Ops256>(kL, p + sub_header_bytes(kL) + 32 * h, w);
  if constexpr (kL.levels) {
    const __m256i levels = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i*>(kSignedLevels.v)));
    for (int j = 0; j < 8; ++j) {
      w[j] = _mm256_shuffle_epi8(levels, w[j]);
      w_abs[j] = kSignsOnW ? w[j] : _mm256_abs_epi8(w[j]);  // unread with kSignsOnW
    }
  }
  const uint8_t* sc_row[2] = {p + 8 * h, p + (kL.scales == 2 ? kGroup : 0) + 8 * h};
  __m256i mult[2], offset_sc, mn;
  for (int r = 0; r < 2; ++r) {
    mult[r] = kL.scales == 0 ? _mm256_set1_epi16(1) : lane_pairs_256(sc_row[r], sc_row[r], true);
  }
  if constexpr (kOffset != 0 && kL.scales > 0) {
    // |sc| <= 128 and offset <= 32: the product fits an int16.
    offset_sc =
        _mm256_mullo_epi16(lane_pairs_256(sc_row[0], sc_row[1], true), _mm256_set1_epi16(kOffset));
  }
  if constexpr (kL.mins > 0) {
    const uint8_t* mn_row = p + kL.scales * kGroup + 8 * h;
    mn = lane_pairs_256(mn_row, mn_row + (kL.mins == 2 ? kGroup : 0), false);
  }
  for (int i = 0; i < R; ++i) {
    const int8_t* xq = sub_block_quants(x, r0 + i, kL.sb, b, sub);
    const int32_t* xs = sub_block_sums16(x, r0 + i, kL.sb, b, sub);
    for (int j0 = 0; j0 < 8; j0 += kChunks) {
      __m256i s16 = _mm256_setzero_si256();
      for (int j = j0; j < j0 + kChunks; ++j) {
        if constexpr (kL.levels) {
          s16 = _mm256_add_epi16(s16,
                                 signed_products<kSignsOnW>(w[j], w_abs[j], load_i32(xq + 4 * j)));
        } else {
          s16 = _mm256_add_epi16(
              s16, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(load_i32(xq + 4 * j))));
        }
      }
      isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(s16, mult[j0 / 4]));
    }
    if constexpr (kOffset != 0 && kL.scales == 0) {
      isum[i] = _mm256_sub_epi32(isum[i], _mm256_set1_epi32(kOffset * (xs[0] + xs[1])));
    } else if constexpr (kOffset != 0) {
      isum[i] = _mm256_sub_epi32(isum[i], _mm256_madd_epi16(offset_sc, sum_pairs_256(xs)));
    }
    if constexpr (kL.mins < 0) {
      msum[i] = _mm256_add_epi32(msum[i], _mm256_set1_epi32(xs[0] + xs[1]));
    } else if constexpr (kL.mins > 0) {
      msum[i] = _mm256_add_epi32(msum[i], _mm256_madd_epi16(mn, sum_pairs_256(xs)));
    }
  }
}

#ifdef PAGEDLM_Q8_AVX_VNNI
// Scales or mins, one byte per lane at p (lanes [8h, 8h + 8)), as int32 (the VNNI kernel
// multiplies its int32 sums by them).
inline __m256i lane_bytes_256(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

// 8 lanes of one row: sum over chunks [j0, j0 + 4) of u * q.
inline __m256i half_dot_vnni_256(const __m256i* w, const int8_t* xq, int j0) {
  __m256i s = _mm256_setzero_si256();
  for (int j = j0; j < j0 + 4; ++j) {
    const __m256i xv = _mm256_set1_epi32(load_i32(xq + 4 * j));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    s = _mm256_dpbusd_epi32(s, w[j], xv);
#else
    s = _mm256_dpbusd_avx_epi32(s, w[j], xv);
#endif
  }
  return s;
}

// The same with VNNI: dpbusd sums the products in int32 lanes, one int32 multiply by the scale
// per half.
template <QuantType T, int R>
inline void sub_block_vnni_256(const Q8Activations& x, int64_t r0, int64_t b, int64_t sub,
                               const uint8_t* p, int h, __m256i* isum, __m256i* msum) {
  constexpr SuperLayout kL = super_layout(T);
  constexpr int kOffset = kernel_offset(kL, true);
  __m256i w[8];
  expand_super<__m256i, Ops256>(kL, p + sub_header_bytes(kL) + 32 * h, w);
  if constexpr (kL.levels) {
    const __m256i levels = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i*>(kUnsignedLevels.v)));
    for (int j = 0; j < 8; ++j) w[j] = _mm256_shuffle_epi8(levels, w[j]);
  }
  __m256i sc[2], mn[2];
  for (int r = 0; r < 2; ++r) {
    if (kL.scales > 0) sc[r] = lane_bytes_256(p + (kL.scales == 2 ? r : 0) * kGroup + 8 * h, true);
    if (kL.mins > 0) {
      mn[r] = lane_bytes_256(p + (kL.scales + (kL.mins == 2 ? r : 0)) * kGroup + 8 * h, false);
    }
  }
  for (int i = 0; i < R; ++i) {
    const int8_t* xq = sub_block_quants(x, r0 + i, kL.sb, b, sub);
    const int32_t* xs = sub_block_sums16(x, r0 + i, kL.sb, b, sub);
    for (int r = 0; r < 2; ++r) {
      __m256i dot = half_dot_vnni_256(w, xq, 4 * r);
      if (kOffset != 0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(kOffset * xs[r]));
      if (kL.scales > 0) dot = _mm256_mullo_epi32(dot, sc[r]);
      isum[i] = _mm256_add_epi32(isum[i], dot);
      if (kL.mins < 0) msum[i] = _mm256_add_epi32(msum[i], _mm256_set1_epi32(xs[r]));
      if (kL.mins > 0) {
        msum[i] = _mm256_add_epi32(msum[i], _mm256_mullo_epi32(mn[r], _mm256_set1_epi32(xs[r])));
      }
    }
  }
}

#endif

template <bool kVnni, bool kSignsOnW, QuantType T, int R>
void tile_super_avx2(const Q8Activations& x, int64_t r0, const uint8_t* group, float* tile) {
  constexpr SuperLayout kL = super_layout(T);
  // One row (decode) takes both halves of the group in one pass, reading its weights in order
  // once; more rows take a half a pass, so that their accumulators stay in registers.
  constexpr int kHalves = R == 1 ? 2 : 1;
  const int64_t nsb = x.cols / kL.sb;
  for (int h0 = 0; h0 < 2; h0 += kHalves) {
    __m256 acc[kHalves][R];
    for (int hh = 0; hh < kHalves; ++hh) {
      for (int i = 0; i < R; ++i) acc[hh][i] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nsb; ++b) {
      const uint8_t* blk = group + b * super_group_bytes(kL);
      __m256i isum[kHalves][R], msum[kHalves][R];
      for (int hh = 0; hh < kHalves; ++hh) {
        for (int i = 0; i < R; ++i) isum[hh][i] = msum[hh][i] = _mm256_setzero_si256();
      }
      for (int64_t sub = 0; sub < kL.sb / kQuantBlock; ++sub) {
        const uint8_t* p = blk + super_header_bytes(kL) + sub * sub_bytes(kL);
        if (R == 1) prefetch_ahead(sub == 0 ? blk : p, p + sub_bytes(kL));
        for (int hh = 0; hh < kHalves; ++hh) {
          if constexpr (kVnni) {
#ifdef PAGEDLM_Q8_AVX_VNNI
            sub_block_vnni_256<T, R>(x, r0, b, sub, p, h0 + hh, isum[hh], msum[hh]);
#endif
          } else {
            sub_block_maddubs_256<kSignsOnW, T, R>(x, r0, b, sub, p, h0 + hh, isum[hh], msum[hh]);
          }
        }
      }
      for (int hh = 0; hh < kHalves; ++hh) {
        const __m256 dw = header_scales_256(kL, blk, h0 + hh);
        for (int i = 0; i < R; ++i) {
          const __m256 dx = _mm256_set1_ps(x.scale[(r0 + i) * nsb + b]);
          acc[hh][i] =
              _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[hh][i]), _mm256_mul_ps(dw, dx), acc[hh][i]);
          if constexpr (has_min(kL)) {
            const __m256 dmin = header_scales_256(kL, blk + kL.scale_bytes * kGroup, h0 + hh);
            acc[hh][i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[hh][i]), _mm256_mul_ps(dmin, dx),
                                          acc[hh][i]);
          }
        }
      }
    }
    for (int hh = 0; hh < kHalves; ++hh) {
      for (int i = 0; i < R; ++i) {
        _mm256_storeu_ps(tile + i * kGroup + 8 * (h0 + hh), acc[hh][i]);
      }
    }
  }
}

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

struct Ops512 {
  static __m512i load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static __m512i bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static __m512i and_(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
  static __m512i or_(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
  static __m512i srli16(__m512i a, int n) { return _mm512_srli_epi16(a, n); }
  static __m512i slli16(__m512i a, int n) { return _mm512_slli_epi16(a, n); }
  // Ops256::with_bit in two operations where the shifts take three: a byte mask of h's bit
  // `from`, and `1 << to` added where it is set (the bit is clear in w, so the sum is the or).
  static __m512i with_bit(__m512i w, __m512i h, int from, int to) {
    const __mmask64 set = _mm512_test_epi8_mask(h, bytes(1 << from));
    return _mm512_mask_add_epi8(w, set, w, bytes(1 << to));
  }
};

inline __m512 header_scales_512(const SuperLayout& l, const uint8_t* p) {
  if (l.scale_bytes == 4) return _mm512_loadu_ps(p);
  return _mm512_maskz_cvtph_ps(kAllLanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i lane_bytes_512(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm512_maskz_cvtepi8_epi32(kAllLanes, v)
                   : _mm512_maskz_cvtepu8_epi32(kAllLanes, v);
}

#ifdef __AVX512VBMI__
// Q2_K with less work per row (tile_super_avx512 below): each weight byte becomes sc * u (at
// most 15 * 3) by one byte lookup (vpermb, index sc << 2 | u), so a chunk's dpbusd adds into the
// super-block's sum directly, with no product by the scales per row and half; and the mins' sum,
// mn[0] * sum q[0..16) + mn[1] * sum q[16..32), is one dpwssd per row on the int16 pairs
// returned here (sums of 16 int8s fit). The same integers as the general path, so the same bits.
alignas(64) constexpr auto kScaledQ2 = byte_table<64>([](int i) { return (i >> 2) * (i & 3); });
constexpr __mmask64 kAllBytes = ~__mmask64{0};

// Sub-block p's 8 chunks of sc * u into w; returns lane c's (mn[0], mn[1]) as an int16 pair.
inline __m512i expand_q2k_scaled(const uint8_t* p, __m512i* w) {
  constexpr SuperLayout kL = super_layout(QuantType::kQ2_K);
  static_assert(kL.low_bits == 2 && kL.high_bits == 0 && kL.scales == 2 && kL.mins == 2 &&
                kL.offset == 0);
  const __m512i products = _mm512_load_si512(kScaledQ2.v);
  // Lane c's 4 bytes all from byte c of a 16-byte row.
  const __m512i spread =
      _mm512_set_epi8(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12, 11, 11, 11,
                      11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5,
                      5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int h = 0; h < 2; ++h) {
    // Half h's scales (at most 15) times 4 in every byte of their lane.
    const __m512i row = _mm512_maskz_broadcast_i32x4(
        kAllLanes, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + h * kGroup)));
    const __m512i sc4 = _mm512_slli_epi16(_mm512_maskz_permutexvar_epi8(kAllBytes, spread, row), 2);
    const __m512i v = _mm512_loadu_si512(p + sub_header_bytes(kL) + h * kChunk);
    for (int t = 0; t < 4; ++t) {
      // (v >> 2t) & 3 | sc4: vpermb reads the low 6 bits
      const __m512i index =
          _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 2 * t), _mm512_set1_epi8(3), sc4, 0xEA);
      w[4 * h + t] = _mm512_maskz_permutexvar_epi8(kAllBytes, index, products);
    }
  }
  return _mm512_or_si512(
      lane_bytes_512(p + 2 * kGroup, false),
      _mm512_maskz_slli_epi32(kAllLanes, lane_bytes_512(p + 3 * kGroup, false), 16));
}
#endif

// Two int16s (sums of 16 int8s) as the halves of one int32, low first: a dpwssd operand.
inline int32_t int16_pair(int32_t low, int32_t high) {
  const uint32_t bits = (static_cast<uint32_t>(low) & 0xFFFF) | static_cast<uint32_t>(high) << 16;
  return static_cast<int32_t>(bits);
}

template <QuantType T, int R>
void tile_super_avx512(const Q8Activations& x, int64_t r0, const uint8_t* group, float* tile) {
  constexpr SuperLayout kL = super_layout(T);
  constexpr int kOffset = kernel_offset(kL, true);
  const int64_t nsb = x.cols / kL.sb;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* blk = group + b * super_group_bytes(kL);
    __m512i isum[R], msum[R];
    for (int i = 0; i < R; ++i) isum[i] = msum[i] = _mm512_setzero_si512();
    for (int64_t sub = 0; sub < kL.sb / kQuantBlock; ++sub) {
      const uint8_t* p = blk + super_header_bytes(kL) + sub * sub_bytes(kL);
      __m512i w[8];
#ifdef __AVX512VBMI__
      if constexpr (T == QuantType::kQ2_K) {
        const __m512i mins = expand_q2k_scaled(p, w);
        for (int i = 0; i < R; ++i) {
          const int8_t* xq = sub_block_quants(x, r0 + i, kL.sb, b, sub);
          const int32_t* xs = sub_block_sums16(x, r0 + i, kL.sb, b, sub);
          for (int j = 0; j < 8; ++j) {
            isum[i] = _mm512_dpbusd_epi32(isum[i], w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
          }
          msum[i] = _mm512_dpwssd_epi32(msum[i], mins, _mm512_set1_epi32(int16_pair(xs[0], xs[1])));
        }
        continue;
      }
#endif
      expand_super<__m512i, Ops512>(kL, p + sub_header_bytes(kL), w);
      if constexpr (kL.levels) {
        const __m512i levels = _mm512_maskz_broadcast_i32x4(
            kAllLanes, _mm_load_si128(reinterpret_cast<const __m128i*>(kUnsignedLevels.v)));
        for (int j = 0; j < 8; ++j) w[j] = _mm512_shuffle_epi8(levels, w[j]);
      }
      __m512i sc[2], mn[2];
      for (int r = 0; r < 2; ++r) {
        if (kL.scales > 0) sc[r] = lane_bytes_512(p + (kL.scales == 2 ? r : 0) * kGroup, true);
        if (kL.mins > 0) {
          mn[r] = lane_bytes_512(p + (kL.scales + (kL.mins == 2 ? r : 0)) * kGroup, false);
        }
      }
      for (int i = 0; i < R; ++i) {
        const int8_t* xq = sub_block_quants(x, r0 + i, kL.sb, b, sub);
        const int32_t* xs = sub_block_sums16(x, r0 + i, kL.sb, b, sub);
        __m512i dot[2];
        for (int r = 0; r < 2; ++r) {
          dot[r] = _mm512_setzero_si512();
          for (int j = 4 * r; j < 4 * r + 4; ++j) {
            dot[r] = _mm512_dpbusd_epi32(dot[r], w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
          }
        }
        if constexpr (kL.scales == 0) {
          // sc = 1 (Q4_0, Q5_0, Q5_1, IQ4_NL): the sub-block's dot product less offset x its sum
          // of q.
          __m512i dot32 = _mm512_add_epi32(dot[0], dot[1]);
          if (kOffset != 0) {
            dot32 = _mm512_sub_epi32(dot32, _mm512_set1_epi32(kOffset * (xs[0] + xs[1])));
          }
          isum[i] = _mm512_add_epi32(isum[i], dot32);
        } else if constexpr (kL.scales == 1) {
          // One scale per 32 (Q4_K, Q5_K, IQ4_XS): the halves' sum, less offset x their sum of
          // q, times it: one product where the halves would take two.
          __m512i dot32 = _mm512_add_epi32(dot[0], dot[1]);
          if (kOffset != 0) {
            dot32 = _mm512_sub_epi32(dot32, _mm512_set1_epi32(kOffset * (xs[0] + xs[1])));
          }
          isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(dot32, sc[0]));
        } else {
          for (int r = 0; r < 2; ++r) {
            if (kOffset != 0) dot[r] = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(kOffset * xs[r]));
            isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(dot[r], sc[r]));
          }
        }
        if constexpr (kL.mins < 0) {
          msum[i] = _mm512_add_epi32(msum[i], _mm512_set1_epi32(xs[0] + xs[1]));
        } else if constexpr (kL.mins == 1) {
          msum[i] = _mm512_add_epi32(msum[i],
                                     _mm512_mullo_epi32(mn[0], _mm512_set1_epi32(xs[0] + xs[1])));
        } else if constexpr (kL.mins == 2) {
          for (int r = 0; r < 2; ++r) {
            msum[i] =
                _mm512_add_epi32(msum[i], _mm512_mullo_epi32(mn[r], _mm512_set1_epi32(xs[r])));
          }
        }
      }
    }
    const __m512 dw = header_scales_512(kL, blk);
    for (int i = 0; i < R; ++i) {
      const __m512 dx = _mm512_set1_ps(x.scale[(r0 + i) * nsb + b]);
      acc[i] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAllLanes, isum[i]), _mm512_mul_ps(dw, dx),
                               acc[i]);
      if constexpr (has_min(kL)) {
        const __m512 dmin = header_scales_512(kL, blk + kL.scale_bytes * kGroup);
        acc[i] = _mm512_fnmadd_ps(_mm512_maskz_cvtepi32_ps(kAllLanes, msum[i]),
                                  _mm512_mul_ps(dmin, dx), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(tile + i * kGroup, acc[i]);
}
#endif

// The packed layouts, in KernelTable's order.
constexpr QuantType kLayouts[] = {QuantType::kQ4_1, QuantType::kQ8_0,   QuantType::kQ4_0,
                                  QuantType::kQ5_0, QuantType::kQ5_1,   QuantType::kQ2_K,
                                  QuantType::kQ3_K, QuantType::kQ4_K,   QuantType::kQ5_K,
                                  QuantType::kQ6_K, QuantType::kIQ4_NL, QuantType::kIQ4_XS};
constexpr int kNumLayouts = sizeof(kLayouts) / sizeof(kLayouts[0]);

int layout_index(QuantType t) {
  for (int i = 0; i < kNumLayouts; ++i) {
    if (kLayouts[i] == t) return i;
  }
  fail("linear_q8: no 8-bit activation layout for ", quant_format(t).name);
}

// A kernel's tile functions for 1..kMaxTileRows rows, per layout.
struct KernelTable {
  int max_rows;
  TileFn fns[kNumLayouts][kMaxTileRows];
};

template <template <QuantType, int> class K, int... Rs>
constexpr KernelTable make_table(int max_rows, std::integer_sequence<int, Rs...> /*rows*/) {
  return KernelTable{max_rows,
                     {{K<kLayouts[0], Rs + 1>::fn...},
                      {K<kLayouts[1], Rs + 1>::fn...},
                      {K<kLayouts[2], Rs + 1>::fn...},
                      {K<kLayouts[3], Rs + 1>::fn...},
                      {K<kLayouts[4], Rs + 1>::fn...},
                      {K<kLayouts[5], Rs + 1>::fn...},
                      {K<kLayouts[6], Rs + 1>::fn...},
                      {K<kLayouts[7], Rs + 1>::fn...},
                      {K<kLayouts[8], Rs + 1>::fn...},
                      {K<kLayouts[9], Rs + 1>::fn...},
                      {K<kLayouts[10], Rs + 1>::fn...},
                      {K<kLayouts[11], Rs + 1>::fn...}}};
}
static_assert(kNumLayouts == 12, "make_table lists every layout");

template <QuantType T, int R>
constexpr TileFn portable_fn() {
  if constexpr (is_super(T)) {
    return tile_super_portable<T, R>;
  } else {
    return tile_portable<T, R>;
  }
}
template <QuantType T, int R>
struct Portable {
  static constexpr TileFn fn = portable_fn<T, R>();
};
constexpr KernelTable kPortableTable =
    make_table<Portable>(kMaxTileRows, std::make_integer_sequence<int, kMaxTileRows>{});

#ifdef PAGEDLM_Q8_AVX2
template <bool kVnni, bool kSignsOnW, QuantType T, int R>
constexpr TileFn avx2_fn() {
  if constexpr (is_super(T)) {
    return tile_super_avx2<kVnni, kSignsOnW, T, R>;
  } else {
    return tile_avx2<kVnni, kSignsOnW, T, R>;
  }
}
// Four rows at most: two halves of 8 features, each its 8 weight registers and R accumulators.
template <QuantType T, int R>
struct Avx2 {
  static constexpr TileFn fn = avx2_fn<false, false, T, R>();
};
constexpr KernelTable kAvx2Table = make_table<Avx2>(4, std::make_integer_sequence<int, 4>{});
// For 32-bit fixed point: Q8_0 and the IQ4 levels with x's signs on the weights (tile_avx2).
template <QuantType T, int R>
struct Avx2SignsOnW {
  static constexpr TileFn fn = avx2_fn<false, true, T, R>();
};
constexpr KernelTable kAvx2SignsOnWTable =
    make_table<Avx2SignsOnW>(4, std::make_integer_sequence<int, 4>{});
#ifdef PAGEDLM_Q8_AVX_VNNI
template <QuantType T, int R>
struct AvxVnni {
  static constexpr TileFn fn = avx2_fn<true, false, T, R>();
};
constexpr KernelTable kAvxVnniTable = make_table<AvxVnni>(4, std::make_integer_sequence<int, 4>{});
#endif
#endif
#ifdef PAGEDLM_Q8_AVX512
template <QuantType T, int R>
constexpr TileFn avx512_fn() {
  if constexpr (is_super(T)) {
    return tile_super_avx512<T, R>;
  } else {
    return tile_avx512<T, R>;
  }
}
template <QuantType T, int R>
struct Avx512 {
  static constexpr TileFn fn = avx512_fn<T, R>();
};
constexpr KernelTable kAvx512Table =
    make_table<Avx512>(kMaxTileRows, std::make_integer_sequence<int, kMaxTileRows>{});
#endif

// kAvx2's table for fixed point on Q8_0 and the IQ4 levels (linear_q8).
const KernelTable& signs_on_w_table() {
#ifdef PAGEDLM_Q8_AVX2
  return kAvx2SignsOnWTable;
#else
  fail("linear_q8: this build has no AVX2 kernel");
#endif
}

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
               int64_t rows, Q8Kernel kernel, int64_t out_stride, IntActivations input) {
  if (out_stride < 0) out_stride = weight.rows;
  const bool fixed32 = input == IntActivations::kFixed32;
  // The AVX2 kernels without VNNI give Q8_0's and the IQ4 levels' signs to x (maddubs takes
  // unsigned weights), which a fixed-point digit of -128 cannot carry: fixed point gives x's
  // signs to the weights instead, or runs on the portable kernel where a Q8_0 quant is -128
  // (the same bits either way).
  const bool signs_through_x = weight.type == QuantType::kQ8_0 ||
                               (is_super(weight.type) && super_layout(weight.type).levels);
  const KernelTable& table = !(fixed32 && kernel == Q8Kernel::kAvx2 && signs_through_x)
                                 ? table_of(kernel)
                             : weight.has_q_minus_128 ? table_of(Q8Kernel::kPortable)
                                                      : signs_on_w_table();
  const int64_t out_features = weight.rows;
  if (rows == 0 || out_features == 0) return;
  // Once per call: every group of features reads the same quantized rows.
  // (The threads below read it through this reference: by name they would see their own.)
  thread_local Q8Activations scratch;
  const Q8Activations& xq = scratch;
  // The kernels' rows: x's, or four digit planes for each of them, which every table's tiles
  // (8 or 4 rows) keep together.
  static_assert(kMaxTileRows % kFixed32Planes == 0);
  if (fixed32) {
    PAGEDLM_CHECK(table.max_rows % kFixed32Planes == 0, "linear_q8: tiles of ", table.max_rows,
                  " rows split a row's digit planes");
    quantize_fixed32(x, rows, weight.cols, scratch, activation_block(weight.type));
    rows *= kFixed32Planes;
  } else {
    quantize_q8(x, rows, weight.cols, scratch, activation_block(weight.type));
  }
  const int64_t group_bytes = packed_group_bytes(weight.type, weight.cols);
  const int64_t num_groups = (out_features + kGroup - 1) / kGroup;
  const int64_t unit_groups = std::max<int64_t>(1, kUnitWeightBytes / group_bytes);
  const int64_t num_units = (num_groups + unit_groups - 1) / unit_groups;
  const TileFn* fns = table.fns[layout_index(weight.type)];
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
        if (fixed32) {
          // A row's planes, least significant first (their sum rounds once it is large).
          for (int64_t i = 0; i < tile_rows; i += kFixed32Planes) {
            const float* planes = tile + i * kGroup;
            float* dst = out + (r0 + i) / kFixed32Planes * out_stride + col0;
            for (int64_t c = 0; c < n_cols; ++c) {
              dst[c] = planes[3 * kGroup + c] + planes[2 * kGroup + c] + planes[kGroup + c] +
                       planes[c] + (bias != nullptr ? bias[col0 + c] : 0.f);
            }
          }
          continue;
        }
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

bool fixed32_on_vnni(QuantType type) {
  const cpu::Q8Kernel kernel = cpu::q8_kernels().front();
  return q8_packs(type) &&
         (kernel == cpu::Q8Kernel::kAvx512Vnni || kernel == cpu::Q8Kernel::kAvxVnni);
}

void linear_q8(const Tensor& x, const Q8PackedMatrix& weight, const Tensor& bias, const Tensor& out,
               int64_t out_col0, IntActivations input) {
  const char* op = input == IntActivations::kFixed32 ? "linear (32-bit fixed-point activations)"
                                                     : "linear (8-bit activations)";
  detail::expect(x, op, "x", DType::kF32, {detail::kAnyDim, weight.cols});
  detail::expect_output_columns(x, out, out_col0, weight.rows, op);
  PAGEDLM_CHECK(x.device() == Device::kCpu && out.device() == Device::kCpu, op, ": a CPU path");
  const int64_t num_groups = (weight.rows + kGroup - 1) / kGroup;
  PAGEDLM_CHECK(weight.cols % activation_block(weight.type) == 0 &&
                    static_cast<int64_t>(weight.data.size()) ==
                        num_groups * packed_group_bytes(weight.type, weight.cols),
                op, ": the packed weight does not match its shape [", weight.rows, ", ",
                weight.cols, "]");
  if (bias.defined()) detail::expect(bias, op, "bias", DType::kF32, {out.dim(1)});
  cpu::linear_q8(x.data<float>(), weight, bias.defined() ? bias.data<float>() + out_col0 : nullptr,
                 out.data<float>() + out_col0, x.dim(0), cpu::q8_kernels().front(), out.dim(1),
                 input);
}

}  // namespace pagedlm::ops
