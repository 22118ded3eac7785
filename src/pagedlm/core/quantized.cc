// The block formats' table and reference dequantization: ggml's arithmetic (ggml-quants.c, the
// same products and sums in the same order). In every format a weight is a product of exactly
// representable values (an f16 scale, or an f16 times a small integer, times a small integer),
// rounded at most once more by an added or subtracted min, so fused and unfused evaluation give
// the same float and the kernels can reproduce it bit for bit.
#include "pagedlm/core/quantized.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/error.h"

namespace pagedlm {
namespace {

constexpr int kQK = 32;    // weights per block of the legacy formats
constexpr int kQKK = 256;  // weights per K-quant block

float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

float load_float(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// Q4_0: d; u8 qs[16]. Low nibbles are weights 0..15, high nibbles 16..31.
void q4_0(float d, const uint8_t* qs, float* y) {
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + kQK / 2] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

// Q4_1: d; m; u8 qs[16].
void q4_1(float d, float m, const uint8_t* qs, float* y) {
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + kQK / 2] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// Q5_0: d; u8 qh[4] (the fifth bits, little-endian u32); u8 qs[16].
void q5_0(float d, const uint8_t* qh_bytes, const uint8_t* qs, float* y) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < kQK / 2; ++j) {
    const uint8_t xh0 = ((qh >> j) << 4) & 0x10;
    const uint8_t xh1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>(((qs[j] & 0x0F) | xh0) - 16) * d;
    y[j + kQK / 2] = static_cast<float>(((qs[j] >> 4) | xh1) - 16) * d;
  }
}

// Q5_1: d; m; u8 qh[4]; u8 qs[16].
void q5_1(float d, float m, const uint8_t* qh_bytes, const uint8_t* qs, float* y) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < kQK / 2; ++j) {
    const uint8_t xh0 = ((qh >> j) << 4) & 0x10;
    const uint8_t xh1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>((qs[j] & 0x0F) | xh0) * d + m;
    y[j + kQK / 2] = static_cast<float>((qs[j] >> 4) | xh1) * d + m;
  }
}

// Q4_K's weights from its super-block scales d, dmin, the 8 sub-blocks' 6-bit scales sc and mins
// m, and its 128 bytes of nibbles (each 32-byte chunk: two sub-blocks, low nibbles first).
void q4_k(float d, float dmin, const uint8_t* sc, const uint8_t* m, const uint8_t* q, float* y) {
  for (int j = 0; j < 8; j += 2) {
    const float d1 = d * sc[j], m1 = dmin * m[j];
    const float d2 = d * sc[j + 1], m2 = dmin * m[j + 1];
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
  }
}

// Q4_K's 12 bytes of 6-bit scales and mins unpacked (ggml's get_scale_min_k4).
void unpack_scales_k4(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = s[j] & 63;
      m[j] = s[j + 4] & 63;
    } else {
      sc[j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
      m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
  }
}

// Q5_K's weights: Q4_K's, each nibble's fifth bit from fifth[j] (sub-block j's u32, bit l for
// its weight l).
void q5_k(float d, float dmin, const uint8_t* sc, const uint8_t* m, const uint32_t* fifth,
          const uint8_t* q, float* y) {
  for (int j = 0; j < 8; j += 2) {
    const float d1 = d * sc[j], m1 = dmin * m[j];
    const float d2 = d * sc[j + 1], m2 = dmin * m[j + 1];
    for (int l = 0; l < 32; ++l) {
      *y++ = d1 * static_cast<float>((q[l] & 0x0F) | (((fifth[j] >> l) & 1) << 4)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      *y++ = d2 * static_cast<float>((q[l] >> 4) | (((fifth[j + 1] >> l) & 1) << 4)) - m2;
    }
    q += 32;
  }
}

// Q5_K's 32 bytes of fifth bits, or Q3_K's of third bits (byte l, bit j), as one u32 per
// sub-block j (bit l).
void transpose_high_bits(const uint8_t* qh, uint32_t* fifth) {
  for (int j = 0; j < 8; ++j) {
    fifth[j] = 0;
    for (int l = 0; l < 32; ++l) fifth[j] |= static_cast<uint32_t>((qh[l] >> j) & 1) << l;
  }
}

// Q3_K's weights from d, its 16 scales (sc - 32), its third bits as one u32 per sub-block (bit l:
// weight l's) and its 64 bytes of 2-bit quants (sub-block j: weights 0-15 and 16-31 of its half's
// 32 bytes, j / 4, at bits 2 (j % 4)); a weight is q with the third bit set, q - 4 without.
void q3_k(float d, const int8_t* sc, const uint32_t* high, const uint8_t* qs, float* y) {
  for (int j = 0; j < 8; ++j) {
    const uint8_t* q = qs + 32 * (j / 4);
    const int shift = 2 * (j % 4);
    for (int half = 0; half < 2; ++half) {  // a scale per 16 weights
      const float dl = d * static_cast<float>(sc[2 * j + half]);
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        const int value = ((q[l] >> shift) & 3) - (((high[j] >> l) & 1) != 0 ? 0 : 4);
        *y++ = dl * static_cast<float>(value);
      }
    }
  }
}

