// Block layouts from ggml-common.h and dequantization with the arithmetic of ggml-quants.c
// (the same products and sums in the same order), so results match llama.cpp bit for bit up
// to floating-point contraction.
#include <cstring>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/error.h"
#include "pagedlm/io/gguf.h"

namespace pagedlm {
namespace {

constexpr int kQK = 32;    // elements per block of the legacy quants
constexpr int kQKK = 256;  // elements per K-quant super-block

float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// Q4_0: half d; u8 qs[16]. Low nibbles are elements 0..15, high nibbles 16..31.
void dequant_q4_0(const uint8_t* b, float* y) {
  const float d = load_half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + kQK / 2] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

// Q4_1: half d; half m; u8 qs[16].
void dequant_q4_1(const uint8_t* b, float* y) {
  const float d = load_half(b);
  const float m = load_half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + kQK / 2] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// Q5_0: half d; u8 qh[4] (the fifth bits, little-endian u32); u8 qs[16].
void dequant_q5_0(const uint8_t* b, float* y) {
  const float d = load_half(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < kQK / 2; ++j) {
    const uint8_t xh0 = ((qh >> j) << 4) & 0x10;
    const uint8_t xh1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>(((qs[j] & 0x0F) | xh0) - 16) * d;
    y[j + kQK / 2] = static_cast<float>(((qs[j] >> 4) | xh1) - 16) * d;
  }
}

// Q5_1: half d; half m; u8 qh[4]; u8 qs[16].
void dequant_q5_1(const uint8_t* b, float* y) {
  const float d = load_half(b);
  const float m = load_half(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < kQK / 2; ++j) {
    const uint8_t xh0 = ((qh >> j) << 4) & 0x10;
    const uint8_t xh1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>((qs[j] & 0x0F) | xh0) * d + m;
    y[j + kQK / 2] = static_cast<float>((qs[j] >> 4) | xh1) * d + m;
  }
}

// Q8_0: half d; i8 qs[32].
void dequant_q8_0(const uint8_t* b, float* y) {
  const float d = load_half(b);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// The 6-bit scale and min of sub-block j, packed into 12 bytes for 8 sub-blocks.
void get_scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K: half d; half dmin; u8 scales[12]; u8 qs[128]. Each 32-byte chunk of qs holds two
// sub-blocks: low nibbles first, then high nibbles.
void dequant_q4_k(const uint8_t* b, float* y) {
  const float d = load_half(b);
  const float dmin = load_half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  int is = 0;
  for (int j = 0; j < kQKK; j += 64) {
    uint8_t sc, m;
    get_scale_min_k4(is + 0, scales, &sc, &m);
    const float d1 = d * sc;
    const float m1 = dmin * m;
    get_scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * sc;
    const float m2 = dmin * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

// Q6_K: u8 ql[128]; u8 qh[64]; i8 scales[16]; half d.
void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_half(b + 208);
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

void dequant_f16(const uint8_t* b, float* y) { *y = load_half(b); }

void dequant_bf16(const uint8_t* b, float* y) {
  uint16_t h;
  std::memcpy(&h, b, 2);
  *y = bf16_to_f32(h);
}

void dequant_f32(const uint8_t* b, float* y) { std::memcpy(y, b, 4); }

struct TypeTraits {
  const char* name;
  int64_t block_elems;
  size_t block_bytes;
  void (*dequant_block)(const uint8_t*, float*);
};

TypeTraits traits(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
      return {"F32", 1, 4, dequant_f32};
    case GgmlType::kF16:
      return {"F16", 1, 2, dequant_f16};
    case GgmlType::kBF16:
      return {"BF16", 1, 2, dequant_bf16};
    case GgmlType::kQ4_0:
      return {"Q4_0", kQK, 18, dequant_q4_0};
    case GgmlType::kQ4_1:
      return {"Q4_1", kQK, 20, dequant_q4_1};
    case GgmlType::kQ5_0:
      return {"Q5_0", kQK, 22, dequant_q5_0};
    case GgmlType::kQ5_1:
      return {"Q5_1", kQK, 24, dequant_q5_1};
    case GgmlType::kQ8_0:
      return {"Q8_0", kQK, 34, dequant_q8_0};
    case GgmlType::kQ4_K:
      return {"Q4_K", kQKK, 144, dequant_q4_k};
    case GgmlType::kQ6_K:
      return {"Q6_K", kQKK, 210, dequant_q6_k};
  }
  fail("unsupported ggml type ", static_cast<uint32_t>(type));
}

}  // namespace

int64_t ggml_block_elems(GgmlType type) { return traits(type).block_elems; }
size_t ggml_block_bytes(GgmlType type) { return traits(type).block_bytes; }
const char* ggml_type_name(GgmlType type) { return traits(type).name; }

void dequantize_row(GgmlType type, const uint8_t* src, float* dst, int64_t n) {
  const TypeTraits t = traits(type);
  PAGEDLM_CHECK(n >= 0 && n % t.block_elems == 0, "cannot dequantize ", n, " elements of ", t.name,
                ": not a multiple of the block size ", t.block_elems);
  if (type == GgmlType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  for (int64_t i = 0; i < n / t.block_elems; ++i) {
    t.dequant_block(src + i * t.block_bytes, dst + i * t.block_elems);
  }
}

}  // namespace pagedlm
