// GGUF tensor types: block layouts from ggml-common.h and dequantization with the arithmetic of
// ggml-quants.c (the same products and sums in the same order), so results match llama.cpp bit
// for bit up to floating-point contraction. The formats the CPU keeps as blocks are dequantized
// by core/quantized.h's reference.
#include <cstring>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/error.h"
#include "pagedlm/core/quantized.h"
#include "pagedlm/io/gguf.h"

namespace pagedlm {
namespace {

float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
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

// The formats the CPU also keeps as blocks are described once, in core/quantized.h's table.
TypeTraits ggml_format(QuantType type) {
  const QuantFormat& f = quant_format(type);
  return {f.name, f.block_elems, static_cast<size_t>(f.block_bytes), f.dequantize_block};
}

TypeTraits traits(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
      return {"F32", 1, 4, dequant_f32};
    case GgmlType::kF16:
      return {"F16", 1, 2, dequant_f16};
    case GgmlType::kBF16:
      return {"BF16", 1, 2, dequant_bf16};
    case GgmlType::kQ4_0:
      return ggml_format(QuantType::kQ4_0);
    case GgmlType::kQ4_1:
      return ggml_format(QuantType::kQ4_1);
    case GgmlType::kQ5_0:
      return ggml_format(QuantType::kQ5_0);
    case GgmlType::kQ5_1:
      return ggml_format(QuantType::kQ5_1);
    case GgmlType::kQ8_0:
      return ggml_format(QuantType::kQ8_0);
    case GgmlType::kQ2_K:
      return ggml_format(QuantType::kQ2_K);
    case GgmlType::kQ3_K:
      return ggml_format(QuantType::kQ3_K);
    case GgmlType::kQ4_K:
      return ggml_format(QuantType::kQ4_K);
    case GgmlType::kQ5_K:
      return ggml_format(QuantType::kQ5_K);
    case GgmlType::kQ6_K:
      return ggml_format(QuantType::kQ6_K);
    case GgmlType::kIQ4_NL:
      return ggml_format(QuantType::kIQ4_NL);
    case GgmlType::kIQ4_XS:
      return ggml_format(QuantType::kIQ4_XS);
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
