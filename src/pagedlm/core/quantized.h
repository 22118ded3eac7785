// A weight matrix kept in a block-quantized form, for kernels that compute from the blocks
// directly (the CPU's linear: a quarter to an eighth of the bytes of float32 per decode step).
// Every format the CPU keeps is described once, in the table of quantized.cc (QuantFormat): its
// block size and bytes and its reference dequantization; the kernels for it are in ops/
// (linear_cpu.cc for the exact ones, linear_q8_cpu.cc for 8-bit activations).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace pagedlm {

// ggml's block formats (ggml-common.h), as a GGUF stores them, and the CPU's repackings of them.
// Q8_0 is computed from as it is (its decode streams at what one thread reads; a f32 scale would
// add 2 bytes to its 34). A repacking holds the same weights
// (its dequantization gives the same floats bit for bit) in a layout the decode kernels stream
// faster: f16 scales made f32 (every f16 is exactly a f32, and a broadcast from memory needs no
// conversion or shuffle per block) and K-quant scales unpacked from their 6 bits.
// ops::repack_for_cpu makes them at load.
//   Q4_1: f16 d, f16 m, 16 bytes of nibbles (weight j: low nibble of byte j, weight j + 16:
//         high nibble), w = q * d + m;
//   Q8_0: f16 d, 32 int8, w = q * d;
//   Q4_0: f16 d, 16 bytes of nibbles as Q4_1, w = (q - 8) * d;
//   Q5_0: f16 d, u32 qh (bit j: weight j's fifth bit), 16 bytes of nibbles, w = (q - 16) * d;
//   Q5_1: f16 d, f16 m, u32 qh, 16 bytes of nibbles, w = q * d + m (computed from as it is, its
//         d and m converted together as Q4_1's are);
//   Q4_K: 256 weights, f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
//         (32-byte chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones),
//         w = d * sc_j * q - dmin * m_j for sub-block j of 32;
//   Q6_K: 256 weights, 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, f16 d,
//         w = d * sc * (q - 32) per 16 weights;
//   Q5_K: 256 weights, f16 d, f16 dmin, Q4_K's 12 bytes of scales and mins, 32 bytes of fifth
//         bits (byte l, bit j: weight l of sub-block j), Q4_K's 128 bytes of nibbles,
//         w = d * sc_j * q - dmin * m_j for sub-block j of 32;
//   Q3_K: 256 weights, 32 bytes of third bits (byte l, bit j: weight l of sub-block j), 64 bytes
//         of 2-bit quants, 12 bytes of 6-bit scales, f16 d, w = d * (sc - 32) * (q - 4) per 16;
//   Q2_K: 256 weights, 16 bytes of 4-bit scales and mins (byte i: scale i in the low nibble, min i
//         in the high one), 64 bytes of 2-bit quants as Q3_K's, f16 d, f16 dmin,
//         w = d * sc_i * q - dmin * m_i per 16;
//   Q4_1F32: f32 d, f32 m, then the 16 bytes of nibbles;
//   Q4_0F32: f32 d, then the 16 bytes of nibbles;
//   Q5_0F32: f32 d, u32 qh, 16 bytes of nibbles;
//   Q4_KF32: f32 d, f32 dmin, u8 sc[8], u8 m[8], Q4_K's 128 bytes of nibbles;
//   Q6_KF32: f32 d, int8 sc[16], then Q6_K's ql[128] and qh[64];
//   Q5_KF32: f32 d, f32 dmin, u8 sc[8], u8 m[8], u32 qh[8] (sub-block j's fifth bits, bit l for
//            its weight l: Q5_0's form), Q5_K's 128 bytes of nibbles;
//   Q3_KF32: f32 d, int8 sc[16] (sc - 32), u32 hmask[8] (sub-block j's third bits, as Q5_KF32's
//            fifth), Q3_K's 64 bytes of 2-bit quants;
//   Q2_KF32: f32 d, f32 dmin, then Q2_K's 16 bytes of scales and mins and 64 of quants;
//   IQ4_NL: f16 d, 16 bytes of nibbles as Q4_0's, w = d * kIq4NlValues[q] (a non-linear grid of
//           16 int8 values);
//   IQ4_NLF32: f32 d, then IQ4_NL's 16 bytes of nibbles;
//   IQ4_XS: 256 weights, f16 d, u16 of the scales' high 2 bits (bits 2j: sub-block j's), 4 bytes
//           of their low 4 bits (byte j / 2, low nibble for even j), 128 bytes of nibbles (16 per
//           sub-block of 32, as IQ4_NL's), w = d * (ls_j - 32) * kIq4NlValues[q] for sub-block j;
//   IQ4_XSF32: f32 d, int8 sc[8] (ls - 32), IQ4_XS's 128 bytes of nibbles.
enum class QuantType : uint8_t {
  kQ4_1,
  kQ8_0,
  kQ4_1F32,
  kQ4_0,
  kQ5_0,
  kQ4_K,
  kQ6_K,
  kQ5_0F32,
  kQ4_KF32,
  kQ6_KF32,
  kQ5_1,
  kQ5_K,
  kQ5_KF32,
  kQ3_K,
  kQ3_KF32,
  kQ2_K,
  kQ2_KF32,
  kIQ4_NL,
  kIQ4_XS,
  kIQ4_XSF32,
  kQ4_0F32,
  kIQ4_NLF32,
};

