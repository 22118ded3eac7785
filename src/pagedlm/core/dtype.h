// Element types and the scalar conversions every backend shares.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace pagedlm {

// kF8E4M3: OCP FP8 E4M3 ("e4m3fn": no infinities, S.1111.111 is NaN), as FP8 checkpoints store
// their weights; only ever read, and always with the checkpoint's scales (model/fp8_weights.h).
enum class DType : uint8_t { kF32, kF16, kBF16, kI32, kU8, kF8E4M3 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kU8:
    case DType::kF8E4M3:
      return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "i32";
    case DType::kU8:
      return "u8";
    case DType::kF8E4M3:
      return "f8_e4m3";
  }
  return "?";
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f);

// Exact: every E4M3 value is a float (4 significant bits, exponents -9..8).
inline float f8e4m3_to_f32(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80) << 24;
  const uint32_t exp = (v >> 3) & 0xf;
  const uint32_t mant = v & 0x7;
  uint32_t bits;
  if (exp == 0xf && mant == 0x7) {
    bits = sign | 0x7fc00000;  // NaN
  } else if (exp == 0) {
    // Subnormal: mant * 2^-9, exact in a float.
    const float f = static_cast<float>(mant) * 0x1p-9f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else {
    bits = sign | (exp + 127 - 7) << 23 | mant << 20;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace pagedlm
