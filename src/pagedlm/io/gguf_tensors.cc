// GGUF tensors as the model reads them: dequantized to F32, or matrices of the block formats the
// CPU computes with kept in their blocks, with the converter's Q/K row interleave undone where the
// caller says so.
#include <cstring>
#include <optional>

#include "pagedlm/core/error.h"
#include "pagedlm/io/gguf.h"

namespace pagedlm {
namespace {

// The GGUF row that holds HF row `r`. The converter interleaved each head's two rope halves
// (GGUF row h*d + 2j + s = HF row h*d + s*d/2 + j), so HF's rotate_half rope needs them split
// back.
int64_t gguf_row_of_hf_row(int64_t r, int64_t head_rows) {
  const int64_t h = r / head_rows;
  const int64_t i = r % head_rows;
  const int64_t half = head_rows / 2;
  return h * head_rows + (i < half ? 2 * i : 2 * (i - half) + 1);
}

// The rows of one head of a Q/K tensor the converter permuted (0: not permuted); throws unless
// the rows split into n_heads heads of even size. A 1-D bias is permuted element-wise: each
// element is a row of one value.
int64_t head_rows_of(const GgufTensorInfo& t, int64_t n_heads, const std::string& path) {
  if (n_heads <= 0) return 0;
  const int64_t row_elems = t.dims.empty() ? 1 : t.dims[0];
  const int64_t perm_rows =
      t.dims.size() == 1 ? row_elems : (row_elems == 0 ? 0 : t.numel() / row_elems);
  PAGEDLM_CHECK(perm_rows % n_heads == 0 && (perm_rows / n_heads) % 2 == 0, "GGUF file '", path,
                "' tensor '", t.name, "' has ", perm_rows, " rows, which do not split into ",
                n_heads, " heads of even size");
  return perm_rows / n_heads;
}

}  // namespace

Tensor gguf_tensor_f32(const GgufTensorInfo& t, int64_t n_heads, const std::string& path) {
  Shape shape(t.dims.rbegin(), t.dims.rend());
  const int64_t row_elems = t.dims.empty() ? 1 : t.dims[0];
  const int64_t n_rows = row_elems == 0 ? 0 : t.numel() / row_elems;
  const bool bias = t.dims.size() == 1;
  const int64_t head_rows = head_rows_of(t, n_heads, path);
  Tensor out = Tensor::empty(DType::kF32, shape);
  float* dst = out.data<float>();
  const size_t row_bytes = t.row_bytes();
  if (bias) {
    dequantize_row(t.type, t.data, dst, row_elems);
    if (head_rows > 0) {
      std::vector<float> src(dst, dst + row_elems);
      for (int64_t r = 0; r < row_elems; ++r) dst[r] = src[gguf_row_of_hf_row(r, head_rows)];
    }
    return out;
  }
  // GgufFile::open checked ne0 against the block size, so nothing below throws: an exception
  // escaping an OpenMP region would terminate the process.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t src_row = head_rows > 0 ? gguf_row_of_hf_row(r, head_rows) : r;
    dequantize_row(t.type, t.data + src_row * row_bytes, dst + r * row_elems, row_elems);
  }
  return out;
}

std::optional<QuantType> cpu_block_format(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
      return QuantType::kQ4_0;
    case GgmlType::kQ4_1:
      return QuantType::kQ4_1;
    case GgmlType::kQ5_0:
      return QuantType::kQ5_0;
    case GgmlType::kQ5_1:
      return QuantType::kQ5_1;
    case GgmlType::kQ8_0:
      return QuantType::kQ8_0;
    case GgmlType::kQ2_K:
      return QuantType::kQ2_K;
    case GgmlType::kQ3_K:
      return QuantType::kQ3_K;
    case GgmlType::kQ4_K:
      return QuantType::kQ4_K;
    case GgmlType::kQ5_K:
      return QuantType::kQ5_K;
    case GgmlType::kQ6_K:
      return QuantType::kQ6_K;
    case GgmlType::kIQ4_NL:
      return QuantType::kIQ4_NL;
    case GgmlType::kIQ4_XS:
      return QuantType::kIQ4_XS;
    default:
      return std::nullopt;
  }
}

// A matrix's blocks in a format the CPU keeps, rows reordered as dequantize() reorders them.
std::optional<QuantizedMatrix> gguf_tensor_blocks(const GgufTensorInfo& t, int64_t n_heads,
                                                  const std::string& path) {
  const std::optional<QuantType> format = cpu_block_format(t.type);
  if (t.dims.size() < 2 || t.dims.size() > 3 || !format) return {};
  QuantizedMatrix q;
  q.type = *format;
  q.cols = t.dims[0];
  q.rows = q.cols == 0 ? 0 : t.numel() / q.cols;  // ne0 = 0 is a legal, empty tensor
  const size_t row_bytes = t.row_bytes();
  q.blocks.resize(row_bytes * q.rows);
  const int64_t head_rows = head_rows_of(t, n_heads, path);
  for (int64_t r = 0; r < q.rows; ++r) {
    const int64_t src_row = head_rows > 0 ? gguf_row_of_hf_row(r, head_rows) : r;
    std::memcpy(q.blocks.data() + r * row_bytes, t.data + src_row * row_bytes, row_bytes);
  }
  return q;
}

}  // namespace pagedlm
