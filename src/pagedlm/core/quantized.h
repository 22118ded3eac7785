// A weight matrix kept in ggml's block-quantized form, for kernels that compute from the blocks
// directly (the CPU's linear: a quarter to an eighth of the bytes of float32 per decode step).
#pragma once

#include <cstdint>
#include <vector>

namespace pagedlm {

// The ggml block formats the CPU kernels read, 32 weights a block:
//   Q4_1: f16 d, f16 m, 16 bytes of nibbles (weight j: low nibble of byte j, weight j + 16:
//         high nibble), w = q * d + m;
//   Q8_0: f16 d, 32 int8, w = q * d;
//   Q4_1 with f32 scales (not a ggml format): f32 d, f32 m, then Q4_1's 16 bytes of nibbles.
//         The CPU backend repacks Q4_1 into it at load (ops::repack_for_cpu): every f16 is
//         exactly a f32, so the weights are the same, and the decode kernel broadcasts d and m
//         straight from memory instead of converting and shuffling them for every block.
enum class QuantType : uint8_t { kQ4_1, kQ8_0, kQ4_1F32 };

constexpr int64_t kQuantBlock = 32;

constexpr int64_t quant_block_bytes(QuantType t) {
  switch (t) {
    case QuantType::kQ4_1:
      return 20;
    case QuantType::kQ8_0:
      return 34;
    case QuantType::kQ4_1F32:
      return 24;
  }
  return 0;
}

// [rows, cols] (cols a multiple of 32), each row its cols / 32 blocks, rows back to back.
struct QuantizedMatrix {
  QuantType type = QuantType::kQ4_1;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> blocks;

  int64_t row_bytes() const { return cols / kQuantBlock * quant_block_bytes(type); }
  bool empty() const { return rows == 0; }
};

}  // namespace pagedlm