// Q3_K's 12 bytes of 6-bit scales unpacked, less 32 (ggml's dequantize_row_q3_K): scale i's low
// 4 bits from byte i % 8 (low nibble for i < 8), its high 2 from byte 8 + i % 4 at bit 2 (i / 4).
void unpack_scales_k3(const uint8_t* s, int8_t* sc) {
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 0x0F : s[i - 8] >> 4;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

// Q2_K's weights from d, dmin, its 16 bytes of scales and mins and its 64 bytes of 2-bit quants
// (laid out as Q3_K's).
void q2_k(float d, float dmin, const uint8_t* scales, const uint8_t* qs, float* y) {
  for (int j = 0; j < 8; ++j) {
    const uint8_t* q = qs + 32 * (j / 4);
    const int shift = 2 * (j % 4);
    for (int half = 0; half < 2; ++half) {  // a scale and a min per 16 weights
      const uint8_t sc = scales[2 * j + half];
      const float dl = d * static_cast<float>(sc & 0x0F), ml = dmin * static_cast<float>(sc >> 4);
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        *y++ = dl * static_cast<float>((q[l] >> shift) & 3) - ml;
      }
    }
  }
}

// Q6_K: u8 ql[128]; u8 qh[64]; i8 scales[16]; d.
void q6_k(float d, const int8_t* sc, const uint8_t* ql, const uint8_t* qh, float* y) {
  for (int n = 0; n < kQKK; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l + 0] = d * sc[is + 0] * q1;
      y[l + 32] = d * sc[is + 2] * q2;
      y[l + 64] = d * sc[is + 4] * q3;
      y[l + 96] = d * sc[is + 6] * q4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// IQ4_NL's weights d * level(q) for one sub-block of 32 from its 16 bytes of nibbles (laid out as
// Q4_0's). The product of an f16 (11 significant bits), an int8 level (7) and, for IQ4_XS, a
// 6-bit scale (5 in magnitude) is exact in f32, so its order does not matter.
void iq4_nl(float d, const uint8_t* qs, float* y) {
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = d * static_cast<float>(kIq4NlValues[qs[j] & 0x0F]);
    y[j + kQK / 2] = d * static_cast<float>(kIq4NlValues[qs[j] >> 4]);
  }
}

