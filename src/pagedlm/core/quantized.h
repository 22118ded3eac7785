// A weight matrix kept in ggml's block-quantized form, for kernels that compute from the blocks
// directly (the CPU's linear: a quarter to an eighth of the bytes of float32 per decode step).
#pragma once

#include <cstdint>
#include <vector>

namespace pagedlm {

// The ggml block formats the CPU kernels read, 32 weights a block:
//   Q4_1: f16 d, f16 m, 16 bytes of nibbles (weight j: low nibble of byte j, weight j + 16:
//         high nibble), w = q * d + m;
//   Q8_0: f16 d, 32 int8, w = q * d.
enum class QuantType : uint8_t { kQ4_1, kQ8_0 };

constexpr int64_t kQuantBlock = 32;

constexpr int64_t quant_block_bytes(QuantType t) { return t == QuantType::kQ4_1 ? 20 : 34; }

// [rows, cols] (cols a multiple of 32), each row its cols / 32 blocks, rows back to back.
struct QuantizedMatrix {
  QuantType type = QuantType::kQ4_1;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> blocks;

  int64_t row_bytes() const { return cols / kQuantBlock * quant_block_bytes(type); }
  bool empty() const { return rows == 0; }
};

}  // namespace pagedlm