// IQ4_NL's and IQ4_XS's 16 weight levels (ggml's kvalues_iq4nl), times the block's scale.
inline constexpr int8_t kIq4NlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};

// The unit the CPU kernels step through a row in: every format's blocks are made of whole
// 32-weight sub-blocks (a K-quant's 256-weight block holds 8).
constexpr int64_t kQuantBlock = 32;
constexpr int64_t kMaxQuantBlockElems = 256;

struct QuantFormat {
  const char* name;
  int64_t block_elems;  // weights per block: 32, or 256 for the K-quants and IQ4_XS
  int64_t block_bytes;
  // The block's weights as floats, with ggml's arithmetic (ggml-quants.c): the reference every
  // kernel of the format reproduces.
  void (*dequantize_block)(const uint8_t* block, float* out);
  QuantType ggml_type;  // the ggml format it holds: itself, or the one it repacks
  // The CPU's exact kernels read blocks of format `cpu_form` (itself where it has no repacking);
  // repack_block writes one block of it from one of this format (null where cpu_form is itself).
  QuantType cpu_form;
  void (*repack_block)(const uint8_t* block, uint8_t* out);
  // Byte offsets of a block's f16 scales (d, then m or dmin; -1: none): where synthetic blocks
  // (random_quantized_matrix) set their magnitude. Given for ggml's formats only.
  int16_t f16_scales[2];
};

const QuantFormat& quant_format(QuantType type);

constexpr int64_t quant_block_bytes(QuantType t) {
  switch (t) {
    case QuantType::kQ4_1:
      return 20;
    case QuantType::kQ8_0:
      return 34;
    case QuantType::kQ4_1F32:
      return 24;
    case QuantType::kQ4_0:
      return 18;
    case QuantType::kQ5_0:
      return 22;
    case QuantType::kQ4_K:
      return 144;
    case QuantType::kQ6_K:
      return 210;
    case QuantType::kQ5_0F32:
      return 24;
    case QuantType::kQ4_KF32:
      return 152;
    case QuantType::kQ6_KF32:
      return 212;
    case QuantType::kQ5_1:
      return 24;
    case QuantType::kQ5_K:
      return 176;
    case QuantType::kQ5_KF32:
      return 184;
    case QuantType::kQ3_K:
      return 110;
    case QuantType::kQ3_KF32:
      return 116;
    case QuantType::kQ2_K:
      return 84;
    case QuantType::kQ2_KF32:
      return 88;
    case QuantType::kIQ4_NL:
      return 18;
    case QuantType::kIQ4_XS:
      return 136;
    case QuantType::kIQ4_XSF32:
      return 140;
    case QuantType::kQ4_0F32:
    case QuantType::kIQ4_NLF32:
      return 20;
  }
  return 0;
}

constexpr int64_t quant_block_elems(QuantType t) {
  switch (t) {
    case QuantType::kQ4_K:
    case QuantType::kQ6_K:
    case QuantType::kQ4_KF32:
    case QuantType::kQ6_KF32:
    case QuantType::kQ5_K:
    case QuantType::kQ5_KF32:
    case QuantType::kQ3_K:
    case QuantType::kQ3_KF32:
    case QuantType::kQ2_K:
    case QuantType::kQ2_KF32:
    case QuantType::kIQ4_XS:
    case QuantType::kIQ4_XSF32:
      return 256;
    default:
      return 32;
  }
}

// [rows, cols] (cols a multiple of the block size), each row its blocks, rows back to back.
struct QuantizedMatrix {
  QuantType type = QuantType::kQ4_1;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> blocks;

  int64_t row_bytes() const { return cols / quant_block_elems(type) * quant_block_bytes(type); }
  bool empty() const { return rows == 0; }
};

// Row r's weights as floats (cols of them), by the format's reference dequantization.
void dequantize_row(const QuantizedMatrix& m, int64_t r, float* out);

// The ggml format named `name` as llama.cpp's quantizer names its types ("q4_k", "Q8_0"; any
// case), or nullopt.
std::optional<QuantType> ggml_quant_type_named(std::string_view name);

// A [rows, cols] matrix of random blocks of ggml format `type` (random quants and scales, each
// block's f16 scales set so that its largest |weight| is `amplitude`, to the f16 scale's
// precision): weights of a quantized
// model's shape for benchmarks, where only the bytes matter. Element-wise the same for a seed
// whatever the thread count.
QuantizedMatrix random_quantized_matrix(QuantType type, int64_t rows, int64_t cols, float amplitude,
                                        uint64_t seed);

}  // namespace pagedlm