// IQ4_XS's 8 scales, less 32 (ggml's dequantize_row_iq4_xs): sub-block j's low 4 bits in byte
// j / 2 of scales_l (low nibble for even j), its high 2 at bits 2j of the u16 scales_h.
void unpack_scales_iq4_xs(const uint8_t* b, int8_t* sc) {
  const int scales_h = b[2] | (b[3] << 8);
  for (int j = 0; j < 8; ++j) {
    const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
    const int high = (scales_h >> (2 * j)) & 3;
    sc[j] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

// IQ4_XS's weights from d, its 8 scales (ls - 32) and its 128 bytes of nibbles.
void iq4_xs(float d, const int8_t* sc, const uint8_t* qs, float* y) {
  for (int j = 0; j < 8; ++j) iq4_nl(d * static_cast<float>(sc[j]), qs + 16 * j, y + kQK * j);
}

void dequant_iq4_nl(const uint8_t* b, float* y) { iq4_nl(load_half(b), b + 2, y); }
void dequant_iq4_nlf32(const uint8_t* b, float* y) { iq4_nl(load_float(b), b + 4, y); }
void dequant_iq4_xs(const uint8_t* b, float* y) {
  int8_t sc[8];
  unpack_scales_iq4_xs(b, sc);
  iq4_xs(load_half(b), sc, b + 8, y);
}
void dequant_iq4_xsf32(const uint8_t* b, float* y) {
  iq4_xs(load_float(b), reinterpret_cast<const int8_t*>(b + 4), b + 12, y);
}

void dequant_q4_0(const uint8_t* b, float* y) { q4_0(load_half(b), b + 2, y); }
void dequant_q4_1(const uint8_t* b, float* y) { q4_1(load_half(b), load_half(b + 2), b + 4, y); }
void dequant_q5_0(const uint8_t* b, float* y) { q5_0(load_half(b), b + 2, b + 6, y); }
void dequant_q5_1(const uint8_t* b, float* y) {
  q5_1(load_half(b), load_half(b + 2), b + 4, b + 8, y);
}
void dequant_q8_0(const uint8_t* b, float* y) {
  const float d = load_half(b);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(qs[j]) * d;
}
void dequant_q4_k(const uint8_t* b, float* y) {
  uint8_t sc[8], m[8];
  unpack_scales_k4(b + 4, sc, m);
  q4_k(load_half(b), load_half(b + 2), sc, m, b + 16, y);
}
void dequant_q6_k(const uint8_t* b, float* y) {
  q6_k(load_half(b + 208), reinterpret_cast<const int8_t*>(b + 192), b, b + 128, y);
}
void dequant_q5_k(const uint8_t* b, float* y) {
  uint8_t sc[8], m[8];
  uint32_t fifth[8];
  unpack_scales_k4(b + 4, sc, m);
  transpose_high_bits(b + 16, fifth);
  q5_k(load_half(b), load_half(b + 2), sc, m, fifth, b + 48, y);
}

void dequant_q3_k(const uint8_t* b, float* y) {
  int8_t sc[16];
  uint32_t high[8];
  unpack_scales_k3(b + 96, sc);
  transpose_high_bits(b, high);
  q3_k(load_half(b + 108), sc, high, b + 32, y);
}

void dequant_q2_k(const uint8_t* b, float* y) {
  q2_k(load_half(b + 80), load_half(b + 82), b, b + 16, y);
}

void dequant_q4_1f32(const uint8_t* b, float* y) {
  q4_1(load_float(b), load_float(b + 4), b + 8, y);
}
void dequant_q4_0f32(const uint8_t* b, float* y) { q4_0(load_float(b), b + 4, y); }
void dequant_q5_0f32(const uint8_t* b, float* y) { q5_0(load_float(b), b + 4, b + 8, y); }
void dequant_q4_kf32(const uint8_t* b, float* y) {
  q4_k(load_float(b), load_float(b + 4), b + 8, b + 16, b + 24, y);
}
void dequant_q6_kf32(const uint8_t* b, float* y) {
  q6_k(load_float(b), reinterpret_cast<const int8_t*>(b + 4), b + 20, b + 148, y);
}
void dequant_q5_kf32(const uint8_t* b, float* y) {
  uint32_t fifth[8];
  std::memcpy(fifth, b + 24, sizeof(fifth));
  q5_k(load_float(b), load_float(b + 4), b + 8, b + 16, fifth, b + 56, y);
}
void dequant_q3_kf32(const uint8_t* b, float* y) {
  uint32_t high[8];
  std::memcpy(high, b + 20, sizeof(high));
  q3_k(load_float(b), reinterpret_cast<const int8_t*>(b + 4), high, b + 52, y);
}

// The repackings (core/quantized.h): f16 scales widened to f32, the K-quants' and IQ4_XS's 6-bit
// scales unpacked, Q5_K's fifth and Q3_K's third bits transposed.
void store_float(float f, uint8_t* p) { std::memcpy(p, &f, 4); }

void repack_q4_1(const uint8_t* b, uint8_t* out) {
  store_float(load_half(b), out);
  store_float(load_half(b + 2), out + 4);
  std::memcpy(out + 8, b + 4, kQK / 2);
}

// Q4_0 and IQ4_NL: a f16 d, then 16 bytes of nibbles.
void repack_q4_0(const uint8_t* b, uint8_t* out) {
  store_float(load_half(b), out);
  std::memcpy(out + 4, b + 2, kQK / 2);
}

void repack_q5_0(const uint8_t* b, uint8_t* out) {
  store_float(load_half(b), out);
  std::memcpy(out + 4, b + 2, 4 + kQK / 2);
}
void repack_q4_k(const uint8_t* b, uint8_t* out) {
  store_float(load_half(b), out);
  store_float(load_half(b + 2), out + 4);
  unpack_scales_k4(b + 4, out + 8, out + 16);
  std::memcpy(out + 24, b + 16, kQKK / 2);
}
void repack_q6_k(const uint8_t* b, uint8_t* out) {
  store_float(load_half(b + 208), out);
  std::memcpy(out + 4, b + 192, 16);
  std::memcpy(out + 20, b, 192);
}

void dequant_q2_kf32(const uint8_t* b, float* y) {
  q2_k(load_float(b), load_float(b + 4), b + 8, b + 24, y);
}
void repack_q2_k(const uint8_t* b, uint8_t* out) {
  store_float(load_half(b + 80), out);
  store_float(load_half(b + 82), out + 4);
  std::memcpy(out + 8, b, 16 + kQKK / 4);
}
void repack_q3_k(const uint8_t* b, uint8_t* out) {
  store_float(load_half(b + 108), out);
  unpack_scales_k3(b + 96, reinterpret_cast<int8_t*>(out + 4));
  uint32_t high[8];
  transpose_high_bits(b, high);
  std::memcpy(out + 20, high, sizeof(high));
  std::memcpy(out + 52, b + 32, kQKK / 4);
}
void repack_q5_k(const uint8_t* b, uint8_t* out) {
  store_float(load_half(b), out);
  store_float(load_half(b + 2), out + 4);
  unpack_scales_k4(b + 4, out + 8, out + 16);
  uint32_t fifth[8];
  transpose_high_bits(b + 16, fifth);
  std::memcpy(out + 24, fifth, sizeof(fifth));
  std::memcpy(out + 56, b + 48, kQKK / 2);
}

void repack_iq4_xs(const uint8_t* b, uint8_t* out) {
  store_float(load_half(b), out);
  unpack_scales_iq4_xs(b, reinterpret_cast<int8_t*>(out + 4));
  std::memcpy(out + 12, b + 8, kQKK / 2);
}

using Dequantize = void (*)(const uint8_t*, float*);
using Repack = void (*)(const uint8_t*, uint8_t*);

constexpr QuantFormat format(const char* name, QuantType type, Dequantize dequantize,
                             QuantType ggml_type, QuantType cpu_form, Repack repack,
                             int16_t scale0 = -1, int16_t scale1 = -1) {
  return {name,   quant_block_elems(type), quant_block_bytes(type), dequantize, ggml_type, cpu_form,
          repack, {scale0, scale1}};
}

// In QuantType's order.
using enum QuantType;
const QuantFormat kFormats[] = {
    format("Q4_1", kQ4_1, dequant_q4_1, kQ4_1, kQ4_1F32, repack_q4_1, 0, 2),
    format("Q8_0", kQ8_0, dequant_q8_0, kQ8_0, kQ8_0, nullptr, 0),
    format("Q4_1 (f32 scales)", kQ4_1F32, dequant_q4_1f32, kQ4_1, kQ4_1F32, nullptr),
    format("Q4_0", kQ4_0, dequant_q4_0, kQ4_0, kQ4_0F32, repack_q4_0, 0),
    format("Q5_0", kQ5_0, dequant_q5_0, kQ5_0, kQ5_0F32, repack_q5_0, 0),
    format("Q4_K", kQ4_K, dequant_q4_k, kQ4_K, kQ4_KF32, repack_q4_k, 0, 2),
    format("Q6_K", kQ6_K, dequant_q6_k, kQ6_K, kQ6_KF32, repack_q6_k, 208),
    format("Q5_0 (f32 scale)", kQ5_0F32, dequant_q5_0f32, kQ5_0, kQ5_0F32, nullptr),
    format("Q4_K (f32 scales)", kQ4_KF32, dequant_q4_kf32, kQ4_K, kQ4_KF32, nullptr),
    format("Q6_K (f32 scale)", kQ6_KF32, dequant_q6_kf32, kQ6_K, kQ6_KF32, nullptr),
    format("Q5_1", kQ5_1, dequant_q5_1, kQ5_1, kQ5_1, nullptr, 0, 2),
    format("Q5_K", kQ5_K, dequant_q5_k, kQ5_K, kQ5_KF32, repack_q5_k, 0, 2),
    format("Q5_K (f32 scales)", kQ5_KF32, dequant_q5_kf32, kQ5_K, kQ5_KF32, nullptr),
    format("Q3_K", kQ3_K, dequant_q3_k, kQ3_K, kQ3_KF32, repack_q3_k, 108),
    format("Q3_K (f32 scale)", kQ3_KF32, dequant_q3_kf32, kQ3_K, kQ3_KF32, nullptr),
    format("Q2_K", kQ2_K, dequant_q2_k, kQ2_K, kQ2_KF32, repack_q2_k, 80, 82),
    format("Q2_K (f32 scales)", kQ2_KF32, dequant_q2_kf32, kQ2_K, kQ2_KF32, nullptr),
    format("IQ4_NL", kIQ4_NL, dequant_iq4_nl, kIQ4_NL, kIQ4_NLF32, repack_q4_0, 0),
    format("IQ4_XS", kIQ4_XS, dequant_iq4_xs, kIQ4_XS, kIQ4_XSF32, repack_iq4_xs, 0),
    format("IQ4_XS (f32 scale)", kIQ4_XSF32, dequant_iq4_xsf32, kIQ4_XS, kIQ4_XSF32, nullptr),
    format("Q4_0 (f32 scale)", kQ4_0F32, dequant_q4_0f32, kQ4_0, kQ4_0F32, nullptr),
    format("IQ4_NL (f32 scale)", kIQ4_NLF32, dequant_iq4_nlf32, kIQ4_NL, kIQ4_NLF32, nullptr),
};
static_assert(sizeof(kFormats) / sizeof(kFormats[0]) ==
              static_cast<size_t>(QuantType::kIQ4_NLF32) + 1);

}  // namespace

const QuantFormat& quant_format(QuantType type) {
  const auto i = static_cast<size_t>(type);
  PAGEDLM_CHECK(i < sizeof(kFormats) / sizeof(kFormats[0]), "unknown block format ", i);
  return kFormats[i];
}

std::optional<QuantType> ggml_quant_type_named(std::string_view name) {
  for (size_t i = 0; i < sizeof(kFormats) / sizeof(kFormats[0]); ++i) {
    const QuantFormat& f = kFormats[i];
    const std::string_view candidate = f.name;
    if (f.ggml_type != static_cast<QuantType>(i) || candidate.size() != name.size()) continue;
    bool same = true;
    for (size_t c = 0; c < name.size() && same; ++c) {
      same = std::tolower(static_cast<unsigned char>(name[c])) ==
             std::tolower(static_cast<unsigned char>(candidate[c]));
    }
    if (same) return f.ggml_type;
  }
  return std::nullopt;
}

QuantizedMatrix random_quantized_matrix(QuantType type, int64_t rows, int64_t cols, float amplitude,
                                        uint64_t seed) {
  const QuantFormat& f = quant_format(type);
  PAGEDLM_CHECK(f.ggml_type == type && f.f16_scales[0] >= 0, "random blocks of ", f.name,
                ": not a ggml format");
  PAGEDLM_CHECK(cols % f.block_elems == 0, "random ", f.name, " blocks: ", cols,
                " columns are not a multiple of its ", f.block_elems, "-weight block");
  QuantizedMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  const int64_t blocks = rows * (cols / f.block_elems);
  m.blocks.resize(static_cast<size_t>(blocks * f.block_bytes));
  constexpr uint16_t kOne = 0x3C00;  // 1.0 in f16
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* block = m.blocks.data() + b * f.block_bytes;
    // splitmix64 of (seed, byte offset): any block drawn on its own.
    for (int64_t i = 0; i < f.block_bytes; i += 8) {
      uint64_t z = seed + static_cast<uint64_t>(b * f.block_bytes + i + 1) * 0x9e3779b97f4a7c15ULL;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      z ^= z >> 31;
      std::memcpy(block + i, &z, static_cast<size_t>(std::min<int64_t>(8, f.block_bytes - i)));
    }
    // With the scales at 1 the weights are sums of products of the block's integers: scaling
    // every scale by one factor scales every weight by it.
    for (const int16_t at : f.f16_scales) {
      if (at >= 0) std::memcpy(block + at, &kOne, 2);
    }
    float w[kMaxQuantBlockElems];
    f.dequantize_block(block, w);
    float largest = 0;
    for (int64_t i = 0; i < f.block_elems; ++i) largest = std::max(largest, std::fabs(w[i]));
    const uint16_t scale = f32_to_f16(largest > 0 ? amplitude / largest : 0.f);
    for (const int16_t at : f.f16_scales) {
      if (at >= 0) std::memcpy(block + at, &scale, 2);
    }
  }
  return m;
}

void dequantize_row(const QuantizedMatrix& m, int64_t r, float* out) {
  const QuantFormat& f = quant_format(m.type);
  const uint8_t* row = m.blocks.data() + r * m.row_bytes();
  for (int64_t b = 0; b < m.cols / f.block_elems; ++b) {
    f.dequantize_block(row + b * f.block_bytes, out + b * f.block_elems);
  }
}

}  // namespace pagedlm
