// GGUF v2/v3 reader: metadata, tensor infos and memory-mapped tensor data.
// Every structural problem (magic, version, truncation, absurd counts, offsets past the end,
// unknown types) throws pagedlm::Error naming what is wrong.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm {

enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ4_NL = 20,
  kIQ4_XS = 23,
  kBF16 = 30,
};

// A metadata value: scalars are widened (all integers to int64 or uint64, floats to double);
// arrays hold their elements as GgufValues.
struct GgufValue {
  using Array = std::vector<GgufValue>;
  std::variant<int64_t, uint64_t, double, bool, std::string, Array> value;
  uint32_t type = 0;  // the GGUF value type id as stored

  bool is_int() const;      // any integer type
  int64_t as_int() const;   // throws if not an integer
  double as_float() const;  // integers convert too
  const std::string& as_string() const;
  const Array& as_array() const;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // ggml order: dims[0] is the fastest-varying (ne0)
  GgmlType type;
  uint64_t offset = 0;  // relative to the data section
  size_t nbytes = 0;
  const uint8_t* data = nullptr;  // into the mapping

  int64_t numel() const;
  // Bytes of one ne0 row; quant blocks never cross rows.
  size_t row_bytes() const;
};

class GgufFile {
 public:
  static GgufFile open(const std::string& path);

  uint32_t version() const { return version_; }
  const std::string& path() const { return path_; }
  uint32_t alignment() const { return alignment_; }
  // File offset of the data section (tensor offsets are relative to it).
  uint64_t data_offset() const { return data_offset_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const GgufValue* find(const std::string& key) const;
  // Typed getters throw if the key is missing or has the wrong type.
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;
  std::vector<std::string> get_string_array(const std::string& key) const;
  std::vector<int64_t> get_int_array(const std::string& key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;

 private:
  std::string path_;
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
  std::shared_ptr<void> mapping_;
};

// Number of elements per block and bytes per block of a ggml type.
int64_t ggml_block_elems(GgmlType type);
size_t ggml_block_bytes(GgmlType type);
const char* ggml_type_name(GgmlType type);
// Dequantizes `n` elements (a multiple of the block size) from `src` into float32, with the
// arithmetic of ggml-quants.c.
void dequantize_row(GgmlType type, const uint8_t* src, float* dst, int64_t n);

// A tensor under its HF shape (ggml dims reversed), dequantized to F32. With n_heads > 0 the
// rows (or, for a 1-D bias, the elements) of each of n_heads heads are un-interleaved:
// llama.cpp's converter interleaved the two rope halves of llama Q/K heads (GGUF row
// h*d + 2j + s = HF row h*d + s*d/2 + j). Throws unless the rows split into such heads.
Tensor gguf_tensor_f32(const GgufTensorInfo& t, int64_t n_heads, const std::string& path);
// The CPU's block format holding a ggml type's blocks as the GGUF stores them (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS); nothing for the types the CPU
// dequantizes to f32.
std::optional<QuantType> cpu_block_format(GgmlType type);
// A 2-D (or 3-D: the outer dims' rows stacked, as experts are) tensor's blocks in a
// cpu_block_format, rows reordered as gguf_tensor_f32 reorders them; nothing for other types.
std::optional<QuantizedMatrix> gguf_tensor_blocks(const GgufTensorInfo& t, int64_t n_heads,
                                                  const std::string& path);

}  // namespace pagedlm
